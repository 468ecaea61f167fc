"""Readers against every fixture and against checkpoints the tests write themselves.

The expected side never goes through ckpt_tools: it comes from ``safetensors``, ``torch.load``
(DTensor local shards concatenated on dim 0 in rank order), ``dcp_to_torch_save`` and the
tensors the test itself saved. Every case is one parametrized id, so a failure names it.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (torch.load of DTensor files needs it)
from safetensors.torch import load_file, save_file

from ckpt_tools import formats
from ckpt_tools.errors import BadInput
from ckpt_tools.engine.reader import Reader

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
REFERENCE_BIN = FIXTURES / "llama_torch" / "pytorch_model.bin"
TRAINING_PT = FIXTURES / "llama_torch_training.pt"


# -- expected values, computed without ckpt_tools ----------------------------------------------

@dataclass
class Case:
    path: Path
    format: str
    world_size: int | None
    expected: dict[tuple[str, str], torch.Tensor]  # (group, name) -> the full logical tensor
    step: float | None = None  # the optimizer's step, where there is an optimizer
    param_names: tuple[str, ...] = ()  # an int-keyed optimizer's parameters, by id
    tied: bool = False
    _ckpt: object = field(default=None, repr=False)

    @property
    def ckpt(self):
        """The description under test (memoized: several tests look at one case)."""
        if self._ckpt is None:
            self._ckpt = formats.describe(self.path)
        return self._ckpt


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes (works for bool, float8 and 0-dim tensors, NaN-safe)."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def whole_reader(ckpt) -> Reader:
    """A Reader that keeps every file unpickled: reading tensor by tensor across W > 4 rank files
    re-unpickles them with the default cache of 4."""
    return Reader(ckpt, cache_files=len(ckpt.files))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@functools.cache
def llama_param_names(tied: bool) -> tuple[str, ...]:
    """``model.parameters()`` order of the fixtures' tiny Llama (= optimizer ids 0..N-1)."""
    from make_fixtures import tiny_llama_config
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_llama_config(tied=tied))
    return tuple(n for n, _ in model.named_parameters())


def load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=True)


def optimizer_tensors(osd: dict, param_names: tuple[str, ...]) -> dict[tuple[str, str], torch.Tensor]:
    out = {}
    for pid, states in osd["state"].items():
        fqn = param_names[pid] if isinstance(pid, int) else pid
        for k, v in states.items():
            if isinstance(v, torch.Tensor):
                out[("optimizer", f"state.{fqn}.{k}")] = v
    return out


def ref_safetensors(path: Path) -> dict:
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    return {("model", k): v for f in files for k, v in load_file(f).items()}


def ref_torch(obj: dict, param_names: tuple[str, ...] = ()) -> dict:
    if isinstance(obj.get("model"), dict):
        out = {("model", k): v for k, v in obj["model"].items() if isinstance(v, torch.Tensor)}
        if "optimizer" in obj:
            out |= optimizer_tensors(obj["optimizer"], param_names)
        return out
    return {("model", k): v for k, v in obj.items()}


def ref_sharded(path: Path, world_size: int, param_names: tuple[str, ...]) -> dict:
    """Assemble verl rank files: DTensor local shards concatenated on dim 0 in rank order."""
    from torch.distributed.tensor import DTensor, Shard

    def assemble(per_rank: list[dict]) -> dict:
        out = {}
        for key in per_rank[0]:
            values = [sd[key] for sd in per_rank]
            if isinstance(values[0], DTensor):
                assert all(v.placements == (Shard(0),) for v in values)
                out[key] = torch.cat([v.to_local() for v in values], dim=0)
            else:  # a plain tensor (the optimizer's step) is the same on every rank
                assert all(same_bits(v, values[0]) for v in values)
                out[key] = values[0]
        return out

    models = [load(path / f"model_world_size_{world_size}_rank_{r}.pt") for r in range(world_size)]
    out = {("model", k): v for k, v in assemble(models).items()}
    optims = [load(path / f"optim_world_size_{world_size}_rank_{r}.pt") for r in range(world_size)
              if (path / f"optim_world_size_{world_size}_rank_{r}.pt").exists()]
    if optims:
        flat = [optimizer_tensors(o, param_names) for o in optims]
        out |= assemble(flat)
    return out


