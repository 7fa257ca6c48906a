"""The rendezvous state machine: who gets in, who is refused, when the run must stop, which rank."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest

import tests.conftest
from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.rules.rendezvous import (
    Admitted,
    Differs,
    Fatal,
    Refused,
    Rendezvous,
)
from epochal.protocol import Fingerprint

MODEL = Fingerprint(digest="model-a", torch_version="2.4.0", entries=2)


hello = partial(tests.conftest.hello, fingerprint=MODEL, host="node1", pid=100)


def rendezvous(world_size: int = 2, **config: object) -> Rendezvous:
    return Rendezvous(CoordinatorConfig(world_size=world_size, **config))  # type: ignore[arg-type]


def other_model(**changes: object) -> Fingerprint:
    return dataclasses.replace(MODEL, digest="model-b", **changes)  # type: ignore[arg-type]


def refused(verdict: object) -> str:
    assert isinstance(verdict, Refused), verdict
    return verdict.reason


def fatal(verdict: object) -> str:
    assert isinstance(verdict, Fatal), verdict
    return verdict.reason


# ----------------------------------------------------------------------------- admission


def test_workers_are_admitted_until_the_world_is_complete():
    rv = rendezvous(world_size=3)
    assert not rv.complete
    assert rv.offer(b"a", hello("w0")) == Admitted(again=False)
    assert rv.offer(b"b", hello("w1")) == Admitted(again=False)
    assert not rv.complete
    assert rv.offer(b"c", hello("w2")) == Admitted(again=False)
    assert rv.complete
    assert list(rv.members) == [b"a", b"b", b"c"]
    assert rv.members[b"b"].hello.worker_id == "w1"


def test_a_retried_hello_from_the_same_peer_is_admitted_again():
    rv = rendezvous(world_size=2)
    assert rv.offer(b"a", hello("w0")) == Admitted(again=False)
    assert rv.offer(b"a", hello("w0")) == Admitted(again=True)
    assert len(rv.members) == 1
    assert not rv.complete


def test_a_retried_hello_after_completion_is_still_admitted_again_not_surplus():
    rv = rendezvous(world_size=1)
    rv.offer(b"a", hello("w0"))
    assert rv.complete
    assert rv.offer(b"a", hello("w0")) == Admitted(again=True)


def test_a_peer_that_joined_cannot_join_again_as_another_worker():
    rv = rendezvous(world_size=3)
    rv.offer(b"a", hello("w0"))
    assert "already joined as worker w0" in refused(rv.offer(b"a", hello("w1")))
    assert list(rv.members) == [b"a"]


def test_a_wrong_job_is_refused_naming_both_jobs():
    rv = rendezvous(job="alpha")
    reason = refused(rv.offer(b"a", hello(job="beta")))
    assert "job 'alpha'" in reason and "job 'beta'" in reason
    assert "--job" in reason
    assert rv.members == {}


@pytest.mark.parametrize("token", ["", "wrong", "s3cret ", "S3cret"])
def test_a_wrong_or_missing_token_is_refused(token: str):
    rv = rendezvous(token="s3cret")
    reason = refused(rv.offer(b"a", hello(token=token)))
    assert "wrong or missing job token" in reason
    assert "s3cret" not in reason  # never echo the secret
    assert rv.members == {}


def test_the_right_token_is_admitted():
    rv = rendezvous(token="s3cr\u00e9t")
    assert rv.offer(b"a", hello(token="s3cr\u00e9t")) == Admitted(again=False)


@pytest.mark.parametrize("token", ["", "wrong"])
def test_a_member_proves_the_token_again_with_every_hello(token: str):
    rv = rendezvous(token="s3cret")
    assert rv.offer(b"a", hello("w0", token="s3cret")) == Admitted(again=False)
    # the same connection, the same worker id, but not the token: refused, still a member
    assert "wrong or missing job token" in refused(rv.offer(b"a", hello("w0", token=token)))
    assert rv.offer(b"a", hello("w0", token="s3cret")) == Admitted(again=True)
    assert list(rv.members) == [b"a"]


def test_any_token_is_admitted_when_none_is_required():
    rv = rendezvous(world_size=2, token="")
    assert rv.offer(b"a", hello("w0", token="whatever")) == Admitted(again=False)
    assert rv.offer(b"b", hello("w1")) == Admitted(again=False)


def test_a_surplus_worker_is_refused_and_the_run_goes_on():
    rv = rendezvous(world_size=2)
    rv.offer(b"a", hello("w0"))
    rv.offer(b"b", hello("w1"))
    reason = refused(rv.offer(b"c", hello("w2")))
    assert "already has its 2 workers" in reason and "surplus" in reason
    assert list(rv.members) == [b"a", b"b"]
    assert rv.complete


def test_a_duplicate_worker_id_from_another_peer_is_refused():
    rv = rendezvous(world_size=3)
    rv.offer(b"a", hello("w0"))
    reason = refused(rv.offer(b"b", hello("w0")))
    assert "id 'w0' has already joined" in reason
    assert "EPOCHAL_WORKER_ID" in reason
    assert list(rv.members) == [b"a"]


def test_a_rank_hint_at_or_over_the_world_size_is_refused():
    rv = rendezvous(world_size=2)
    reason = refused(rv.offer(b"a", hello(rank_hint=2)))
    assert "asks for rank 2 but the world size is 2" in reason
    assert "ranks run 0..1" in reason
    assert rv.members == {}


def test_a_rank_hint_clash_is_refused_naming_the_holder():
    rv = rendezvous(world_size=3)
    rv.offer(b"a", hello("w0", rank_hint=1, host="node7", pid=77))
    reason = refused(rv.offer(b"b", hello("w1", rank_hint=1)))
    assert "rank 1 is already taken by worker w0 (host node7, pid 77)" in reason
    assert "EPOCHAL_RANK" in reason
    # the clashing worker is not in; another hint still is free
    assert list(rv.members) == [b"a"]
    assert rv.offer(b"b", hello("w1", rank_hint=0)) == Admitted(again=False)


def test_a_refused_worker_can_join_once_fixed():
    rv = rendezvous(world_size=2, job="alpha")
    refused(rv.offer(b"a", hello("w0", job="beta")))
    assert rv.offer(b"a", hello("w0", job="alpha")) == Admitted(again=False)


# ----------------------------------------------------------------------------- fingerprints


def differs(verdict: object) -> bytes:
    """The reference peer a Differs verdict names."""
    assert isinstance(verdict, Differs), verdict
    return verdict.reference.peer


def test_a_model_with_another_digest_is_not_admitted_and_names_the_reference():
    """The entries are not in the hello: the verdict names the member whose list is compared
    with the newcomer's (see test_models.py for the naming)."""
    rv = rendezvous(world_size=2)
    rv.offer(b"a", hello("w0", host="h0", pid=1))
    assert differs(rv.offer(b"b", hello("w1", fingerprint=other_model(entries=1)))) == b"a"
    assert list(rv.members) == [b"a"]
    assert not rv.complete


