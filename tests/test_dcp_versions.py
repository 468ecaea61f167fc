"""DCP ``.metadata`` from every torch ckpt supports is read, and a newer torch's is named as such.

``fixtures/dcp_torch214`` and ``fixtures/dcp_torch215`` were written by the real torch 2.14.1
and 2.15.0 (fixtures/make_dcp_versions.py; torch 2.15 pickles TensorProperties with a sixth
field, ``strides``). Each is read element for element, converted, and what ckpt writes from it
loads with ``dcp.load`` of the installed torch. A form no supported torch writes is exit 3
saying "written by a newer torch", never "corrupt".
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckpt_tools
from ckpt_tools.cli.main import main as cli
from ckpt_tools.codecs import metapickle

FIX = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIX))
from make_dcp_versions import expected  # noqa: E402

SAVED_BY = ["dcp_torch214", "dcp_torch215"]


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.parametrize("fixture", SAVED_BY)
def test_a_dcp_saved_by_that_torch_is_read_exactly(tmp_path, fixture):
    info = ckpt_tools.inspect(FIX / fixture, tensors=True)
    assert info["format"] == "dcp"
    r = _cli("verify", FIX / fixture)
    assert r.exit_code == 0, r.output
    ckpt_tools.convert(FIX / fixture, tmp_path / "out.pt", to="torch", progress=False)
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    want = expected()
    assert got["step"] == want["step"]
    assert got["model"].keys() == want["model"].keys()
    for name, value in want["model"].items():
        assert got["model"][name].dtype == value.dtype, name
        assert torch.equal(got["model"][name], value), name  # the transposed one too


@pytest.mark.parametrize("fixture", SAVED_BY)
def test_what_ckpt_writes_from_it_loads_with_dcp_load(tmp_path, fixture):
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "dcp"
    ckpt_tools.convert(FIX / fixture, out, to="dcp", progress=False)
    want = expected()
    state = {"model": {k: torch.empty_like(v.contiguous()) for k, v in want["model"].items()}, "step": 0}
    dcp.load(state, checkpoint_id=str(out))
    assert state["step"] == 7
    for name, value in want["model"].items():
        assert torch.equal(state["model"][name], value), name


def _newer_metadata(tmp_path: Path, monkeypatch, state) -> Path:
    """A DCP whose TensorProperties pickle ``state`` (as a future torch might): written through
    ckpt's own DCP writer with the field list changed."""
    monkeypatch.setattr(metapickle.TensorProperties, "__getstate__", lambda self: state(self))
    out = tmp_path / "newer"
    ckpt_tools.convert(FIX / "dcp_torch215", out, to="dcp", progress=False)
    return out


@pytest.mark.parametrize("state", [
    lambda p: (p.dtype, metapickle.STRIDED, False, metapickle.CONTIGUOUS, False, None, "a seventh field"),
    lambda p: {"dtype": p.dtype, "strides": None},
], ids=["seven-fields", "a-dict"])
def test_a_newer_torchs_tensor_properties_say_so(tmp_path, monkeypatch, state):
    src = _newer_metadata(tmp_path, monkeypatch, state)
    monkeypatch.undo()
    for args in (["inspect", src], ["export", src, tmp_path / "hf"], ["verify", src]):
        r = _cli(*args)
        assert r.exit_code == 3, r.output
        assert "written by a newer torch" in r.output and "TensorProperties" in r.output, r.output
        assert "corrupt" not in r.output, r.output


def test_a_dcp_class_no_supported_torch_pickles_is_a_newer_torchs(tmp_path):
    """A class name in torch.distributed.checkpoint that ckpt does not know: refused (nothing
    of it runs), as a newer torch's, not as corrupt."""
    src = tmp_path / "dcp"
    src.mkdir()
    for f in (FIX / "dcp_torch215").iterdir():
        data = f.read_bytes()
        if f.name == ".metadata":
            assert data.count(b"BytesStorageMetadata") == 1
            data = data.replace(b"BytesStorageMetadata", b"BytesStorageMetadatX")  # same length: a valid pickle
        (src / f.name).write_bytes(data)
    r = _cli("inspect", src)
    assert r.exit_code == 3, r.output
    assert "written by a newer torch" in r.output and "BytesStorageMetadatX" in r.output, r.output


def test_strides_that_are_not_integers_are_corrupt(tmp_path, monkeypatch):
    src = _newer_metadata(tmp_path, monkeypatch,
                          lambda p: (p.dtype, metapickle.STRIDED, False, metapickle.CONTIGUOUS, False, "x"))
    monkeypatch.undo()
    r = _cli("inspect", src)
    assert r.exit_code == 3 and "corrupt" in r.output and "newer torch" not in r.output, r.output
