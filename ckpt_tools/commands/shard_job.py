"""The per-rank half of ``ckpt shard``: what each rank of the job does, given a :class:`ShardJob`.

:mod:`.shard` (the command) checks the options, the sources and the destination, then hands the
launcher :func:`rank_main` and a :class:`ShardJob`. Everything a rank needs is here, at module
level, so that spawned processes import it by name; this module never imports :mod:`.shard`.

Order of work on each rank:
  1. :func:`build_meta_model` - the architecture from ``config.json``, parameters on meta, each in
     the dtype its safetensors entry has (so the output is bit for bit the source);
  2. :func:`wrap` - ``fully_shard`` on :func:`transformer_blocks`, then the root;
  3. ``to_empty`` + :func:`fill` - non-persistent buffers (rotary ``inv_freq``, BERT
     ``position_ids``) through the model's own ``_init_weights``, as ``from_pretrained`` does in
     transformers 5, then this rank's rows (:func:`plan_reads`) from the files;
  4. optionally a fresh AdamW state and a forward-pass check; 5. save, barrier, commit (rank 0).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import re
import shutil
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.describe import chunk_rows
from ..engine.stream import on_terminal
from ..errors import BadInput, CkptError, DestinationError, count
from ..formats.sharded import CONFIG_NAME, file_name
from ..hf.assets import ASSET_PATTERNS
from ..hf.models import dtype_argument, model_class
from ..runtime import launch
from ..storage import atomic, manifest

if TYPE_CHECKING:
    import torch
    from torch import nn

MIXED_PRECISION = {"bf16": "bfloat16", "fp16": "float16"}  # torch dtype names
CHECK_INPUT_SHAPE = (2, 16)
# Old checkpoints still carry buffers transformers now computes; from_pretrained ignores them too.
_IGNORED_SOURCE_KEYS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of the model's safetensors files, located from their headers (no data read)."""

    name: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # of its first byte in ``file`` (safetensors data is row-major, little-endian)
    # when its bytes are several ranges, in order: ``(file, offset, length)`` each (rows of other tensors)
    parts: tuple[tuple[str, int, int], ...] = ()

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


@dataclass(frozen=True)
class Read:
    """Copy rows [start, stop) of ``source`` into the tensor the model calls ``target``;
    ``start is None`` means the whole tensor (an unsharded buffer)."""

    target: str
    source: SourceTensor
    start: int | None = None
    stop: int | None = None


@dataclass(frozen=True)
class ShardJob:
    """What every rank is told: plain, picklable values, so spawned ranks get it as an argument."""

    model_dir: str
    dst: str
    tmp: str | None  # made by the caller when it spawns the ranks; else rank 0 makes it
    ranks: int
    format: str
    device: str
    mixed_precision: str | None
    cpu_offload: bool
    with_optimizer: str | None
    overwrite: bool
    check: bool
    progress: bool
    sources: tuple[SourceTensor, ...]


def stage(progress: bool, text: str) -> None:
    """One line on stderr saying what the job is doing now (not with ``progress=False``)."""
    if progress:
        print(text, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the model


def load_config(model_dir: Path):
    """The model's ``config.json`` as transformers reads it; BadInput when it cannot."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir))
    except (OSError, ValueError, KeyError) as e:
        raise BadInput(f"{model_dir / 'config.json'}: transformers cannot read it ({e})") from e



def build_meta_model(config, sources: dict[str, SourceTensor]) -> nn.Module:
    """The model on the meta device, each parameter in its safetensors dtype."""
    import torch

    dtypes = Counter()
    for s in sources.values():
        if s.dtype.is_floating_point:
            dtypes[s.dtype] += 1
    dtype = dtypes.most_common(1)[0][0] if dtypes else torch.float32
    with torch.device("meta"):
        model = model_class(config)._from_config(config, **dtype_argument(dtype))
    reads = {r.target: r.source for r in plan_reads(model, sources, world_size=1, rank=0)}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        src = reads.get(name)
        if src is not None and tensor.dtype != src.dtype:
            tensor.data = tensor.data.to(src.dtype)  # meta: no data moves
    return model


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules to ``fully_shard`` one by one: those whose class is in ``_no_split_modules``
    (else the children of the longest ``ModuleList`` of one class), outermost only, and none
    that holds a parameter also used outside it (a tied embedding belongs to the root)."""
    from torch import nn

    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in names]
    if not found:
        lists = [(n, ml) for n, ml in model.named_modules() if isinstance(ml, nn.ModuleList) and len(ml)
                 and len({type(c) for c in ml}) == 1]
        if lists:
            prefix, ml = max(lists, key=lambda x: len(x[1]))
            found = [(f"{prefix}.{i}", c) for i, c in enumerate(ml)]
    aliases: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    blocks: list[tuple[str, nn.Module]] = []
    for name, module in found:
        if any(name.startswith(outer + ".") for outer, _ in blocks):
            continue
        inside = name + "."
        if any(not a.startswith(inside) for p in module.parameters() for a in aliases[id(p)]):
            continue
        blocks.append((name, module))
    return [m for _, m in blocks]


