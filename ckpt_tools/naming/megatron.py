"""Megatron-Core GPT names -> Hugging Face names, for the Llama-style families and two MoE ones.

Families mapped (HF ``model_type``): ``llama``, ``mistral`` (the same names) and ``qwen2``
(``llama`` plus q/k/v biases): a Megatron-Core ``GPTModel`` with RMSNorm, a gated MLP (SwiGLU),
RoPE on the two halves of each head (Megatron's default, ``rotary_interleaved=False``, which is
Hugging Face's convention: no row permutation), GQA or MHA, no linear biases but Qwen2's q/k/v
ones, tied or untied embeddings; the local and the Transformer-Engine layer specs (whose norm
weights are named ``input_layernorm.weight`` / ``self_attention.linear_qkv.layer_norm_weight``).

Megatron's ``sharded_state_dict`` stacks the layers on a leading axis
(``decoder.layers.self_attention.linear_qkv.weight`` is ``[num_layers, rows, hidden]``), fuses
Q, K and V interleaved per query group (``[q heads of group 0, k0, v0, q heads of group 1, ...]``,
as ``SelfAttention.get_query_key_value_tensors`` splits them) and holds ``[gate; up]`` in
``linear_fc1``. Every Hugging Face weight is therefore a list of row ranges of one layer of one
stacked tensor, and each such range is a contiguous byte range of the file that stores it: the
weight is described as those byte ranges (the stored items' headers are read, no tensor data),
so the engine streams it like any copy (no whole-model buffer). Megatron-LM pads the vocabulary
(``make_vocab_size_divisible_by``): embedding rows beyond the config's ``vocab_size`` are left out.

Mixture-of-Experts families (``qwen3_moe``, with QK-norm; ``mixtral``): Megatron-Core's MoE layer
with the router ``decoder.layers.mlp.router.weight`` ``[L, E, H]`` and the experts of all layers
as one global tensor per key, whatever the expert- or tensor-parallel degree
(``SequentialMLP``/``TEGroupedMLP.sharded_state_dict`` put the expert on the axis after the
layer: ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` ``[L, E, 2F, H]``, each expert
``[gate; up]``, and ``linear_fc2`` ``[L, E, H, F]``). One layer of it is exactly the tensor
transformers 5 holds in memory (``mlp.experts.gate_up_proj`` ``[E, 2F, H]``, ``down_proj``
``[E, H, F]``), so the map names it so, and :mod:`.experts` then writes what ``save_pretrained``
writes for the config's model type (per expert for both families), from transformers' own
registry: every output is still row ranges of the stacked tensor. A save whose layers are not
homogeneous (``moe_layer_freq`` with dense layers: Qwen3-MoE's ``mlp_only_layers``) has one key
per layer (``decoder.layers.1.mlp.router.weight`` ``[E, H]``): read the same way, without the
layer axis; which layers are dense is then checked by the architecture check against the config.
One key per expert (``singleton_local_shards``) is refused.

DeepSeek-V3 (``deepseek_v3``): Megatron-Core's multi-latent attention (``MLASelfAttention``) is
Hugging Face's layer for layer (``linear_q_down_proj`` -> ``q_a_proj``, ``q_layernorm`` (or the TE
spec's ``linear_q_up_proj.layer_norm_weight``) -> ``q_a_layernorm``, ``linear_q_up_proj`` ->
``q_b_proj`` (``linear_q_proj`` -> ``q_proj`` without a query latent), ``linear_kv_down_proj``
(``kv_lora_rank + qk_pos_emb_head_dim`` rows) -> ``kv_a_proj_with_mqa``, ``kv_layernorm`` ->
``kv_a_layernorm``, ``linear_kv_up_proj`` -> ``kv_b_proj``), the same split of each head into its
no-rotary and rotary parts, and the same rotary convention: Megatron's MLA takes the rotary rows in
interleaved pairs (``x[0::2], x[1::2]``), as HF's ``rope_interleave=True`` does; for a config with
``rope_interleave=False`` the rotary rows of ``q_b_proj``/``q_proj`` and ``kv_a_proj_with_mqa`` are
reordered (evens, then odds), which gives the same attention scores. The shared experts'
``[gate; up]`` become ``mlp.shared_experts.gate_proj``/``up_proj``, the router's expert bias
``mlp.gate.e_score_correction_bias``. The training arguments that the shapes cannot show (the
sigmoid router, its normalization, scaling factor and groups, the dense first layers, the rotary
type and YaRN's parameters) are checked against config.json by :mod:`.megatron_mla`.

Refused (exit 3, naming what is missing): any name outside the family's table (LayerNorm biases,
linear biases, MoE experts and router in a dense family, shared experts and the router's expert
bias but for DeepSeek-V3, QK-norm, MLA in another family, multi-token prediction layers), an
expert count or width that is not config.json's, a ``linear_fc1`` that is not ``2 x
intermediate_size`` rows (a non-gated MLP), a config of another family, and chunks that do not
tile a tensor (a hole, or overlaps). Saves made at tensor or pipeline parallel > 1 are read as
they are stored: ``sharded_state_dict`` gives each rank's slice its place in the global tensor
(layers of a pipeline stage on the layer axis, column-parallel rows and row-parallel columns,
SwiGLU's gate and up halves each split, so the global ``linear_fc1`` is ``[gate; up]`` at any
tensor-parallel size); each chunk's rows are byte ranges as above. What the shapes
cannot say (activation, normalization, rotary convention, epsilon, theta) is checked against
Megatron-LM's training arguments where the save holds them (:func:`check_args`); a Megatron-Core
save of the model alone records none: a note then says what was taken from config.json (a
non-gated MLP whose ``ffn_hidden_size`` is twice the config's ``intermediate_size`` cannot be
told apart by its shapes).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path

from ..core.describe import Checkpoint, Chunk, Location, TensorInfo
from ..core.dtypes import DType
from ..core.plan import Piece, Target, whole
from ..engine.reader import Reader
from ..errors import BadInput
from . import experts, megatron_mla

_MARKS = ("decoder.layers.", "embedding.word_embeddings.weight", "output_layer.weight")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3_moe", "mixtral", "deepseek_v3")
# families asked for by name that the map does not cover, and why
_REFUSED = {"deepseek_v2": "DeepSeek-V2's softmax router and MLA are mapped for deepseek_v3 only (export with a "
                           "deepseek_v3 config if the run was DeepSeek-V3-style)",
            "qwen2_moe": "shared experts (mlp.shared_experts) are not mapped"}
STACKED = "decoder.layers."
_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_PER_EXPERT = re.compile(r"\.experts\.experts\.\d+\.")  # singleton_local_shards: one key per expert

# Megatron name (below ``decoder.layers.`` for the stacked ones) -> (HF name, part) pairs; the
# part says which rows of the layer the HF weight takes (None: all of them)
_LAYER_TABLE = {
    "self_attention.linear_qkv.weight": (("model.layers.{}.self_attn.q_proj.weight", "q"),
                                         ("model.layers.{}.self_attn.k_proj.weight", "k"),
                                         ("model.layers.{}.self_attn.v_proj.weight", "v")),
    "self_attention.linear_qkv.bias": (("model.layers.{}.self_attn.q_proj.bias", "q"),
                                       ("model.layers.{}.self_attn.k_proj.bias", "k"),
                                       ("model.layers.{}.self_attn.v_proj.bias", "v")),
    "self_attention.linear_proj.weight": (("model.layers.{}.self_attn.o_proj.weight", None),),
    "self_attention.linear_qkv.layer_norm_weight": (("model.layers.{}.input_layernorm.weight", None),),
    "input_layernorm.weight": (("model.layers.{}.input_layernorm.weight", None),),
    "mlp.linear_fc1.layer_norm_weight": (("model.layers.{}.post_attention_layernorm.weight", None),),
    "pre_mlp_layernorm.weight": (("model.layers.{}.post_attention_layernorm.weight", None),),
    "mlp.linear_fc1.weight": (("model.layers.{}.mlp.gate_proj.weight", "gate"),
                              ("model.layers.{}.mlp.up_proj.weight", "up")),
    "mlp.linear_fc2.weight": (("model.layers.{}.mlp.down_proj.weight", None),),
}
_QK_NORM = {
    "self_attention.q_layernorm.weight": (("model.layers.{}.self_attn.q_norm.weight", None),),
    "self_attention.k_layernorm.weight": (("model.layers.{}.self_attn.k_norm.weight", None),),
}
# one layer of the stacked experts is the tensor transformers 5 holds in memory ([E, 2F, H] with
# each expert's [gate; up], [E, H, F]); naming/experts.py writes it as save_pretrained does
_MOE = {
    "mlp.router.weight": (("model.layers.{}.mlp.gate.weight", "router"),),
    "mlp.experts.experts.linear_fc1.weight": (("model.layers.{}.mlp.experts.gate_up_proj", "experts_fc1"),),
    "mlp.experts.experts.linear_fc2.weight": (("model.layers.{}.mlp.experts.down_proj", "experts_fc2"),),
}
# multi-latent attention (Megatron's MLASelfAttention, local or TE spec: the TE spec fuses the q/kv
# latent norms into the up-projections as their layer_norm_weight); the parts reorder rotary rows
# when config.json's rope_interleave is false (naming/megatron_mla.py)
_MLA = {
    "self_attention.linear_q_proj.weight": (("model.layers.{}.self_attn.q_proj.weight", "mla_q"),),
    "self_attention.linear_q_down_proj.weight": (("model.layers.{}.self_attn.q_a_proj.weight", None),),
    "self_attention.q_layernorm.weight": (("model.layers.{}.self_attn.q_a_layernorm.weight", None),),
    "self_attention.linear_q_up_proj.layer_norm_weight": (("model.layers.{}.self_attn.q_a_layernorm.weight", None),),
    "self_attention.linear_q_up_proj.weight": (("model.layers.{}.self_attn.q_b_proj.weight", "mla_q"),),
    "self_attention.linear_kv_down_proj.weight": (("model.layers.{}.self_attn.kv_a_proj_with_mqa.weight",
                                                   "mla_kv_a"),),
    "self_attention.kv_layernorm.weight": (("model.layers.{}.self_attn.kv_a_layernorm.weight", None),),
    "self_attention.linear_kv_up_proj.layer_norm_weight": (("model.layers.{}.self_attn.kv_a_layernorm.weight",
                                                            None),),
    "self_attention.linear_kv_up_proj.weight": (("model.layers.{}.self_attn.kv_b_proj.weight", None),),
}
# DeepSeek's MoE besides the routed experts: the router's expert bias (aux-loss-free balancing) and
# the shared experts, one gated MLP ([gate; up] in linear_fc1)
_SHARED = {
    "mlp.router.expert_bias": (("model.layers.{}.mlp.gate.e_score_correction_bias", "router_bias"),),
    "mlp.shared_experts.linear_fc1.weight": (("model.layers.{}.mlp.shared_experts.gate_proj.weight", "shared_gate"),
                                             ("model.layers.{}.mlp.shared_experts.up_proj.weight", "shared_up")),
    "mlp.shared_experts.linear_fc2.weight": (("model.layers.{}.mlp.shared_experts.down_proj.weight", None),),
}
_NOT_QKV = {k: v for k, v in _LAYER_TABLE.items() if "linear_qkv" not in k}
_FAMILY_TABLE = {"qwen3_moe": {**_LAYER_TABLE, **_QK_NORM, **_MOE}, "mixtral": {**_LAYER_TABLE, **_MOE},
                 "deepseek_v3": {**_NOT_QKV, **_MLA, **_MOE, **_SHARED}}
_TOP_TABLE = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
# what an unmapped name most likely means, for the refusal
_WHY = (("mtp.", "multi-token prediction layers (mtp_num_layers; Hugging Face's model has none)"),
        ("layer_norm_bias", "LayerNorm (the map is for RMSNorm)"),
        ("layernorm.bias", "LayerNorm (the map is for RMSNorm)"),
        ("shared_experts", "shared experts (mapped for deepseek_v3)"),
        ("expert_bias", "the router's expert bias (aux-loss-free balancing; mapped for deepseek_v3)"),
        ("experts", "MoE experts (mapped for qwen3_moe, mixtral and deepseek_v3)"),
        ("router", "an MoE router (mapped for qwen3_moe, mixtral and deepseek_v3)"), ("q_layernorm", "QK-norm"),
        ("k_layernorm", "QK-norm"), ("linear_q_", "multi-latent attention (mapped for deepseek_v3)"),
        ("linear_kv_", "multi-latent attention (mapped for deepseek_v3)"), ("kv_layernorm", "multi-latent attention"),
        ("linear_qkv", "grouped-query attention (linear_qkv), where config.json's family has multi-latent attention"),
        (".bias", "linear biases"), ("position_embeddings", "learned absolute positions (the map is for RoPE)"))


def detect(names: Iterable[str]) -> bool:
    """Whether the model's names are Megatron-Core's (a GPT's decoder layers or embedding)."""
    return any(n.startswith(_MARKS) for n in names)


def _table(family: str) -> dict:
    return _FAMILY_TABLE.get(family, _LAYER_TABLE)


def _known(name: str, family: str, per_layer: bool) -> bool:
    m = _PER_LAYER.match(name)
    if m:
        return per_layer and name[m.end():] in _table(family)
    return name in _TOP_TABLE or name.startswith(STACKED) and name[len(STACKED):] in _table(family)


def _why(name: str, per_layer: bool) -> str:
    if _PER_EXPERT.search(name):
        return "one key per expert (singleton_local_shards)"
    if _PER_LAYER.match(name) and not per_layer:
        return ("per-layer names, as model.state_dict() or a legacy checkpoint spells them: the map reads "
                "dist_checkpointing's torch_dist save (layers stacked, or one key per layer where they are not "
                "homogeneous), whose tensors are global at any parallelism")
    return next((what for mark, what in _WHY if mark in name), "no counterpart")


def _family(config: dict, src: Path) -> str:
    if not config:
        raise BadInput(f"{src}: Megatron-Core names to Hugging Face need the model's config.json (heads, query "
                       "groups, intermediate size); pass --base MODEL with a config of matching shapes")
    family = config.get("model_type")
    if family in _REFUSED:
        raise BadInput(f"{src}: Megatron-Core names for model_type {family!r}: {_REFUSED[family]} (ckpt maps "
                       f"{', '.join(FAMILIES)}); convert --to dcp keeps the save under Megatron's own names")
    if family not in FAMILIES:
        raise BadInput(f"{src}: Megatron-Core names for model_type {family!r} are not mapped (ckpt maps "
                       f"{', '.join(FAMILIES)}: RMSNorm, SwiGLU, RoPE); pass --base with a config of one of those")
    return family


def _rows(part: str | None, shape: tuple[int, ...], config: dict, name: str) -> list[tuple[int, int]]:
    """The row ranges of one layer of ``name`` (``shape``) that HF's ``part`` takes."""
    rows = shape[0]
    if part is None:
        return [(0, rows)]
    if part in ("router", "router_bias", "experts_fc1", "experts_fc2"):
        _check_experts(part, shape, config, name)
        return [(0, rows)]
    if part in ("mla_q", "mla_kv_a"):
        return megatron_mla.rows(part, rows, config, name)
    if part in ("gate", "up", "shared_gate", "shared_up"):
        inter, key = ((config.get("intermediate_size"), "intermediate_size") if part in ("gate", "up")
                      else megatron_mla.shared_width(config))
        if not isinstance(inter, int) or rows != 2 * inter:
            raise BadInput(f"{name}: {rows} rows, but a gated MLP (SwiGLU: [gate; up]) of {key} "
                           f"{inter} has {2 * inter if isinstance(inter, int) else '2 x ' + key}: "
                           "a non-gated MLP is not mapped, or config.json does not describe this model")
        return [(0, inter)] if part.endswith("gate") else [(inter, rows)]
    heads = config.get("num_attention_heads")
    groups = config.get("num_key_value_heads") or heads
    hidden = config.get("hidden_size")
    if not all(isinstance(v, int) and v > 0 for v in (heads, groups, hidden)) or heads % groups:
        raise BadInput(f"{name}: config.json's num_attention_heads {heads}, num_key_value_heads {groups}, hidden_size "
                       f"{hidden} do not describe grouped-query attention")
    head_dim = config.get("head_dim") or hidden // heads
    per_group = heads // groups
    block = (per_group + 2) * head_dim
    if rows != groups * block:
        raise BadInput(f"{name}: {rows} rows, but {heads} heads of {head_dim} in {groups} query groups fuse to "
                       f"{groups * block}: config.json does not describe this model")
    start, size = {"q": (0, per_group * head_dim), "k": (per_group * head_dim, head_dim),
                   "v": ((per_group + 1) * head_dim, head_dim)}[part]
    return [(g * block + start, g * block + start + size) for g in range(groups)]


def _check_experts(part: str, shape: tuple[int, ...], config: dict, name: str) -> None:
    """One layer of the router (``[E, H]``) or of the stacked experts (``[E, 2F, H]``, ``[E, H, F]``)
    against config.json's expert count and expert width, naming the Megatron tensor."""
    count = experts.num_experts(config)
    if shape[0] != count:
        key = next((k for k in experts.COUNT_KEYS if config.get(k) == count), "/".join(experts.COUNT_KEYS))
        raise BadInput(f"{name}: holds {shape[0]} experts (its axis after the layer) but config.json says "
                       f"{count if count is not None else 'none'} ({key}); pass --base with a config that "
                       "describes this model")
    if part in ("router", "router_bias"):
        return
    key = "moe_intermediate_size" if "moe_intermediate_size" in config else "intermediate_size"
    inter, hidden = config.get(key), config.get("hidden_size")
    if not isinstance(inter, int):
        raise BadInput(f"{name}: config.json has no expert width ({key})")
    want = [count, 2 * inter, hidden] if part == "experts_fc1" else [count, hidden, inter]
    if list(shape) != want:
        raise BadInput(f"{name}: one layer is {list(shape)}, but {count} gated experts (SwiGLU: [gate; up]) of "
                       f"config.json's {key} {inter} and hidden_size {hidden} are {want}: a non-gated expert MLP is "
                       "not mapped, or config.json does not describe this model")


def _view(reader: Reader, src: TensorInfo, layer: int | None, ranges: list[tuple[int, int]], name: str) -> TensorInfo:
    """A tensor named ``name`` made of rows ``ranges`` of layer ``layer`` of ``src`` (of ``src``
    itself when ``layer`` is None), described as byte ranges of the files that store them. A
    stored chunk may hold some of the columns (a tensor-parallel row-parallel layer saved per
    rank): each of its rows is still one contiguous run of bytes, a rectangle of the result."""
    lead = 0 if layer is None else 1  # the stacked layer axis, when there is one
    inner = src.shape[lead:]
    rest = inner[1:]
    itemsize = DType.of(src.dtype).itemsize
    total = sum(b - a for a, b in ranges) * math.prod(rest)
    chunks, covered, seen = [], 0, set()
    for c in src.chunks:
        box = (c.offsets, c.sizes)
        if box in seen or not c.numel:
            continue
        seen.add(box)
        if layer is not None and not c.offsets[0] <= layer < c.offsets[0] + c.sizes[0]:
            continue
        cols_at, cols = tuple(c.offsets[lead + 1:]), tuple(c.sizes[lead + 1:])
        row_bytes = math.prod(cols) * itemsize  # one row of this chunk (all its columns)
        c_lo, c_hi = c.offsets[lead], c.offsets[lead] + c.sizes[lead]
        found = None
        dst = 0
        for a, b in ranges:
            lo, hi = max(a, c_lo), min(b, c_hi)
            if lo < hi:
                if found is None:
                    found = reader.span(src, c)
                    if found is None:
                        raise BadInput(f"{src.name}: its item in {c.location.file} is not stored as one contiguous "
                                       "range of bytes; ckpt cannot take one layer's rows of it")
                _, offset, _ = found
                within = ((layer - c.offsets[0]) * c.sizes[1] if layer is not None else 0) + (lo - c_lo)
                loc = Location(c.location.file, "raw", offset + within * row_bytes, (hi - lo) * row_bytes)
                chunks.append(Chunk((dst + lo - a, *cols_at), (hi - lo, *cols), loc, c.rank))
                covered += (hi - lo) * math.prod(cols)
            dst += b - a
    if covered != total:
        raise BadInput(f"{src.name}: its chunks cover {covered} of the {total} elements {name} needs; the save has a "
                       "hole or overlapping pieces")
    return TensorInfo(src.group, name, (sum(b - a for a, b in ranges), *rest), src.dtype, tuple(chunks))


def to_hf_pieces(ckpt: Checkpoint, names: dict[str, TensorInfo], config: dict, src: Path,
                 cast: DType | None) -> list[Piece]:
    """Whole pieces under Hugging Face names for the Megatron-Core model tensors ``names``
    (each described as byte ranges of the save's files, streamed by the engine). Raises
    BadInput naming every Megatron name the map does not know, or the shape that does not fit
    the config.

    Example: ``decoder.layers.self_attention.linear_qkv.weight`` ``[2, 64, 32]`` (4 heads of 8
    in 2 groups) -> ``model.layers.{0,1}.self_attn.{q,k,v}_proj.weight`` of 32, 16, 16 rows.
    """
    family = _family(config, src)
    if family in megatron_mla.FAMILIES:
        megatron_mla.check_config(config, src)
    per_layer = ckpt.format == "dcp"  # a torch_dist save: its per-layer keys are global tensors too
    unknown = sorted(n for n in names if not _known(n, family, per_layer))
    if unknown:
        by_why: dict[str, list[str]] = {}
        for n in unknown:
            by_why.setdefault(_why(n, per_layer), []).append(n)
        listed = "; ".join(f"{why}: {', '.join(ns[:3])}{' ...' if len(ns) > 3 else ''}" for why, ns in by_why.items())
        raise BadInput(f"{src}: Megatron-Core names with no Hugging Face counterpart in ckpt's map ({listed}; "
                       f"{len(unknown)} in all); the map covers "
                       f"{'/'.join(FAMILIES)}-style GPTs (RMSNorm, SwiGLU, RoPE, no linear biases but Qwen2's q/k/v; "
                       f"model_type {family!r} here); "
                       "convert --to dcp keeps the save under Megatron's own names")
    vocab = config.get("vocab_size")
    pieces = []
    with Reader(ckpt) as reader:
        for name, t in names.items():
            if name in _TOP_TABLE:
                rows = t.shape[0] if t.shape else 0
                if name != "decoder.final_layernorm.weight" and isinstance(vocab, int) and 0 < vocab < rows:
                    rows = vocab  # Megatron-LM's padded vocabulary: the padding rows are dropped
                view = _view(reader, t, None, [(0, rows)], _TOP_TABLE[name])
                pieces.append(_whole(view, cast))
                continue
            m = _PER_LAYER.match(name)
            if m:  # layers not homogeneous (moe_layer_freq): one key per layer, no layer axis
                for hf, part in _table(family)[name[m.end():]]:
                    view = _view(reader, t, None, _rows(part, tuple(t.shape), config, name), hf.format(m.group(1)))
                    pieces.append(_whole(view, cast))
                continue
            if len(t.shape) < 2:
                raise BadInput(f"{name}: {list(t.shape)} is not stacked on a layer axis")
            for layer in range(t.shape[0]):
                for hf, part in _table(family)[name.removeprefix(STACKED)]:
                    view = _view(reader, t, layer, _rows(part, tuple(t.shape[1:]), config, name), hf.format(layer))
                    pieces.append(_whole(view, cast))
    seen = set()
    for p in pieces:
        if p.target.name in seen:
            raise BadInput(f"{src}: two Megatron-Core tensors become {p.target.name!r} (a local-spec and a "
                           "Transformer-Engine norm name both saved?)")
        seen.add(p.target.name)
    if family not in _FAMILY_TABLE:
        return pieces
    # MoE: each layer's experts, named as transformers holds them, as save_pretrained writes them
    views = experts.hub_tensors(ckpt, {p.target.name: p.target.source for p in pieces}, config, src)
    return [_whole(v, cast) for v in views.values()]


# Megatron-LM's argument -> (what the map assumes, or a config.json key whose value it must equal)
_ASSUMED = {"swiglu": (True, "a gated MLP with SiLU (SwiGLU)"), "normalization": ("RMSNorm", "RMSNorm"),
            "position_embedding_type": ("rope", "rotary positions"),
            "rotary_interleaved": (False, "rotary embeddings on the two halves of each head"),
            "rotary_percent": (1.0, "rotary embeddings on every dimension of a head"),
            "qk_layernorm": (False, "no QK-norm"), "num_experts": (None, "a dense MLP (no MoE)")}
_EQUAL = {"num_attention_heads": "num_attention_heads", "num_layers": "num_hidden_layers",
          "hidden_size": "hidden_size", "ffn_hidden_size": "intermediate_size", "kv_channels": "head_dim",
          "norm_epsilon": "rms_norm_eps", "rotary_base": "rope_theta"}
# what an MoE family's arguments must say besides: Megatron's router as Hugging Face's computes it
_MOE_ASSUMED = {"moe_router_score_function": ("softmax", "a softmax router"),
                "moe_shared_expert_intermediate_size": (None, "no shared experts"),
                "moe_router_enable_expert_bias": (False, "no router expert bias"),
                "moe_router_topk_scaling_factor": (None, "unscaled routing weights"),
                "moe_router_num_groups": (None, "no group-limited routing")}
_QK = {"qwen3_moe": (True, "QK-norm (Qwen3)")}
# how the family's router weighs the top-k experts: normalized always (True), or as a config key says;
# Megatron's normalizes unless moe_router_pre_softmax (softmax over all experts, then top-k)
_NORMALIZED = {"qwen3_moe": "norm_topk_prob", "mixtral": True}


def check_args(ckpt: Checkpoint, config: dict, src: Path) -> list[str]:
    """Check what the map assumes (and ``config.json``) against the training arguments the save
    recorded (Megatron-LM's ``args`` in ``common.pt``, :mod:`ckpt_tools.layouts.megatron`): a
    difference is exit 3 naming the argument. Without them (a Megatron-Core save of the model
    alone) the shapes are all that is checked: a note says what was taken from config.json."""
    args = ckpt.details.get("run_args")
    family = config.get("model_type")
    mla = family in megatron_mla.FAMILIES
    moe = family in _NORMALIZED or mla
    if not isinstance(args, dict):
        why = ckpt.details.get("run_args_unread")
        return [f"{src}: " + (f"its training arguments could not be read ({why}); " if why else
                                    "the save records no training arguments (no Megatron-LM args in common.pt); ")
                + "SwiGLU, RMSNorm and the rotary convention of config.json are assumed"
                + (f", and {megatron_mla.NOTE}" if mla else
                   ", and its router's top-k weighing (Megatron's default, moe_router_pre_softmax=False, "
                   "normalizes the top-k weights)" if moe else "") + "; only the shapes are checked"]
    assumed = {**_ASSUMED, "qk_layernorm": _QK.get(family, _ASSUMED["qk_layernorm"])}
    if moe:
        del assumed["num_experts"]  # compared with config.json's count below
        assumed.update(_MOE_ASSUMED)
    if mla:
        for k in megatron_mla.COMPARED:
            del assumed[k]
        assumed.update(megatron_mla.ASSUMED)
    wrong = [f"{k}={args[k]!r} ({what} expected)" for k, (want, what) in assumed.items()
             if k in args and args[k] != want and not (want is False and args[k] in (None, 0))
             and not (want is None and args[k] in (0, 1))]
    groups = args.get("num_query_groups") if args.get("group_query_attention") else args.get("num_attention_heads")
    pairs = [*((k, c) for k, c in _EQUAL.items()), ("num_query_groups", "num_key_value_heads")]
    values = {**args, "num_query_groups": groups}
    if mla:  # no query groups, no kv_channels (head widths are compared by megatron_mla)
        pairs = [(k, c) for k, c in pairs if k not in ("num_query_groups", "kv_channels")]
    if moe:
        width = "moe_intermediate_size" if "moe_intermediate_size" in config else "intermediate_size"
        if not (mla and config.get("first_k_dense_replace")):  # the dense width: no weight of this model
            pairs = [(k, c) for k, c in pairs if k != "ffn_hidden_size"]
        pairs += [("num_experts", "num_experts"), ("moe_router_topk", "num_experts_per_tok"),
                  ("moe_ffn_hidden_size", width)]
        values["moe_ffn_hidden_size"] = args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size")
        config = {**config, "num_experts": experts.num_experts(config)}
        normalized = _NORMALIZED.get(family) if isinstance(_NORMALIZED.get(family), bool) else bool(
            config.get(_NORMALIZED.get(family)))
        if mla:
            wrong += megatron_mla.wrong_args(args, config)
        elif bool(args.get("moe_router_pre_softmax")) == normalized:
            wrong.append(f"moe_router_pre_softmax={args.get('moe_router_pre_softmax')!r} but "
                         + (f"config.json's {_NORMALIZED[family]} is {config.get(_NORMALIZED[family])!r}"
                            if isinstance(_NORMALIZED[family], str) else f"{family} always normalizes the top-k weights"))
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    config = {**config, "rope_theta": config.get("rope_theta", rope.get("rope_theta")),
              "rope_scaling": config.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default")
                                                             else None)}  # transformers 5 nests them
    wrong += [f"{k}={values[k]!r} but config.json's {c} is {config.get(c)!r}" for k, c in pairs
              if values.get(k) is not None and config.get(c) is not None and not _same(values[k], config[c])]
    if args.get("swiglu") and config.get("hidden_act") not in (None, "silu"):
        wrong.append(f"swiglu=True but config.json's hidden_act is {config.get('hidden_act')!r}")
    tied = not args.get("untie_embeddings_and_output_weights", True)
    if "untie_embeddings_and_output_weights" in args and bool(config.get("tie_word_embeddings", True)) != tied:
        wrong.append(f"untie_embeddings_and_output_weights={not tied} but config.json's tie_word_embeddings is "
                     f"{config.get('tie_word_embeddings', True)}")
    if "use_rope_scaling" in args and not mla and bool(args["use_rope_scaling"]) != bool(config.get("rope_scaling")):
        wrong.append(f"use_rope_scaling={args['use_rope_scaling']!r} but config.json's rope_scaling is "
                     f"{config.get('rope_scaling')!r}")
    if wrong:
        raise BadInput(f"{src}: the training arguments saved in common.pt say {'; '.join(wrong)}: the export would not "
                       "compute what the Megatron model computed; pass --base with a config that describes it (ckpt maps "
                       f"{'/'.join(FAMILIES)}-style GPTs)")
    return []


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)
    return a == b


def _whole(view: TensorInfo, cast: DType | None) -> Piece:
    dtype = cast if cast is not None and view.dtype.is_floating_point else view.dtype
    return whole(Target(view, view.group, view.name, dtype))