def ref_dcp(path: Path, scratch: Path) -> dict:
    """torch's own DCP loader, through dcp_to_torch_save (the fixture is trusted)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = {}
    parts = [path] if (path / ".metadata").exists() else sorted(p for p in path.iterdir() if (p / ".metadata").exists())
    for i, part in enumerate(parts):
        dst = scratch / f"dcp_ref_{i}.pt"
        dcp_to_torch_save(part, dst)
        obj = load(dst)
        out |= {("model", k): v for k, v in obj.get("model", {}).items()}
        if "optimizer" in obj:
            out |= optimizer_tensors(obj["optimizer"], ())
    return out


# -- the cases ---------------------------------------------------------------------------------

FIXTURE_FORMATS = {
    "llama_accelerate": ("dcp", 2), "llama_dcp": ("dcp", 2), "llama_hf": ("hf", None),
    "llama_hf_sharded": ("hf", None), "llama_sharded_ws2": ("sharded", 2), "llama_sharded_ws8": ("sharded", 8),
    "llama_tied_hf": ("hf", None), "llama_tied_sharded_ws2": ("sharded", 2), "llama_torch": ("torch", None),
    "llama_torch_training.pt": ("torch", None), "llama_torch/pytorch_model.bin": ("torch", None),
}
FIXTURE_CASES = list(FIXTURE_FORMATS)


def _fixture_case(name: str, factory) -> Case:
    fmt, ws = FIXTURE_FORMATS[name]
    path = FIXTURES / name
    tied = "tied" in name
    names = llama_param_names(tied)
    if fmt == "hf":
        expected = ref_safetensors(path)
    elif fmt == "torch":
        expected = ref_torch(load(path if path.is_file() else path / "pytorch_model.bin"), names)
    elif fmt == "sharded":
        expected = ref_sharded(path, ws, names)
    else:
        expected = ref_dcp(path, factory.mktemp("dcp_ref"))
    has_optim = any(g == "optimizer" for g, _ in expected)
    return Case(path, fmt, ws, expected, step=3.0 if has_optim else None, param_names=names, tied=tied)


def _dtype_zoo() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w.f32": torch.randn(4, 5, generator=g),
        "w.f64": torch.randn(3, generator=g, dtype=torch.float64),
        "w.bf16": torch.randn(3, 7, generator=g).bfloat16(),
        "w.fp16": torch.randn(2, 3, 4, generator=g).half(),
        "w.f8": torch.randn(6, 2, generator=g).to(torch.float8_e4m3fn),
        "w.f8e5": torch.randn(5, generator=g).to(torch.float8_e5m2),
        "ids.i64": torch.arange(-3, 8, dtype=torch.int64),
        "ids.i32": torch.arange(5, dtype=torch.int32),
        "ids.i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "bytes.u8": torch.tensor([0, 255, 7], dtype=torch.uint8),
        "mask.bool": torch.tensor([[True, False, True], [False, False, True]]),
        "scalar": torch.tensor(3.25),
        "scalar.i64": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
    }


def _st_file(factory) -> Case:
    zoo = _dtype_zoo()
    path = factory.mktemp("st_file") / "weights.safetensors"
    save_file(zoo, path)
    return Case(path, "hf", None, {("model", k): v for k, v in zoo.items()})


def _st_dir(factory) -> Case:
    zoo = _dtype_zoo()
    d = factory.mktemp("st_dir")
    save_file(zoo, d / "model.safetensors", metadata={"format": "pt"})
    return Case(d, "hf", None, {("model", k): v for k, v in zoo.items()})


def _hf_save_pretrained(factory, *, tied: bool) -> Case:
    from make_fixtures import tiny_llama_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM(tiny_llama_config(tied=tied))
    d = factory.mktemp("hf_tied" if tied else "hf_sharded")
    model.save_pretrained(d, max_shard_size="1MB" if tied else "30KB")
    sd = model.state_dict()
    if tied:  # save_pretrained writes a tied weight once, under the embedding's name
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    else:
        assert (d / "model.safetensors.index.json").exists() and len(list(d.glob("*.safetensors"))) > 2
    return Case(d, "hf", None, {("model", k): v.detach().clone() for k, v in sd.items()}, tied=tied)


def _torch_plain(factory) -> Case:
    zoo = _dtype_zoo()
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    zoo["noncontig.t"] = base.t()  # a transposed view, saved with its strides
    zoo["view.rows"] = base[1:3]  # shares storage with noncontig.t
    path = factory.mktemp("torch_plain") / "weights.pt"
    torch.save(zoo, path)
    return Case(path, "torch", None, {("model", k): v.contiguous() for k, v in zoo.items()})


def _trained_llama(tied: bool, steps: int = 2):
    from make_fixtures import tiny_llama_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(2)
    model = LlamaForCausalLM(tiny_llama_config(tied=tied))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=4)
    ids = torch.randint(4, 101, (2, 8), generator=torch.Generator().manual_seed(3))
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def _torch_training(factory, *, tied: bool) -> Case:
    """A plain (non-FSDP) training dict; optimizer.state_dict() is int-keyed."""
    model, opt, sched = _trained_llama(tied)
    path = factory.mktemp("torch_training") / ("tied.pt" if tied else "training.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "lr_scheduler": sched.state_dict(),
                "epoch": 1}, path)
    names = tuple(n for n, _ in model.named_parameters())
    expected = {("model", k): v.detach().clone() for k, v in model.state_dict().items()}
    expected |= optimizer_tensors(opt.state_dict(), names)
    return Case(path, "torch", None, expected, step=2.0, param_names=names, tied=tied)


def _hf_bin_sharded(factory) -> Case:
    """HF's pytorch_model-0000x-of-0000y.bin shards + pytorch_model.bin.index.json."""
    sd = load(REFERENCE_BIN)
    d = factory.mktemp("hf_bin")
    keys = list(sd)
    split = {"pytorch_model-00001-of-00002.bin": keys[:9], "pytorch_model-00002-of-00002.bin": keys[9:]}
    for file, names in split.items():
        torch.save({k: sd[k] for k in names}, d / file)
    index = {"metadata": {"total_size": sum(nbytes(v) for v in sd.values())},
             "weight_map": {k: f for f, names in split.items() for k in names}}
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return Case(d, "torch", None, {("model", k): v for k, v in sd.items()})


