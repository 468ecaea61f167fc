"""Casts streamed block by block (``castio``): the same bytes as torch's cast of the whole
tensor, for every pair of float dtypes, across source parts and block edges; and the writers
that take them (hf, native DCP, sharded) write what torch's casting path writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpt_tools
from ckpt_tools.castio import CastSpan, blocks
from ckpt_tools.dtypes import DType

FLOATS = ["float32", "bfloat16", "float16", "float64"]


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
def test_blocks_equal_a_whole_cast(tmp_path, src, dst):
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(1001, generator=g) * 1e3).to(getattr(torch, src))
    b = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e-40, -0.0, 65504.0, 7e4], dtype=getattr(torch, src))
    path = tmp_path / "raw"
    path.write_bytes(b"xyz" + a.view(torch.uint8).numpy().tobytes() + b.view(torch.uint8).numpy().tobytes())
    size = a.element_size()
    parts = ((path, 3, a.numel() * size), (path, 3 + a.numel() * size, b.numel() * size))
    got = b"".join(bytes(x) for x in blocks(CastSpan(parts, DType(src), DType(dst)), block=97))
    want = torch.cat([a, b]).to(getattr(torch, dst))
    got_t = torch.frombuffer(bytearray(got), dtype=want.dtype)
    nan = want.isnan()
    # bit for bit, except NaN: torch's vector and scalar conversion loops (which one runs depends
    # on where an element falls in a block) may give a NaN another sign or payload
    assert torch.equal(got_t.isnan(), nan)
    assert got_t[~nan].view(torch.uint8).numpy().tobytes() == want[~nan].view(torch.uint8).numpy().tobytes()


def test_export_cast_is_torchs(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    state = {"model.w": torch.randn(37, 11, generator=g), "model.b": torch.randn(5, generator=g),
             "model.i": torch.arange(4)}
    save_file(state, src / "model.safetensors")
    ckpt_tools.convert(src, tmp_path / "dcp", to="dcp", world_size=3, progress=False)
    ckpt_tools.export(tmp_path / "dcp", tmp_path / "out", dtype="fp16", progress=False)
    got = load_file(tmp_path / "out" / "model.safetensors")
    for k, v in state.items():
        want = v.half() if v.is_floating_point() else v
        assert got[k].dtype == want.dtype and torch.equal(got[k], want), k


def test_sharded_cast_from_dcp_is_torchs(tmp_path):
    from ckpt_tools.formats import shardsynth

    fix = Path(__file__).resolve().parents[1] / "fixtures" / "llama_dcp"
    ckpt_tools.convert(fix, tmp_path / "a", to="sharded", world_size=2, dtype="bf16", progress=False)
    real = shardsynth.available
    shardsynth.available = lambda: False
    try:
        ckpt_tools.convert(fix, tmp_path / "b", to="sharded", world_size=2, dtype="bf16", progress=False)
    finally:
        shardsynth.available = real
    for f in sorted((tmp_path / "b").glob("model_*.pt")):
        a = torch.load(tmp_path / "a" / f.name, weights_only=True)
        b = torch.load(f, weights_only=True)
        assert list(a) == list(b)
        for k in a:
            assert a[k].dtype == torch.bfloat16 and torch.equal(a[k]._local_tensor, b[k]._local_tensor), k
