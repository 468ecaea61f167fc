"""The one engine that moves bytes: it carries out a writer's plan (a list of
:class:`~ckpt_tools.core.plan.FileJob`) from a source description into a staged destination, in
this process (:mod:`.stream`), in ``--workers`` processes or across a ``torchrun`` launch
(:mod:`.parallel`), and commits it whole (:mod:`ckpt_tools.storage.atomic`). A remote source's
bytes are fetched by the ranges the plan reads, as it goes (:mod:`.fetch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..core.describe import Checkpoint
from ..core.plan import FileJob
from ..errors import UsageError
from ..runtime import env
from ..security import bounded, safefs
from ..storage import manifest, remote, streamup
from ..storage.atomic import check_destination, staged
from . import fetch, parallel
from .stream import Writer, run_jobs


def execute(src: Checkpoint, writer: Writer, jobs: Sequence[FileJob], dst: Path, *,
            overwrite: bool = False, progress: bool = True, desc: str = "writing", fmt: str = "",
            workers: int = 1, after: Callable[[Path], None] | None = None, own_share: bool = False,
            consume: bool = False) -> None:
    """Carry out ``jobs`` into ``dst`` atomically: staged in a temporary sibling, fsynced,
    renamed into place. ``after(staging)`` adds files (HF assets, manifest) before the commit.
    ``own_share``: under torchrun, ``jobs`` are this process's files only (it planned no others);
    otherwise each process takes its share of the whole plan. ``consume``: the caller hands the
    plan over; each job's pieces are let go once its file is written, where the writer's
    ``finish`` needs none (a many-rank plan's 10^5 pieces go file by file, not at the end)."""
    with bounded.gc_frozen():  # the description and plan: live to the end, walked by no collector pass
        _execute(src, writer, jobs, Path(dst), overwrite=overwrite, progress=progress, desc=desc, fmt=fmt,
                 workers=workers, after=after, own_share=own_share,
                 consume=consume and not getattr(writer, "finish_reads_pieces", False))


def _execute(src: Checkpoint, writer: Writer, jobs: Sequence[FileJob], dst: Path, *, overwrite: bool,
             progress: bool, desc: str, fmt: str, workers: int, after: Callable[[Path], None] | None,
             own_share: bool, consume: bool) -> None:
    sealed: dict[Path, tuple[int, str]] = {}

    def complete(tmp: Path, written: dict[str, Any], elsewhere: dict[str, tuple[int, str]] | None = None) -> None:
        if src.stamps is not None:
            # a source rewritten while it was read (a training job saving over it) gives an
            # output that is no faithful copy of anything: it is not published (a remote
            # source's stand-in changes as its ranges arrive; its reads check their lengths)
            safefs.check_unchanged(src.base_dir(), src.stamps, names=[
                f.path for f in src.files if not remote.is_standin(src.base_dir() / f.path)])
        writer.finish(tmp, jobs, written)
        if after is not None:
            after(tmp)
        if not writer.single_file:
            # last: a manifest vouches for every file beside it
            manifest.write(tmp, source=str(src.root), source_format=src.format, format=fmt, known=sealed,
                           elsewhere=elsewhere)

    if env.world() > 1 and writer.single_file and (dest := remote.destination(dst)) is not None:
        # one file is written by one process; a remote DST under torchrun has no rank to publish it
        raise UsageError(f"{dest.store.url}: this output is one file, not split over the processes of a torchrun "
                         "launch, so it cannot be written there; run it as one process (plain `ckpt ...`)")
    fetch.side_files(src)  # a remote source's files no plan reads but layouts copy (nothing when local)
    if env.world() > 1 and not writer.single_file:
        parallel.execute_torchrun(src, writer, jobs, dst, overwrite=overwrite, progress=progress, desc=desc,
                                  complete=complete, sealed=sealed, own_share=own_share)
        return
    check_destination(src.root, dst, overwrite=overwrite)
    with staged(dst, overwrite=overwrite, is_dir=not writer.single_file) as tmp:
        if workers > 1 and len(jobs) > 1 and not writer.single_file:
            with fetch.Ahead(src, jobs) as ahead:
                ahead.all()  # the workers read the stand-in this process filled
            written = parallel.run_parallel(src, writer, jobs, tmp, workers=workers, progress=progress, desc=desc,
                                            sealed=sealed)
        else:
            # a remote DST: each file's parts are uploaded as it is written (nothing when local)
            written = run_jobs(src, writer, jobs, tmp, progress=progress, desc=desc,
                               sealed=None if writer.single_file else sealed, upload=streamup.follower(dst),
                               consume=consume)
        complete(tmp, written)
