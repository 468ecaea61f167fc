"""The module attributes that tests patch to force a fallback are the ones the code calls at run
time: a patch on a name the code no longer reads (after a module moved) would test nothing.
Each attribute is wrapped with a recorder that calls through, and a command that needs it is run."""

from __future__ import annotations

from pathlib import Path

import pytest

import ckpt_tools
from ckpt_tools.formats import dcpnative, shardtree, torchnative
from ckpt_tools.security import safeload

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _recording(monkeypatch, module, name: str) -> list:
    calls: list = []
    real = getattr(module, name)

    def recorder(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, recorder)
    return calls


@pytest.mark.parametrize("module,name,run", [
    (dcpnative, "native_writer",
     lambda tmp: ckpt_tools.convert(FIXTURES / "llama_hf", tmp / "out", to="dcp", world_size=2, progress=False)),
    (torchnative, "native_writer",
     lambda tmp: ckpt_tools.convert(FIXTURES / "llama_sharded_ws2", tmp / "out.pt", to="torch", progress=False)),
    (safeload, "load_torch",
     lambda tmp: ckpt_tools.convert(FIXTURES / "llama_torch_training.pt", tmp / "out", to="dcp", progress=False)),
    (shardtree, "dtensor_of",
     lambda tmp: ckpt_tools.reshard(FIXTURES / "llama_sharded_ws2", tmp / "out", to=1, progress=False)),
], ids=["dcpnative.native_writer", "torchnative.native_writer", "safeload.load_torch", "shardtree.dtensor_of"])
def test_a_patch_reaches_the_code(tmp_path, monkeypatch, module, name, run):
    shardtree._parsed.cache_clear()  # a tree parsed by an earlier test would skip the describe
    calls = _recording(monkeypatch, module, name)
    run(tmp_path)
    assert calls, f"{module.__name__}.{name} was patched but never called"
