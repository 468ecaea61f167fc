"""accelerate's ``Accelerator.save_state`` with FSDP ``SHARDED_STATE_DICT``: a DCP per model
(``pytorch_model_fsdp_{i}/``, keys nested under ``model``) and per optimizer (``optimizer_{i}/``,
under ``optimizer``), ``scheduler.bin`` (``scheduler_{i}.bin``), ``random_states_{r}.pkl`` per
rank, and ``custom_checkpoint_{i}.pkl`` for registered objects.

The DCP saves hold no trace of FSDP1 or FSDP2 (both save the same DCP), so ``fsdp_version`` is
null; ``accelerator.load_state`` takes either."""

from __future__ import annotations

import re

from ..formats.dcp import ACCELERATE_MODEL, ACCELERATE_OPTIM

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
