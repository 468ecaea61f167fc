"""DeepSpeed run directories (``ckpt latest``): ``engine.save_checkpoint(save_dir)`` writes
``save_dir/global_stepN/`` (the tag's default name) and then, on rank 0, the ``latest`` file
naming the tag. What makes a step directory whole is the format's rule
(:mod:`ckpt_tools.formats.whole`: the model states and every data-parallel rank's optimizer
states, each a readable zip), judged without importing torch. Reading a save is
:mod:`ckpt_tools.formats.deepspeed`'s business; this module only walks runs."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import BadInput
from ..formats import deepspeed as zero
from ..formats import whole as wholes
from ..security import safefs
from .plain import RUN_FOLDERS, recorded_step  # noqa: F401 - run hooks: plain's

NAME = zero.NAME
NAMES_STEP_DIRS = True
LATEST = zero.LATEST
_STEP_DIR = re.compile(r"^global_step(\d+)$")


def step_of(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def parts(step_dir: Path) -> list[str]:
    return [""]


def missing(ckpt_dir: Path, whole) -> list[str]:
    return []  # all of it is in check_whole


def hint(run_dir: Path) -> int | None:
    """The step of the tag DeepSpeed's ``latest`` file names (a hint, never trusted over the files)."""
    try:
        return step_of(safefs.read_capped(run_dir / LATEST, 4096).decode().strip())
    except (UnicodeDecodeError, OSError, BadInput):
        return None


def owns(step_dir: Path) -> bool:
    """Whether a directory holds DeepSpeed model states, whatever its name (``save_checkpoint``
    takes any ``tag``): its wholeness is then judged here, under any layout that claims it."""
    try:
        return zero.holds_states(step_dir)
    except OSError:
        return False


def check_whole(step_dir: Path) -> wholes.Whole:
    """Whether ``global_stepN/`` holds every file DeepSpeed's ``load_checkpoint`` reads (the
    format's rule, :func:`ckpt_tools.formats.whole.check_deepspeed`)."""
    return wholes.check_deepspeed(step_dir)
