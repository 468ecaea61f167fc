"""Tiny multi-rank test harness: run a function on N CPU ranks with gloo.

Usage::

    from dist import run_ranks          # or: from tests.dist import run_ranks

    def _body(rank, world_size, x):     # must be module-level (picklable)
        t = torch.tensor([float(rank + x)])
        torch.distributed.all_reduce(t)
        return t.item()

    def test_sum(tmp_path):
        assert run_ranks(_body, 3, tmp_path, 1) == [6.0, 6.0, 6.0]

Each rank is a fresh process from the ``spawn`` start method, so ``fn``, its
arguments and its return value must be picklable, and ``fn``'s module must be
importable in the child (the child gets the parent's ``sys.path``).  Return
values travel back as pickle files under ``tmp_path``; return plain tensors /
Python data, not DTensors or process-group objects.

No dependency on ``torch.testing._internal``.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable

__all__ = ["run_ranks", "terminal_sigint"]

# Environment forced on the children (2-core machine, up to 8 ranks).
_CHILD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

# After the first rank fails, how long the others get to finish on their own
# before they are killed (they are usually stuck in a collective).
_GRACE_AFTER_FAILURE = 5.0


def _child(
    rank: int,
    world_size: int,
    init_method: str,
    result_dir: str,
    timeout: float,
    fn: Callable,
    args: tuple,
) -> None:
    result_file = os.path.join(result_dir, f"rank_{rank}.pkl")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=max(timeout, 1.0)),
        )
        try:
            payload = ("ok", fn(rank, world_size, *args), time.time())
        except BaseException:  # noqa: BLE001 - report everything to the parent
            # Time-stamped before teardown, which is what breaks the peers'
            # collectives, so the parent can list the root cause first.
            payload = ("error", traceback.format_exc(), time.time())
        # Never let teardown mask the real error or hang the rank.
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    except BaseException:  # noqa: BLE001 - e.g. init_process_group failed
        payload = ("error", traceback.format_exc(), time.time())
    tmp = result_file + ".tmp"
    try:
        with open(tmp, "wb") as f:
            pickle.dump(payload, f)
    except Exception:  # unpicklable return value
        with open(tmp, "wb") as f:
            pickle.dump(("error", traceback.format_exc(), time.time()), f)
    os.replace(tmp, result_file)
    _end_children()
    os._exit(0 if payload[0] == "ok" else 1)


def _end_children() -> None:
    """Stop what the rank's code started and left running (Megatron's save starts a
    multiprocessing Manager server per process): ``os._exit`` runs no finalizer, and an orphan
    would live on after the suite, holding its output open."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
    for child in multiprocessing.active_children():
        child.join(5)


def run_ranks(fn: Callable, world_size: int, tmp_path, *args: Any, timeout: float = 300) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned CPU processes.

    Every child sets single-threaded BLAS/OpenMP, calls
    ``torch.distributed.init_process_group('gloo', init_method='file://...')``
    (the rendezvous file is unique per call and lives under ``tmp_path``), runs
    ``fn``, then ``destroy_process_group()``.

    Returns the ranks' return values, ordered by rank.  If any rank raises (or
    dies, or the whole run exceeds ``timeout`` seconds), the remaining ranks are
    killed and a ``RuntimeError`` carrying the failing rank's traceback text is
    raised in the parent.
    """
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    call_dir = Path(tmp_path) / f"run_ranks_{uuid.uuid4().hex[:12]}"
    result_dir = call_dir / "results"
    result_dir.mkdir(parents=True)
    init_method = f"file://{(call_dir / 'rendezvous').resolve()}"

    ctx = mp.get_context("spawn")
    procs = []
    saved_env = {k: os.environ.get(k) for k in _CHILD_ENV}
    os.environ.update(_CHILD_ENV)  # spawn children copy the env at start time
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_child,
                args=(rank, world_size, init_method, str(result_dir), timeout, fn, args),
                name=f"run_ranks-{rank}",
                # not daemonic: fn may start its own workers (e.g. DataLoader);
                # the parent kills leftovers itself, see _kill_all.
            )
            p.start()
            procs.append(p)
    except BaseException:
        _kill_all(procs)
        raise
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    deadline = time.monotonic() + timeout
    first_failure_at = None
    timed_out = False
    try:
        while True:
            alive = [p for p in procs if p.is_alive()]
            if not alive:
                break
            now = time.monotonic()
            if first_failure_at is None and any(
                (not p.is_alive() and p.exitcode != 0) for p in procs
            ):
                first_failure_at = now
            if first_failure_at is not None and now - first_failure_at > _GRACE_AFTER_FAILURE:
                break
            if now > deadline:
                timed_out = True
                break
            alive[0].join(0.05)
    finally:
        killed = {rank for rank, p in enumerate(procs) if p.is_alive()}
        _kill_all(procs)

    results: list = [None] * world_size
    errors: list[tuple[float, str]] = []  # (when, text); sorted so the root cause comes first
    for rank, p in enumerate(procs):
        f = result_dir / f"rank_{rank}.pkl"
        if f.exists():
            with open(f, "rb") as fh:
                status, value, when = pickle.load(fh)
            if status == "ok":
                results[rank] = value
            else:
                errors.append((when, f"rank {rank} raised:\n{value}"))
        else:
            if rank not in killed:
                # Died on its own without reporting (os._exit, signal, OOM):
                # most likely the root cause, so list it first.
                errors.append((float("-inf"), f"rank {rank} died without a result (exit code {p.exitcode})"))
            else:
                why = "timeout" if timed_out else "another rank failed"
                errors.append((float("inf"), f"rank {rank} produced no result (killed: {why})"))

    if errors:
        # Silent deaths, then tracebacks in time order (the earliest is usually
        # the root cause, later ones are peers whose collectives broke), then
        # ranks we killed.
        errors.sort(key=lambda e: e[0])
        head = f"run_ranks({getattr(fn, '__qualname__', fn)!r}, world_size={world_size})"
        if timed_out:
            head += f" timed out after {timeout}s"
        raise RuntimeError(head + " failed:\n" + "\n".join(text for _, text in errors))
    return results


def _kill_all(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(10)


def terminal_sigint() -> None:
    """``preexec_fn`` for a program a test interrupts as a terminal would: SIGINT at its default,
    as in a shell's foreground job. A test suite started in the background of a non-interactive
    shell (``cmd &``) inherits SIGINT ignored, and a program keeps a SIGINT its parent ignores
    ignored (as ``ckpt`` does, as Python does): the Ctrl-C would never arrive."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
