"""FSDP1 ``SHARDED_STATE_DICT`` tensors written for another world size.

FSDP1 saves each parameter (and each optimizer moment) as a ShardedTensor: rank r holds the
rows ``torch.chunk`` gives it on dim 0 (none when the chunks run out), and the pickle records
the shards' layout and the rank and world size that saved it. A job loading such a file checks
both against its own, so a resharded file must say the new rank and world size exactly as a
job of that size would have written them (torch's ``_create_chunk_sharded_tensor``).

The value written is a stand-in whose pickle is the one a ShardedTensor gives: a real
ShardedTensor cannot be pickled outside a process group, and none is needed to describe it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ..core.describe import chunk_rows

if TYPE_CHECKING:
    import torch

KIND = "FSDP1 (ShardedTensor)"  # what the sharded format's description calls such files


class Saved:
    """Pickles as the ShardedTensor of global ``shape`` whose rank ``rank`` of ``world_size``
    holds ``local`` (its ``torch.chunk`` rows; None for a rank past the last chunk)."""

    def __init__(self, local: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                 rank: int, world_size: int) -> None:
        import torch
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
        from torch.distributed._shard.sharded_tensor.shard import Shard
        from torch.distributed._shard.sharding_spec.api import _infer_sharding_spec_from_shards_metadata

        rows = [chunk_rows(shape[0], world_size, r) for r in range(world_size)]
        rows = [(start, stop) for start, stop in rows if stop > start] or [(0, 0)]
        metas = [ShardMetadata([start] + [0] * (len(shape) - 1), [stop - start, *shape[1:]], f"rank:{r}/cpu")
                 for r, (start, stop) in enumerate(rows)]
        self.local_shards = [] if local is None else [Shard(local, metas[rank])]
        self.metadata = ShardedTensorMetadata(
            shards_metadata=metas, size=torch.Size(shape),
            tensor_properties=TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                                               memory_format=torch.contiguous_format, pin_memory=False))
        self.spec = _infer_sharding_spec_from_shards_metadata(metas)
        self.shape, self.dtype, self.rank, self.world_size = tuple(shape), dtype, rank, world_size

    def __reduce_ex__(self, protocol: int) -> tuple:
        import torch
        from torch.distributed._shard.sharded_tensor.api import ShardedTensor

        # what ShardedTensor.__getstate__ returns in a job of this rank and world size
        # (one process group: local and global ranks are the same)
        pg_state = ShardedTensor.ProcessGroupState(self.rank, self.rank, self.world_size, self.world_size)
        state = (self.local_shards, self.metadata, pg_state, self.spec, False)
        stride = tuple(math.prod(self.shape[i + 1:]) for i in range(len(self.shape)))
        args = (ShardedTensor, self.dtype, torch.Size(self.shape), stride, 0, torch.strided,
                torch.device("cpu"), False)
        return torch._tensor._rebuild_from_type_v2, (torch._utils._rebuild_wrapper_subclass, ShardedTensor, args, state)


def has_rows(shape: tuple[int, ...], world_size: int, rank: int) -> bool:
    start, stop = chunk_rows(shape[0], world_size, rank)
    return stop > start


def value(local: Any, shape: tuple[int, ...], dtype: torch.dtype, rank: int, world_size: int) -> Saved:
    return Saved(local if has_rows(shape, world_size, rank) else None, shape, dtype, rank, world_size)
