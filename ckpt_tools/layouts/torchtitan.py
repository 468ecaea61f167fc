"""torchtitan's ``CheckpointManager`` ``step-N/``: one DCP whose model keys sit at the top level
(no ``model.`` prefix), optimizer flattened (``optimizer`` → ``state.<fqn>.<name>``,
``param_groups.<fqn>.<key>``), ``lr_scheduler``, ``train_state`` and one
``dataloader.dp_rank_{r}`` entry per data-parallel rank (rank-local). torchtitan trains with
FSDP2 only."""

from __future__ import annotations

import re
from pathlib import Path

from ..naming import torchtitan as names
from .plain import RUN_FOLDERS, hint, parts, recorded_step  # noqa: F401 - run hooks: plain's

NAME = "torchtitan"
RANK_LOCAL_FILE = None
_STEP_DIR = re.compile(r"^step-\d+$")
_DP_RANK = re.compile(r"^dp_rank_(\d+)$")
# torchtitan's loader expects a dataloader.dp_rank_{r} entry for every rank of the resumed job,
# so at any change of data-parallel degree (as for its own reshard at load) it must skip them
RANK_LOCAL_CHANGED = ('in the resumed torchtitan job set checkpoint.exclude_from_loading = ["dataloader"] '
                      "(its loader needs every rank's dataloader.dp_rank_* entry, as at any change of "
                      "data-parallel degree)")


def detect(ckpt) -> bool:
    if ckpt.format != "dcp":
        return False
    heads = {str(o.path[0]) for o in ckpt.objects if o.path}
    if "train_state" in heads or any(rank_local_object(o) is not None for o in ckpt.objects):
        return True
    flat_optim = any(len(o.path) == 2 and str(o.path[0]) == "optimizer" and str(o.path[1]).startswith("param_groups.")
                     for o in ckpt.objects)
    return bool(_STEP_DIR.match(ckpt.root.name)) and flat_optim


def fsdp_version(ckpt) -> int | None:
    return 2


def rank_local_object(obj) -> int | None:
    path = [str(p) for p in obj.path]
    if len(path) >= 2 and path[0] == "dataloader":
        m = _DP_RANK.match(path[1])
        if m:
            return int(m.group(1))
    return None


# ``convert --to dcp --layout torchtitan``: torchtitan's own names, model keys at the top level
WRITES = "dcp"
TOP_LEVEL_MODEL = True


def retarget(targets, config: dict, src, ckpt=None) -> tuple[list, object]:
    """The model targets under torchtitan's names, and how each rank's rows of them are taken
    (the rotary row permutation): from a Hugging Face source (``ckpt``, whose per-expert
    tensors are joined into torchtitan's grouped ones) and its config."""

    renamed, row_maps = names.from_hf_targets([t for t in targets if t.group == "model"], config, src, ckpt)
    return renamed, names.rank_piece(row_maps)


# -- run directories: ``checkpoint.folder/step-N/``, one DCP. A full save holds the optimizer
# with ``lr_scheduler`` and ``train_state`` (what ``CheckpointManager.load`` restores besides
# the model); a model-only save (``last_save_model_only``) holds the model alone.
NAMES_STEP_DIRS = True
_STEP_NUM = re.compile(r"^step-(\d+)$")
_WITH_OPTIMIZER = ("lr_scheduler", "train_state")


def step_of(name: str) -> int | None:
    m = _STEP_NUM.match(name)
    return int(m.group(1)) if m else None


_MARKS = frozenset({"train_state", "lr_scheduler", "dataloader"})


def claims(whole) -> bool:
    """Whether a ``step-N/`` directory holds torchtitan's checkpoint: a DCP with one of its own
    entries, or its model keys at the top level. A ``dcp.save({"model": ..., "optimizer": ...})``
    in a folder that happens to be named ``step-N`` is plain."""
    return whole.format != "dcp" or bool(_MARKS & whole.entries) or "model" not in whole.entries


def missing(ckpt_dir: Path, whole) -> list[str]:
    if whole.format != "dcp" or "optimizer" not in whole.entries:
        return []
    return [f"entry {e!r} missing beside the optimizer" for e in _WITH_OPTIMIZER if e not in whole.entries]
