"""One ``torch.save`` file (``convert --to torch``) written without torch
(``formats/torchnative.py``): every zip record but the serialization id equal to the torch
path's, ``torch.load(weights_only=True)`` reading the same object, no torch imported."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import ckpt_tools
from ckpt_tools.formats import torchnative

FIX = Path(__file__).resolve().parents[1] / "fixtures"


def _records(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n.split("/", 1)[1]: z.read(n) for n in z.namelist() if not n.endswith(".data/serialization_id")}


def _same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    else:
        assert a == b, where


@pytest.mark.parametrize("dtype", [None, "bf16"], ids=["keep", "bf16"])
@pytest.mark.parametrize("source", ["llama_dcp", "llama_sharded_ws2", "llama_hf", "llama_sharded_ws8"])
def test_native_torch_file_is_the_torch_paths(tmp_path, monkeypatch, source, dtype):
    ckpt_tools.convert(FIX / source, tmp_path / "native.pt", to="torch", dtype=dtype, progress=False)
    assert zipfile.ZipFile(tmp_path / "native.pt").namelist()[0] == "archive/data.pkl"
    monkeypatch.setattr(torchnative, "native_writer", lambda *a, **k: None)
    ckpt_tools.convert(FIX / source, tmp_path / "torch.pt", to="torch", dtype=dtype, progress=False)
    assert _records(tmp_path / "native.pt") == _records(tmp_path / "torch.pt")
    # laid out as torch lays it out: the files differ only in the serialization id's 40 digits
    a, b = (tmp_path / "native.pt").read_bytes(), (tmp_path / "torch.pt").read_bytes()
    assert len(a) == len(b) and sum(x != y for x, y in zip(a, b)) <= 40 + 8
    _same(torch.load(tmp_path / "native.pt", weights_only=True), torch.load(tmp_path / "torch.pt", weights_only=True),
          source)


def test_dcp_to_torch_imports_no_torch(tmp_path):
    code = ("import sys, ckpt_tools; "
            f"ckpt_tools.convert({str(FIX / 'llama_dcp')!r}, {str(tmp_path / 'a.pt')!r}, to='torch', progress=False); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
