"""``ckpt shard``: lay a Hugging Face model out as the checkpoint an N-rank FSDP2 job would save.

Every rank builds the model on the meta device, wraps it with ``fully_shard`` (each transformer
block, then the root), materialises only its own shards and fills them by reading just its rows
of each tensor from the safetensors files (plain reads at header offsets, no mmap), so no rank
ever holds, or maps, the whole model. The result is
written as per-rank ``sharded`` files (verl's layout) or as a DCP directory, atomically.

This module is the command: options, the model's files, the source tensors and the destination
are checked here, before any rank starts; then the ranks are launched. What each rank does, in
order, is :mod:`.shard_job`.
"""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import replace
import tempfile
from pathlib import Path
from typing import Any

from ..errors import BadInput, DestinationError, UsageError, count
from ..formats import hf
from ..hf import archcheck
from ..formats.sharded import CONFIG_NAME, file_name
from ..hf import assets as hfassets
from ..hf.assets import ASSET_PATTERNS, asset_names
from ..naming import quant
from ..hf.hub import resolve_model_dir
from ..hf.models import model_class, require_transformers
from ..naming import experts
from ..runtime import env, launch
from ..storage import atomic, manifest
from .convert import export
from .options import note
from .report import files_report, finish, recording_notes
from .urls import accepts_urls
from .shard_job import MIXED_PRECISION, ShardJob, SourceTensor, build_meta_model, load_config, plan_reads, rank_main, stage

FORMATS = ("sharded", "dcp")
OPTIMIZERS = ("adamw",)


@accepts_urls(sources=(), dest="dst")  # DST may be an object-storage URL (published marker-last)
def shard(model: str, dst: str | Path, *, ranks: int, format: str = "sharded", device: str = "cpu",
          mixed_precision: str | None = None, cpu_offload: bool = False,
          with_optimizer: str | None = None, overwrite: bool = False, check: bool = False,
          progress: bool = True, dry_run: bool = False) -> dict[str, Any]:
    """Write ``model`` (a local HF directory or a hub id) as an FSDP2 checkpoint of ``ranks`` ranks.

    Spawns the ranks (gloo on CPU, NCCL on CUDA), or, inside ``torchrun`` or an initialised
    process group, runs only this process's rank. ``format="sharded"`` writes verl's
    ``model_world_size_{N}_rank_{r}.pt`` (+ ``optim_...`` with ``with_optimizer``),
    ``fsdp_config.json`` and ``huggingface/``; ``format="dcp"`` writes ``dcp.save`` of
    ``{"model": ..., "optimizer": ...}`` with the same ``huggingface/`` beside it (so ``export``
    needs no ``--base``). ``mixed_precision`` and ``cpu_offload`` set the FSDP
    policies of the job (they change the ``check`` forward pass, not what is saved).

    Returns ``{"dst", "ranks", "format", "device", "params", "bytes", "peak_rss_bytes": [per
    rank]}``, plus ``"peak_device_bytes"`` on CUDA and ``"max_abs_diff"`` (sharded forward vs
    ``from_pretrained`` on rank 0) with ``check``, and the keys every writing command reports
    (``world_size``, ``num_tensors``, ``total_bytes``, ``dtype``, ``dtypes``, ``files``,
    ``written_bytes``, ``notes``, ``dry_run``: :mod:`ckpt_tools.commands.report`), as ``ckpt shard
    --json`` prints it. ``dry_run``: the model's files are read and the model built on the meta
    device, no rank starts and nothing is written.

    Example: ``shard("Qwen/Qwen2.5-0.5B", "ckpt/actor", ranks=8, with_optimizer="adamw")``

    Memory: each rank holds 1/N of the weights (3/N with the optimizer) plus a constant; only
    ``check`` loads a full reference copy, on rank 0.

    Limits: safetensors sources, architectures transformers ships (no remote code); parameters
    keep the files' dtypes (no fp32 master copy); the optimizer state is fresh (zero moments,
    step 0, AdamW's default hyper-parameters, which ``load_state_dict`` hands to the loading
    optimizer); under torchrun on several hosts DST must be on a file system all ranks see.
    """
    with recording_notes() as notes:
        report = _shard(model, dst, ranks=ranks, format=format, device=device, mixed_precision=mixed_precision,
                        cpu_offload=cpu_offload, with_optimizer=with_optimizer, overwrite=overwrite, check=check,
                        progress=progress, dry_run=dry_run)
    return finish(report, notes, dry_run=dry_run)


