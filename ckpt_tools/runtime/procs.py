"""Helper processes of our own: every rank of ``ckpt shard`` and every ``--workers`` writer is
``python -m ckpt_tools.runtime.child WORK/NAME``, never multiprocessing's ``spawn``; or, for
``--workers`` where it is safe (:func:`can_fork`), a fork of this process (:func:`fork`).

``spawn`` re-imports the caller's ``__main__`` in each child: a script without an
``if __name__ == "__main__":`` guard (the README's API block pasted into a file) ran again in
every rank, and each rank then failed with Python's "bootstrapping phase" RuntimeError. Here the
child runs a module of ours; the work (a function of ours, by reference, and its arguments)
travels in a file this process writes into a private directory of its own (``mkdtemp``, 0700),
the way multiprocessing sends it down a pipe, and the result comes back the same way.

Children start in a session of their own: a Ctrl-C at the terminal reaches this process alone,
which then stops them (:func:`stop`) and prints the one ``error:`` line; they never print a
traceback each. Each child dies with this process (:mod:`.lifeline`).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import private

# After a stop is asked (SIGTERM), how long a child gets to end on its own (one in the middle of
# a commit finishes it first, see storage/atomic.py) before it is killed.
STOP_GRACE_S = 10.0


@dataclass
class Child:
    name: str
    proc: subprocess.Popen | _Forked
    out: Path

    def outcome(self) -> tuple:
        """``("ok", value)`` or ``("error", exception, traceback text)``, as the child wrote it;
        ``("died", exit code)`` when it wrote nothing (a signal, out of memory)."""
        try:
            with private.open_read(self.out) as f:
                return private.load(f)  # written by our own child into our private directory
        except FileNotFoundError:
            return ("died", self.proc.returncode)


def start(fn: Callable[..., Any], args: Sequence[Any], *, work: Path, name: str,
          env: dict[str, str] | None = None, passes: Sequence[Callable[..., Any]] = ()) -> Child:
    """Run ``fn(*args)`` in a fresh ``python -m ckpt_tools.runtime.child``; ``fn`` must be a
    module-level function of an importable module (not of ``__main__``). ``work``: a private
    directory of the caller's; ``env``: variables to add to the child's environment;
    ``passes``: functions among ``args`` (outside ckpt_tools) the child may look up."""
    spec = work / f"{name}.in"
    with private.open_write(spec) as f:
        head = {"sys_path": list(sys.path), "parent": os.getpid(), "admit": private.names_of([fn, *passes])}
        f.write(json.dumps(head).encode() + b"\n")
        pickle.dump((fn, tuple(args)), f)
    child_env = {**os.environ, **(env or {})}
    root = str(Path(__file__).resolve().parents[2])  # the folder that holds ckpt_tools/
    if root not in _site_dirs():  # importable here only through sys.path: so it is in the child
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, child_env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tools.runtime.child", str(spec)], env=child_env,
                            stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    return Child(name, proc, work / f"{name}.out")


def can_fork() -> bool:
    """Whether :func:`fork` may be used now: on Linux, with this the process's only thread (a
    fork copies only the calling thread; a lock another held would stay held in the child) and
    torch not loaded (its thread pools do not survive a fork)."""
    return sys.platform.startswith("linux") and threading.active_count() == 1 and "torch" not in sys.modules


def fork(fn: Callable[..., Any], args: Sequence[Any], *, work: Path, name: str) -> Child:
    """Run ``fn(*args)`` in a forked copy of this process (see :func:`can_fork`): the arguments
    are this process's own objects, not pickled and read back (a 256-rank plan and description
    took longer to hand over than to write). The child reports as :func:`start`'s do, in a
    session of its own, tied to this process; it ends with ``os._exit``, so none of this
    process's pending cleanups (its staging directory's) ever run in it."""
    from .child import report
    from .lifeline import tie_to_parent  # (imported here: the child imports nothing)

    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # (else both would write what is buffered)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.setsid()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            tie_to_parent(parent)
            try:
                outcome: tuple = ("ok", fn(*args))
            except Exception as e:  # noqa: BLE001 - everything goes back to the parent
                outcome = ("error", e, traceback.format_exc())
            code = report(work / f"{name}.out", outcome)
        finally:
            os._exit(code)
    return Child(name, _Forked(pid), work / f"{name}.out")


class _Forked:
    """What this module asks of a :class:`subprocess.Popen`, for a forked child."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _site_dirs() -> set[str]:
    import site

    dirs = set(getattr(site, "getsitepackages", lambda: [])())
    dirs.add(getattr(site, "getusersitepackages", lambda: "")())
    return {str(Path(d).resolve()) for d in dirs if d}


def stop(children: Sequence[Child], grace: float = STOP_GRACE_S) -> None:
    """End the children still running: SIGTERM, up to ``grace`` seconds, then SIGKILL; waits."""
    alive = [c for c in children if c.proc.poll() is None]
    for c in alive:
        with _gone_ok():
            c.proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace
    for c in alive:
        try:
            c.proc.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            with _gone_ok():
                c.proc.kill()
            c.proc.wait()


def wait_any(children: Sequence[Child], poll: float = 0.02) -> Child | None:
    """The first child (of those still unreaped) to end, or None when all have been reaped."""
    while True:
        running = [c for c in children if c.proc.returncode is None]
        if not running:
            return None
        for c in running:
            if c.proc.poll() is not None:
                return c
        time.sleep(poll)


class _gone_ok:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        return kind is not None and issubclass(kind, ProcessLookupError)
