"""FSDP1 flat-parameter optimizer state (``use_orig_params=False``) described per parameter.

The sharded reader keeps such state as one 1-D tensor per unit and state (rank r's shard at
``r * S``, padding included). Given the units (which parameters each flat parameter holds,
proposed by a layout from the model; :mod:`ckpt_tools.core.flat` proves them against the
shard lengths), :func:`expand` describes it as every other optimizer state is described:
``state.<fqn>.exp_avg`` with the parameter's shape, its chunks the rectangles of each rank's
shard (byte ranges of the same records, so nothing is read to describe it). The padding is
simply not part of any parameter. ``step`` (one scalar per unit) becomes each parameter's.

``param_groups`` number flat parameters; the expanded description lists parameter FQNs in
their place, carried as a literal value (:class:`Location` kind ``value``).
"""

from __future__ import annotations

import ast
import math
from dataclasses import replace
from typing import Any

from ..core.describe import Checkpoint, Chunk, Location, ObjectInfo, TensorInfo
from ..core.flat import Unit, boxes, check, parts
from ..errors import BadInput


def collect(pieces: dict, param_order: tuple[str, ...]) -> tuple[TensorInfo, ...]:
    """The flat state as read (keyed by the optimizer's own numbering, ``param`` = ``"k"``)."""
    out = []
    for (group, _), p in pieces.items():
        if group != "optimizer" or p["param"] not in param_order:
            continue
        k = param_order.index(p["param"])
        chunks = tuple(p["chunks"].chunks())
        shape = p["shape"]
        if shape:
            if len(shape) != 1:
                raise BadInput(f"optimizer state {k}.{p['state']} is {shape}, which is neither parameter {k}'s "
                               f"({p['param']}) shape nor an FSDP1 flat shard; the optimizer files do not match "
                               "the model files")
            size = shape[0]
            chunks = tuple(c.replaced(offsets=(c.rank * size,)) for c in chunks)
            shape = (size * len(chunks),)
        out.append(TensorInfo("optimizer", f"state.{k}.{p['state']}", shape, p["dtype"], chunks, str(k), p["state"]))
    return tuple(out)


