"""DType: torch's dtypes by name, so describing and planning never import torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt_tools
from ckpt_tools.core.dtypes import DType, as_torch

NAMES = ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "complex64", "complex128",
         "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool"]


@pytest.mark.parametrize("name", NAMES)
def test_dtype_agrees_with_torch(name):
    d, t = DType(name), getattr(torch, name)
    assert d == t and t == d and not (d != t) and not (t != d)
    assert (d.itemsize, d.is_floating_point, d.is_complex) == (t.itemsize, t.is_floating_point, t.is_complex)
    assert as_torch(d) is t and d.torch is t and DType.of(t) == d
    assert str(d) == name and hash(d) == hash(name)


def test_dtype_aliases_and_unknowns():
    assert DType("float") == DType("torch.float32") == "float32"
    assert DType("half") != torch.float32 and DType("long") == torch.int64
    with pytest.raises(ValueError):
        DType("quint8")


FIXTURES = Path(__file__).parent.parent / "fixtures"


@pytest.mark.parametrize("source", ["model-only", "llama_dcp", "llama_accelerate"])
def test_export_of_a_dcp_does_not_import_torch(tmp_path, source):
    """Describing a DCP (its optimizer's param_groups items included), planning, and copying its
    items into safetensors need no torch (``convert --to hf``: these DCPs carry no config.json,
    which ``export`` refuses, and an export's architecture check imports transformers)."""
    if source == "model-only":
        src = tmp_path / "dcp"
        ckpt_tools.convert(FIXTURES / "llama_hf", src, to="dcp", world_size=3, progress=False)
    else:
        src = FIXTURES / source
    code = ("import sys, ckpt_tools; "
            f"ckpt_tools.convert({str(src)!r}, {str(tmp_path / 'hf')!r}, to='hf', progress=False); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    result = ckpt_tools.verify(src, tmp_path / "hf", progress=False)
    assert result["ok"] and result["checked"] == 21


def test_one_object_per_dtype():
    """Every spelling of a dtype gives the same object (plans compare dtypes by identity
    first, and find their facts by it), pickled or copied too; a subclass keeps its own."""
    import copy
    import pickle

    a = DType("float32")
    assert a is DType("torch.float32") is DType("float") is DType(torch.float32) is DType(a)
    assert pickle.loads(pickle.dumps(a)) is a and copy.deepcopy(a) is a
    assert DType("half") is DType("float16") is not a
    assert (a.itemsize, a.is_floating_point, DType("complex64").is_complex) == (4, True, True)

    class Named(DType):
        __slots__ = ()

    n = Named("bfloat16")
    assert type(n) is Named and n == DType("bfloat16") and n.itemsize == 2
