"""DeepSpeed ZeRO saves (stages 1, 2 and 3): ``global_stepN/`` beside a ``latest`` file.

What is on disk (DeepSpeed 0.19, one model-parallel rank):
- ``mp_rank_00_model_states.pt`` (stages 1/2) or ``zero_pp_rank_R_mp_rank_00_model_states.pt``
  (stage 3, one per rank): ``module`` (the engine's module weights: fp32, or bf16/fp16 in a
  mixed-precision run; empty placeholders in stage 3), ``buffer_names``, ``param_shapes`` (one ordered
  ``{name: torch.Size}`` per optimizer group, in flat order), ``shared_params``,
  ``global_steps``, ``dp_world_size``, ``ds_config`` (an fp16 run says so only there);
- ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``: ``optimizer_state_dict`` holding the
  stage (``ZeroStageEnum``), the fp32 master partitions of rank R and the wrapped optimizer's
  own state of those partitions (``exp_avg``, ``exp_avg_sq``: the same flat layout; ``step``
  one scalar per group).

Where each parameter's elements lie (pure arithmetic on lengths read from the pickles):
- stages 1/2: each group is its parameters concatenated, ``param_alignment_paddings`` after
  each, then cut into one contiguous partition per rank (``single_partition_of_fp32_groups``);
  the group's padding (``group_paddings``, per rank) sits at its tail, stored in the moments
  but not in the saved master, so a parameter may straddle ranks;
- stage 3: every parameter is cut into ``ceil(n / W)`` elements per rank (the pad at its tail),
  rank R's pieces concatenated group by group (``fp32_flat_groups``).
Each parameter's master and moments are described as rectangles of byte ranges of the rank
files (:func:`ckpt_tools.core.flat.boxes`), never as a group: the engine reads a parameter at
a time. Lengths that do not add up, a forged ``param_shapes`` included, are refused (exit 3);
the pickles are read by ckpt's restricted tree reader (:mod:`ckpt_tools.security.zeroglobals`).
"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path
from typing import Any

from ..codecs.tensornodes import NotSimple, local_of
from ..core.describe import Checkpoint, Chunk, FileEntry, Location, ObjectInfo, TensorInfo
from ..core.flat import boxes
from ..errors import BadInput
from ..security import safefs, zeroglobals
from ..security.torchfile import Reduce, TorchZip
from .shardtree import tensor_location

NAME = "deepspeed"
LATEST = "latest"
MODEL_STATES = "mp_rank_00_model_states.pt"
MODEL3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


def holds_states(d: Path) -> bool:
    return d.is_dir() and ((d / MODEL_STATES).is_file() or any(MODEL3.match(p.name) for p in d.iterdir()))


def detect(path: Path) -> bool:
    if not path.is_dir():
        return False
    if holds_states(path):
        return True
    return (path / LATEST).is_file() and any(holds_states(p) for p in path.iterdir() if p.is_dir())


def step_dir(path: Path) -> Path:
    """The ``global_stepN/`` directory: ``path`` itself, or the one its ``latest`` names."""
    if holds_states(path):
        return path
    tag = safefs.read_capped(path / LATEST, 4096).decode("utf-8", "replace").strip()
    d = safefs.resolve_inside(path, tag, what=f"{path / LATEST}")
    if not holds_states(d):
        raise BadInput(f"{path / LATEST} names {tag!r}, which holds no DeepSpeed model states; "
                       "point at a global_stepN directory")
    return d


def describe(path: Path) -> Checkpoint:
    d = step_dir(path)
    rel = "" if d == path else f"{d.relative_to(path)}/"
    names = sorted(p.name for p in d.iterdir() if p.is_file())
    model3 = {int(m.group(1)): n for n in names if (m := MODEL3.match(n))}
    optim = {int(m.group(2)): n for n in names if (m := OPTIM.match(n))}
    model_file = MODEL_STATES if MODEL_STATES in names else model3.get(0)
    if model_file is None:
        raise BadInput(f"{d}: no {MODEL_STATES} or zero_pp_rank_0_mp_rank_00_model_states.pt")
    mz = zeroglobals.read(d / model_file)
    m = mz.tree
    if not isinstance(m, dict) or not isinstance(m.get("param_shapes"), list):
        raise BadInput(f"{d / model_file}: not DeepSpeed model states (no param_shapes)")
    groups = [_shapes(g, d / model_file) for g in m["param_shapes"]]
    fqns = [fqn for g in groups for fqn, _ in g]
    if len(set(fqns)) != len(fqns):
        raise BadInput(f"{d / model_file}: param_shapes names a parameter twice")
    if m.get("frozen_param_shapes"):
        raise BadInput(f"{d / model_file}: holds frozen parameters ({len(m['frozen_param_shapes'])}), "
                       "which ckpt does not read yet")
    ws = len(optim) or (len(model3) or None)
    for kind, files in (("optimizer", optim), ("model", model3)):
        if files and sorted(files) != list(range(ws)):
            raise BadInput(f"{d}: {kind} states of ranks {sorted(files)}, expected 0..{ws - 1}: a rank's file is "
                           "missing or from another save")
    if optim and m.get("dp_world_size") not in (None, ws):
        raise BadInput(f"{d / model_file}: dp_world_size {m.get('dp_world_size')}, but {ws} optimizer files")
    tensors: list[TensorInfo] = []
    objects: list[ObjectInfo] = []
    facts: dict[str, Any] = {"global_step": m.get("global_steps"), "param_groups": len(groups)}
    if optim:
        files = [rel + optim[r] for r in range(ws)]
        trees = [zeroglobals.read(d / optim[r]) for r in range(ws)]
        stage = _Partitions(groups, files, trees, ws, d)
        tensors += stage.model() + stage.moments()
        objects.append(stage.param_groups())
        facts["zero_stage"] = stage.stage
        facts["mixed_precision"] = "bf16" if optim[0].startswith("bf16_") else _fp16_or_none(m)
    elif model3:
        raise BadInput(f"{d}: no zero_pp_rank_R_mp_rank_00_optim_states.pt: a ZeRO-3 save keeps its weights only "
                       "in the optimizer files (its model states hold none); copy them in beside the model states")
    else:  # stages 1/2 saved without the optimizer (save_checkpoint(exclude_frozen..., optimizer off)): module
        facts["zero_stage"] = None
        tensors += _module_tensors(mz, rel + model_file, fqns, d / model_file)
    tensors += _module_tensors(mz, rel + model_file, m.get("buffer_names") or [], d / model_file)
    if m.get("lr_scheduler") is not None:  # the scheduler's state_dict: the job's extra state elsewhere
        objects.append(ObjectInfo("extra", "lr_scheduler", Location(rel + model_file, "pickled", key=("lr_scheduler",)),
                                  path=("lr_scheduler",)))
    shared = m.get("shared_params") or {}
    by_name = {t.name: t for t in tensors if t.group == "model"}
    for alias, source in (shared.items() if isinstance(shared, dict) else ()):
        if isinstance(alias, str) and source in by_name and alias not in by_name:
            tensors.append(TensorInfo("model", alias, by_name[source].shape, by_name[source].dtype,
                                      by_name[source].chunks))
    entries = [FileEntry(rel + n, (d / n).stat().st_size) for n in names if n == model_file or n in model3.values()
               or n in optim.values()]
    details = {"facts": facts, "optimizer_keyed": "fqn" if optim else None}
    return Checkpoint(NAME, path, ws, tuple(tensors), tuple(objects), tuple(entries), None, details, tuple(fqns))


def _fp16_or_none(m: dict) -> str | None:
    """``"fp16"`` for a save of an fp16 run (its files are named as an fp32 run's): what its
    ``ds_config`` says, as DeepSpeed reads it."""
    cfg = m.get("ds_config")
    fp16 = cfg.get("fp16") if isinstance(cfg, dict) else None
    return "fp16" if isinstance(fp16, dict) and fp16.get("enabled") is True else None


def _shapes(group: Any, where: Path) -> list[tuple[str, tuple[int, ...]]]:
    if not isinstance(group, dict):
        raise BadInput(f"{where}: param_shapes holds a {type(group).__name__}, not a map of names to shapes")
    out = []
    for fqn, size in group.items():
        shape = size.args[0] if type(size) is Reduce and size.func.name == "Size" and len(size.args) == 1 else size
        if not isinstance(fqn, str) or not isinstance(shape, tuple) or len(shape) > 8 or not all(
                type(s) is int and 0 <= s < 1 << 40 for s in shape):
            raise BadInput(f"{where}: param_shapes entry {fqn!r}: {shape!r} is not a shape")
        out.append((fqn, shape))
    return out


def _module_tensors(zf: TorchZip, file: str, names, where: Path) -> list[TensorInfo]:
    """Tensors of the saved ``module`` (buffers; the weights when no optimizer file is there)."""
    module = zf.tree.get("module")
    out = []
    for name in names:
        node = module.get(name) if isinstance(module, dict) else None
        local = _local(node, where, name)
        out.append(TensorInfo("model", name, local.size, local.dtype,
                              (Chunk((0,) * len(local.size), local.size, tensor_location(zf, file, local)),)))
    return out


def _local(node: Any, where: Path, name: str):
    try:
        local = local_of(zeroglobals.plain_tensor(node))
    except NotSimple as e:
        raise BadInput(f"{where}: {name}: {e}") from None
    if local is None:
        raise BadInput(f"{where}: {name} is not a stored tensor")
    return local


def _nth(values: Any, g: int, groups: int) -> Any:
    """``values[g]`` of a per-group list (0 where none was saved); None where it is not one."""
    if values is None:
        return 0
    return values[g] if isinstance(values, list) and len(values) == groups else None


class _Partitions:
    """The rank files' flat partitions, read as where each parameter's elements lie."""

    def __init__(self, groups, files: list[str], trees: list[TorchZip], ws: int, where: Path) -> None:
        self.groups, self.files, self.zips, self.ws, self.where = groups, files, trees, ws, where
        self.osd = []
        for r, zf in enumerate(trees):
            osd = zf.tree.get("optimizer_state_dict") if isinstance(zf.tree, dict) else None
            if not isinstance(osd, dict) or "zero_stage" not in osd:
                raise BadInput(f"{where / Path(files[r]).name}: not a ZeRO optimizer state (no zero_stage)")
            self.osd.append(osd)
        self.stage = zeroglobals.enum_value(self.osd[0]["zero_stage"])
        if self.stage not in (1, 2, 3) or any(zeroglobals.enum_value(o["zero_stage"]) != self.stage for o in self.osd):
            raise BadInput(f"{where}: ZeRO stage {self.stage!r} (ranks disagree or unknown)")
        key, inner = (("fp32_flat_groups", "optimizer_state_dict") if self.stage == 3
                      else ("single_partition_of_fp32_groups", "base_optimizer_state"))
        self.base = [o.get(inner) for o in self.osd]
        self.master = [[_local(n, where, f"{key}[{g}]") for g, n in enumerate(o.get(key) or [])] for o in self.osd]
        for r, parts in enumerate(self.master):
            if len(parts) != len(groups) or any(len(p.size) != 1 for p in parts):
                raise BadInput(f"{self._file(r)}: {len(parts)} flat {key}, but param_shapes lists {len(groups)} groups")
        self.spans = [self._spans(g) for g in range(len(groups))]  # [group][rank] -> [(fqn, shape, a, b, at)]

    def _file(self, r: int) -> Path:
        return self.where / Path(self.files[r]).name

    def _spans(self, g: int) -> list[list[tuple]]:
        params = self.groups[g]
        lengths = [self.master[r][g].size[0] for r in range(self.ws)]
        if self.stage == 3:
            per = [-(-math.prod(s) // self.ws) for _, s in params]
            if any(n != sum(per) for n in lengths):
                raise BadInput(f"{self.where}: group {g}'s stage-3 partitions hold {lengths} elements, but "
                               f"param_shapes gives {sum(per)} per rank; param_shapes or the partitions are forged")
            out = []
            for r in range(self.ws):
                spans, at = [], 0
                for (fqn, shape), p in zip(params, per):
                    a, b = min(r * p, math.prod(shape)), min((r + 1) * p, math.prod(shape))
                    spans.append((fqn, shape, a, b, at))
                    at += p
                out.append(spans)
            return out
        align = _nth(self.osd[0].get("param_alignment_paddings"), g, len(self.groups))
        align = [0] * len(params) if align == 0 else align
        pads = [_nth(o.get("group_paddings"), g, len(self.groups)) for o in self.osd]
        if (not isinstance(align, list) or len(align) != len(params)
                or not all(type(x) is int and x >= 0 for x in [*align, *pads])):
            raise BadInput(f"{self._file(0)}: group {g}'s paddings do not match its {len(params)} parameters")
        pos, at = [], 0
        for (_, shape), pad in zip(params, align):
            pos.append(at)
            at += math.prod(shape) + pad
        if sum(lengths) not in (at, at - (align[-1] if align else 0)):
            raise BadInput(f"{self.where}: group {g}'s partitions hold {sum(lengths)} elements ({lengths} by rank), "
                           f"but param_shapes and its paddings make {at}; they do not add up")
        for r in range(self.ws):
            if pads[r] and any(lengths[q] for q in range(r + 1, self.ws)):
                raise BadInput(f"{self._file(r)}: group {g} is padded on rank {r} before ranks that hold elements")
        out, start = [], 0
        for r in range(self.ws):
            lo, hi = start, start + lengths[r]
            spans = []
            for (fqn, shape), p in zip(params, pos):
                n = math.prod(shape)
                a, b = max(lo, p), min(hi, p + n)
                if a < b:
                    spans.append((fqn, shape, a - p, b - p, a - lo))
            out.append(spans)
            start = hi + pads[r]
        return out

    def _tensors(self, group: str, state: str | None, node_of) -> list[TensorInfo]:
        out = []
        for g, params in enumerate(self.groups):
            chunks: dict[str, list[Chunk]] = {fqn: [] for fqn, _ in params}
            dtype = None
            for r in range(self.ws):
                local = _local(node_of(r, g), self._file(r), f"group {g} {state or 'master'}")
                if len(local.size) != 1 or local.size[0] < self.master[r][g].size[0]:
                    raise BadInput(f"{self._file(r)}: group {g} {state} holds {local.size}, shorter than its "
                                   f"partition of {self.master[r][g].size[0]}")
                dtype = local.dtype
                loc = tensor_location(self.zips[r], self.files[r], local)
                size = dtype.itemsize
                for fqn, shape, a, b, at in self.spans[g][r]:
                    for offsets, sizes in boxes(shape, a, b):
                        first = sum(o * math.prod(shape[k + 1:]) for k, o in enumerate(offsets))
                        chunks[fqn].append(Chunk(offsets, sizes, Location(
                            loc.file, "raw", loc.offset + (at + first - a) * size, math.prod(sizes) * size), r))
            for fqn, shape in params:
                name = fqn if state is None else f"state.{fqn}.{state}"
                out.append(TensorInfo(group, name, shape, dtype, tuple(chunks[fqn]),
                                      None if state is None else fqn, state))
        return out

    def model(self) -> list[TensorInfo]:
        return self._tensors("model", None, lambda r, g: self.master[r][g].node)

    def _state(self, r: int) -> dict:
        state = self.base[r].get("state") if isinstance(self.base[r], dict) else None
        if not isinstance(state, dict):
            raise BadInput(f"{self._file(r)}: its optimizer holds no state dict")
        return state

    def moments(self) -> list[TensorInfo]:
        first = self._state(0)
        names = list(first.get(0, {})) if isinstance(first.get(0), dict) else []
        out = []
        for state in names:
            if not _local(first[0][state], self._file(0), f"group 0 {state}").size:
                # step: one scalar per group, each of its parameters' 
                for g, params in enumerate(self.groups):
                    node = _local(self._state(0).get(g, {}).get(state), self._file(0), f"group {g} {state}")
                    loc = tensor_location(self.zips[0], self.files[0], node)
                    out += [TensorInfo("optimizer", f"state.{fqn}.{state}", (), node.dtype, (Chunk((), (), loc, 0),),
                                       fqn, state) for fqn, _ in params]
                continue

            def node_of(r: int, g: int, state=state) -> Any:
                entry = self._state(r).get(g)
                return entry.get(state) if isinstance(entry, dict) else None

            out += self._tensors("optimizer", state, node_of)
        return out

    def param_groups(self) -> ObjectInfo:
        saved = self.base[0].get("param_groups") if isinstance(self.base[0], dict) else None
        if not isinstance(saved, list) or len(saved) != len(self.groups) or not all(isinstance(g, dict) for g in saved):
            raise BadInput(f"{self._file(0)}: param_groups do not match the {len(self.groups)} groups of param_shapes")
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [fqn for fqn, _ in params]}
                  for g, params in zip(saved, self.groups)]
        try:
            literal = repr(groups)
            if ast.literal_eval(literal) != groups:
                raise ValueError(literal[:80])
        except (ValueError, SyntaxError, RecursionError) as e:
            raise BadInput(f"{self._file(0)}: param_groups hold more than plain values ({e})") from None
        return ObjectInfo("optimizer", "param_groups", Location("", "value", key=(literal,)),
                          path=("optimizer", "param_groups"))