def _shard(model: str, dst: str | Path, *, ranks: int, format: str, device: str, mixed_precision: str | None,
           cpu_offload: bool, with_optimizer: str | None, overwrite: bool, check: bool, progress: bool,
           dry_run: bool) -> dict[str, Any]:
    _check_options(ranks, format, mixed_precision, with_optimizer)
    talk = progress and env.rank() == 0 and not dry_run
    stage(talk, f"loading {model}: torch, its config and the safetensors headers")
    require_transformers("`ckpt shard` (it builds the model to shard it)")
    launch.check_device(device)
    dst = Path(dst).expanduser().absolute()
    if dry_run:
        atomic.check_destination(None, dst, overwrite=overwrite, dry_run=True)
    else:
        check_destination(dst, overwrite)
    model_dir = fetch_model(model)
    atomic.check_destination(model_dir, dst, overwrite=overwrite)
    plain = None if dry_run else dequantized(model_dir, dst, talk)  # a quantized model: its dequantized copy
    try:
        return _shard_dir(plain / "model" if plain else model_dir, dst, ranks=ranks, format=format, device=device,
                          mixed_precision=mixed_precision, cpu_offload=cpu_offload, with_optimizer=with_optimizer,
                          overwrite=overwrite, check=check, progress=progress, talk=talk, dry_run=dry_run)
    finally:
        if plain is not None:
            shutil.rmtree(plain, ignore_errors=True)


def _shard_dir(model_dir: Path, dst: Path, *, ranks: int, format: str, device: str, mixed_precision: str | None,
               cpu_offload: bool, with_optimizer: str | None, overwrite: bool, check: bool, progress: bool,
               talk: bool, dry_run: bool) -> dict[str, Any]:
    sources = training_names(model_dir, read_sources(model_dir))
    config = load_config(model_dir)
    ignored = ignored_on_load(model_dir, config, sources)
    if ignored:
        note(f"note: leaving out {', '.join(ignored)}, which from_pretrained ignores too")
        sources = {k: v for k, v in sources.items() if k not in ignored}
    # On meta, cheap: a config that does not fit the weights fails here, before any rank starts.
    planned = _plan(build_meta_model(config, sources), model_dir, dst, ranks, format, with_optimizer)
    files, extra = planned.pop("_files"), planned.pop("_extra")
    if dry_run:
        return {"dst": str(dst), "ranks": ranks, "format": format, "device": device, **planned,
                **files_report(dst, files, dry_run=True, extra_files=extra)}
    spawn = launch.will_spawn()
    tmp = atomic.make_staging(dst) if spawn else None
    job = ShardJob(str(model_dir), str(dst), str(tmp) if tmp else None, ranks, format, device,
                   mixed_precision, cpu_offload, with_optimizer, overwrite, check, progress,
                   tuple(sources.values()))
    if spawn:
        stage(talk, f"starting {count(ranks, 'rank')} ({launch.backend_for(device)}): each loads torch and builds "
                    f"the model on the meta device")
    try:
        report = launch.run(rank_main, job, ranks=ranks, device=device)
        return {**planned, **report, **files_report(dst, files, dry_run=False)}
    finally:
        if tmp is not None and tmp.exists():  # a rank failed or was interrupted
            shutil.rmtree(tmp, ignore_errors=True)


