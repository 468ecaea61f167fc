"""`reshard`: a training job resumed at another world size continues as if it never stopped.

The distributed half runs a real FSDP2 job (tiny Llama, AdamW, LinearLR, a global batch of 24
sequences that 2, 3, 4 and 8 ranks all divide) at world size 4 on spawned gloo CPU ranks. It
saves verl-style per-rank files and a DCP, then trains on; every step's global mean loss is
recorded. Each resume case reshards the saved state with ``ckpt``, resumes in a fresh job at
the new world size with the consumer's own loaders, trains the same steps on the same data and
must reproduce those losses. A resume with a fresh optimizer must not, which shows the
comparison catches dropped optimizer state.

The other half checks the on-disk result against the fixtures without spawning ranks.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import ckpt_tools
from ckpt_tools.cli.main import main as cli
from ckpt_tools.core.describe import chunk_rows
from ckpt_tools.formats import describe
from ckpt_tools.engine.reader import Reader

try:
    from dist import run_ranks
except ImportError:  # tests/ imported as a package
    from tests.dist import run_ranks

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"

# The job: 24 sequences divide evenly over 2, 3, 4 and 8 ranks, so every rank's mean loss has
# the same weight and FSDP's gradient average equals the global mean's gradient.
GLOBAL_BATCH, SEQ_LEN, VOCAB = 24, 16, 101
SAVE_WORLD = 4
SAVE_AFTER = 3      # steps before the save
RESUME_STEPS = 3    # steps after it, compared one by one
LR = 1e-2           # large enough that a fresh optimizer's first update shows in the next loss
REL_TOL = 1e-5
N_PARAMS = 21       # tiny Llama, untied


# ---------------------------------------------------------------- helpers shared with the ranks

def _fixtures_module():
    spec = importlib.util.spec_from_file_location("_ckpt_make_fixtures", FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _quiet() -> None:
    import logging

    warnings.filterwarnings("ignore")
    for name in ("torch.distributed", "torch.distributed.device_mesh", "torch.distributed.checkpoint",
                 "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _batch(step: int) -> torch.Tensor:
    """The global batch of ``step``, the same tokens whatever the world size: two batches in
    turn, so the model can learn them and the loss falls."""
    gen = torch.Generator().manual_seed(1000 + step % 2)
    return torch.randint(4, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=gen)


def _build(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = LlamaForCausalLM(_fixtures_module().tiny_llama_config()).to(torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    # the LR changes every step, so a lost or misapplied scheduler state shows in the losses
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=10)
    return model, optimizer, scheduler


def _train_step(model, optimizer, scheduler, step: int, rank: int, world_size: int) -> float:
    """One optimizer step on this rank's contiguous slice; returns the global mean loss."""
    import torch.distributed as dist

    per_rank = GLOBAL_BATCH // world_size
    local = _batch(step)[rank * per_rank:(rank + 1) * per_rank]
    loss = model(input_ids=local, labels=local).loss  # mean over this rank's tokens
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    tokens = per_rank * (SEQ_LEN - 1)  # labels shift by one; no padding
    total = loss.detach().double() * tokens
    dist.all_reduce(total)
    return (total / (GLOBAL_BATCH * (SEQ_LEN - 1))).item()


def _rank_file(root: str | Path, kind: str, world_size: int, rank: int) -> Path:
    return Path(root) / f"{kind}_world_size_{world_size}_rank_{rank}.pt"