def expand(ckpt: Checkpoint, units: list[Unit], param_groups: list[dict]) -> Checkpoint:
    """``ckpt`` with its flat optimizer state described per parameter (see the module doc);
    refused (BadInput) where the units do not give the saved shard lengths."""
    flat = ckpt.details["flat_state"]
    ws = ckpt.world_size or 1
    by_unit: dict[int, list[TensorInfo]] = {}
    for t in flat:
        by_unit.setdefault(int(t.param), []).append(t)
    local = {k: next((t.shape[0] // ws for t in ts if t.shape), 0) for k, ts in by_unit.items()}
    check(units, ws, local, what=str(ckpt.root))
    model = {t.name: t.shape for t in ckpt.group("model")}
    for unit in units:
        for fqn, shape in unit.params:
            if model.get(fqn) != shape:
                raise BadInput(f"{ckpt.root}: the model's parameter {fqn} {shape} is "
                               f"{'not in the model files' if fqn not in model else f'{model[fqn]} in the model files'}; "
                               "the flat parameters cannot be mapped onto them")
    tensors = []
    for k, unit in enumerate(units):
        for t in by_unit[k]:
            if not t.shape:  # step: the unit's one scalar is each of its parameters'
                tensors += [TensorInfo("optimizer", f"state.{fqn}.{t.state}", (), t.dtype, t.chunks, fqn, t.state)
                            for fqn, _ in unit.params]
                continue
            tensors += _per_parameter(t, unit, ws, str(ckpt.root))
    groups = []
    for g in param_groups:
        ids = g.get("params", [])
        if not all(isinstance(k, int) and 0 <= k < len(units) for k in ids):
            raise BadInput(f"{ckpt.root}: param_groups name flat parameters {ids}, which the units do not match")
        # in the model's order, as get_optimizer_state_dict lists a model's parameters
        held = {fqn for k in ids for fqn, _ in units[k].params}
        groups.append({**g, "params": [fqn for fqn in ckpt.param_order if fqn in held]
                       + sorted(held - set(ckpt.param_order))})
    try:
        literal = repr(groups)
        if ast.literal_eval(literal) != groups:
            raise ValueError(literal)
    except (ValueError, SyntaxError, RecursionError) as e:
        raise BadInput(f"{ckpt.root}: param_groups hold more than plain values ({e})") from None
    objects = tuple(o for o in ckpt.objects if not (o.group == "optimizer" and o.name == "param_groups"))
    objects += (ObjectInfo("optimizer", "param_groups", Location("", "value", key=(literal,)),
                           path=("optimizer", "param_groups")),)
    details = {k: v for k, v in ckpt.details.items() if k not in ("optimizer_flat", "flat_state")}
    details["flat_units"] = tuple(units)
    return replace(ckpt, tensors=ckpt.tensors + tuple(tensors), objects=objects, details=details)


def _per_parameter(t: TensorInfo, unit: Unit, ws: int, where: str) -> list[TensorInfo]:
    size = t.shape[0] // ws
    itemsize = t.dtype.itemsize
    chunks: dict[str, list[Chunk]] = {fqn: [] for fqn, _ in unit.params}
    for c in t.chunks:
        loc = c.location
        if loc.kind != "raw" or c.sizes != (size,):
            raise BadInput(f"{where}: flat optimizer state {t.name!r} on rank {c.rank} is not a plain "
                           "stored tensor; ckpt cannot map it onto parameters")
        for fqn, shape, start, stop, at in parts(unit, ws, c.rank):
            for offsets, sizes in boxes(shape, start, stop):
                first = sum(o * math.prod(shape[d + 1:]) for d, o in enumerate(offsets))
                pos = at + first - start
                chunks[fqn].append(Chunk(offsets, sizes, replace(loc, offset=loc.offset + pos * itemsize,
                                                                 length=math.prod(sizes) * itemsize), c.rank))
    return [TensorInfo("optimizer", f"state.{fqn}.{t.state}", shape, t.dtype, tuple(chunks[fqn]), fqn, t.state)
            for fqn, shape in unit.params]


def param_groups_of(ckpt: Checkpoint) -> list[dict]:
    """The saved ``param_groups`` (rank 0's optimizer file), read as a pickle tree, without torch."""
    from .shardtree import parsed

    obj = next((o for o in ckpt.objects if o.group == "optimizer" and o.name == "param_groups"), None)
    groups: Any = []
    if obj is not None:
        groups = parsed(ckpt.base_dir() / obj.location.file).tree
        for key in obj.location.key:
            groups = groups[key]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise BadInput(f"{ckpt.root}: param_groups is not a list of groups")
    return groups


# -- writing: flat parameters again, at another world size ----------------------------------

def layout(targets, units: tuple[Unit, ...], world_size: int, rank: int) -> tuple[tuple, list]:
    """Rank ``rank``'s optimizer file at ``world_size`` in FSDP1's flat layout: the pieces (each
    parameter's part of each flat shard, as rectangles, in flat order; each unit's ``step``
    once) and, per unit, ``(k, [(state, pieces, shard elements)])`` for the writer."""
    from ..core.plan import piece, whole

    by = {(t.param, t.state): t for t in targets if t.group == "optimizer"}
    order = list(dict.fromkeys(t.state for t in targets if t.group == "optimizer"))
    pieces, plan = [], []
    for k, unit in enumerate(units):
        first = unit.params[0][0]
        states = []
        for state in order:
            if (first, state) not in by:
                continue
            if not by[(first, state)].shape:
                ps = (whole(by[(first, state)]),)
                states.append((state, ps, 0))
            else:
                ps = tuple(piece(by[(fqn, state)], offsets, sizes)
                           for fqn, shape, start, stop, _ in parts(unit, world_size, rank)
                           for offsets, sizes in boxes(shape, start, stop))
                states.append((state, ps, unit.shard(world_size)))
            pieces += ps
        plan.append((k, states))
    return tuple(pieces), plan


def flat_groups(groups: list[dict], units: tuple[Unit, ...]) -> list[dict]:
    """``param_groups`` listing parameter FQNs, numbering flat parameters again."""
    first = {unit.params[0][0]: k for k, unit in enumerate(units)}
    return [{**g, "params": sorted(first[p] for p in g.get("params", []) if p in first)} for g in groups]


def write_state(job, objects, lazy, provider, units: tuple[Unit, ...]) -> dict:
    """An FSDP1 rank's ``optimizer.state_dict()``: each unit's shard of each state, its pieces
    concatenated in flat order and padded with zeros at the end, as FSDP1 pads."""
    import torch

    from ..core.dtypes import as_torch
    from ..core.state import gather

    state: dict = {}
    for k, states in job.meta["flat"]:
        entry = state.setdefault(k, {})
        for name, ps, size in states:
            dtype = ps[0].target.dtype
            if not size:
                entry[name] = lazy.placeholder((), dtype, provider(ps[0]))
                continue
            parts_ = [provider(p) for p in ps]
            pad = size - sum(p.numel for p in ps)

            def flat(parts_=parts_, pad=pad, dtype=dtype) -> torch.Tensor:
                values = [part().reshape(-1) for part in parts_]
                return torch.cat(values + [torch.zeros(pad, dtype=as_torch(dtype))])

            entry[name] = lazy.placeholder((size,), dtype, flat)
    groups = gather(job.objects, objects).get("optimizer", {}).get("param_groups", [])
    return {"state": state, "param_groups": flat_groups(groups, units)}
