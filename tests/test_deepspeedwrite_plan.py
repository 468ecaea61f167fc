"""Where a DeepSpeed ZeRO save written at another world size puts each parameter's elements:
the pure layout rules of :mod:`ckpt_tools.formats.deepspeedwrite`, with small numbers and the
lengths seen in real DeepSpeed 0.19.8 saves (``tests/test_deepspeed.py`` loads the written files
in DeepSpeed itself)."""

from __future__ import annotations

import pytest

from ckpt_tools.formats.deepspeedwrite import fragments, stage3_segments, stage12_partitions, stage12_segments

# the tiny Llama at hidden 50 (tests/fw_deepspeed.py): 44850 elements in one group
LLAMA50 = 44850


@pytest.mark.parametrize("world, want", [
    # seen in real saves: ZeRO 1 bf16 at 2 ranks (22426 + 22426, rank 1 padded by 2),
    # ZeRO 2 at 3 ranks (14950 each, no padding: 44850 divides 6)
    (2, [(0, 22426, 0), (22426, 22426, 2)]),
    (3, [(0, 14950, 0), (14950, 14950, 0), (29900, 14950, 0)]),
    # 44850 padded to a multiple of 2 * 4
    (4, [(0, 11214, 0), (11214, 11214, 0), (22428, 11214, 0), (33642, 11214, 6)]),
])
def test_stage12_partitions_as_deepspeed_cuts_them(world, want):
    assert stage12_partitions([LLAMA50], [0], world) == want


def test_stage12_partition_wholly_padding():
    """More ranks than elements: the last ranks hold padding only (DeepSpeed's group_paddings)."""
    assert stage12_partitions([3], [0], 4) == [(0, 2, 0), (2, 2, 1), (4, 2, 2), (6, 2, 2)]


def test_stage12_segments_straddle_and_pad():
    params, align = [("a", 5), ("b", 4)], [1, 0]  # a, one alignment zero, b: 10 elements
    assert stage12_segments(params, align, 0, 4) == [("a", 0, 4)]
    assert stage12_segments(params, align, 4, 8) == [("a", 4, 5), (None, 0, 1), ("b", 0, 2)]
    assert stage12_segments(params, align, 8, 12) == [("b", 2, 4), (None, 0, 2)]
    assert fragments(params, align, 4, 8) == [("a", 1, 0), ("b", 2, 2)]


def test_stage3_segments_pad_each_parameter():
    params = [("w", 5050), ("n", 50)]
    assert stage3_segments(params, 3, 0) == [("w", 0, 1684), ("n", 0, 17)]
    assert stage3_segments(params, 3, 2) == [("w", 3368, 5050), (None, 0, 2), ("n", 34, 50), (None, 0, 1)]
    # a parameter smaller than the world: the last ranks hold its padding only
    assert stage3_segments([("s", 2)], 3, 2) == [(None, 0, 1)]
