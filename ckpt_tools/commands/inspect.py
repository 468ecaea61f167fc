"""``ckpt inspect``: what a checkpoint is and what it holds, from headers and metadata."""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

from ..core.describe import GROUPS, Checkpoint, dtype_name, holders, layout_key
from ..layouts import describe, layout_of
from ..hf import archcheck
from ..hf import assets as hfassets
from ..naming import experts, lora, quant
from ..naming.wrappers import normalize_name
from ..engine.reader import Reader
from .latest import holds_checkpoints, run_listing
from .urls import accepts_urls


@accepts_urls(sources=("path",), need="headers")
def inspect(path: str | Path, *, tensors: bool = False) -> dict[str, Any]:
    """Describe the checkpoint at ``path`` as CONTRACT.md's ``inspect --json`` object.

    Example: ``ckpt_tools.inspect("ckpt/global_step_100/actor")["world_size"]``.
    Reads headers and metadata only, plus the optimizer's scalar ``step`` when there is one.
    A directory holding checkpoints rather than being one (a run) gives :func:`run_listing`'s
    object instead: ``{"run", "latest", "checkpoints": [...]}``.
    """
    if holds_checkpoints(path):
        return run_listing(path)
    ckpt = describe(path, read_only=True)
    return summarize(ckpt, tensors=tensors)


def summarize(ckpt: Checkpoint, *, tensors: bool = False) -> dict[str, Any]:
    groups: dict[str, dict[str, int]] = {}
    for g in GROUPS:
        ts = ckpt.group(g)
        objs = [o for o in ckpt.objects if o.group == g]
        if ts or objs:
            groups[g] = {"num_tensors": len(ts), "total_bytes": sum(t.nbytes for t in ts),
                         "num_objects": len({o.name for o in objs})}
    out: dict[str, Any] = {
        "format": ckpt.format,
        "path": str(ckpt.root),
        "world_size": ckpt.world_size,
        "num_tensors": len(ckpt.tensors),
        "total_bytes": ckpt.total_bytes,
        "groups": groups,
        "dtypes": dict(Counter(dtype_name(t.dtype) for t in ckpt.tensors)),
        "num_files": len(ckpt.files),
        "file_bytes": sum(f.size for f in ckpt.files),
    }
    if ckpt.mesh_shape:
        out["mesh_shape"] = list(ckpt.mesh_shape)
    out["lora"] = lora.summary(ckpt)
    model = {t.name: t.shape for t in ckpt.group("model")}
    config = _config(ckpt)
    out["params"] = _params({normalize_name(n): s for n, s in model.items()}, config)
    out["moe"] = experts.summary({normalize_name(n): s for n, s in model.items()})
    out["quantization"] = quant.summary(list(ckpt.tensors), config, ckpt.root)
    if ckpt.details.get("fsdp"):
        out["fsdp"] = ckpt.details["fsdp"]
    out.update(layout_of(ckpt).to_json())
    out.update(ckpt.details.get("facts") or {})  # what a format says of itself (a ZeRO save's stage, step)
    if "optimizer" in groups:
        out["optimizer"] = _optimizer(ckpt)
    extra = sorted({str(o.path[0]) if o.path else o.name for o in ckpt.objects if o.group == "extra"})
    if extra:
        out["extra_state"] = extra
    if ckpt.world_size and ckpt.format == "sharded":
        out["bytes_per_rank"] = _bytes_per_rank(ckpt)
    if tensors:
        out["tensors"] = [{"name": t.name, "group": t.group, "shape": list(t.shape), "dtype": dtype_name(t.dtype)}
                          for t in ckpt.tensors]
    return out


def _bytes_per_rank(ckpt: Checkpoint) -> list[int]:
    """Each rank's bytes of tensors. The tensors of one chunk layout (``layout_key``) hold the
    same elements on each rank: their chunks are walked once, by the bytes of an element of all
    of them (25k tensors on 16 ranks walked 400k chunks; a model's tensors are a few layouts)."""
    layouts: dict[Any, list] = {}  # layout (or a tensor's id) -> [its chunks, bytes an element]
    for t in ckpt.tensors:
        key = layout_key(t.chunks)
        got = layouts.setdefault(key if key is not None else id(t), [t.chunks, 0])
        got[1] += t.nbytes // max(t.numel, 1)
    per_rank = Counter()
    for chunks, itemsize in layouts.values():
        for rank, sizes in holders(chunks):
            if rank is not None:
                per_rank[rank] += math.prod(sizes) * itemsize
    return [per_rank.get(r, 0) for r in range(ckpt.world_size)]


def _params(model: dict[str, tuple[int, ...]], config: dict) -> int:
    """The model's parameter count: its tensors, less those its class holds as buffers."""
    return sum(math.prod(s) for s in archcheck.parameters_only(model, config).values())


def _config(ckpt: Checkpoint) -> dict:
    """The config.json beside the checkpoint (or in its huggingface/ folder), {} without one."""
    try:
        return hfassets.read_config(hfassets.find_assets(ckpt.root, None))
    except Exception:  # an unreadable config is not this report's to refuse
        return {}


