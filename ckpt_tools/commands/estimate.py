"""How much memory training a model takes per rank under DDP and FSDP (``ckpt estimate``).

Counts parameters without loading any weights: from the safetensors headers when the model
directory has them, else from ``config.json`` by building the model on the meta device.

The memory model (parameters + gradients + optimizer state; activations, temporary buffers,
the CUDA context and allocator fragmentation are not counted):

- Default, fp32 + AdamW: fp32 parameters (4 B), fp32 gradients (4 B), AdamW ``exp_avg`` and
  ``exp_avg_sq`` in fp32 (8 B): 16 B per parameter.
- DDP: every rank holds all of it.
- FSDP (FSDP2 ``fully_shard``, ZeRO-3): every rank holds one shard of each parameter, gradient
  and optimizer state. Shards follow fully_shard's ``Shard(0)`` split, padded to
  ``ceil(dim0 / ranks)`` rows on every rank, so uneven first dimensions cost a little more than
  ``16 * params / ranks``.
- One rule for the unit FSDP gathers, with every option: FSDP's GPU bytes add the unsharded copy
  of the largest FSDP unit (units: each numbered block such as ``model.layers.3``, plus the root
  holding everything else, e.g. embeddings and ``lm_head``) in the compute dtype: fp32 (4 B/param)
  by default, bf16/fp16 (2 B/param) with ``mixed_precision``. Prefetching a second unit is not
  counted.
- ``mixed_precision="bf16"``/``"fp16"`` (FSDP2 ``MixedPrecisionPolicy``, autocast for DDP): master
  parameters, gradients and optimizer state stay fp32; DDP adds a full 2 B/param working copy,
  FSDP the gathered unit in that dtype (above).
- ``cpu_offload=True`` (FSDP2 ``CPUOffloadPolicy``; DDP has no offload and is unchanged): FSDP's
  sharded parameters, gradients and optimizer state live in CPU memory; the GPU holds the
  gathered unit (above).

Known limits: safetensors counts take floating-point tensors only (quantized checkpoints are
undercounted); ``trust_remote_code`` models cannot be built from their config.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import BadInput, UsageError, count
from ..formats import hf
from ..hf import archcheck
from ..hf.hub import resolve_model_dir
from ..hf.models import build_from_config, require_transformers
from ..naming import experts

FP32 = 4
LOW_PRECISION_BYTES = {"bf16": 2, "fp16": 2}
ADAMW_STATES = 2  # exp_avg, exp_avg_sq
CONFIG_PATTERNS = ("config.json",)
ROOT_UNIT = "(root)"


@dataclass(frozen=True)
class Placement:
    """Bytes one rank holds in one kind of memory (GPU or CPU)."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def to_json(self) -> dict[str, int]:
        return {"params_bytes": self.params, "grads_bytes": self.grads, "optimizer_bytes": self.optimizer}


@dataclass(frozen=True)
class StrategyMemory:
    """Per-rank memory of one strategy: ``gpu`` on the accelerator, ``cpu`` offloaded."""

    gpu: Placement
    cpu: Placement = field(default_factory=Placement)

    def to_json(self) -> dict:
        return {"per_rank_bytes": self.gpu.total, **self.gpu.to_json(),
                "cpu_per_rank_bytes": self.cpu.total, "cpu": self.cpu.to_json()}


