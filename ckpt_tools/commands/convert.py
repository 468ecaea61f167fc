"""``convert`` and ``reshard``: describe the source, choose what to write, let a format's writer
lay it out and the engine carry it out.

Read top to bottom, :func:`convert` is: options checked (:class:`Options`), the source described,
the tensors and objects kept, the framework's layout kept (a reshard) or written (``--layout``),
the writer chosen (:mod:`ckpt_tools.formats.writers`), the plan executed, the report returned.
``export`` (``--to hf``) is :mod:`.export`.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from .. import layouts
from ..core.chunks import extents, kinds
from ..core.describe import Checkpoint
from ..core.plan import rows_of, share_of, targets_from
from ..engine.execute import execute
from ..engine.reader import Reader
from ..errors import BadInput, UsageError, count
from ..formats import deepspeedwrite, writers
from ..layouts import describe
from ..naming import experts, quant
from ..hf import archcheck
from ..hf import assets as hfassets
from ..runtime import env
from ..security import bounded
from ..storage.atomic import check_destination, staged
from .export import write_hf
from .options import Options, note
from .report import finish, planned_files, recording_notes, summary
from .urls import accepts_urls


@accepts_urls(dest="dst")
def convert(src: str | Path, dst: str | Path, *, to: str, world_size: int | None = None,
            dtype: str | None = None, max_shard_size: str | int = "5GB", model_only: bool = False,
            base: str | None = None, overwrite: bool = False, progress: bool = True,
            rank_local: str = "drop", workers: int = 1, layout: str | None = None, lora: str | None = None,
            lora_alpha: float | None = None, arch_check: bool = True, keys: dict[str, str] | None = None,
            dry_run: bool = False,
            _ckpt: Checkpoint | None = None) -> dict[str, Any]:
    """Convert the checkpoint at ``src`` to format ``to`` at ``dst``.

    Carries model, optimizer and extra state into every format that can hold them (``hf``
    holds the model only). ``dtype`` ("bf16", "fp16", "fp32") casts floating-point tensors;
    without it every tensor is kept bit for bit. ``world_size`` applies to ``sharded`` and
    ``dcp`` output (default: the source's, else 1). ``layout="torchtitan"`` with ``to="dcp"``
    writes torchtitan's names (from a Hugging Face source), so torchtitan starts from it;
    ``layout="verl"`` with ``to="sharded"`` names the rank files' device mesh ``("fsdp",)`` as
    verl's does (a job loads DTensors only onto a mesh of the same names; without it the mesh is
    unnamed, as ``fully_shard``'s default). ``lora``/``lora_alpha``/``arch_check``: see :func:`export`.
    ``keys`` (``to="dcp"``) renames the DCP's top-level keys for the loader that reads it:
    ``{"optimizer": "optim"}`` writes ``optim.state...`` where ``dcp.save`` of
    ``{"model": ..., "optimizer": ...}`` would write ``optimizer.state...``.
    ``to="deepspeed"`` writes a DeepSpeed ZeRO save, from one, at ``world_size`` ranks (what
    :func:`reshard` does; any other source is exit 3: its stage and ds_config would be invented).
    ``dry_run``: plan only; nothing is written and DST is not created.

    Returns what was written (or would be): ``dst``, ``format``, ``world_size``, ``num_tensors``,
    ``total_bytes``, ``dtype``, ``dtypes``, ``files``, ``written_bytes``, ``notes``, ``dry_run``
    (:mod:`ckpt_tools.commands.report`), the same object ``ckpt convert --json`` prints.

    Example: ``ckpt_tools.convert("ckpt/actor", "out.pt", to="torch", model_only=True)``
    """
    opts = Options(to=to, world_size=world_size, dtype=dtype, max_shard_size=max_shard_size,
                   model_only=model_only, base=base, overwrite=overwrite, progress=progress,
                   rank_local=rank_local, workers=workers, layout=layout, lora=lora, lora_alpha=lora_alpha,
                   arch_check=arch_check, keys=tuple((keys or {}).items()), dry_run=dry_run)
    return run(Path(src), Path(dst), opts, _ckpt)


def run(src: Path, dst: Path, opts: Options, ckpt: Checkpoint | None = None) -> dict[str, Any]:
    """:func:`convert` with its options built (``ckpt``: the source, when already described);
    the report says what was written, or with ``opts.dry_run`` what would be."""
    # the description and plan live to the end: set aside from the collector as they are built
    with recording_notes() as notes, bounded.gc_frozen():
        report = _run(src, dst, opts, ckpt)
    return finish(report, notes, dry_run=opts.dry_run)


def _run(src: Path, dst: Path, opts: Options, ckpt: Checkpoint | None = None) -> dict[str, Any]:
    if env.rank() != 0:
        opts = replace(opts, progress=False)  # one voice per torchrun launch
    src = layouts.resolve(src)  # a verl global_step_N/ (what `ckpt latest` prints): its actor/
    # before any work, or any warning about it (a dry run removes no leftover staging)
    check_destination(src, dst, overwrite=opts.overwrite, dry_run=opts.dry_run)
    # (safetensors are written from the plan alone: nothing parsed need be kept for the writer)
    ckpt = ckpt or describe(src, base=opts.base, read_only=opts.to == "hf")
    if opts.to == deepspeedwrite.NAME:
        return _write_deepspeed(ckpt, src, dst, opts)
    out_layout = opts.output
    if out_layout is not None and out_layout.mesh_names and ckpt.format == "sharded":
        raise UsageError(f"{src}: per-rank files keep their own device mesh, its names included "
                         f"(--layout {out_layout.name} names the mesh of files built from another format)")
    keep = [t for t in ckpt.tensors if t.group == "model" or not opts.model_alone]
    left_out = sorted({t.group for t in ckpt.tensors} - {t.group for t in keep})
    if not [t for t in keep if t.group == "model"]:
        raise BadInput(f"{src}: holds no model tensors to write")
    if opts.to == "hf":
        return write_hf(ckpt, src, dst, keep, opts, left_out)
    objects = tuple(o for o in ckpt.objects if not opts.model_alone or o.group == "model")
    left_out += sorted({o.group for o in ckpt.objects} - {o.group for o in objects} - set(left_out))
    if ckpt.details.get("optimizer_flat") and not opts.model_alone:
        raise BadInput(f"{src}: {ckpt.details['optimizer_flat']}; ckpt works it out from the model's "
                       "config.json (huggingface/ beside the files, or convert --base) and found none. Give "
                       "the config, or export or convert the model alone (ckpt export, or convert --model-only)")
    ranked = opts.to in ("sharded", "dcp")
    ws = opts.world_size or (ckpt.world_size if ckpt.world_size and ranked else 1)
    report: dict[str, Any] = {"src": str(src), "dst": str(dst), "format": opts.to, "world_size": ws if ranked else None}
    if ckpt.format == "hf" and ranked and out_layout is None:  # hub layout -> the training model's names
        keep = experts.model_tensors(ckpt, keep, hfassets.read_config(hfassets.find_assets(src, opts.base)), src)
    quantized = quant.find(keep, hfassets.read_config(hfassets.find_assets(src, opts.base)), src) if opts.cast else None
    if quantized is not None:  # --dtype dequantizes: weights computed from codes and scales, scales left out
        keep = [t for t in keep if t.name not in quantized.dropped]
        targets = [quant.target(t, t.name, opts.cast, quantized) for t in keep]
    else:
        targets = targets_from(keep, dtype=opts.cast)

    carry = None
    if opts.to == ckpt.format and ranked and not opts.model_only and opts.layout is None:
        # a copy in the source's own format keeps its framework's layout (reshard)
        lay, objects, carry = layouts.keep_layout(ckpt, objects, ws, opts.rank_local)
        report["layout"] = lay.name
    piece_of = rows_of
    if out_layout is not None and out_layout.retarget is not None:
        config = hfassets.read_config(hfassets.find_assets(src, opts.base))
        targets, piece_of = out_layout.retarget(targets, config, src, ckpt)
        objects = ()

    def open_reader() -> Reader:
        return Reader(ckpt)

    common = dict(rank_local=opts.rank_local, open_reader=open_reader)
    # under torchrun each process plans only the output ranks it writes (a dry run plans them all)
    ranks = share_of(ws, env.world(), env.rank()) if ranked and env.world() > 1 and not opts.dry_run else None
    if opts.to == "torch":
        writer, jobs = writers.torch_file(ckpt, targets, objects, dst.name, **common)
    elif opts.to == "dcp":
        writer, jobs = writers.dcp_dir(ckpt, targets, objects, ws, keep_parts=carry is not None, piece_of=piece_of,
                                       top_level_model=bool(out_layout and out_layout.top_level_model),
                                       keys=dict(opts.keys), ranks=ranks, **common)
    else:
        # rank files' device mesh names: the layout's when asked; else a rank-file source's own
        # (kept also where torch's writer rebuilds its files, as for --to 1); else unnamed
        names = (out_layout.mesh_names if out_layout is not None and out_layout.mesh_names
                 else ckpt.details.get("mesh_dim_names") if ckpt.format == "sharded" else None)
        buffers = _buffers(targets, src, opts.base) if carry is None else frozenset()
        writer, jobs = writers.rank_files(ckpt, targets, objects, ws, mesh_names=tuple(names) if names else None,
                                          keep=carry is not None, ranks=ranks, buffers=buffers, **common)

    extra: list[str] = []  # what a dry run says it would copy beside the plan's files
    if carry is not None:
        extra = [str(f) for f in carry.files]

        def after(tmp: Path) -> None:
            layouts.copy_side_files(ckpt.base_dir(), carry.files, tmp)
    elif opts.to == "sharded":
        # rank files from another format: config and tokenizer into huggingface/, as verl keeps them
        assets = hfassets.find_assets(src, opts.base)
        extra = [f"huggingface/{n}" for n in hfassets.asset_names(assets)]

        def after(tmp: Path) -> None:
            if assets is not None:
                (tmp / "huggingface").mkdir()
                hfassets.copy_assets(assets, tmp / "huggingface", dtype=None)
                if quantized is not None and (tmp / "huggingface" / "config.json").is_file():
                    hfassets.rewrite_config(tmp / "huggingface" / "config.json",
                                            quant.without_quantization(hfassets.read_config(assets)))
    else:
        after = None

    planned = planned_files(jobs)
    if not opts.dry_run:  # (the plan handed over: each file's pieces let go once it is written)
        execute(ckpt, writer, jobs, dst, overwrite=opts.overwrite, progress=opts.progress,
                desc=f"{ckpt.format} → {opts.to}", fmt=opts.to, workers=opts.workers, after=after,
                own_share=ranks is not None, consume=True)
    if left_out:
        note(f"note: left out {', '.join(left_out)} state (model only)")
    if opts.to == "sharded" and carry is None and writers.fsdp1_files(ckpt):
        note("note: written as FSDP2 rank files (DTensors); the source's FSDP1 ShardedTensors are kept only by "
             "`ckpt reshard`, which an FSDP1 job's SHARDED_STATE_DICT load needs")
    if opts.to == "sharded" and ckpt.format != "sharded" and not (out_layout and out_layout.mesh_names):
        note(f"note: {layouts.unnamed_mesh_note()}")
    report.update(num_tensors=len(targets), total_bytes=sum(t.nbytes for t in targets), left_out=left_out)
    report.update(summary(dst, jobs, targets, dry_run=opts.dry_run, cast=opts.cast, extra_files=extra,
                          planned=planned))
    return report


def _write_deepspeed(ckpt: Checkpoint, src: Path, dst: Path, opts: Options) -> dict[str, Any]:
    """A ZeRO save written as a ZeRO save at ``opts.world_size`` ranks (same stage, precision and
    training state; see :mod:`ckpt_tools.formats.deepspeedwrite`)."""
    if opts.dtype or opts.model_only or opts.layout or opts.lora:
        raise UsageError(f"--to {opts.to} keeps the save's stage, precision and whole training state; "
                         "--dtype, --model-only, --layout and --lora do not apply")
    source = deepspeedwrite.source(ckpt)  # exit 3 for any other source, or a save it cannot prove
    ws = opts.world_size or ckpt.world_size
    writer, jobs = deepspeedwrite.plan(source, ws)
    scripts = deepspeedwrite.scripts(source)

    def after(tmp: Path) -> None:
        for script in scripts:
            shutil.copyfile(script, tmp / script.name)

    # one process: the writer holds the source's parsed pickles (the files are few and small beside
    # their records, which the kernel copies or the engine streams a parameter piece at a time)
    if not opts.dry_run:
        execute(ckpt, writer, jobs, dst, overwrite=opts.overwrite, progress=opts.progress,
                desc=f"{ckpt.format} → {opts.to}", fmt=opts.to, workers=1, after=after)
    report = {"src": str(src), "dst": str(dst), "format": opts.to, "world_size": ws,
              "zero_stage": source.stage, "tag": writer.tag,
              "num_tensors": len(ckpt.tensors),
              "total_bytes": sum(j.nbytes for j in jobs), "left_out": []}
    # the save's tensors, as inspect counts them (the plan's pieces cover the optimizer files only)
    report.update(summary(dst, jobs, ckpt.tensors, dry_run=opts.dry_run, extra_files=[s.name for s in scripts]))
    return report


@accepts_urls(dest="dst")
def export(src: str | Path, dst: str | Path, *, base: str | None = None, dtype: str | None = None,
           max_shard_size: str | int = "5GB", overwrite: bool = False, progress: bool = True,
           lora: str = "merge", lora_alpha: float | None = None, quantize: str | None = None,
           arch_check: bool = True, dry_run: bool = False) -> dict[str, Any]:
    """Export ``src`` as an HF directory ready for ``from_pretrained`` and serving: weights
    under the names of the architecture in config.json (wrapper prefixes removed, torchtitan
    names mapped, tied weights once; checked against that architecture before anything is
    written), config with its dtype set, generation config and tokenizer (from the source's
    ``huggingface/`` folder or ``base``). Optimizer state is left out.

    PEFT LoRA: ``lora="merge"`` folds ``B @ A * alpha / r`` into the base weights (as
    ``merge_and_unload``); ``lora="adapter"`` writes ``adapter_model.safetensors`` +
    ``adapter_config.json`` for ``PeftModel.from_pretrained``. alpha comes from the
    checkpoint's ``adapter_config.json`` / ``lora_train_meta.json`` or ``lora_alpha``. An
    adapter-only checkpoint merges only into ``base``'s full weights.

    ``dry_run``: plan (and check the names against the architecture) only; nothing is written.
    Returns the report :func:`convert` returns (``ckpt export --json``).
    Quantized sources (block FP8, MXFP4, compressed-tensors FP8): ``dtype`` dequantizes (see
    docs/quantization.md); without it they stay quantized. ``quantize`` ("fp8-block",
    "fp8-dynamic") writes the linear weights as FP8 codes + scales for serving.
    The names are checked against the architecture of config.json, built by transformers on the
    meta device; when that cannot be done (transformers missing, a class it lacks) the export is
    refused (BadInput, exit 3). ``arch_check=False`` writes them unchecked, with a warning.

    Example: ``ckpt_tools.export("ckpt/global_step_500/actor", "hf_out", dtype="bf16")``
    """
    opts = Options(to="hf", dtype=dtype, max_shard_size=max_shard_size, model_only=True, base=base,
                   overwrite=overwrite, progress=progress, lora=lora, lora_alpha=lora_alpha, loadable=True,
                   quantize=quantize, arch_check=arch_check, dry_run=dry_run)
    return run(Path(src), Path(dst), opts)


@accepts_urls(dest="dst")
def reshard(src: str | Path, dst: str | Path, *, to: int, from_: int | None = None,
            overwrite: bool = False, progress: bool = True, rank_local: str = "drop",
            workers: int = 1, dry_run: bool = False) -> dict[str, Any]:
    """Reshard a ``sharded``, ``dcp`` or DeepSpeed ZeRO checkpoint to ``to`` ranks, keeping its
    format and the whole training state (model, optimizer, extra state; a ZeRO save keeps its
    stage and precision, and DeepSpeed's ``engine.load_checkpoint`` takes it at ``to`` ranks).

    ``workers`` processes write the output files in parallel (each file by one process, so the
    result is byte-identical to a single process's). ``dry_run``: plan only, nothing written.
    Returns the report :func:`convert` returns (``ckpt reshard --json``).

    Example: ``ckpt_tools.reshard("ckpt/actor", "ckpt4/actor", to=4, from_=8)``
    """
    if to < 1:
        raise UsageError(f"--to must be at least 1, not {to}")
    # checked before the source is read; its format, which the copy keeps, is known after
    opts = Options(to="sharded", world_size=to, overwrite=overwrite, progress=progress, rank_local=rank_local,
                   workers=workers, dry_run=dry_run)
    parts = layouts.parts_of(src)
    if parts:
        return _reshard_parts(Path(src), Path(dst), parts, opts, from_)
    with bounded.gc_frozen():  # (see run: the description lives to the end)
        return _reshard(Path(src), Path(dst), opts, from_, to)


def _reshard(src: Path, dst: Path, opts: Options, from_: int | None, to: int) -> dict[str, Any]:
    ckpt = describe(src)
    if ckpt.format not in ("sharded", "dcp", deepspeedwrite.NAME):
        why = "which has no ranks" if not ckpt.world_size else "which ckpt reads but does not write"
        raise BadInput(f"{src}: is {ckpt.format!r}, {why}; use `ckpt convert --to sharded --world-size {to}` "
                       f"(or --to dcp)")
    if from_ is not None and from_ != ckpt.world_size:
        raise BadInput(f"{src}: --from {from_} but the checkpoint was saved by {count(ckpt.world_size, 'rank')}")
    if ckpt.format == "sharded" and ckpt.mesh_shape and len(ckpt.mesh_shape) > 1:
        raise BadInput(f"{src}: saved on a {len(ckpt.mesh_shape)}-D device mesh {tuple(ckpt.mesh_shape)} (HSDP or "
                       "FSDP+TP); reshard writes 1-D FSDP2 rank files, which such a job does not load. Export it "
                       "(ckpt export), or convert it to DCP (ckpt convert --to dcp), which the job reshards at load")
    _check_same_save(ckpt)
    return run(src, dst, replace(opts, to=ckpt.format), ckpt)


def _reshard_parts(src: Path, dst: Path, parts: list[str], opts: Options, from_: int | None) -> dict[str, Any]:
    """A step directory holding several checkpoints (verl's ``global_step_N/``: ``actor/``,
    ``critic/``) resharded whole into ``dst``, laid out the same (each part resharded, the
    files beside them, as verl's ``data.pt`` dataloader state, copied), so that the trainer
    resumes from ``dst`` as from ``src``. Published at once: the parts are written into one
    staging sibling of ``dst``."""
    check_destination(src, dst, overwrite=opts.overwrite, dry_run=opts.dry_run)
    if opts.dry_run:  # each part planned where it would go; nothing staged
        reports = {part: reshard(src / part, dst / part, to=opts.world_size, from_=from_, progress=False,
                                 rank_local=opts.rank_local, workers=opts.workers, dry_run=True) for part in parts}
        return {**reports[parts[0]], "src": str(src), "dst": str(dst), "parts": {p: r["dst"] for p, r in reports.items()}}
    reports = {}
    with staged(dst, overwrite=opts.overwrite) as tmp:
        for part in parts:
            reports[part] = reshard(src / part, tmp / part, to=opts.world_size, from_=from_, progress=opts.progress,
                                    rank_local=opts.rank_local, workers=opts.workers)
        for f in sorted(src.iterdir()):
            if f.is_file() and not f.is_symlink():  # data.pt: the driver's, not a rank's
                shutil.copyfile(f, tmp / f.name)
    first = reports[parts[0]]
    return {**first, "src": str(src), "dst": str(dst), "parts": {p: r["dst"].replace(str(tmp), str(dst))
                                                                 for p, r in reports.items()}}


def _check_same_save(ckpt: Checkpoint) -> None:
    """Every rank's copy of a replicated scalar (the optimizer's ``step``) must agree."""
    steps = [t for t in ckpt.tensors if t.state == "step" and len(t.chunks) > 1]
    with Reader(ckpt) as r:
        # compared as stored bytes: no tensor (and no torch) needed; a table's read from its
        # columns (74k chunks at 256 ranks, each made with its location, were ~0.1 s)
        raw = [kinds(t.chunks) == {"raw"} for t in steps]
        stored = iter(r.raw_small([(file, start, length) for t, plain in zip(steps, raw) if plain
                                   for _, file, start, length in extents(t.chunks)]))
        for t, plain in zip(steps, raw):
            if plain:
                values = {next(stored) for _ in range(len(t.chunks))}
            else:
                values = {r.chunk(t, c).item() for c in t.chunks}
            if len(values) > 1:
                values = {r.chunk(t, c).item() for c in t.chunks}
                raise BadInput(f"{ckpt.root}: {t.name!r} differs between ranks ({sorted(values)}); "
                               "the rank files are not from one save")


def _buffers(targets: list, src: Any, base: Any) -> frozenset[str]:
    """The model tensors that the class config.json names holds as buffers (DeepSeek's
    ``e_score_correction_bias``): ``fully_shard`` leaves those plain tensors, so every rank
    file holds each whole, as a training job's own save does."""
    shapes = {t.name: t.shape for t in targets if t.group == "model"}
    try:
        config = hfassets.read_config(hfassets.find_assets(src, base))
    except BadInput:
        return frozenset()
    return frozenset(shapes) - set(archcheck.parameters_only(shapes, config))
