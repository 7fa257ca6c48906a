"""The coordinator's disk work off its event loop: jobs in order on a thread, a heartbeat's snapshot
superseding an older one still queued, failures said once, a bounded wait at the end; and the
service sending heartbeats on time while a checkpoint takes 30 s to delete."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

import epochal
from epochal.coordinator.serve import diskwork
from epochal.coordinator.serve.background import BackgroundCoordinator
from epochal.coordinator.serve.diskwork import DiskWork, OffLoop, delete_tree
from epochal.observe import RunObserver, StatusSnapshot, World
from epochal.protocol import Decision, Done, EpochReport, Finish, Heartbeat, decode
from epochal.rundir.manifest import checkpoint_path
from tests.coordinator.test_service import FakeWorker, join_all
from tests.coordinator.test_service_observers import run_epochs

WAIT = 30.0
"""Bound on waits for work the test itself releases: far beyond any machine's slowness."""


def snapshot(epoch: int) -> StatusSnapshot:
    return StatusSnapshot(
        run_id="r", state="running", epoch=epoch, epochs=9, world_size=1, joined=1
    )


async def test_jobs_run_in_order_and_a_newer_snapshot_supersedes_one_still_queued() -> None:
    work = DiskWork("test-disk")
    gate = threading.Event()
    done: list[str] = []

    def held() -> None:
        gate.wait(WAIT)
        done.append("held")

    work.submit("held", held)
    for name, kind in [("a", None), ("s1", "s"), ("s2", "s"), ("b", None), ("s3", "s")]:
        work.submit(name, lambda name=name: done.append(name), kind=kind)  # type: ignore[misc]
    assert work.pending() == ["held", "a", "s2", "b", "s3"]  # s1 superseded by s2, queued after
    gate.set()
    assert await work.drain(WAIT) == []
    assert done == ["held", "a", "s2", "b", "s3"]
    # no work: no thread (it ends on its own once it found the queue empty for IDLE_SECONDS)
    for thread in [t for t in threading.enumerate() if t.name == "test-disk"]:
        thread.join(WAIT)  # a hang deadline
    assert not [t for t in threading.enumerate() if t.name == "test-disk"]


async def test_jobs_given_in_a_burst_share_one_thread_and_a_newer_join_supersedes_one_queued():
    work = DiskWork("test-burst")
    threads: set[int] = set()
    for _ in range(3):  # a rendezvous: a job a join, each soon after the one before
        work.submit("job", lambda: threads.add(threading.get_ident()))
        assert await work.drain(WAIT) == []
    assert len(threads) == 1  # not a thread started for each
    # a fresh one: the last drain's own end may still be on the first one's thread a moment
    work = DiskWork("test-supersede")
    gate = threading.Event()
    worlds: list[int] = []

    class Heard(RunObserver):
        def on_join(self, world: World) -> None:
            worlds.append(world.joined)

    off = OffLoop(Heard(), work)
    work.submit("held", lambda: gate.wait(WAIT))
    for joined in (1, 2, 3):
        off.on_join(World(joined=joined, world_size=3, hosts=()))
    assert work.pending() == ["held", "telling the observers (on_join)"]
    gate.set()
    assert await work.drain(WAIT) == []
    assert worlds == [3]  # the observers keep the newest world only


async def test_a_failure_is_said_once_and_counted_and_the_work_goes_on() -> None:
    work = DiskWork("test-disk")
    done: list[int] = []

    def fail() -> None:
        raise OSError("disk full")

    for i in range(3):
        work.submit("writing status.json", fail)
        work.submit("after", lambda i=i: done.append(i))  # type: ignore[misc]
    assert await work.drain(WAIT) == []
    assert done == [0, 1, 2]
    assert work.take_failures() == ["writing status.json failed: OSError: disk full"]
    assert work.take_failures() == []  # said once
    assert work.repeats() == ["writing status.json failed 3 times"]


