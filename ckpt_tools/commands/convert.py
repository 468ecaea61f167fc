"""``convert``, ``export`` and ``reshard``: choose targets, lay them out for a writer, and let
the engine carry the plan out. The layout functions are pure: descriptions in, jobs out."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from ..hf import assets as hfassets
from .. import layouts
from ..security import safefs
from ..storage.atomic import check_destination
from ..core.describe import Checkpoint, ObjectInfo, TensorInfo
from ..core.dtypes import DType
from ..engine.execute import execute
from ..errors import BadInput, UsageError
from ..formats import FORMATS, dcp, dcpnative, describe, hf, shardsynth, shardtree, sharded, torchnative, torchsave
from ..core.plan import FileJob, Target, rows_of, targets_from, whole
from ..engine.reader import Reader
from ..engine.scaleout import torchrun_rank
from ..core.state import per_rank_extras, short_list, warn_rank_local

DTYPES = {"bf16": DType("bfloat16"), "fp16": DType("float16"), "fp32": DType("float32")}
_WRAPPER_PREFIXES = re.compile(r"(^|\.)(_orig_mod|module|_fsdp_wrapped_module|_checkpoint_wrapped_module)\.")


def normalize_name(name: str) -> str:
    """A weight name as ``from_pretrained`` expects it: wrapper prefixes removed."""
    while True:
        new = _WRAPPER_PREFIXES.sub(r"\1", name)
        if new == name:
            return name
        name = new


def _say(message: str, progress: bool) -> None:
    if progress:
        print(message, file=sys.stderr)


# -- layouts (pure) ------------------------------------------------------------------------

def layout_sharded(src: Checkpoint, targets: list[Target], world_size: int, extras: list[dict] | None) -> list[FileJob]:
    """Per-rank model/optim/extra_state jobs at ``world_size``, FSDP2's ``Shard(0)`` split."""
    plain = {t.key for t in src.tensors if _replicated(t, src)}
    model = [t for t in targets if t.group == "model"]
    optim = [t for t in targets if t.group == "optimizer"]
    plain_targets = {(t.group, t.name) for t in targets if t.source.key in plain or not t.shape}
    mobj = tuple(o for o in src.objects if o.group == "model" and o.rank in (None, 0))
    oobj = tuple(o for o in src.objects if o.group == "optimizer" and o.rank in (None, 0) and o.path[:2] == ("optimizer", "param_groups"))
    jobs = []
    for r in range(world_size):
        def pieces(ts):
            return tuple(whole(t) if (t.group, t.name) in plain_targets else rows_of(t, world_size, r) for t in ts)
        jobs.append(FileJob(sharded.file_name("model", world_size, r), pieces(model), mobj, r, "model",
                            {"plain": plain_targets}))
        if optim:
            jobs.append(FileJob(sharded.file_name("optim", world_size, r), pieces(optim), oobj, r, "optim",
                                {"plain": plain_targets}))
        if extras and extras[r]:
            jobs.append(FileJob(sharded.file_name("extra_state", world_size, r), (), (), r, "extra",
                                {"extra": extras[r]}))
    return jobs


def _replicated(t: TensorInfo, src: Checkpoint) -> bool:
    """A plain (non-DTensor) entry of a per-rank file: every rank holds the whole tensor."""
    return (src.format == "sharded" and len(t.chunks) == (src.world_size or 1) > 1
            and all(c.sizes == t.shape for c in t.chunks))


def layout_dcp(targets: list[Target], objects: tuple[ObjectInfo, ...], world_size: int,
               extra: dict | None = None, part_of=None, *, piece_of=rows_of) -> list[FileJob]:
    """``__{r}_0.distcp`` per rank: rank r's rows of every tensor with rows; scalars and
    objects once, on rank 0 (as dcp.save deduplicates replicated entries).

    ``part_of(target or object)`` names the part directory an entry belongs to (accelerate's
    ``pytorch_model_fsdp_0``, ``optimizer_0``; ``""`` for the root): each part is a DCP of its own.
    ``piece_of`` gives a target's rows for a rank (a naming scheme may reorder them)."""
    part_of = part_of or (lambda item: "")
    parts = list(dict.fromkeys([part_of(t) for t in targets] + [part_of(o) for o in objects])) or [""]
    home = "" if "" in parts else parts[0]  # where merged extra state goes
    jobs = []
    for part in parts:
        mine = [t for t in targets if part_of(t) == part]
        objs = tuple(o for o in objects if part_of(o) == part)
        prefix = f"{part}/" if part else ""
        for r in range(world_size):
            pieces = tuple(p for t in mine if t.shape for p in [piece_of(t, world_size, r)] if p.numel)
            if r == 0:
                pieces += tuple(whole(t) for t in mine if not t.shape)
            jobs.append(FileJob(f"{prefix}__{r}_0.distcp", pieces, objs if r == 0 else (), r,
                                meta={"extra": extra or {}} if r == 0 and part == home else {}))
    return jobs