def _dcp_no_dist(factory) -> Case:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, sched = _trained_llama(False, steps=1)
    msd, osd = get_state_dict(model, opt)
    d = factory.mktemp("dcp_no_dist") / "ckpt"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict()}, checkpoint_id=str(d),
                 no_dist=True)
    expected = {("model", k): v.detach().clone() for k, v in msd.items()} | optimizer_tensors(osd, ())
    return Case(d, "dcp", 1, expected, step=1.0, param_names=tuple(n for n, _ in model.named_parameters()))


# One 3-rank FSDP2 job (a single spawn) writes three of the cases. Its models are plain torch
# (transformers costs each spawned rank seconds of import time on a 2-core machine).
WS3 = 3


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(32)
        self.up_proj = torch.nn.Linear(32, 48)
        self.down_proj = torch.nn.Linear(48, 32)

    def forward(self, x):
        return x + self.down_proj(torch.nn.functional.silu(self.up_proj(self.norm(x))))


class TinyLM(torch.nn.Module):
    """Llama-shaped names and uneven dim 0 (101 rows over 3 ranks), plus two unsharded buffers."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(101, 32)
        self.layers = torch.nn.ModuleList(Block() for _ in range(2))
        self.norm = torch.nn.RMSNorm(32)
        self.lm_head = torch.nn.Linear(32, 101, bias=False)
        self.register_buffer("position_ids", torch.arange(8))
        self.register_buffer("scale", torch.full((5,), 0.5))

    def forward(self, ids):
        x = self.embed_tokens(ids) * self.scale[0]
        for block in self.layers:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _ws3_job(rank: int, world_size: int, out: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict, get_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    results = {}
    for name in ("verl_ws3", "verl_ws3_small"):
        torch.manual_seed(0)
        if name == "verl_ws3":
            model = TinyLM()
            blocks = list(model.layers)
            ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(rank))
            loss_fn = lambda: model(ids)  # noqa: E731
        else:  # 2 rows and 1 row over 3 ranks: the last ranks hold empty shards
            model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
            blocks = list(model)
            x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
            loss_fn = lambda: model(x).sum()  # noqa: E731
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=4)
        for _ in range(2):
            loss_fn().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        d = Path(out) / name
        d.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), d / f"model_world_size_{world_size}_rank_{rank}.pt")
        torch.save(opt.state_dict(), d / f"optim_world_size_{world_size}_rank_{rank}.pt")
        torch.save({"lr_scheduler": sched.state_dict()}, d / f"extra_state_world_size_{world_size}_rank_{rank}.pt")
        if rank == 0:
            (d / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world_size}))
        if name == "verl_ws3":
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict()},
                     checkpoint_id=str(Path(out) / "dcp_ws3"))
            # the same save with FQN-keyed (get_optimizer_state_dict) per-rank optim files
            fqn_dir = Path(out) / "verl_ws3_fqn_optim"
            fqn_dir.mkdir(exist_ok=True)
            mine = [f"model_world_size_{world_size}_rank_{rank}.pt",
                    f"extra_state_world_size_{world_size}_rank_{rank}.pt"] + (["fsdp_config.json"] if rank == 0 else [])
            for f in mine:  # this rank's own files only: the others may still be writing theirs
                shutil.copy(d / f, fqn_dir / f)
            torch.save(osd, fqn_dir / f"optim_world_size_{world_size}_rank_{rank}.pt")
        fm = get_model_state_dict(model, options=full)
        fo = get_optimizer_state_dict(model, opt, options=full)
        if rank == 0:
            results[name] = {"model": {k: v.clone() for k, v in fm.items()},
                             "optimizer": fo, "names": [n for n, _ in model.named_parameters()]}
    try:
        results["fsdp1_ws3"] = _fsdp1_job(rank, world_size, Path(out) / "fsdp1_ws3")
    except Exception as e:  # FSDP1 is deprecated: its loss must not take the FSDP2 cases down
        results["fsdp1_ws3"] = f"FSDP1 job failed: {type(e).__name__}: {e}"
    return results if rank == 0 else None


def _fsdp1_job(rank: int, world_size: int, d: Path):
    """FSDP1 SHARDED_STATE_DICT files (ShardedTensor), verl's names; rank 2 holds no rows of `1.*`."""
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2)), device_id=torch.device("cpu"),
                 use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))).sum().backward()
    opt.step()
    d.mkdir(parents=True, exist_ok=True)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        torch.save(model.state_dict(), d / f"model_world_size_{world_size}_rank_{rank}.pt")
        torch.save(FSDP.optim_state_dict(model, opt), d / f"optim_world_size_{world_size}_rank_{rank}.pt")
    if rank == 0:
        (d / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 1, "world_size": world_size}))
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = {k: v.clone() for k, v in model.state_dict().items()}
        full_optim = FSDP.optim_state_dict(model, opt)
    return {"model": full, "optimizer": full_optim}


