"""Run a function on every rank of an FSDP job: spawn the ranks, or join ``torchrun``.

``run(fn, ranks=N, device=...)`` calls ``fn(ctx, *args)`` once per rank, where ``ctx`` is a
:class:`RankContext` (rank, world size, the torch device to put this rank's tensors on).

* Inside ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) or inside a job whose process group is
  already initialised, only this process's rank runs, and ``N`` must equal the world size.
* Otherwise ``N`` processes are spawned on this host with a ``file://`` rendezvous; the caller
  waits for them, and a rank that fails makes the others stop.

The backend follows the device: gloo on CPU; on CUDA, NCCL for CUDA tensors and gloo for the
CPU ones (``cpu:gloo,cuda:nccl``), so CPU-offloaded state and object collectives work too.
The ranks are ``python -m ckpt_tools.runtime.child`` processes (:mod:`.procs`), so they never
import the caller's ``__main__``: a script that calls this needs no ``if __name__ == "__main__":``
guard, and ``fn`` must be a module-level function of an importable module.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import errors
from ..errors import CkptError, UsageError
from . import env, procs

if TYPE_CHECKING:
    import torch

DEVICES = ("cpu", "cuda")
# After the first rank fails, how long the others get to stop on their own before they are
# killed (they are usually blocked in a collective the failed rank never joins).
_GRACE_S = 5.0


class RankFailed(CkptError):
    """A rank raised something that is not a CkptError (a bug, or an environment problem)."""

    def __init__(self, message: str, remote_traceback: str = ""):
        super().__init__(message)
        self.remote_traceback = remote_traceback

    def __reduce__(self):
        return (type(self), (str(self), self.remote_traceback))


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def backend_for(device: str) -> str:
    return "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"


def check_device(device: str) -> None:
    import torch

    if device not in DEVICES:
        raise UsageError(f"--device {device!r}: choose one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible here; use --device cpu")


def will_spawn() -> bool:
    """True when :func:`run` would start the ranks itself (no torchrun, no process group)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) and env.launch() is None


def run(fn: Callable[..., Any], *args: Any, ranks: int, device: str = "cpu",
        threads_per_rank: int | None = None) -> Any:
    """Run ``fn(ctx, *args)`` on each of ``ranks`` ranks.

    Returns what ``fn`` returned on rank 0 when this call spawned the ranks, or on this
    process's rank when it joined an existing job; ``fn`` should therefore return the same
    value on every rank (gather what it needs with a collective). A ``CkptError`` raised on a
    rank is raised here as is; anything else becomes :class:`RankFailed` with the rank's
    traceback. Example: ``run(work, job, ranks=4, device="cpu")``.
    """
    check_device(device)
    if ranks < 1:
        raise UsageError(f"--ranks {ranks}: must be at least 1")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return _join(fn, args, ranks, device, dist.get_rank(), dist.get_world_size(),
                     int(os.environ.get("LOCAL_RANK", dist.get_rank())), own_group=False)
    launched = env.launch()
    if launched is not None:
        return _join(fn, args, ranks, device, launched.rank, launched.world, launched.local_rank, own_group=True)
    return _spawn(fn, args, ranks, device, threads_per_rank)


def _join(fn, args, ranks, device, rank, world, local_rank, *, own_group: bool) -> Any:
    import torch.distributed as dist

    if world != ranks:
        raise UsageError(f"--ranks {ranks} but this job has WORLD_SIZE={world}; "
                         f"pass --ranks {world} (or run outside torchrun to spawn {ranks} ranks)")
    dev = _set_device(device, local_rank)
    if own_group:
        dist.init_process_group(backend_for(device), init_method="env://",
                                device_id=dev if device == "cuda" else None)
    try:
        return fn(RankContext(rank, world, local_rank, dev), *args)
    finally:
        if own_group:
            dist.destroy_process_group()


def on_rank0(ctx: RankContext, fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0, its result (or its CkptError) on every rank."""
    import torch.distributed as dist

    box: list[Any] = [None]
    if ctx.rank == 0:
        try:
            box[0] = ("ok", fn())
        except CkptError as e:
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0)
    if box[0][0] == "error":
        raise box[0][1]
    return box[0][1]


def all_gather(ctx: RankContext, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    import torch.distributed as dist

    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def peak_memory(ctx: RankContext) -> dict[str, int | None]:
    """This process's peak resident memory and, on CUDA, peak allocated device memory (bytes)."""
    import torch

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"rss_bytes": rss if sys.platform == "darwin" else rss * 1024,
            "device_bytes": torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else None}


