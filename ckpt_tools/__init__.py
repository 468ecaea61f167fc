"""ckpt-tools: inspect, convert, export, reshard, shard and verify PyTorch (FSDP) checkpoints.

Every ``ckpt`` command is also a plain function here::

    import ckpt_tools
    info = ckpt_tools.inspect("checkpoints/global_step_100/actor")
"""

from __future__ import annotations

from ._version import __version__
from .errors import BadInput, CkptError, DestinationError, UsageError, VerifyFailed  # noqa: E402
from .commands.convert import convert, export, reshard  # noqa: E402
from .commands.estimate import estimate  # noqa: E402
from .commands.inspect import inspect  # noqa: E402
from .commands.latest import latest  # noqa: E402
from .commands.shard import shard  # noqa: E402
from .commands.verify import verify  # noqa: E402


__all__ = ["__version__", "inspect", "convert", "export", "reshard", "shard", "verify", "estimate", "latest",
           "CkptError", "BadInput", "DestinationError", "UsageError", "VerifyFailed"]
