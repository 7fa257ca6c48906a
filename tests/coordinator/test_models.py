"""Models that differ are named from parameter lists fetched a page at a time, on a given clock.

A hello carries its model's digest only. When two workers' digests differ, the coordinator asks
both for their entries (DescribeModel, answered by ModelPage) and aborts naming the first that
differs; when the lists do not come within LIST_TIMEOUT it names the digests. Once every worker
is in, the run directory's model.json is checked (or written) the same way, so a resume with
another model is refused naming its parameter.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest

import tests.conftest
from epochal.coordinator import CoordinatorConfig
from epochal.coordinator.rules.actions import Action, Log, Send
from epochal.coordinator.rules.machine import RunMachine
from epochal.coordinator.rules.models import (
    LIST_TIMEOUT,
    describe_difference,
    describe_fingerprints,
)
from epochal.coordinator.serve import resume
from epochal.coordinator.serve.modelfile import ModelFile
from epochal.protocol import (
    Abort,
    DescribeModel,
    Fingerprint,
    Joined,
    OpenStore,
    ParamSpec,
    StoreReady,
    Welcome,
)
from epochal.protocol.paging import model_page
from tests.coordinator.test_machine import aborted

WEIGHT = ParamSpec(name="weight", shape=(2, 5), dtype="torch.float32")
BIAS = ParamSpec(name="bias", shape=(2,), dtype="torch.float32")
MODEL = (WEIGHT, BIAS)
FP = Fingerprint(digest="model-a", torch_version="2.4.0", entries=2)

# ----------------------------------------------------------------------------- naming


def test_a_different_shape_is_named_with_both_sides():
    other = (ParamSpec("weight", (1, 5), "torch.float32"), BIAS)
    assert describe_difference(MODEL, other, "A", "B") == (
        "parameter 'weight' has shape (2, 5) in A and (1, 5) in B"
    )


def test_a_different_dtype_is_named():
    other = (WEIGHT, ParamSpec("bias", (2,), "torch.float64"))
    assert describe_difference(MODEL, other, "A", "B") == (
        "parameter 'bias' has dtype torch.float32 in A and torch.float64 in B"
    )


def test_a_missing_and_an_extra_parameter_are_named():
    assert describe_difference(MODEL, (WEIGHT,), "A", "B") == (
        "parameter 'bias' exists in A but not in B"
    )
    extra = ParamSpec("scale", (1,), "torch.float32")
    assert describe_difference(MODEL, (*MODEL, extra), "A", "B") == (
        "parameter 'scale' exists in B but not in A"
    )


def test_a_different_registration_order_is_named():
    assert describe_difference(MODEL, (BIAS, WEIGHT), "A", "B") == (
        "the parameters are registered in a different order in A and B"
    )


def test_identical_entries_with_other_digests_say_so():
    assert describe_difference(MODEL, MODEL, "A", "B") == "the fingerprints' digests differ"


def test_fingerprints_alone_name_the_torch_version_else_the_digests():
    other = Fingerprint(digest="model-b", torch_version="2.5.1", entries=3)
    assert describe_fingerprints(FP, other, "A", "B") == "A has torch 2.4.0, B has torch 2.5.1"
    other = Fingerprint(digest="model-b", torch_version="2.4.0", entries=3)
    assert describe_fingerprints(FP, other, "A", "B") == (
        "A's model has digest model-a (2 parameters and buffers), B's has digest model-b (3)"
    )


# ----------------------------------------------------------------------------- the machine


hello = partial(tests.conftest.hello, fingerprint=FP, host="host")


def machine(world_size: int = 2, record: Any = None) -> RunMachine:
    config = CoordinatorConfig(world_size=world_size, epochs=2)
    return RunMachine(
        config, resume.inspect(config, None), run_id="r1", now=0.0, model_record=record
    )


def asked(actions: list[Action]) -> dict[bytes, int]:
    """The pages asked for: peer -> first entry."""
    return {
        a.peer: a.message.first
        for a in actions
        if isinstance(a, Send) and isinstance(a.message, DescribeModel)
    }


def answer(
    m: RunMachine, now: float, peer: bytes, params: tuple[ParamSpec, ...], session: str = ""
) -> list[Action]:
    """``peer`` answers every page it is asked for, as a worker's client does."""
    actions: list[Action] = []
    first: int | None = 0
    while first is not None:
        out = m.on_message(now, peer, model_page(params, first), session=session)
        actions += out
        first = asked(out).get(peer)
    return actions


def session_of(actions: list[Action], peer: bytes) -> str:
    return next(
        a.message.session
        for a in actions
        if isinstance(a, Send) and a.peer == peer and isinstance(a.message, Joined)
    )


