"""Run directories: the checkpoints a training job wrote into one directory over time, which of
them are whole, and which is the newest a job can resume from.

Each framework's module says where its step directories sit and how they are named
(``RUN_FOLDERS``, ``step_of``), which checkpoints a step directory holds (``parts``), what its
loader needs beyond the format's own files (``missing``), the step it recorded
(``recorded_step``) and the step its own "latest" marker names (``hint``, reported, never
trusted); one whose step directory is no format of its own (DeepSpeed's ``global_stepN/``) also
says what makes it whole (``check_whole``). This module only asks them; the format's part is :mod:`ckpt_tools.formats.whole`.
Nothing here reads a tensor or imports torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..formats import detect, torchsave, whole
from ..security import safefs
from ..storage import manifest
from . import accelerate, deepspeed, megatron, plain, torchtitan, trainer, verl

# frameworks whose step directories are known by their names, most specific first; plain
# (any numbered sub-directory holding checkpoint files) last
_BY_NAME = (verl, trainer, accelerate, torchtitan, megatron, deepspeed)
_ALL = (*_BY_NAME, plain)
ESCAPED = "leads out of RUN_DIR through a symlink; refused, not read"


@dataclass(frozen=True)
class Entry:
    """One checkpoint of a run: where, which step, what it is, and what it lacks (nothing when
    complete)."""

    path: Path
    step: int | None
    layout: str
    format: str | None
    world_size: int | None
    size: int
    missing: tuple[str, ...]

    @property
    def complete(self) -> bool:
        return not self.missing

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "step": self.step, "format": self.format, "layout": self.layout,
                "world_size": self.world_size, "size": self.size, "complete": self.complete,
                "missing": list(self.missing)}


@dataclass(frozen=True)
class Run:
    """A run directory's checkpoints, newest first; ``itself``: RUN_DIR is the one checkpoint."""

    root: Path
    entries: tuple[Entry, ...]
    itself: bool
    notes: tuple[str, ...] = ()

    def latest(self) -> Entry | None:
        return next((e for e in self.entries if e.complete), None)


