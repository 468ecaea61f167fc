"""DeepSpeed ZeRO saves written for another data-parallel world size (``reshard --to M``).

DeepSpeed's own loader (``engine.load_checkpoint``) takes a save only at the world size that
wrote it: each rank reads its own ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` and
copies its flat partitions as they are. So the files are written as an M-rank job of the same
stage and precision would have saved them (DeepSpeed 0.19's layouts, proven against the source
first: a layout these rules do not reproduce at the source's own world size is refused):

- stages 1/2, per optimizer group: the parameters concatenated in ``param_shapes`` order, each
  followed by its ``param_alignment_paddings`` (independent of the world size), the whole padded
  to a multiple of ``2 * M`` (``nccl_start_alignment_factor * dp``), cut into ``M`` contiguous
  near-equal partitions (``get_data_parallel_partitions``). ``group_paddings[g]`` is the padding
  that falls in a rank's partition; ``single_partition_of_fp32_groups`` holds the partition
  without it, the wrapped optimizer's moments hold it whole (rigid checkpoint);
  ``param_slice_mappings`` say where each parameter's fragment starts in the partition;
- stage 3: every parameter cut into ``ceil(n / M)`` elements per rank, the last rank's piece
  padded at its tail, rank R's pieces concatenated group by group (``fp32_flat_groups``).

Each new flat tensor is a record made of per-parameter rectangles (:func:`ckpt_tools.core.flat.boxes`
of the source's description), which the engine reads a parameter piece at a time, and zeros
for the padding. Everything else (module weights and buffers of the model states, loss scaler,
``step``, ``param_groups``, ``lr_scheduler``, ``global_steps``, ``global_samples``, client
state) is the source's pickle, its storages copied record to record; ``dp_world_size``,
``partition_count`` and ``ds_config``'s per-rank micro batch say M. ``latest`` names the tag.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..codecs.tensornodes import local_of
from ..codecs.torchpickler import dumps
from ..codecs.torchwriter import TorchZipWriter
from ..core.describe import Checkpoint
from ..core.flat import boxes
from ..core.plan import FileJob, Piece, Span, Target, by_piece, piece
from ..errors import BadInput
from ..security import zeroglobals
from ..security.torchfile import NewObj, Reduce
from . import deepspeed as src_format
from .hf import tensor_bytes
from .shardtree import FROM_TYPE, REBUILD_V2, Emitter, renumber, small_records

NAME = src_format.NAME
ALIGN_FACTOR = 2  # DeepSpeed's nccl_start_alignment_factor: groups padded to 2 * dp elements
_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # recovery scripts DeepSpeed copies beside the tags
_BLOCK = 1 << 20


def optim_name(bf16: bool, rank: int) -> str:
    """A rank's optimizer states file, as DeepSpeed names it (``bf16_`` in a bf16 run)."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


# -- where each parameter's elements go (pure) -------------------------------------------------

Seg = tuple[str | None, int, int]  # (fqn, start, stop) of the flattened parameter; fqn None: zeros


