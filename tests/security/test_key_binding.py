"""Under CURVE, an admitted worker's frames must come from the key its hello came with.

Two workers hold allow-listed keys. One of them takes the other's routing identity and even
presents the other's session secret: its frames are still dropped, because the ZAP user id (its
own public key) is not the one the identity was admitted with.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from epochal.coordinator import Coordinator, CoordinatorConfig
from epochal.errors import RunAborted
from epochal.protocol import Failed, Heartbeat, Joined, decode, encode
from epochal.security import KeyDirectory
from epochal.security.curvekeys import ClientSecurity, ServerSecurity, secure_client
from tests.conftest import hello

CONFIG = CoordinatorConfig(world_size=2, epochs=1)
WAIT = CONFIG.heartbeat_timeout
"""Seconds any one answer or drop may take: a coordinator silent for longer would abort the run."""


async def test_a_frame_from_another_allowed_key_under_a_members_identity_is_dropped(
    net, keydir: KeyDirectory
):
    security = ServerSecurity.from_paths(keydir.coordinator_secret, keydir.allowed)
    coordinator = Coordinator(
        CONFIG,
        context=None,
        log=lambda line: None,
        security=security,
    )
    endpoint = await coordinator.start()
    task = asyncio.create_task(coordinator.run())
    try:
        names = sorted(keydir.worker_secrets)

        def client(name: str, identity: bytes) -> zmq.asyncio.Socket:
            sock = net.socket(zmq.DEALER, IDENTITY=identity)
            secure_client(
                sock,
                ClientSecurity.from_paths(keydir.worker_secrets[name], keydir.coordinator_public),
            )
            sock.connect(endpoint)
            return sock

        async def recv(sock: zmq.asyncio.Socket):
            while True:
                message = decode(await asyncio.wait_for(sock.recv(), WAIT))
                if not isinstance(message, Heartbeat):
                    return message

        async def dropped(count: int, what: str) -> None:
            """Until the coordinator has dropped ``count`` forged frames in all."""
            deadline = time.monotonic() + WAIT
            while coordinator.forged_frames < count:
                assert time.monotonic() < deadline, f"{what} was not dropped"
                await asyncio.sleep(0.01)

        alice = client(names[0], b"alice-identity")
        await alice.send(encode(hello("alice")))
        joined = await recv(alice)
        assert isinstance(joined, Joined)
        # bob's key is allowed too; he takes alice's identity and presents her session
        # (a DEALER queues what it sends until its handshake is done: the frame can only reach
        # the coordinator over bob's own connection, which has taken the identity over)
        bob = client(names[1], b"alice-identity")
        await bob.send(encode(Failed(reason="sent by bob"), session=joined.session))
        await dropped(1, "bob's frame")
        members = coordinator.machine.rendezvous.members.values()
        assert "alice" in {m.hello.worker_id for m in members}
        # a hello from bob under alice's identity is not admitted as her either, though it is
        # byte for byte hers, known without decoding as her retry: it is judged all the same
        await bob.send(encode(hello("alice")))
        await dropped(2, "bob's hello as alice")
        members = coordinator.machine.rendezvous.members.values()
        assert [m.hello.worker_id for m in members] == ["alice"]
        assert not task.done()
    finally:
        coordinator.abort("test over")
        with pytest.raises(RunAborted):
            await asyncio.wait_for(task, 5)