def _original_job(rank: int, world_size: int, out: str) -> dict:
    """Train, save verl-style and as a DCP, train on. Returns every step's loss."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _quiet()
    model, optimizer, scheduler = _build(world_size)
    before = [_train_step(model, optimizer, scheduler, s, rank, world_size) for s in range(SAVE_AFTER)]

    sharded = Path(out) / "sharded"
    sharded.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), _rank_file(sharded, "model", world_size, rank))
    torch.save(optimizer.state_dict(), _rank_file(sharded, "optim", world_size, rank))
    torch.save({"lr_scheduler": scheduler.state_dict()}, _rank_file(sharded, "extra_state", world_size, rank))
    if rank == 0:
        (sharded / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world_size}))
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optimizer": osd, "lr_scheduler": scheduler.state_dict()},
             checkpoint_id=str(Path(out) / "dcp"))
    dist.barrier()

    after = [_train_step(model, optimizer, scheduler, s, rank, world_size)
             for s in range(SAVE_AFTER, SAVE_AFTER + RESUME_STEPS)]
    return {"before": before, "after": after, "lr": scheduler.get_last_lr()}


def _resume_job(rank: int, world_size: int, kind: str, path: str, fresh_optimizer: bool) -> list[float]:
    """A new job at ``world_size``: load the checkpoint the way its consumer does, train on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

    _quiet()
    model, optimizer, scheduler = _build(world_size)
    if kind == "sharded":
        model.load_state_dict(torch.load(_rank_file(path, "model", world_size, rank), weights_only=True))
        if not fresh_optimizer:
            optimizer.load_state_dict(torch.load(_rank_file(path, "optim", world_size, rank), weights_only=True))
        extra = torch.load(_rank_file(path, "extra_state", world_size, rank), weights_only=True)
        scheduler.load_state_dict(extra["lr_scheduler"])
    else:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optimizer": osd, "lr_scheduler": scheduler.state_dict()}
        dcp.load(state, checkpoint_id=path)
        if fresh_optimizer:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        scheduler.load_state_dict(state["lr_scheduler"])
    return [_train_step(model, optimizer, scheduler, s, rank, world_size)
            for s in range(SAVE_AFTER, SAVE_AFTER + RESUME_STEPS)]


# ---------------------------------------------------------------- test-side helpers

def _ckpt(*args: str):
    return CliRunner().invoke(cli, [*map(str, args)], catch_exceptions=False)


def _error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error: ")]


def _assert_same_losses(resumed: list[float], reference: list[float]) -> None:
    assert len(resumed) == len(reference)
    for step, (a, b) in enumerate(zip(resumed, reference), start=SAVE_AFTER):
        assert math.isfinite(a), f"step {step}: loss {a}"
        assert abs(a - b) <= REL_TOL * abs(b), (
            f"step {step}: resumed loss {a!r} vs uninterrupted {b!r} (rel {abs(a - b) / abs(b):.2e})")


def _full_tensors(path: Path) -> dict[tuple[str, str], torch.Tensor]:
    ckpt = describe(path)
    # tensor by tensor across every rank file: keep all files open (the default LRU is smaller)
    with Reader(ckpt, cache_files=len(ckpt.files)) as reader:
        return {t.key: reader.full(t) for t in ckpt.tensors}


def _assert_tensors_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        g = got[key]
        assert g.dtype == w.dtype and g.shape == w.shape, key
        assert torch.equal(g, w), f"{key}: values differ"


def _same(a, b) -> bool:
    """Deep equality of saved values (tensors and numpy arrays compared exactly)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _load_extra(path: Path):
    """An extra_state file; numpy's RNG state needs these globals admitted."""
    allowed = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, weights_only=True)


def _load(path: Path):
    import torch.distributed.tensor  # noqa: F401  (DTensor files)

    return torch.load(path, weights_only=True)


# ---------------------------------------------------------------- the resumption proof

@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """The uninterrupted job at world size 4, run once for the module."""
    root = tmp_path_factory.mktemp("original")
    results = run_ranks(_original_job, SAVE_WORLD, root, str(root), timeout=300)
    assert all(r == results[0] for r in results), "ranks disagree on the global loss"
    return {"sharded": root / "sharded", "dcp": root / "dcp", **results[0]}


def test_original_job_trains(original):
    """The reference itself: finite losses that move, a schedule that moves the LR."""
    losses = original["before"] + original["after"]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    steps = SAVE_AFTER + RESUME_STEPS  # LinearLR from 0.25 to 1 over 10 steps
    assert original["lr"] == [pytest.approx(LR * (0.25 + 0.75 * steps / 10))]
    assert describe(original["sharded"]).world_size == SAVE_WORLD
    assert describe(original["dcp"]).format == "dcp"


def _prepare(kind: str, world_size: int, original: dict, tmp_path: Path) -> tuple[str, Path]:
    """Reshard (or convert) the saved state with the CLI; returns the loader kind and DST."""
    dst = tmp_path / "resharded"
    if kind == "sharded":
        args = ["reshard", original["sharded"], dst, "--to", world_size, "--from", SAVE_WORLD, "--quiet"]
        loader = "sharded"
    elif kind == "dcp":
        args = ["reshard", original["dcp"], dst, "--to", world_size, "--from", SAVE_WORLD, "--quiet"]
        loader = "dcp"
    else:  # dcp -> sharded: the FQN-keyed DCP optimizer must come out int-keyed
        args = ["convert", original["dcp"], dst, "--to", "sharded", "--world-size", world_size, "--quiet"]
        loader = "sharded"
    result = _ckpt(*args)
    assert result.exit_code == 0, result.output
    assert describe(dst).world_size == world_size
    return loader, dst


