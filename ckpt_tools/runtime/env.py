"""Where this process stands in a launch: the one reader of the ``env://`` variables that
``torchrun`` (or any launcher of its kind) sets."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import UsageError


@dataclass(frozen=True)
class Launch:
    """This process's place in a launch: its rank, the number of processes, its rank on this
    node, and the launch's id (``TORCHELASTIC_RUN_ID``; ``"none"`` from a launcher that sets none)."""

    rank: int
    world: int
    local_rank: int
    run_id: str


def launch() -> Launch | None:
    """This process's :class:`Launch`, or None outside one.

    A launch is recognised by ``RANK`` and ``WORLD_SIZE`` together with ``LOCAL_RANK`` or
    ``TORCHELASTIC_RUN_ID`` (torchrun sets all four): ``RANK`` alone is too common a name (a
    scheduler's, a user's) to turn a plain run into one process of many. Values that are not
    integers are the launcher's mistake, said as such."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    if "LOCAL_RANK" not in env and "TORCHELASTIC_RUN_ID" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
    except ValueError as e:
        raise UsageError(f"RANK/WORLD_SIZE/LOCAL_RANK are not integers ({e}); check the launcher") from e
    return Launch(rank, world, local, env.get("TORCHELASTIC_RUN_ID", "none"))


def world() -> int:
    """The number of processes of the launch this process belongs to (1 outside one)."""
    found = launch()
    return found.world if found else 1


def rank() -> int:
    """This process's rank in its launch (0 outside one, or in a launch of one process)."""
    found = launch()
    return found.rank if found and found.world > 1 else 0
