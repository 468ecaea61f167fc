"""Non-tensor training state: nesting flattened objects back, optimizer ``param_groups`` in
either keying, and the policy for rank-local extra state when the world size changes."""

from __future__ import annotations

import io
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .describe import ObjectInfo
from ..errors import BadInput, UsageError, count

RANK_LOCAL_POLICIES = ("drop", "keep-first")


def nest(items: Iterable[tuple[tuple, Any]]) -> dict[str, Any]:
    """Build the nested state from ``(path, value)`` pairs (DCP's flattened paths included)."""
    flat, mapping = {}, {}
    for path, value in items:
        key = ".".join(map(str, path))
        flat[key] = value
        mapping[key] = tuple(path)
    if not flat:
        return {}
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    return unflatten_state_dict(flat, mapping)


def gather(objects: Iterable[ObjectInfo], fetch: Callable[[ObjectInfo], Any]) -> dict[str, Any]:
    return nest((o.path or (o.group, o.name), fetch(o)) for o in objects)


def param_groups_keyed(groups: list[dict], *, keyed: str, param_order: Sequence[str]) -> list[dict]:
    """``param_groups`` with ``params`` as ints (``optimizer.state_dict()``) or FQNs."""
    out = []
    for g in groups:
        g = dict(g)
        params = []
        for p in g.get("params", []):
            if keyed == "int":
                if isinstance(p, int):
                    params.append(p)
                elif p in param_order:
                    params.append(param_order.index(p))
                else:
                    raise BadInput(f"param_groups names parameter {p!r}, which the model does not have")
            else:
                params.append(param_order[p] if isinstance(p, int) and p < len(param_order) else p)
        g["params"] = params
        out.append(g)
    return out


def same(a: Any, b: Any) -> bool:
    """Deep equality of saved values (tensors compared bit for bit)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                                                        b.view(-1).view(torch.uint8) if b.numel() else b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:
        buf_a, buf_b = io.BytesIO(), io.BytesIO()
        torch.save(a, buf_a)
        torch.save(b, buf_b)
        return buf_a.getvalue() == buf_b.getvalue()


def per_rank_extras(objects: Sequence[ObjectInfo], fetch: Callable[[ObjectInfo], Any], *,
                    src_world: int | None, dst_world: int, policy: str = "drop",
                    warn: Callable[[str], None] | None = None,
                    equal: Callable[[Any, Any], bool] | None = None) -> list[dict[str, Any]]:
    """Extra state for each of ``dst_world`` new ranks.

    Values equal on every source rank (LR scheduler, step counters) go to every new rank.
    Rank-local values (RNG states, per-rank data-loader state) cannot be split or merged
    meaningfully; ``policy`` says what happens to them when the world size changes:
    ``drop`` (default: the new job seeds them afresh) or ``keep-first`` (new rank r keeps
    source rank r's value where there is one). Unsharded sources' extras go to every rank.
    ``equal`` compares two fetched values (default: :func:`same`).
    """
    equal = equal or same
    if policy not in RANK_LOCAL_POLICIES:
        raise UsageError(f"--rank-local must be one of {', '.join(RANK_LOCAL_POLICIES)}, not {policy!r}")
    warn = warn or (lambda m: print(f"warning: {m}", file=sys.stderr))
    out: list[dict[str, Any]] = [{} for _ in range(dst_world)]
    shared = [o for o in objects if o.rank is None]
    for key, value in gather(shared, fetch).items():
        for r in range(dst_world):
            out[r][key] = value
    by_key: dict[Any, dict[int, ObjectInfo]] = {}
    for o in objects:
        if o.rank is not None:
            by_key.setdefault(o.path[0] if o.path else o.name, {})[o.rank] = o
    local = []
    for key, ranks in by_key.items():
        values = {r: fetch(o) for r, o in sorted(ranks.items())}
        if src_world == dst_world:
            for r, v in values.items():
                out[r][key] = v
            continue
        first = next(iter(values.values()))
        if len(values) == src_world and all(equal(first, v) for v in values.values()):
            for r in range(dst_world):
                out[r][key] = first
            continue
        local.append(str(key))
        if policy == "keep-first":
            for r in range(dst_world):
                if r in values:
                    out[r][key] = values[r]
    if local:
        warn_rank_local(f"extra state {', '.join(local)} differs between ranks (rank-local, e.g. RNG)",
                        src_world=src_world, dst_world=dst_world, policy=policy, warn=warn)
    return out


def warn_rank_local(what: str, *, src_world: int | None, dst_world: int, policy: str,
                    warn: Callable[[str], None] | None = None) -> None:
    """The one warning for rank-local state (extra-state entries, a layout's files or DCP
    entries) that a change of world size left out, or kept for some ranks only. Printed even
    with --quiet: the resumed job differs from the saved one."""
    warn = warn or (lambda m: print(f"warning: {m}", file=sys.stderr))
    done = ("dropped: the resumed job starts them afresh" if policy == "drop" else
            f"kept for ranks 0..{min(dst_world, src_world or 0) - 1} from the same source ranks, "
            "absent on the others")
    warn(f"{what}; going from {src_world} to {count(dst_world, 'rank')}, {done} (--rank-local {policy})")


def short_list(names: Sequence[str], n: int = 4) -> str:
    """At most ``n`` names, comma-separated, and how many there are in all."""
    names = list(names)
    return ", ".join(names[:n] + ([f"... ({len(names)} in all)"] if len(names) > n else []))