def dcp_part(item: Target | ObjectInfo) -> str:
    """The part directory of a DCP source that holds ``item`` (``""`` at the root)."""
    if isinstance(item, ObjectInfo):
        loc = item.location
    else:
        if not item.source.chunks:
            return ""
        loc = item.source.chunks[0].location
    return loc.file.rpartition("/")[0] if loc.kind in ("torch_item", "bytes_item") else ""


def keep_layout(ckpt: Checkpoint, objects: tuple[ObjectInfo, ...], ws: int, policy: str
                ) -> tuple[layouts.Layout, tuple[ObjectInfo, ...], layouts.Carry]:
    """What a copy of ``ckpt`` in its own format and framework layout at ``ws`` ranks keeps:
    its side files (carried as files, so entries read from them are not written again), its
    rank-local entries (by ``policy`` when the world size changes, with a warning)."""
    lay = layouts.layout_of(ckpt)
    side = set(lay.side_files)
    kept, local = [], []
    for o in objects:
        if o.location.file in side:
            continue
        rank = lay.rank_local_object(o) if o.rank is None else None
        if rank is not None and ckpt.world_size != ws:
            local.append(".".join(map(str, o.path)))
            if policy != "keep-first" or rank >= ws:
                continue
        kept.append(o)
    if local:
        warn_rank_local(f"rank-local entries {short_list(sorted(local))} ({lay.name}) cannot be split or merged",
                        src_world=ckpt.world_size, dst_world=ws, policy=policy)
    carry = layouts.carry_plan(lay, src_world=ckpt.world_size, dst_world=ws, policy=policy)
    return lay, tuple(kept), carry


def copy_side_files(src: Path, files: tuple[str, ...], tmp: Path) -> None:
    """Side files into the staging directory, byte for byte."""
    for rel in files:
        out = tmp / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        # resolved whole and required inside the checkpoint: never a file from elsewhere
        path = safefs.resolve_inside(src, rel, what=f"{src}: side file")
        safefs.require_regular(path)
        shutil.copyfile(path, out)


# -- public operations ---------------------------------------------------------------------

