"""torchtitan's model names, both ways, for the llama3, qwen3 (dense and MoE) and deepseek_v3
families.

A name table written as data, as torchtitan's own ``state_dict_adapter.py`` files do (the layer
index a ``{}`` placeholder; an expert's HF name has a second one), and the real transformations
beside it:

* torchtitan's llama3 applies rotary embeddings to interleaved pairs, Hugging Face's to the two
  halves of each head, so the rows of ``wq`` and ``wk`` are permuted within each head. qwen3
  uses Hugging Face's convention and deepseek_v3's HF model rotates interleaved pairs itself
  (``rope_interleave``): no permutation.
* MoE experts: torchtitan keeps one grouped tensor per layer (``w1_EFD``/``w3_EFD`` [E, F, D],
  ``w2_EDF`` [E, D, F]); Hugging Face one tensor per expert (rows ``e*F .. e*F+F``). Split on
  export, joined for ``convert --layout torchtitan``; both are row ranges of the stored bytes
  (:mod:`.experts` plans them), so the engine streams them like any copy.

Recognised from the names alone; the directory layout (``step-N/``) is not this module's business.

Earlier torchtitan releases are read as 0.3: attention ``layers.N.attention.wq`` (0.3:
``attention.qkv_linear.wq``) and ``output`` (0.3: ``lm_head``); MoE experts ``moe.experts.w1``
with ``moe.expert_bias`` (to 2026-05), ``moe.experts.w1_EFD`` (to 2026-07), and 0.3's
``moe.routed_experts.inner_experts.w1_EFD``; the shapes are the same in all three. 0.3's are written.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from ..core.dtypes import DType
from ..engine.reader import Reader
from ..errors import BadInput
from ..core.plan import Computed, Piece, Target, permuted_rows, rename_piece, rows_of

_COMMON = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.qkv_linear.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.qkv_linear.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.qkv_linear.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# the router, and expert {} of a layer <- its rows of the layer's grouped tensor
_MOE = {
    "model.layers.{}.mlp.gate.weight": "layers.{}.moe.router.gate.weight",
    "model.layers.{}.mlp.experts.{}.gate_proj.weight": "layers.{}.moe.routed_experts.inner_experts.w1_EFD",
    "model.layers.{}.mlp.experts.{}.up_proj.weight": "layers.{}.moe.routed_experts.inner_experts.w3_EFD",
    "model.layers.{}.mlp.experts.{}.down_proj.weight": "layers.{}.moe.routed_experts.inner_experts.w2_EDF",
}
# HF name -> torchtitan name, per HF model_type; None: a buffer HF computes (not written)
FROM_HF = {
    "llama": {**_COMMON, "model.layers.{}.self_attn.rotary_emb.inv_freq": None},
    "qwen3": {**_COMMON, **_MOE, "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",
              "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight",
              "model.layers.{}.self_attn.rotary_emb.inv_freq": None},
    # multi-head latent attention (q_proj without a q LoRA rank, q_a/q_b with one), dense first
    # layers, shared experts, and the routing bias load balancing learns
    "deepseek_v3": {
        **{k: v for k, v in _COMMON.items() if "self_attn" not in k}, **_MOE,
        "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
        "model.layers.{}.self_attn.q_a_proj.weight": "layers.{}.attention.wq_a.weight",
        "model.layers.{}.self_attn.q_a_layernorm.weight": "layers.{}.attention.q_norm.weight",
        "model.layers.{}.self_attn.q_b_proj.weight": "layers.{}.attention.wq_b.weight",
        "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight": "layers.{}.attention.wkv_a.weight",
        "model.layers.{}.self_attn.kv_a_layernorm.weight": "layers.{}.attention.kv_norm.weight",
        "model.layers.{}.self_attn.kv_b_proj.weight": "layers.{}.attention.wkv_b.weight",
        "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
        "model.layers.{}.mlp.shared_experts.gate_proj.weight": "layers.{}.moe.shared_experts.w1.weight",
        "model.layers.{}.mlp.shared_experts.up_proj.weight": "layers.{}.moe.shared_experts.w3.weight",
        "model.layers.{}.mlp.shared_experts.down_proj.weight": "layers.{}.moe.shared_experts.w2.weight",
        "model.layers.{}.mlp.gate.e_score_correction_bias": "layers.{}.moe.expert_bias_E",
    },
}
FROM_HF["qwen3_moe"] = FROM_HF["qwen3"]  # torchtitan's qwen3 holds both; HF names the MoE its own type
# the load-balancing bias torchtitan's MoE holds (a persistent buffer, zeros at the start); a
# family whose HF model has none leaves it out on export (as its to_hf does) and starts it at zeros
_EXPERT_BIAS = "layers.{}.moe.expert_bias_E"
# expert-use counters some torchtitan versions save; never weights
_MOE_COUNTERS = re.compile(r"^layers\.\d+\.moe\.tokens_per_expert(_E)?$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(.+)$")
# config settings a family's names map under only: torchtitan's deepseek_v3 rotates interleaved
# pairs, which HF's model does with rope_interleave on (it then needs no row permutation)
_REQUIRED = {"deepseek_v3": {"rope_interleave": True}}
# which families rotate interleaved pairs (torchtitan's ComplexRoPE): their wq/wk rows are permuted
PERMUTED = {"llama": ("model.layers.{}.self_attn.q_proj.weight", "model.layers.{}.self_attn.k_proj.weight")}
# earlier torchtitan spellings, read as 0.3's where the family's table does not hold them
_OLDER = {"layers.{}.attention.wq.weight": "layers.{}.attention.qkv_linear.wq.weight",
          "layers.{}.attention.wk.weight": "layers.{}.attention.qkv_linear.wk.weight",
          "layers.{}.attention.wv.weight": "layers.{}.attention.qkv_linear.wv.weight",
          "output.weight": "lm_head.weight",
          "layers.{}.moe.expert_bias": _EXPERT_BIAS,
          **{f"layers.{{}}.moe.experts.{old}": f"layers.{{}}.moe.routed_experts.inner_experts.{new}"
             for new in ("w1_EFD", "w3_EFD", "w2_EDF") for old in (new, new[:2])}}
# computed buffers some torchtitan versions save; never weights
_BUFFERS = re.compile(r"^(freqs_cis|rope\.cache)$")
_LAYER = re.compile(r"^layers\.(\d+)\.")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def detect(names: Iterable[str]) -> bool:
    """Whether these model names are torchtitan's (``tok_embeddings``, ``layers.N.attention...``)."""
    names = list(names)
    return any(n == "tok_embeddings.weight" for n in names) or any(
        _LAYER.match(n) and (".attention." in n or ".feed_forward." in n) for n in names)


