"""Whether the ranks that should hold the same weights do: one checksum per rank and epoch.

In the modes where every rank holds the whole model (replicated, main, sharded optimizer state
with replicated parameters), each rank's epoch report carries a checksum of its parameters
(:mod:`epochal.worker.training.checksums`). DDP keeps them bit-identical; a training loop that
never averages its gradients (a plain model under ``join()``), a non-deterministic step or a
rank that loaded other weights does not, and the run then trains as many different models as
it has ranks while every loss looks fine.
:func:`replicas_differ` names the ranks whose weights differ, before the epoch is decided.
"""

from __future__ import annotations

from collections.abc import Mapping

from epochal.coordinator.rules.batches import format_ranks

SHOWN = 4
"""Sets of ranks with one set of weights named in the abort, at most."""


def replicas_differ(epoch: int, checksums: Mapping[int, int | None]) -> str | None:
    """Why the run must stop when the ranks' ``checksums`` after ``epoch`` differ; None when
    they agree (ranks without a checksum, such as a fully sharded model's, are not compared)."""
    groups: dict[int, list[int]] = {}
    for rank in sorted(checksums):
        value = checksums[rank]
        if value is not None:
            groups.setdefault(value, []).append(rank)
    if len(groups) < 2:
        return None
    ordered = sorted(groups.values(), key=lambda ranks: (-len(ranks), ranks[0]))
    shown = [
        f"{format_ranks(ranks)} {'hold' if len(ranks) > 1 else 'holds'} "
        + ("one" if i == 0 else "another")
        for i, ranks in enumerate(ordered[:SHOWN])
    ]
    if len(ordered) > SHOWN:
        shown.append(f"{len(ordered) - SHOWN} more sets of ranks hold others")
    held = "; ".join(shown)
    return (
        f"after epoch {epoch} the ranks' weights differ ({held}): ranks that train one model "
        "must end every epoch with the same weights. Wrap the model in "
        "torch.nn.parallel.DistributedDataParallel after epochal.join() (epochal.train does it), "
        "or average the gradients yourself; check for a non-deterministic step. If the ranks are "
        "meant to differ, pass --no-replica-check"
    )
