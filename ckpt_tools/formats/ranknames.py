"""Per-rank files the user named (``torch.save(model.state_dict(), f"model_rank{r}.pt")``), not
in verl's ``model_world_size_{W}_rank_{r}.pt`` names: a set known by what it holds and how it
is named. Its files differ only in one number, the ranks 0..W-1 (W >= 2), and rank 0's model
file holds DTensors or ShardedTensors (one rank's shards; a whole state dict holds neither).

Which kind a set is comes from the rest of its name: ``optim`` (optimizer), ``extra``/``rng``
(extra state), anything else the model; one model set at most. Nothing is unpickled: the
check reads the zip's pickle bytes for the two classes' names.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

SUFFIXES = (".pt", ".pth", ".bin")
_RANKED = re.compile(r"^(?P<head>.*?)(?P<rank>\d+)(?P<tail>\D*)$")
_SHARDED_CLASSES = (b"torch.distributed.tensor\nDTensor", b"torch.distributed.tensor._api\nDTensor",
                    b"ShardedTensor")
_MAX_PICKLE = 64 << 20


def find(path: Path) -> tuple[int, dict[str, dict[int, str]]] | None:
    """``(world size, {"model"|"optim"|"extra_state": {rank: file name}})`` of the user-named
    rank files in the directory ``path``, or None when it holds no such set."""
    groups: dict[tuple[str, str], dict[int, str]] = {}
    try:
        entries = [p for p in path.iterdir() if p.suffix in SUFFIXES and p.is_file()]
    except OSError:
        return None
    for p in entries:
        m = _RANKED.match(p.name)
        if m:
            groups.setdefault((m.group("head"), m.group("tail")), {})[int(m.group("rank"))] = p.name
    sets = {key: ranks for key, ranks in groups.items() if len(ranks) >= 2 and set(ranks) == set(range(len(ranks)))}
    if not sets or len({len(r) for r in sets.values()}) != 1:
        return None
    found: dict[str, dict[int, str]] = {"model": {}, "optim": {}, "extra_state": {}}
    for (head, _), ranks in sorted(sets.items()):
        kind = _kind(head)
        if found[kind]:
            return None  # two sets of one kind: which is which is not known
        found[kind] = ranks
    if not found["model"] or not _holds_shards(path / found["model"][0]):
        return None
    return len(found["model"]), found


def _kind(head: str) -> str:
    low = head.lower()
    if "optim" in low:
        return "optim"
    if "extra" in low or "rng" in low:
        return "extra_state"
    return "model"


def _holds_shards(file: Path) -> bool:
    try:
        with zipfile.ZipFile(file) as z:
            pkl = next((i for i in z.infolist() if i.filename.endswith("/data.pkl")), None)
            if pkl is None or pkl.file_size > _MAX_PICKLE:
                return False
            data = z.read(pkl)
    except (OSError, zipfile.BadZipFile, ValueError):
        return False
    return any(c in data for c in _SHARDED_CLASSES)