RESUME_CASES = [
    pytest.param("sharded", 2, id="sharded-4to2"),
    pytest.param("sharded", 3, id="sharded-4to3"),
    pytest.param("sharded", 8, id="sharded-4to8"),
    pytest.param("dcp", 2, id="dcp-reshard-4to2"),
    pytest.param("dcp-to-sharded", 3, id="dcp-convert-sharded-4to3"),
]


@pytest.mark.parametrize("kind,world_size", RESUME_CASES)
def test_resume_continues_training(original, tmp_path, kind, world_size):
    loader, dst = _prepare(kind, world_size, original, tmp_path)
    results = run_ranks(_resume_job, world_size, tmp_path, loader, str(dst), False, timeout=300)
    assert all(r == results[0] for r in results)
    _assert_same_losses(results[0], original["after"])


def test_fresh_optimizer_fails_the_comparison(original, tmp_path):
    """Dropped optimizer state (same weights and scheduler) must be caught by the comparison."""
    loader, dst = _prepare("sharded", 2, original, tmp_path)
    resumed = run_ranks(_resume_job, 2, tmp_path, loader, str(dst), True, timeout=300)[0]
    reference = original["after"]
    # the first loss is taken before any update: same weights, same loss
    assert abs(resumed[0] - reference[0]) <= REL_TOL * abs(reference[0])
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed[1:], reference[1:])) > 1e-4
    with pytest.raises(AssertionError):
        _assert_same_losses(resumed, reference)


# ---------------------------------------------------------------- on-disk checks (no ranks)

CHAIN = (3, 8, 2)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """llama_sharded_ws8 resharded to 3, that to 8, that to 2."""
    root = tmp_path_factory.mktemp("chain")
    paths, src = {}, FIXTURES / "llama_sharded_ws8"
    for i, m in enumerate(CHAIN):
        dst = root / f"hop{i}_ws{m}"
        ckpt_tools.reshard(src, dst, to=m, progress=False)
        paths[i], src = dst, dst
    return paths