def stage12_partitions(numels: list[int], align: list[int], world: int) -> list[tuple[int, int, int]]:
    """``(start, size, padding)`` of each rank's partition of one stage-1/2 group."""
    padded = sum(numels) + sum(align)
    unit = ALIGN_FACTOR * world
    total = -(-padded // unit) * unit
    base, extra = divmod(total, world)
    out, start = [], 0
    for r in range(world):
        size = base + (1 if r < extra else 0)
        pad = size if padded <= start else max(0, start + size - padded)
        out.append((start, size, pad))
        start += size
    return out


def stage12_segments(params: list[tuple[str, int]], align: list[int], lo: int, hi: int) -> list[Seg]:
    """The elements ``[lo, hi)`` of a group's padded flat layout, as parameter ranges and zeros."""
    out: list[Seg] = []
    at = lo

    def zeros(upto: int) -> None:
        nonlocal at
        if upto > at:
            out.append((None, 0, upto - at))
            at = upto

    pos = 0
    for (fqn, n), pad in zip(params, align):
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            zeros(a)
            out.append((fqn, a - pos, b - pos))
            at = b
        pos += n + pad
    zeros(hi)
    return out


def stage3_segments(params: list[tuple[str, int]], world: int, rank: int) -> list[Seg]:
    """Rank ``rank``'s stage-3 flat partition of one group: each parameter's ``ceil(n / M)``
    elements, zeros where the parameter ends first."""
    out: list[Seg] = []
    for fqn, n in params:
        per = -(-n // world)
        a, b = min(rank * per, n), min((rank + 1) * per, n)
        if a < b:
            out.append((fqn, a, b))
        if per - (b - a):
            out.append((None, 0, per - (b - a)))
    return out


def fragments(params: list[tuple[str, int]], align: list[int], lo: int, hi: int) -> list[tuple[str, int, int]]:
    """``param_slice_mappings`` of a partition: ``(fqn, numel, start)`` of each parameter in it."""
    out, pos = [], 0
    for (fqn, n), pad in zip(params, align):
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            out.append((fqn, b - a, a - lo))
        pos += n + pad
    return out


# -- the source, checked ---------------------------------------------------------------------

@dataclass(frozen=True)
class Flat:
    """A flat tensor to write: ``items`` are pieces of parameters and counts of zero elements,
    in order; ``like`` is the source node whose form (a plain tensor, or one pickled with its
    attributes) the new one keeps."""

    key: tuple
    items: tuple
    like: Any
    itemsize: int

    @property
    def numel(self) -> int:
        return sum(i if isinstance(i, int) else i.numel for i in self.items)


class Source:
    """A ZeRO save described and read as the writer needs it; refuses what it cannot prove."""

    def __init__(self, ckpt: Checkpoint) -> None:
        if ckpt.format != src_format.NAME:
            raise BadInput(f"{ckpt.root}: is {ckpt.format!r}; only a DeepSpeed ZeRO save is written as one (at "
                           f"another world size: ckpt reshard). From {ckpt.format!r} the ZeRO stage, precision and "
                           "ds_config would have to be invented; convert it --to dcp or --to sharded instead")
        facts = ckpt.details.get("facts", {})
        self.stage, self.world = facts.get("zero_stage"), ckpt.world_size
        self.ckpt = ckpt
        self.dir = src_format.step_dir(ckpt.root)
        self.tag = self.dir.name if self.dir != ckpt.root else None
        if self.stage not in (1, 2, 3):
            raise BadInput(f"{self.dir}: a ZeRO save without its optimizer files (or of stage {self.stage!r}) cannot "
                           "be written at another world size: the fp32 master and moments are in those files")
        names = sorted(p.name for p in self.dir.iterdir())
        known = {f.path.rpartition("/")[2] for f in ckpt.files} | set(_SCRIPTS)
        other = [n for n in names if n not in known]
        if other:
            raise BadInput(f"{self.dir}: holds {', '.join(other[:4])}, which this writer does not know (model "
                           "parallel, pipeline, expert or offloaded state); only data-parallel ZeRO saves of one "
                           "model-parallel rank are written at another world size")
        self.bf16 = facts.get("mixed_precision") == "bf16"  # fp16 files are named as fp32 ones
        self.model_file = (src_format.MODEL_STATES if (self.dir / src_format.MODEL_STATES).is_file()
                           else "zero_pp_rank_0_mp_rank_00_model_states.pt")
        self.model_zip = zeroglobals.read(self.dir / self.model_file)
        self.zips = [zeroglobals.read(self.dir / optim_name(self.bf16, r)) for r in range(self.world)]
        m = self.model_zip.tree
        self.groups = [[(fqn, tuple(s.args[0]) if type(s) is Reduce else tuple(s)) for fqn, s in g.items()]
                       for g in m["param_shapes"]]
        if m.get("mp_world_size", 1) != 1:
            raise BadInput(f"{self.dir / self.model_file}: mp_world_size {m.get('mp_world_size')}; only saves of one "
                           "model-parallel rank are written at another world size")
        dims = m.get("checkpoint_parallel_dimensions") or {}
        if isinstance(dims, dict) and any(v not in (None, 1) for v in dims.values()):
            raise BadInput(f"{self.dir / self.model_file}: saved with parallel dimensions {dims}; only data "
                           "parallel ZeRO saves are written at another world size")
        self.osd = [z.tree["optimizer_state_dict"] for z in self.zips]
        config = self.zips[0].tree.get("ds_config") if isinstance(self.zips[0].tree, dict) else None
        zero = config.get("zero_optimization") if isinstance(config, dict) else None
        for flag in ("round_robin_gradients", "elastic_checkpoint"):
            if isinstance(zero, dict) and zero.get(flag):
                raise BadInput(f"{self.dir}: saved with zero_optimization.{flag}, whose layout depends on the world "
                               "size in ways this writer does not reproduce")
        for key in ("ds_zero_partition_groups", "universal_checkpoint_info"):
            if any(key in o for o in self.osd):
                raise BadInput(f"{self.dir}: its optimizer states hold {key}, which this writer does not know")
        self.master = {t.name: t for t in ckpt.tensors if t.group == "model"}
        self.moments = {(t.param, t.state): t for t in ckpt.tensors if t.group == "optimizer" and t.shape}
        self.states = list(dict.fromkeys(s for _, s in self.moments))
        self._prove()

    def numels(self, g: int) -> list[tuple[str, int]]:
        return [(fqn, math.prod(shape)) for fqn, shape in self.groups[g]]

    def align(self, g: int) -> list[int]:
        return list(self.osd[0]["param_alignment_paddings"][g])

    def _length(self, node: Any) -> int:
        local = local_of(zeroglobals.plain_tensor(node))
        return local.size[0] if local is not None and len(local.size) == 1 else -1

    def _prove(self) -> None:
        """The rules reproduce the source's own partitions at its own world size, or it is refused."""
        n = self.world
        for g in range(len(self.groups)):
            for r, osd in enumerate(self.osd):
                where = self.dir / self.zips[r].path.name
                if self.stage == 3:
                    want = sum(b - a if f else b for f, a, b in stage3_segments(self.numels(g), n, r))
                    got = self._length(osd["fp32_flat_groups"][g])
                    moments = [self._length(v) for v in osd["optimizer_state_dict"]["state"][g].values()
                               if self._length(v) > 0]
                    if got != want or any(m != want for m in moments) or osd.get("partition_count") not in (n, [n]):
                        raise BadInput(f"{where}: group {g}'s stage-3 partition is not the layout this writer "
                                       f"knows ({got} elements, {want} expected at {n} ranks)")
                    continue
                if not isinstance(osd.get("param_alignment_paddings"), list) or osd["param_alignment_paddings"] != \
                        self.osd[0]["param_alignment_paddings"]:
                    raise BadInput(f"{where}: no param_alignment_paddings (an older DeepSpeed save), or ranks disagree;"
                                   " its layout cannot be proven")
                start, size, pad = stage12_partitions([k for _, k in self.numels(g)], self.align(g), n)[r]
                got = self._length(osd["single_partition_of_fp32_groups"][g])
                moments = [self._length(v) for v in osd["base_optimizer_state"]["state"][g].values()
                           if self._length(v) > 0]
                if (got != size - pad or osd["group_paddings"][g] != pad or any(m != size for m in moments)
                        or osd.get("partition_count") != [n] * len(self.groups)):
                    raise BadInput(f"{where}: group {g}'s partition ({got} elements, padding "
                                   f"{osd['group_paddings'][g]}) is not the layout this writer knows ({size - pad}, "
                                   f"padding {pad} at {n} ranks); it was saved with options it does not reproduce")

    # -- a rank's flat tensors at M ---------------------------------------------------------

    def _items(self, g: int, segs: list[Seg], target_of) -> tuple:
        out: list = []
        shapes = dict(self.groups[g])
        for fqn, a, b in segs:
            if fqn is None:
                out.append(b - a)
                continue
            target = target_of(fqn)
            out += [piece(target, offsets, sizes) for offsets, sizes in boxes(shapes[fqn], a, b)]
        return tuple(out)

    def flats(self, world: int, rank: int) -> tuple[dict, list, list]:
        """The flat tensors of ``rank`` at ``world``: ``{key: items}`` with keys ``("master", g)``
        and ``("state", g, name)``; the group paddings; the fragments (stages 1/2)."""
        out, pads, frags = {}, [], []
        for g in range(len(self.groups)):
            params = self.numels(g)
            if self.stage == 3:
                full = master = stage3_segments(params, world, rank)
            else:
                align = self.align(g)
                start, size, pad = stage12_partitions([n for _, n in params], align, world)[rank]
                full = stage12_segments(params, align, start, start + size)
                master = stage12_segments(params, align, start, start + size - pad)
                pads.append(pad)
                frags.append(fragments(params, align, start, start + size))
            out[("master", g)] = self._items(g, master, lambda f: _target(self.master[f]))
            for state in self.states:
                out[("state", g, state)] = self._items(g, full, lambda f, s=state: _target(self.moments[(f, s)]))
        return out, pads, frags


def _target(t) -> Target:
    return Target(t, t.group, t.name, t.dtype, t.param, t.state)


# -- the files' pickle trees -------------------------------------------------------------------

def _config_for(config: Any, world: int) -> Any:
    """``ds_config`` as an M-rank job states it: its per-rank micro batch, where the global batch
    divides (the loader does not read it; a job's own config decides)."""
    if not isinstance(config, dict):
        return config
    tbs, gas = config.get("train_batch_size"), config.get("gradient_accumulation_steps") or 1
    if "train_micro_batch_size_per_gpu" in config and type(tbs) is int and type(gas) is int and tbs % (gas * world) == 0:
        return {**config, "train_micro_batch_size_per_gpu": tbs // (gas * world)}
    return config


def optim_tree(src: Source, world: int, rank: int, flats: dict, pads: list, frags: list) -> Any:
    """Rank ``rank``'s optimizer states file at ``world``: rank 0's pickle with the new
    partitions and the facts that say the world size."""
    top = dict(src.zips[0].tree)
    osd = dict(top["optimizer_state_dict"])

    def flat(key: tuple, like: Any) -> Flat:
        local = local_of(zeroglobals.plain_tensor(like))
        if local is None or len(local.size) != 1:
            raise BadInput(f"{src.dir}: {key} of rank 0 is not a flat tensor")
        items = flats[key]
        if any(not isinstance(i, int) and i.target.dtype.itemsize != local.dtype.itemsize for i in items):
            raise BadInput(f"{src.dir}: {key} mixes element sizes; cannot be written as one flat tensor")
        return Flat(key, items, like, local.dtype.itemsize)

    inner_key = "optimizer_state_dict" if src.stage == 3 else "base_optimizer_state"
    inner = dict(osd[inner_key])
    inner["state"] = {g: {k: (flat(("state", g, k), v) if ("state", g, k) in flats else v) for k, v in entry.items()}
                      for g, entry in inner["state"].items()}
    osd[inner_key] = inner
    if src.stage == 3:
        osd["fp32_flat_groups"] = [flat(("master", g), v) for g, v in enumerate(osd["fp32_flat_groups"])]
        osd["partition_count"] = world if type(osd["partition_count"]) is int else [world] * len(src.groups)
    else:
        osd["single_partition_of_fp32_groups"] = [flat(("master", g), v)
                                                  for g, v in enumerate(osd["single_partition_of_fp32_groups"])]
        osd["group_paddings"] = list(pads)
        osd["partition_count"] = [world] * len(src.groups)
        if "param_slice_mappings" in osd:
            cls = _fragment_class(src)
            osd["param_slice_mappings"] = [OrderedDict((fqn, NewObj(cls, (), {"numel": n, "start": s}))
                                                       for fqn, n, s in group) for group in frags]
    top["optimizer_state_dict"] = osd
    if "ds_config" in top:
        top["ds_config"] = _config_for(top["ds_config"], world)
    return top


def _fragment_class(src: Source) -> Any:
    for osd in src.osd:
        for group in osd.get("param_slice_mappings") or []:
            for node in group.values():
                if type(node) is NewObj:
                    return node.cls
    raise BadInput(f"{src.dir}: param_slice_mappings name no fragment; cannot write them")


def model_tree(src: Source, world: int) -> Any:
    top = dict(src.model_zip.tree)
    top["dp_world_size"] = world
    if "ds_config" in top:
        top["ds_config"] = _config_for(top["ds_config"], world)
    return top


def build(tree: Any, zf, emitter: Emitter) -> Any:
    """A copy of ``tree`` (of file ``zf``) for ``emitter``: the source's storages copied record
    to record, each :class:`Flat` a new 1-D tensor of its own record."""
    return renumber(tree, zf, emitter, leaf=lambda x: _flat_node(x, emitter) if type(x) is Flat else None)


def _flat_node(f: Flat, emitter: Emitter) -> Reduce:
    like = f.like
    wrapped = type(like) is Reduce and like.func == FROM_TYPE
    inner = like.args[2] if wrapped else like.args
    ref = emitter.storage(inner[0], f.numel, f)
    args = (ref, 0, (f.numel,), (1,), *inner[4:])
    if wrapped:
        return Reduce(like.func, (like.args[0], like.args[1], args, like.args[3]), like.state)
    return Reduce(REBUILD_V2, args, like.state)


# -- the writer --------------------------------------------------------------------------------

class Writer:
    """Writes the jobs of :func:`plan` (one torch.save file each) and ``latest``."""

    single_file = False
    accepts_spans = True
    accepts_casts = False

    def __init__(self, src: Source, world: int, tag: str) -> None:
        self.src, self.world, self.tag = src, world, tag

    def tree_for(self, job: FileJob) -> tuple[Any, Emitter, Any]:
        emitter = Emitter()
        if job.kind == "model":
            return build(model_tree(self.src, self.world), self.src.model_zip, emitter), emitter, self.src.model_zip
        flats, pads, frags = job.meta["flats"], job.meta["pads"], job.meta["frags"]
        tree = optim_tree(self.src, self.world, job.rank, flats, pads, frags)
        return build(tree, self.src.zips[0], emitter), emitter, self.src.zips[0]

    def write(self, path: Path, job: FileJob, pieces, objects) -> None:
        tree, emitter, zf = self.tree_for(job)
        values = by_piece(iter(pieces))
        with TorchZipWriter(path, path.stem) as out:
            out.write_record("data.pkl", dumps(tree))
            for name, data in small_records(zf):
                out.write_record(name, data)
            for key, source in emitter.records:
                if type(source) is Flat:
                    out.write_stream(f"data/{key}", source.numel * source.itemsize, _bytes(source, values))
                else:
                    out.copy_record(f"data/{key}", source)

    def finish(self, out: Path, jobs, written: dict) -> None:
        # what save_checkpoint writes last: the tag DeepSpeed's loader reads when none is given
        (out / src_format.LATEST).write_text(self.tag)


def _bytes(flat: Flat, values):
    """The record of ``flat``: each piece's bytes as the engine hands them, zeros between."""
    for item in flat.items:
        if isinstance(item, int):
            left = item * flat.itemsize
            while left:
                n = min(left, _BLOCK)
                yield bytes(n)
                left -= n
            continue
        v = values(item)
        if isinstance(v, Span):
            for path, offset, length in v.parts:
                fd = os.open(path, os.O_RDONLY)
                try:
                    done = 0
                    while done < length:
                        chunk = os.pread(fd, min(_BLOCK, length - done), offset + done)
                        if not chunk:
                            raise BadInput(f"{path}: ends before byte {offset + length}")
                        yield chunk
                        done += len(chunk)
                finally:
                    os.close(fd)
        else:
            yield tensor_bytes(v)


def plan(src: Source, world: int) -> tuple[Writer, list[FileJob]]:
    """The writer and its jobs: the model states (one file; one per rank in stage 3) and each
    rank's optimizer states, under the source's tag."""
    tag = src.tag or src.dir.name
    writer = Writer(src, world, tag)
    jobs = []
    for r in range(world):
        if src.stage == 3 or r == 0:
            name = src_format.MODEL_STATES if src.stage != 3 else f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
            jobs.append(FileJob(f"{tag}/{name}", (), (), r, "model"))
        flats, pads, frags = src.flats(world, r)
        job = FileJob(f"{tag}/{optim_name(src.bf16, r)}", (), (), r, "optim",
                      {"flats": flats, "pads": pads, "frags": frags})
        # the pieces in the order the file's records take them (the engine streams them so)
        _, emitter, _ = writer.tree_for(job)
        ordered = tuple(i for _, s in emitter.records if type(s) is Flat for i in s.items if isinstance(i, Piece))
        jobs.append(FileJob(job.path, ordered, (), r, "optim", job.meta))
    return writer, jobs


def scripts(src: Source) -> list[Path]:
    """DeepSpeed's recovery scripts beside the tag, carried as side files."""
    return [src.ckpt.root / n for n in _SCRIPTS if src.tag and (src.ckpt.root / n).is_file()]


def source(ckpt: Checkpoint) -> Source:
    """:class:`Source` of ``ckpt``; a pickle that does not hold what DeepSpeed saves is exit 3."""
    try:
        return Source(ckpt)
    except BadInput:
        raise
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
        raise BadInput(f"{ckpt.root}: its ZeRO states do not hold what DeepSpeed saves ({type(e).__name__}: {e}); "
                       "nothing written") from None