def wrap(model: nn.Module, mesh, *, mixed_precision: str | None, cpu_offload: bool, device: str) -> None:
    """``fully_shard`` each of :func:`transformer_blocks`, then the root (which takes the rest),
    under the job's mixed-precision and CPU-offload policies."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, MIXED_PRECISION[mixed_precision]), reduce_dtype=torch.float32) \
        if mixed_precision else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy(pin_memory=device == "cuda") if cpu_offload else OffloadPolicy()
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)


def plan_reads(model: nn.Module, sources: dict[str, SourceTensor], *, world_size: int, rank: int,
               check_extra: bool = True) -> list[Read]:
    """What ``rank`` reads: for each parameter (tied ones once) and persistent buffer, its
    source tensor and, for parameters, the ``Shard(0)`` rows ``fully_shard`` gives the rank.

    Raises BadInput for a tensor the files lack, a shape that differs from the config's, or a
    file tensor the model has no place for.
    """
    prefix = getattr(model, "base_model_prefix", "")
    used: set[str] = set()
    reads: list[Read] = []

    def source_of(name: str) -> SourceTensor | None:
        candidates = [name]
        if prefix:
            candidates += [name.removeprefix(prefix + "."), f"{prefix}.{name}"]
        return next((sources[c] for c in candidates if c in sources), None)

    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    tensors = [(name, p, True) for name, p in model.named_parameters()]
    tensors += [(name, b, False) for name, b in _buffers(model, persistent=True)]
    for name, tensor, is_param in tensors:
        names = aliases.get(id(tensor), [name]) if is_param else [name]
        found = [s for s in map(source_of, names) if s is not None]
        used.update(s.name for s in found)
        if not found:
            raise BadInput(f"{name!r} is not in the safetensors files; does config.json match the weights?")
        src = found[0]
        if tuple(tensor.shape) != src.shape:
            raise BadInput(f"{src.file}: tensor {src.name!r} is {list(src.shape)} but the model from "
                           f"config.json wants {list(tensor.shape)}; the config does not match the weights")
        if is_param and tensor.dim() > 0:
            start, stop = chunk_rows(tensor.shape[0], world_size, rank)
            reads.append(Read(name, src, start, stop))
        else:
            reads.append(Read(name, src))
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    extra = [k for k in sources if k not in used and not _IGNORED_SOURCE_KEYS.search(k)
             and not any(p.search(k) for p in ignore)]
    if extra and check_extra:
        raise BadInput(f"{sources[extra[0]].file}: tensor {extra[0]!r} (and {len(extra) - 1} more) has no place in "
                       f"{type(model).__name__}; check config.json's architectures")
    return reads


def _no_grad(fn):
    """``torch.no_grad()`` as a decorator, without importing torch with this module."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper


def _buffers(model: nn.Module, *, persistent: bool):
    for name, buf in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if (leaf in model.get_submodule(owner)._non_persistent_buffers_set) != persistent:
            yield name, buf


