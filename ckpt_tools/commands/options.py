"""The options of ``convert``, ``export`` and ``reshard``, checked once, where they are built."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from .. import layouts
from ..core.dtypes import DType
from ..core.state import RANK_LOCAL_POLICIES
from ..errors import UsageError
from ..formats import FORMATS
from ..naming.lora import MODES as LORA_MODES
from ..naming.quant import QUANTIZE
from ..runtime import env

DTYPES = {"bf16": DType("bfloat16"), "fp16": DType("float16"), "fp32": DType("float32")}
# torch's own names for them, accepted as well (any case)
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def choose(flag: str, value: str, choices: tuple[str, ...] | list[str], aliases: dict[str, str] | None = None) -> str:
    """``value`` as one of ``choices``, in any case or under one of ``aliases``; else a usage
    error listing them, with a "did you mean" when one is close.

    Example: ``choose("--to", "HF", FORMATS) == "hf"``; ``choose("--dtype", "bfloat16", ...) == "bf16"``
    """
    import difflib

    key = str(value).strip().lower()
    if key in choices:
        return key
    if aliases and key in aliases:
        return aliases[key]
    close = difflib.get_close_matches(key, [*choices, *(aliases or {})], n=1, cutoff=0.6)
    hint = f"; did you mean {(aliases or {}).get(close[0], close[0])}?" if close else ""
    raise UsageError(f"{flag} must be one of {', '.join(choices)}, not {value!r}{hint}")

# --max-shard-size units: decimal as Hugging Face's (5GB = 5 * 10**9 bytes), binary with an "i"
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]I?)?B?\s*", re.IGNORECASE)


def parse_size(size: str | int) -> int:
    """``--max-shard-size`` in bytes: a plain byte count, or a number with a unit, any case:
    K/KB, M/MB, G/GB, T/TB (powers of 1000, as Hugging Face's ``5GB``) or KiB, MiB, GiB, TiB
    (powers of 1024). Zero, negative or unreadable sizes are a usage error (exit 2).

    Example: ``parse_size("2GiB") == 2147483648``; ``parse_size("500M") == 500_000_000``
    """
    if isinstance(size, bool):
        raise UsageError(f"--max-shard-size {size!r}: give a size such as 5GB, 500MB, 2GiB or a byte count")
    if isinstance(size, int):
        n = size
    else:
        m = _SIZE.fullmatch(str(size))
        if m is None:
            raise UsageError(f"--max-shard-size {size!r}: give a size such as 5GB, 500MB, 2GiB or a byte count")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if n < 1:
        raise UsageError(f"--max-shard-size {size!r}: a shard must be allowed at least one byte "
                         "(a tensor larger than it gets a shard of its own)")
    return n


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
    dry_run: bool = False  # plan only: nothing written, DST not created
    # ``export --quantize``: fp8-block or fp8-dynamic codes + scales for the linear weights
    quantize: str | None = None
    # ``--no-arch-check``: HF names written without asking the architecture (a ``warning:`` says so)
    arch_check: bool = True
    # ``convert --to dcp --keys model=model,optimizer=optim``: top-level keys of the DCP renamed
    keys: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "to", choose("--to", self.to, FORMATS))
        if self.dtype is not None:
            object.__setattr__(self, "dtype", choose("--dtype", self.dtype, tuple(DTYPES), DTYPE_ALIASES))
        self.output  # a layout not written in that format: a usage error
        object.__setattr__(self, "max_shard_size", parse_size(self.max_shard_size))
        if self.world_size is not None and self.world_size < 1:
            raise UsageError(f"--world-size must be at least 1, not {self.world_size}")
        if self.workers < 1:
            raise UsageError(f"--workers must be at least 1, not {self.workers}")
        if self.rank_local not in RANK_LOCAL_POLICIES:
            raise UsageError(f"--rank-local must be one of {', '.join(RANK_LOCAL_POLICIES)}, not {self.rank_local!r}")
        if self.quantize is not None and (self.quantize not in QUANTIZE or self.to != "hf"):
            raise UsageError(f"--quantize must be one of {', '.join(QUANTIZE)} (export only), not {self.quantize!r}")
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
