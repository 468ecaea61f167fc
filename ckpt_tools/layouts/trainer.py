"""transformers ``Trainer`` ``checkpoint-N/`` with FSDP: accelerate's ``save_state`` directories
(``pytorch_model_fsdp_0/``, ``optimizer_0/``) plus ``scheduler.pt``, ``trainer_state.json``,
``training_args.bin`` and ``rng_state_{r}.pth`` per rank (``Trainer._load_rng_state`` skips a
missing one with a warning)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..formats.whole import torch_file_missing
from ..errors import BadInput
from ..security import safefs
from . import accelerate
from .plain import RUN_FOLDERS, hint, parts  # noqa: F401 - run hooks: plain's

NAME = "trainer"
RANK_LOCAL_FILE = re.compile(r"^rng_state_(\d+)\.pth$")
_MARKS = ("trainer_state.json", "training_args.bin")


def detect(ckpt) -> bool:
    return accelerate.detect(ckpt) and any((ckpt.root / m).is_file() for m in _MARKS)


def fsdp_version(ckpt) -> int | None:
    return None


def rank_local_object(obj) -> int | None:
    return None


# -- run directories: ``output_dir/checkpoint-N/``. The Trainer writes in place, model and
# optimizer first and ``trainer_state.json`` last, so a save cut off has no trainer_state.json
# (nor training_args.bin); and when ``scheduler.pt`` is missing it resumes with a fresh
# optimizer and schedule without a word, so an optimizer without it is no checkpoint.
NAMES_STEP_DIRS = True
_STEP_DIR = re.compile(r"^checkpoint-(\d+)$")
STATE = "trainer_state.json"
SCHEDULER = "scheduler.pt"
_TORCH_SIDE = re.compile(r"^(optimizer\.pt|scheduler\.pt|training_args\.bin|rng_state(_\d+)?\.pth)$")


def step_of(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def missing(ckpt_dir: Path, whole) -> list[str]:
    out = []
    if not (ckpt_dir / STATE).is_file():
        out.append(f"{STATE} missing (the Trainer writes it last: the save was cut off)")
    has_optim = (ckpt_dir / "optimizer.pt").exists() or any(
        accelerate.ACCELERATE_OPTIM.match(p.name) for p in ckpt_dir.iterdir())
    if has_optim and not (ckpt_dir / SCHEDULER).exists():
        out.append(f"{SCHEDULER} missing (without it the Trainer resumes with a fresh optimizer and schedule, silently)")
    for p in sorted(ckpt_dir.iterdir()):
        if _TORCH_SIDE.match(p.name):
            out += torch_file_missing(p, ckpt_dir)
    return out + _rng_missing(ckpt_dir, whole.world_size)


def _rng_missing(ckpt_dir: Path, world_size: int | None) -> list[str]:
    """Every process writes its own ``rng_state_{r}.pth``, rank 0 ``trainer_state.json``: a rank
    killed after rank 0 finished leaves its file out, and ``_load_rng_state`` then only warns and
    that rank resumes with another random stream. So where any rank's RNG state was saved (not
    with ``save_only_model``), each rank of the save's world size must have its own."""
    ranks = {int(m.group(1)) for p in ckpt_dir.iterdir() if (m := RANK_LOCAL_FILE.match(p.name))}
    if not ranks or not world_size:
        return []
    lost = [r for r in range(world_size) if r not in ranks]
    return [f"rng_state_{r}.pth missing (rank {r} of {world_size}; the Trainer would resume that rank with "
            "another random stream, with only a warning)" for r in lost]


def recorded_step(step_dir: Path, named: int) -> int:
    """``trainer_state.json``'s ``global_step`` (the directory's number without one)."""
    try:
        step = json.loads(safefs.read_capped(step_dir / STATE, safefs.MAX_JSON_BYTES))["global_step"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError, BadInput):
        return named
    return step if type(step) is int and step >= 0 else named