@_no_grad
def fill(model: nn.Module, model_dir: Path, reads: list[Read], *, progress: bool, label: str) -> int:
    """Give every tensor of the materialised (``to_empty``) model its value; returns bytes read.

    Rows are read with plain file reads straight into the rank's shard (no mmap of the files:
    mapped pages would count in the rank's memory, and safetensors' slices add a copy)."""
    from torch.distributed.tensor import DTensor, Shard
    from tqdm.auto import tqdm

    if sys.byteorder != "little":
        raise CkptError("safetensors data is little-endian; this big-endian host is not supported")
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    _init_non_persistent_buffers(model, {r.target for r in reads})
    total = sum(_rows_bytes(r) for r in reads)
    with contextlib.ExitStack() as stack, tqdm(total=total, unit="B", unit_scale=True, desc=label,
                                                disable=not progress or not on_terminal(),
                                                file=sys.stderr) as bar:
        files: dict[str, Any] = {}

        def opened(file: str):
            if file not in files:
                files[file] = stack.enter_context(open(model_dir / file, "rb", buffering=0))
            return files[file]

        for r in sorted(reads, key=lambda r: (r.source.file, r.source.offset)):
            tensor = targets[r.target]
            if isinstance(tensor, DTensor):
                if tuple(tensor.placements) != (Shard(0),):
                    raise CkptError(f"{r.target}: placements {tensor.placements}, expected (Shard(0),)")
                tensor = tensor.to_local()
                if r.start is None or tensor.shape[0] != r.stop - r.start:
                    raise CkptError(f"{r.target}: this rank holds {tensor.shape[0]} rows, the plan says "
                                    f"{r.start}..{r.stop}; fully_shard's split changed")
            elif r.start is not None:
                raise CkptError(f"{r.target}: fully_shard left this parameter unsharded")
            _read_into(opened, r, tensor, model_dir)
            bar.update(_rows_bytes(r))
    return total


def _read_into(opened, r: Read, out: torch.Tensor, model_dir: Path) -> None:
    import torch

    start = (r.start or 0) * r.source.row_bytes
    n = _rows_bytes(r)
    direct = out.device.type == "cpu" and out.is_contiguous()
    buf = out if direct else torch.empty(out.shape, dtype=out.dtype)
    if n:
        view = memoryview(buf.reshape(-1).view(torch.uint8).numpy())  # shares buf's memory
        done = 0
        for file, offset, length in _byte_ranges(r.source, start, n):
            f = opened(file)
            f.seek(offset)
            got = f.readinto(view[done:done + length])
            if got != length:
                raise BadInput(f"{model_dir / file}: tensor {r.source.name!r}: file ends after "
                               f"{got} of {length} bytes; truncated?")
            done += length
    if not direct:  # a CUDA shard: through one host buffer of this tensor's rows
        out.copy_(buf)


def _byte_ranges(source: SourceTensor, start: int, n: int):
    """``(file, offset, length)`` of bytes ``[start, start + n)`` of ``source``'s values."""
    parts = source.parts or ((source.file, source.offset, math.prod(source.shape) * source.dtype.itemsize),)
    at = 0
    for file, offset, length in parts:
        lo, hi = max(start, at), min(start + n, at + length)
        if lo < hi:
            yield file, offset + lo - at, hi - lo
        at += length


def _rows_bytes(r: Read) -> int:
    if r.start is None:
        return math.prod(r.source.shape) * r.source.dtype.itemsize
    return (r.stop - r.start) * r.source.row_bytes


