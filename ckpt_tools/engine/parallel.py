"""Writing one plan with several processes: ``--workers K`` (a local process pool), or every
process of a ``torchrun`` launch taking its share of the output files. Each output file is
written by exactly one process, so the result is byte-identical to a single process's. Under
``torchrun`` a local DST is staged in one directory the processes share; a remote one
(:class:`~ckpt_tools.storage.remote.Destination`) in a private directory per process, each
uploading its own files, rank 0 the markers last."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..core.describe import Checkpoint
from ..core.plan import FileJob
from ..errors import CkptError
from ..runtime import env, lifeline, procs
from ..storage import remote
from ..storage.atomic import (TMP_MARK, check_destination, commit_into, discarded_on_error, fsync_tree, holding,
                              remember_staging, remove_path)
from .stream import Writer, progress_bar, run_jobs


def balance(jobs: Sequence[FileJob], k: int) -> list[list[FileJob]]:
    """Split whole files over ``k`` processes, largest first onto the least loaded; a file
    costs its bytes and :data:`FILE_COST` (files of no tensor bytes, a many-rank job's extra
    state, all went to one process: 192 of them at 256 -> 192 ranks, ~0.3 s more for it)."""
    shares: list[list[FileJob]] = [[] for _ in range(k)]
    loads = [0] * k
    for job in sorted(jobs, key=lambda j: (-j.nbytes, j.path)):
        i = loads.index(min(loads))
        shares[i].append(job)
        loads[i] += job.nbytes + FILE_COST
    return shares


FILE_COST = 1 << 18  # what writing a file costs beyond its bytes (its pickle, zip, fsync), in bytes


def _run_share(src: Checkpoint, writer: Writer, jobs: Sequence[FileJob], out: Path
               ) -> tuple[dict[str, Any], dict[str, tuple[int, str]]]:
    if "torch" in sys.modules:  # workers share the cores: one intra-op thread each
        sys.modules["torch"].set_num_threads(1)
    sealed: dict[Path, tuple[int, str]] = {}
    return run_jobs(src, writer, jobs, out, progress=False, desc="", sealed=sealed), _relative(sealed, out)


def _relative(sealed: dict[Path, tuple[int, str]], out: Path) -> dict[str, tuple[int, str]]:
    """The files a process sealed (hashed and fsynced as it wrote them: :class:`~ckpt_tools.storage.manifest.Sealer`),
    by their name under ``out``: what it reports, for the manifest's writer to take as known
    rather than read every process's files again, one after the other, once all are written."""
    return {p.relative_to(out).as_posix(): digest for p, digest in sealed.items()}


def _absolute(digests: dict[str, tuple[int, str]], out: Path) -> dict[Path, tuple[int, str]]:
    return {out / rel: digest for rel, digest in digests.items()}


def run_parallel(src: Checkpoint, writer: Writer, jobs: Sequence[FileJob], out: Path, *,
                 workers: int, progress: bool, desc: str, sealed: dict[Path, tuple[int, str]]) -> dict[str, Any]:
    """Write ``jobs`` with ``workers`` helper processes (:mod:`ckpt_tools.runtime.procs`: they
    never import the caller's ``__main__``), each taking whole files and sealing them as it
    writes them (their digests added to ``sealed``). An interrupt or a failed worker stops the
    others; the first failure is raised here."""
    shares = [share for share in balance(jobs, workers) if share]
    written: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="ckpt-workers-"))
    children: list[procs.Child] = []
    # forked where it can be (the plan as it stands in memory), else handed over in a file
    start = procs.fork if procs.can_fork() else procs.start
    try:
        for i, share in enumerate(shares):
            children.append(start(_run_share, (src, writer, share, out), work=work, name=f"worker-{i}"))
        share_of = {c.name: share for c, share in zip(children, shares)}
        with progress_bar(sum(j.nbytes for j in jobs), desc, progress) as bar:  # (a bar's thread after the forks)
            while (done := procs.wait_any(children)) is not None:
                outcome = done.outcome()
                if outcome[0] == "ok":
                    written.update(outcome[1][0])
                    sealed.update(_absolute(outcome[1][1], out))
                    bar.update(sum(j.nbytes for j in share_of[done.name]))
                elif outcome[0] == "error":
                    raise outcome[1]
                else:
                    raise CkptError(f"a --workers process died with exit code {outcome[1]} (out of memory?); "
                                    "re-run, with fewer --workers")
    finally:
        procs.stop(children)
        shutil.rmtree(work, ignore_errors=True)
    return written