def test_two_models_that_differ_are_named_from_both_lists_before_the_abort():
    m = machine(world_size=3)
    a_session = session_of(m.on_message(0.0, b"a", hello("w0")), b"a")
    other = Fingerprint(digest="model-b", torch_version="2.4.0", entries=2)
    actions = m.on_message(1.0, b"b", hello("w1", fingerprint=other))
    assert asked(actions) == {b"a": 0, b"b": 0}
    assert aborted(actions) is None and not m.over
    changed = (ParamSpec("weight", (1, 5), "torch.float32"), BIAS)
    assert answer(m, 1.5, b"a", MODEL, a_session) == []  # one list in: wait for the other
    actions = answer(m, 2.0, b"b", changed)
    reason = aborted(actions)
    assert reason is not None and reason.startswith("the workers' models differ: ")
    assert (
        "parameter 'weight' has shape (2, 5) in worker w0 (host host, pid 1) and (1, 5) in "
        "worker w1 (host host, pid 1)"
    ) in reason
    # the newcomer is no member, and hears the abort too
    assert any(
        isinstance(a, Send) and a.peer == b"b" and isinstance(a.message, Abort) for a in actions
    )
    assert list(m.rendezvous.members) == [b"a"]


def test_a_long_list_is_fetched_page_after_page():
    params = tuple(ParamSpec(f"layers.{i}.weight", (512, 512), "float32") for i in range(3000))
    changed = (*params[:-1], ParamSpec("layers.2999.weight", (512, 256), "float32"))
    fp = Fingerprint(digest="big-a", torch_version="x", entries=len(params))
    m = machine()
    a_session = session_of(m.on_message(0.0, b"a", hello("w0", fingerprint=fp)), b"a")
    m.on_message(0.0, b"b", hello("w1", fingerprint=Fingerprint("big-b", "x", len(params))))
    pages = 0
    first: int | None = 0
    while first is not None:
        out = m.on_message(0.5, b"a", model_page(params, first), session=a_session)
        pages += 1
        first = asked(out).get(b"a")
    assert pages >= 3
    reason = aborted(answer(m, 1.0, b"b", changed))
    assert reason is not None and "parameter 'layers.2999.weight' has shape (512, 512)" in reason


def test_lists_that_do_not_come_in_time_are_named_by_their_digests():
    m = machine()
    m.on_message(0.0, b"a", hello("w0"))
    other = Fingerprint(digest="model-b", torch_version="2.4.0", entries=3)
    m.on_message(0.0, b"b", hello("w1", fingerprint=other))
    assert aborted(m.on_tick(LIST_TIMEOUT - 0.1)) is None
    reason = aborted(m.on_tick(LIST_TIMEOUT))
    assert reason is not None
    assert "'s model has digest model-a (2 parameters and buffers)" in reason
    assert "has digest model-b (3)" in reason
    assert f"(their parameter lists did not come within {LIST_TIMEOUT:g} s)" in reason


def test_pages_nobody_asked_for_are_ignored_and_counted():
    m = machine()
    m.on_message(0.0, b"a", hello("w0"))
    # before any difference: a stranger's page
    assert m.on_message(0.5, b"x", model_page(MODEL, 0)) == []
    m.on_message(1.0, b"b", hello("w1", fingerprint=Fingerprint("model-b", "2.4.0", 2)))
    # a page from a peer not asked, and one from the asked newcomer under another key
    assert m.on_message(1.5, b"x", model_page(MODEL, 0)) == []
    assert m.on_message(1.5, b"b", model_page(MODEL, 0), user_id="another-key") == []
    assert m.gate.ignored_frames == 3
    assert m.knows(b"b") and not m.knows(b"x")  # the newcomer's page is read; the stranger's not
    assert not m.over


def test_hellos_meanwhile_are_admitted_but_the_store_waits_for_the_verdict():
    m = machine(world_size=2)
    a_session = session_of(m.on_message(0.0, b"a", hello("w0")), b"a")
    m.on_message(0.0, b"b", hello("w1", fingerprint=Fingerprint("model-b", "2.4.0", 2)))
    actions = m.on_message(0.5, b"c", hello("w2"))  # completes the rendezvous
    assert m.rendezvous.complete
    assert not any(isinstance(a, Send) and isinstance(a.message, OpenStore) for a in actions)
    # a third model while the difference is being named asks nothing more
    assert (
        asked(m.on_message(0.6, b"d", hello("w3", fingerprint=Fingerprint("model-c", "2.4.0", 2))))
        == {}
    )
    answer(m, 1.0, b"a", MODEL, a_session)
    assert aborted(answer(m, 1.0, b"b", (WEIGHT, ParamSpec("scale", (1,), "f")))) is not None


# ----------------------------------------------------------------------------- the run directory


def model_file(tmp_path: Path) -> ModelFile:
    return ModelFile(tmp_path)


def join_both(m: RunMachine, now: float = 0.0) -> tuple[list[Action], str]:
    a = m.on_message(now, b"a", hello("w0"))
    return a + m.on_message(now, b"b", hello("w1")), session_of(a, b"a")


def sent(actions: list[Action], kind: type) -> list[bytes]:
    return [a.peer for a in actions if isinstance(a, Send) and isinstance(a.message, kind)]


