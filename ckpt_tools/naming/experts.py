"""Mixture-of-Experts layouts: the names and rows ``save_pretrained`` writes (the hub layout),
and those the training model holds (transformers 5 fuses experts in memory), planned from
transformers' own conversion registry at run time.

transformers 5 loads a hub checkpoint through its registry
(``conversion_mapping.get_checkpoint_conversion_mapping(model_type)``: ``WeightConverter``s of
``MergeModulelist``, ``Concatenate``, ... and renames such as Mixtral's ``block_sparse_moe`` →
``mlp``), and ``save_pretrained`` writes the hub layout back by reversing it
(``core_model_loading.revert_weight_conversion``). ckpt keeps no copy of that table: it hands
transformers' own ``revert_weight_conversion`` small *probes* in place of the tensors, one
integer per row (a tensor's last dimension collapsed to 1, each element the global number of a
source row), and reads from what comes back which rows of which source tensor make each output
tensor. The operations that only move whole rows (stacking experts, concatenating gate and up,
splitting them back, interleaving rows) pass the probes through unchanged in kind; one that moves
columns (``Transpose``) leaves the probe's last dimension elsewhere and is refused (exit 3). A new
MoE family in a later transformers release therefore needs no change here.

A row range of a stored chunk is a contiguous byte range of its file, so every output tensor is
described as byte ranges of the source files (no data read at planning time) and the engine
streams it like any copy: the per-expert slice ``gate`` of a fused ``[E, 2I, H]`` tensor is rows
``e*2I .. e*2I+I``; a fused tensor built from per-expert ones is their rows one after another.

Directions: :func:`to_hub` (export: what ``save_pretrained`` writes) and :func:`to_model`
(``shard``, ``convert --to dcp|sharded`` of a hub directory: what the training model holds).
Names already in the wanted layout pass through unchanged (a transformers-4 save exports as it is).
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.describe import Chunk, Location, TensorInfo
from ..core.dtypes import DType
from ..engine.reader import Reader
from ..errors import BadInput

# config keys that say how many routed experts a model has (any one of them, top level or text_config)
COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# the registry's operations that move whole rows only (any other is refused by the probe check)
ROW_OPS = frozenset({"MergeModulelist", "SplitModulelist", "Concatenate", "Chunk", "Interleave"})
_PER_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")  # the hub's one module per expert
# one tensor for all experts (torchtitan 0.3: ``moe.routed_experts.inner_experts.w1_EFD``)
_GROUPED = re.compile(r"(?:^|\.)(?:inner_)?experts\.[^.\d][^.]*(?:\.weight)?$")


@dataclass(frozen=True)
class Run:
    """Output rows ``[out_start, out_start + rows)`` are rows ``[src_start, ...)`` of ``source``
    (a tensor viewed as rows of its last dimension; a 1-D tensor as rows of one element)."""

    source: str
    src_start: int
    out_start: int
    rows: int


@dataclass(frozen=True)
class Planned:
    """One output tensor: its name and shape, and either ``same`` (a source taken whole, perhaps
    renamed) or the runs that make it, in output order."""

    name: str
    shape: tuple[int, ...]
    same: str | None
    runs: tuple[Run, ...] = ()


def num_experts(config: dict) -> int | None:
    """The routed-expert count ``config.json`` gives (None for a dense model)."""
    for cfg in (config, config.get("text_config") if isinstance(config.get("text_config"), dict) else {}):
        for k in COUNT_KEYS:
            v = cfg.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def is_moe(config: dict | None, names=()) -> bool:
    """Whether the model has routed experts, by its config (or, without one, its names)."""
    if config:
        return num_experts(config) is not None
    return any(".experts." in n for n in names)


def _transforms(config: dict, src: Path):
    """The registry's transforms for this model (class name first, then model_type, as
    ``from_pretrained`` looks them up); None when it has none (the hub layout is the model's)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError as e:
        raise BadInput(f"{src}: a Mixture-of-Experts model: the layout of its experts comes from transformers' "
                       "conversion registry, and transformers 5 is not installed (pip install 'ckpt-tools[hf]')") from e
    archs = config.get("architectures") or []
    found = None
    for key in (*(a for a in archs[:1] if isinstance(a, str)), config.get("model_type")):
        if isinstance(key, str):
            found = get_checkpoint_conversion_mapping(key)
            if found is not None:
                break
    # PrefixChange is dropped by save_pretrained for a model not loaded by from_pretrained: the same here
    found = [t for t in found or () if not isinstance(t, PrefixChange)]
    return found or None


class _Probe:
    """What ``revert_weight_conversion`` needs of a model: its transforms and config; a
    parameter lookup (only ``Split``/``Transpose(check_dims)`` ask) is refused."""

    def __init__(self, transforms: list, config: Any) -> None:
        self._weight_conversions = transforms
        self.config = config

    def get_parameter(self, name: str):
        raise LookupError(f"{name}: ckpt plans without building the model")


def to_hub(config: dict, shapes: dict[str, tuple[tuple[int, ...], DType]], src: Path) -> dict[str, Planned] | None:
    """What ``save_pretrained`` writes for tensors ``shapes`` (name -> (shape, dtype)) of the
    model ``config`` describes; None when it writes them as they are."""
    transforms = _transforms(config, src)
    return None if transforms is None else _plan(transforms, config, shapes, src, "to_hub")


def to_model(config: dict, shapes: dict[str, tuple[tuple[int, ...], DType]], src: Path) -> dict[str, Planned] | None:
    """What ``from_pretrained`` holds in memory for hub tensors ``shapes`` (the names an FSDP2
    training model's state dict has); None when they are the same."""
    transforms = _transforms(config, src)
    if transforms is None:
        return None
    forward = [t.reverse_transform() for t in transforms][::-1]  # reverting these applies the originals
    return _plan(forward, config, shapes, src, "to_model")


def _lead(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """A tensor as rows: the shape of its rows and the width of one row."""
    return (tuple(shape[:-1]), shape[-1]) if len(shape) >= 2 else (tuple(shape), 1)


def _plan(transforms: list, config: dict, shapes: dict[str, tuple[tuple[int, ...], DType]], src: Path,
          direction: str) -> dict[str, Planned] | None:
    import torch
    from transformers.core_model_loading import WeightConverter, revert_weight_conversion

    reverted = [t.reverse_transform() for t in transforms[::-1]]  # what revert_weight_conversion applies
    converters = [t for t in reverted if isinstance(t, WeightConverter)]
    matched = {}
    for name in shapes:
        conv = next((c for c in converters if c.rename_source_key(name)[1] is not None), None)
        if conv is not None:
            matched[name] = conv
    count = num_experts(config)
    _check_ops(matched, src)
    if direction == "to_model":
        _check_complete(matched, count, src)
    names = list(shapes)
    bases: list[int] = []
    probes: dict[str, Any] = {}
    total = 0
    for i, name in enumerate(names):
        shape = shapes[name][0]
        if name not in matched:
            probes[name] = torch.tensor([-(i + 1)], dtype=torch.int64)  # a whole tensor: only its name moves
            bases.append(-1)
            continue
        if not shape:
            raise BadInput(f"{src}: {name!r} is a scalar; an expert tensor has rows")
        if direction == "to_hub" and count is not None and _GROUPED.search(name) and shape[0] != count:
            raise BadInput(f"{src}: {name!r} holds {shape[0]} experts but config.json says {count} "
                           f"({_count_key(config)}); the config does not describe these weights")
        lead, _ = _lead(shape)
        rows = math.prod(lead)
        probes[name] = torch.arange(total, total + rows, dtype=torch.int64).view(*lead, 1)
        bases.append(total)
        total += rows
    try:
        # the config only for an operation that asks it how many pieces to make (AutoConfig costs seconds)
        asks = any(getattr(op, "num_shards_attribute", None) for c in matched.values() for op in c.operations)
        out = revert_weight_conversion(_Probe(transforms, _config_object(config) if asks else None), probes)
    except Exception as e:  # noqa: BLE001 - transformers' own refusal: the layout cannot be vouched for
        raise BadInput(f"{src}: transformers' conversion registry for {config.get('model_type')!r} does not apply to "
                       f"these names ({type(e).__name__}: {str(e)[:200]}); is an expert tensor missing, or does "
                       "config.json describe another model?") from e
    plan = _read_probes(out, names, shapes, bases, total, src)
    if direction == "to_model" and count is not None:
        for p in plan.values():
            if p.same is None and _GROUPED.search(p.name) and p.shape[0] != count:
                raise BadInput(f"{src}: {p.name!r} would hold {p.shape[0]} experts but config.json says {count} "
                               f"({_count_key(config)})")
    if all(p.same == n for n, p in plan.items()):
        return None
    return plan


def _count_key(config: dict) -> str:
    for cfg in (config, config.get("text_config") or {}):
        for k in COUNT_KEYS:
            if cfg.get(k):
                return f"{k}={cfg[k]}"
    return "no expert count"


def _config_object(config: dict):
    """The config as transformers reads it (an operation may ask it for a count); None when it cannot."""
    try:
        from transformers import AutoConfig

        fields = {k: v for k, v in config.items() if k != "transformers_version"}
        return AutoConfig.for_model(**fields)
    except Exception:  # noqa: BLE001 - only Chunk(num_shards_attribute) asks; its failure is reported then
        return None


def _check_ops(matched: dict, src: Path) -> None:
    for name, conv in matched.items():
        for op in conv.operations:
            if type(op).__name__ not in ROW_OPS:
                raise BadInput(f"{src}: {name!r}: transformers converts it with {type(op).__name__}, which moves "
                               "more than whole rows; ckpt does not plan that layout yet (export it with "
                               "save_pretrained, or keep it in its training format)")


def _check_complete(matched: dict, count: int | None, src: Path) -> None:
    """Per-expert names: every expert 0..count-1 of every kind is there, and no other."""
    groups: dict[str, set[int]] = {}
    for name in matched:
        m = _PER_EXPERT.search(name)  # ``experts.{e}.``: fused names (one per layer) have no index
        if m is None:
            continue
        at, end = m.span(1)
        groups.setdefault(name[:at] + "{}" + name[end:], set()).add(int(m.group(1)))
    for template, have in sorted(groups.items()):
        want = count if count is not None else max(have) + 1
        missing = sorted(set(range(want)) - have)
        extra = sorted(have - set(range(want)))
        if missing:
            raise BadInput(f"{src}: expert tensor {template.format(missing[0])!r} is missing "
                           f"({len(missing)} of {want} experts missing for {template.format('*')!r})")
        if extra:
            raise BadInput(f"{src}: {template.format(extra[0])!r} is expert {extra[0]}, but config.json has {want} "
                           "experts; the config does not describe these weights")


def _read_probes(out: dict, names: list[str], shapes: dict, bases: list[int], total: int,
                 src: Path) -> dict[str, Planned]:
    """The runs each output's probe names; every source row must land exactly once."""
    import torch

    ordered = sorted((b, i) for i, b in enumerate(bases) if b >= 0)
    starts = [b for b, _ in ordered]
    plan: dict[str, Planned] = {}
    used: dict[str, list[tuple[int, int]]] = {}
    whole_used: set[str] = set()
    for out_name, probe in out.items():
        flat = probe.reshape(-1)
        if flat.numel() == 1 and int(flat[0]) < 0:
            name = names[-int(flat[0]) - 1]
            if name in whole_used:
                raise BadInput(f"{src}: {name!r} would be written twice")
            whole_used.add(name)
            plan[out_name] = Planned(out_name, shapes[name][0], name)
            continue
        if probe.dim() < 2 or probe.shape[-1] != 1 or bool((flat < 0).any()):
            raise BadInput(f"{src}: {out_name!r}: transformers' conversion moves more than whole rows of it; "
                           "ckpt does not plan that layout yet")
        cut = torch.nonzero(flat[1:] != flat[:-1] + 1).reshape(-1) + 1
        edges = [0, *cut.tolist(), flat.numel()]
        firsts = flat[edges[:-1]].tolist()
        runs, width, dtype, one_d = [], None, None, None
        for a, b, first in zip(edges, edges[1:], firsts):
            while a < b:  # consecutive numbers may run on into the next source tensor: split there
                k = bisect.bisect_right(starts, first) - 1
                base, i = ordered[k]
                name = names[i]
                shape, dt = shapes[name]
                lead, w = _lead(shape)
                if (width, dtype, one_d) != (None, None, None) and (width, dtype, one_d) != (w, dt, len(shape) == 1):
                    raise BadInput(f"{src}: {out_name!r} would join rows of {name!r} ({list(shape)} {dt}) to rows "
                                   "of another shape or dtype")
                width, dtype, one_d = w, dt, len(shape) == 1
                n = min(b - a, base + math.prod(lead) - first)
                run = Run(name, first - base, a, n)
                runs.append(run)
                used.setdefault(name, []).append((run.src_start, run.rows))
                a, first = a + n, first + n
        shape = tuple(probe.shape[:-1]) + (() if one_d else (width,))
        plan[out_name] = Planned(out_name, shape, None, tuple(runs))
    for name, b in zip(names, bases):
        if b < 0:
            if name not in whole_used:
                raise BadInput(f"{src}: {name!r} maps to nothing in transformers' conversion registry")
            continue
        rows = math.prod(_lead(shapes[name][0])[0])
        spans = sorted(used.get(name, []))
        at = 0
        for s, n in spans:
            if s != at:
                break
            at += n
        if at != rows:
            raise BadInput(f"{src}: rows of {name!r} map to nothing (or twice) in transformers' conversion registry")
    return plan


# -- the plan as byte ranges of the source files ------------------------------------------------

def views(reader: Reader, tensors: dict[str, TensorInfo], plan: dict[str, Planned]) -> dict[str, TensorInfo]:
    """The output tensors of ``plan``, from the source ``tensors`` (by name): a source taken
    whole keeps its chunks under its new name; any other is described as byte ranges of the
    stored chunks' files. Raises BadInput when a chunk is not one contiguous range of bytes."""
    from dataclasses import replace

    out = {}
    for name, p in plan.items():
        if p.same is not None:
            t = tensors[p.same]
            out[name] = t if t.name == name else replace(t, name=name, path=())
            continue
        chunks: list[Chunk] = []
        first = tensors[p.runs[0].source]
        for run in p.runs:
            chunks += _run_chunks(reader, tensors[run.source], run, p.shape)
        covered = sum(c.numel for c in chunks)
        if covered != math.prod(p.shape):
            raise BadInput(f"{name}: its source chunks cover {covered} of {math.prod(p.shape)} elements; "
                           "the checkpoint has a hole or overlapping pieces")
        out[name] = TensorInfo(first.group, name, p.shape, first.dtype, tuple(chunks))
    return out


def _run_chunks(reader: Reader, t: TensorInfo, run: Run, out_shape: tuple[int, ...]) -> list[Chunk]:
    lead, _ = _lead(t.shape)
    one_d = len(t.shape) == 1
    out_lead = tuple(out_shape) if one_d else tuple(out_shape[:-1])  # as :func:`_read_probes` shaped it
    itemsize = DType.of(t.dtype).itemsize
    out: list[Chunk] = []
    seen = set()
    for c in t.chunks:
        box = (c.offsets, c.sizes)
        if box in seen or not c.numel:
            continue
        seen.add(box)
        b_off, b_size = (c.offsets, c.sizes) if one_d else (c.offsets[:-1], c.sizes[:-1])
        col = () if one_d else (c.offsets[-1],)
        cols = () if one_d else (c.sizes[-1],)
        row_bytes = (1 if one_d else c.sizes[-1]) * itemsize
        found = None
        for t_start, length, local in _segments(b_off, b_size, lead):
            a, b = max(t_start, run.src_start), min(t_start + length, run.src_start + run.rows)
            if a >= b:
                continue
            if found is None:
                found = reader.span(t, c, pickled=True)
                if found is None:
                    raise BadInput(f"{t.name}: its piece in {c.location.file} is not stored as one contiguous range "
                                   "of bytes; ckpt cannot take expert rows of it")
            _, offset, _ = found
            local_row = local + (a - t_start)
            o = run.out_start + (a - run.src_start)
            for offs, sizes, flat in _boxes(out_lead, o, b - a):
                first = local_row + (flat - o)
                n = math.prod(sizes)
                loc = Location(c.location.file, "raw", offset + first * row_bytes, n * row_bytes)
                out.append(Chunk((*offs, *col), (*sizes, *cols), loc, c.rank))
    return out


def _segments(off: tuple[int, ...], size: tuple[int, ...], lead: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
    """The rows of a box (``off``/``size`` within rows shaped ``lead``) as runs consecutive in
    the whole tensor: ``(first row, rows, first row within the box)``, in order."""
    if not lead:
        yield 0, 1, 0
        return
    k = len(lead) - 1
    while k > 0 and off[k] == 0 and size[k] == lead[k]:
        k -= 1
    inner = math.prod(lead[k + 1:])
    length = size[k] * inner
    box_inner = math.prod(size[k:])
    for n, idx in enumerate(itertools.product(*(range(s) for s in size[:k]))):
        at = [o + i for o, i in zip(off[:k], idx)] + [off[k]] + [0] * (len(lead) - k - 1)
        flat = 0
        for d, x in zip(lead, at):
            flat = flat * d + x
        yield flat, length, n * box_inner


def _boxes(shape: tuple[int, ...], start: int, length: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Rows ``[start, start + length)`` of an array of rows shaped ``shape`` as boxes
    ``(offsets, sizes, first row)``, in order."""
    if length <= 0:
        return
    if not shape:
        yield (), (), start
        return
    if len(shape) == 1:
        yield (start,), (length,), start
        return
    inner = math.prod(shape[1:])
    end = start + length
    i, r = divmod(start, inner)
    if r:
        n = min(end - start, inner - r)
        for offs, sizes, flat in _boxes(shape[1:], r, n):
            yield (i, *offs), (1, *sizes), i * inner + flat
        start += n
    full = (end - start) // inner
    if full:
        yield (start // inner, *(0,) * (len(shape) - 1)), (full, *shape[1:]), start
        start += full * inner
    if start < end:
        i = start // inner
        for offs, sizes, flat in _boxes(shape[1:], 0, end - start):
            yield (i, *offs), (1, *sizes), i * inner + flat


def hub_tensors(ckpt, names: dict[str, TensorInfo], config: dict, src: Path) -> dict[str, TensorInfo]:
    """``names`` (model tensors by name) as ``save_pretrained`` writes them for an MoE
    ``config`` (unchanged for a dense model, or one already in its hub layout)."""
    if not config or not is_moe(config):
        return names
    plan = to_hub(config, {n: (t.shape, t.dtype) for n, t in names.items()}, src)
    if plan is None:
        return names
    with Reader(ckpt) as reader:
        return views(reader, names, plan)


def model_tensors(ckpt, tensors: list[TensorInfo], config: dict | None, src: Path) -> list[TensorInfo]:
    """Model ``tensors`` under the names (and fused rows) the training model holds, for an MoE
    ``config`` whose hub layout differs; others as they are."""
    model = {t.name: t for t in tensors if t.group == "model"}
    if not config or not is_moe(config):
        return tensors
    plan = to_model(config, {n: (t.shape, t.dtype) for n, t in model.items()}, src)
    if plan is None:
        return tensors
    with Reader(ckpt) as reader:
        mapped = views(reader, model, plan)
    return [*mapped.values(), *(t for t in tensors if t.group != "model")]


# -- what a checkpoint's names say about its experts (no transformers, no config) ----------------

_STACKED = "decoder.layers."  # one tensor for all layers: the experts are its second axis
_ONE_LAYER = re.compile(r"^decoder\.layers\.\d+\.")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "experts_per_token", "num_experts_per_token")


def summary(shapes: dict[str, tuple[int, ...]]) -> dict[str, Any] | None:
    """``{"num_experts", "layout"}`` from names and shapes: ``per_expert`` (the hub's
    ``experts.{e}.``), ``fused`` (``[E, ...]`` tensors: transformers 5 in memory, gpt-oss's hub,
    torchtitan's grouped experts) or ``stacked`` (``[layers, E, ...]``, Megatron-Core); None
    for a dense model."""
    per = [int(m.group(1)) for n in shapes if (m := _PER_EXPERT.search(n))]
    if per:
        return {"num_experts": max(per) + 1, "layout": "per_expert"}
    for name, shape in shapes.items():
        if _GROUPED.search(name) and len(shape) >= 2:
            stacked = name.startswith(_STACKED) and len(shape) >= 3
            # one key per layer (layers not homogeneous: decoder.layers.1.mlp...): no layer axis
            layer_axis = stacked and not _ONE_LAYER.match(name)
            return {"num_experts": shape[1] if layer_axis else shape[0], "layout": "stacked" if stacked else "fused"}
    return None


def routed_params(shapes: dict[str, tuple[int, ...]]) -> int:
    """How many of the parameters belong to routed experts (shared experts and routers not)."""
    return sum(math.prod(s) for n, s in shapes.items() if _PER_EXPERT.search(n) or _GROUPED.search(n))


def active_params(shapes: dict[str, tuple[int, ...]], config: dict) -> int | None:
    """Parameters one token uses: all, less the routed experts it is not sent to
    (``num_experts_per_tok`` of ``num_experts``); None when config.json does not say."""
    total = sum(math.prod(s) for s in shapes.values())
    found = summary(shapes)
    if found is None:
        return total
    cfgs = (config, config.get("text_config") if isinstance(config.get("text_config"), dict) else {})
    k = next((c[key] for c in cfgs for key in TOP_K_KEYS if isinstance(c.get(key), int) and c[key] > 0), None)
    if k is None:
        return None
    e = found["num_experts"]
    return total - routed_params(shapes) * (e - min(k, e)) // e
