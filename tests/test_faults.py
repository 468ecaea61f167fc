"""What lands on disk when things go wrong: kill -9, Ctrl-C, SIGTERM, a full disk, an existing
or overlapping DST. DST is always absent, the old one, or complete; SRC is never touched.

Conversions run as ``python -m ckpt_tools convert`` subprocesses on a ~100 MB safetensors
checkpoint, so a signal can land while files are being written.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist import terminal_sigint
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import ckpt_tools
from ckpt_tools.storage.atomic import TMP_MARK
from ckpt_tools.cli.main import main
from ckpt_tools.commands.verify import verify

LAYERS = 24  # 24 x 1024 x 1024 float32 = 96 MiB


@pytest.fixture(scope="module")
def big_src(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("big") / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file({f"model.layers.{i}.mlp.weight": torch.randn(1024, 1024, generator=g) for i in range(LAYERS)},
              str(src / "model.safetensors"))
    return src


def _hashes(root: Path) -> dict[str, tuple[str, int]]:
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns) for p in files}


@pytest.fixture(scope="module")
def big_src_hashes(big_src: Path) -> dict:
    return _hashes(big_src)


@pytest.fixture
def src(big_src: Path, big_src_hashes: dict):
    """The big source; after the test, every file of it is byte-for-byte (and mtime) unchanged."""
    yield big_src
    assert _hashes(big_src) == big_src_hashes, "the source was modified"


def _dst(tmp_path: Path, to: str) -> Path:
    return tmp_path / ("out.pt" if to == "torch" else "out")


def _staging(dst: Path) -> list[Path]:
    return [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}{TMP_MARK}")]


def _start(src: Path, dst: Path, to: str, *extra: str) -> subprocess.Popen:
    """``python -m ckpt_tools convert``; stderr goes to a file beside DST (a pipe nobody reads
    could fill up and stall the run), read back with :func:`_stderr`."""
    with open(_log(dst), "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "ckpt_tools", "convert", str(src), str(dst), "--to", to, *extra],
                                stdout=subprocess.DEVNULL, stderr=log, preexec_fn=terminal_sigint)


def _log(dst: Path) -> Path:
    return dst.parent / f"{dst.name}.stderr"


def _stderr(dst: Path) -> str:
    return _log(dst).read_text(errors="replace")


def _absent_or_complete(src: Path, dst: Path) -> str:
    if not dst.exists():
        return "absent"
    report = verify(src, dst, progress=False)
    assert report["ok"], f"{dst} exists but is not complete: {report['problems'] or report['mismatches']}"
    assert report["checked"] == LAYERS
    return "complete"


# -- kill -9 --------------------------------------------------------------------------------

def _staged_bytes(dst: Path) -> int:
    total = 0
    for p in _staging(dst):
        try:
            files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
            total += sum(f.stat().st_size for f in files)
        except FileNotFoundError:  # renamed into place meanwhile
            pass
    return total


def _wait_for_bytes(proc: subprocess.Popen, dst: Path, n: int, timeout: float = 60) -> bool:
    """Block until ``n`` bytes are staged (True) or the process ends (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _staging(dst) and _staged_bytes(dst) >= n:
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.002)
    proc.kill()
    raise AssertionError("the conversion never wrote that much")


MiB = 1024 * 1024
# (format, when): seconds after the start (while importing), once that many bytes are
# staged (mid-write, by construction rather than by timing), or after a clean exit
KILLS = [("hf", "0.2s"), ("dcp", "1MiB"), ("torch", "32MiB"), ("sharded", "64MiB"), ("hf", "90MiB"),
         ("dcp", "done")]


@pytest.mark.parametrize("to, when", KILLS, ids=[f"{t}-{w}" for t, w in KILLS])
def test_kill_9_leaves_dst_absent_or_complete(to: str, when: str, src: Path, tmp_path: Path) -> None:
    dst = _dst(tmp_path, to)
    proc = _start(src, dst, to)
    if when == "done":
        assert proc.wait(timeout=120) == 0, _stderr(dst)
    else:
        if when.endswith("s"):
            time.sleep(float(when[:-1]))
        else:
            _wait_for_bytes(proc, dst, int(when.removesuffix("MiB")) * MiB)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    state = _absent_or_complete(src, dst)
    if when == "done":
        assert state == "complete" and not _staging(dst)
    elif when.endswith("MiB"):
        assert state == "absent"  # killed mid-write: nothing may show at DST
    if state == "absent":
        # the stale staging sibling of a killed run does not stand in the way of a re-run
        ckpt_tools.convert(src, dst, to=to, progress=False)
        assert _absent_or_complete(src, dst) == "complete"


# -- Ctrl-C and SIGTERM ---------------------------------------------------------------------



@pytest.mark.parametrize("sig, to", [(signal.SIGINT, "torch"), (signal.SIGTERM, "hf"), (signal.SIGTERM, "dcp")],
                         ids=["SIGINT-torch", "SIGTERM-hf", "SIGTERM-dcp"])
