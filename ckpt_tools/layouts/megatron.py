"""Megatron-Core ``dist_checkpointing`` with the ``torch_dist`` strategy: a DCP (``.metadata`` +
``__R_I.distcp``) beside ``common.pt`` (what is not sharded: Megatron's ``args``, iteration,
RNG when saved) and ``metadata.json`` (the strategy's name and version). Its ``.metadata``
also carries every rank's save plan (``all_local_plans``), read as inert records
(:mod:`ckpt_tools.security.dcpmeta`). The DCP is read as any other; ``common.pt`` and
``metadata.json`` are side files, carried as they are. Names are Megatron's own
(``decoder.layers.self_attention.linear_qkv.weight``, layers stacked on a leading axis);
:mod:`ckpt_tools.naming.megatron` maps them to Hugging Face's for an export. A Megatron-LM run
directory (``iter_NNNNNNN/`` + ``latest_checkpointed_iteration.txt``) is walked by the run hooks
at the end."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from ..errors import BadInput
from ..formats.whole import torch_file_missing
from ..security import runargs, safefs

NAME = "megatron"
RANK_LOCAL_FILE = None
METADATA_JSON = "metadata.json"
COMMON = "common.pt"


def detect(ckpt) -> bool:
    root = ckpt.root
    if ckpt.format != "dcp" or not root.is_dir() or not (root / METADATA_JSON).is_file():
        return False
    try:
        meta = json.loads(safefs.read_capped(root / METADATA_JSON, safefs.MAX_JSON_BYTES))
    except (BadInput, ValueError, RecursionError):
        return False
    return isinstance(meta, dict) and meta.get("sharded_backend") == "torch_dist"


def fsdp_version(ckpt) -> int | None:
    return None


def rank_local_object(obj) -> int | None:
    return None


def complete(ckpt, base: str | None = None):
    """Megatron keys its optimizer state ``optimizer.state.<state>.<parameter key>``
    (``optim_state_to_sharding_state``), where DCP's convention is ``state.<fqn>.<state>``:
    each tensor keeps its saved key and is told its parameter and state, so the optimizer is
    counted per parameter (``inspect``) and written FQN-keyed by the other writers.

    Megatron-LM's training arguments (``common.pt``'s ``args``, read as inert data) go into
    ``details["run_args"]`` for the export's name map to check its assumptions against; a
    ``common.pt`` without them (a Megatron-Core save of the model alone) gives none, and one
    that cannot be read safely is said in ``details["run_args_unread"]``."""
    ckpt = _with_args(ckpt)
    model = {t.name for t in ckpt.group("model")}
    tensors, changed = [], False
    for t in ckpt.tensors:
        state, _, param = t.name.removeprefix("state.").partition(".")
        if t.group == "optimizer" and t.name.startswith("state.") and param in model and (t.param, t.state) != (
                param, state):
            t = replace(t, param=param, state=state)
            changed = True
        tensors.append(t)
    return replace(ckpt, tensors=tuple(tensors)) if changed else ckpt


def _with_args(ckpt):
    path = ckpt.root / COMMON
    if not path.is_file():
        return ckpt
    try:
        args = runargs.read(path)
    except (BadInput, ValueError, OSError) as e:  # UnsafeInput too: a class the reader does not admit
        return replace(ckpt, details={**ckpt.details, "run_args_unread": f"{COMMON}: {e}"})
    return replace(ckpt, details={**ckpt.details, "run_args": args}) if args is not None else ckpt


# -- run directories (Megatron-LM's ``save_checkpoint``): ``iter_NNNNNNN/``, each a torch_dist
# save, and ``latest_checkpointed_iteration.txt`` (the iteration as text, or ``release``) written
# by rank 0 once every rank's save is in. ``dist_checkpointing.save`` writes ``common.pt``
# first and ``metadata.json`` last (``metadata_finalize_fn``, after the DCP's own ``.metadata``).
RUN_FOLDERS = ("",)
NAMES_STEP_DIRS = True
TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^iter_(\d+)$")


def step_of(name: str) -> int | None:
    m = _ITER_DIR.match(name)
    return int(m.group(1)) if m else None


def parts(step_dir: Path) -> list[str]:
    return [""]


def recorded_step(step_dir: Path, named: int) -> int:
    return named


def missing(ckpt_dir: Path, whole) -> list[str]:
    """What Megatron's loader needs beside the DCP: ``metadata.json`` (which strategy reads
    the save; written last) and a whole ``common.pt``."""
    out = []
    if whole.format == "dcp" and not (ckpt_dir / METADATA_JSON).is_file():
        out.append(f"{METADATA_JSON} missing (dist_checkpointing writes it last: the save was cut off)")
    if whole.format == "dcp":
        out += torch_file_missing(ckpt_dir / COMMON, ckpt_dir)
    return out


def hint(run_dir: Path) -> int | None:
    """The iteration Megatron-LM's tracker file names (a hint, never trusted over the files)."""
    try:
        return int(safefs.read_capped(run_dir / TRACKER, 64).decode().strip())
    except (ValueError, UnicodeDecodeError, OSError, BadInput):
        return None
