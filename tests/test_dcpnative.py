"""ckpt's own DCP writer (``formats/dcpnative.py`` + ``metapickle.py``): golden bytes against
torch's ``torch.save`` and ``pickle.dump`` of DCP's classes, byte-identical directories against
the torch writer it replaces, no torch imported, and ``dcp.load`` in a real 2-rank gloo job
filling a ``fully_shard`` model from a DCP written for 3 ranks.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpt_tools
from ckpt_tools.codecs import metapickle as mp
from ckpt_tools.commands.options import DTYPES
from ckpt_tools.formats.writers import layout_dcp
from ckpt_tools.engine.execute import execute
from ckpt_tools.formats import dcp, dcpnative, describe
from ckpt_tools.core.plan import targets_from
from ckpt_tools.codecs.torchpickler import dumps
from ckpt_tools.codecs.torchwriter import TorchZipWriter

try:
    from dist import run_ranks
except ImportError:
    from tests.dist import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "fixtures"


def _blob(dtype: str, sizes: tuple[int, ...], data: bytes, *, tensor: bool = True, value=None) -> bytes:
    """One DCP item as the native writer emits it, appended to an open file (as in a .distcp)."""
    with tempfile.TemporaryFile() as f:
        with TorchZipWriter(Path(os.devnull), "archive", fd=f.fileno()) as z:
            z.write_record("data.pkl", dcpnative.tensor_pickle(dtype, sizes) if tensor else dumps(value))
            for name, rec in dcpnative._SMALL:
                z.write_record(name, rec)
            if tensor:
                z.write_record("data/0", data)
            z.close(name_hash=dcpnative.TENSOR_NAME_HASH if tensor else dcpnative.OBJECT_NAME_HASH)
        f.seek(0)
        return f.read()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64", "int64", "int32", "int8", "uint8",
                                   "bool", "complex64"])
@pytest.mark.parametrize("shape", [(3, 4), (), (5,), (2, 0, 3), (1, 2, 3)], ids=str)
def test_tensor_item_is_torch_save(dtype, shape):
    """A DCP tensor item: the blob torch.save writes into dcp.save's stream."""
    t = (torch.arange(torch.Size(shape).numel()) % 7).to(getattr(torch, dtype)) if shape != (2, 0, 3) else None
    t = torch.zeros(shape, dtype=getattr(torch, dtype)) if t is None else t.reshape(shape)
    want = io.BytesIO()
    torch.save(t, want)
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    assert _blob(dtype, shape, raw) == want.getvalue()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "uint8", "bool"])
@pytest.mark.parametrize("shape", [(3, 4), (), (2, 0, 3), (1, 2, 3), (70, 3)], ids=str)
def test_tensor_item_from_its_template_is_torch_save(dtype, shape):
    """A small item rendered from its dtype and shape's template (how the writer writes the
    thousands of items of a many-rank DCP): the blob torch.save writes, for two tensors of one
    template, and for one whose bytes open as a zip data descriptor does (torch folds 4 more of
    them into its serialization id)."""
    for seed in (0, 1, "descriptor"):
        n = torch.Size(shape).numel()
        if seed == "descriptor":
            if dtype != "uint8" or n < 8:
                continue
            t = torch.tensor(list(b"PK\x07\x08") + [9] * (n - 4), dtype=torch.uint8).reshape(shape)
        else:
            t = ((torch.arange(n) * (seed + 3)) % 7).to(getattr(torch, dtype)).reshape(shape)
        want = io.BytesIO()
        torch.save(t, want)
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if n else b""
        got = dcpnative._item_template(dtype, shape, len(raw)).render(raw, zlib.crc32(raw))
        assert bytes(got) == want.getvalue() == _blob(dtype, shape, raw)


@pytest.mark.parametrize("value", [0.001, [0.9, 0.999], (0.9, 0.999), ["model.a", "model.b", "x"], True, None, 7, "s",
                                   {"lr": 0.1, "betas": (0.9, 0.95), "params": ["a"]}], ids=repr)
def test_object_item_is_torch_save(value):
    want = io.BytesIO()
    torch.save(value, want)
    assert _blob("", (), b"", tensor=False, value=value) == want.getvalue()


def test_no_legacy_storage_is_not_native():
    with pytest.raises(dcpnative.NotNative):
        dcpnative.tensor_pickle("uint16", (2,))