def _set_device(device: str, local_rank: int) -> torch.device:
    import torch

    if device == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UsageError(f"local rank {local_rank} but only {torch.cuda.device_count()} CUDA devices "
                             "are visible; use fewer ranks per host")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _child(rank: int, world: int, device: str, init_method: str, result_dir: str,
           threads: int, fn: Callable, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    _thread_lock_for_tqdm()
    try:
        dev = _set_device(device, rank)
        dist.init_process_group(backend_for(device), init_method=init_method, rank=rank,
                                world_size=world, device_id=dev if device == "cuda" else None,
                                timeout=datetime.timedelta(minutes=30))
        payload: tuple = ("ok", fn(RankContext(rank, world, rank, dev), *args))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        payload = ("error", e, traceback.format_exc())
    # Reported before teardown: destroying the group is what breaks the peers' collectives, and
    # their errors must not look earlier than this rank's own.
    _report(result_dir, rank, payload)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    # The work is done and reported: end now. The interpreter's own teardown of torch and
    # transformers took seconds, and the caller waited for it after the bar had finished.
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0 if payload[0] == "ok" else 1)


def _thread_lock_for_tqdm() -> None:
    """tqdm guards its bars with a multiprocessing lock by default: a named semaphore, and a
    resource-tracker process to remove it, which a rank ending with ``os._exit`` would leave
    warning about a leak. One process's bars need only a thread lock."""
    import threading

    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _report(result_dir: str, rank: int, payload: tuple) -> None:
    """Write this rank's outcome as JSON (results are plain data; a CkptError travels as its
    class name, message and exit code, so the parent re-raises the same error)."""
    out = Path(result_dir) / f"rank_{rank}.json"
    if payload[0] == "ok":
        record = {"ok": True, "result": payload[1]}
    else:
        e = payload[1]
        error = ({"type": type(e).__name__, "message": str(e), "exit_code": e.exit_code}
                 if isinstance(e, CkptError) else None)
        record = {"ok": False, "error": error, "traceback": payload[2]}
    record["when"] = time.time()
    try:
        data = json.dumps(record)
    except (TypeError, ValueError):  # a result that is not plain data
        data = json.dumps({"ok": False, "error": None, "traceback": traceback.format_exc(), "when": time.time()})
    out.with_suffix(".tmp").write_text(data)
    os.replace(out.with_suffix(".tmp"), out)


def _revive(error: dict | None) -> CkptError | None:
    """The CkptError a rank reported, as an exception of the same class and exit code."""
    if not error:
        return None

    cls = getattr(errors, error.get("type", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, CkptError)):
        cls = CkptError
    exc = cls(error.get("message", ""))
    exc.exit_code = error.get("exit_code", cls.exit_code)
    return exc


def _spawn(fn, args, ranks: int, device: str, threads_per_rank: int | None) -> Any:
    import torch

    if device == "cuda" and ranks > torch.cuda.device_count():
        raise UsageError(f"--ranks {ranks} but only {torch.cuda.device_count()} CUDA devices are visible; "
                         "one rank per GPU (use torchrun for several hosts)")
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // ranks)
    work = Path(tempfile.mkdtemp(prefix="ckpt-launch-"))
    try:
        init_method = f"file://{(work / 'rendezvous').resolve()}"
        children: list[procs.Child] = []
        killed: set[int] = set()
        try:
            for rank in range(ranks):
                children.append(procs.start(_child, (rank, ranks, device, init_method, str(work), threads, fn, args),
                                            work=work, name=f"rank-{rank}", passes=[fn]))
            _wait(children)
        finally:
            # on an interrupt too: SIGTERM, then a grace (a rank 0 in the middle of its commit
            # finishes it), then SIGKILL; only our own children, by handle
            killed = {rank for rank, c in enumerate(children) if c.proc.poll() is None}
            procs.stop(children)
        return _collect(work, [c.proc for c in children], killed)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _wait(children: list[procs.Child]) -> None:
    failed_at = None
    while any(c.proc.poll() is None for c in children):
        if failed_at is None and any(c.proc.returncode not in (None, 0) for c in children):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > _GRACE_S:
            return
        time.sleep(0.02)


def _collect(work: Path, procs: list, killed: set[int]) -> Any:
    errors = []  # (when, rank, exception or None, traceback text)
    result = None
    for rank, p in enumerate(procs):
        f = work / f"rank_{rank}.json"
        if not f.exists():
            # A rank that died on its own (signal, out of memory) is likely the cause.
            why = "stopped after another rank failed" if rank in killed else \
                f"died with exit code {p.returncode} (out of memory?)"
            errors.append((float("inf") if rank in killed else float("-inf"), rank, None,
                           f"rank {rank} {why}"))
            continue
        record = json.loads(f.read_text())
        if record["ok"]:
            if rank == 0:
                result = record["result"]
        else:
            errors.append((record["when"], rank, _revive(record["error"]), record["traceback"]))
    if not errors:
        return result
    # The earliest failure is the cause; later ones are peers whose collectives broke.
    errors.sort(key=lambda e: (e[0], isinstance(e[2], CkptError) is False))
    when, rank, exc, text = errors[0]
    if isinstance(exc, CkptError):
        raise exc
    last = text.strip().splitlines()[-1] if text.strip() else "no traceback"
    raise RankFailed(f"rank {rank} of {len(procs)} failed: {last}", text)
