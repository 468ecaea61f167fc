"""Reading FSDP1 ``SHARDED_STATE_DICT`` files (ShardedTensor) without a process group.

A saved ShardedTensor unpickles into torch's own class only inside its job (its
``__setstate__`` asks the process group for ranks). Under ``weights_only`` loading we map the
class name onto :class:`SavedShardedTensor`, which keeps what the file holds — local shards
and their metadata — and nothing else. The pickle reaches ``ShardedTensor.ProcessGroupState``
through ``getattr``; only that one attribute lookup is allowed.
"""

from __future__ import annotations

from typing import Any

import torch

_API = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"


class SavedShardedTensor(torch.Tensor):
    """The data of a saved ShardedTensor: ``local_shards()`` and ``metadata()``."""

    class ProcessGroupState:
        def __init__(self, *args: Any) -> None:
            self.args = args

        def __setstate__(self, state: Any) -> None:
            self.__dict__.update(state if isinstance(state, dict) else {"state": state})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError("a ShardedTensor read from a file holds its local shards only")

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) < 4:
            raise ValueError("unexpected ShardedTensor state")
        self._saved_shards, self._saved_metadata, self._saved_pg_state = state[0], state[1], state[2]

    def local_shards(self) -> list:
        return list(self._saved_shards)

    def metadata(self) -> Any:
        return self._saved_metadata


def _getattr(obj: Any, name: str) -> Any:
    if obj is SavedShardedTensor and name == "ProcessGroupState":
        return SavedShardedTensor.ProcessGroupState
    raise ValueError(f"getattr({obj!r}, {name!r}) is not allowed in a checkpoint")


def safe_globals() -> list:
    """Allow-list entries for ``torch.serialization.safe_globals`` that read FSDP1 files."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import (
        MEM_FORMAT_ENCODING, ShardedTensorMetadata, TensorProperties,
    )
    from torch.distributed._shard.sharded_tensor.shard import Shard
    from torch.distributed._shard.sharding_spec.chunk_sharding_spec import ChunkShardingSpec
    from torch.distributed.remote_device import _remote_device

    return [
        ShardMetadata, Shard, ShardedTensorMetadata, MEM_FORMAT_ENCODING, TensorProperties,
        ChunkShardingSpec, _remote_device, torch._utils._rebuild_wrapper_subclass,
        (SavedShardedTensor, _API),
        (SavedShardedTensor.ProcessGroupState, _API + ".ProcessGroupState"),
        (_getattr, "builtins.getattr"), (_getattr, "__builtin__.getattr"),
    ]


def is_sharded_tensor(value: Any) -> bool:
    return isinstance(value, SavedShardedTensor) or type(value).__name__ == "ShardedTensor"
