"""FSDP1 flat parameters (``use_orig_params=False``): where each parameter's elements lie.

FSDP1 flattens the parameters of each wrapped unit into one 1-D FlatParameter: the unit's
parameters in its module's ``named_parameters()`` order (shared ones once), concatenated with
no padding between them, then padded at the end so the length divides the world size W; rank r
holds elements ``[r * S, (r + 1) * S)`` with ``S = ceil(numel / W)``. The optimizer's state of a
flat parameter (``exp_avg``, ``exp_avg_sq``) has the same layout; ``step`` is one scalar.

The files do not record which parameters a unit holds: the caller proposes units (from the
model and the wrap policy), and :func:`check` proves them against the saved shard lengths.
Pure arithmetic; no tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import BadInput


@dataclass(frozen=True)
class Unit:
    """One flat parameter: ``(fqn, shape)`` of each parameter it holds, in flat order."""

    params: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.params)

    def shard(self, world_size: int) -> int:
        """Elements each rank holds (the padded length over ``world_size``)."""
        return -(-self.numel // world_size)


def check(units: Sequence[Unit], world_size: int, local: Mapping[int, int], *, what: str) -> None:
    """Refuse units that do not give the saved shard lengths (``local[k]``: elements rank 0
    holds of flat parameter k): the files were wrapped otherwise than proposed."""
    if len(units) != len(local):
        raise BadInput(f"{what}: the optimizer holds {len(local)} flat parameters, but the model's units "
                       f"make {len(units)}; it was wrapped otherwise (another auto-wrap policy, LoRA, "
                       "min_num_params), which the files do not record")
    for k, unit in enumerate(units):
        if k not in local or unit.shard(world_size) != local[k]:
            first = unit.params[0][0] if unit.params else "(empty)"
            raise BadInput(f"{what}: flat parameter {k} holds {local.get(k)} elements per rank, but the unit "
                           f"starting at {first} ({len(unit.params)} parameters, {unit.numel} elements) gives "
                           f"{unit.shard(world_size)} at {world_size} ranks; it was wrapped otherwise, which the "
                           "files do not record")


def parts(unit: Unit, world_size: int, rank: int) -> list[tuple[str, tuple[int, ...], int, int, int]]:
    """The parameters' element ranges in ``rank``'s shard: ``(fqn, shape, start, stop, at)``,
    elements ``[start, stop)`` of the flattened parameter at element ``at`` of the shard."""
    size = unit.shard(world_size)
    lo, hi = rank * size, (rank + 1) * size
    out, pos = [], 0
    for fqn, shape in unit.params:
        n = math.prod(shape)
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            out.append((fqn, shape, a - pos, b - pos, a - lo))
        pos += n
    return out


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Rectangles ``(offsets, sizes)`` covering elements ``[start, stop)`` of a row-major tensor
    of ``shape``, in element order (at most two per dimension)."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    rest = tuple(shape[1:])

    def row(r: int, a: int, b: int) -> list:
        return [((r, *o), (1, *s)) for o, s in boxes(rest, a, b)]

    if r0 == r1:
        return row(r0, c0, c1)
    out = []
    if c0:
        out += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0, *([0] * len(rest))), (r1 - r0, *rest)))
    if c1:
        out += row(r1, 0, c1)
    return out
