"""The options of ``convert``, ``export`` and ``reshard``, checked once, where they are built."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from .. import layouts
from ..core.dtypes import DType
from ..core.state import RANK_LOCAL_POLICIES
from ..errors import UsageError
from ..formats import FORMATS
from ..naming.lora import MODES as LORA_MODES
from ..runtime import env

DTYPES = {"bf16": DType("bfloat16"), "fp16": DType("float16"), "fp32": DType("float32")}


@dataclass(frozen=True)
class Options:
    """What a conversion was asked to do, checked once, here, where it is built (the CLI's flags
    and the API's keywords both come through it); the rest of the command trusts it."""

    to: str
    world_size: int | None = None
    dtype: str | None = None
    max_shard_size: str | int = "5GB"
    model_only: bool = False
    base: str | None = None
    overwrite: bool = False
    progress: bool = True
    rank_local: str = "drop"
    workers: int = 1
    layout: str | None = None
    lora: str | None = None
    lora_alpha: float | None = None
    # ``export``: the output must be a directory ``from_pretrained`` loads (config included),
    # or nothing is written; ``convert --to hf`` writes the weights alone when there is no config
    loadable: bool = False
    # ``convert --to dcp --keys model=model,optimizer=optim``: top-level keys of the DCP renamed
    keys: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.to not in FORMATS:
            raise UsageError(f"--to must be one of {', '.join(FORMATS)}, not {self.to!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        self.output  # a layout not written in that format: a usage error
        if self.world_size is not None and self.world_size < 1:
            raise UsageError(f"--world-size must be at least 1, not {self.world_size}")
        if self.workers < 1:
            raise UsageError(f"--workers must be at least 1, not {self.workers}")
        if self.rank_local not in RANK_LOCAL_POLICIES:
            raise UsageError(f"--rank-local must be one of {', '.join(RANK_LOCAL_POLICIES)}, not {self.rank_local!r}")
        if self.keys and self.to != "dcp":
            raise UsageError(f"--keys names the top-level keys of a DCP; it applies to --to dcp, not --to {self.to}")
        if len({new for _, new in self.keys}) != len(self.keys) or any(not a or not b for a, b in self.keys):
            raise UsageError(f"--keys must map each key to a distinct, non-empty name ({dict(self.keys)})")
        if self.lora is not None and self.lora not in LORA_MODES:
            raise UsageError(f"--lora must be one of {', '.join(LORA_MODES)}, not {self.lora!r}")

    @property
    def cast(self) -> DType | None:
        return DTYPES[self.dtype] if self.dtype else None

    @property
    def output(self) -> layouts.Output | None:
        """The framework layout ``--layout`` asks to write (None: the source's is kept, if any)."""
        return layouts.output(self.layout, self.to)

    @property
    def model_alone(self) -> bool:
        """Only the model is written: asked for, or the format holds nothing else."""
        return self.model_only or self.to == "hf"


def say(message: str, progress: bool) -> None:
    """A progress line (what the command is doing): ``--quiet`` (``progress=False``) hides it."""
    if progress:
        print(message, file=sys.stderr)


def note(message: str) -> None:
    """A ``warning:`` or ``note:`` line: printed even with ``--quiet``, which hides progress
    only (CONTRACT.md); once per torchrun launch, by rank 0."""
    if env.rank() == 0:
        print(message, file=sys.stderr)
