"""Quantized Hugging Face checkpoints: which tensors are codes, which are their scales, and how
they line up (block FP8, MXFP4, compressed-tensors FP8), read from ``quantization_config``;
and the tensors and config an ``export --quantize`` writes.

Everything here is planning: a quantized weight becomes a :class:`~ckpt_tools.core.plan.Target`
whose values are computed (``Computed("dequant", ...)`` with its scale as input); the arithmetic
is :mod:`ckpt_tools.storage.lowp`'s. What cannot be proven right (an unknown ``quant_method``, a
scale missing or whose grid does not fit its weight) is refused, naming the tensor: float8 or
packed bytes are never written as if they were the weights.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..core.describe import TensorInfo
from ..core.dtypes import DType
from ..core.plan import Computed, Target
from ..errors import BadInput
from ..storage.lowp import Grid

METHODS = ("fp8", "mxfp4", "compressed-tensors")
FP8 = ("float8_e4m3fn", "float8_e5m2")
# tensors a dequantized checkpoint no longer needs: static activation scales
_DROPPED = (".input_scale", ".activation_scale", ".output_scale", ".k_scale", ".v_scale")
# weights an export leaves unquantized, as DeepSeek-V3, Qwen3-FP8 and llm-compressor do:
# embeddings, the output head, norms, MoE routers (MoE "gate" modules, not gate_proj)
_KEEP = re.compile(r"(^|\.)(lm_head|embed_tokens|wte|wpe|word_embeddings|embeddings|embed|router|gate|"
                   r"[a-z_]*norm[a-z_]*|shared_expert_gate)\.weight$")

QUANTIZE = ("fp8-block", "fp8-dynamic")


def config_of(config: dict) -> dict | None:
    """The ``quantization_config`` of a config (or of its ``text_config``), None without one."""
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    return q or None


def without_quantization(config: dict) -> dict:
    """``config`` as a dequantized checkpoint's: no ``quantization_config``."""
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    if isinstance(out.get("text_config"), dict) and "quantization_config" in out["text_config"]:
        out["text_config"] = {k: v for k, v in out["text_config"].items() if k != "quantization_config"}
    return out


@dataclass(frozen=True)
class Quantized:
    """A quantized checkpoint: its method, block size or scheme, and for each quantized weight
    (by source name) the computation that dequantizes it and the name it is written under;
    ``dropped``: scale and activation-scale tensors that a dequantized copy leaves out."""

    method: str
    detail: dict[str, Any]
    weights: dict[str, tuple[str, Computed]] = field(default_factory=dict)
    dropped: frozenset[str] = frozenset()

    def summary(self) -> dict[str, Any]:
        """What ``inspect --json`` reports as ``"quantization"``."""
        return {"method": self.method, **self.detail, "quantized_tensors": len(self.weights)}


def find(tensors: list[TensorInfo], config: dict, where: Any) -> Quantized | None:
    """The quantization of a checkpoint holding ``tensors`` with ``config``; None when the
    config names none and no tensor is float8. Raises BadInput (exit 3) for an unknown method,
    a scale without a weight, a weight without its scale, or a grid that does not fit."""
    q = config_of(config)
    by_name = {t.name: t for t in tensors if t.group == "model"}
    if q is None:
        fp8 = [n for n, t in by_name.items() if t.dtype in FP8]
        if fp8:
            raise BadInput(f"{where}: tensor {fp8[0]!r} is {by_name[fp8[0]].dtype} but config.json has no "
                           "quantization_config to say how its scales apply (none found beside the checkpoint; "
                           "pass --base MODEL with the quantized model's config), so it cannot be dequantized")
        return None
    method = q.get("quant_method")
    if method == "fp8":
        return _block_fp8(by_name, q, where)
    if method == "compressed-tensors":
        return _compressed_tensors(by_name, q, where)
    if method == "mxfp4":
        return _mxfp4(by_name, where)
    first = next((n for n, t in by_name.items() if not t.dtype.is_floating_point or t.dtype in FP8), None)
    raise BadInput(f"{where}: quantization_config names quant_method {method!r}, which ckpt does not know "
                   f"(it reads {', '.join(METHODS)}); tensor {first!r} and the like cannot be dequantized exactly")