def _init_non_persistent_buffers(model: nn.Module, loaded: set[str]) -> None:
    """Compute the buffers no file holds (rotary ``inv_freq``, BERT ``position_ids``) the way
    transformers 5's ``from_pretrained`` does: mark every loaded tensor initialised, then run
    the model's ``initialize_weights``, whose ``_init_weights`` fills only unmarked ones."""
    import torch

    todo = dict(_buffers(model, persistent=False))
    if not todo:
        return
    if not hasattr(model, "initialize_weights"):
        raise BadInput(f"{type(model).__name__} has buffers {sorted(todo)[:3]} that no file holds and "
                       "this transformers version cannot compute them; upgrade transformers to 5.x")
    named = dict(model.named_parameters()) | dict(model.named_buffers())
    marked = [named[n] for n in loaded]
    # Poisoned first, to notice a buffer that _init_weights does not know.
    poison = {n: float("nan") if b.is_floating_point() else torch.iinfo(b.dtype).min
              for n, b in todo.items() if b.dtype != torch.bool}
    for name, value in poison.items():
        todo[name].fill_(value)
    for t in marked:
        t._is_hf_initialized = True
    # initialize_weights skips modules flagged by an earlier run; every module must be visited.
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    try:
        model.initialize_weights()
    finally:
        for t in (*marked, *model.modules()):
            t.__dict__.pop("_is_hf_initialized", None)
    for name, value in poison.items():
        buf = todo[name]
        if (buf.isnan() if buf.is_floating_point() else buf == value).any():
            raise CkptError(f"{type(model).__name__}: buffer {name!r} is not in the files and its "
                            "_init_weights does not compute it; this architecture is not supported yet")