def convert(src: str | Path, dst: str | Path, *, to: str, world_size: int | None = None,
            dtype: str | None = None, max_shard_size: str | int = "5GB", model_only: bool = False,
            base: str | None = None, overwrite: bool = False, progress: bool = True,
            rank_local: str = "drop", workers: int = 1, layout: str | None = None, lora: str | None = None,
            lora_alpha: float | None = None, _ckpt: Checkpoint | None = None) -> dict[str, Any]:
    """Convert the checkpoint at ``src`` to format ``to`` at ``dst``.

    Carries model, optimizer and extra state into every format that can hold them (``hf``
    holds the model only). ``dtype`` ("bf16", "fp16", "fp32") casts floating-point tensors;
    without it every tensor is kept bit for bit. ``world_size`` applies to ``sharded`` and
    ``dcp`` output (default: the source's, else 1). ``layout="torchtitan"`` with ``to="dcp"``
    writes torchtitan's names (from a Hugging Face source), so torchtitan starts from it;
    ``layout="verl"`` with ``to="sharded"`` names the rank files' device mesh ``("fsdp",)`` as
    verl's does (a job loads DTensors only onto a mesh of the same names; without it the mesh is
    unnamed, as ``fully_shard``'s default). ``lora``/``lora_alpha``: see :func:`export`.

    Example: ``ckpt_tools.convert("ckpt/actor", "out.pt", to="torch", model_only=True)``
    """
    if to not in FORMATS:
        raise UsageError(f"--to must be one of {', '.join(FORMATS)}, not {to!r}")
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if (layout not in (None, "plain", "torchtitan", "verl") or layout == "torchtitan" and to != "dcp"
            or layout == "verl" and to != "sharded"):
        raise UsageError(f"--layout {layout} is not written by convert --to {to} "
                         "(--to dcp --layout torchtitan, --to sharded --layout verl)")
    if world_size is not None and world_size < 1:
        raise UsageError(f"--world-size must be at least 1, not {world_size}")
    src_path, dst = Path(src), Path(dst)
    if torchrun_rank() != 0:
        progress = False  # one voice per torchrun launch
    check_destination(src_path, dst, overwrite=overwrite)  # before any work, or any warning about it
    ckpt = _ckpt or describe(src_path)
    if layout == "verl" and ckpt.format == "sharded":
        raise UsageError(f"{src_path}: per-rank files keep their own device mesh, its names included "
                         "(--layout verl names the mesh of files built from another format)")
    cast = DTYPES.get(dtype) if dtype else None
    keep = [t for t in ckpt.tensors if t.group == "model" or not (model_only or to == "hf")]
    left_out = sorted({t.group for t in ckpt.tensors} - {t.group for t in keep})
    if not [t for t in keep if t.group == "model"]:
        raise BadInput(f"{src_path}: holds no model tensors to write")
    objects = tuple(o for o in ckpt.objects if not (model_only or to == "hf") or o.group == "model")
    if to != "hf":
        left_out += sorted({o.group for o in ckpt.objects} - {o.group for o in objects} - set(left_out))
    if ckpt.details.get("optimizer_flat") and not (model_only or to == "hf"):
        raise BadInput(f"{src_path}: {ckpt.details['optimizer_flat']}, so ckpt cannot write it resharded or "
                       "converted without guessing. Export or convert the model alone (ckpt export, or "
                       "convert --model-only), or save with FSDP2 or use_orig_params=True")
    ws = world_size or (ckpt.world_size if ckpt.world_size and to in ("sharded", "dcp") else 1)
    report: dict[str, Any] = {"src": str(src_path), "dst": str(dst), "format": to, "world_size": ws if to in ("sharded", "dcp") else None}
    after: Any = None
    if to == "hf":
        return _export(ckpt, src_path, dst, keep, cast, max_shard_size, base, overwrite, progress, report, left_out,
                       lora, lora_alpha)
    targets = targets_from(keep, dtype=cast)
    carry = None
    if to == ckpt.format and to in ("dcp", "sharded") and not model_only and layout is None:
        # a copy in the source's own format keeps its framework's layout (reshard)
        lay, objects, carry = keep_layout(ckpt, objects, ws, rank_local)
        report["layout"] = lay.name
    piece_of = rows_of
    if layout == "torchtitan":
        from ..naming import torchtitan

        targets, row_maps = torchtitan.from_hf_targets([t for t in targets if t.group == "model"],
                                                       hfassets.read_config(hfassets.find_assets(src_path, base)), src_path)
        piece_of, objects = torchtitan.rank_piece(row_maps), ()
    shared = tuple(o for o in objects if o.rank is None)
    rank_objs = [o for o in objects if o.rank is not None]
    native_extras = _native_extras(ckpt, rank_objs, rank_local) if to in ("torch", "dcp") and rank_objs else None

    def merged_by_torch(warn=None) -> dict:
        # one global copy: values equal on every rank; rank-local ones follow the policy
        if not (to in ("torch", "dcp") and rank_objs):
            return {}
        with Reader(ckpt) as reader:
            (values,) = per_rank_extras(rank_objs, reader.object, src_world=ckpt.world_size, dst_world=1,
                                        policy=rank_local, warn=warn)
        return values

    # read as pickle trees for ckpt's own writers; torch's writers take values as torch loads them
    merged = native_extras if native_extras is not None else merged_by_torch()
    quiet = lambda m: None  # noqa: E731 - said once already, by the first merge
    if to == "torch":
        jobs = [FileJob(dst.name, tuple(whole(t) for t in targets), shared, meta={"extra": merged})]
        writer: Any = torchnative.native_writer(ckpt, jobs, param_order=ckpt.param_order)
        if writer is None:
            if native_extras is not None:
                jobs = [FileJob(dst.name, jobs[0].pieces, shared, meta={"extra": merged_by_torch(quiet)})]
            writer = torchsave.Writer(param_order=ckpt.param_order)
    elif to == "dcp":
        jobs = layout_dcp(targets, shared, ws, merged, part_of=dcp_part if carry is not None else None,
                          piece_of=piece_of)
        # ckpt's own writer where it covers the plan (no torch, bytes copied by the kernel),
        # else torch's; either keeps a layout (part directories, a DCP source's items copied as
        # saved, torchtitan's top-level names) the same way
        source_dcp = ckpt.format == "dcp" and carry is not None
        writer = dcpnative.native_writer(ckpt, jobs, param_order=ckpt.param_order, extras=native_extras is not None,
                                         verbatim=source_dcp, top_level_model=layout == "torchtitan")
        if writer is None:
            if native_extras is not None:
                jobs = layout_dcp(targets, shared, ws, merged_by_torch(quiet), part_of=dcp_part if carry is not None else None,
                                  piece_of=piece_of)
            writer = dcp.Writer(param_order=ckpt.param_order, source=ckpt.base_dir() if source_dcp else None,
                                top_level_model=layout == "torchtitan")
    else:
        # rank files' mesh names: verl's when asked; else a rank-file source's own (kept also where
        # its files are rebuilt by torch's writer, as for --to 1); else unnamed
        names = ("fsdp",) if layout == "verl" else ckpt.details.get("mesh_dim_names") if ckpt.format == "sharded" else None
        writer, jobs = _sharded_plan(ckpt, targets, objects, ws, rank_local, mesh_names=tuple(names) if names else None)
    if carry is not None:
        def after(tmp: Path) -> None:
            copy_side_files(ckpt.base_dir(), carry.files, tmp)
    elif to == "sharded":
        # verl's layout from another format: config and tokenizer into huggingface/
        assets = hfassets.find_assets(src_path, base)

        def after(tmp: Path) -> None:
            if assets is not None:
                (tmp / "huggingface").mkdir()
                hfassets.copy_assets(assets, tmp / "huggingface", dtype=None)

    execute(ckpt, writer, jobs, dst, overwrite=overwrite, progress=progress, desc=f"{to} → {dst.name}", fmt=to,
            workers=workers, after=after)
    if left_out:
        _say(f"note: left out {', '.join(left_out)} state (model only)", progress)
    if to == "sharded" and ckpt.format != "sharded" and layout != "verl":
        _say("note: the rank files' device mesh is unnamed, as fully_shard's default mesh is; a job loads them "
             "only onto a mesh of the same names: for verl (mesh ('fsdp',)) convert with --layout verl", progress)
    report.update(num_tensors=len(targets), total_bytes=sum(t.nbytes for t in targets), left_out=left_out)
    return report