def _grid(weight: TensorInfo, scale: TensorInfo, block: tuple[int, int], where: Any, *, e2m1: bool = False,
          transposed: bool = False) -> Grid:
    """How ``scale`` covers ``weight`` (codes [..., rows, cols]), or BadInput naming both."""
    if e2m1:  # [..., rows, groups, 16 bytes]: 32 values a group
        *lead, rows = weight.shape[:-2]
        cols = weight.shape[-2] * weight.shape[-1] * 2
    else:
        *lead, rows, cols = weight.shape
    grid = tuple(scale.shape[-2:]) if len(scale.shape) >= 2 else ()
    g = Grid(math.prod(lead), rows, cols, block, grid if len(grid) == 2 else (0, 0), e2m1, transposed)
    if len(scale.shape) != len(lead) + 2 or tuple(scale.shape[:-2]) != tuple(lead) or not g.fits():
        want = [*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1])]
        raise BadInput(f"{where}: scale {scale.name!r} has shape {list(scale.shape)}, which does not fit weight "
                       f"{weight.name!r} of shape {list(weight.shape)} in blocks of {list(block)} (expected {want})")
    return g


def _dequant(shape: tuple[int, ...], scale: TensorInfo, g: Grid) -> Computed:
    """The computation of a weight of ``shape`` from its codes and ``scale`` laid out by ``g``."""
    return Computed("dequant", shape, (scale,), (("grid", g),))


def _dropped(by_name: dict[str, TensorInfo]) -> set[str]:
    return {n for n in by_name if n.endswith(_DROPPED)}


def _pairs(by_name: dict[str, TensorInfo], suffix: str, where: Any, codes: tuple[str, ...]) -> dict[str, TensorInfo]:
    """weight name -> its scale tensor, for scales named ``<weight><suffix>``; every code tensor
    (dtype in ``codes``) must have one."""
    pairs = {}
    for n, t in by_name.items():
        if n.endswith("weight" + suffix):  # activation scales (input_scale, ...) are not weights' scales
            w = n[:-len(suffix)]
            if w not in by_name:
                raise BadInput(f"{where}: scale {n!r} has no weight {w!r}; the checkpoint is incomplete")
            pairs[w] = t
    for n, t in by_name.items():
        if t.dtype in codes and n not in pairs:
            raise BadInput(f"{where}: tensor {n!r} is {t.dtype} but its scale {n + suffix!r} is missing; "
                           "the checkpoint is incomplete (a shard or the index lacks it)")
    return pairs


def _block_fp8(by_name: dict[str, TensorInfo], q: dict, where: Any) -> Quantized:
    size = q.get("weight_block_size")
    if size is not None and (len(size) != 2 or not all(isinstance(x, int) and x > 0 for x in size)):
        raise BadInput(f"{where}: quantization_config weight_block_size {size!r} is not two positive integers")
    weights = {}
    for w, s in _pairs(by_name, "_scale_inv", where, FP8).items():
        t = by_name[w]
        if t.dtype not in FP8 or len(t.shape) < 2:
            raise BadInput(f"{where}: tensor {w!r} has a scale but is {t.dtype} {list(t.shape)}, not float8 codes")
        block = tuple(size) if size else tuple(t.shape[-2:])  # no block size: one scale per tensor
        weights[w] = (w, _dequant(t.shape, s, _grid(t, s, block, where)))
    detail = {"block_size": list(size) if size else None}
    if q.get("scale_fmt"):
        detail["scale_fmt"] = q["scale_fmt"]
    return Quantized("fp8", detail, weights, frozenset({n + "_scale_inv" for n in weights} | _dropped(by_name)))


def _ct_groups(q: dict, where: Any) -> list[dict]:
    fmt = q.get("format")
    groups = list((q.get("config_groups") or {}).values())
    formats = {g.get("format") or fmt for g in groups} or {fmt}
    if formats - {"float-quantized"}:
        raise BadInput(f"{where}: compressed-tensors format {sorted(map(str, formats))}: ckpt dequantizes only "
                       "float-quantized (FP8) weights")
    for g in groups:
        w = g.get("weights") or {}
        if w and (w.get("type") != "float" or w.get("num_bits") != 8 or not w.get("symmetric", True)):
            raise BadInput(f"{where}: compressed-tensors weights {w.get('type')} {w.get('num_bits')}-bit "
                           f"(symmetric {w.get('symmetric')}): ckpt dequantizes symmetric 8-bit float weights only")
    return groups


