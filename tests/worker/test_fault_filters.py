"""A ``drop``/``corrupt`` fault names the control message it acts on by its wire name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from epochal.protocol import EpochReport, Status, encode
from epochal.protocol.messages import MESSAGE_TYPES, WorkerMessage
from epochal.worker import faults

REPORT = encode(
    EpochReport(epoch=0, train_loss_sum=1.0, train_count=1, valid_loss_sum=0.0, valid_count=0)
)
STATUS = encode(Status(phase="train", epoch=0, step=0, where=""))  # type: ignore[arg-type]


@pytest.fixture
def fault(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    faults._plan.cache_clear()
    yield monkeypatch
    faults._plan.cache_clear()


def test_the_names_are_every_message_a_worker_sends():
    expected = {n for n, cls in MESSAGE_TYPES.items() if issubclass(cls, WorkerMessage)}
    assert set(faults.MESSAGE_KINDS) == expected
    assert {"hello", "epoch_report", "status", "heartbeat"} <= expected
    assert "welcome" not in expected


def test_drop_acts_on_the_named_message_of_the_named_rank_only(fault: pytest.MonkeyPatch):
    fault.setenv(faults.FAULT_ENV, "drop@send:rank=1:type=epoch_report")
    assert faults.on_send("epoch_report", REPORT, rank=1) is None
    assert faults.on_send("epoch_report", REPORT, rank=0) == REPORT
    assert faults.on_send("status", STATUS, rank=1) == STATUS


def test_corrupt_replaces_the_frame_with_one_no_reader_accepts(fault: pytest.MonkeyPatch):
    fault.setenv(faults.FAULT_ENV, "corrupt@send:type=status")
    garbled = faults.on_send("status", STATUS, rank=None)
    assert garbled is not None and garbled != STATUS and garbled[0] == 0xC1
    assert faults.on_send("epoch_report", REPORT, rank=None) == REPORT


@pytest.mark.parametrize("value", ["3", "welcome", "EpochReport", ""])
def test_a_type_that_is_not_a_worker_message_name_is_refused_naming_them(
    fault: pytest.MonkeyPatch, value: str
):
    fault.setenv(faults.FAULT_ENV, f"drop@send:rank=1:type={value}")
    with pytest.raises(ValueError) as info:
        faults.on_send("epoch_report", REPORT, rank=1)
    message = str(info.value)
    assert f"got {value!r}" in message
    assert "hello, store_ready, epoch_ready, epoch_report" in message