@functools.cache
def _ws3_outputs(root: Path) -> dict:
    from dist import run_ranks

    return run_ranks(_ws3_job, WS3, root, str(root), timeout=240)[0]


def _ws3_case(name: str, factory) -> Case:
    root = _ws3_root(factory)
    res = _ws3_outputs(root)["verl_ws3" if name in ("dcp_ws3", "verl_ws3_fqn_optim") else name]
    expected = {("model", k): v for k, v in res["model"].items()} | optimizer_tensors(res["optimizer"], ())
    fmt, ws = ("dcp", WS3) if name == "dcp_ws3" else ("sharded", WS3)
    return Case(root / name, fmt, ws, expected, step=2.0, param_names=tuple(res["names"]))


_WS3_ROOT: list[Path] = []


def _ws3_root(factory) -> Path:
    if not _WS3_ROOT:
        _WS3_ROOT.append(factory.mktemp("ws3"))
    return _WS3_ROOT[0]


BUILDERS = {
    "safetensors_file_dtypes": _st_file,
    "safetensors_dir_dtypes": _st_dir,
    "hf_save_pretrained_sharded": functools.partial(_hf_save_pretrained, tied=False),
    "hf_save_pretrained_tied": functools.partial(_hf_save_pretrained, tied=True),
    "torch_pt_dtypes": _torch_plain,
    "torch_training_int_keyed": functools.partial(_torch_training, tied=False),
    "torch_training_tied_int_keyed": functools.partial(_torch_training, tied=True),
    "hf_bin_shards_index": _hf_bin_sharded,
    "dcp_no_dist": _dcp_no_dist,
    "verl_ws3": functools.partial(_ws3_case, "verl_ws3"),
    "verl_ws3_small": functools.partial(_ws3_case, "verl_ws3_small"),
    "verl_ws3_fqn_optim": functools.partial(_ws3_case, "verl_ws3_fqn_optim"),
    "dcp_ws3": functools.partial(_ws3_case, "dcp_ws3"),
}
MADE_CASES = list(BUILDERS)
ALL_CASES = FIXTURE_CASES + MADE_CASES
SHARDED_CASES = [n for n in ALL_CASES if n.startswith(("llama_sharded", "llama_tied_sharded", "verl_"))]
INT_KEYED_CASES = [n for n in SHARDED_CASES if n != "verl_ws3_fqn_optim"] + [
    "torch_training_int_keyed", "torch_training_tied_int_keyed"]
