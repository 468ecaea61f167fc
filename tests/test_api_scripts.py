"""The Python API from a plain script, as a user pastes it: no ``if __name__ == "__main__":``
guard. Spawned ranks (``shard``) and ``--workers`` processes must never import the calling
script: its lines run once, no rank fails with Python's "bootstrapping phase" RuntimeError, and
no note about an interrupted run appears. The README's API block is run exactly as written
(only its ``/tmp/`` outputs moved under the test's folder)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run_script(text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "export_script.py"
    script.write_text(text)
    return subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=600)


def _assert_ran_once(proc: subprocess.CompletedProcess, *markers: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for marker in markers:
        assert proc.stdout.count(marker) == 1, f"{marker!r} printed {proc.stdout.count(marker)} times:\n{out}"
    assert "bootstrapping phase" not in out and "Traceback" not in out, out
    assert "interrupted" not in out, out


def test_unguarded_script_calls_shard_and_workers(tmp_path):
    text = f"""
import ckpt_tools
print("MARK-START")
ckpt_tools.shard("fixtures/llama_hf", r"{tmp_path / 'ckpt0'}", ranks=2, progress=False)
print("MARK-SHARDED")
ckpt_tools.reshard("fixtures/llama_sharded_ws8", r"{tmp_path / 'ws4'}", to=4, workers=2, progress=False)
print("MARK-RESHARDED")
"""
    proc = _run_script(text, tmp_path)
    _assert_ran_once(proc, "MARK-START", "MARK-SHARDED", "MARK-RESHARDED")
    assert ckpt_tools_verify(tmp_path / "ws4", REPO / "fixtures/llama_sharded_ws8")


def ckpt_tools_verify(a: Path, b: Path) -> bool:
    import ckpt_tools

    return ckpt_tools.verify(a, b, progress=False)["ok"]


def _readme_block(lang: str, after: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(after)
    m = re.compile(rf"```{lang}\n(.*?)```", re.S).search(text, start)
    return m.group(1)


def test_readme_api_block_as_written(tmp_path):
    block = _readme_block("python", "## Python API")
    assert "/tmp/api/" in block
    proc = _run_script("print('MARK-BEGIN')\n" + block.replace("/tmp/api/", f"{tmp_path}/api/")
                       + "print('MARK-END')\n", tmp_path)
    _assert_ran_once(proc, "MARK-BEGIN", "MARK-END")
    assert proc.stdout.splitlines()[-2].startswith("sharded True "), proc.stdout
    assert (tmp_path / "api" / "hf").is_dir() and not (tmp_path / "api" / "hf2").exists()  # the dry run wrote nothing