def _plan(meta_model, model_dir: Path, dst: Path, ranks: int, format: str, with_optimizer: str | None) -> dict[str, Any]:
    """What the job will save, from the model on the meta device: its state dict and, with an
    optimizer, AdamW's ``step``, ``exp_avg`` and ``exp_avg_sq`` per parameter (counted as
    ``inspect`` counts them), and the files it writes (``_files``, ``_extra``: for the report)."""
    state = meta_model.state_dict()
    dtypes = [(str(t.dtype).removeprefix("torch."), t.numel(), t.numel() * t.element_size()) for t in state.values()]
    per_param = 0
    if with_optimizer:
        params = list(dict.fromkeys(meta_model.parameters()))  # tied weights once, as the optimizer holds them
        per_param = 3
        for p in params:
            kind = str(p.dtype).removeprefix("torch.")
            dtypes += [("float32", 1, 4), (kind, p.numel(), p.numel() * p.element_size()),
                       (kind, p.numel(), p.numel() * p.element_size())]
    counts = Counter(d for d, _, _ in dtypes)
    numel: Counter = Counter()
    for d, n, _ in dtypes[:len(state)]:
        if d.startswith(("float", "bfloat")):
            numel[d] += n
    files: dict[str, tuple[int | None, int | None]] = {}
    n_opt = per_param * len(list(dict.fromkeys(meta_model.parameters()))) if with_optimizer else 0
    if format == "dcp":
        files.update({f"__{r}_0.distcp": (None, None) for r in range(ranks)})
        extra = [".metadata"]
    else:
        for r in range(ranks):
            files[file_name("model", ranks, r)] = (len(state), None)
            if with_optimizer:
                files[file_name("optim", ranks, r)] = (n_opt, None)
        extra = [CONFIG_NAME]
    extra += [f"huggingface/{n}" for n in asset_names(model_dir)] + [manifest.NAME]
    return {"world_size": ranks, "num_tensors": len(dtypes), "total_bytes": sum(b for _, _, b in dtypes),
            "dtypes": dict(sorted(counts.items())), "dtype": numel.most_common(1)[0][0] if numel else None,
            "_files": files, "_extra": extra}
def dequantized(model_dir: Path, dst: Path, talk: bool) -> Path | None:
    """A quantized model (block FP8, MXFP4, compressed-tensors FP8) dequantized to its config's
    dtype (bfloat16 when it names none) into ``model/`` of a temporary folder beside ``dst``
    (returned; removed once the ranks are done), which the ranks then read as any model; None
    for a model that is not quantized."""
    config = hfassets.read_config(model_dir)
    if quant.config_of(config) is None:
        return None
    if not launch.will_spawn():
        raise BadInput(f"{model_dir}: is quantized ({quant.config_of(config).get('quant_method')}); under torchrun "
                       "dequantize it first (ckpt export MODEL DIR --dtype bf16) and shard DIR")
    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(name, "bf16")
    stage(talk, f"dequantizing {model_dir} to {name} (beside {dst.name})")
    out = Path(tempfile.mkdtemp(prefix=f".{dst.name}.dequantized-", dir=dst.parent)) / "model"
    try:
        export(model_dir, out, dtype=dtype, progress=talk)
    except BaseException:
        shutil.rmtree(out.parent, ignore_errors=True)
        raise
    return out.parent


def _check_options(ranks: int, format: str, mixed_precision: str | None, with_optimizer: str | None) -> None:
    if not isinstance(ranks, int) or ranks < 1:
        raise UsageError(f"--ranks {ranks}: must be a positive integer")
    if format not in FORMATS:
        raise UsageError(f"--format {format!r}: choose one of {', '.join(FORMATS)}")
    if mixed_precision is not None and mixed_precision not in MIXED_PRECISION:
        raise UsageError(f"--mixed-precision {mixed_precision!r}: choose one of {', '.join(MIXED_PRECISION)}")
    if with_optimizer is not None and with_optimizer not in OPTIMIZERS:
        raise UsageError(f"--with-optimizer {with_optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")


# ---------------------------------------------------------------- source and destination


