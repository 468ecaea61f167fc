"""verl's ``FSDPCheckpointManager`` layout: ``model_/optim_/extra_state_world_size_{W}_rank_{r}.pt``,
``fsdp_config.json`` (``FSDP_version``, ``world_size``), ``huggingface/`` (config, tokenizer,
``model.safetensors`` when saved), ``lora_train_meta.json`` for LoRA runs.

Rank-local: the ``rng`` entry of each ``extra_state`` file (handled with the extra state)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..core.describe import Checkpoint
from ..core.flat import Unit
from ..errors import BadInput
from ..formats import flatparams, sharded
from ..formats.sharded import CONFIG_NAME, file_name
from ..hf import assets
from ..hf.models import build_from_config
from ..security import safefs
from .plain import RUN_FOLDERS, _from_details, recorded_step  # noqa: F401 - run hooks: plain's

NAME = "verl"
RANK_LOCAL_FILE = None


def detect(ckpt) -> bool:
    # rank files the user named (model_rank{r}.pt) are no framework's
    return ckpt.format == "sharded" and not ckpt.details.get("rank_files")


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


# -- run directories: ``default_local_dir/global_step_N/{actor,critic}/`` beside
# ``latest_checkpointed_iteration.txt``. Rank 0 writes fsdp_config.json after its own files
# while other ranks may still be writing theirs, and the iteration file can name a step whose
# files a lost node never flushed: both are hints, the files decide.
NAMES_STEP_DIRS = True
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_ROLES = ("actor", "critic")
ITERATION_FILE = "latest_checkpointed_iteration.txt"


def step_of(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def parts(step_dir: Path) -> list[str]:
    """The roles saved in ``global_step_N/`` (``actor`` at least: verl's trainer loads it)."""
    return [r for r in _ROLES if (step_dir / r).exists() or (step_dir / r).is_symlink()] or ["actor"]


def roles_in(path: Path) -> list[str]:
    """The roles of a ``global_step_N/`` directory (what ``ckpt latest`` prints, and verl's
    ``trainer.resume_from_path`` takes) that hold verl's rank files, the actor first; ``[]``
    for any other directory. Known by what it holds: rank files under ``actor/``."""
    if not (path.is_dir() and (path / "actor").is_dir() and sharded.detect(path / "actor")):
        return []
    return [r for r in _ROLES if (path / r).is_dir() and sharded.detect(path / r)]


def missing(ckpt_dir: Path, whole) -> list[str]:
    """``fsdp_config.json`` and the ``extra_state`` file of every rank, which
    ``FSDPCheckpointManager.load_checkpoint`` reads (the rank files themselves: the format)."""
    out = []
    if not (ckpt_dir / CONFIG_NAME).is_file():
        out.append(f"{CONFIG_NAME} missing (verl's rank 0 writes it after its own rank files)")
    ws = whole.world_size
    if ws and whole.format == "sharded" and not (ckpt_dir / file_name("extra_state", ws, 0)).exists():
        out.append(f"{file_name('extra_state', ws, 0)} .. rank {ws - 1} missing (the loader reads lr_scheduler and rng there)")
    return out


def hint(run_dir: Path) -> int | None:
    """The step ``latest_checkpointed_iteration.txt`` names (a hint, never trusted over the files)."""
    try:
        return int(safefs.read_capped(run_dir / ITERATION_FILE, 64).decode().strip())
    except (ValueError, UnicodeDecodeError, OSError, BadInput):
        return None
