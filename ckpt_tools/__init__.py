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
from .shard import shard  # noqa: E402
from .verify import verify  # noqa: E402


__all__ = ["__version__", "inspect", "convert", "export", "reshard", "shard", "verify", "estimate",
           "CkptError", "BadInput", "DestinationError", "UsageError", "VerifyFailed"]
