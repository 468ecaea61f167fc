"""accelerate's ``Accelerator.save_state`` with FSDP ``SHARDED_STATE_DICT``: a DCP per model
(``pytorch_model_fsdp_{i}/``, keys nested under ``model``) and per optimizer (``optimizer_{i}/``,
under ``optimizer``), ``scheduler.bin`` (``scheduler_{i}.bin``), ``random_states_{r}.pkl`` per
rank, and ``custom_checkpoint_{i}.pkl`` for registered objects.

The DCP saves hold no trace of FSDP1 or FSDP2 (both save the same DCP), so ``fsdp_version`` is
null; ``accelerator.load_state`` takes either."""

from __future__ import annotations

import re
from pathlib import Path

from ..formats.dcp import ACCELERATE_MODEL, ACCELERATE_OPTIM
from ..formats.whole import torch_file_missing
from .plain import hint, parts, recorded_step  # noqa: F401 - run hooks: plain's

NAME = "accelerate"
RANK_LOCAL_FILE = re.compile(r"^random_states_(\d+)\.pkl$")


def detect(ckpt) -> bool:
    return ckpt.format == "dcp" and ckpt.root.is_dir() and any(
        (ACCELERATE_MODEL.match(p.name) or ACCELERATE_OPTIM.match(p.name)) and p.is_dir()
        for p in ckpt.root.iterdir())


def fsdp_version(ckpt) -> int | None:
    return None


def rank_local_object(obj) -> int | None:
    return None


# -- run directories: ``project_dir/checkpoints/checkpoint_N/`` (automatic naming); RUN_DIR may
# be the project dir or its ``checkpoints/``. ``load_state`` loads every part it was given:
# a model without its ``optimizer_0/`` fails there.
NAMES_STEP_DIRS = True
RUN_FOLDERS = ("", "checkpoints")
_STEP_DIR = re.compile(r"^checkpoint_(\d+)$")
_TORCH_SIDE = re.compile(r"^(optimizer|scheduler)(_\d+)?\.bin$")


def step_of(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def missing(ckpt_dir: Path, whole) -> list[str]:
    names = {p.name for p in ckpt_dir.iterdir()}
    out = []
    if any(ACCELERATE_MODEL.match(n) for n in names) and not any(ACCELERATE_OPTIM.match(n) for n in names):
        out.append("optimizer_0/ missing (load_state reads the optimizer's DCP beside the model's)")
    for n in sorted(names):
        if _TORCH_SIDE.match(n):
            out += torch_file_missing(ckpt_dir / n, ckpt_dir)
    return out