def _native_extras(ckpt: Checkpoint, rank_objs: list[ObjectInfo], policy: str) -> dict | None:
    """Per-rank extra state of a sharded source merged into one copy (as ``per_rank_extras``
    merges it) as pickle trees, without torch; None where torch's loader must read it."""
    if ckpt.format != "sharded" or not all(c.location.kind == "raw" for t in ckpt.tensors for c in t.chunks):
        return None

    def tree(e: shardtree.Entry) -> tuple:
        zf = shardtree.parsed(ckpt.base_dir() / e.file)
        return zf, zf.tree[e.key]

    said: list[str] = []
    try:
        (merged,) = per_rank_extras(rank_objs, lambda o: shardtree.Entry(o.location.file, o.location.key[0]),
                                    src_world=ckpt.world_size, dst_world=1, policy=policy, warn=said.append,
                                    equal=lambda a, b: shardtree.same_value(tree(a), tree(b)))
        values = {key: tree(e)[1] for key, e in merged.items()}
    except (shardtree.NotSimple, BadInput, KeyError, TypeError):
        return None
    if not all(dcpnative.plain(v) for v in values.values()):
        return None
    for m in said:
        print(f"warning: {m}", file=sys.stderr)
    return values


def _sharded_plan(ckpt: Checkpoint, targets: list[Target], objects: tuple[ObjectInfo, ...], ws: int,
                  rank_local: str, mesh_names: tuple[str, ...] | None = None) -> tuple[sharded.Writer, list[FileJob]]:
    """The sharded writer and its jobs. From a sharded source read without torch, each new file
    is its source's pickle rebuilt for the new ranks (its mesh kept), records copied by the
    kernel; else (or if the dry run finds something only torch can write) tensors go through
    torch.save, on a mesh of dimensions ``mesh_names`` (None: unnamed, as ``fully_shard``'s
    default mesh is)."""
    keyed = "fqn" if ckpt.format == "sharded" and ckpt.details.get("optimizer_keyed") == "fqn" else "int"
    extra_objs = [o for o in objects if o.group == "extra"]
    if ckpt.format == "sharded" and all(c.location.kind == "raw" for t in ckpt.tensors for c in t.chunks) and all(
            t.dtype == t.source.dtype for t in targets):
        writer = sharded.Writer(world_size=ws, param_order=ckpt.param_order, keyed=keyed, template=ckpt.root,
                                src_world=ckpt.world_size, config=sharded.read_config(ckpt.root))

        def equal(a: shardtree.Entry, b: shardtree.Entry) -> bool:
            return shardtree.same_value(writer.entry(a), writer.entry(b))

        try:
            extras = per_rank_extras(extra_objs, lambda o: shardtree.Entry(o.location.file, o.location.key[0]),
                                     src_world=ckpt.world_size, dst_world=ws, policy=rank_local, equal=equal)
            jobs = layout_sharded(ckpt, targets, ws, extras)
            for job in jobs:
                writer.tree_for(job)  # a dry run: anything unusual falls back before a byte is written
            return writer, jobs
        except shardtree.NotSimple:
            pass
    elif ckpt.format != "sharded" and shardsynth.available():
        # no source rank files to rebuild: each file's tree is built from the plan, no torch
        writer = sharded.Writer(world_size=ws, param_order=ckpt.param_order, keyed=keyed, synth=ckpt.base_dir(),
                                mesh_names=mesh_names)
        try:
            if any(o.rank is not None for o in extra_objs):
                raise shardtree.NotSimple("rank-local extra state")
            shared = shardsynth.object_values(ckpt.base_dir(), extra_objs)
            jobs = layout_sharded(ckpt, targets, ws, [shared] * ws if shared else None)
            for job in jobs:
                writer.tree_for(job)  # a dry run, as above
            return writer, jobs
        except shardtree.NotSimple:
            pass
    config = sharded.read_config(ckpt.root) if ckpt.format == "sharded" else {}
    writer = sharded.Writer(world_size=ws, param_order=ckpt.param_order, keyed=keyed, config=config,
                            mesh_names=mesh_names)
    with Reader(ckpt) as reader:
        extras = per_rank_extras(extra_objs, reader.object, src_world=ckpt.world_size, dst_world=ws,
                                 policy=rank_local)
    return writer, layout_sharded(ckpt, targets, ws, extras)