def fresh_adamw(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with real, zero state entries (step 0), as if built before the first step: a zero-grad
    ``step()`` would instead move the weights through weight decay."""
    import torch

    opt = torch.optim.AdamW(model.parameters())
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    return opt


@_no_grad
def forward_check(model: nn.Module, cls: type, config, ctx: launch.RankContext, model_dir: Path) -> float | None:
    """Largest |difference| between the sharded model's output and ``from_pretrained``'s (rank 0
    only builds the unsharded reference) on one fixed input; ``None`` on other ranks."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    vocab = config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, CHECK_INPUT_SHAPE, generator=torch.Generator().manual_seed(0)).to(ctx.device)
    dtype = next(model.parameters()).dtype  # now: after a forward the root's parameters stay unsharded
    model.eval()
    out = model(input_ids=ids)[0]
    for module in model.modules():  # back to sharded DTensors before anything saves the state dict
        if isinstance(module, FSDPModule):
            module.reshard()
    if ctx.rank != 0:
        return None
    with _no_transformers_progress():
        ref = cls.from_pretrained(str(model_dir), **dtype_argument(dtype))
    ref = ref.to(ctx.device).eval()
    expected = ref(input_ids=ids)[0]
    return (out.float() - expected.float()).abs().max().item()


@contextlib.contextmanager
def _no_transformers_progress():
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


# ---------------------------------------------------------------- one rank


def rank_main(ctx: launch.RankContext, job: ShardJob) -> dict[str, Any]:
    """One rank of the job, as the launcher calls it: build, shard, fill, save this rank's part;
    rank 0 then writes the manifest and commits. Returns the command's report (see
    :func:`.shard.shard`); the staging directory is removed if anything fails."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    model_dir, dst = Path(job.model_dir), Path(job.dst)
    sources = {s.name: s for s in job.sources}
    tmp = _shared_tmp_dir(ctx, job, dst)
    try:
        config = load_config(model_dir)
        model = build_meta_model(config, sources)
        cls = type(model)
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        wrap(model, mesh, mixed_precision=job.mixed_precision, cpu_offload=job.cpu_offload, device=job.device)
        model.to_empty(device="cpu" if job.cpu_offload else ctx.device)
        reads = plan_reads(model, sources, world_size=ctx.world_size, rank=ctx.rank)
        talk = job.progress and ctx.rank == 0
        stage(talk, f"sharding: {count(ctx.world_size, 'rank')} up, each reading its rows of every tensor "
                    f"(fully_shard, {ctx.device.type})")
        fill(model, model_dir, reads, progress=talk, label=f"shard rank 0/{ctx.world_size}")
        optimizer = fresh_adamw(model) if job.with_optimizer else None
        if job.check:
            stage(talk, "checking: a forward pass of the sharded model against from_pretrained's")
        diff = forward_check(model, cls, config, ctx, model_dir) if job.check else None
        stage(talk, f"writing the {job.format} checkpoint: {count(ctx.world_size, 'rank')}"
                    + (", model and optimizer" if optimizer is not None else ""))
        with _writing(dst):
            _save(model, optimizer, ctx, job, tmp, model_dir)
        counted = _count(model, optimizer)
        stats = launch.all_gather(ctx, {**launch.peak_memory(ctx), "diff": diff})
        dist.barrier()
        if ctx.rank == 0:
            with _writing(dst):
                # written last, over every rank's files: `ckpt verify DST` checks them against it
                manifest.write(tmp, source=str(model_dir), source_format="hf", format=job.format)
                commit(tmp, dst, job.overwrite)
        dist.barrier()  # every rank returns once DST is in place
    except BaseException:
        if ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    report = {"dst": str(dst), "ranks": ctx.world_size, "format": job.format, "device": job.device,
              "params": sum(p.numel() for p in model.parameters()),
              "bytes": sum(math.prod(s.shape) * s.dtype.itemsize for s in sources.values()),
              "peak_rss_bytes": [s["rss_bytes"] for s in stats], **counted}
    if job.device == "cuda":
        report["peak_device_bytes"] = [s["device_bytes"] for s in stats]
    if job.check:
        report["max_abs_diff"] = stats[0]["diff"]
    return report


def _count(model, optimizer) -> dict[str, int]:
    """The logical (unsharded) tensors the checkpoint holds and their bytes, as ``inspect``
    counts them: the model's state dict, and per parameter its AdamW ``step``, ``exp_avg`` and
    ``exp_avg_sq``."""
    state = model.state_dict()  # DTensors: numel() is the whole tensor's
    n = len(state)
    size = sum(t.numel() * t.element_size() for t in state.values())
    if optimizer is not None:
        for entries in optimizer.state.values():
            n += len(entries)
            size += sum(t.numel() * t.element_size() for t in entries.values())
    return {"num_tensors": n, "total_bytes": size}


def _shared_tmp_dir(ctx: launch.RankContext, job: ShardJob, dst: Path) -> Path:
    return Path(job.tmp) if job.tmp else Path(launch.on_rank0(ctx, lambda: str(atomic.make_staging(dst))))


def _save(model, optimizer, ctx: launch.RankContext, job: ShardJob, tmp: Path, model_dir: Path) -> None:
    import torch

    if job.format == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if optimizer is not None:
            msd, osd = get_state_dict(model, optimizer)
            state = {"model": msd, "optimizer": osd}
        else:
            state = {"model": get_model_state_dict(model)}
        # not synced here: commit() fsyncs the whole staging directory once, every rank's files included
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=False))
        if ctx.rank == 0:
            _write_hf_assets(model_dir, tmp)
        return
    n, r = ctx.world_size, ctx.rank
    # not synced here: commit() fsyncs the whole staging directory once, every rank's files included
    torch.save(model.state_dict(), tmp / file_name("model", n, r))
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / file_name("optim", n, r))
    if r == 0:
        (tmp / CONFIG_NAME).write_text(json.dumps({"FSDP_version": 2, "world_size": n}, indent=4))
        _write_hf_assets(model_dir, tmp)


def _write_hf_assets(model_dir: Path, tmp: Path) -> None:
    """Config, tokenizer and generation config into ``huggingface/`` beside the checkpoint,
    whatever its format: what verl keeps next to its rank files, and where ``export`` and
    ``convert`` look for them, so the checkpoint exports without ``--base``."""
    assets = tmp / "huggingface"
    assets.mkdir()
    for name in ASSET_PATTERNS:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, assets / name)


# ---------------------------------------------------------------- the commit, on rank 0


def commit(tmp: Path, dst: Path, overwrite: bool) -> None:
    """fsync the finished ``tmp`` and rename it to ``dst`` (the old DST survives until then)."""
    atomic.fsync_tree(tmp)
    atomic.commit_into(tmp, dst, overwrite=overwrite)


@contextlib.contextmanager
def _writing(where: Path):
    """A full disk or quota is a destination problem (exit 4), whatever layer reports it:
    torch.save says so in a RuntimeError, dcp.save in a CheckpointException (a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (OSError, RuntimeError, CheckpointException) as e:
        space = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or any(
            m in str(e) for m in ("No space left", "Disk quota", "file write failed"))
        if space:
            raise DestinationError(f"{where}: out of space ({e}); nothing was committed, free space and re-run") from e
        raise