FQN_KEYED_CASES = ["llama_torch_training.pt", "llama_dcp", "llama_accelerate", "dcp_no_dist", "dcp_ws3",
                   "verl_ws3_fqn_optim"]

_CASES: dict[str, Case] = {}


def get_case(name: str, factory) -> Case:
    """Build (once per session) the case called ``name``; shared with test_inspect."""
    if name not in _CASES:
        _CASES[name] = _fixture_case(name, factory) if name in FIXTURE_FORMATS else BUILDERS[name](factory)
    return _CASES[name]


@pytest.fixture
def case(request, tmp_path_factory) -> Case:
    return get_case(request.param, tmp_path_factory)


# -- every reader, every case ------------------------------------------------------------------

@pytest.mark.parametrize("case", ALL_CASES, indirect=True)
def test_detect(case):
    assert formats.detect(case.path) == case.format


@pytest.mark.parametrize("case", ALL_CASES, indirect=True)
def test_describe_matches_reference(case):
    ckpt = case.ckpt
    assert ckpt.format == case.format
    assert ckpt.world_size == case.world_size
    got = {t.key: (t.shape, t.dtype, t.nbytes) for t in ckpt.tensors}
    want = {k: (tuple(v.shape), v.dtype, nbytes(v)) for k, v in case.expected.items()}
    assert got == want
    assert len(ckpt.tensors) == len(got), "a tensor is listed twice"


@pytest.mark.parametrize("case", ALL_CASES, indirect=True)
def test_full_equals_real_tensor(case):
    with whole_reader(case.ckpt) as r:
        wrong = [t.name for t in case.ckpt.tensors if not same_bits(r.full(t), case.expected[t.key])]
    assert wrong == []


@pytest.mark.parametrize("case", SHARDED_CASES, indirect=True)
def test_sharded_chunks_follow_fully_shard_split(case):
    """Each rank's chunk is torch.chunk's split of dim 0 (trailing ranks may hold no rows)."""
    for t in case.ckpt.tensors:
        sharded = t.group == "optimizer" or t.name in case.param_names or (case.tied and t.name == "lm_head.weight")
        if t.state == "step" or not sharded:
            # plain tensors (the step, buffers) are whole on every rank
            assert [(c.rank, c.sizes) for c in t.chunks] == [(r, t.shape) for r in range(case.world_size)]
            continue
        got = {c.rank: (c.offsets[0], c.sizes[0]) for c in t.chunks if c.numel}
        pieces = torch.arange(t.shape[0]).chunk(case.world_size)
        want = {r: (int(p[0]), len(p)) for r, p in enumerate(pieces) if len(p)}
        assert got == want, t.name
        assert all(c.sizes[1:] == t.shape[1:] for c in t.chunks), t.name


@pytest.mark.parametrize("case", ["verl_ws3", "verl_ws3_small", "verl_ws3_fqn_optim"], indirect=True)
def test_reference_assembly_equals_full_state_dict(case):
    """The test's own rule (concatenate local shards in rank order) matches what FSDP gathers."""
    assembled = ref_sharded(case.path, WS3, case.param_names)
    assert assembled.keys() == case.expected.keys()
    assert all(same_bits(assembled[k], case.expected[k]) for k in assembled)


