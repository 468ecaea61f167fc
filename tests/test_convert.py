"""`convert` and `export`, checked by the real consumers of what they write.

* Round trips ``hf → dcp → sharded(3) → torch → hf`` keep every tensor bit for bit, whatever its
  dtype (fp32, bf16, fp16, int64, bool, fp8), including rows that do not divide by the world size
  and 0-dim tensors. Each hop is read back with the format's own reader (safetensors, torch's
  ``dcp.load``, ``torch.load``), not with ckpt's.
* A DCP the tool wrote loads with ``torch.distributed.checkpoint.load`` (no process group) and into
  a 2-rank ``fully_shard`` job with ``set_state_dict``.
* ``sharded`` output at N ranks loads into an N-rank ``fully_shard`` job with
  ``model.load_state_dict`` / ``optimizer.load_state_dict`` and keeps training.
* ``export`` output loads with ``from_pretrained`` (no missing or unexpected keys, same logits),
  tied and untied, with its config, tokenizer, generation config and index right.
* ``--dtype``, ``--model-only``, ``--overwrite`` and the plain ``torch`` output.

Multi-rank cases spawn gloo CPU ranks with tests/dist.py: three jobs in all (one 2-rank DCP
resume, one 2-rank and one 3-rank ``sharded`` resume that each load two sources).
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ckpt_tools
from ckpt_tools.cli.main import main as cli
from ckpt_tools.formats import describe
from ckpt_tools.engine.reader import Reader

try:
    from dist import run_ranks
except ImportError:  # tests/ imported as a package
    from tests.dist import run_ranks

# dcp.load(no_dist=True) says it assumes a single process: that is the point
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "fixtures"
REF_WEIGHTS = FIX / "llama_torch" / "pytorch_model.bin"
REF_TRAINING = FIX / "llama_torch_training.pt"
SEED_OTHER = 123  # resume jobs start from different weights, so a load that does nothing shows


def _fixtures_module():
    spec = importlib.util.spec_from_file_location("_ckpt_make_fixtures", FIX / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cli(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_exact(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert torch.equal(_bits(got), _bits(want)), f"{what}: bytes differ"


def _plain_load(path: Path):
    """``torch.load`` the way a consumer does: weights only, no extra safe globals."""
    import torch.distributed.tensor  # noqa: F401  (DTensor loads need it imported)

    return torch.load(path, weights_only=True)


def _full_from_sharded(path: Path, kind: str = "model") -> dict[str, torch.Tensor]:
    """The full model state of a verl checkpoint, from its rank files (local shards concatenated)."""
    ws = json.loads((path / "fsdp_config.json").read_text())["world_size"]
    parts = [_plain_load(path / f"{kind}_world_size_{ws}_rank_{r}.pt") for r in range(ws)]
    return {k: torch.cat([p[k].to_local() for p in parts]) for k in parts[0]}


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return torch.load(REF_WEIGHTS, weights_only=True)


@pytest.fixture(scope="module")
def training() -> dict:
    return torch.load(REF_TRAINING, weights_only=True)


# ---------------------------------------------------------------------------------------------
# 1. Round trips hf → dcp → sharded(3) → torch → hf, bit for bit
# ---------------------------------------------------------------------------------------------

def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every bit pattern allowed, NaN payloads and -0.0 included: a value-based copy shows."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _round_trip_source() -> dict[str, torch.Tensor]:
    """Names with dots (DCP flattens on them); 7 rows at 3 ranks split 3+3+1, 2 rows 1+1+0,
    1 row 1+0+0."""
    g = torch.Generator().manual_seed(0)
    int64 = torch.randint(-(2**62), 2**62, (7, 3), dtype=torch.int64, generator=g)
    int64[0, :2] = torch.tensor([torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max])
    return {
        "layers.0.fp32.7x5": _random_bits((7, 5), torch.float32, 1),
        "layers.0.fp32.2x3": _random_bits((2, 3), torch.float32, 2),
        "layers.0.fp32.1x4": _random_bits((1, 4), torch.float32, 3),
        "layers.0.fp32.scalar": torch.tensor(-0.0),
        "layers.1.bf16.7x4": _random_bits((7, 4), torch.bfloat16, 4),
        "layers.1.bf16.2x4": _random_bits((2, 4), torch.bfloat16, 5),
        "layers.1.bf16.scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "layers.1.fp16.7": _random_bits((7,), torch.float16, 6),
        "layers.1.fp16.2x2": _random_bits((2, 2), torch.float16, 7),
        "buffers.int64.7x3": int64,
        "buffers.int64.2": torch.tensor([-1, 2**40]),
        "buffers.int64.scalar": torch.tensor(-(2**53) - 1),
        "buffers.bool.7": torch.tensor([True, False, True, True, False, False, True]),
        "buffers.bool.2x3": torch.rand(2, 3, generator=g) > 0.5,
        "buffers.bool.scalar": torch.tensor(True),
        "fp8.e4m3fn.256": torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn),  # all patterns
        "fp8.e4m3fn.2x4": _random_bits((2, 4), torch.float8_e4m3fn, 8),
        "fp8.e4m3fn.7x2": _random_bits((7, 2), torch.float8_e4m3fn, 9),
        "fp8.e4m3fn.scalar": torch.tensor(0.5).to(torch.float8_e4m3fn),
    }


ROUND_TRIP = _round_trip_source()
ROUND_TRIP_WS = 3
# (hop name, --to, --world-size, destination name)
HOPS = [
    ("hf->dcp", "dcp", None, "dcp"),
    ("dcp->sharded3", "sharded", ROUND_TRIP_WS, "sharded3"),
    ("sharded3->torch", "torch", None, "model.pt"),
    ("torch->hf", "hf", None, "hf"),
]
HOP_NAMES = [h[0] for h in HOPS]


class _Chain:
    """Runs the hops in order, once per module; a failed hop fails itself and every hop after it."""

    def __init__(self, root: Path):
        self.src = root / "source.safetensors"
        save_file(ROUND_TRIP, str(self.src))
        self.outputs: dict[str, Path | BaseException] = {}
        self._read: dict[str, dict[str, torch.Tensor]] = {}
        prev: Path | None = self.src
        for name, to, ws, dst in HOPS:
            if prev is None:
                self.outputs[name] = RuntimeError("an earlier hop failed")
                continue
            try:
                ckpt_tools.convert(prev, root / dst, to=to, world_size=ws, progress=False)
                self.outputs[name] = prev = root / dst
            except Exception as e:  # noqa: BLE001 - reported by the hop's own tests
                self.outputs[name] = e
                prev = None

    def path(self, hop: str) -> Path:
        out = self.outputs[hop]
        if isinstance(out, BaseException):
            raise AssertionError(f"hop {hop} failed: {type(out).__name__}: {out}") from out
        return out

    def tensors(self, hop: str) -> dict[str, torch.Tensor]:
        """What the hop wrote, read with the format's own reader."""
        if hop not in self._read:
            path = self.path(hop)
            to = next(h[1] for h in HOPS if h[0] == hop)
            self._read[hop] = _READ_BACK[to](path)
        return self._read[hop]