def test_a_first_run_records_rank_0s_list_while_the_store_opens_then_welcomes(tmp_path):
    m = machine(record=model_file(tmp_path))
    actions, a_session = join_both(m)
    # rank 0 opens the store and sends its list meanwhile; the welcome waits for both
    assert sent(actions, OpenStore) == [b"a"] and asked(actions) == {b"a": 0}
    ready = StoreReady(host="127.0.0.1", port=4242, key="k")
    assert sent(m.on_message(0.2, b"a", ready, session=a_session), Welcome) == []
    assert not (tmp_path / resume.MODEL_FILE).exists()
    actions = answer(m, 0.5, b"a", MODEL, a_session)
    assert sorted(sent(actions, Welcome)) == [b"a", b"b"]
    stored = json.loads((tmp_path / resume.MODEL_FILE).read_text())
    assert stored["digest"] == "model-a" and stored["entries"] == 2
    assert stored["params"][0] == {"name": "weight", "shape": [2, 5], "dtype": "torch.float32"}
    # the next start with the same model needs no list: welcomed as soon as the store is ready
    again = machine(record=model_file(tmp_path))
    actions, a_session = join_both(again)
    assert asked(actions) == {}
    assert sorted(sent(again.on_message(0.2, b"a", ready, session=a_session), Welcome)) == [
        b"a",
        b"b",
    ]


def test_a_resume_with_another_model_is_refused_naming_the_parameter(tmp_path):
    first = machine(record=model_file(tmp_path))
    _, a_session = join_both(first)
    answer(first, 0.5, b"a", MODEL, a_session)
    other = Fingerprint(digest="model-b", torch_version="2.4.0", entries=2)
    m = machine(record=model_file(tmp_path))
    a = m.on_message(0.0, b"a", hello("w0", fingerprint=other))
    actions = m.on_message(0.0, b"b", hello("w1", fingerprint=other))
    assert asked(actions) == {b"a": 0}
    changed = (ParamSpec("weight", (3, 5), "torch.float32"), BIAS)
    reason = aborted(answer(m, 0.5, b"a", changed, session_of(a, b"a")))
    assert reason == (
        f"the run directory {tmp_path} holds a run of another model: parameter 'weight' has "
        "shape (2, 5) in the run directory's model and (3, 5) in the workers' model; use another "
        "--run-dir for this model, or --fresh to replace that run"
    )


def test_a_list_that_does_not_come_records_the_digest_only_and_the_run_goes_on(tmp_path):
    m = machine(record=model_file(tmp_path))
    _, a_session = join_both(m)
    ready = StoreReady(host="127.0.0.1", port=4242, key="k")
    assert sent(m.on_message(0.2, b"a", ready, session=a_session), Welcome) == []
    assert sent(m.on_tick(LIST_TIMEOUT - 0.1), Welcome) == []
    actions = m.on_tick(LIST_TIMEOUT)
    assert sorted(sent(actions, Welcome)) == [b"a", b"b"]
    assert any(isinstance(a, Log) and "records its model's digest only" in a.line for a in actions)
    stored = json.loads((tmp_path / resume.MODEL_FILE).read_text())
    assert "params" not in stored and stored["digest"] == "model-a"
    # a resume with another model is then named by its digest
    problem = model_file(tmp_path).check(Fingerprint("model-b", "2.4.0", 2))
    assert problem is not None and "digest model-a" in problem and "digest model-b" in problem


@pytest.mark.parametrize("content", ["{", "[]", '{"digest": "x"}'])
def test_an_unreadable_model_json_is_refused_naming_it(tmp_path, content: str):
    (tmp_path / resume.MODEL_FILE).write_text(content)
    record = model_file(tmp_path)
    assert not record.needs_list(FP)
    problem = record.check(FP)
    assert problem is not None and "model.json is unreadable" in problem and "--fresh" in problem


def test_a_model_json_written_before_fingerprints_counted_entries_still_reads(tmp_path):
    (tmp_path / resume.MODEL_FILE).write_text(
        json.dumps(
            {
                "digest": "model-a",
                "params": [{"name": "weight", "shape": [2, 5], "dtype": "torch.float32"}],
                "torch_version": "2.4.0",
            }
        )
    )
    record = model_file(tmp_path)
    assert not record.needs_list(FP) and record.check(FP) is None
    other = Fingerprint("model-b", "2.4.0", 2)
    assert record.needs_list(other)


def test_a_store_timeout_shorter_than_the_lists_blames_no_rank_while_the_list_comes(tmp_path):
    config = CoordinatorConfig(world_size=2, epochs=2, store_timeout=2.0)
    m = RunMachine(
        config,
        resume.inspect(config, None),
        run_id="r1",
        now=0.0,
        model_record=model_file(tmp_path),
    )
    _, a_session = join_both(m)
    ready = StoreReady(host="127.0.0.1", port=4242, key="k")
    m.on_message(0.5, b"a", ready, session=a_session)
    assert aborted(m.on_tick(config.store_timeout + 1.0)) is None
    assert sorted(sent(answer(m, 3.5, b"a", MODEL, a_session), Welcome)) == [b"a", b"b"]
