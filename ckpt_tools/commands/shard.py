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
from pathlib import Path
from typing import Any

from ..errors import BadInput, DestinationError, UsageError, count
from ..formats import hf
from ..hf import archcheck
from ..hf.assets import ASSET_PATTERNS
from ..hf.hub import resolve_model_dir
from ..hf.models import model_class, require_transformers
from ..runtime import env, launch
from ..storage import atomic
from .options import note
from .urls import accepts_urls
from .shard_job import MIXED_PRECISION, ShardJob, SourceTensor, build_meta_model, load_config, plan_reads, rank_main, stage

FORMATS = ("sharded", "dcp")
OPTIMIZERS = ("adamw",)


@accepts_urls(sources=(), dest="dst")  # DST may be an object-storage URL (published marker-last)
def shard(model: str, dst: str | Path, *, ranks: int, format: str = "sharded", device: str = "cpu",
          mixed_precision: str | None = None, cpu_offload: bool = False,
          with_optimizer: str | None = None, overwrite: bool = False, check: bool = False,
          progress: bool = True) -> dict[str, Any]:
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
    ``from_pretrained`` on rank 0) with ``check``.

    Example: ``shard("Qwen/Qwen2.5-0.5B", "ckpt/actor", ranks=8, with_optimizer="adamw")``

    Memory: each rank holds 1/N of the weights (3/N with the optimizer) plus a constant; only
    ``check`` loads a full reference copy, on rank 0.

    Limits: safetensors sources, architectures transformers ships (no remote code); parameters
    keep the files' dtypes (no fp32 master copy); the optimizer state is fresh (zero moments,
    step 0, AdamW's default hyper-parameters, which ``load_state_dict`` hands to the loading
    optimizer); under torchrun on several hosts DST must be on a file system all ranks see.
    """
    _check_options(ranks, format, mixed_precision, with_optimizer)
    talk = progress and env.rank() == 0
    stage(talk, f"loading {model}: torch, its config and the safetensors headers")
    require_transformers("`ckpt shard` (it builds the model to shard it)")
    launch.check_device(device)
    dst = Path(dst).expanduser().absolute()
    check_destination(dst, overwrite)
    model_dir = fetch_model(model)
    atomic.check_destination(model_dir, dst, overwrite=overwrite)
    sources = read_sources(model_dir)
    config = load_config(model_dir)
    ignored = ignored_on_load(model_dir, config, sources)
    if ignored:
        note(f"note: leaving out {', '.join(ignored)}, which from_pretrained ignores too")
        sources = {k: v for k, v in sources.items() if k not in ignored}
    # On meta, cheap: a config that does not fit the weights fails here, before any rank starts.
    build_meta_model(config, sources)
    spawn = launch.will_spawn()
    tmp = atomic.make_staging(dst) if spawn else None
    job = ShardJob(str(model_dir), str(dst), str(tmp) if tmp else None, ranks, format, device,
                   mixed_precision, cpu_offload, with_optimizer, overwrite, check, progress,
                   tuple(sources.values()))
    if spawn:
        stage(talk, f"starting {count(ranks, 'rank')} ({launch.backend_for(device)}): each loads torch and builds "
                    f"the model on the meta device")
    try:
        return launch.run(rank_main, job, ranks=ranks, device=device)
    finally:
        if tmp is not None and tmp.exists():  # a rank failed or was interrupted
            shutil.rmtree(tmp, ignore_errors=True)


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
            sources[key] = SourceTensor(key, name, tuple(entry["shape"]), hf.DTYPES[entry["dtype"]],
                                        data_start + entry["data_offsets"][0])
    return sources


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