def test_fsdp1_sharded_tensor_files(tmp_path_factory):
    """CONTRACT.md: FSDP1 SHARDED_STATE_DICT files (ShardedTensor) are read too."""
    res = _ws3_outputs(_ws3_root(tmp_path_factory))["fsdp1_ws3"]
    assert isinstance(res, dict), res
    expected = {("model", k): v for k, v in res["model"].items()} | optimizer_tensors(res["optimizer"], ())
    ckpt = formats.describe(_ws3_root(tmp_path_factory) / "fsdp1_ws3")
    assert (ckpt.format, ckpt.world_size) == ("sharded", WS3)
    with whole_reader(ckpt) as r:
        got = {t.key: r.full(t) for t in ckpt.tensors}
    assert got.keys() == expected.keys()
    # FSDP1's own full optim_state_dict on CPU returns exp_avg aliased to exp_avg_sq (torch 2.13),
    # so exp_avg is checked against Adam's first step instead: exp_avg = 0.1 g, exp_avg_sq = 0.001 g²
    exact = [k for k in got if not k[1].endswith(".exp_avg")]
    assert all(same_bits(got[k], expected[k]) for k in exact), [k for k in exact if not same_bits(got[k], expected[k])]
    for k in set(got) - set(exact):
        sq = got[(k[0], k[1] + "_sq")]
        torch.testing.assert_close(got[k] ** 2 * 0.1, sq, rtol=1e-4, atol=1e-12)


def test_ws3_small_has_empty_shards(tmp_path_factory):
    ckpt = get_case("verl_ws3_small", tmp_path_factory).ckpt
    w = ckpt.tensor_map()[("model", "1.weight")]
    assert w.shape == (1, 2)
    assert sorted(c.sizes[0] for c in w.chunks) == [0, 0, 1]


# -- the fixtures agree with each other (fixtures/README.md) ------------------------------------

SAME_WEIGHTS = ["llama_sharded_ws2", "llama_dcp", "llama_accelerate", "llama_hf_sharded", "llama_hf",
                "llama_sharded_ws8"]


@pytest.mark.parametrize("case", SAME_WEIGHTS, indirect=True)
def test_fixture_weights_equal_pytorch_model_bin(case):
    ref = load(REFERENCE_BIN)
    with whole_reader(case.ckpt) as r:
        got = {t.name: r.full(t) for t in case.ckpt.group("model")}
    assert got.keys() == ref.keys()
    for name, value in got.items():
        if case.path.name == "llama_hf":
            assert same_bits(value, ref[name].bfloat16()), name
        elif case.path.name == "llama_sharded_ws8":  # a separate job: equal to ~1e-7
            torch.testing.assert_close(value, ref[name], rtol=0, atol=1e-5)
        else:
            assert same_bits(value, ref[name]), name


@pytest.mark.parametrize("case", ["llama_sharded_ws2", "llama_dcp", "llama_accelerate", "llama_sharded_ws8"],
                         indirect=True)
def test_fixture_optimizer_equals_training_pt(case):
    """Int-keyed (verl) and FQN-keyed (DCP) optimizer state land on the same names and values as
    the FQN-keyed full optimizer state dict in llama_torch_training.pt."""
    ref = load(TRAINING_PT)["optimizer"]["state"]
    want = {f"state.{fqn}.{k}": v for fqn, s in ref.items() for k, v in s.items()}
    with whole_reader(case.ckpt) as r:
        got = {t.name: r.full(t) for t in case.ckpt.group("optimizer")}
    assert got.keys() == want.keys()
    for name, value in got.items():
        if case.path.name == "llama_sharded_ws8":
            torch.testing.assert_close(value, want[name], rtol=1e-4, atol=1e-6)
        else:
            assert same_bits(value, want[name]), name


# -- optimizer state mapped to parameter names ------------------------------------------------

@pytest.mark.parametrize("case", INT_KEYED_CASES, indirect=True)
def test_int_keyed_ids_map_to_parameter_names(case):
    ckpt = case.ckpt
    assert ckpt.param_order == case.param_names
    shapes = {t.name: t.shape for t in ckpt.group("model")}
    params = {t.param for t in ckpt.group("optimizer")}
    assert params == set(case.param_names)
    for t in ckpt.group("optimizer"):
        assert t.name == f"state.{t.param}.{t.state}"
        if t.state != "step":
            assert t.shape == shapes[t.param], t.name


def test_llama_ids_0_to_20_are_readme_order():
    names = llama_param_names(False)
    assert len(names) == 21 and names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    assert names[1] == "model.layers.0.self_attn.q_proj.weight" and names[-2] == "model.norm.weight"
    assert llama_param_names(True) == names[:-1]