def test_a_different_torch_version_is_fatal_naming_both():
    rv = rendezvous(world_size=2)
    rv.offer(b"a", hello("w0"))
    reason = fatal(rv.offer(b"b", hello("w1", fingerprint=other_model(torch_version="2.5.1"))))
    assert reason.startswith("the workers' models differ: ")
    assert "has torch 2.4.0" in reason and "has torch 2.5.1" in reason
    assert "same model with the same torch version" in reason


def test_the_same_digest_is_admitted_without_comparing_entries():
    rv = rendezvous(world_size=2)
    rv.offer(b"a", hello("w0"))
    assert rv.offer(b"b", hello("w1", fingerprint=MODEL)) == Admitted(again=False)


def test_a_different_model_from_a_worker_that_would_be_refused_anyway_is_not_fatal():
    # a stranger (wrong job) must not be able to stop the run
    rv = rendezvous(world_size=2)
    rv.offer(b"a", hello("w0"))
    assert isinstance(rv.offer(b"b", hello("w1", job="other", fingerprint=other_model())), Refused)


# ----------------------------------------------------------------------------- leave


def test_leave_frees_the_slot_the_id_and_the_rank_hint():
    rv = rendezvous(world_size=2)
    rv.offer(b"a", hello("w0", rank_hint=0))
    rv.offer(b"b", hello("w1"))
    assert rv.complete
    rv.leave(b"a")
    assert not rv.complete
    assert list(rv.members) == [b"b"]
    # the same worker id and rank hint may come back, from a new connection
    assert rv.offer(b"c", hello("w0", rank_hint=0)) == Admitted(again=False)
    assert rv.complete


def test_leave_of_an_unknown_peer_changes_nothing():
    rv = rendezvous(world_size=2)
    rv.offer(b"a", hello("w0"))
    rv.leave(b"zz")
    assert list(rv.members) == [b"a"]