def _abstract(name: str, pattern: re.Pattern, head: str) -> tuple[str, str | None]:
    m = pattern.match(name)
    if not m:
        return name, None
    return f"{head}{{}}." + name[m.end():], m.group(1)


def _family(config: dict, src: Path, direction: str) -> str:
    if not config:
        raise BadInput(f"{src}: torchtitan names {direction} Hugging Face need the model's config.json "
                       "(heads, hidden size); pass --base MODEL")
    family = config.get("model_type")
    if family not in FROM_HF:
        raise BadInput(f"{src}: torchtitan names for model_type {family!r} are not mapped "
                       f"(ckpt maps {', '.join(sorted(FROM_HF))}); convert with torchtitan's own state_dict_adapter")
    for key, want in _REQUIRED.get(family, {}).items():
        if config.get(key, want) != want:
            raise BadInput(f"{src}: config.json sets {key}: {config[key]!r}, but torchtitan's {family} names map only "
                           f"under {key}: {want!r} (its adapter assumes it); the names would map and the model would "
                           f"compute something else. Use a config with {key}: {str(want).lower()}")
    return family


def _to_hf_table(family: str) -> dict[str, str]:
    return {v: k for k, v in FROM_HF[family].items() if v is not None}


def _current(abstract: str, to_hf: dict[str, str]) -> str:
    """An abstract torchtitan name as 0.3 spells it (the family's own table first)."""
    return abstract if abstract in to_hf else _OLDER.get(abstract, abstract)


