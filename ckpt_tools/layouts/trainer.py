"""transformers ``Trainer`` ``checkpoint-N/`` with FSDP: accelerate's ``save_state`` directories
(``pytorch_model_fsdp_0/``, ``optimizer_0/``) plus ``scheduler.pt``, ``trainer_state.json``,
``training_args.bin`` and ``rng_state_{r}.pth`` per rank (``Trainer._load_rng_state`` skips a
missing one with a warning)."""

from __future__ import annotations

import re

from . import accelerate

NAME = "trainer"
RANK_LOCAL_FILE = re.compile(r"^rng_state_(\d+)\.pth$")
_MARKS = ("trainer_state.json", "training_args.bin")


def detect(ckpt) -> bool:
    return accelerate.detect(ckpt) and any((ckpt.root / m).is_file() for m in _MARKS)


def fsdp_version(ckpt) -> int | None:
    return None


def rank_local_object(obj) -> int | None:
    return None
