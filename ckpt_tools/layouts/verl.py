"""verl's ``FSDPCheckpointManager`` layout: ``model_/optim_/extra_state_world_size_{W}_rank_{r}.pt``,
``fsdp_config.json`` (``FSDP_version``, ``world_size``), ``huggingface/`` (config, tokenizer,
``model.safetensors`` when saved), ``lora_train_meta.json`` for LoRA runs.

Rank-local: the ``rng`` entry of each ``extra_state`` file (handled with the extra state)."""

from __future__ import annotations

import json

from .plain import _from_details

NAME = "verl"
RANK_LOCAL_FILE = None


def detect(ckpt) -> bool:
    return ckpt.format == "sharded"


def fsdp_version(ckpt) -> int | None:
    """From ``fsdp_config.json`` (verl writes it), else from the files: FSDP1 files given a
    device mesh hold DTensors like FSDP2's, so only the config (or flat optimizer state) tells."""
    try:
        return int(json.loads((ckpt.root / "fsdp_config.json").read_text())["FSDP_version"])
    except (OSError, ValueError, KeyError, TypeError):
        return _from_details(ckpt)


def rank_local_object(obj) -> int | None:
    # extra_state entries are per rank file already; which differ between ranks (``rng``) is
    # judged by value with the rest of the extra state (state.per_rank_extras)
    return None


# ``convert --to sharded --layout verl``: rank files whose device mesh is named as verl's jobs
# name theirs; ``load_state_dict`` copies DTensors only between meshes of the same names, so
# verl's loader refuses the unnamed mesh of ``fully_shard``'s default
WRITES = "sharded"
MESH_NAMES = ("fsdp",)
