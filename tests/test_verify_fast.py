"""``verify`` of one checkpoint at the speed of reading its bytes once: files hashed in parallel,
chunks whose bytes the checksums cover and items whose pickles read as inert trees checked
without importing torch; anything else still goes through torch's loader (test_verify,
test_hostile and test_faults check that damage and unsafe content are still found)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ckpt_tools

FIX = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.mark.parametrize("name", ["llama_sharded_ws8", "llama_dcp", "llama_hf_sharded"])
def test_verify_alone_reads_every_tensor_without_torch(name):
    code = ("import json, sys, ckpt_tools; "
            f"r = ckpt_tools.verify({str(FIX / name)!r}, progress=False); "
            "print(json.dumps([r['ok'], r['checked'], 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ok, checked, imported = json.loads(out.stdout)
    assert ok and not imported, out.stderr
    from ckpt_tools.formats import describe

    assert checked == len(describe(FIX / name).tensors)


def test_parallel_checksums_name_each_damaged_file(tmp_path):
    dst = tmp_path / "ws3"
    ckpt_tools.convert(FIX / "llama_dcp", dst, to="dcp", world_size=3, progress=False)
    for name in ("__0_0.distcp", "__2_0.distcp"):
        with open(dst / name, "r+b") as f:
            f.seek(200)
            byte = f.read(1)
            f.seek(200)
            f.write(bytes([byte[0] ^ 0xFF]))
    report = ckpt_tools.verify(dst, progress=False)
    assert not report["ok"]
    damaged = sorted(p for p in report["problems"] if "checksum mismatch" in p)
    assert len(damaged) == 2 and "__0_0.distcp" in damaged[0] and "__2_0.distcp" in damaged[1]


def test_verify_two_equal_checkpoints_compares_bytes_without_torch(tmp_path):
    """Equal stored bytes need no tensors: a sharded checkpoint against its 3-rank DCP."""
    ckpt_tools.convert(FIX / "llama_sharded_ws8", tmp_path / "dcp3", to="dcp", world_size=3, progress=False)
    code = ("import json, sys, ckpt_tools; "
            f"r = ckpt_tools.verify({str(FIX / 'llama_sharded_ws8')!r}, {str(tmp_path / 'dcp3')!r}, progress=False); "
            "print(json.dumps([r['ok'], r['checked'], 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ok, checked, imported = json.loads(out.stdout)
    assert ok and checked > 0 and not imported, out.stderr


def test_verify_two_checkpoints_still_counts_differences(tmp_path):
    import torch
    from safetensors.torch import save_file

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    w = torch.arange(40, dtype=torch.float32).reshape(8, 5)
    save_file({"w": w}, a / "model.safetensors")
    w2 = w.clone()
    w2[6, 1] = -1.0
    save_file({"w": w2}, b / "model.safetensors")
    report = ckpt_tools.verify(a, b, progress=False)
    assert not report["ok"] and report["mismatches"] == ["w"]
    assert report["differences"][0]["reason"].startswith("1 of 40 elements differ")


@pytest.mark.parametrize("n", [1, 7, 8, 4096, (1 << 20) + 3, 3 << 20])
def test_equal_bytes_finds_a_difference_anywhere(n):
    """The block comparison behind a bit-exact verify: words or bytes, any length, any step."""
    from ckpt_tools.commands.compare import _equal_bytes

    a = bytearray(os.urandom(n))
    assert _equal_bytes(memoryview(a), memoryview(bytes(a)), step=4096)
    for at in {0, n // 2, n - 1}:
        b = bytearray(a)
        b[at] ^= 0x40
        assert not _equal_bytes(memoryview(a), memoryview(b), step=4096), at
