"""Sharded (verl) files built from a plan without torch (``formats/shardsynth.py``), for sources
with no rank files to rebuild (DCP, safetensors): every zip record but the serialization id
byte-identical to what the torch path writes (the pickle included), no torch imported, and
``torch.load(weights_only=True)`` reading the same values. (The multi-rank resume of such
output is exercised by test_reshard's dcp-to-sharded case and test_convert's sharded runs.)
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # noqa: F401 - DTensor & co. become safe globals

import ckpt_tools
from ckpt_tools.formats import shardsynth

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "fixtures"


def _records(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n.split("/", 1)[1]: z.read(n) for n in z.namelist() if not n.endswith(".data/serialization_id")}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """(source, world size) -> (synthesized output, torch path output)."""
    root = tmp_path_factory.mktemp("synth")
    out = {}
    for name, ws, layout in CASES:
        a = root / f"{name}_{ws}_{layout}_synth"
        ckpt_tools.convert(FIX / name, a, to="sharded", world_size=ws, layout=layout, progress=False)
        out[(name, ws, layout)] = [a]
    real = shardsynth.available
    shardsynth.available = lambda: False
    try:
        for name, ws, layout in CASES:
            b = root / f"{name}_{ws}_{layout}_torch"
            ckpt_tools.convert(FIX / name, b, to="sharded", world_size=ws, layout=layout, progress=False)
            out[(name, ws, layout)].append(b)
    finally:
        shardsynth.available = real
    return out


# (source, world size, layout): "verl" names the mesh ("fsdp",) as verl's jobs do
CASES = [("llama_dcp", 3, None), ("llama_dcp", 2, None), ("llama_hf", 4, None), ("llama_dcp", 2, "verl")]
IDS = lambda c: f"{c[0]}-ws{c[1]}" + (f"-{c[2]}" if c[2] else "")  # noqa: E731


def test_verl_layout_names_the_mesh(outputs):
    for case in CASES:
        for out in outputs[case]:
            dt = torch.load(out / f"model_world_size_{case[1]}_rank_0.pt", weights_only=True)["model.norm.weight"]
            assert dt.device_mesh.mesh_dim_names == (("fsdp",) if case[2] == "verl" else None), (case, out)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_records_are_the_torch_paths(outputs, case):
    synth, torch_path = outputs[case]
    names = sorted(p.name for p in torch_path.iterdir())
    assert sorted(p.name for p in synth.iterdir()) == names
    for name in names:
        if name.endswith(".pt"):
            assert _records(synth / name) == _records(torch_path / name), name


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_torch_load_reads_the_same(outputs, case):
    synth, torch_path = outputs[case]
    for f in sorted(torch_path.glob("*.pt")):
        a = torch.load(synth / f.name, weights_only=True)
        b = torch.load(f, weights_only=True)
        _same(a, b, f.name)


def _same(a, b, where: str) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor):
        assert isinstance(b, DTensor) and a.placements == b.placements and a.shape == b.shape, where
        assert torch.equal(a._local_tensor, b._local_tensor), where
        assert a.device_mesh.mesh.tolist() == b.device_mesh.mesh.tolist(), where
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def test_dcp_to_sharded_imports_no_torch(tmp_path):
    code = ("import sys, ckpt_tools; "
            f"ckpt_tools.convert({str(FIX / 'llama_dcp')!r}, {str(tmp_path / 'a')!r}, to='sharded', world_size=3, "
            "progress=False); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_one_rank_takes_the_torch_path(tmp_path):
    """A one-device mesh pickles differently: written by torch, and still loads."""
    ckpt_tools.convert(FIX / "llama_dcp", tmp_path / "ws1", to="sharded", world_size=1, progress=False)
    sd = torch.load(tmp_path / "ws1" / "model_world_size_1_rank_0.pt", weights_only=True)
    assert sd and all(v.device_mesh.size() == 1 for v in sd.values() if hasattr(v, "device_mesh"))


def test_verl_layout_only_where_it_names_a_mesh(tmp_path):
    """--layout verl names the mesh of files built from another format; rank files keep their
    own, and no other format has one. Refused before anything is written."""
    from ckpt_tools.errors import UsageError

    for src, to in (("llama_sharded_ws2", "sharded"), ("llama_dcp", "dcp"), ("llama_dcp", "torch")):
        with pytest.raises(UsageError):
            ckpt_tools.convert(FIX / src, tmp_path / "out", to=to, layout="verl", progress=False)
        assert not (tmp_path / "out").exists()


def test_unnamed_mesh_is_said(tmp_path, capfd):
    ckpt_tools.convert(FIX / "llama_dcp", tmp_path / "plain", to="sharded", world_size=2)
    assert "--layout verl" in capfd.readouterr().err
    ckpt_tools.convert(FIX / "llama_dcp", tmp_path / "verl", to="sharded", world_size=2, layout="verl")
    assert "--layout verl" not in capfd.readouterr().err


@pytest.mark.parametrize("to", [1, 3])
def test_reshard_keeps_the_mesh_names(tmp_path, to):
    """A reshard keeps the source's mesh names, also at one rank (written by torch's writer)."""
    src = tmp_path / "verl"
    ckpt_tools.convert(FIX / "llama_dcp", src, to="sharded", world_size=2, layout="verl", progress=False)
    for source, names in ((src, ("fsdp",)), (FIX / "llama_sharded_ws2", None)):
        dst = tmp_path / f"out_{names}"
        ckpt_tools.reshard(source, dst, to=to, progress=False)
        dt = torch.load(dst / f"model_world_size_{to}_rank_0.pt", weights_only=True)["model.norm.weight"]
        assert dt.device_mesh.mesh_dim_names == names, source