def execute_torchrun(src: Checkpoint, writer: Writer, jobs: Sequence[FileJob], dst: Path, *, overwrite: bool,
                     progress: bool, desc: str, complete: Callable[[Path, dict[str, Any]], None],
                     sealed: dict[Path, tuple[int, str]], own_share: bool = False) -> None:
    """Every process of the launch writes its share of ``jobs`` (``own_share``: ``jobs`` are its
    share, the only files it planned) into one staging directory; rank 0 then writes the
    describing files from what every process reports it wrote, and commits. Any process's error
    fails all."""
    import torch.distributed as dist

    # a process of the launch ends with torchrun's agent: killed, it can no longer stop us
    lifeline.tie_to_launcher()
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = list(jobs) if own_share else balance(jobs, world)[rank]
    dest = remote.destination(dst)
    if dest is not None:
        try:
            _same_writer(writer)
            _execute_to_store(src, writer, mine, dst, dest, rank=rank, world=world, progress=progress, desc=desc,
                              complete=complete, sealed=sealed)
        finally:
            if own:
                dist.destroy_process_group()
        return
    launched = env.launch()
    run_id = launched.run_id if launched else "none"
    try:
        _same_writer(writer)
    except CkptError:
        if own:
            dist.destroy_process_group()
        raise
    tmp = dst.parent / f".{dst.name}{TMP_MARK}run-{run_id}"
    lock = contextlib.ExitStack()
    try:
        error = None
        if rank == 0:
            try:
                check_destination(src.root, dst, overwrite=overwrite)
                remove_path(tmp)
                tmp.mkdir(parents=True)
                remember_staging(dst, tmp)
                lock.enter_context(holding(tmp))  # marks the staging live until this process ends
            except CkptError as e:
                error = e
        (error,) = _bcast(error)
        if error is not None:
            raise error
        written, mine_sealed, error = {}, {}, None
        try:
            written = run_jobs(src, writer, mine, tmp, progress=progress and rank == 0, desc=desc, sealed=mine_sealed)
        except Exception as e:  # reported to every process, raised everywhere
            error = CkptError(f"process {rank} of the torchrun launch failed: {e}")
            error.exit_code = getattr(e, "exit_code", 5)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (written, _relative(mine_sealed, tmp), error))
        failed = [e for *_, e in gathered if e is not None]
        if rank == 0:
            if failed:
                remove_path(tmp)
            else:
                merged: dict[str, Any] = {}
                for w, digests, _ in gathered:
                    merged.update(w)
                    sealed.update(_absolute(digests, tmp))
                with discarded_on_error(tmp, dst):
                    complete(tmp, merged)
                    fsync_tree(tmp)
                    # torchrun's launcher killed meanwhile: the run is over, nothing is published
                    # (the watchdog would end this process within its poll interval anyway)
                    lifeline.end_if_orphaned()
                    commit_into(tmp, dst, overwrite=overwrite)
        dist.barrier()
        if failed:
            raise failed[0]
    finally:
        lock.close()
        if own:
            dist.destroy_process_group()


def _execute_to_store(src: Checkpoint, writer: Writer, jobs: Sequence[FileJob], dst: Path, dest: remote.Destination, *,
                      rank: int, world: int, progress: bool, desc: str,
                      complete: Callable[..., None], sealed: dict[Path, tuple[int, str]]) -> None:
    """A remote DST under torchrun, no shared filesystem: each process writes its share into its
    own private staging directory (``dst``, a path of its own) and uploads it; once every upload
    is done, rank 0 writes the describing files (with the digests the others report) and
    uploads them, markers last. Any process's failure: no marker is uploaded."""
    import torch.distributed as dist

    error = None
    if rank == 0:
        try:
            dest.begin()  # DST refused (exit 4) or its old markers removed, before any rank writes
        except CkptError as e:
            error = e
    (error,) = _bcast(error)
    if error is not None:
        raise error
    remove_path(dst)
    dst.mkdir(parents=True)
    written: dict[str, Any] = {}
    uploaded: list[str] = []
    try:
        written = run_jobs(src, writer, jobs, dst, progress=progress and rank == 0, desc=desc, sealed=sealed)
        uploaded = dest.upload_data(dst)
    except Exception as e:  # reported to every process, raised everywhere
        error = CkptError(f"process {rank} of the torchrun launch failed: {e}")
        error.exit_code = getattr(e, "exit_code", 5)
    digests = _relative(sealed, dst)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (written, digests, uploaded, error))
    failed = [e for *_, e in gathered if e is not None]
    final = failed[0] if failed else None
    if rank == 0 and final is None:
        merged: dict[str, Any] = {}
        elsewhere: dict[str, tuple[int, str]] = {}
        for i, (w, d, _, _) in enumerate(gathered):
            merged.update(w)
            if i != 0:
                elsewhere.update(d)
        try:
            complete(dst, merged, elsewhere)
            dest.finish(dst, {rel for _, _, up, _ in gathered for rel in up})
        except Exception as e:  # noqa: BLE001 - every process raises it
            final = e if isinstance(e, CkptError) else CkptError(f"process 0 of the torchrun launch failed: {e}")
    (final,) = _bcast(final)
    dest.published = final is None
    if final is not None:
        raise final


def _same_writer(writer: Writer) -> None:
    """Every process chose the same writer (each chose it from its own files: the same bytes need
    the same writer), else every process stops before writing (nothing is published)."""
    import torch.distributed as dist

    kind = (type(writer).__module__, type(writer).__qualname__, getattr(writer, "accepts_spans", None),
            getattr(writer, "accepts_casts", None))
    kinds: list = [None] * dist.get_world_size()
    dist.all_gather_object(kinds, kind)
    if len(set(kinds)) > 1:
        raise CkptError("the processes of the torchrun launch chose different writers for their files "
                        f"({sorted(set(map(str, kinds)))}); run it as one process (plain `ckpt ...`)")


def _bcast(value: Any) -> list:
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box
