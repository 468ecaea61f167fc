"""``verify`` of one checkpoint at the speed of reading its bytes once: files hashed in parallel,
chunks whose bytes the checksums cover and items whose pickles read as inert trees checked
without importing torch; anything else still goes through torch's loader (test_verify,
test_hostile and test_faults check that damage and unsafe content are still found)."""

from __future__ import annotations

import json
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
