"""verl's ``FSDPCheckpointManager`` layout: ``model_/optim_/extra_state_world_size_{W}_rank_{r}.pt``,
``fsdp_config.json`` (``FSDP_version``, ``world_size``), ``huggingface/`` (config, tokenizer,
``model.safetensors`` when saved), ``lora_train_meta.json`` for LoRA runs.

Rank-local: the ``rng`` entry of each ``extra_state`` file (handled with the extra state)."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.describe import Checkpoint
from ..core.flat import Unit
from ..formats import flatparams
from ..hf import assets
from ..hf.models import build_from_config
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


def complete(ckpt: Checkpoint, base: str | None = None) -> Checkpoint:
    """FSDP1 flat-parameter optimizer state (verl's ``strategy: fsdp``, ``use_orig_params=False``)
    mapped onto the model's parameters. verl wraps every module whose class the model lists in
    ``_no_split_modules`` (its decoder layers; ``get_fsdp_wrap_policy``) and the root keeps what
    is left; the units are built from the model's config (``huggingface/``, or ``base``) on the
    meta device, and proved against the saved shard lengths before anything is mapped. Without
    a config the state stays unmapped (and writers of optimizer state refuse it)."""
    if not ckpt.details.get("flat_state"):
        return ckpt
    found = assets.find_assets(ckpt.base_dir(), base)
    if found is None:
        return ckpt
    return flatparams.expand(ckpt, fsdp1_units(found), flatparams.param_groups_of(ckpt))


def fsdp1_units(config_dir: Path) -> list[Unit]:
    """FSDP1's flat parameters for a model auto-wrapped on its ``_no_split_modules``, in
    ``model.parameters()`` order: the root unit first, then each wrapped module in module order;
    each unit's parameters in its module's ``named_parameters()`` order, shared ones once,
    without those of units inside it."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = build_from_config(config)
    wrapped = set(getattr(model, "_no_split_modules", None) or ())
    roots = [""] + [name + "." for name, m in model.named_modules() if name and type(m).__name__ in wrapped]
    units: dict[str, list] = {root: [] for root in roots}
    for fqn, p in model.named_parameters():
        owner = max((r for r in roots if fqn.startswith(r)), key=len)
        units[owner].append((fqn, tuple(p.shape)))
    return [Unit(tuple(units[r])) for r in roots if units[r]]
