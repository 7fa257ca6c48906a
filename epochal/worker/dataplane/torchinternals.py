"""What leaving a process group relies on in torch beyond its public API: the one place for it.

A gloo group closes its connections only when the last reference to it goes; a peer blocked in a
collective with a rank that left raises only then ("Connection closed by peer"). Destroying the
group (``dist.destroy_process_group``) drops torch's registry of it, and the training objects
built over it go with the strategy; two holders remain that torch gives no public way to drop
(torch 2.13 and 2.14):

- **import-time default arguments.** Some ``torch.distributed`` functions declare
  ``group=group.WORLD``, evaluated once, when their module is first imported: imported while a
  group exists, they hold that group for the life of the process. :data:`IMPORT_BEFORE_ANY_GROUP`
  lists those modules; :func:`prepare` imports them while no group exists, so their default is
  None (which they read as "the default group, whichever it is then").
- **device meshes.** A ``DeviceMesh`` keeps the process groups of its dimensions, and DTensor's
  caches (sharding propagation, redistribution plans, mesh topology: several, private, more in
  each release) keep every mesh they have seen for the life of the process: once a model was
  fully sharded, the group outlives its destruction. Rather than chase those caches, the mesh a
  world builds is made to drop its groups when the world is left (:func:`release_mesh`): the
  caches then keep a mesh that holds names only.

:func:`changed` says which of these no longer holds in the installed torch;
``tests/worker/test_torchinternals.py`` fails naming it, so a torch release that moves one is
caught by the test suite rather than by a peer waiting for its collective timeout.
"""

from __future__ import annotations

import importlib

IMPORT_BEFORE_ANY_GROUP = (
    "torch.distributed.nn.functional",  # its collectives: imported by DDP when first built
    "torch.distributed.optim.zero_redundancy_optimizer",  # _broadcast_object
)
"""The ``torch.distributed`` modules whose functions take ``group.WORLD`` as a default argument
evaluated at import."""

MESH_GROUPS = "_pg_registry"
"""The attribute of a ``DeviceMesh`` that holds its dimensions' process groups by name (the mesh
resolves a name there first, then in torch's registry)."""


def prepare() -> None:
    """Import :data:`IMPORT_BEFORE_ANY_GROUP` now, so that their defaults hold no group. This
    package's modules that leave a group call it at their import, before a worker forms its
    first group; a module imported while a group exists keeps that one group (its sockets stay
    open until the process ends, which a run that never regroups does not notice)."""
    for name in IMPORT_BEFORE_ANY_GROUP:
        importlib.import_module(name)


def release_mesh(mesh: object) -> None:
    """Make ``mesh`` (a ``DeviceMesh`` of ours) drop the process groups it holds, keeping only
    their names, which resolve to nothing once the groups are destroyed. DTensor's caches keep
    the mesh for the life of the process; this way they keep no group with it."""
    groups = getattr(mesh, MESH_GROUPS, None)
    if isinstance(groups, dict):
        groups.clear()


def changed() -> list[str]:
    """What this module relies on that the installed torch no longer offers, each named with
    what to look at (empty: nothing). Imports DTensor's debug module to look."""
    problems = []
    for name in IMPORT_BEFORE_ANY_GROUP:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            problems.append(f"module {name} cannot be imported ({exc})")
    from torch.distributed.device_mesh import DeviceMesh

    if MESH_GROUPS not in getattr(DeviceMesh, "__annotations__", {}):
        problems.append(
            f"DeviceMesh no longer declares {MESH_GROUPS}: find where a mesh keeps its process "
            "groups now (release_mesh must drop them)"
        )
    return problems
