"""Naming how two models differ, from parameter lists fetched a page at a time.

A hello carries only its model's :class:`~epochal.protocol.Fingerprint`: a digest, the torch
version and the number of entries, a few dozen bytes whoever sends it. Equal digests are the same
model. When two differ (two workers, or the workers and the run directory's ``model.json``), or
when the run directory must record the model, the coordinator needs the entries themselves:
:class:`Inquiry` asks the peers concerned for them, one
:class:`~epochal.protocol.DescribeModel` page at a time, and collects the
:class:`~epochal.protocol.ModelPage` answers until every list is whole or its deadline passes.
Only peers whose hello showed the job's token are asked, and a page nobody asked for is dropped.
:func:`describe_difference` then names the first entry that differs; past the deadline,
:func:`describe_fingerprints` names the digests. :class:`ModelChecks` runs the two checks of a
rendezvous (between workers, and against the run directory) on top of it and says how each ended
(:class:`Differ`, :class:`Checked`). The clock is an argument.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from epochal.coordinator.rules.actions import Action, Send
from epochal.protocol import DescribeModel, Fingerprint, ModelPage, ParamSpec
from epochal.text import printable

LIST_TIMEOUT = 10.0
"""Seconds the coordinator waits for the parameter lists it asked for; past them, it names the
digests instead of the first entry that differs."""


def describe_difference(
    a: Sequence[ParamSpec], b: Sequence[ParamSpec], a_name: str, b_name: str
) -> str:
    """Name the first entry that differs between two models' lists of parameters and buffers."""
    in_a = {p.name: p for p in a}
    in_b = {p.name: p for p in b}
    for name, p in in_a.items():
        q = in_b.get(name)
        shown = printable(name)
        if q is None:
            return f"parameter '{shown}' exists in {a_name} but not in {b_name}"
        if q.shape != p.shape:
            return (
                f"parameter '{shown}' has shape {tuple(p.shape)} in {a_name} and "
                f"{tuple(q.shape)} in {b_name}"
            )
        if q.dtype != p.dtype:
            return (
                f"parameter '{shown}' has dtype {printable(p.dtype)} in {a_name} and "
                f"{printable(q.dtype)} in {b_name}"
            )
    for name in in_b:
        if name not in in_a:
            return f"parameter '{printable(name)}' exists in {b_name} but not in {a_name}"
    if [p.name for p in a] != [p.name for p in b]:
        return f"the parameters are registered in a different order in {a_name} and {b_name}"
    return "the fingerprints' digests differ"


def describe_fingerprints(a: Fingerprint, b: Fingerprint, a_name: str, b_name: str) -> str:
    """Name what two fingerprints alone say differs: the torch version, else the digests."""
    if a.torch_version != b.torch_version:
        return (
            f"{a_name} has torch {printable(a.torch_version)}, "
            f"{b_name} has torch {printable(b.torch_version)}"
        )
    return (
        f"{a_name}'s model has digest {a.digest[:16]} ({a.entries} parameters and buffers), "
        f"{b_name}'s has digest {b.digest[:16]} ({b.entries})"
    )


@dataclass(slots=True)
class _Listing:
    """One asked peer's list as it arrives."""

    fingerprint: Fingerprint
    # the fingerprint its hello carried: the list must have as many entries
    user_id: str | None
    # the ZAP user id its hello came with; None: a member, whose session the gate checks
    params: list[ParamSpec] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        return len(self.params) == self.fingerprint.entries


class Inquiry:
    """The parameter lists asked of a few peers, page by page, under one deadline."""

    def __init__(
        self,
        now: float,
        asked: Mapping[bytes, tuple[Fingerprint, str | None]],
        timeout: float = LIST_TIMEOUT,
    ) -> None:
        """``asked``: each peer with the fingerprint its hello carried and the ZAP user id its
        pages must come from (None: a member, whose session the gate checks)."""
        self.deadline = now + timeout
        self.timeout = timeout
        self._lists = {peer: _Listing(fp, user_id) for peer, (fp, user_id) in asked.items()}

    def start(self) -> list[Action]:
        """The first requests: page 0 of every list that has entries."""
        return [
            Send(peer, DescribeModel(first=0))
            for peer, listing in self._lists.items()
            if not listing.whole
        ]

    def asks(self, peer: bytes) -> bool:
        """Whether a page from ``peer`` is awaited (it passes the strangers' budget)."""
        listing = self._lists.get(peer)
        return listing is not None and not listing.whole

    def on_page(self, peer: bytes, page: ModelPage, user_id: str) -> tuple[bool, list[Action]]:
        """Take ``page`` from ``peer``: whether it was the page awaited, and the next request."""
        listing = self._lists.get(peer)
        if (
            listing is None
            or listing.whole
            or (listing.user_id is not None and user_id != listing.user_id)
            or page.first != len(listing.params)
            or page.entries != listing.fingerprint.entries
            or not page.params
        ):
            return False, []
        listing.params.extend(page.params)
        if listing.whole:
            return True, []
        return True, [Send(peer, DescribeModel(first=len(listing.params)))]

    @property
    def complete(self) -> bool:
        """Every list asked for is whole."""
        return all(listing.whole for listing in self._lists.values())

    def expired(self, now: float) -> bool:
        """The deadline passed with a list still missing."""
        return now >= self.deadline and not self.complete

    def params(self, peer: bytes) -> tuple[ParamSpec, ...] | None:
        """``peer``'s whole list; None while (or because) it is not whole."""
        listing = self._lists.get(peer)
        if listing is None or not listing.whole:
            return None
        return tuple(listing.params)


