"""``ckpt latest RUN_DIR``: the newest complete checkpoint of a run, for resuming a job; and the
listing ``ckpt inspect RUN_DIR`` shows of a directory that holds checkpoints.

Whole or not is judged from headers, sizes and listings (:mod:`ckpt_tools.layouts.runs`), never
by reading a tensor and never through torch: a run of 20 checkpoints is checked in milliseconds.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..layouts import runs
from .urls import accepts_urls


@accepts_urls(sources=("run_dir",), need=lambda a: "data" if a.get("verify") else "headers")
def latest(run_dir: str | Path, *, verify: bool = False) -> str:
    """The path of the newest complete checkpoint under ``run_dir``.

    Newest by the step the framework recorded (``global_step_N``, ``checkpoint-N`` and its
    ``trainer_state.json``, ``checkpoint_N``, ``step-N``, Megatron-LM's ``iter_N``, DeepSpeed's
    ``global_stepN``, the number in a plain directory's name), never by modification time; complete when every file its format and its layout's
    loader need is present and long enough (see ``ckpt_tools.formats.whole``). A directory that
    is itself a checkpoint is its own answer. ``verify`` also compares a ckpt manifest's
    checksums. For verl the path is ``global_step_N`` (its ``actor/`` and ``critic/`` checked),
    what verl's ``trainer.resume_from_path`` takes.

    Example: ``ckpt_tools.latest("checkpoints/exp1")`` -> ``"checkpoints/exp1/global_step_20"``.
    Raises BadInput (exit 3) naming what each candidate lacks when none is complete.
    """
    info = run_listing(run_dir, verify=verify, until_complete=True)
    if info["latest"] is None:
        raise BadInput(none_complete(info))
    return info["latest"]


@accepts_urls(sources=("run_dir",), need=lambda a: "data" if a.get("verify") else "headers")
def run_listing(run_dir: str | Path, *, verify: bool = False, until_complete: bool = False) -> dict[str, Any]:
    """CONTRACT's ``{"run", "latest", "checkpoints": [{"path", "step", "format", "layout",
    "world_size", "size", "complete", "missing"}, ...]}`` for ``run_dir``, newest first
    (``latest``: the path :func:`latest` gives, or None), plus ``notes``. ``until_complete``:
    list only the newest down to the first complete one (all of them when none is)."""
    run = runs.scan(run_dir, verify=verify, until_complete=until_complete)
    found = run.latest()
    return {"run": str(run.root), "latest": str(found.path) if found else None,
            "checkpoints": [e.to_json() for e in run.entries], "notes": list(run.notes)}


def holds_checkpoints(path: str | Path) -> bool:
    """Whether ``path`` is a directory that is not a checkpoint itself but holds step
    directories of checkpoints (``inspect`` then lists them)."""
    return runs.is_run(Path(path))


def none_complete(info: dict[str, Any]) -> str:
    """The one-line error for a :func:`run_listing` with no complete checkpoint: what each lacks."""
    items = info["checkpoints"]
    if not items:
        return (f"{info['run']}: no checkpoint found (no global_step_N/, checkpoint-N/, checkpoint_N/, step-N/ "
                "or numbered directory holding checkpoint files, and not a checkpoint itself)")
    lacks = "; ".join(f"{_name(c['path'], info['run'])}: {', '.join(c['missing'])}" for c in items)
    return f"{info['run']}: no complete checkpoint ({lacks})"


def _name(path: str, run: str) -> str:
    rel = os.path.relpath(path, run)
    return path if rel == "." else rel