async def test_the_wait_at_the_end_is_bounded_and_says_what_is_left() -> None:
    work = DiskWork("test-disk")
    gate = threading.Event()

    def held() -> None:
        gate.wait(WAIT)

    work.submit("deleting a checkpoint", held)
    work.submit("telling the observers (on_end)", lambda: None)
    try:
        left = await work.drain(0.1)
        assert left == ["deleting a checkpoint", "telling the observers (on_end)"]
        assert work.pending() == ["deleting a checkpoint"]  # the queued one was dropped
    finally:
        gate.set()


async def test_off_loop_observers_hear_every_call_in_order_on_another_thread() -> None:
    heard: list[tuple[str, int, str]] = []

    class Recorder(RunObserver):
        def on_status(self, snapshot: StatusSnapshot) -> None:
            heard.append(("status", snapshot.epoch, threading.current_thread().name))

        def on_end(self, result: object) -> None:
            heard.append(("end", 0, threading.current_thread().name))

    work = DiskWork("test-observers")
    observer = OffLoop(Recorder(), work)
    for epoch in range(3):
        observer.on_status(snapshot(epoch))
    observer.on_end({"status": "finished"})
    assert await work.drain(WAIT) == []
    # the snapshots not yet written when a newer came are superseded; the newest and the end stay
    assert heard[-2:] == [("status", 2, "test-observers"), ("end", 0, "test-observers")]
    assert [e for _, e, _ in heard[:-1]] == sorted(e for _, e, _ in heard[:-1])


def test_delete_tree_deletes_and_a_missing_path_is_not_an_error(tmp_path: Path) -> None:
    tree = tmp_path / "epoch_0"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "shard").write_bytes(b"x")
    delete_tree(tree)
    assert not tree.exists()
    delete_tree(tree)  # seen from the coordinator's machine or not: nothing to delete


@pytest.mark.skipif(os.geteuid() == 0, reason="root deletes what it may not write")
def test_delete_tree_names_what_it_could_not_delete(tmp_path: Path) -> None:
    tree = tmp_path / "epoch_0"
    (tree / "locked").mkdir(parents=True)
    (tree / "locked" / "shard").write_bytes(b"x")
    (tree / "locked").chmod(0o500)
    try:
        with pytest.raises(OSError, match=r"PermissionError: .*shard.*delete it by hand"):
            delete_tree(tree)
    finally:
        (tree / "locked").chmod(0o700)


# ---------------------------------------------------------------- the service


class SlowPrune:
    """``delete_tree`` that takes 30 s unless the test releases it sooner."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.ended = threading.Event()
        self.paths: list[Path] = []

    def __call__(self, path: Path) -> None:
        self.paths.append(path)
        self.started.set()
        self.release.wait(30)
        self.ended.set()


async def heartbeats(workers: list[FakeWorker], span: float) -> list[float]:
    """For ``span`` seconds, answer every heartbeat the workers get; return the longest gap any
    worker saw between two (from the start of the span)."""
    start = time.monotonic()
    last = [start] * len(workers)
    gaps = [0.0] * len(workers)

    async def listen(i: int, w: FakeWorker) -> None:
        while (left := span - (time.monotonic() - start)) > 0:
            try:
                data = await asyncio.wait_for(w.sock.recv(), left)
            except TimeoutError:
                break
            now = time.monotonic()
            assert isinstance(decode(data), Heartbeat)  # nothing else is due in the span
            gaps[i], last[i] = max(gaps[i], now - last[i]), now
            await w.send(Heartbeat())

    await asyncio.gather(*(listen(i, w) for i, w in enumerate(workers)))
    end = time.monotonic()
    return [max(gap, end - seen) for gap, seen in zip(gaps, last, strict=True)]


def start(ctx_lines: list[str], tmp_path: Path, **config: object) -> BackgroundCoordinator:
    """A coordinator of 2 workers on a thread and event loop of its own, as `epochal run` has
    one: a loop held up by the disk holds up its heartbeats, not the fake workers' loop."""
    return epochal.start_coordinator(
        world_size=2,
        checkpoint_dir=tmp_path / "ckpt",
        checkpoint_every=1,
        keep_checkpoints=1,
        log=ctx_lines.append,
        **config,
    )


