"""Ctrl-C, as a terminal sends it (SIGINT to the whole process group), at any moment of a run:
one ``error:`` line that says what DST holds afterwards, exit 130, no traceback from any
process, nothing left beside DST that the message does not name.

Runs ``python -m ckpt_tools`` in a session of its own, on a ~200 MB sharded source.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist import terminal_sigint
import torch

import ckpt_tools
from ckpt_tools.storage.atomic import TMP_MARK

LAYERS = 48  # 48 x 1024 x 1024 float32 = 192 MiB


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> dict[str, Path]:
    """A ~200 MB sharded source at 2 ranks, and the old DST: the same resharded to 3 ranks (its
    file names tell it from the new one, at 4 ranks)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("interrupts")
    g = torch.Generator().manual_seed(0)
    save_file({f"model.layers.{i}.mlp.weight": torch.randn(1024, 1024, generator=g) for i in range(LAYERS)},
              str(root / "model.safetensors"))
    ckpt_tools.convert(root / "model.safetensors", root / "src", to="sharded", world_size=2, progress=False)
    (root / "model.safetensors").unlink()
    ckpt_tools.reshard(root / "src", root / "old", to=3, progress=False)
    return {"src": root / "src", "old": root / "old"}


def _start(*args: str, log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "ckpt_tools", *args], stdout=subprocess.DEVNULL,
                                stderr=f, start_new_session=True, preexec_fn=terminal_sigint)


def _ctrl_c(proc: subprocess.Popen) -> None:
    """What the terminal does: SIGINT to every process of the foreground group."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except ProcessLookupError:
        pass


def _beside(dst: Path) -> list[Path]:
    return sorted(p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}{TMP_MARK}"))


def _holds(dst: Path) -> str:
    if not dst.exists():
        return "nothing"
    names = {p.name for p in dst.iterdir()}
    if "model_world_size_4_rank_0.pt" in names:
        report = ckpt_tools.verify(dst, progress=False)
        assert report["ok"], f"{dst} holds a damaged new checkpoint: {report}"
        return "new"
    assert "model_world_size_3_rank_0.pt" in names, names
    return "old"


def _check_outcome(proc: subprocess.Popen, log: Path, dst: Path) -> str:
    rc = proc.wait(timeout=120)
    text = log.read_text(errors="replace")
    holds = _holds(dst)
    left = _beside(dst)
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    if rc == 0:
        assert holds == "new" and not left, (holds, left, text)
        return "finished"
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert rc == 130 and len(errors) == 1, (rc, text)
    line = errors[0]
    if holds == "new":
        assert "holds the new" in line, line
    else:
        assert holds == "old" and "left as it was" in line and "holds the new" not in line, (holds, line)
    for p in left:  # whatever is left beside DST is named, with how to remove it
        assert p.name in line and "ckpt clean" in line, (p, line)
    return holds


def _fresh_old(big: dict[str, Path], tmp_path: Path, clutter: int = 0) -> Path:
    dst = tmp_path / "dst"
    shutil.copytree(big["old"], dst)
    for i in range(clutter):  # files that make removing the old copy take a while
        (dst / f"note_{i}.json").write_text("{}")  # checkpoint-named: --overwrite replaces only those
    return dst


def _reshard(big, dst, log, *extra):
    return _start("reshard", str(big["src"]), str(dst), "--to", "4", "--overwrite", *extra, log=log)


@pytest.fixture(scope="module")
def run_seconds(big, tmp_path_factory) -> float:
    """How long an uninterrupted ``reshard --overwrite`` takes here."""
    tmp = tmp_path_factory.mktemp("timing")
    dst = _fresh_old(big, tmp)
    t = time.monotonic()
    proc = _reshard(big, dst, tmp / "log")
    assert proc.wait(timeout=120) == 0, (tmp / "log").read_text()
    return time.monotonic() - t


@pytest.mark.parametrize("fraction", [0.15, 0.35, 0.55, 0.75, 0.95])
def test_ctrl_c_swept_over_an_overwrite(big, run_seconds, tmp_path, fraction):
    dst = _fresh_old(big, tmp_path)
    proc = _reshard(big, dst, tmp_path / "log")
    time.sleep(run_seconds * fraction)
    _ctrl_c(proc)
    _check_outcome(proc, tmp_path / "log", dst)


def _children(pid: int) -> list[str]:
    """The child processes of every thread of ``pid``."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += (task / "children").read_text().split()
        except OSError:
            pass
    return out


