"""ckpt-tools: inspect, convert, export, reshard, shard and verify PyTorch (FSDP) checkpoints.

Every ``ckpt`` command is also a plain function here::

    import ckpt_tools
    info = ckpt_tools.inspect("checkpoints/global_step_100/actor")
"""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import BadInput, CkptError, DestinationError, UsageError, VerifyFailed  # noqa: E402
from .convert import convert, export, reshard  # noqa: E402
from .estimate import estimate  # noqa: E402
from .inspect import inspect  # noqa: E402


def __getattr__(name: str):
    # `shard` and `verify` need torch; importing it costs over a second, so they load on first use
    if name == "shard":
        from .shard import shard

        return shard
    if name == "verify":
        from .verify import verify

        return verify
    raise AttributeError(f"module 'ckpt_tools' has no attribute {name!r}")


__all__ = ["__version__", "inspect", "convert", "export", "reshard", "shard", "verify", "estimate",
           "CkptError", "BadInput", "DestinationError", "UsageError", "VerifyFailed"]