def heads(config: dict, hf_name: str, rows: int) -> int:
    """How many heads share the rows of a q or k projection."""
    n = config["num_attention_heads"]
    if "k_proj" in hf_name:
        n = config.get("num_key_value_heads") or n
    if rows % n or (rows // n) % 2:
        raise BadInput(f"{hf_name}: {rows} rows do not split into {n} heads of an even size; "
                       "does config.json describe this model?")
    return n


def to_hf_rows(n_heads: int, rows: int) -> list[int]:
    """HF row i comes from torchtitan row ``rows_map[i]``: ``w.view(n, hd/2, 2, -1)
    .transpose(1, 2)`` (torchtitan's ``_permute``)."""
    hd = rows // n_heads
    half = hd // 2
    return [h * hd + j * 2 + i for h in range(n_heads) for i in range(2) for j in range(half)]


def from_hf_rows(n_heads: int, rows: int) -> list[int]:
    """The inverse: torchtitan row i comes from HF row ``rows_map[i]`` (``_reverse_permute``)."""
    forward = to_hf_rows(n_heads, rows)
    inverse = [0] * rows
    for hf_row, tt_row in enumerate(forward):
        inverse[tt_row] = hf_row
    return inverse


def to_hf_pieces(pieces: list[Piece], config: dict, src: Path) -> list[Piece]:
    """Whole pieces under torchtitan names -> the same under HF names, wq/wk rows reordered.
    A name outside the table is refused, never guessed (a fused ``wqkv`` among them)."""
    family = _family(config, src, "to")
    to_hf = _to_hf_table(family)
    out = []
    for p in pieces:
        name = p.target.name
        if _BUFFERS.match(name) or _MOE_COUNTERS.match(name):
            continue
        if _HF_EXPERT.match(name):  # split from a grouped tensor already (:func:`split_experts`)
            out.append(p)
            continue
        if name.startswith("mtp_layers."):
            raise BadInput(f"{src}: {name!r} belongs to a multi-token-prediction layer, which "
                           "Hugging Face's DeepseekV3ForCausalLM does not hold; ckpt does not map those")
        abstract, layer = _abstract(name, _LAYER, "layers.")
        abstract = _current(abstract, to_hf)
        if abstract == _EXPERT_BIAS and abstract not in to_hf:
            continue  # the family's HF model has no routing bias (its to_hf leaves it out)
        if abstract.endswith("wqkv.weight"):
            raise BadInput(f"{src}: {name!r} is a fused q/k/v projection; torchtitan's own save splits it into "
                           "wq/wk/wv (FusedQKVLinear's state-dict hook): export a checkpoint saved by torchtitan")
        hf_name = to_hf.get(abstract)
        if hf_name is None or hf_name.count("{}") > 1:
            raise BadInput(f"{src}: torchtitan name {name!r} has no Hugging Face counterpart in the {family} table")
        hf_name = hf_name.format(layer) if layer is not None else hf_name
        if p.add is None and hf_name.replace(f".{layer}.", ".{}.", 1) in PERMUTED.get(family, ()):
            rows = p.target.shape[0]
            new = Target(p.target.source, p.target.group, hf_name, p.target.dtype)
            out.append(permuted_rows(new, to_hf_rows(heads(config, hf_name, rows), rows)))
        elif p.add is not None and layer is not None and ("wq" in abstract or "wk" in abstract):
            raise BadInput(f"{src}: {name!r} carries a LoRA update; torchtitan names with LoRA are not mapped")
        else:
            out.append(rename_piece(p, name=hf_name))
    return out


def dropped_bias(ckpt, pieces: list[Piece], config: dict, src: Path, *, refuse: bool = True) -> list[str]:
    """Routing biases :func:`to_hf_pieces` leaves out that are not zeros: refused (exit 3), or
    with ``refuse=False`` (``--no-arch-check``) ``warning:`` lines.

    torchtitan's qwen3 MoE learns a load-balancing bias (``expert_bias_E``) that changes which
    experts a token is sent to; Hugging Face's Qwen3-MoE has no such tensor, and torchtitan's own
    ``to_hf`` drops it silently. The export would then not be the trained model, so ckpt
    refuses unless asked to write names the architecture cannot check."""
    from ..engine.stream import materialize

    family = _family(config, src, "to")
    to_hf = _to_hf_table(family)
    dropped = [p for p in pieces if (m := _abstract(p.target.name, _LAYER, "layers."))[1] is not None
               and _current(m[0], to_hf) == _EXPERT_BIAS and _EXPERT_BIAS not in to_hf]
    if not dropped:
        return []
    with Reader(ckpt) as reader:
        nonzero = [p.target.name for p in dropped if bool(materialize(reader, p).any())]
    if not nonzero:
        return []
    what = (f"{src}: {nonzero[0]} ({len(nonzero)} layers) holds a learned routing bias that "
            f"{(config.get('architectures') or [family])[0]} has no tensor for")
    if refuse:
        raise BadInput(f"{what}: without it the export routes some tokens to other experts than the trained "
                       "model did; --no-arch-check writes it anyway, the bias left out as torchtitan's own to_hf "
                       "does")
    return [f"warning: {what}; it is left out (--no-arch-check), as torchtitan's own to_hf does, so the export "
            "routes some tokens to other experts than the trained model did"]


def from_hf_targets(targets: list[Target], config: dict, src: Path, ckpt=None) -> tuple[list[Target], dict[str, list[int]]]:
    """HF-named targets -> torchtitan-named ones, and the row map (torchtitan row i from HF row
    ``map[i]``) of each permuted one, by its new name. Per-expert tensors are joined into the
    layer's grouped ones (row ranges of ``ckpt``'s files); a routing bias the HF model lacks
    starts at zeros, as torchtitan's model does. Tied embeddings get their own ``lm_head``
    (torchtitan's ``from_hf`` does the same when ``enable_weight_tying`` is off)."""
    family = _family(config, src, "from")
    table = FROM_HF[family]
    layers = config.get("num_hidden_layers")
    for t in targets:
        m = _HF_LAYER.match(t.name)
        if m and isinstance(layers, int) and int(m.group(1)) >= layers:
            raise BadInput(f"{src}: {t.name!r} lies beyond config.json's {layers} layers (DeepSeek's hub keeps its "
                           "multi-token-prediction layer there); ckpt does not map it to torchtitan's mtp_layers: "
                           "convert a checkpoint without it")
    out, row_maps = [], {}
    singles = [t for t in targets if not _HF_EXPERT.match(t.name)]
    if len(singles) < len(targets):
        out += _grouped_targets(ckpt, [t for t in targets if _HF_EXPERT.match(t.name)], table, config, src)
    for t in singles:
        abstract, layer = _abstract(t.name, _HF_LAYER, "model.layers.")
        if abstract not in table:
            raise BadInput(f"{src}: {t.name!r} has no torchtitan counterpart in the {family} table")
        tt = table[abstract]
        if tt is None:
            continue
        name = tt.format(layer) if layer is not None else tt
        out.append(Target(t.source, t.group, name, t.dtype))
        if abstract in PERMUTED.get(family, ()):
            row_maps[name] = from_hf_rows(heads(config, t.name, t.shape[0]), t.shape[0])
    have = {t.name for t in out}
    for t in list(out):  # the routing bias of each MoE layer, where HF has none
        m = _LAYER.match(t.name)
        if m and t.name == _MOE["model.layers.{}.mlp.gate.weight"].format(m.group(1)):
            bias = _EXPERT_BIAS.format(m.group(1))
            if bias not in have:
                out.append(Target(t.source, t.group, bias, DType("float32"),
                                  computed=Computed("zeros", (t.shape[0],))))
    if "lm_head.weight" not in have:
        embed = next((t for t in out if t.name == "tok_embeddings.weight"), None)
        if embed is None:
            raise BadInput(f"{src}: has neither lm_head.weight nor model.embed_tokens.weight")
        out.append(Target(embed.source, embed.group, "lm_head.weight", embed.dtype))
    return out, row_maps


def _grouped_targets(ckpt, targets: list[Target], table: dict, config: dict, src: Path) -> list[Target]:
    """One expert tensor per expert -> each layer's grouped tensor ``[E, rows, columns]``, expert
    ``e`` its rows ``e*rows ..``, as torchtitan's ``from_hf`` stacks them."""
    from . import experts

    count = experts.num_experts(config)
    by_kind: dict[tuple[str, str], dict[int, Target]] = {}
    for t in targets:
        m = _HF_EXPERT.match(t.name)
        template = f"model.layers.{{}}.mlp.experts.{{}}.{m.group(3)}"
        if table.get(template) is None:
            raise BadInput(f"{src}: {t.name!r} has no torchtitan counterpart (ckpt maps experts' "
                           "gate_proj/up_proj/down_proj weights)")
        if t.computed is not None:
            raise BadInput(f"{src}: {t.name!r} is computed (dequantized) on the way; ckpt joins stored expert "
                           "tensors only: convert the hub checkpoint --to hf --dtype bf16 first")
        by_kind.setdefault((m.group(1), template), {})[int(m.group(2))] = t
    plan, first_of = {}, {}
    for (layer, template), by_e in sorted(by_kind.items()):
        want = count if count is not None else max(by_e) + 1
        missing = sorted(set(range(want)) - set(by_e))
        extra = sorted(set(by_e) - set(range(want)))
        if missing or extra:
            which = template.format(layer, (missing or extra)[0])
            raise BadInput(f"{src}: expert tensor {which!r} is " + ("missing" if missing else
                           f"beyond config.json's {want} experts") + "; the config does not describe these weights")
        first = by_e[0]
        for e, t in by_e.items():
            if t.shape != first.shape or t.source.dtype != first.source.dtype or t.dtype != first.dtype:
                raise BadInput(f"{src}: {t.name!r} is {list(t.shape)} {t.source.dtype}, expert 0 "
                               f"{list(first.shape)} {first.source.dtype}; experts of one layer must match")
        if len(first.shape) != 2:
            raise BadInput(f"{src}: {first.name!r} is {list(first.shape)}; an expert's weight is 2-D")
        name = table[template].format(layer)
        rows = first.shape[0]
        runs = tuple(experts.Run(by_e[e].source.name, 0, e * rows, rows) for e in range(want))
        plan[name] = experts.Planned(name, (want, *first.shape), None, runs)
        first_of[name] = first
    sources = {t.source.name: t.source for t in targets}
    with Reader(ckpt) as reader:
        infos = experts.views(reader, sources, plan)
    return [Target(infos[n], first_of[n].group, n, first_of[n].dtype) for n in plan]


def rank_piece(row_maps: dict[str, list[int]]):
    """``rows_of`` for a DCP writer: rank r's rows of each target, reordered where a row map says."""
    def piece_of(target: Target, world_size: int, rank: int) -> Piece:
        rows = row_maps.get(target.name)
        if rows is None:
            return rows_of(target, world_size, rank)
        return permuted_rows(target, rows, rank=rank, world_size=world_size)

    return piece_of


def split_experts(ckpt, names: dict, config: dict, src: Path) -> dict:
    """torchtitan's grouped expert tensors (``layers.N.moe.routed_experts.inner_experts.w1_EFD``
    ``[E, F, D]``, or an older spelling) as one Hugging Face tensor per expert
    (``model.layers.N.mlp.experts.{e}.gate_proj.weight``: rows ``e*F .. e*F+F``, byte ranges of
    the save), as torchtitan's own ``to_hf`` splits them; every other name as it is."""
    from . import experts

    family = config.get("model_type") if config else None
    if family not in FROM_HF:
        return names
    to_hf = _to_hf_table(family)
    grouped = {}
    for n in names:
        abstract, layer = _abstract(n, _LAYER, "layers.")
        hf = to_hf.get(_current(abstract, to_hf)) if layer is not None else None
        if hf is not None and hf.count("{}") == 2:
            grouped[n] = (layer, hf)
    if not grouped:
        return names
    _family(config, src, "to")
    count = experts.num_experts(config)
    plan = {}
    for name, (layer, hf) in grouped.items():
        t = names[name]
        if len(t.shape) != 3 or (count is not None and t.shape[0] != count):
            raise BadInput(f"{src}: {name!r} is {list(t.shape)}; torchtitan's grouped experts are [experts, rows, "
                           f"columns] with config.json's {count} experts")
        rows = t.shape[1]
        for e in range(t.shape[0]):
            out = hf.format(layer, e)
            plan[out] = experts.Planned(out, t.shape[1:], None, (experts.Run(name, e * rows, 0, rows),))
    plan.update({n: experts.Planned(n, t.shape, n) for n, t in names.items() if n not in grouped})
    with Reader(ckpt) as reader:
        return experts.views(reader, names, plan)