@pytest.mark.parametrize("pickler", ["c", "python", "named-like-a-stand-in", "named-like-an-unwritten-stand-in"])
def test_metadata_pickle_is_torchs(monkeypatch, pickler):
    """Stand-ins pickle as DCP's classes: shared strings, two dtypes, several chunks, bytes items,
    many frames; by the C pickler (stand-in modules renamed) and by the pure-Python one, which
    writes a file where an item is named like a stand-in module: one the pickler writes too, or
    one it does not (the dtypes' module, in a checkpoint without tensors)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)

    items = [(("model", "a"), "bfloat16", (0, 0), (2, 2), (4, 2)), (("model", "a"), "bfloat16", (2, 0), (2, 2), (4, 2)),
             (("optimizer", "state", "a", "exp_avg"), "float32", (0,), (3,), (3,)),
             (("optimizer", "state", "a", "step"), "float32", (), (), ()), (("x",), None, None, None, None),
             (("optimizer", "param_groups", 0, "lr"), None, None, None, None)]
    items += [(("model", f"layers.{i}.w"), "float16", (r * 2, 0), (2, 8), (16, 8)) for i in range(300) for r in range(8)]
    stand = next(stand for stand, real in mp._RENAMES if real.endswith(b"checkpoint.metadata"))[2:].decode()
    written, real_py = [], mp._dumps_py
    monkeypatch.setattr(mp, "_dumps_py", lambda m, p: written.append(p) or real_py(m, p))
    if pickler == "python":
        monkeypatch.setattr(mp, "_dumps_c", lambda *a: None)
    if pickler == "named-like-a-stand-in":
        items.append(((stand,), "float32", (0,), (3,), (3,)))
    if pickler == "named-like-an-unwritten-stand-in":
        mp.dtype("float32")
        items = [item for item in items if item[1] is None] + [((mp._STANDS[id(mp._DTYPE_MODULE)].__name__,),) + (None,) * 4]

    def build(real: bool) -> bytes:
        Size = torch.Size if real else mp.Size
        state, planner, storage = {}, {}, {}
        for path, dt, offs, sizes, shape in items:
            fqn = ".".join(map(str, path))
            if dt:
                props = TensorProperties(dtype=getattr(torch, dt)) if real else mp.TensorProperties(dtype=mp.dtype(dt))
                md = state.setdefault(fqn, (TensorStorageMetadata if real else mp.TensorStorageMetadata)(
                    properties=props, size=Size(shape), chunks=[]))
                md.chunks.append((ChunkStorageMetadata if real else mp.ChunkStorageMetadata)(
                    offsets=Size(offs), sizes=Size(sizes)))
                storage[(MetadataIndex if real else mp.MetadataIndex)(fqn, Size(offs))] = (
                    _StorageInfo if real else mp.StorageInfo)("__0_0.distcp", 5, 10)
            else:
                state[fqn] = BytesStorageMetadata() if real else mp.BytesStorageMetadata()
                storage[(MetadataIndex if real else mp.MetadataIndex)(fqn)] = (
                    _StorageInfo if real else mp.StorageInfo)("__1_0.distcp", 1, 2)
            planner[fqn] = path
        if real:
            return pickle.dumps(Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage,
                                         version="1.0.0"))
        return mp.dumps(mp.Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage,
                                    version="1.0.0"))

    assert build(False) == build(True)
    assert bool(written) == (pickler != "c")


def _mixed_hf(tmp_path: Path) -> Path:
    """Odd row counts (uneven splits, empty ranks), 0-dim and 1-row tensors, several dtypes."""
    src = tmp_path / "hf"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file({"model.a": torch.randn(7, 5, generator=g), "model.b": torch.randn(3, 2, generator=g).bfloat16(),
               "model.c": torch.arange(5, dtype=torch.int64), "model.d": torch.tensor(2.5),
               "model.e": torch.randn(1, 4, generator=g).half(), "model.f": torch.tensor([True, False, True])},
              src / "model.safetensors")
    return src


def _sharded_with_moments(tmp_path: Path) -> Path:
    """Sharded at 2 ranks with Adam-like moments and no param groups (as bench.py builds it)."""
    from dataclasses import replace

    from ckpt_tools.core.describe import TensorInfo

    ck = describe(_mixed_hf(tmp_path))
    # parameters are the tensors with rows (a 0-dim entry is saved whole, as a buffer): the
    # optimizer numbers them as the model file lists its DTensors
    params = [t for t in ck.tensors if t.shape]
    moments = [TensorInfo("optimizer", f"state.{t.name}.exp_avg", t.shape, t.dtype, t.chunks, t.name, "exp_avg")
               for t in params if t.dtype.is_floating_point]
    ck = replace(ck, tensors=ck.tensors + tuple(moments), param_order=tuple(t.name for t in params))
    ckpt_tools.convert(ck.root, tmp_path / "ws2", to="sharded", world_size=2, progress=False, _ckpt=ck)
    return tmp_path / "ws2"


SOURCES = {"hf": lambda tmp: FIX / "llama_hf", "mixed": _mixed_hf, "dcp": lambda tmp: FIX / "llama_dcp",
           "sharded": lambda tmp: FIX / "llama_sharded_ws8", "sharded-moments": _sharded_with_moments}


@pytest.mark.parametrize("dtype", [None, "bf16"], ids=["keep", "bf16"])
@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("source", list(SOURCES))
def test_native_output_is_the_torch_writers(tmp_path, source, world_size, dtype):
    """Every file, .metadata included, byte-identical to what the torch writer writes."""
    ck = describe(SOURCES[source](tmp_path))
    targets = targets_from(ck.tensors, dtype=DTYPES[dtype] if dtype else None)
    jobs = layout_dcp(targets, tuple(o for o in ck.objects if o.rank is None), world_size, {})
    native = dcpnative.native_writer(ck, jobs, param_order=ck.param_order)
    assert native is not None, "the plan should be written without torch"
    execute(ck, native, jobs, tmp_path / "native", progress=False, fmt="dcp")
    execute(ck, dcp.Writer(param_order=ck.param_order), jobs, tmp_path / "torch", progress=False, fmt="dcp")
    names = sorted(p.name for p in (tmp_path / "torch").iterdir())
    assert sorted(p.name for p in (tmp_path / "native").iterdir()) == names
    for name in names:
        if name != ".ckpt-manifest.json":
            assert (tmp_path / "native" / name).read_bytes() == (tmp_path / "torch" / name).read_bytes(), name


def test_native_paths_import_no_torch(tmp_path):
    code = ("import sys, ckpt_tools; "
            f"ckpt_tools.convert({str(FIX / 'llama_hf')!r}, {str(tmp_path / 'a')!r}, to='dcp', world_size=3, progress=False); "
            f"ckpt_tools.reshard({str(FIX / 'llama_dcp')!r}, {str(tmp_path / 'b')!r}, to=3, progress=False); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_uncovered_dtype_falls_back_to_torch(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    want = {"model.a": torch.arange(6, dtype=torch.int32).reshape(3, 2).to(torch.uint16), "model.b": torch.ones(4)}
    save_file(want, src / "model.safetensors")
    ck = describe(src)
    jobs = layout_dcp(targets_from(ck.tensors), (), 2, {})
    assert dcpnative.native_writer(ck, jobs, param_order=()) is None
    ckpt_tools.convert(src, tmp_path / "dcp", to="dcp", world_size=2, progress=False)
    import torch.distributed.checkpoint as tdcp

    state = {"model": {k: torch.empty_like(v) for k, v in want.items()}}
    tdcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for k, v in want.items():
        assert torch.equal(state["model"][k], v), k


def _load_rank(rank: int, world_size: int, path: str) -> dict:
    """A 2-rank fully_shard job loads the tiny Llama from a DCP saved for 3 ranks."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as tdcp
    from make_fixtures import tiny_llama_config
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    torch.manual_seed(123)  # other weights than the source's: a load that does nothing shows
    model = LlamaForCausalLM(tiny_llama_config()).to(torch.float32)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = {"model": get_model_state_dict(model)}
    tdcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return full if rank == 0 else {}


