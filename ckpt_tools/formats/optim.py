"""Optimizer state dicts, int-keyed (``optimizer.state_dict()``) or FQN-keyed
(``get_optimizer_state_dict``), mapped to parameter names."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any


def is_optimizer_state(obj: Any) -> bool:
    return isinstance(obj, dict) and "state" in obj and "param_groups" in obj and isinstance(obj["state"], dict)


def is_int_keyed(osd: dict) -> bool:
    ids = [p for g in osd["param_groups"] for p in g.get("params", [])]
    return bool(ids) and all(isinstance(p, int) for p in ids) or (
        not ids and all(isinstance(k, int) for k in osd["state"])
    )


def state_entries(osd: dict, param_order: Sequence[str]) -> Iterator[tuple[str, str, Any, tuple]]:
    """Yield ``(param_fqn, state_key, value, key_path)`` for each per-parameter state value.

    Int keys are mapped through ``param_order`` (the parameters in ``model.parameters()``
    order); an int with no name there keeps its number as its name.
    """
    for pid, states in osd["state"].items():
        if isinstance(pid, int):
            fqn = param_order[pid] if 0 <= pid < len(param_order) else str(pid)
        else:
            fqn = str(pid)
        for k, v in states.items():
            yield fqn, str(k), v, ("state", pid, k)


def is_tensor(v: Any) -> bool:
    import torch

    return isinstance(v, torch.Tensor)


_BUFFER_SUFFIXES = (".running_mean", ".running_var", ".num_batches_tracked")


def param_order_for(model_sd: dict, osd: dict) -> tuple[str, ...]:
    """Names for an int-keyed optimizer's ids, checked against the state's shapes.

    The candidates are :func:`param_order_from_model`'s; when an id's state holds a tensor
    whose shape differs from its candidate's (a floating buffer counted as a parameter), the
    candidate is skipped. If the ids cannot all be matched, no names are given (ids stay
    numbers) rather than wrong ones.
    """
    import torch
    from torch.distributed.tensor import DTensor

    base = param_order_from_model(model_sd)
    ids = sorted({p for g in osd.get("param_groups", []) for p in g.get("params", []) if isinstance(p, int)}
                 | {k for k in osd.get("state", {}) if isinstance(k, int)})
    order: list[str] = []
    j = 0
    for pid in ids:
        states = osd["state"].get(pid, {})
        shape = next((tuple(v.shape) for v in states.values() if isinstance(v, (torch.Tensor, DTensor)) and v.dim()), None)
        while j < len(base) and shape is not None and tuple(model_sd[base[j]].shape) != shape:
            j += 1
        if j >= len(base):
            return ()
        order.append(base[j])
        j += 1
    return tuple(order)


def param_order_from_model(model_sd: dict) -> tuple[str, ...]:
    """The parameters of a saved ``model.state_dict()`` in ``model.parameters()`` order: its
    DTensor entries (FSDP2 parameters are DTensors, buffers are not), tied ones once. For a
    plain (unsharded) state dict, every floating tensor, tied ones once."""
    import torch
    from torch.distributed.tensor import DTensor

    from ..security.fsdp1 import is_sharded_tensor

    def sharded(v) -> bool:
        return isinstance(v, DTensor) or is_sharded_tensor(v)

    values = [(k, v) for k, v in model_sd.items() if isinstance(v, torch.Tensor)]
    if any(sharded(v) for _, v in values):
        values = [(k, v) for k, v in values if sharded(v)]
    else:
        values = [(k, v) for k, v in values if v.is_floating_point() and not k.endswith(_BUFFER_SUFFIXES)]
    seen: set[int] = set()
    order = []
    for k, v in values:
        # tied parameters are two entries over one storage (not always one object)
        if is_sharded_tensor(v):
            shards = v.local_shards()
            ident = shards[0].tensor.untyped_storage()._cdata if shards else id(v)
        else:
            local = v._local_tensor if isinstance(v, DTensor) else v
            ident = local.untyped_storage()._cdata
        if ident not in seen:
            seen.add(ident)
            order.append(k)
    return tuple(order)