def test_after_everyone_leaves_a_new_model_is_the_reference():
    rv = rendezvous(world_size=2)
    rv.offer(b"a", hello("w0"))
    rv.leave(b"a")
    assert rv.offer(b"b", hello("w1", fingerprint=other_model())) == Admitted(again=False)
    assert differs(rv.offer(b"c", hello("w2"))) == b"b"


def test_when_the_reference_leaves_the_next_member_is_compared_against():
    rv = rendezvous(world_size=3)
    rv.offer(b"a", hello("w0", host="h0"))
    rv.offer(b"b", hello("w1", host="h1"))
    rv.leave(b"a")
    assert differs(rv.offer(b"c", hello("w2", fingerprint=other_model()))) == b"b"
    assert rv.reference is not None and rv.reference.hello.worker_id == "w1"


# ----------------------------------------------------------------------------- assign


def test_ranks_follow_arrival_order_without_hints():
    rv = rendezvous(world_size=3)
    for peer, wid in [(b"z", "w0"), (b"a", "w1"), (b"m", "w2")]:
        rv.offer(peer, hello(wid))
    ranks, _ = rv.assign()
    assert ranks == {b"z": 0, b"a": 1, b"m": 2}


def test_rank_hints_are_honoured_and_the_rest_fill_free_ranks_in_arrival_order():
    rv = rendezvous(world_size=5)
    rv.offer(b"p", hello("w0"))
    rv.offer(b"q", hello("w1", rank_hint=0))
    rv.offer(b"r", hello("w2"))
    rv.offer(b"s", hello("w3", rank_hint=3))
    rv.offer(b"t", hello("w4"))
    ranks, _ = rv.assign()
    assert ranks == {b"q": 0, b"s": 3, b"p": 1, b"r": 2, b"t": 4}
    assert sorted(ranks.values()) == list(range(5))


def test_a_hint_freed_by_leave_goes_to_the_next_hintless_worker():
    rv = rendezvous(world_size=2)
    rv.offer(b"a", hello("w0", rank_hint=0))
    rv.leave(b"a")
    rv.offer(b"b", hello("w1"))
    rv.offer(b"c", hello("w2", rank_hint=1))
    ranks, _ = rv.assign()
    assert ranks == {b"b": 0, b"c": 1}


@pytest.mark.parametrize(
    ("devices", "backend"),
    [
        (["cuda", "cuda"], "nccl"),
        (["cuda", "cpu"], "gloo"),
        (["cpu", "cuda"], "gloo"),
        (["cpu", "cpu"], "gloo"),
    ],
)
def test_auto_backend_is_nccl_only_when_every_worker_has_cuda(devices: list[str], backend: str):
    rv = rendezvous(world_size=2)
    for i, device in enumerate(devices):
        rv.offer(bytes([i]), hello(f"w{i}", device=device))
    assert rv.assign()[1] == backend


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_an_explicit_backend_is_used_as_given(backend: str):
    rv = rendezvous(world_size=1, backend=backend)
    rv.offer(b"a", hello("w0", device="cuda" if backend == "gloo" else "cpu"))
    assert rv.assign()[1] == backend


# ----------------------------------------------------------------------------- --monitor


def test_a_monitor_the_worker_says_it_does_not_report_is_fatal_at_its_hello():
    r = rendezvous(monitor="acc", monitor_mode="max")
    reason = fatal(r.offer(b"p0", hello(metrics=("accuracy", "f1"))))
    assert reason == (
        "--monitor acc: the workers report no metric of that name (they report loss, accuracy, "
        "f1): did you mean --monitor accuracy? Else add 'acc' to the training code's metrics"
    )
    assert r.members == {}  # nobody admitted: the run stops before anyone trains
    reason = fatal(r.offer(b"p1", hello("w1", metrics=())))  # a worker that reports none
    assert "(they report loss): monitor one of those, or add 'acc'" in reason


def test_a_monitor_is_checked_only_against_names_a_worker_said():
    r = rendezvous(monitor="accuracy", monitor_mode="max")
    assert isinstance(r.offer(b"p0", hello(metrics=("accuracy",))), Admitted)
    # a custom loop that did not say its metrics: checked at the first report instead
    assert isinstance(r.offer(b"p1", hello("w1")), Admitted)
    # the loss is always reported: nothing to check
    assert isinstance(rendezvous().offer(b"p0", hello(metrics=())), Admitted)