def test_interrupt_removes_staging_and_leaves_no_dst(sig: int, to: str, src: Path, tmp_path: Path) -> None:
    dst = _dst(tmp_path, to)
    proc = _start(src, dst, to)
    assert _wait_for_bytes(proc, dst, 16 * MiB)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    text = _stderr(dst)
    assert not dst.exists()
    assert not _staging(dst), "the temporary sibling was left behind"
    lines = [x for x in text.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in text, text
    assert proc.returncode == 130, text
    assert "interrupted" in lines[0]


# -- full disk ------------------------------------------------------------------------------

@contextlib.contextmanager
def _file_size_limit(limit: int):
    """Writes past ``limit`` bytes fail with EFBIG, as on a full disk (Python ignores SIGXFSZ,
    so the write returns the error instead of killing the process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))




@pytest.mark.parametrize("to", ["hf", "torch", "dcp", "sharded"])
def test_full_disk_exits_4_and_writes_nothing(to: str, src: Path, tmp_path: Path) -> None:
    dst = _dst(tmp_path, to)
    with _file_size_limit(16 * MiB):
        result = CliRunner().invoke(main, ["convert", str(src), str(dst), "--to", to, "--quiet"],
                                    catch_exceptions=False)
    assert not dst.exists()
    assert not _staging(dst)
    assert result.exit_code == 4, result.stderr
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "space" in result.stderr


# -- existing DST ---------------------------------------------------------------------------

@pytest.fixture
def old_dst(tmp_path: Path, fixtures_dir: Path) -> Path:
    """A complete, different checkpoint already at DST."""
    dst = tmp_path / "out"
    ckpt_tools.convert(fixtures_dir / "llama_hf", dst, to="hf", progress=False)
    return dst


def test_existing_dst_refused_without_overwrite(src: Path, old_dst: Path) -> None:
    before = _hashes(old_dst)
    result = CliRunner().invoke(main, ["convert", str(src), str(old_dst), "--to", "hf"], catch_exceptions=False)
    assert result.exit_code == 4
    assert result.stderr.startswith("error: ") and "--overwrite" in result.stderr
    assert _hashes(old_dst) == before
    assert not _staging(old_dst)


def test_existing_file_dst_refused_without_overwrite(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out.pt"
    dst.write_bytes(b"precious")
    result = CliRunner().invoke(main, ["convert", str(src), str(dst), "--to", "torch"], catch_exceptions=False)
    assert result.exit_code == 4
    assert dst.read_bytes() == b"precious"


def test_overwrite_replaces_when_complete(src: Path, old_dst: Path) -> None:
    ckpt_tools.convert(src, old_dst, to="hf", overwrite=True, progress=False)
    assert _absent_or_complete(src, old_dst) == "complete"
    assert not _staging(old_dst)


def test_overwrite_keeps_old_dst_until_new_is_complete(src: Path, old_dst: Path, fixtures_dir: Path) -> None:
    before = _hashes(old_dst)
    proc = _start(src, old_dst, "hf", "--overwrite")
    assert _wait_for_bytes(proc, old_dst, 32 * MiB)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert _hashes(old_dst) == before, "the old DST changed before the new one was complete"
    assert verify(fixtures_dir / "llama_hf", old_dst, progress=False)["ok"]


# -- DST overlapping SRC --------------------------------------------------------------------

def _overlap_cases():
    # name -> (src, dst, to), paths relative to a tmp dir holding src/ (a directory checkpoint)
    return {
        "dst-is-src": ("src", "src", "hf"),
        "dst-inside-src": ("src", "src/out", "hf"),
        "dst-contains-src": ("src", ".", "hf"),
        "dst-is-src-file": ("src/model.safetensors", "src/model.safetensors", "torch"),
        "dst-symlink-to-src": ("src", "link", "hf"),
        "dst-dir-holds-src-file": ("src/model.safetensors", "src", "hf"),
    }




@pytest.mark.parametrize("case", list(_overlap_cases()))
def test_dst_overlapping_src_is_refused(case: str, tmp_path: Path, fixtures_dir: Path) -> None:
    src_rel, dst_rel, to = _overlap_cases()[case]
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy2(fixtures_dir / "llama_hf" / "model.safetensors", _mkdir(work / "src") / "model.safetensors")
    (work / "link").symlink_to(work / "src")
    src, dst = work / src_rel, work / dst_rel
    before = _hashes(work / "src")
    result = CliRunner().invoke(main, ["convert", str(src), str(dst), "--to", to, "--overwrite"],
                                catch_exceptions=False)
    assert result.exit_code == 4, result.stderr
    assert result.stderr.startswith("error: ")
    assert (work / "src").is_dir() and _hashes(work / "src") == before


def _mkdir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    return d


# -- SRC untouched --------------------------------------------------------------------------

@pytest.mark.parametrize("to", ["hf", "torch", "dcp", "sharded"])
def test_source_never_modified(to: str, fixtures_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(fixtures_dir / "llama_sharded_ws2", src)
    before = _hashes(src)
    names = sorted(os.listdir(src))
    ckpt_tools.convert(src, _dst(tmp_path, to), to=to, progress=False)
    assert _hashes(src) == before
    assert sorted(os.listdir(src)) == names  # nothing added beside it either
