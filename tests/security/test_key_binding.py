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
from epochal.security.curve import ClientSecurity, ServerSecurity, secure_client
from tests.conftest import hello


async def test_a_frame_from_another_allowed_key_under_a_members_identity_is_dropped(
    net, keydir: KeyDirectory
):
    security = ServerSecurity.from_paths(keydir.coordinator_secret, keydir.allowed)
    coordinator = Coordinator(
        CoordinatorConfig(world_size=2, epochs=1),
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
                message = decode(await asyncio.wait_for(sock.recv(), 5))
                if not isinstance(message, Heartbeat):
                    return message

        alice = client(names[0], b"alice-identity")
        await alice.send(encode(hello("alice")))
        joined = await recv(alice)
        assert isinstance(joined, Joined)
        # bob's key is allowed too; he takes alice's identity and presents her session
        bob = client(names[1], b"alice-identity")
        await asyncio.sleep(0.2)
        await bob.send(encode(Failed(reason="sent by bob"), session=joined.session))
        deadline = time.monotonic() + 5
        while coordinator.forged_frames < 1:
            assert time.monotonic() < deadline, "bob's frame was not dropped"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        members = coordinator.machine.rendezvous.members.values()
        assert "alice" in {m.hello.worker_id for m in members}
        # a hello from bob under alice's identity is not admitted as her either, though it is
        # byte for byte hers, known without decoding as her retry: it is judged all the same
        await bob.send(encode(hello("alice")))
        await asyncio.sleep(0.2)
        assert coordinator.forged_frames >= 2
        assert not task.done()
    finally:
        coordinator.abort("test over")
        with pytest.raises(RunAborted):
            await asyncio.wait_for(task, 5)