def _read_dcp(path: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    model = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in ROUND_TRIP.items()}
    dcp.load({"model": model}, checkpoint_id=str(path), no_dist=True)
    return model


def _read_sharded(path: Path) -> dict[str, torch.Tensor]:
    """Each rank file as a job would load it; DTensors must have fully_shard's layout."""
    from torch.distributed.tensor import DTensor, Shard

    assert json.loads((path / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": ROUND_TRIP_WS}
    ranks = [_plain_load(path / f"model_world_size_{ROUND_TRIP_WS}_rank_{r}.pt") for r in range(ROUND_TRIP_WS)]
    out = {}
    for name, want in ROUND_TRIP.items():
        values = [sd[name] for sd in ranks]
        if want.dim() == 0:
            assert all(not isinstance(v, DTensor) and v.dim() == 0 for v in values), name
            for v in values[1:]:
                assert_bit_exact(v, values[0], f"{name} (copies on the ranks)")
            out[name] = values[0]
            continue
        expected_rows = [len(c) for c in torch.chunk(torch.empty(want.shape[0]), ROUND_TRIP_WS)]
        expected_rows += [0] * (ROUND_TRIP_WS - len(expected_rows))
        for r, v in enumerate(values):
            assert isinstance(v, DTensor), f"{name} rank {r}: {type(v).__name__}, expected a DTensor"
            assert tuple(v.placements) == (Shard(0),), f"{name} rank {r}: {v.placements}"
            assert tuple(v.shape) == tuple(want.shape), f"{name} rank {r}: global shape {tuple(v.shape)}"
            assert v.device_mesh.size() == ROUND_TRIP_WS, name
            assert v.to_local().shape[0] == expected_rows[r], (
                f"{name} rank {r}: {v.to_local().shape[0]} rows, fully_shard gives {expected_rows[r]}")
        out[name] = torch.cat([v.to_local() for v in values])
    return out


def _read_torch(path: Path) -> dict[str, torch.Tensor]:
    sd = _plain_load(path)
    if set(sd) <= {"model", "optimizer", "lr_scheduler", "step", "extra"} and isinstance(sd.get("model"), dict):
        sd = sd["model"]
    return sd


def _read_hf(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


_READ_BACK = {"dcp": _read_dcp, "sharded": _read_sharded, "torch": _read_torch, "hf": _read_hf}


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> _Chain:
    return _Chain(tmp_path_factory.mktemp("round_trip"))


@pytest.mark.parametrize("name", list(ROUND_TRIP))
@pytest.mark.parametrize("hop", HOP_NAMES)
def test_round_trip_bit_exact(chain, hop, name):
    got = chain.tensors(hop)
    assert name in got, f"{hop}: {name} missing (has {sorted(got)})"
    assert_bit_exact(got[name], ROUND_TRIP[name], f"{hop}: {name}")


@pytest.mark.parametrize("hop", HOP_NAMES)
def test_round_trip_writes_nothing_else(chain, hop):
    assert set(chain.tensors(hop)) == set(ROUND_TRIP)


@pytest.mark.parametrize("hop", HOP_NAMES)
def test_round_trip_describe_matches(chain, hop):
    """ckpt's own view of each hop (inspect's source) agrees with the bytes."""
    ckpt = describe(chain.path(hop))
    assert ckpt.format == next(h[1] for h in HOPS if h[0] == hop)
    got = {t.name: t for t in ckpt.tensors}
    assert {t.group for t in ckpt.tensors} == {"model"}
    assert set(got) == set(ROUND_TRIP)
    with Reader(ckpt) as reader:
        for name, want in ROUND_TRIP.items():
            assert got[name].dtype == want.dtype, name
            assert got[name].shape == tuple(want.shape), name
            assert_bit_exact(reader.full(got[name]), want, f"{hop}: {name} via ckpt's reader")


def test_round_trip_source_is_valid_safetensors(chain):
    """The chain starts from what safetensors itself wrote and reads."""
    with safe_open(str(chain.src), "pt") as f:
        assert set(f.keys()) == set(ROUND_TRIP)
    for name, t in load_file(str(chain.src)).items():
        assert_bit_exact(t, ROUND_TRIP[name], f"source: {name}")


# ---------------------------------------------------------------------------------------------
# 2. DCP output: torch's reader, and a 2-rank fully_shard job
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dcp_from_sharded(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("dcp") / "from_ws2"
    ckpt_tools.convert(FIX / "llama_sharded_ws2", dst, to="dcp", progress=False)
    return dst


def _placeholders(value):
    """A state-dict template for dcp.load: empty tensors, None for the non-tensor leaves."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    if isinstance(value, dict):
        return {k: _placeholders(v) for k, v in value.items()}
    if isinstance(value, list) and any(isinstance(v, (dict, torch.Tensor)) for v in value):
        return [_placeholders(v) for v in value]
    return None


def test_dcp_output_loads_with_torch_reader(dcp_from_sharded, ref, training):
    import torch.distributed.checkpoint as dcp

    # keys as get_state_dict names them: "model" -> fqn, "optimizer" -> state/param_groups by fqn
    state = {
        "model": _placeholders(ref),
        "optimizer": _placeholders(training["optimizer"]),
        "lr_scheduler": _placeholders(training["lr_scheduler"]),
    }
    dcp.load(state, checkpoint_id=str(dcp_from_sharded), no_dist=True)

    assert set(state["model"]) == set(ref)
    for k, v in ref.items():
        assert_bit_exact(state["model"][k], v, f"model.{k}")
    want_osd = training["optimizer"]
    assert set(state["optimizer"]["state"]) == set(want_osd["state"])
    for fqn, per_param in want_osd["state"].items():
        for key, v in per_param.items():
            assert_bit_exact(state["optimizer"]["state"][fqn][key], v, f"optimizer.state.{fqn}.{key}")
    assert state["optimizer"]["param_groups"] == want_osd["param_groups"]
    assert state["lr_scheduler"] == training["lr_scheduler"]


def test_dcp_output_metadata_names(dcp_from_sharded):
    """The keys dcp.save itself would write for get_state_dict's dicts."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(dcp_from_sharded)).read_metadata()
    keys = set(md.state_dict_metadata)
    assert "model.model.embed_tokens.weight" in keys
    assert "optimizer.state.lm_head.weight.exp_avg_sq" in keys
    assert "optimizer.param_groups.0.params" in keys
    assert "lr_scheduler.last_epoch" in keys
    assert md.planner_data["optimizer.state.model.norm.weight.step"] == ("optimizer", "state", "model.norm.weight", "step")


def _quiet_rank() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("torch.distributed", "torch.distributed.device_mesh", "torch.distributed.checkpoint", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _sharded_llama(world_size: int):
    """The fixtures' tiny Llama, fully_shard'ed as they were (layers, then root), AdamW + LinearLR,
    but from other initial weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    config = _fixtures_module().tiny_llama_config()
    torch.manual_seed(SEED_OTHER)
    model = LlamaForCausalLM(config).to(torch.float32)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=4)
    return model, optimizer, scheduler


def _resumed(model, optimizer, scheduler, rank: int) -> dict:
    """What the job holds after loading: full params (DTensor.full_tensor()), this rank's
    optimizer shards, the optimizer state torch gathers (get_optimizer_state_dict, full), and,
    after one training step, the optimizer's step counts (the loaded state trains)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    names = {p: n for n, p in model.named_parameters()}
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    local = {names[p]: {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in st.items()}
             for p, st in optimizer.state.items()}
    groups = copy.deepcopy(optimizer.state_dict()["param_groups"])
    try:
        full = copy.deepcopy(get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True)))
        gather_error = None
    except Exception as e:  # noqa: BLE001 - raised alike on every rank, before any collective
        full, gather_error = None, f"{type(e).__name__}: {e}"
    lr = optimizer.param_groups[0]["lr"]
    g = torch.Generator().manual_seed(7)
    batch = torch.randint(4, 101, (2, 8), generator=g)
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    scheduler.step()
    steps = {optimizer.state[p]["step"].item() for p in model.parameters()}
    return {"params": params if rank == 0 else None, "optim_local": local, "param_groups": groups,
            "optim_full": full if rank == 0 else None, "gather_error": gather_error, "lr": lr,
            "steps_after": steps}


def _dcp_resume_rank(rank: int, world_size: int, path: str) -> dict:
    _quiet_rank()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer, scheduler = _sharded_llama(world_size)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optimizer": osd, "lr_scheduler": scheduler.state_dict()}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    scheduler.load_state_dict(state["lr_scheduler"])
    return _resumed(model, optimizer, scheduler, rank)


def _assert_resumed(results: list[dict], ref: dict, training: dict, what: str) -> None:
    """Every rank's job holds the source's weights, optimizer state (its shards concatenated)
    and learning rate, and trained one more step."""
    params = results[0]["params"]
    assert set(params) == set(ref), what
    for k, v in ref.items():
        assert_bit_exact(params[k], v, f"{what}: param {k}")
    want = training["optimizer"]
    for r in results:
        assert set(r["optim_local"]) == set(want["state"]), what
    for fqn, per_param in want["state"].items():
        for key, v in per_param.items():
            if v.dim() == 0:  # step: a plain scalar on every rank
                for r, res in enumerate(results):
                    assert_bit_exact(res["optim_local"][fqn][key], v, f"{what}: rank {r} optimizer {fqn}.{key}")
                continue
            got = torch.cat([res["optim_local"][fqn][key] for res in results])
            assert_bit_exact(got, v, f"{what}: optimizer {fqn}.{key} (rank shards)")
    for r, res in enumerate(results):
        groups = res["param_groups"]
        assert len(groups) == len(want["param_groups"]) == 1, what
        assert {k: v for k, v in groups[0].items() if k != "params"} == \
            {k: v for k, v in want["param_groups"][0].items() if k != "params"}, f"{what}: rank {r} param_groups"
        assert res["lr"] == training["lr_scheduler"]["_last_lr"][0], f"{what}: rank {r} lr"
        assert res["steps_after"] == {4.0}, f"{what}: rank {r} Adam step after one more step"


def _assert_gathered_optimizer(results: list[dict], training: dict, what: str) -> None:
    """torch's own gather of the loaded optimizer state works and gives the source's state."""
    errors = [r["gather_error"] for r in results]
    assert errors == [None] * len(results), f"{what}: get_optimizer_state_dict(full_state_dict=True) raised {errors[0]}"
    osd, want = results[0]["optim_full"], training["optimizer"]
    assert set(osd["state"]) == set(want["state"]), what
    for fqn, per_param in want["state"].items():
        for key, v in per_param.items():
            assert_bit_exact(osd["state"][fqn][key], v, f"{what}: gathered optimizer {fqn}.{key}")
    assert osd["param_groups"] == want["param_groups"], what


def test_dcp_output_resumes_2_rank_fully_shard_job(dcp_from_sharded, ref, training, tmp_path):
    results = run_ranks(_dcp_resume_rank, 2, tmp_path, str(dcp_from_sharded))
    _assert_resumed(results, ref, training, "dcp (from llama_sharded_ws2) at 2 ranks")
    _assert_gathered_optimizer(results, training, "dcp (from llama_sharded_ws2) at 2 ranks")


# ---------------------------------------------------------------------------------------------
# 3. sharded output at N loads into an N-rank fully_shard job
# ---------------------------------------------------------------------------------------------

SHARDED_SOURCES = {"llama_dcp": FIX / "llama_dcp", "llama_torch_training.pt": REF_TRAINING}
SHARDED_CASES = [(n, name) for n in (2, 3) for name in SHARDED_SOURCES]


def _sharded_resume_rank(rank: int, world_size: int, paths: dict[str, str]) -> dict:
    """For each source's sharded output: a fresh job loads its rank's files as verl does."""
    _quiet_rank()
    out = {}
    for name, path in paths.items():
        model, optimizer, scheduler = _sharded_llama(world_size)
        d = Path(path)
        model.load_state_dict(torch.load(d / f"model_world_size_{world_size}_rank_{rank}.pt", weights_only=True))
        optimizer.load_state_dict(torch.load(d / f"optim_world_size_{world_size}_rank_{rank}.pt", weights_only=True))
        extra = torch.load(d / f"extra_state_world_size_{world_size}_rank_{rank}.pt", weights_only=True)
        scheduler.load_state_dict(extra["lr_scheduler"])
        out[name] = _resumed(model, optimizer, scheduler, rank)
    return out


class _ShardedRuns:
    """Converts each source to sharded at N and runs one N-rank job per N (both sources in it),
    on first use; the tests of that N share the result."""

    def __init__(self, root: Path):
        self.root = root
        self._outputs: dict[int, dict[str, Path]] = {}
        self._runs: dict[int, list[dict] | BaseException] = {}

    def outputs(self, n: int) -> dict[str, Path]:
        if n not in self._outputs:
            self._outputs[n] = {name: Path(ckpt_tools.convert(src, self.root / f"{name}_ws{n}", to="sharded",
                                                             world_size=n, progress=False)["dst"])
                                for name, src in SHARDED_SOURCES.items()}
        return self._outputs[n]

    def results(self, n: int, name: str) -> list[dict]:
        if n not in self._runs:
            paths = {k: str(p) for k, p in self.outputs(n).items()}
            try:
                self._runs[n] = run_ranks(_sharded_resume_rank, n, self.root / f"run_ws{n}", paths)
            except Exception as e:  # noqa: BLE001 - every case of this N reports it
                self._runs[n] = e
        run = self._runs[n]
        if isinstance(run, BaseException):
            raise run
        return [r[name] for r in run]


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> _ShardedRuns:
    return _ShardedRuns(tmp_path_factory.mktemp("sharded"))


@pytest.mark.parametrize("n", [2, 3])
def test_sharded_output_layout(sharded_runs, n):
    for name, path in sharded_runs.outputs(n).items():
        files = sorted(p.name for p in path.iterdir() if not p.name.startswith("."))
        assert files == sorted(
            ["fsdp_config.json"]
            + [f"{k}_world_size_{n}_rank_{r}.pt" for k in ("model", "optim", "extra_state") for r in range(n)]
        ), name
        assert json.loads((path / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": n}
        osd = _plain_load(path / f"optim_world_size_{n}_rank_0.pt")
        # int-keyed, as optimizer.state_dict() is, whatever the source's keys
        assert sorted(osd["state"]) == list(range(21)), name
        assert osd["param_groups"][0]["params"] == list(range(21)), name


@pytest.mark.parametrize("n,source", SHARDED_CASES)
def test_sharded_output_resumes_fully_shard_job(sharded_runs, ref, training, n, source):
    _assert_resumed(sharded_runs.results(n, source), ref, training, f"sharded at {n} from {source}")


@pytest.mark.parametrize("n,source", SHARDED_CASES)
def test_sharded_output_optimizer_state_gathers(sharded_runs, training, n, source):
    _assert_gathered_optimizer(sharded_runs.results(n, source), training, f"sharded at {n} from {source}")


# ---------------------------------------------------------------------------------------------
# 4. export → from_pretrained
# ---------------------------------------------------------------------------------------------

EXPORT_SOURCES = {"untied": FIX / "llama_sharded_ws2", "tied": FIX / "llama_tied_sharded_ws2"}
TOKENS = torch.tensor([[1, 4, 17, 60, 99, 100, 3, 2, 55, 42]])


def _load_hf(path: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True, **kwargs)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    assert not info.get("error_msgs"), info
    return model.eval()


def _source_model(state: dict[str, torch.Tensor], tied: bool = False):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(_fixtures_module().tiny_llama_config(tied=tied)).to(torch.float32)
    if tied:
        missing, unexpected = model.load_state_dict({k: v for k, v in state.items() if k != "lm_head.weight"},
                                                    strict=False)
        assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        model.load_state_dict(state, strict=True)
    return model.eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def _safetensors_keys(path: Path) -> dict[str, torch.dtype]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({k: v.dtype for k, v in load_file(str(f)).items()})
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export")
    return {name: Path(ckpt_tools.export(src, root / name, progress=False)["dst"])
            for name, src in EXPORT_SOURCES.items()}


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_export_from_pretrained_same_logits(exported, ref, kind):
    tied = kind == "tied"
    state = _full_from_sharded(EXPORT_SOURCES[kind])
    if not tied:
        for k, v in ref.items():  # the fixture's reference weights are these shards
            assert_bit_exact(state[k], v, k)
    source = _source_model(state, tied=tied)
    model = _load_hf(exported[kind])
    assert model.config.tie_word_embeddings is tied
    for k, v in model.state_dict().items():
        assert_bit_exact(v, source.state_dict()[k], f"{kind}: {k}")
    assert torch.equal(_logits(model), _logits(source))


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_export_weights_and_assets(exported, ref, kind):
    out = exported[kind]
    keys = _safetensors_keys(out)
    if kind == "tied":
        # written once: from_pretrained ties lm_head to the embedding
        assert set(keys) == set(ref) - {"lm_head.weight"}
    else:
        assert set(keys) == set(ref)
    assert set(keys.values()) == {torch.float32}
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32"
    assert config["tie_word_embeddings"] is (kind == "tied")
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    # optimizer and extra state left out: nothing but the model's weights and HF assets
    assert not list(out.glob("*optim*")) and not list(out.glob("*extra_state*"))

    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok("the of")["input_ids"] == [1, 4, 5]
    assert GenerationConfig.from_pretrained(str(out)).eos_token_id == 2


def test_export_dtype_bf16(tmp_path, ref):
    out = tmp_path / "bf16"
    result = _cli("export", EXPORT_SOURCES["untied"], out, "--dtype", "bf16", "--quiet")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = _read_hf(out)
    assert set(tensors) == set(ref)
    for k, v in ref.items():
        assert_bit_exact(tensors[k], v.to(torch.bfloat16), k)
    # the same weights as HF's own bf16 save_pretrained (fixtures/llama_hf), byte for byte
    hf_own = load_file(str(FIX / "llama_hf" / "model.safetensors"))
    for k, v in hf_own.items():
        assert_bit_exact(tensors[k], v, f"{k} vs llama_hf")
    model = _load_hf(out)
    assert model.dtype == torch.bfloat16  # the config's dtype is what from_pretrained uses
    assert torch.equal(_logits(model), _logits(_load_hf(FIX / "llama_hf")))


def test_export_max_shard_size_40KB(tmp_path, ref):
    out = tmp_path / "sharded_hf"
    result = _cli("export", EXPORT_SOURCES["untied"], out, "--max-shard-size", "40KB", "--quiet")
    assert result.exit_code == 0, result.output
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 2, shards
    n = len(shards)
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ref)
    assert set(index["weight_map"].values()) == set(shards)
    # the same split as HF's own save_pretrained(max_shard_size="40KB") of these weights
    hf_own = json.loads((FIX / "llama_hf_sharded" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == hf_own["weight_map"]
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in ref.values())
    for shard in shards:
        tensors = load_file(str(out / shard))
        assert set(tensors) == {k for k, s in index["weight_map"].items() if s == shard}, shard
        assert sum(v.numel() * v.element_size() for v in tensors.values()) <= 40_000, shard
    model = _load_hf(out)
    assert torch.equal(_logits(model), _logits(_source_model(ref)))


def test_export_base_dir_supplies_assets(tmp_path, ref):
    """llama_dcp has no huggingface/ folder: config, tokenizer and generation config come from
    --base; the config's dtype is what was written (fp32), not the base's (bf16)."""
    base = FIX / "llama_hf"
    assert json.loads((base / "config.json").read_text())["dtype"] == "bfloat16"
    out = tmp_path / "from_dcp"
    result = _cli("export", FIX / "llama_dcp", out, "--base", base, "--quiet")
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    base_config = json.loads((base / "config.json").read_text())
    assert config["dtype"] == "float32"
    assert {k: v for k, v in config.items() if k != "dtype"} == {k: v for k, v in base_config.items() if k != "dtype"}
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (base / name).read_bytes(), name
    assert set(_safetensors_keys(out)) == set(ref)
    model = _load_hf(out)
    assert model.dtype == torch.float32
    assert torch.equal(_logits(model), _logits(_source_model(ref)))


@pytest.mark.parametrize("prefix", ["_orig_mod.", "module.", "module._orig_mod."])
def test_export_strips_wrapper_prefixes(tmp_path, ref, prefix):
    src = tmp_path / "wrapped.pt"
    torch.save({prefix + k: v for k, v in ref.items()}, src)
    out = tmp_path / "clean"
    ckpt_tools.export(src, out, base=str(FIX / "llama_hf_sharded"), progress=False)
    tensors = _read_hf(out)
    assert set(tensors) == set(ref)
    for k, v in ref.items():
        assert_bit_exact(tensors[k], v, k)
    model = _load_hf(out)
    assert torch.equal(_logits(model), _logits(_source_model(ref)))


# ---------------------------------------------------------------------------------------------
# 5. --dtype, --model-only, --overwrite, plain torch output
# ---------------------------------------------------------------------------------------------

MIXED = {
    "w.fp32": torch.randn(5, 3, generator=torch.Generator().manual_seed(1)),
    "w.bf16": torch.randn(4, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16),
    "w.fp16": torch.randn(3, 2, generator=torch.Generator().manual_seed(3)).to(torch.float16),
    "buf.int64": torch.tensor([[1, -2], [2**40, 7]]),
    "buf.bool": torch.tensor([True, False, True]),
    "buf.scalar_int": torch.tensor(5),
}


@pytest.mark.parametrize("to", ["torch", "hf", "dcp", "sharded"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_dtype_casts_floating_tensors_only(tmp_path, dtype, to):
    target = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    src = tmp_path / "mixed.safetensors"
    save_file(MIXED, str(src))
    dst = tmp_path / ("out.pt" if to == "torch" else "out")
    ckpt_tools.convert(src, dst, to=to, dtype=dtype, world_size=2 if to in ("dcp", "sharded") else None,
                       progress=False)
    ckpt = describe(dst)
    got = {t.name: t for t in ckpt.tensors}
    assert set(got) == set(MIXED)
    with Reader(ckpt) as reader:
        for name, v in MIXED.items():
            if v.is_floating_point():
                want = v.to(target)
            else:
                want = v
            assert_bit_exact(reader.full(got[name]), want, f"{name} --dtype {dtype} --to {to}")


@pytest.mark.parametrize("to", ["torch", "dcp", "sharded"])
def test_dtype_keeps_optimizer_step(tmp_path, training, to):
    dst = tmp_path / ("out.pt" if to == "torch" else "out")
    ckpt_tools.convert(FIX / "llama_sharded_ws2", dst, to=to, dtype="bf16", progress=False)
    ckpt = describe(dst)
    optim = [t for t in ckpt.tensors if t.group == "optimizer"]
    assert len(optim) == 63
    with Reader(ckpt) as reader:
        for t in ckpt.tensors:
            if t.group == "optimizer" and t.state == "step":
                assert t.dtype == torch.float32, t.name
                assert reader.full(t).item() == 3.0, t.name
            else:
                assert t.dtype == torch.bfloat16, (t.group, t.name, t.dtype)
        for t in optim:
            if t.state == "exp_avg":
                want = training["optimizer"]["state"][t.param]["exp_avg"].to(torch.bfloat16)
                assert_bit_exact(reader.full(t), want, t.name)
    if to == "torch":
        sd = _plain_load(dst)
        assert sd["optimizer"]["state"]["lm_head.weight"]["step"].dtype == torch.float32
        assert sd["optimizer"]["state"]["lm_head.weight"]["exp_avg"].dtype == torch.bfloat16
        assert sd["model"]["lm_head.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("to", ["torch", "dcp", "sharded"])
def test_model_only_drops_optimizer(tmp_path, ref, to):
    dst = tmp_path / ("out.pt" if to == "torch" else "out")
    result = _cli("convert", FIX / "llama_sharded_ws2", dst, "--to", to, "--model-only", "--quiet")
    assert result.exit_code == 0, result.output
    ckpt = describe(dst)
    assert {t.group for t in ckpt.tensors} == {"model"}
    assert {t.name for t in ckpt.tensors} == set(ref)
    assert {o.group for o in ckpt.objects} <= {"model"}
    if to == "sharded":
        assert not list(dst.glob("optim_*")) and not list(dst.glob("extra_state_*"))
    if to == "torch":
        sd = _plain_load(dst)
        assert set(_read_torch(dst)) == set(ref)
        assert "optimizer" not in sd and "lr_scheduler" not in sd


def test_cli_existing_destination_needs_overwrite(tmp_path):
    src = FIX / "llama_sharded_ws2"
    dst = tmp_path / "out.pt"
    assert _cli("convert", src, dst, "--to", "torch", "--model-only", "--quiet").exit_code == 0
    before = dst.read_bytes()

    result = _cli("convert", src, dst, "--to", "torch", "--quiet")
    assert result.exit_code == 4, result.output
    assert result.stderr.startswith("error: ") and str(dst) in result.stderr, result.stderr
    assert dst.read_bytes() == before

    result = _cli("convert", src, dst, "--to", "torch", "--overwrite", "--quiet")
    assert result.exit_code == 0, result.output
    assert "optimizer" in _plain_load(dst)  # replaced by the full conversion
    assert not [p for p in tmp_path.iterdir() if p.name != "out.pt"], "temporary files left behind"


def test_cli_existing_directory_destination(tmp_path):
    src = FIX / "llama_sharded_ws2"
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    result = _cli("export", src, dst, "--quiet")
    assert result.exit_code == 4, result.output
    assert result.stderr.startswith("error: "), result.stderr
    assert (dst / "keep.txt").read_text() == "mine"

    # --overwrite replaces only a checkpoint: the user's own file is never deleted (issue 31)
    result = _cli("export", src, dst, "--overwrite", "--quiet")
    assert result.exit_code == 4, result.output
    assert "keep.txt" in result.stderr and (dst / "keep.txt").read_text() == "mine"
    (dst / "keep.txt").unlink()
    result = _cli("export", src, dst, "--overwrite", "--quiet")
    assert result.exit_code == 0, result.output
    assert (dst / "config.json").is_file() and (dst / "model.safetensors").is_file()


@pytest.mark.parametrize("src", ["llama_sharded_ws2", "llama_dcp"])
def test_convert_to_torch_is_a_plain_training_state(tmp_path, ref, training, src):
    dst = tmp_path / "full.pt"
    result = _cli("convert", FIX / src, dst, "--to", "torch", "--quiet")
    assert result.exit_code == 0, result.output
    # plain: nothing beyond torch.load's default allowlist (no DTensor, no numpy RNG state)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(dst)) == []
    sd = torch.load(dst, weights_only=True)
    assert isinstance(sd, dict)
    assert {"model", "optimizer", "lr_scheduler"} <= set(sd)
    assert set(sd["model"]) == set(ref)
    for k, v in ref.items():
        assert type(sd["model"][k]) is torch.Tensor, k
        assert_bit_exact(sd["model"][k], v, k)
    osd, want = sd["optimizer"], training["optimizer"]
    assert set(osd) == {"state", "param_groups"}
    assert list(osd["state"]) == list(want["state"])  # FQN-keyed, in parameter order
    for fqn, per_param in want["state"].items():
        assert set(osd["state"][fqn]) == set(per_param), fqn
        for key, v in per_param.items():
            assert type(osd["state"][fqn][key]) is torch.Tensor
            assert_bit_exact(osd["state"][fqn][key], v, f"{fqn}.{key}")
    assert osd["param_groups"] == want["param_groups"]
    assert sd["lr_scheduler"] == training["lr_scheduler"]


def test_convert_accelerate_to_torch_keeps_model_and_optimizer(tmp_path, ref, training):
    dst = tmp_path / "full.pt"
    ckpt_tools.convert(FIX / "llama_accelerate", dst, to="torch", progress=False)
    sd = torch.load(dst, weights_only=True)
    for k, v in ref.items():
        assert_bit_exact(sd["model"][k], v, k)
    assert list(sd["optimizer"]["state"]) == list(training["optimizer"]["state"])
    assert sd["optimizer"]["param_groups"] == training["optimizer"]["param_groups"]


def test_convert_accelerate_to_torch_keeps_lr_scheduler(tmp_path, training):
    dst = tmp_path / "full.pt"
    ckpt_tools.convert(FIX / "llama_accelerate", dst, to="torch", progress=False)
    assert torch.load(dst, weights_only=True).get("lr_scheduler") == training["lr_scheduler"]