async def finish(workers: list[FakeWorker]) -> None:
    for w in workers:
        assert isinstance(await w.recv(), Finish)
        await w.send(Done())


async def test_heartbeats_go_out_on_time_while_a_checkpoint_takes_30_s_to_delete(
    ctx, tmp_path, monkeypatch
):
    prune = SlowPrune()
    monkeypatch.setattr(diskwork, "delete_tree", prune)
    interval, timeout = 0.05, 1.0
    lines: list[str] = []
    coordinator = start(
        lines, tmp_path, epochs=3, heartbeat_interval=interval, heartbeat_timeout=timeout
    )
    try:
        workers = await join_all(ctx, coordinator, 2)
        await run_epochs(workers, 2, of=3, checkpoint=True)  # epoch 1's commit prunes epoch 0's
        assert await asyncio.to_thread(prune.started.wait, WAIT)
        assert prune.paths == [checkpoint_path(tmp_path.absolute() / "ckpt", 0)]
        # three heartbeat timeouts into the 30 s: no worker went a heartbeat timeout without one
        # (each would have stopped), and the checkpoint is still being deleted
        gaps = await heartbeats(workers, 3 * timeout)
        assert max(gaps) < timeout, gaps
        assert not prune.ended.is_set()
        for w in workers:
            await w.send(EpochReport(2, 0.5, 1, 0.25, 1, ready=None))
        for w in workers:
            assert isinstance(await w.recv(), Decision)
        await finish(workers)
        # every worker is done, but the run is not reported done while the checkpoint is going
        with pytest.raises(TimeoutError):
            await asyncio.to_thread(coordinator.wait, timeout)
        prune.release.set()
        summary = await asyncio.to_thread(coordinator.wait, WAIT)
        assert prune.ended.is_set() and summary.epochs_run == 3
    finally:
        prune.release.set()
        await asyncio.to_thread(coordinator.close)


async def test_a_prune_that_fails_is_said_once_with_its_path_and_the_run_goes_on(
    ctx, tmp_path, monkeypatch
):
    def refuse(path: Path) -> None:
        raise OSError(f"PermissionError: {path}/shard; delete it by hand")

    monkeypatch.setattr(diskwork, "delete_tree", refuse)
    lines: list[str] = []
    coordinator = start(lines, tmp_path, epochs=4)
    try:
        workers = await join_all(ctx, coordinator, 2)
        await run_epochs(workers, 4, of=4, checkpoint=True)
        await finish(workers)
        summary = await asyncio.to_thread(coordinator.wait, WAIT)
    finally:
        await asyncio.to_thread(coordinator.close)
    assert summary.epochs_run == 4
    failed = [line for line in lines if "failed" in line]
    # epochs 0, 1 and 2 were pruned in turn (the best is the newest): each said once
    assert len(failed) == 3, lines
    assert "deleting the checkpoint of epoch 0" in failed[0]
    path = checkpoint_path(tmp_path.absolute() / "ckpt", 0)
    assert failed[0].endswith(f"{path}/shard; delete it by hand (the run goes on)")


async def test_the_end_waits_for_the_disk_only_so_long_and_says_what_is_left(
    ctx, tmp_path, monkeypatch
):
    prune = SlowPrune()
    monkeypatch.setattr(diskwork, "delete_tree", prune)
    monkeypatch.setattr(diskwork, "DRAIN_TIMEOUT", 0.2)
    lines: list[str] = []
    coordinator = start(lines, tmp_path, epochs=2)
    try:
        workers = await join_all(ctx, coordinator, 2)
        await run_epochs(workers, 2, of=2, checkpoint=True)
        await finish(workers)
        # the prune takes 30 s; the end waits DRAIN_TIMEOUT for it, not the 30 s
        summary = await asyncio.to_thread(coordinator.wait, WAIT)
        assert summary.epochs_run == 2 and not prune.ended.is_set()
    finally:
        prune.release.set()
        await asyncio.to_thread(coordinator.close)
    (line,) = [line for line in lines if "not done" in line]
    assert "0.2 s after the run ended: deleting the checkpoint of epoch 0" in line