@dataclass(frozen=True)
class Estimate:
    """The answer of :func:`estimate`; ``to_json()`` for scripts, ``table()`` for people."""

    model: str
    source: str  # "safetensors" (headers) or "config" (meta-device model)
    params: int
    ranks: int
    mixed_precision: str | None
    cpu_offload: bool
    largest_unit: str
    largest_unit_params: int
    ddp: StrategyMemory
    fsdp: StrategyMemory
    active_params: int | None = None  # what one token uses (MoE: its top-k routed experts only)
    moe: dict | None = None  # {"num_experts", "layout"}, None for a dense model

    def to_json(self) -> dict:
        return {
            "model": self.model, "source": self.source, "params": self.params, "ranks": self.ranks,
            "active_params": self.active_params, "moe": self.moe,
            "options": {"optimizer": "adamw", "master_dtype": "fp32",
                        "mixed_precision": self.mixed_precision, "cpu_offload": self.cpu_offload},
            "largest_unit": {"name": self.largest_unit, "params": self.largest_unit_params},
            "ddp": self.ddp.to_json(), "fsdp": self.fsdp.to_json(),
        }

    def table(self) -> str:
        src = "safetensors headers" if self.source == "safetensors" else "config.json on the meta device"
        mp = f", {self.mixed_precision} mixed precision" if self.mixed_precision else ""
        lines = [
            f"{self.model}: {self.params:,} parameters ({_count(self.params)}, from {src}), {count(self.ranks, 'rank')}"
            + (f"; {self.moe['num_experts']} experts, {_count(self.active_params)} active per token"
               if self.moe and self.active_params is not None else ""),
            f"fp32 master weights and grads, AdamW fp32 moments (16 B/param){mp}"
            f"{', FSDP CPU offload' if self.cpu_offload else ''}; activations not counted; GB = 10^9 B",
            "",
            f"{'':<6}{'params':>11}{'grads':>11}{'optimizer':>11}{'GPU/rank':>11}{'CPU/rank':>11}",
        ]
        for name, mem in (("DDP", self.ddp), ("FSDP", self.fsdp)):
            g = mem.gpu
            cpu = _bytes(mem.cpu.total) if mem.cpu.total else "-"
            lines.append(f"{name:<6}{_bytes(g.params):>11}{_bytes(g.grads):>11}{_bytes(g.optimizer):>11}"
                         f"{_bytes(g.total):>11}{cpu:>11}")
        lines.append(f"\nFSDP GPU/rank includes the largest unit gathered unsharded: {self.largest_unit} "
                     f"({_count(self.largest_unit_params)} params, {self.mixed_precision or 'fp32'})")
        return "\n".join(lines)