def _export(ckpt: Checkpoint, src_path: Path, dst: Path, keep: list[TensorInfo], cast, max_shard_size,
            base: str | None, overwrite: bool, progress: bool, report: dict, left_out: list[str],
            lora: str | None = None, lora_alpha: float | None = None) -> dict:
    from ..naming import hfnames

    assets = hfassets.find_assets(src_path, base)
    config = hfassets.read_config(assets)
    plan = hfnames.plan_export(ckpt, src_path, keep, cast=cast, config=config, lora=lora, lora_alpha=lora_alpha,
                               base=base)
    pieces, adapter = plan.pieces, plan.adapter_config is not None
    single = dst.suffix == ".safetensors"
    if adapter and single:
        raise UsageError(f"{dst}: a PEFT adapter is a directory (adapter_model.safetensors + adapter_config.json)")
    writer = hf.Writer(single_file=single, max_shard_size=max_shard_size)
    if adapter:
        jobs = [FileJob(hfnames.peft_lora.ADAPTER_WEIGHTS, tuple(pieces))]
    else:
        jobs = writer.plan(pieces) if not single else [FileJob(dst.name, tuple(pieces))]
    targets = [p.target for p in pieces]
    dtypes = {t.dtype for t in targets if t.dtype.is_floating_point}
    written = cast or (max(dtypes, key=lambda d: sum(t.numel for t in targets if t.dtype == d)) if dtypes else None)

    notes: list[str] = []

    def after(tmp: Path) -> None:
        notes.extend(wait_for_check())  # a refusal here leaves nothing at DST
        if adapter:
            (tmp / hfnames.peft_lora.ADAPTER_CONFIG).write_text(json.dumps(plan.adapter_config, indent=2) + "\n")
            report["assets"] = [hfnames.peft_lora.ADAPTER_CONFIG]
        elif not single:
            report["assets"] = hfassets.copy_assets(assets, tmp, dtype=written)

    with hfnames.checked_in_background(plan) as wait_for_check:
        execute(plan.ckpt, writer, jobs, dst, overwrite=overwrite, progress=progress, desc=f"hf → {dst.name}",
                fmt="hf", after=after)
    hfnames.say(notes, progress)
    if left_out:
        _say(f"note: the export holds the model only; left out {', '.join(left_out)} state", progress)
    if assets is None and not single and not adapter:
        _say("note: no config.json or tokenizer found (no huggingface/ folder); pass --base MODEL to add them", progress)
    report.update(num_tensors=len(targets), total_bytes=sum(t.nbytes for t in targets), left_out=left_out,
                  dtype=str(written) if written else None,
                  lora="adapter" if adapter else ("merge" if any(p.add for p in pieces) else None))
    return report