def _compressed_tensors(by_name: dict[str, TensorInfo], q: dict, where: Any) -> Quantized:
    groups = _ct_groups(q, where)
    blocks = {tuple(g["weights"]["block_structure"]) for g in groups
              if (g.get("weights") or {}).get("block_structure")}
    zp = [n for n in by_name if n.endswith(".weight_zero_point")]
    if zp:
        raise BadInput(f"{where}: tensor {zp[0]!r}: asymmetric (zero-point) weights are not dequantized by ckpt")
    weights, schemes = {}, set()
    for w, s in _pairs(by_name, "_scale", where, FP8).items():
        t = by_name[w]
        if t.dtype not in FP8 or len(t.shape) != 2:
            raise BadInput(f"{where}: tensor {w!r} has a scale but is {t.dtype} {list(t.shape)}, not 2-D float8 codes")
        rows, cols = t.shape
        if s.numel == 1:  # per tensor: [1] or []
            block, scheme = (rows, cols), "tensor"
            s_view = s if len(s.shape) == 2 else _as_2d(s)
        elif tuple(s.shape) == (rows, 1):
            block, scheme, s_view = (1, cols), "channel", s
        elif len(blocks) == 1:
            block, scheme, s_view = next(iter(blocks)), "block", s
        else:
            raise BadInput(f"{where}: scale {s.name!r} of shape {list(s.shape)} is neither per tensor, per channel nor "
                           f"a block grid named by quantization_config (weight {w!r} is {list(t.shape)})")
        schemes.add(scheme)
        # a per-tensor scale is read as a [1, 1] grid (the same bytes)
        weights[w] = (w, _dequant(t.shape, s_view, _grid(t, s_view, block, where)))
    detail = {"scheme": {"tensor": "FP8", "channel": "FP8_DYNAMIC", "block": "FP8_BLOCK"}[schemes.pop()]
              if len(schemes) == 1 else sorted(schemes) or None}
    if blocks:
        detail["block_size"] = list(next(iter(blocks)))
    return Quantized("compressed-tensors", detail, weights,
                     frozenset({n + "_scale" for n in weights} | _dropped(by_name)))


def _as_2d(t: TensorInfo) -> TensorInfo:
    from dataclasses import replace

    return replace(t, shape=(1, 1), chunks=tuple(c.replaced(offsets=(0, 0), sizes=(1, 1)) for c in t.chunks))


def _mxfp4(by_name: dict[str, TensorInfo], where: Any) -> Quantized:
    weights = {}
    dropped = set()
    for n, t in by_name.items():
        if not n.endswith("_blocks"):
            continue
        w = n[:-len("_blocks")]
        s = by_name.get(w + "_scales")
        if s is None:
            raise BadInput(f"{where}: tensor {n!r} has no scales {w + '_scales'!r}; the checkpoint is incomplete")
        if t.dtype != "uint8" or s.dtype != "uint8" or len(t.shape) != 4 or t.shape[-1] != 16:
            raise BadInput(f"{where}: tensor {n!r} is {t.dtype} {list(t.shape)} with scales {s.dtype} "
                           f"{list(s.shape)}; MXFP4 experts are uint8 [experts, rows, groups, 16] + uint8 scales")
        g = _grid(t, s, (1, 32), where, e2m1=True, transposed=True)
        e, rows = t.shape[0], t.shape[1]
        weights[n] = (w, _dequant((e, g.cols, rows), s, g))
        dropped.add(w + "_scales")
    orphans = [n for n in by_name if n.endswith("_scales") and n not in dropped]
    if orphans:
        raise BadInput(f"{where}: scales {orphans[0]!r} have no blocks {orphans[0][:-len('_scales')] + '_blocks'!r}")
    return Quantized("mxfp4", {"block_size": [1, 32]}, weights, frozenset(dropped | _dropped(by_name)))