def test_hf_to_dcp_loads_in_2_rank_job(tmp_path):
    dst = tmp_path / "dcp3"
    ckpt_tools.convert(FIX / "llama_hf", dst, to="dcp", world_size=3, progress=False)
    assert {p.name for p in dst.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}
    got = run_ranks(_load_rank, 2, tmp_path, str(dst))[0]
    want = load_file(FIX / "llama_hf" / "model.safetensors")
    assert set(got) <= set(want) and got
    for k, v in got.items():
        # the fixture is bf16, the job's model fp32: dcp.load casts (exactly) into it
        assert torch.equal(v, want[k].to(v.dtype)), k


def test_object_order_and_keying_from_sharded_param_groups(tmp_path):
    """An int-keyed verl optimizer's param_groups come out FQN-keyed, as torch's writer does."""
    ck = describe(FIX / "llama_sharded_ws2")
    shared = tuple(o for o in ck.objects if o.rank is None)
    items = dcpnative.Writer(root=ck.base_dir(), param_order=ck.param_order).items(shared)
    keys = [k for k, _, _ in items]
    assert "optimizer.param_groups.0.params" in keys
    params = next(leaf.value for k, _, leaf in items if k == "optimizer.param_groups.0.params")
    assert params == list(ck.param_order)


@pytest.mark.parametrize("fixture,world_size", [("llama_sharded_ws2", 2), ("llama_sharded_ws8", 3)])
def test_sharded_extra_state_merged_without_torch(tmp_path, monkeypatch, capfd, fixture, world_size):
    """verl's per-rank extra state (LR scheduler equal on every rank, RNG not) merged into one
    DCP copy from pickle trees: the same bytes as torch's writer, one warning about the RNG."""
    ckpt_tools.convert(FIX / fixture, tmp_path / "native", to="dcp", world_size=world_size, progress=False)
    warned = capfd.readouterr().err
    assert warned.count("warning:") == 1 and "rng" in warned
    monkeypatch.setattr(dcpnative, "native_writer", lambda *a, **k: None)
    ckpt_tools.convert(FIX / fixture, tmp_path / "torch", to="dcp", world_size=world_size, progress=False)
    names = sorted(p.name for p in (tmp_path / "torch").iterdir())
    assert sorted(p.name for p in (tmp_path / "native").iterdir()) == names
    for name in names:
        if name != ".ckpt-manifest.json":
            assert (tmp_path / "native" / name).read_bytes() == (tmp_path / "torch" / name).read_bytes(), name