def _until_interrupted(attempt, tries: int = 3) -> str:
    """``attempt()`` again when its Ctrl-C came only after the run had finished: a test process
    kept off the CPU for a moment can send it late, and then there is nothing to interrupt."""
    for _ in range(tries):
        outcome = attempt()
        if outcome != "finished":
            return outcome
    return outcome


def test_ctrl_c_during_the_swap(big, tmp_path):
    """The moment the issue met: DST already the new checkpoint, the old one moved aside and
    being removed. The old copy holds many small files, so that removal takes a while."""
    def attempt(n=iter(range(10))):
        run = tmp_path / f"run{next(n)}"
        run.mkdir()
        dst = _fresh_old(big, run, clutter=3000)
        proc = _reshard(big, dst, run / "log")
        seen = False
        while proc.poll() is None:
            if any(f"{TMP_MARK}old-" in name for name in os.listdir(run)):
                _ctrl_c(proc)
                seen = True
                break
            time.sleep(0.0005)
        outcome = _check_outcome(proc, run / "log", dst)
        assert seen or outcome == "finished", outcome
        return outcome

    assert _until_interrupted(attempt) == "new"


def test_ctrl_c_while_workers_start(big, tmp_path):
    def attempt(n=iter(range(10))):
        run = tmp_path / f"run{next(n)}"
        run.mkdir()
        dst = _fresh_old(big, run)
        proc = _reshard(big, dst, run / "log", "--workers", "2")
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline and not _children(proc.pid):
            time.sleep(0.002)
        time.sleep(0.05)  # the workers are importing
        _ctrl_c(proc)
        return _check_outcome(proc, run / "log", dst)

    assert _until_interrupted(attempt) == "old"


@pytest.fixture(scope="module")
def startup_seconds() -> float:
    """How long Python itself takes here to start and reach the program's first module (under
    load this varies; a signal before that moment is the interpreter's, not the program's)."""
    best = float("inf")
    for _ in range(3):
        t = time.monotonic()
        subprocess.run([sys.executable, "-c", "import ckpt_tools.cli.entry"], check=True)
        best = min(best, time.monotonic() - t)
    return best


@pytest.mark.parametrize("factor", [1.5, 2.5, 4.0])
def test_ctrl_c_while_the_program_loads(tmp_path, startup_seconds, factor):
    """Before the command has even imported its modules: one line, exit 130, no traceback."""
    log = tmp_path / "log"
    proc = _start("estimate", "fixtures/llama_hf", "--ranks", "2", log=log)
    time.sleep(startup_seconds * factor)
    _ctrl_c(proc)
    rc = proc.wait(timeout=60)
    text = log.read_text(errors="replace")
    if rc == 0:
        pytest.skip("finished before the signal")
    assert rc == 130 and "Traceback" not in text, text
    assert [line for line in text.splitlines() if line.strip()] == [text.strip()] and text.startswith("error: "), text


def test_ctrl_c_while_a_class_is_made_is_an_interrupt(tmp_path):
    """A Ctrl-C that lands in a descriptor's ``__set_name__`` while a module the command imports
    makes a class (Python 3.11 raises it as a RuntimeError from the KeyboardInterrupt) ends the
    command as any other interrupt: one line, exit 130, not an internal error."""
    script = (
        "import click\n"
        "from ckpt_tools.cli.main import command\n"
        "class Cut:\n"
        "    def __set_name__(self, owner, name):\n"
        "        raise KeyboardInterrupt\n"
        "@click.command()\n"
        "@command\n"
        "def cmd(progress):\n"
        "    class Layout:\n"
        "        fields = Cut()\n"
        "cmd(['--quiet'])\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 130, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "internal error" not in lines[0], proc.stderr
