"""Several processes writing one plan: ``--workers K`` and a ``torchrun`` launch give the same
bytes as one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ckpt_tools

ROOT = Path(__file__).resolve().parents[1]


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def single(fixtures_dir: Path, tmp_path_factory) -> dict[str, dict[str, bytes]]:
    out = {}
    for name in ("llama_sharded_ws8", "llama_dcp"):
        dst = tmp_path_factory.mktemp("single") / name
        ckpt_tools.reshard(fixtures_dir / name, dst, to=3, progress=False)
        out[name] = _files(dst)
    return out


@pytest.mark.parametrize("name", ["llama_sharded_ws8", "llama_dcp"])
def test_workers_write_the_same_bytes(name: str, fixtures_dir: Path, tmp_path: Path, single) -> None:
    dst = tmp_path / "out"
    ckpt_tools.reshard(fixtures_dir / name, dst, to=3, workers=2, progress=False)
    got = _files(dst)
    assert got.keys() == single[name].keys()
    assert [k for k in got if got[k] != single[name][k]] == []


def test_torchrun_processes_write_their_share(fixtures_dir: Path, tmp_path: Path, single) -> None:
    dst = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "ckpt_tools", "reshard", str(fixtures_dir / "llama_sharded_ws8"), str(dst), "--to", "3", "--quiet"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = _files(dst)
    assert got.keys() == single["llama_sharded_ws8"].keys()
    assert [k for k in got if got[k] != single["llama_sharded_ws8"][k]] == []
    assert not [p for p in tmp_path.iterdir() if ".ckpt-tmp-" in p.name], "staging left behind"


def test_torchrun_refuses_existing_destination_on_every_process(fixtures_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    dst.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "ckpt_tools", "reshard", str(fixtures_dir / "llama_sharded_ws8"), str(dst), "--to", "3", "--quiet"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode != 0
    # torchrun stops the other process once one fails, so it may or may not get to print its own
    # refusal; either way no process got past the check: nothing written, no staging left
    assert proc.stderr.count("error: ") >= 1 and "exists" in proc.stderr
    assert list(dst.iterdir()) == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
