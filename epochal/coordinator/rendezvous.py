"""Who is in the run: the rendezvous as a pure state machine.

:class:`Rendezvous` takes each hello with the peer it came from and says what to do with it:
admit it (again, for a retried hello), refuse just that worker (wrong job or token, duplicate,
surplus, rank clash), or abort the whole run (a model that differs between workers: nobody can
tell which side is wrong). When ``world_size`` workers are in, :meth:`Rendezvous.assign` gives
ranks and picks the data-plane backend.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from epochal.coordinator.config import CoordinatorConfig
from epochal.protocol import Fingerprint, Hello


@dataclass(frozen=True, slots=True)
class Admitted:
    """The worker is in (or was already in: a retried hello)."""

    again: bool


@dataclass(frozen=True, slots=True)
class Refused:
    """This worker may not join; tell it why. The run goes on."""

    reason: str


@dataclass(frozen=True, slots=True)
class Fatal:
    """The run cannot go on: tell every worker why."""

    reason: str


Verdict = Admitted | Refused | Fatal


@dataclass(frozen=True, slots=True)
class Member:
    """One admitted worker."""

    peer: bytes
    hello: Hello

    def describe(self) -> str:
        h = self.hello
        at = f" at {h.data_address}" if h.data_address else ""
        return f"worker {h.worker_id} (host {h.host}{at}, pid {h.pid})"


def describe_difference(a: Fingerprint, b: Fingerprint, a_name: str, b_name: str) -> str:
    """Name the first thing that differs between two model fingerprints, torch version included."""
    if a.torch_version != b.torch_version:
        return f"{a_name} has torch {a.torch_version}, {b_name} has torch {b.torch_version}"
    in_a = {p.name: p for p in a.params}
    in_b = {p.name: p for p in b.params}
    for name, p in in_a.items():
        q = in_b.get(name)
        if q is None:
            return f"parameter {name!r} exists in {a_name} but not in {b_name}"
        if q.shape != p.shape:
            return (
                f"parameter {name!r} has shape {tuple(p.shape)} in {a_name} and "
                f"{tuple(q.shape)} in {b_name}"
            )
        if q.dtype != p.dtype:
            return f"parameter {name!r} has dtype {p.dtype} in {a_name} and {q.dtype} in {b_name}"
    for name in in_b:
        if name not in in_a:
            return f"parameter {name!r} exists in {b_name} but not in {a_name}"
    if [p.name for p in a.params] != [p.name for p in b.params]:
        return f"the parameters are registered in a different order in {a_name} and {b_name}"
    return "the fingerprints' digests differ"


class Rendezvous:
    """Collects hellos until ``world_size`` distinct workers are in. O(1) work per hello."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.members: dict[bytes, Member] = {}
        self._by_worker_id: dict[str, bytes] = {}
        self._by_rank_hint: dict[int, bytes] = {}
        self._reference: Member | None = None

    @property
    def complete(self) -> bool:
        return len(self.members) == self.config.world_size

    def offer(self, peer: bytes, hello: Hello) -> Verdict:
        """Judge one hello from ``peer`` (the routing identity it came from)."""
        cfg = self.config
        known = self.members.get(peer)
        if known is not None:
            if known.hello.worker_id == hello.worker_id:
                return Admitted(again=True)
            return Refused(f"connection already joined as worker {known.hello.worker_id}")
        if hello.job != cfg.job:
            return Refused(
                f"this coordinator runs job {cfg.job!r}, the worker asked for job {hello.job!r}: "
                "point the worker at its own coordinator or set the same job name"
                " (--job / EPOCHAL_JOB)"
            )
        if cfg.token and not hmac.compare_digest(hello.token.encode(), cfg.token.encode()):
            return Refused(
                "wrong or missing job token: give the worker the coordinator's token "
                "(EPOCHAL_TOKEN)"
            )
        if self.complete:
            return Refused(
                f"the run already has its {cfg.world_size} workers: this worker is surplus; "
                "start exactly --world-size workers"
            )
        if hello.worker_id in self._by_worker_id:
            return Refused(
                f"a worker with id {hello.worker_id!r} has already joined: give every worker a "
                "distinct id (EPOCHAL_WORKER_ID), or stop the duplicate process"
            )
        hint = hello.rank_hint
        if hint is not None:
            if hint >= cfg.world_size:
                return Refused(
                    f"the worker asks for rank {hint} but the world size is {cfg.world_size}: "
                    f"ranks run 0..{cfg.world_size - 1}"
                )
            if hint in self._by_rank_hint:
                holder = self.members[self._by_rank_hint[hint]]
                return Refused(
                    f"rank {hint} is already taken by {holder.describe()}: give each worker a "
                    "distinct EPOCHAL_RANK, or none"
                )
        member = Member(peer=peer, hello=hello)
        ref = self._reference
        if ref is not None and ref.hello.fingerprint.digest != hello.fingerprint.digest:
            diff = describe_difference(
                ref.hello.fingerprint, hello.fingerprint, ref.describe(), member.describe()
            )
            return Fatal(
                f"the workers' models differ: {diff}; every worker must build the same model "
                "with the same torch version"
            )
        if ref is None:
            self._reference = member
        self.members[peer] = member
        self._by_worker_id[hello.worker_id] = peer
        if hint is not None:
            self._by_rank_hint[hint] = peer
        return Admitted(again=False)

    def leave(self, peer: bytes) -> None:
        """Forget a worker that left before the rendezvous completed (it stopped heartbeating)."""
        member = self.members.pop(peer, None)
        if member is None:
            return
        self._by_worker_id.pop(member.hello.worker_id, None)
        if member.hello.rank_hint is not None:
            self._by_rank_hint.pop(member.hello.rank_hint, None)
        if self._reference is member:
            self._reference = next(iter(self.members.values()), None)

    def assign(self) -> tuple[dict[bytes, int], str]:
        """Ranks for every member (hints honoured, the rest in order of arrival) and the backend."""
        ranks: dict[bytes, int] = {}
        free = iter(r for r in range(self.config.world_size) if r not in self._by_rank_hint)
        for peer, member in self.members.items():
            hint = member.hello.rank_hint
            ranks[peer] = hint if hint is not None else next(free)
        backend = self.config.backend
        if backend == "auto":
            all_cuda = all(m.hello.device == "cuda" for m in self.members.values())
            backend = "nccl" if all_cuda else "gloo"
        return ranks, backend
