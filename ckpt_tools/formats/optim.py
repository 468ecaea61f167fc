"""Optimizer state dicts, int-keyed (``optimizer.state_dict()``) or FQN-keyed
(``get_optimizer_state_dict``), mapped to parameter names."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
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


MAX_SUBSEQUENCE_CELLS = 4_000_000  # params x ids searched for an optimizer over some parameters


def subset_order(params: Sequence[tuple[str, tuple[int, ...]]], wants: Sequence[tuple[int, ...] | None]
                 ) -> tuple[str, ...] | None:
    """The parameters an optimizer built over *some* of the model's parameters numbers 0..m-1
    (``filter(lambda p: p.requires_grad, model.parameters())``: a LoRA run's adapters), found
    from its states' shapes: the one subsequence of ``params`` (``(fqn, shape)`` in
    ``model.parameters()`` order) whose shapes are ``wants`` (id k's state shape; None: id k
    holds no shaped state, any parameter fits). None when no subsequence fits or more than one
    does: names are then never guessed. Example: params ``[("w", (4, 4)), ("a", (2, 4))]``,
    wants ``[(2, 4)]`` -> ``("a",)``."""
    n, m = len(params), len(wants)
    if m == 0 or m > n or n * m > MAX_SUBSEQUENCE_CELLS:
        return None
    fits = [[w is None or w == shape for w in wants] for _, shape in params]
    # ways[i][j]: how many ways (counted up to 2) ids j.. map onto params i.., in order
    ways = [bytearray(m + 1) for _ in range(n + 1)]
    ways[n][m] = 1
    for i in range(n - 1, -1, -1):
        row, below = ways[i], ways[i + 1]
        row[m] = 1
        for j in range(m - 1, -1, -1):
            row[j] = min(2, below[j] + (below[j + 1] if fits[i][j] else 0))
    if ways[0][0] != 1:
        return None
    out, j = [], 0
    for i in range(n):
        if j < m and fits[i][j] and ways[i + 1][j + 1]:
            out.append(params[i][0])
            j += 1
    return tuple(out)


def renumber(pieces: dict, param_order: tuple[str, ...], objects: list) -> tuple[str, ...] | None:
    """An int-keyed optimizer built over some of the parameters (only the adapters of a LoRA
    run train) numbers those only. ``pieces`` as the rank-file reader collects them
    (``{(group, name): {"shape", "param", "state", ...}}``, states named through
    ``param_order``): where the states' shapes are not those of the parameters at their ids
    but fit exactly one in-order subset of them, the states are renamed after it and that
    subset is returned (None: nothing to rename, or no one subset fits)."""
    optim_pieces = {k: p for k, p in pieces.items() if k[0] == "optimizer" and p["param"] is not None}
    model = {k[1]: p["shape"] for k, p in pieces.items() if k[0] == "model"}
    if not any(p["shape"] and model.get(p["param"]) != p["shape"] and len(p["shape"]) > 1
               for p in optim_pieces.values()):
        return None  # all fit (or 1-D state only: FSDP1 flat shards, judged by the caller)
    position = {fqn: i for i, fqn in enumerate(param_order)}
    ids: dict[str, int] = {}
    for p in optim_pieces.values():
        pid = position.get(p["param"], int(p["param"]) if p["param"].isdigit() else None)
        if pid is None:
            return None
        ids[p["param"]] = pid
    wants: list = [None] * (max(ids.values()) + 1)
    for p in optim_pieces.values():
        if p["shape"]:
            wants[ids[p["param"]]] = p["shape"]
    order = subset_order([(f, model[f]) for f in param_order], wants)
    if order is None:
        return None
    for key in optim_pieces:  # all out first: a new name may be another's old one
        del pieces[key]
    for (group, _), p in optim_pieces.items():
        fqn = order[ids[p["param"]]]
        pieces[(group, f"state.{fqn}.{p['state']}")] = {**p, "param": fqn}
    for i, o in enumerate(objects):
        if o.group == "optimizer" and len(o.path) >= 3 and o.path[1] == "state" and isinstance(o.path[2], int) \
                and o.path[2] < len(order):
            objects[i] = replace(o, name=f"state.{order[o.path[2]]}.{o.path[3] if len(o.path) > 3 else ''}")
    return order
