"""Is a checkpoint whole? Every file its format needs, present and long enough, judged from
headers, sizes and listings alone: no tensor is read and torch is never imported, so a run
directory of many checkpoints is checked in a few milliseconds each.

- ``dcp``: ``.metadata`` present (torch's coordinator writes ``.metadata.tmp`` and renames it
  only once every rank's data is in), and every ``.distcp`` file it names present and at
  least as long as the largest ``offset + length`` it names in that file; for accelerate's
  ``save_state`` directories (``pytorch_model_fsdp_0/``, ``optimizer_0/``) each one so;
- ``sharded``: every rank of the world size, for each kind of file any rank has, each file a
  readable ``torch.save`` zip whose records lie inside it;
- ``hf``: the index and every shard it names, each header within its file and its tensors'
  byte ranges exactly filling the data;
- ``torch``: each file a readable zip with its records inside;
- ``deepspeed`` (a ``global_stepN/``, or the one a run's ``latest`` names): the model states
  (``mp_rank_00_model_states.pt``, or every rank's ``zero_pp_rank_R_mp_rank_00_model_states.pt``
  in ZeRO-3) and the optimizer states of every data-parallel rank below the model states'
  ``dp_world_size``, each a readable zip with its records inside (the model states' pickle is
  read as an inert tree for ``dp_world_size`` and the stage; no tensor).

:func:`check` says what is missing as short phrases relative to the checkpoint's directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BadInput
from ..security import safefs, zeroglobals
from ..security.dcpmeta import load_dcp_metadata
from ..security.zipdir import zip_records
from . import dcp, deepspeed, detect, hf, sharded, torchsave

PENDING_METADATA = dcp.METADATA + ".tmp"  # what torch's FileSystemWriter renames at the end


@dataclass(frozen=True)
class Whole:
    """What :func:`check` found: the format (None when none is recognised), the world size where
    the files say it, bytes on disk, what is missing or damaged (empty when whole), and for a
    DCP the top-level names of the entries its metadata lists (for a layout's own rules)."""

    format: str | None
    world_size: int | None
    size: int
    missing: tuple[str, ...]
    entries: frozenset[str] = field(default=frozenset())

    @property
    def complete(self) -> bool:
        return not self.missing


def check(path: Path) -> Whole:
    """Whether the checkpoint directory (or file) at ``path`` is whole; see the module doc."""
    path = Path(path)
    size = tree_size(path)
    name = None
    try:
        name = _format_of(path)
        world, missing, entries = _CHECKS[name](path)
    except BadInput as e:
        return Whole(name, None, size, (short(e, path),))
    except OSError as e:  # a directory or file this user cannot list or read
        return Whole(name, None, size, (f"cannot read {short(e, path)}",))
    return Whole(name, world, size, tuple(missing), frozenset(entries))


def looks_like(path: Path) -> bool:
    """Whether the directory ``path`` holds anything a checkpoint format writes (finished or
    not): a cheap test for sub-directories of a run that no framework names."""
    try:
        for e in os.scandir(path):
            n = e.name
            if (n in (dcp.METADATA, PENDING_METADATA) or n.endswith((".distcp", ".safetensors"))
                    or sharded.PATTERN.match(n) or n.endswith(torchsave.SUFFIXES)
                    or ((dcp.ACCELERATE_MODEL.match(n) or dcp.ACCELERATE_OPTIM.match(n)) and e.is_dir())):
                return True
    except OSError:
        return False
    return False


def is_part(name: str) -> bool:
    """Whether a sub-directory of that name is a part of the checkpoint around it (accelerate's
    ``pytorch_model_fsdp_0/``, ``optimizer_0/``), not a checkpoint of its own."""
    return bool(dcp.ACCELERATE_MODEL.match(name) or dcp.ACCELERATE_OPTIM.match(name))


def tree_size(path: Path) -> int:
    """Bytes of the regular files under ``path`` (symlinks not followed)."""
    if not path.is_dir():
        try:
            return path.stat().st_size
        except OSError:
            return 0
    total, todo = 0, [path]
    while todo:
        try:
            with os.scandir(todo.pop()) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        todo.append(Path(e.path))
                    elif e.is_file(follow_symlinks=False):
                        total += e.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return total


def short(e: BaseException, root: Path) -> str:
    """A reader's message with the checkpoint's own directory left out of the paths it names."""
    text = str(e)
    for base in {str(root), str(root.resolve())}:
        text = text.replace(base + os.sep, "").replace(base + ": ", "")
    return text


def _format_of(path: Path) -> str:
    if path.is_dir() and not (path / dcp.METADATA).exists() and _dcp_parts(path):
        return "dcp"  # accelerate's part directories, finished or not
    try:
        return detect(path)
    except BadInput:
        if path.is_dir() and ((path / PENDING_METADATA).exists() or any(path.glob("*.distcp"))):
            return "dcp"  # a DCP save killed before its coordinator wrote the metadata
        raise


def _dcp_parts(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and (dcp.ACCELERATE_MODEL.match(p.name)
                                                               or dcp.ACCELERATE_OPTIM.match(p.name)))


def _check_dcp(path: Path) -> tuple[int | None, list[str], set[str]]:
    parts = [(path, "")] if (path / dcp.METADATA).exists() or not _dcp_parts(path) else \
        [(p, p.name + "/") for p in _dcp_parts(path)]
    missing: list[str] = []
    entries: set[str] = set()
    ranks: set[int] = set()
    for part, prefix in parts:
        _dcp_part(part, prefix, path, missing, entries, ranks)
    return (max(ranks) + 1 if ranks else None), missing, entries


def _dcp_part(part: Path, prefix: str, root: Path, missing: list[str], entries: set[str], ranks: set[int]) -> None:
    meta_path = part / dcp.METADATA
    if not meta_path.exists():
        pending = " (only .metadata.tmp: the save was cut off before it finished)" \
            if (part / PENDING_METADATA).exists() else " (the save never finished)"
        missing.append(f"{prefix}{dcp.METADATA} missing{pending}")
        return
    try:
        meta = load_dcp_metadata(meta_path)
        ends: dict[str, int] = {}
        for info in (meta.storage_data or {}).values():
            name = info.relative_path
            if not isinstance(name, str):
                raise BadInput(f"{meta_path}: a data file named by a {type(name).__name__}; the metadata is corrupt")
            _, length = safefs.check_span(info.offset, info.length, None, what=f"{meta_path}: item in {name!r}")
            ends[name] = max(ends.get(name, 0), info.offset + length)
        entries.update(str(k).split(".", 1)[0] for k in (meta.state_dict_metadata or {}))
    except (BadInput, AttributeError, TypeError) as e:
        missing.append(short(e, root) if isinstance(e, BadInput) else f"{prefix}{dcp.METADATA}: malformed ({e})")
        return
    for name, end in sorted(ends.items()):
        m = dcp.RANK_FILE.match(name)
        if m:
            ranks.add(int(m.group(1)))
        try:
            file = safefs.resolve_inside(part, name, what=f"{meta_path}: data file")
            size = safefs.require_regular(file, what=f"{prefix}{name}").st_size
        except BadInput as e:
            missing.append(short(e, root))
            continue
        if size < end:
            missing.append(f"{prefix}{name} truncated ({size} of at least {end} bytes)")


def _check_sharded(path: Path) -> tuple[int | None, list[str], set[str]]:
    try:
        ws, found = sharded._inventory(path)
    except BadInput as e:
        return None, [short(e, path)], set()
    missing = []
    for kind in found.values():
        for rank in sorted(kind):
            missing += _zip_missing(path / kind[rank], path)
    return ws, missing, set()


def _check_hf(path: Path) -> tuple[int | None, list[str], set[str]]:
    try:
        base, files, _ = hf.shard_files(path)
    except BadInput as e:
        return None, [short(e, path)], set()
    missing = []
    for f in files:
        try:
            hf.read_header(safefs.resolve_inside(base, f, what=f"{path}: shard"))
        except BadInput as e:
            missing.append(short(e, path))
    return None, missing, set()


def _check_torch(path: Path) -> tuple[int | None, list[str], set[str]]:
    try:
        base, files, _ = torchsave._files(path)
    except BadInput as e:
        return None, [short(e, path)], set()
    missing = []
    for f in files:
        try:
            missing += _zip_missing(safefs.resolve_inside(base, f, what=f"{path}: shard"), base)
        except BadInput as e:
            missing.append(short(e, path))
    return None, missing, set()


def _zip_missing(file: Path, root: Path) -> list[str]:
    try:
        zip_records(file)
    except BadInput as e:
        return [short(e, root)]
    return []


def torch_file_missing(file: Path, root: Path) -> list[str]:
    """For a layout's side file saved with ``torch.save``: ``[]`` when present and whole (a
    readable zip, every record inside it), else what is wrong, relative to ``root``."""
    rel = file.relative_to(root).as_posix()
    if not file.exists() and not file.is_symlink():
        return [f"{rel} missing"]
    try:
        safefs.resolve_inside(root, rel, what=str(root))
    except BadInput as e:
        return [short(e, root)]
    return _zip_missing(file, root)


def check_deepspeed(path: Path) -> Whole:
    """:func:`check` of a directory known to be a DeepSpeed step directory (a run's
    ``global_stepN/``), so that one missing its model states says so rather than "no format"."""
    size = tree_size(path)
    try:
        world, missing, _ = _check_deepspeed(path)
    except OSError as e:
        return Whole(deepspeed.NAME, None, size, (f"cannot read {short(e, path)}",))
    return Whole(deepspeed.NAME, world, size, tuple(missing))


def _check_deepspeed(path: Path) -> tuple[int | None, list[str], set[str]]:
    try:
        step_dir = deepspeed.step_dir(path) if deepspeed.detect(path) else path
    except BadInput as e:
        return None, [short(e, path)], set()
    pre = "" if step_dir == path else f"{step_dir.relative_to(path).as_posix()}/"
    names = sorted(e.name for e in os.scandir(step_dir) if e.is_file())
    model3 = {int(m.group(1)): n for n in names if (m := deepspeed.MODEL3.match(n))}
    optim = {int(m.group(2)): n for n in names if (m := deepspeed.OPTIM.match(n))}
    model_file = deepspeed.MODEL_STATES if deepspeed.MODEL_STATES in names else model3.get(0)
    if model_file is None:
        return None, [f"{pre}{deepspeed.MODEL_STATES} missing (DeepSpeed writes the model states first)"], set()
    lacks = _zip_missing(step_dir / model_file, path)
    if lacks:
        return None, lacks, set()
    try:
        states = zeroglobals.read(step_dir / model_file).tree
    except (BadInput, ValueError) as e:
        return None, [f"{pre}{model_file} unreadable ({short(e, path)})"], set()
    states = states if isinstance(states, dict) else {}
    ws = states.get("dp_world_size")
    if not isinstance(ws, int) or ws < 1:
        ws = max([*optim, *model3, -1]) + 1 or None
    config = states.get("ds_config") if isinstance(states.get("ds_config"), dict) else {}
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    need_optim = bool(optim) or (isinstance(zero.get("stage"), int) and zero["stage"] > 0)
    missing: list[str] = []
    for r in range(ws or 0):
        if model3 and r not in model3:
            missing.append(f"{pre}zero_pp_rank_{r}_mp_rank_00_model_states.pt missing")
        elif model3 and r:
            missing += _zip_missing(step_dir / model3[r], path)
        if need_optim and r not in optim:
            missing.append(f"{pre}zero_pp_rank_{r}_mp_rank_00_optim_states.pt missing (rank {r} of {ws})")
        elif r in optim:
            missing += _zip_missing(step_dir / optim[r], path)
    extra = sorted(r for r in (*optim, *model3) if ws is not None and r >= ws)
    if extra:
        missing.append(f"{pre}: states of ranks {extra} beyond dp_world_size {ws} (files from another save?)")
    return ws, missing, set()


_CHECKS = {"dcp": _check_dcp, "sharded": _check_sharded, "hf": _check_hf, "torch": _check_torch,
           deepspeed.NAME: _check_deepspeed}