def scan(run_dir: str | Path, *, verify: bool = False, until_complete: bool = False) -> Run:
    """Every checkpoint under ``run_dir``, checked and ordered newest first (by the step each
    framework records; those without a step last). ``verify``: also compare the checksums of a
    ckpt manifest, where one is present (sizes are always compared). ``until_complete``: check
    from the newest down and stop at the first complete one (what ``latest`` needs: the cost
    is that of the few newest, however long the run).

    A directory with no step directories that is itself a checkpoint is its own one entry.
    Raises BadInput when ``run_dir`` is not a directory.
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise BadInput(f"{root}: {'not a directory' if root.exists() else 'no such directory'}; "
                       "expected a run directory of checkpoints")
    found = step_dirs(root)
    itself = not found
    if itself:
        adapter = next((a for a in _BY_NAME if a.step_of(root.name) is not None), None)
        if adapter is not None or whole.looks_like(root):
            adapter = adapter or plain
            found = [("", adapter, adapter.step_of(root.name))]
    # the step each framework recorded (a small JSON at most), read before any check
    found = [(rel, a, a.recorded_step(root / rel, step) if step is not None and not (rel and _escapes(root, rel))
              else step) for rel, a, step in found]
    found.sort(key=lambda f: (f[2] is not None, f[2] or 0, f[0]), reverse=True)
    entries = []
    for rel, adapter, step in found:
        entries.append(_check(root, rel, adapter, step, verify))
        if until_complete and entries[-1].complete:
            break
    steps = {(a.NAME, step) for _, a, step in found}
    return Run(root, tuple(entries), itself and bool(entries), tuple(_notes(root, entries, steps)))


def is_run(path: Path) -> bool:
    """Whether the directory ``path`` holds step directories of checkpoints rather than being a
    checkpoint itself: it has step directories, and no format claims it, or only by a lone torch
    file beside them (a stray ``args.pt``, never a checkpoint whose files are the step
    directories')."""
    path = Path(path)
    if not path.is_dir() or not step_dirs(path):
        return False
    try:
        found = detect(path)
    except BadInput:
        return True
    return found == "torch" and not ((path / torchsave.INDEX_NAME).is_file()
                                     or (path / "pytorch_model.bin").is_file())


def step_dirs(root: Path) -> list[tuple[str, Any, int | None]]:
    """(path relative to root, adapter, step) of each step directory, claimed by the first
    framework that names it (plain: only when it holds checkpoint files and is no part of one)."""
    out, seen = [], set()
    for adapter in _ALL:
        for folder in adapter.RUN_FOLDERS:
            base = root / folder if folder else root
            try:
                names = sorted(e.name for e in os.scandir(base) if e.is_dir())
            except OSError:
                continue
            for name in names:
                rel = f"{folder}/{name}" if folder else name
                step = adapter.step_of(name)
                if rel in seen or step is None:
                    continue
                # numbered directories inside a checkpoint (accelerate's optimizer_0/) are its parts
                if not adapter.NAMES_STEP_DIRS and (whole.is_part(name) or not (
                        _escapes(root, rel) or whole.looks_like(base / name))):
                    continue
                seen.add(rel)
                out.append((rel, adapter, step))
    return out


def _escapes(root: Path, rel: str) -> bool:
    try:
        safefs.resolve_inside(root, rel, what=str(root))
    except BadInput:
        return True
    return False


def _check(root: Path, rel: str, adapter: Any, step: int | None, verify: bool) -> Entry:
    path = root / rel if rel else root
    if rel and _escapes(root, rel):
        return Entry(path, step, adapter.NAME, None, None, 0, (ESCAPED,))
    missing: list[str] = []
    fmt = ws = None
    size = 0
    for part in adapter.parts(path):
        where = f"{part}/" if part else ""
        d = path / part if part else path
        if part and _escapes(path, part):
            missing.append(f"{where} {ESCAPED}")
            continue
        if not d.is_dir():
            missing.append(f"{where} missing")
            continue
        w = _whole(adapter, d)
        if not getattr(adapter, "claims", lambda _: True)(w):
            # named as the framework names its step directories but holding none of its marks
            # (a dcp.save in ``step-N/``): the layout is what the checkpoint holds, not its name
            adapter = plain
        fmt, ws, size = fmt or w.format, ws or w.world_size, size + w.size
        try:
            side = [*adapter.missing(d, w), *_manifest_missing(d, verify)]
        except OSError as e:  # a side file or directory this user cannot read
            side = [f"cannot read {whole.short(e, d)}"]
        missing += [where + m for m in (*w.missing, *side)]
    return Entry(path, step, adapter.NAME, fmt, ws, size, tuple(missing))


def _whole(adapter: Any, d: Path) -> whole.Whole:
    """A framework whose step directory is no format of its own (DeepSpeed's) says itself what
    makes it whole: for the directories it names, and for any whose contents it owns (a
    custom-tagged one that plain claims by its number)."""
    if hasattr(adapter, "check_whole"):
        return adapter.check_whole(d)
    owner = next((a for a in _BY_NAME if hasattr(a, "owns") and a.owns(d)), None)
    return owner.check_whole(d) if owner is not None else whole.check(d)


def _manifest_missing(d: Path, verify: bool) -> list[str]:
    """A ckpt manifest, where present: every file it lists present with its size (and, with
    ``verify``, its checksum)."""
    try:
        found = manifest.read(d)
    except ValueError as e:
        return [f"{manifest.NAME} unreadable ({e})"]
    files = found.get("files") if isinstance(found, dict) else None
    if not isinstance(files, dict):
        return [] if found is None else [f"{manifest.NAME} lists no files"]
    out = []
    for rel, info in files.items():
        try:
            p = safefs.resolve_inside(d, rel, what=f"{d / manifest.NAME}")
            size = safefs.require_regular(p, what=f"{rel}").st_size
        except BadInput as e:
            out.append(whole.short(e, d))
            continue
        want = info.get("size") if isinstance(info, dict) else None
        if size != want:
            out.append(f"{rel}: {size} bytes, the manifest says {want}")
        elif verify and manifest.file_digest(p) != info.get("xxh3_64"):
            out.append(f"{rel}: checksum differs from the manifest's")
    return out


def _notes(root: Path, entries: list[Entry], steps: set[tuple[str, int | None]]) -> list[str]:
    """What a framework's own "latest" marker says, where the files disagree with it (asked only
    of the frameworks whose step directories the run holds: verl and Megatron-LM both write
    ``latest_checkpointed_iteration.txt``)."""
    out = []
    for adapter in _BY_NAME:
        if not any(name == adapter.NAME for name, _ in steps):
            continue
        step = adapter.hint(root)
        if step is None:
            continue
        named = [e for e in entries if e.layout == adapter.NAME and e.step == step]
        if (adapter.NAME, step) not in steps:
            out.append(f"{adapter.NAME}'s latest marker names step {step}, which is not in {root}; ignored")
        elif named and not named[0].complete:
            out.append(f"{adapter.NAME}'s latest marker names step {step}, which is incomplete; ignored")
    return out
