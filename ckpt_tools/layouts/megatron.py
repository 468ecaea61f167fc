"""Megatron-Core ``dist_checkpointing`` with the ``torch_dist`` strategy: a DCP (``.metadata`` +
``__R_I.distcp``) beside ``common.pt`` (what is not sharded: Megatron's ``args``, iteration,
RNG when saved) and ``metadata.json`` (the strategy's name and version). Its ``.metadata``
also carries every rank's save plan (``all_local_plans``), read as inert records
(:mod:`ckpt_tools.security.dcpmeta`). The DCP is read as any other; ``common.pt`` and
``metadata.json`` are side files, carried as they are. Names are Megatron's own
(``decoder.layers.self_attention.linear_qkv.weight``, layers stacked on a leading axis);
:mod:`ckpt_tools.naming.megatron` says what an export would need."""

from __future__ import annotations

import json
from dataclasses import replace

from ..errors import BadInput
from ..security import safefs

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
    counted per parameter (``inspect``) and written FQN-keyed by the other writers."""
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
