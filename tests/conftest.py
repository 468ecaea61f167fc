"""Shared test setup: import paths, the fixtures folder, a tiny Llama factory.

``tests/`` and ``fixtures/`` go on ``sys.path`` so that any test can ``from dist import run_ranks``
and ``from make_fixtures import tiny_llama_config, build_tokenizer`` (spawned ranks inherit it).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
FIXTURES_DIR = TESTS_DIR.parent / "fixtures"

for _p in (str(TESTS_DIR), str(FIXTURES_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# the architecture check's remembered answers (ckpt_tools.archcheck.known_good) go to a folder
# of this run, not the user's ~/.cache; subprocesses the tests start inherit it
_CACHE = tempfile.mkdtemp(prefix="ckpt-test-archcheck-")
os.environ["CKPT_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """The committed fixture checkpoints (see fixtures/README.md); never write into it."""
    return FIXTURES_DIR


@pytest.fixture(scope="session")
def tiny_llama():
    """Factory for the fixtures' tiny ``LlamaForCausalLM`` (vocab 101, hidden 32, 2 layers).

    ``tiny_llama(tied=False, seed=0, dtype=torch.float32)``; the same seed gives the same weights.
    """
    import torch

    def make(*, tied: bool = False, seed: int = 0, dtype=None):
        from make_fixtures import tiny_llama_config
        from transformers import LlamaForCausalLM

        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_llama_config(tied=tied))
        return model.to(dtype or torch.float32)

    return make


# Every process the suite starts carries this mark in its environment, so that any left behind
# (an orphan of a rank that ended with os._exit, a server a failed fixture did not stop) is found
# and ended when the session ends: none outlives the suite holding its output open.
_MARK = "CKPT_TEST_SESSION"
os.environ[_MARK] = f"{os.getpid()}-{os.urandom(4).hex()}"


def _marked_processes() -> list[int]:
    needle = f"{_MARK}={os.environ[_MARK]}".encode()
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone, or not ours to read
            continue
    return found


def pytest_sessionfinish(session, exitstatus):
    import signal
    import time

    left = {pid: _cmdline(pid) for pid in _marked_processes()}
    # this process's own multiprocessing resource tracker ends when it does (its pipe closes)
    left = {pid: cmd for pid, cmd in left.items()
            if not ("multiprocessing.resource_tracker" in cmd and _parent(pid) == os.getpid())}
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if left:
        time.sleep(0.2)
        listed = "; ".join(f"{pid} {cmd}" for pid, cmd in left.items())
        print(f"\nconftest: ended {len(left)} process(es) the suite left running: {listed}", file=sys.stderr)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
    except OSError:
        return "?"
