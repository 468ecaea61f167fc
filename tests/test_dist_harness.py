"""Smoke tests for the multi-rank harness in tests/dist.py."""

import pytest
import torch
import torch.distributed as dist

try:
    from dist import run_ranks
except ImportError:  # tests/ imported as a package
    from tests.dist import run_ranks


def _all_reduce_body(rank, world_size, offset):
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": t.item()}


def _raising_body(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one")
    # The healthy ranks block in a collective the failing rank never joins.
    dist.barrier()
    return rank


def test_all_reduce_three_ranks(tmp_path):
    out = run_ranks(_all_reduce_body, 3, tmp_path, 10, timeout=120)
    assert out == [{"rank": r, "world_size": 3, "sum": 33.0} for r in range(3)]


def test_raising_rank_surfaces(tmp_path):
    with pytest.raises(RuntimeError, match="boom from rank one") as info:
        run_ranks(_raising_body, 3, tmp_path, timeout=120)
    assert "rank 1 raised" in str(info.value)
    assert "ValueError" in str(info.value)
