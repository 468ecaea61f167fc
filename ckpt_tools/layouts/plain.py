"""No framework recognised: a DCP from ``dcp.save``, per-rank files without a framework's
side files, or an unsharded file. Nothing is rank-local."""

from __future__ import annotations

import re
from pathlib import Path

NAME = "plain"
RANK_LOCAL_FILE = None


def detect(ckpt) -> bool:
    return True


def fsdp_version(ckpt) -> int | None:
    return _from_details(ckpt)


def rank_local_object(obj) -> int | None:
    return None


def _from_details(ckpt) -> int | None:
    fsdp = ckpt.details.get("fsdp") or ""
    return 2 if fsdp.startswith("FSDP2") else 1 if fsdp.startswith("FSDP1") else None


# -- run directories (``ckpt latest``): which sub-directory is a checkpoint of which step, and
# what beyond its format's own files makes it whole. Every adapter has these; plain's are the
# defaults the others take where they have nothing to add.

RUN_FOLDERS = ("",)  # where, below RUN_DIR, the step directories sit
NAMES_STEP_DIRS = False  # plain claims a sub-directory only when it holds checkpoint files
_NUMBER = re.compile(r"\d+")


def step_of(name: str) -> int | None:
    """The step a sub-directory's name says: here the last number in it (None: not a step)."""
    numbers = _NUMBER.findall(name)
    return int(numbers[-1]) if numbers else None


def parts(step_dir: Path) -> list[str]:
    """The checkpoints inside a step directory, relative to it ("" is the directory itself)."""
    return [""]


def missing(ckpt_dir: Path, whole) -> list[str]:
    """What the layout's loader needs beyond the format's files (none for plain)."""
    return []


def recorded_step(step_dir: Path, named: int) -> int:
    """The step the framework recorded for this save (the directory's number by default)."""
    return named


def hint(run_dir: Path) -> int | None:
    """The step a framework's own "latest" marker names in RUN_DIR, if it writes one."""
    return None