def fetch_model(model: str) -> Path:
    """The local directory of ``model``; from the hub, only config, tokenizer and safetensors."""

    base = resolve_model_dir(model, allow_patterns=[*ASSET_PATTERNS, hf.INDEX_NAME, hf.SINGLE_NAME])
    index = base / hf.INDEX_NAME
    if index.is_file():  # now the shards the index names, and nothing else
        base = resolve_model_dir(model, allow_patterns=[*ASSET_PATTERNS, hf.INDEX_NAME,
                                                        *sorted(set(hf.read_index(index).values()))])
    if not (base / "config.json").is_file():
        raise BadInput(f"{model}: no config.json; `ckpt shard` needs a Hugging Face model directory")
    return base


def read_sources(model_dir: Path) -> dict[str, SourceTensor]:
    """Every tensor of the model's safetensors files, from their headers."""
    if not hf.detect(model_dir):
        found = "pytorch_model*.bin weights" if any(model_dir.glob("pytorch_model*.bin")) else "no weights"
        raise BadInput(f"{model_dir}: {found}; `ckpt shard` reads safetensors - convert first with "
                       f"`ckpt convert {model_dir} DIR --to hf`")
    base, files, _ = hf.shard_files(model_dir)
    sources: dict[str, SourceTensor] = {}
    for name in files:
        header, data_start = hf.read_header(hf.safe_relative(base, name, what=str(base)))
        for key, entry in header.items():
            if key in sources:
                raise BadInput(f"{base / name}: tensor {key!r} is also in {sources[key].file}")
            sources[key] = SourceTensor(key, name, entry.shape, hf.DTYPES[entry.dtype], data_start + entry.begin)
    return sources


def training_names(model_dir: Path, sources: dict[str, SourceTensor]) -> dict[str, SourceTensor]:
    """The sources under the names the model holds in memory, where its hub layout differs
    (Mixture-of-Experts: per-expert tensors fused, :mod:`ckpt_tools.naming.experts`); a tensor
    made of rows of several is read as their byte ranges, in order."""
    config = hfassets.read_config(model_dir)
    plan = experts.to_model(config, {k: (s.shape, s.dtype) for k, s in sources.items()}, model_dir) \
        if experts.is_moe(config) else None
    if plan is None:
        return sources
    out = {}
    for name, p in plan.items():
        if p.same is not None:
            out[name] = replace(sources[p.same], name=name)
            continue
        parts = []
        for run in p.runs:
            s = sources[run.source]
            row = (s.shape[-1] if len(s.shape) > 1 else 1) * s.dtype.itemsize
            parts.append((s.file, s.offset + run.src_start * row, run.rows * row))
        first = sources[p.runs[0].source]
        out[name] = SourceTensor(name, parts[0][0], p.shape, first.dtype, parts[0][1], tuple(parts))
    return out


def check_destination(dst: Path, overwrite: bool) -> None:
    """Before any download or rank: an existing DST needs ``overwrite``; its folder must exist."""
    atomic.check_destination(None, dst, overwrite=overwrite)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DestinationError(f"{dst.parent}: cannot create the destination's folder ({e.strerror})") from e


def ignored_on_load(model_dir: Path, config, sources: dict[str, SourceTensor]) -> list[str]:
    """Source tensors the model has no place for that ``from_pretrained`` skips without a word
    (BERT's old ``position_ids``, rotary ``inv_freq``): asked of ``from_pretrained`` itself
    (:mod:`ckpt_tools.hf.archcheck`). What it would call unexpected stays, for :func:`.shard_job.plan_reads` to refuse."""
    import torch

    with torch.device("meta"):
        model = model_class(config)._from_config(config)
    used = {r.source.name for r in plan_reads(model, sources, world_size=1, rank=0, check_extra=False)}
    shapes = {k: (s.shape, str(s.dtype).removeprefix("torch.")) for k, s in sources.items()}
    return archcheck.ignored(model_dir / "config.json", shapes, set(sources) - used)