@pytest.mark.parametrize("hop", range(len(CHAIN)), ids=["8to3", "8to3to8", "8to3to8to2"])
def test_reshard_chain_is_exact(chain, hop):
    source = FIXTURES / "llama_sharded_ws8"
    dst, m = chain[hop], CHAIN[hop]
    assert describe(dst).world_size == m
    assert json.loads((dst / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": m}
    for kind in ("model", "optim", "extra_state"):
        assert sorted(p.name for p in dst.glob(f"{kind}_world_size_*")) == sorted(
            _rank_file(dst, kind, m, r).name for r in range(m))
    _assert_tensors_equal(_full_tensors(dst), _full_tensors(source))
    # the model files are what fully_shard's state_dict() returns at M ranks: Shard(0), torch.chunk rows
    from torch.distributed.tensor import DTensor, Shard

    src_model = _load(_rank_file(source, "model", 8, 0))
    for r in range(m):
        sd = _load(_rank_file(dst, "model", m, r))
        assert list(sd) == list(src_model)
        for name, v in sd.items():
            assert isinstance(v, DTensor) and v.placements == (Shard(0),) and v.device_mesh.size() == m
            start, stop = chunk_rows(v.shape[0], m, r)
            assert v.to_local().shape[0] == stop - start, name
    assert (dst / "huggingface" / "config.json").read_bytes() == (
        source / "huggingface" / "config.json").read_bytes()


def test_more_ranks_than_rows_gives_empty_shards(tmp_path):
    """At 24 ranks the 16-row k_proj leaves ranks 16..23 with no rows, as fully_shard would."""
    from torch.distributed.tensor import DTensor

    source, dst, m = FIXTURES / "llama_sharded_ws2", tmp_path / "out", 24
    ckpt_tools.reshard(source, dst, to=m, progress=False)
    _assert_tensors_equal(_full_tensors(dst), _full_tensors(source))
    last = _load(_rank_file(dst, "model", m, m - 1))
    assert isinstance(last["model.embed_tokens.weight"], DTensor)
    assert last["model.embed_tokens.weight"].shape == (VOCAB, 32)
    assert last["model.embed_tokens.weight"].to_local().shape == (0, 32)
    assert last["model.layers.0.self_attn.k_proj.weight"].to_local().shape == (0, 32)
    optim = _load(_rank_file(dst, "optim", m, m - 1))
    assert optim["state"][0]["exp_avg"].to_local().shape == (0, 32)


def test_reshard_tied_is_exact(tmp_path):
    """Tied embeddings: both names stay in the model files, the optimizer keeps 20 params."""
    source, dst = FIXTURES / "llama_tied_sharded_ws2", tmp_path / "out"
    ckpt_tools.reshard(source, dst, to=3, progress=False)
    _assert_tensors_equal(_full_tensors(dst), _full_tensors(source))
    for r in range(3):
        model = _load(_rank_file(dst, "model", 3, r))
        assert torch.equal(model["lm_head.weight"].to_local(), model["model.embed_tokens.weight"].to_local())
        osd = _load(_rank_file(dst, "optim", 3, r))
        assert list(osd["state"]) == list(range(N_PARAMS - 1))
        assert osd["param_groups"][0]["params"] == list(range(N_PARAMS - 1))


def test_reshard_reads_each_source_file_a_few_times(tmp_path, monkeypatch):
    """Rank files are parsed a few times at most (never once per tensor), as pickle trees:
    torch.load is not called at all."""
    import collections

    import ckpt_tools.security.safeload as safeload
    from ckpt_tools.formats import shardtree
    from ckpt_tools.security.torchfile import TorchZip

    parses: collections.Counter = collections.Counter()
    loads: collections.Counter = collections.Counter()
    real_init, real_load = TorchZip.__init__, safeload.load_torch

    def counting_init(self, path, **kw):
        parses[Path(path).name] += 1
        real_init(self, path, **kw)

    def counting_load(path, *args, **kwargs):
        loads[Path(path).name] += 1
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(TorchZip, "__init__", counting_init)
    monkeypatch.setattr(safeload, "load_torch", counting_load)
    shardtree._parsed.cache_clear()  # earlier tests parsed these files in this process
    ckpt_tools.reshard(FIXTURES / "llama_sharded_ws8", tmp_path / "out", to=2, progress=False)
    assert len(parses) == 24 and max(parses.values()) == 1, parses.most_common(3)
    assert not loads


def test_reshard_of_fsdp2_files_does_not_import_torch(tmp_path):
    """import torch costs more than copying a gigabyte: resharding verl's FSDP2 files works on
    pickle trees and byte ranges alone."""
    code = ("import sys, ckpt_tools; "
            f"ckpt_tools.reshard({str(FIXTURES / 'llama_sharded_ws8')!r}, {str(tmp_path / 'out')!r}, to=3, progress=False); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    assert len(list((tmp_path / "out").glob("model_world_size_3_rank_*.pt"))) == 3


def _same_loaded(x, y, where: str) -> None:
    """Two values torch.load gave are the same: DTensors to their mesh, coordinate, spec
    (and its hash) and local bits."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        assert isinstance(y, DTensor), where
        assert (x.placements, x.shape, x.stride()) == (y.placements, y.shape, y.stride()), where
        assert torch.equal(x.device_mesh.mesh, y.device_mesh.mesh), where
        assert x.device_mesh.get_coordinate() == y.device_mesh.get_coordinate(), where
        assert x._spec == y._spec and hash(x._spec) == hash(y._spec), where
        x, y = x._local_tensor, y._local_tensor
    if isinstance(x, torch.Tensor):
        assert type(x) is type(y) and x.dtype == y.dtype and x.shape == y.shape, where
        assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)), where
    elif isinstance(x, dict):
        assert list(x) == list(y), where
        for k in x:
            _same_loaded(x[k], y[k], f"{where}/{k}")
    elif isinstance(x, (list, tuple)):
        assert type(x) is type(y) and len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            _same_loaded(u, v, f"{where}/{i}")
    else:
        assert x == y, where


@pytest.mark.parametrize("fixture,to", [("llama_sharded_ws8", 3), ("llama_sharded_ws2", 4),
                                        ("llama_tied_sharded_ws2", 5), ("llama_sharded_ws8", 1)],
                         ids=["8to3", "2to4", "tied-2to5", "8to1-torch-lays-out-one-device-meshes"])
def test_files_rebuilt_from_pickle_trees_load_as_torch_writes_them(tmp_path, monkeypatch, fixture, to):
    """The torch-free writer (each file its source's pickle tree, rebuilt for the new ranks,
    records copied by the kernel) gives files that torch.load reads exactly as it reads the
    files written through torch.save: same keys, DTensor meshes, coordinates, specs, bits."""
    from ckpt_tools.formats import shardtree
    from ckpt_tools.security.safeload import load_torch

    trees, saved = tmp_path / "trees", tmp_path / "saved"
    ckpt_tools.reshard(FIXTURES / fixture, trees, to=to, progress=False)
    assert ckpt_tools.inspect(FIXTURES / fixture)  # sanity: the fixture reads

    def not_simple(node):
        raise shardtree.NotSimple("forced: take the torch path")

    monkeypatch.setattr(shardtree, "dtensor_of", not_simple)
    ckpt_tools.reshard(FIXTURES / fixture, saved, to=to, progress=False)
    monkeypatch.undo()
    names = sorted(p.name for p in trees.glob("*.pt"))
    assert names == sorted(p.name for p in saved.glob("*.pt")) and len(names) == 3 * to
    for name in names:
        for mmap in (True, False):
            _same_loaded(load_torch(trees / name, mmap=mmap), load_torch(saved / name, mmap=mmap), name)


@pytest.mark.parametrize("fixture,world_size", [("llama_sharded_ws2", 2), ("llama_dcp", 2)],
                         ids=["sharded", "dcp"])
def test_from_mismatch_is_bad_input(tmp_path, fixture, world_size):
    dst = tmp_path / "out"
    result = _ckpt("reshard", FIXTURES / fixture, dst, "--to", 3, "--from", world_size + 2, "--quiet")
    assert result.exit_code == 3
    (line,) = _error_lines(result)
    assert str(world_size + 2) in line and str(world_size) in line
    assert "Traceback" not in result.output
    assert not dst.exists()


def test_from_match_is_accepted(tmp_path):
    result = _ckpt("reshard", FIXTURES / "llama_sharded_ws2", tmp_path / "out", "--to", 3, "--from", 2, "--quiet")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("kind", ["model", "optim", "extra_state"])
def test_missing_rank_file_is_bad_input(tmp_path, kind):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "llama_sharded_ws2", src)
    _rank_file(src, kind, 2, 1).unlink()
    dst = tmp_path / "out"
    result = _ckpt("reshard", src, dst, "--to", 3, "--quiet")
    assert result.exit_code == 3, result.output
    (line,) = _error_lines(result)
    assert "rank" in line and kind in line
    assert not dst.exists()


def test_existing_destination_needs_overwrite(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.pt").write_text("old")  # named as a checkpoint's file: --overwrite may replace it
    result = _ckpt("reshard", FIXTURES / "llama_sharded_ws2", dst, "--to", 3, "--quiet")
    assert result.exit_code == 4
    (line,) = _error_lines(result)
    assert "--overwrite" in line
    assert [p.name for p in dst.iterdir()] == ["old.pt"]

    result = _ckpt("reshard", FIXTURES / "llama_sharded_ws2", dst, "--to", 3, "--overwrite", "--quiet")
    assert result.exit_code == 0, result.output
    assert not (dst / "old.pt").exists()
    assert describe(dst).world_size == 3


def _source_extras(fixture: str, n: int) -> list[dict]:
    return [_load_extra(_rank_file(FIXTURES / fixture, "extra_state", n, r)) for r in range(n)]


def test_rank_local_state_is_dropped_by_default(tmp_path):
    dst = tmp_path / "out"
    result = _ckpt("reshard", FIXTURES / "llama_sharded_ws2", dst, "--to", 3)
    assert result.exit_code == 0, result.output
    warning = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warning) == 1 and "rng" in warning[0] and "--rank-local" in warning[0], result.stderr
    source = _source_extras("llama_sharded_ws2", 2)
    assert not _same(source[0]["rng"], source[1]["rng"])  # the premise: rank-local
    for r in range(3):
        extra = _load_extra(_rank_file(dst, "extra_state", 3, r))
        assert list(extra) == ["lr_scheduler"]
        assert _same(extra["lr_scheduler"], source[0]["lr_scheduler"])


def test_rank_local_warning_survives_quiet(tmp_path):
    result = _ckpt("reshard", FIXTURES / "llama_sharded_ws2", tmp_path / "out", "--to", 3, "--quiet")
    assert result.exit_code == 0, result.output
    assert any(line.startswith("warning: ") and "rng" in line for line in result.stderr.splitlines())


@pytest.mark.parametrize("fixture,n,m", [("llama_sharded_ws2", 2, 3), ("llama_sharded_ws8", 8, 3)],
                         ids=["2to3", "8to3"])
def test_rank_local_keep_first(tmp_path, fixture, n, m):
    dst = tmp_path / "out"
    result = _ckpt("reshard", FIXTURES / fixture, dst, "--to", m, "--rank-local", "keep-first", "--quiet")
    assert result.exit_code == 0, result.output
    source = _source_extras(fixture, n)
    for r in range(m):
        extra = _load_extra(_rank_file(dst, "extra_state", m, r))
        assert _same(extra["lr_scheduler"], source[0]["lr_scheduler"])  # shared state: every rank
        if r < min(n, m):
            assert _same(extra["rng"], source[r]["rng"]), f"rank {r}: rng not source rank {r}'s"
        else:
            assert "rng" not in extra


def test_same_world_size_keeps_rank_local_state(tmp_path):
    dst = tmp_path / "out"
    assert _ckpt("reshard", FIXTURES / "llama_sharded_ws2", dst, "--to", 2, "--quiet").exit_code == 0
    source = _source_extras("llama_sharded_ws2", 2)
    for r in range(2):
        assert _same(_load_extra(_rank_file(dst, "extra_state", 2, r)), source[r])


@pytest.mark.parametrize("fixture", ["llama_sharded_ws2", "llama_dcp"], ids=["from-sharded", "from-dcp"])
def test_optimizer_files_are_int_keyed(tmp_path, fixture):
    """What ``optimizer.load_state_dict`` takes: int ids in parameter order, ``params`` ints."""
    from torch.distributed.tensor import DTensor

    dst, m = tmp_path / "out", 3
    if fixture == "llama_dcp":  # a DCP's optimizer is FQN-keyed; its param_groups give the order
        ckpt_tools.convert(FIXTURES / fixture, dst, to="sharded", world_size=m, progress=False)
    else:
        ckpt_tools.reshard(FIXTURES / fixture, dst, to=m, progress=False)
    ref = _load(_rank_file(FIXTURES / "llama_sharded_ws2", "optim", 2, 0))
    for r in range(m):
        osd = _load(_rank_file(dst, "optim", m, r))
        model = _load(_rank_file(dst, "model", m, r))
        assert list(osd["state"]) == list(range(N_PARAMS))
        assert all(type(k) is int for k in osd["state"])
        (group,) = osd["param_groups"]
        assert group["params"] == list(range(N_PARAMS)) and all(type(p) is int for p in group["params"])
        assert {k: v for k, v in group.items() if k != "params"} == {
            k: v for k, v in ref["param_groups"][0].items() if k != "params"}
        for i, (fqn, param) in enumerate(model.items()):
            state = osd["state"][i]
            assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
            assert not isinstance(state["step"], DTensor) and state["step"].shape == () and float(state["step"]) == 3.0
            for key in ("exp_avg", "exp_avg_sq"):
                assert isinstance(state[key], DTensor), (fqn, key)
                assert state[key].shape == param.shape and state[key].placements == param.placements
                assert state[key].to_local().shape == param.to_local().shape, (fqn, key)


def _dcp_contents(path: Path) -> dict:
    """Everything in a DCP, read by ``dcp.load`` itself into a flat state dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    state = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            # a sentinel that no loaded value equals, so an unread tensor shows
            fill = float("nan") if md.properties.dtype.is_floating_point else -1
            state[key] = torch.full(tuple(md.size), fill, dtype=md.properties.dtype)
        else:
            state[key] = "<unread>"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    assert "<unread>" not in [v for v in state.values() if isinstance(v, str)], path
    return state


def test_dcp_reshard_loads_equal(tmp_path):
    dst = tmp_path / "out"
    result = _ckpt("reshard", FIXTURES / "llama_dcp", dst, "--to", 3, "--quiet")
    assert result.exit_code == 0, result.output
    assert (dst / ".metadata").is_file()
    assert sorted(p.name for p in dst.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    # laid out as 3 ranks' dcp.save would: rank r's torch.chunk rows of every tensor with rows
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(dst)).read_metadata()
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata) and len(md.size) > 0:
            rows = [chunk_rows(md.size[0], 3, r) for r in range(3)]
            want_offsets = sorted((start, *[0] * (len(md.size) - 1)) for start, stop in rows if stop > start)
            assert sorted(tuple(c.offsets) for c in md.chunks) == want_offsets, key
    want, got = _dcp_contents(FIXTURES / "llama_dcp"), _dcp_contents(dst)
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        assert _same(got[key], w), key
    assert any(k.startswith("lr_scheduler.") for k in got) and "optimizer.param_groups.0.params" in got