def test_sharded_to_dcp_imports_no_torch(tmp_path):
    code = ("import sys, ckpt_tools; "
            f"ckpt_tools.convert({str(FIX / 'llama_sharded_ws2')!r}, {str(tmp_path / 'a')!r}, to='dcp', progress=False); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def _same_trees(a: Path, b: Path) -> None:
    files = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for rel in files:
        if not rel.endswith(".ckpt-manifest.json"):
            assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


@pytest.mark.parametrize("case", ["accelerate-parts", "training-dcp", "torchtitan-names"])
def test_kept_layouts_written_without_torch_as_torch_writes_them(tmp_path, monkeypatch, case):
    """A reshard that keeps a framework's layout (accelerate's part directories, each with its
    own .metadata; a DCP's non-tensor items copied as saved) and torchtitan's top-level names go
    through ckpt's own writer, and give the torch writer's bytes."""
    def run(dst):
        if case == "accelerate-parts":
            ckpt_tools.reshard(FIX / "llama_accelerate", dst, to=3, progress=False)
        elif case == "training-dcp":
            ckpt_tools.reshard(FIX / "llama_dcp", dst, to=3, progress=False)
        else:
            ckpt_tools.convert(FIX / "llama_hf", dst, to="dcp", world_size=2, layout="torchtitan", progress=False)

    used = []
    real = dcpnative.native_writer
    monkeypatch.setattr(dcpnative, "native_writer", lambda *a, **k: used.append(real(*a, **k)) or used[-1])
    run(tmp_path / "native")
    assert used and used[-1] is not None, "the torch writer was used"
    monkeypatch.setattr(dcpnative, "native_writer", lambda *a, **k: None)
    run(tmp_path / "torch")
    _same_trees(tmp_path / "native", tmp_path / "torch")
    if case == "accelerate-parts":
        assert len(list((tmp_path / "native").rglob(".metadata"))) >= 2


@pytest.mark.parametrize("fails", [False, True])
def test_metadata_is_written_a_frame_at_a_time_and_whole_when_the_emitter_gives_up(tmp_path, monkeypatch, fails):
    """``.metadata`` goes to its file a frame at a time (never held whole), and is the pickler's
    bytes all the same; where the emitter gives up after some frames are out (a value it does
    not render), the file holds the pickler's pickle alone, nothing of the frames before."""
    from ckpt_tools.codecs import metaemit

    def files():
        return [(f"__{r}_0.distcp", [("tensor", (("model", f"layers.{i}.w"), "float32", (64, 8), (r * 8, 0), (8, 8)),
                                      1000 * i, 900) for i in range(800)]) for r in range(8)]

    writes, real_dump = [], metaemit.dump

    def dump(meta, write, protocol):
        def counted(data):
            writes.append(len(data))
            return write(data)
        real_dump(meta, counted, protocol)
        if fails:  # (as if a value past the frames written so far could not be rendered)
            raise metaemit.Unsupported("a value the emitter does not render")

    monkeypatch.setattr(metaemit, "dump", dump)
    given = files()
    dcpnative.Writer(root=tmp_path)._metadata(tmp_path, given)
    written = (tmp_path / ".metadata").read_bytes()
    assert len(writes) > 10 and max(writes) < 2 * 65536  # a frame at a time (cut once it holds 64 KiB)
    assert all(records == [] for _, records in given)  # the engine's records let go as they were read
    meta = dcpnative.metadata_of(files())[0]
    assert written == mp.dumps(metaemit.stand_ins(meta))  # the pickler's bytes, nothing before them
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(tmp_path).read_metadata()  # DCP's own reader
    assert len(md.state_dict_metadata) == 800 and len(md.storage_data) == 6400


def test_records_read_as_the_list_of_them_and_cross_to_the_parent_as_data(tmp_path):
    """A file's ``Records`` iterate as the ``(kind, what, start, length)`` list they were made
    from (a tensor's head one tuple however many files hold it), give the same ``.metadata``,
    and go through the workers' hand-over pickle (ckpt's own globals only) unchanged."""
    from ckpt_tools.runtime import private

    def rows(r: int) -> list:
        return [("tensor", (("model", f"layers.{i}.w"), "float32", (64, 8), (r * 8, 0), (8, 8)), 1000 * i + r, 900 + i)
                for i in range(5)] + [("object", ("model", "step"), 9000, 3 + r), ("bytes", ("extra", ("extra",)), 9100, 1 << 40)]

    lists = [(f"__{r}_0.distcp", rows(r)) for r in range(4)]
    compact = []
    for rel, records in lists:
        got = dcp.Records()
        for record in records:
            got.append(record)
        assert list(got) == records and len(got) == len(records)
        compact.append((rel, got))
    heads = {id(got._refs[3 * i]) for _, got in compact for i in range(5)}
    assert len(heads) == 4 * 5  # (append's heads are its own; a writer's are shared: below)
    handed = private.load(io.BytesIO(pickle.dumps(compact)))
    assert [(rel, list(got)) for rel, got in handed] == lists
    a, _ = dcpnative.metadata_of(lists)
    b, _ = dcpnative.metadata_of(handed, consume=True)
    assert mp.dumps(a) == mp.dumps(b) and all(len(got) == 0 for _, got in handed)


def test_the_native_writer_holds_one_head_per_tensor_for_all_its_files(tmp_path):
    """Each file's records name a tensor by one ``(path, dtype, shape)`` tuple, the same object
    in every file (one per tensor, not one per item), and hold no tuple per item."""
    src = tmp_path / "src"
    src.mkdir()
    save_file({f"layers.{i}.w": torch.arange(64.0).reshape(16, 4) + i for i in range(3)}, src / "model.safetensors")
    seen = []
    real = dcpnative.Writer._write_items

    def spy(self, *args):
        order, records = real(self, *args)
        seen.append((type(records), records._refs[:]))  # (as written: the .metadata's making empties them)
        return order, records

    import unittest.mock
    with unittest.mock.patch.object(dcpnative.Writer, "_write_items", spy):
        ckpt_tools.convert(src, tmp_path / "out", to="dcp", world_size=4, progress=False)
    assert len(seen) == 4 and all(kind is dcp.Records for kind, _ in seen)
    heads = {}
    for _, refs in seen:
        assert len(refs) == 3 * 3
        for head in refs[::3]:
            assert heads.setdefault(head[0], head) is head
    assert len(heads) == 3
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(tmp_path / "out").read_metadata()
    assert sum(len(m.chunks) for m in md.state_dict_metadata.values()) == 12