@pytest.mark.parametrize("case", ["llama_tied_sharded_ws2", "torch_training_tied_int_keyed"], indirect=True)
def test_tied_weights(case):
    """20 parameters for the optimizer; the model still lists both names, over equal values."""
    ckpt = case.ckpt
    assert len(ckpt.param_order) == 20 and "lm_head.weight" not in ckpt.param_order
    assert {t.param for t in ckpt.group("optimizer")} == set(llama_param_names(True))
    assert len(ckpt.group("optimizer")) == 60
    tm = ckpt.tensor_map()
    with Reader(ckpt) as r:
        assert same_bits(r.full(tm[("model", "lm_head.weight")]), r.full(tm[("model", "model.embed_tokens.weight")]))


def test_tied_hf_fixture_has_no_lm_head(tmp_path_factory):
    names = {t.name for t in get_case("llama_tied_hf", tmp_path_factory).ckpt.tensors}
    assert len(names) == 20 and "lm_head.weight" not in names and "model.embed_tokens.weight" in names


@pytest.mark.parametrize("case", FQN_KEYED_CASES, indirect=True)
def test_fqn_keyed_optimizer_names(case):
    optim = case.ckpt.group("optimizer")
    assert {t.param for t in optim} == set(case.param_names)
    assert case.ckpt.param_order == case.param_names  # the order an int-keyed output numbers them
    assert {t.state for t in optim} == {"step", "exp_avg", "exp_avg_sq"}
    assert all(t.name == f"state.{t.param}.{t.state}" for t in optim)


def test_int_keyed_mapping_skips_float_buffers(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "bn.pt")
    ckpt = formats.describe(tmp_path / "bn.pt")
    names = [n for n, _ in model.named_parameters()]
    assert {t.param for t in ckpt.group("optimizer")} == set(names)
    shapes = {t.name: t.shape for t in ckpt.group("model")}
    assert all(t.shape == shapes[t.param] for t in ckpt.group("optimizer") if t.state != "step")