class ModelRecord(Protocol):
    """The run directory's record of its model (:class:`~.ModelFile`)."""

    def needs_list(self, fingerprint: Fingerprint) -> bool:
        """Whether a worker's parameter list is needed to record or compare the model."""
        ...

    def check(
        self, fingerprint: Fingerprint, params: Sequence[ParamSpec] | None = None
    ) -> str | None:
        """Record the model, or say how it differs from the one recorded."""
        ...


@dataclass(frozen=True, slots=True)
class Differ:
    """Two workers' models differ: the run aborts with ``difference`` (what differs, named as
    well as the lists that came allow), and ``peer``, the worker that is not a member, hears it
    too."""

    difference: str
    peer: bytes


@dataclass(frozen=True, slots=True)
class Checked:
    """The run directory's model is checked (or recorded): ``problem`` aborts the run; ``note``
    is to be logged."""

    problem: str | None
    note: str | None = None


Outcome = Differ | Checked


class ModelChecks:
    """The model checks of a rendezvous, one at a time: between two workers whose digests differ,
    and between the workers and the run directory's record once every worker is in."""

    def __init__(self, record: ModelRecord | None, timeout: float = LIST_TIMEOUT) -> None:
        self.record = record
        self.timeout = timeout
        self._inquiry: Inquiry | None = None
        self._outcome: Callable[[], Outcome] | None = None
        # what the lists asked for decide once they are in or late

    @property
    def busy(self) -> bool:
        """Lists are being fetched: the rendezvous may not move on."""
        return self._inquiry is not None

    def asks(self, peer: bytes) -> bool:
        """Whether a page from ``peer`` is awaited."""
        return self._inquiry is not None and self._inquiry.asks(peer)

    def differ(
        self,
        now: float,
        reference: tuple[bytes, Fingerprint, str],
        other: tuple[bytes, Fingerprint, str],
        user_id: str,
    ) -> tuple[list[Action], Outcome | None]:
        """Two models differ: ``reference`` (a member) and ``other`` (not one, its hello from
        ``user_id``), each a peer, its fingerprint and its description. Asks both for their lists;
        nothing when a check is under way already (the run ends with that one)."""
        if self._inquiry is not None:
            return [], None
        (ref_peer, ref_fp, ref_name), (peer, fp, name) = reference, other
        inquiry = Inquiry(now, {ref_peer: (ref_fp, None), peer: (fp, user_id)}, self.timeout)

        def named() -> Outcome:
            a, b = inquiry.params(ref_peer), inquiry.params(peer)
            if a is not None and b is not None:
                return Differ(describe_difference(a, b, ref_name, name), peer)
            late = f" (their parameter lists did not come within {self.timeout:g} s)"
            return Differ(describe_fingerprints(ref_fp, fp, ref_name, name) + late, peer)

        return self._ask(inquiry, named)

    def complete(
        self, now: float, reference: tuple[bytes, Fingerprint, str]
    ) -> tuple[list[Action], Outcome | None]:
        """Every worker is in: compare with (or write) the run directory's record, asking
        ``reference`` (rank 0: peer, fingerprint, description) for its list when the record
        needs it. ``Checked(None)`` at once when there is no record."""
        if self._inquiry is not None:
            return [], None
        record = self.record
        peer, fingerprint, name = reference
        if record is None:
            return [], Checked(None)
        if not record.needs_list(fingerprint):
            return [], Checked(record.check(fingerprint))
        inquiry = Inquiry(now, {peer: (fingerprint, None)}, self.timeout)

        def recorded() -> Outcome:
            params = inquiry.params(peer)
            if params is not None:
                return Checked(record.check(fingerprint, params))
            note = (
                f"{name} sent no parameter list within {self.timeout:g} s: the run directory "
                "records its model's digest only"
            )
            return Checked(record.check(fingerprint), note)

        return self._ask(inquiry, recorded)

    def on_page(
        self, peer: bytes, page: ModelPage, user_id: str
    ) -> tuple[bool, list[Action], Outcome | None]:
        """A page arrived: whether it was awaited, the next request, and the outcome once every
        list is in."""
        inquiry = self._inquiry
        if inquiry is None:
            return False, [], None
        taken, actions = inquiry.on_page(peer, page, user_id)
        if taken and inquiry.complete:
            return True, actions, self._settle()
        return taken, actions, None

    def expired(self, now: float) -> Outcome | None:
        """The outcome at ``now`` when the lists' deadline has passed; else None."""
        if self._inquiry is None or not self._inquiry.expired(now):
            return None
        return self._settle()

    def _ask(
        self, inquiry: Inquiry, outcome: Callable[[], Outcome]
    ) -> tuple[list[Action], Outcome | None]:
        self._inquiry, self._outcome = inquiry, outcome
        if inquiry.complete:  # nothing to fetch: a model without parameters
            return [], self._settle()
        return inquiry.start(), None

    def _settle(self) -> Outcome:
        outcome = self._outcome
        assert outcome is not None
        self._inquiry = self._outcome = None
        return outcome()
