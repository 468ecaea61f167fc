"""torchtitan's model names, both ways, for the llama3 and qwen3 families (qwen3's MoE experts
to Hugging Face only: each grouped ``[E, F, D]`` tensor split into one tensor per expert).

A name table written as data, as torchtitan's own ``state_dict_adapter.py`` files do (the layer
index a ``{}`` placeholder), and the one real transformation beside it: torchtitan's llama3
applies rotary embeddings to interleaved pairs, Hugging Face's to the two halves of each head,
so the rows of ``wq`` and ``wk`` are permuted within each head. The permutation is a row map,
so the engine streams it like any copy (no whole-model buffer). qwen3 uses Hugging Face's
convention (no permutation). Recognised from the names alone; the directory layout
(``step-N/``) is not this module's business.

torchtitan 0.3 spells attention ``layers.N.attention.qkv_linear.wq`` and the output
``lm_head``; earlier releases ``layers.N.attention.wq`` and ``output``. Both are read; 0.3's
are written.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from ..engine.reader import Reader
from ..errors import BadInput
from ..core.plan import Piece, Target, permuted_rows, rename_piece, rows_of

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
# HF name -> torchtitan name, per HF model_type; None: a buffer HF computes (not written)
FROM_HF = {
    "llama": {**_COMMON, "model.layers.{}.self_attn.rotary_emb.inv_freq": None},
    "qwen3": {**_COMMON, "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",
              "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight",
              "model.layers.{}.self_attn.rotary_emb.inv_freq": None,
              "model.layers.{}.mlp.gate.weight": "layers.{}.moe.router.gate.weight"},
}
FROM_HF["qwen3_moe"] = FROM_HF["qwen3"]  # torchtitan's qwen3 holds both; HF names the MoE its own type
# torchtitan's grouped experts ([E, F, D] / [E, D, F], one tensor per layer) -> HF's tensor of
# expert e (its rows e*F .. e*F+F), per family, every spelling torchtitan has used
_GROUPED = {"qwen3": {
    **{f"moe.{where}.{w}": hf for where in ("routed_experts.inner_experts", "experts")
       for w, hf in (("w1_EFD", "gate_proj"), ("w3_EFD", "up_proj"), ("w2_EDF", "down_proj"),
                     ("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))},
}}
_GROUPED["qwen3_moe"] = _GROUPED["qwen3"]
# load-balancing buffers torchtitan's MoE saves and its own to_hf leaves out (qwen3's HF model has none)
_MOE_BUFFERS = re.compile(r"^layers\.\d+\.moe\.(expert_bias(_E)?|tokens_per_expert)$")
_HF_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.")
# which families rotate interleaved pairs (torchtitan's ComplexRoPE): their wq/wk rows are permuted
PERMUTED = {"llama": ("model.layers.{}.self_attn.q_proj.weight", "model.layers.{}.self_attn.k_proj.weight")}
# earlier torchtitan spellings, read as 0.3's
_OLDER = {"layers.{}.attention.wq.weight": "layers.{}.attention.qkv_linear.wq.weight",
          "layers.{}.attention.wk.weight": "layers.{}.attention.qkv_linear.wk.weight",
          "layers.{}.attention.wv.weight": "layers.{}.attention.qkv_linear.wv.weight",
          "output.weight": "lm_head.weight"}
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
    return family


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
    to_hf = {v: k for k, v in FROM_HF[family].items() if v is not None}
    out = []
    for p in pieces:
        name = p.target.name
        if _BUFFERS.match(name) or _MOE_BUFFERS.match(name):
            continue
        if _HF_EXPERT.match(name):  # split from a grouped tensor already (:func:`split_experts`)
            out.append(p)
            continue
        abstract, layer = _abstract(name, _LAYER, "layers.")
        abstract = _OLDER.get(abstract, abstract)
        if abstract.endswith("wqkv.weight"):
            raise BadInput(f"{src}: {name!r} is a fused q/k/v projection; torchtitan's own save splits it into "
                           "wq/wk/wv (FusedQKVLinear's state-dict hook): export a checkpoint saved by torchtitan")
        hf_name = to_hf.get(abstract)
        if hf_name is None:
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


def from_hf_targets(targets: list[Target], config: dict, src: Path) -> tuple[list[Target], dict[str, list[int]]]:
    """HF-named targets -> torchtitan-named ones, and the row map (torchtitan row i from HF row
    ``map[i]``) of each permuted one, by its new name. Tied embeddings get their own ``lm_head``
    (torchtitan's ``from_hf`` does the same when ``enable_weight_tying`` is off)."""
    family = _family(config, src, "from")
    table = FROM_HF[family]
    out, row_maps = [], {}
    for t in targets:
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
    if "lm_head.weight" not in {t.name for t in out}:
        embed = next((t for t in out if t.name == "tok_embeddings.weight"), None)
        if embed is None:
            raise BadInput(f"{src}: has neither lm_head.weight nor model.embed_tokens.weight")
        out.append(Target(embed.source, embed.group, "lm_head.weight", embed.dtype))
    return out, row_maps


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
    ``[E, F, D]``, ...) as one Hugging Face tensor per expert (``model.layers.N.mlp.experts.{e}.
    gate_proj.weight``: rows ``e*F .. e*F+F``, byte ranges of the save), as torchtitan's own
    ``to_hf`` splits them; every other name as it is."""
    from . import experts

    grouped = {n: t for n, t in names.items() if (m := _LAYER.match(n)) and n[m.end():] in _GROUPED.get(
        config.get("model_type"), {})}
    if not grouped:
        return names
    family = _family(config, src, "to")
    plan = {}
    for name, t in grouped.items():
        m = _LAYER.match(name)
        hf = _GROUPED[family][name[m.end():]]
        count = experts.num_experts(config)
        if len(t.shape) != 3 or (count is not None and t.shape[0] != count):
            raise BadInput(f"{src}: {name!r} is {list(t.shape)}; torchtitan's grouped experts are [experts, rows, "
                           f"columns] with config.json's {count} experts")
        rows = t.shape[1]
        for e in range(t.shape[0]):
            out = f"model.layers.{m.group(1)}.mlp.experts.{e}.{hf}.weight"
            plan[out] = experts.Planned(out, t.shape[1:], None, (experts.Run(name, e * rows, 0, rows),))
    plan.update({n: experts.Planned(n, t.shape, n) for n, t in names.items() if n not in grouped})
    with Reader(ckpt) as reader:
        return experts.views(reader, names, plan)