def _count(n: int) -> str:
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _bytes(n: int) -> str:
    for div, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def estimate(model: str, *, ranks: int, mixed_precision: str | None = None,
             cpu_offload: bool = False) -> Estimate:
    """Estimate per-rank training memory of ``model`` under DDP and FSDP (see the module docstring).

    Args:
        model: a local Hugging Face model directory or a hub repo id (only ``config.json`` is
            fetched; ``HF_HUB_OFFLINE=1`` and the cache are honoured).
        ranks: number of ranks (GPUs), at least 1.
        mixed_precision: ``None`` (fp32), ``"bf16"`` or ``"fp16"``.
        cpu_offload: FSDP keeps sharded state in CPU memory.

    Returns:
        An :class:`Estimate`.

    Raises:
        UsageError: ``ranks < 1`` or an unknown ``mixed_precision``.
        BadInput: the model cannot be found, or its config or headers cannot be read.

    Example: ``estimate("meta-llama/Llama-2-7b-hf", ranks=4).fsdp.gpu.total  # ~27e9``
    """
    _check_options(ranks, mixed_precision)
    model_dir = resolve_model_dir(model, allow_patterns=CONFIG_PATTERNS)
    shapes, source = read_param_shapes(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if source == "safetensors" and isinstance(config, dict):  # (buffers are in the files, not trained)
        shapes = archcheck.parameters_only(shapes, config)
    found = plan_memory(shapes, ranks=ranks, mixed_precision=mixed_precision,
                        cpu_offload=cpu_offload, model=model, source=source)
    return replace(found, active_params=experts.active_params(shapes, config if isinstance(config, dict) else {}),
                   moe=experts.summary(shapes))


def _check_options(ranks: int, mixed_precision: str | None) -> None:
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise UsageError(f"--ranks must be a whole number of at least 1, got {ranks!r}")
    if mixed_precision is not None and mixed_precision not in LOW_PRECISION_BYTES:
        raise UsageError(f"--mixed-precision must be one of {', '.join(LOW_PRECISION_BYTES)}, "
                         f"got {mixed_precision!r}; leave it out for fp32")


def unit_of(name: str) -> str:
    """The FSDP unit a parameter falls in: its numbered block (``model.layers.3``) or the root."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ROOT_UNIT


def plan_memory(shapes: Mapping[str, Sequence[int]], *, ranks: int, mixed_precision: str | None = None,
                cpu_offload: bool = False, model: str = "", source: str = "") -> Estimate:
    """Pure part of :func:`estimate`: memory figures from parameter names and shapes."""
    _check_options(ranks, mixed_precision)
    params = sum(math.prod(s) for s in shapes.values())
    # fully_shard pads dim 0 to a multiple of ranks: every rank allocates ceil(dim0 / ranks) rows
    shard = sum(-(-(s[0] if s else 1) // ranks) * math.prod(s[1:]) for s in shapes.values())
    units: dict[str, int] = {}
    for name, s in shapes.items():
        units[unit_of(name)] = units.get(unit_of(name), 0) + math.prod(s)
    unit, unit_params = max(units.items(), key=lambda kv: kv[1], default=(ROOT_UNIT, 0))
    low = LOW_PRECISION_BYTES.get(mixed_precision or "", 0)

    ddp = StrategyMemory(Placement(FP32 * params + low * params, FP32 * params, ADAMW_STATES * FP32 * params))
    sharded = Placement(FP32 * shard, FP32 * shard, ADAMW_STATES * FP32 * shard)
    gathered = (low or FP32) * unit_params  # the one rule: the largest unit, unsharded, in the compute dtype
    if cpu_offload:
        fsdp = StrategyMemory(gpu=Placement(params=gathered), cpu=sharded)
    else:
        fsdp = StrategyMemory(Placement(sharded.params + gathered, sharded.grads, sharded.optimizer))
    return Estimate(model=model, source=source, params=params, ranks=ranks, mixed_precision=mixed_precision,
                    cpu_offload=cpu_offload, largest_unit=unit, largest_unit_params=unit_params,
                    ddp=ddp, fsdp=fsdp)


def read_param_shapes(model_dir: Path) -> tuple[dict[str, tuple[int, ...]], str]:
    """Parameter names and shapes of the model in ``model_dir``, and where they came from.

    Safetensors headers win when every weight file is present (no tensor data is read); else the
    model is built from ``config.json`` on the meta device, tied weights counted once.
    """
    files = _safetensors_files(model_dir)
    if files:
        shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            shapes.update(_header_shapes(f))
        return shapes, "safetensors"
    return _meta_model_shapes(model_dir), "config"


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise BadInput(f"{index}: not a safetensors index (no weight_map); re-download it") from e
        files = sorted(model_dir / n for n in names)
        # a config-only hub download can bring the index without the shards: use the config then
        return files if all(f.is_file() for f in files) else []
    single = model_dir / "model.safetensors"
    return [single] if single.is_file() else []


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the floating-point tensors a safetensors header lists (no data read).

    Lenient on purpose: only names, shapes and dtypes are needed, so the entries' byte ranges
    are not checked as a read of the data would (see :func:`~ckpt_tools.formats.hf.read_header`).
    """
    try:
        entries = hf.read_raw_header(path).entries
        # integer tensors (position_ids buffers, quantization indices) are not trainable parameters
        return {name: tuple(info["shape"]) for name, info in entries.items()
                if info["dtype"].startswith(("F", "BF"))}
    except (BadInput, OSError, KeyError, TypeError, AttributeError) as e:
        reason = str(e).removeprefix(f"{path}: ")  # the header reader's messages name the file already
        raise BadInput(f"{path}: not a readable safetensors file ({reason}); re-download or re-save it") from e


def _meta_model_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise BadInput(f"{model_dir}: no config.json and no model.safetensors; pass a Hugging Face "
                       "model directory (or hub repo id) that has its config.json")
    import torch  # deferred: torch and transformers take seconds to import

    require_transformers(f"{config_path}: counting parameters from a config")
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(model_dir)
    except Exception as e:  # transformers' validators raise their own classes (not ValueError)
        raise BadInput(f"{config_path}: transformers cannot read this config ({e}); check its "
                       "model_type, or upgrade transformers") from e
    try:
        with torch.device("meta"):
            model = build_from_config(config)
    except Exception as e:  # any failure here is the config's: inconsistent sizes, unknown class
        raise BadInput(f"{config_path}: cannot build the model from this config ({type(e).__name__}: {e})") from e
    # named_parameters() yields a tied weight (lm_head = embed_tokens) once
    return {name: tuple(p.shape) for name, p in model.named_parameters()}