class _UnusedFirst(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(2, 3)  # gets no gradient, so no optimizer state
        self.used = torch.nn.Linear(4, 5)

    def forward(self, x):
        return self.used(x)


def test_dcp_param_order_keeps_parameters_without_state(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _UnusedFirst()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    # optimizer.state_dict() numbers every parameter of param_groups, stateless or not
    assert formats.describe(tmp_path / "dcp").param_order == tuple(osd["param_groups"][0]["params"])


def _save_dcp(state: dict, path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def test_dcp_of_a_plain_model_state_dict(tmp_path, tiny_llama):
    sd = tiny_llama().state_dict()
    _save_dcp(sd, tmp_path / "dcp")
    ckpt = formats.describe(tmp_path / "dcp")
    assert {t.key for t in ckpt.tensors} == {("model", k) for k in sd}


def test_dcp_torchtitan_layout(tmp_path):
    """torchtitan: model keys at top level, get_optimizer_state_dict(flatten_optimizer_state_dict=True)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(0)
    model = TinyLM()  # torchtitan's own models have no "model." prefix either
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 101, (2, 8))).backward()
    opt.step()
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    _save_dcp({**model.state_dict(), "optimizer": osd, "train_state": {"step": 1}}, tmp_path / "titan")
    ckpt = formats.describe(tmp_path / "titan")
    names = tuple(n for n, _ in model.named_parameters())
    assert {t.name for t in ckpt.group("model")} == set(model.state_dict())
    optim = ckpt.group("optimizer")
    assert len(optim) == 3 * len(names)
    assert {t.param for t in optim} == set(names) and {t.state for t in optim} == {"step", "exp_avg", "exp_avg_sq"}
    assert ckpt.param_order == names


# -- non-tensor state through Reader.object ----------------------------------------------------

SCHEDULER = {"start_factor": 0.5, "end_factor": 1.0, "total_iters": 4, "base_lrs": [0.001], "last_epoch": 3,
             "_step_count": 4, "_is_initial": False, "_get_lr_called_within_step": False, "_last_lr": [0.000875]}


@pytest.mark.parametrize("case", ["llama_torch_training.pt", "llama_sharded_ws2", "llama_tied_sharded_ws2"],
                         indirect=True)
def test_scheduler_state_object(case):
    objs = [o for o in case.ckpt.objects if o.name == "lr_scheduler"]
    assert objs
    with Reader(case.ckpt) as r:
        values = [r.object(o) for o in objs]
    for v in values:
        assert v.keys() == SCHEDULER.keys()
        assert all(v[k] == pytest.approx(SCHEDULER[k]) for k in SCHEDULER), v


def test_dcp_scheduler_entries(tmp_path_factory):
    ckpt = get_case("llama_dcp", tmp_path_factory).ckpt
    objs = {o.path[1:]: o for o in ckpt.objects if o.path and o.path[0] == "lr_scheduler"}
    with Reader(ckpt) as r:
        assert r.object(objs[("last_epoch",)]) == 3
        assert r.object(objs[("total_iters",)]) == 4


@pytest.mark.parametrize("case", ["llama_sharded_ws2", "llama_torch_training.pt", "llama_dcp"], indirect=True)
def test_optimizer_param_groups_object(case):
    groups = [o for o in case.ckpt.objects if o.group == "optimizer" and o.path[:2] == ("optimizer", "param_groups")]
    assert groups
    with Reader(case.ckpt) as r:
        values = {o.path: r.object(o) for o in groups}
    if len(values) == 1:  # the list of param_groups as one object
        (value,) = values.values()
        lr = value[0]["lr"]
    else:  # DCP flattens it: ("optimizer", "param_groups", 0, "lr"), ...
        lr = values[("optimizer", "param_groups", 0, "lr")]
    assert lr == pytest.approx(0.000875)


def test_extra_state_is_per_rank(tmp_path_factory):
    ckpt = get_case("llama_sharded_ws2", tmp_path_factory).ckpt
    rng = sorted((o for o in ckpt.objects if o.name == "rng"), key=lambda o: o.rank)
    assert [o.rank for o in rng] == [0, 1]
    with Reader(ckpt) as r:
        a, b = (r.object(o) for o in rng)
    assert a["random"] != b["random"]  # seeded 0 + rank


# -- Reader details ----------------------------------------------------------------------------

def test_reader_chunk_is_rank_local_shard(tmp_path_factory):
    ckpt = get_case("llama_sharded_ws2", tmp_path_factory).ckpt
    t = ckpt.tensor_map()[("model", "model.embed_tokens.weight")]
    with Reader(ckpt) as r:
        for c in t.chunks:
            local = load(ckpt.path_of(c.location))["model.embed_tokens.weight"].to_local()
            assert same_bits(r.chunk(t, c), local)
    assert Counter(c.sizes[0] for c in t.chunks) == Counter([51, 50])


def test_reader_refuses_item_past_end_of_truncated_distcp(tmp_path):
    d = tmp_path / "dcp"
    shutil.copytree(FIXTURES / "llama_dcp", d)
    ckpt = formats.describe(d)
    f = d / "__1_0.distcp"
    os.truncate(f, f.stat().st_size // 2)
    late = max((t for t in ckpt.tensors for c in t.chunks if c.location.file == "__1_0.distcp"),
               key=lambda t: max(c.location.offset for c in t.chunks if c.location.file == "__1_0.distcp"))
    with Reader(ckpt) as r, pytest.raises(BadInput, match="__1_0.distcp"):
        r.full(late)


def test_total_bytes_is_logical_not_on_disk(tmp_path_factory):
    case = get_case("llama_sharded_ws8", tmp_path_factory)
    assert case.ckpt.total_bytes == sum(nbytes(v) for v in case.expected.values())
    assert case.ckpt.total_bytes == 25056 * 4 * 3 + 21 * 4  # params, exp_avg, exp_avg_sq + 21 steps
    assert math.prod(case.ckpt.tensor_map()[("model", "lm_head.weight")].shape) == 101 * 32


class _GetattrPayload:
    """Pickles as ``getattr(torch.Size, "__init__")``: the only getattr a checkpoint may use is
    FSDP1's ShardedTensor.ProcessGroupState, so any other lookup is refused."""

    def __reduce__(self):
        return (getattr, (torch.Size, "__init__"))


def test_getattr_in_a_pickle_reaches_nothing_else(tmp_path):
    from ckpt_tools.errors import BadInput

    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": _GetattrPayload()}, path)
    with pytest.raises(BadInput, match="getattr"):
        formats.describe(path)