def _optimizer(ckpt: Checkpoint) -> dict[str, Any]:
    states = {t.state for t in ckpt.group("optimizer") if t.state}
    kind = "Adam/AdamW" if {"exp_avg", "exp_avg_sq"} <= states else ("SGD (momentum)" if "momentum_buffer" in states else None)
    info: dict[str, Any] = {"type": kind, "states": sorted(states),
                            "keyed": ckpt.details.get("optimizer_keyed"),
                            "params": len({t.param for t in ckpt.group("optimizer") if t.param})}
    if ckpt.details.get("optimizer_flat"):
        info["flat_parameters"] = True  # FSDP1 flat-parameter state: not mapped to parameters
    step = next((t for t in ckpt.group("optimizer") if t.state == "step" and t.numel == 1), None)
    if step is not None:
        with Reader(ckpt) as r:
            # from its bytes: importing torch for one number would cost seconds
            value = r.scalar(step)
            info["step"] = value if value is not None else r.full(step).item()
    return info


def format_summary(info: dict[str, Any]) -> str:
    """The human-readable form of :func:`inspect`'s result."""
    lines = [f"{info['path']}",
             f"  format      {info['format']}" + (f", {info['layout']} layout" if info.get("layout") else "")
             + (f", FSDP{info['fsdp_version']}" if info.get("fsdp_version") else ""),
             f"  world size  {info['world_size'] if info['world_size'] is not None else '- (unsharded)'}"
             + (f", mesh {tuple(info['mesh_shape'])}" if info.get("mesh_shape") else "")
             + (f", {info['fsdp']}" if info.get("fsdp") else "")
             + (f", ZeRO stage {info['zero_stage']}" if info.get("zero_stage") else "")
             + (f", global step {info['global_step']}" if info.get("global_step") is not None else ""),
             f"  tensors     {info['num_tensors']} ({human_bytes(info['total_bytes'])})",
             f"  files       {info['num_files']} ({human_bytes(info['file_bytes'])} on disk)",
             "  dtypes      " + ", ".join(f"{k} {v}" for k, v in sorted(info["dtypes"].items())),
             "  groups"]
    for g, s in info["groups"].items():
        objs = f", {s['num_objects']} other entries" if s.get("num_objects") else ""
        lines.append(f"    {g:<10}{s['num_tensors']:>6} tensors  {human_bytes(s['total_bytes']):>10}{objs}")
    if "optimizer" in info:
        o = info["optimizer"]
        step = f", step {o['step']:g}" if isinstance(o.get("step"), (int, float)) else ""
        if o.get("flat_parameters"):
            lines.append("  optimizer   FSDP1 flat-parameter state (not mapped to parameters; reshard refuses it)")
        else:
            lines.append(f"  optimizer   {o['type'] or 'unknown'} over {o['params']} parameters "
                         f"({', '.join(o['states'])}; {o['keyed']}-keyed{step})")
    if info.get("extra_state"):
        lines.append("  extra state " + ", ".join(info["extra_state"]))
    if info.get("side_files"):
        files = info["side_files"]
        lines.append(f"  side files  {', '.join(files[:6])}" + (f" ... ({len(files)} in all)" if len(files) > 6 else ""))
    if info.get("lora"):
        lo = info["lora"]
        lines.append(f"  LoRA        rank {lo['rank']}, alpha {lo['alpha'] if lo['alpha'] is not None else 'unknown'}, "
                     f"targets {', '.join(lo['target_modules'])}"
                     + ("; adapter weights only (no base model)" if lo["adapter_only"] else ""))
    if info.get("moe"):
        lines.append(f"  experts     {info['moe']['num_experts']} routed, {info['moe']['layout'].replace('_', '-')} layout")
    if info.get("quantization"):
        q = info["quantization"]
        how = q.get("block_size") or q.get("scheme")
        lines.append(f"  quantized   {q['method']}" + (f" {how}" if how else "")
                     + (f", {q['quantized_tensors']} weights" if q.get("quantized_tensors") is not None else "")
                     + (f" (cannot be dequantized: {q['error']})" if q.get("error") else ""))
    if info.get("bytes_per_rank"):
        b = info["bytes_per_rank"]
        lines.append(f"  per rank    {human_bytes(min(b))} .. {human_bytes(max(b))} of tensors")
    if info.get("tensors"):
        lines.append("  tensors:")
        width = max(len(t["name"]) for t in info["tensors"])
        for t in info["tensors"]:
            lines.append(f"    {t['group']:<10}{t['name']:<{width}}  {t['dtype']:<9} {tuple(t['shape'])}")
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_run(info: dict[str, Any]) -> str:
    """The human-readable table of :func:`~ckpt_tools.commands.latest.run_listing`."""
    rows = [("step", "path", "format", "layout", "ranks", "size", "complete")]
    for c in info["checkpoints"]:
        rel = os.path.relpath(c["path"], info["run"])
        rows.append((str(c["step"]) if c["step"] is not None else "-", c["path"] if rel == "." else rel,
                     c["format"] or "-", c["layout"], str(c["world_size"] or "-"), human_bytes(c["size"]),
                     "yes" if c["complete"] else "no: " + "; ".join(c["missing"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = [info["run"]]
    lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    lines.append(f"  latest complete: {info['latest'] or 'none'}")
    lines += [f"  note: {n}" for n in info.get("notes", [])]
    return "\n".join(lines)
