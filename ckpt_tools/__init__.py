"""ckpt-tools: inspect, convert, export, reshard, shard and verify PyTorch (FSDP) checkpoints.

Every ``ckpt`` command is also a plain function here::

    import ckpt_tools
    info = ckpt_tools.inspect("checkpoints/global_step_100/actor")

The functions are imported on first use: ``import ckpt_tools`` itself is instant, so the
``ckpt`` program can set up its Ctrl-C handling before anything heavy loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import BadInput, CkptError, DestinationError, UsageError, VerifyFailed

if TYPE_CHECKING:
    from .commands.convert import convert, export, reshard
    from .commands.estimate import estimate
    from .commands.inspect import inspect
    from .commands.latest import latest
    from .commands.shard import shard
    from .commands.verify import verify

__all__ = ["__version__", "inspect", "convert", "export", "reshard", "shard", "verify", "estimate", "latest",
           "CkptError", "BadInput", "DestinationError", "UsageError", "VerifyFailed"]


def __getattr__(name: str) -> Any:
    if name in ("convert", "export", "reshard"):
        from .commands import convert as module
    elif name == "estimate":
        from .commands import estimate as module
    elif name == "inspect":
        from .commands import inspect as module
    elif name == "latest":
        from .commands import latest as module
    elif name == "shard":
        from .commands import shard as module
    elif name == "verify":
        from .commands import verify as module
    else:  # a subpackage (ckpt_tools.formats, ...), as an eager import would have made it an attribute
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