def export(src: str | Path, dst: str | Path, *, base: str | None = None, dtype: str | None = None,
           max_shard_size: str | int = "5GB", overwrite: bool = False, progress: bool = True,
           lora: str = "merge", lora_alpha: float | None = None) -> dict[str, Any]:
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

    Example: ``ckpt_tools.export("ckpt/global_step_500/actor", "hf_out", dtype="bf16")``
    """
    return convert(src, dst, to="hf", dtype=dtype, max_shard_size=max_shard_size, model_only=True,
                   base=base, overwrite=overwrite, progress=progress, lora=lora, lora_alpha=lora_alpha)


def reshard(src: str | Path, dst: str | Path, *, to: int, from_: int | None = None,
            overwrite: bool = False, progress: bool = True, rank_local: str = "drop",
            workers: int = 1) -> dict[str, Any]:
    """Reshard a ``sharded`` or ``dcp`` checkpoint to ``to`` ranks, keeping its format and the
    whole training state (model, optimizer, extra state).

    ``workers`` processes write the output files in parallel (each file by one process, so the
    result is byte-identical to a single process's).

    Example: ``ckpt_tools.reshard("ckpt/actor", "ckpt4/actor", to=4, from_=8)``
    """
    if to < 1:
        raise UsageError(f"--to must be at least 1, not {to}")
    if workers < 1:
        raise UsageError(f"--workers must be at least 1, not {workers}")
    ckpt = describe(Path(src))
    if ckpt.format not in ("sharded", "dcp"):
        raise BadInput(f"{src}: is {ckpt.format!r}, which has no ranks; use `ckpt convert --to sharded --world-size {to}`")
    if from_ is not None and from_ != ckpt.world_size:
        raise BadInput(f"{src}: --from {from_} but the checkpoint was saved by {ckpt.world_size} ranks")
    if ckpt.format == "sharded" and ckpt.mesh_shape and len(ckpt.mesh_shape) > 1:
        raise BadInput(f"{src}: saved on a {len(ckpt.mesh_shape)}-D device mesh {tuple(ckpt.mesh_shape)} (HSDP or "
                       "FSDP+TP); reshard writes 1-D FSDP2 rank files, which such a job does not load. Export it "
                       "(ckpt export), or convert it to DCP (ckpt convert --to dcp), which the job reshards at load")
    _check_same_save(ckpt)
    return convert(src, dst, to=ckpt.format, world_size=to, overwrite=overwrite, progress=progress,
                   rank_local=rank_local, workers=workers, _ckpt=ckpt)


def _check_same_save(ckpt: Checkpoint) -> None:
    """Every rank's copy of a replicated scalar (the optimizer's ``step``) must agree."""
    with Reader(ckpt) as r:
        for t in ckpt.tensors:
            if t.state != "step" or len(t.chunks) < 2:
                continue
            # compared as stored bytes: no tensor (and no torch) needed
            values = {bytes(r.raw(c.location)) if c.location.kind == "raw" else r.chunk(t, c).item() for c in t.chunks}
            if len(values) > 1:
                values = {r.chunk(t, c).item() for c in t.chunks}
                raise BadInput(f"{ckpt.root}: {t.name!r} differs between ranks ({sorted(values)}); "
                               "the rank files are not from one save")