def target(t: TensorInfo, name: str, cast: DType, quant: Quantized) -> Target:
    """The target of a kept tensor of a dequantized export: computed when it is a quantized weight."""
    found = quant.weights.get(t.name)
    if found is None:
        dtype = cast if t.dtype.is_floating_point and t.state != "step" else t.dtype
        return Target(t, t.group, name, dtype, t.param, t.state)
    new, comp = found
    name = name[:len(name) - (len(t.name) - len(new))]  # MXFP4: X_blocks is written as X
    return Target(t, t.group, name, cast, t.param, t.state, comp)


# -- export --quantize --------------------------------------------------------------------

def quantizable(t: TensorInfo) -> bool:
    """A 2-D floating ``*.weight`` of a linear layer: not an embedding, head, norm or router."""
    return (t.group == "model" and t.name.endswith(".weight") and len(t.shape) == 2 and t.dtype.is_floating_point
            and t.dtype not in FP8 and not _KEEP.search(t.name))


def quantize_targets(target: Target, scheme: str) -> list[Target]:
    """The targets that replace ``target`` (a weight) in a ``scheme`` export: codes + scale."""
    t, (rows, cols) = target, target.shape
    fp8 = DType("float8_e4m3fn")
    stem = t.name[:-len("weight")]
    if scheme == "fp8-block":
        block = (128, 128)
        grid = (math.ceil(rows / 128), math.ceil(cols / 128))
        return [Target(t.source, t.group, t.name, fp8, t.param, t.state,
                       Computed("quant_block_codes", (rows, cols), (), (("block", block),))),
                Target(t.source, t.group, stem + "weight_scale_inv", DType("float32"), None, None,
                       Computed("quant_block_scale", grid, (), (("block", block),)))]
    scale_dtype = t.dtype  # compressed-tensors keeps the scale in the model's dtype
    return [Target(t.source, t.group, t.name, fp8, t.param, t.state, Computed("quant_channel_codes", (rows, cols))),
            Target(t.source, t.group, stem + "weight_scale", scale_dtype, None, None,
                   Computed("quant_channel_scale", (rows, 1)))]


def unquantized_linears(names: list[str], shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The linear modules an export leaves unquantized (the output head, MoE routers), as
    ``modules_to_not_convert`` / ``ignore`` name them: ``lm_head`` always (a tied head too)."""
    out = ["lm_head"]
    for n in names:
        if len(shapes[n]) == 2 and _KEEP.search(n) and not re.search(r"(embed|wte|wpe|lm_head)", n):
            out.append(n[:-len(".weight")])
    return out


def quantization_config(scheme: str, kept: list[str]) -> dict:
    """The ``quantization_config`` of a ``scheme`` export; ``kept``: linear modules left unquantized."""
    if scheme == "fp8-block":
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": [128, 128], **({"modules_to_not_convert": kept} if kept else {})}
    # what llm-compressor 0.14 writes for FP8_DYNAMIC (fixtures/fp8_dynamic/quantized/config.json)
    args = {"actorder": None, "block_structure": None, "group_size": None, "num_bits": 8, "observer_kwargs": {},
            "scale_dtype": None, "symmetric": True, "type": "float", "zp_dtype": None}
    return {
        "config_groups": {"group_0": {
            "format": "float-quantized",
            "input_activations": {**args, "dynamic": True, "observer": None, "strategy": "token"},
            "output_activations": None, "targets": ["Linear"],
            "weights": {**args, "dynamic": False, "observer": "memoryless_minmax", "strategy": "channel"}}},
        "format": "float-quantized", "global_compression_ratio": None, "ignore": kept, "kv_cache_scheme": None,
        "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
        "transform_config": {}, "version": "0.19.0"}


def summary(tensors: list[TensorInfo], config: dict, where: Any) -> dict[str, Any] | None:
    """``inspect --json``'s ``"quantization"``: ``{"method", "block_size" or "scheme",
    "quantized_tensors"}``, None for a checkpoint that is not quantized; a quantized one that
    cannot be dequantized says why under ``"error"``."""
    if config_of(config) is None and not any(t.dtype in FP8 for t in tensors):
        return None
    try:
        found = find(tensors, config, where)
    except BadInput as e:
        return {"method": (config_of(config) or {}).get("quant_method"), "quantized_tensors": None, "error": str(e)}
    return found.summary() if found is not None else None
