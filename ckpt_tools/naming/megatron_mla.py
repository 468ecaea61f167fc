"""DeepSeek-V3 from Megatron-Core: multi-latent attention's rows and what the run's arguments must
say for Hugging Face's ``DeepseekV3ForCausalLM`` to compute what Megatron computed.

The names are in :mod:`.megatron`'s table; here are the parts the shapes cannot show, as data:

- Rotary rows. Megatron's MLA (``rope_utils._apply_rotary_pos_emb_bshd`` with
  ``multi_latent_attention``) takes the rotary part of each head in interleaved pairs
  (``x[0::2]``, ``x[1::2]``, then rotate-half), which is transformers' ``rope_interleave=True``
  (``apply_rotary_pos_emb_interleave``): no reordering. With ``rope_interleave=False``
  transformers rotates the two halves, so HF's rotary row ``j`` is Megatron's ``2j`` and row
  ``d/2 + j`` Megatron's ``2j + 1`` (:func:`rows`); q and k are reordered alike, so the scores
  are the same.
- The router (``topk_routing_with_score_function``): sigmoid scores, the expert bias added for
  the choice only, top-k weights normalized whenever top-k > 1 (HF: ``norm_topk_prob``), times
  ``moe_router_topk_scaling_factor`` (HF: ``routed_scaling_factor``, None = 1). Group-limited
  routing scores a group by its top ``topk // group_topk`` experts, transformers' by its top 2:
  the same only when ``topk // group_topk == 2`` (DeepSeek-V3's 8 of 4 groups); else exit 3.
- Dense first layers: ``moe_layer_freq`` (a list or an int) against ``first_k_dense_replace``.
- Rotary type: ``rope`` against HF's default rope, ``yarn`` against HF's ``yarn`` (factor,
  original context, betas), with the two scalings MLA applies compared as numbers: the
  rotary ``cos``/``sin`` factor (Megatron's ``_yarn_get_concentration_factor``, HF's
  ``attention_factor``) and the softmax scale's ``mscale(factor, mscale_all_dim)**2`` (Megatron
  applies it even with plain rope; transformers only with a scaled rope).
"""

from __future__ import annotations

import math

from ..errors import BadInput

FAMILIES = ("deepseek_v3",)

# Megatron-LM's argument -> (what the map assumes, in words)
ASSUMED = {"multi_latent_attention": (True, "multi-latent attention"),
           "qk_layernorm": (True, "the q/kv latent norms (HF's q_a_layernorm, kv_a_layernorm)"),
           "moe_router_score_function": ("sigmoid", "DeepSeek's sigmoid router"),
           "moe_router_enable_expert_bias": (True, "the router's expert bias (HF's e_score_correction_bias)"),
           "moe_shared_expert_gate": (False, "shared experts without a gate"),
           "mtp_num_layers": (False, "no multi-token prediction layers"),  # False: None or 0
           "rotary_interleaved": (False, "MLA's own rotary pairs (HF's rope_interleave)"),
           "rotary_percent": (1.0, "rotary embeddings on every rotary dimension"),
           "use_rope_scaling": (False, "no Llama-3 rope scaling (MLA's rope_type says how its rope is scaled)")}
# what another MoE family assumes of these arguments, here compared with config.json instead
COMPARED = ("moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_shared_expert_intermediate_size")
# Megatron-LM's argument -> (config.json's key, the value None stands for on each side)
EQUAL = {"q_lora_rank": ("q_lora_rank", None), "kv_lora_rank": ("kv_lora_rank", None),
         "qk_head_dim": ("qk_nope_head_dim", None), "qk_pos_emb_head_dim": ("qk_rope_head_dim", None),
         "v_head_dim": ("v_head_dim", None), "moe_router_topk_scaling_factor": ("routed_scaling_factor", 1.0),
         "moe_router_num_groups": ("n_group", 1), "moe_router_group_topk": ("topk_group", 1)}
# what MLATransformerConfig takes when the arguments leave them out
_MEGATRON_DEFAULTS = {"rope_type": "yarn", "rotary_scaling_factor": 40.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
NOTE = ("multi-latent attention's rotary convention, the q/kv latent norms' epsilon (transformers' own), the sigmoid "
        "router's normalization, scaling factor and groups, and the rotary type and YaRN parameters of config.json "
        "are assumed")


def latent_norm_eps() -> float:
    """The epsilon of transformers' DeepseekV3 q/kv latent norms: ``DeepseekV3Attention`` builds
    them with ``DeepseekV3RMSNorm``'s default, not config.json's ``rms_norm_eps``; Megatron's MLA
    uses its one ``norm_epsilon`` for them. Read from the class (1e-6 in transformers 5)."""
    try:
        import inspect

        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

        return float(inspect.signature(DeepseekV3RMSNorm.__init__).parameters["eps"].default)
    except Exception:  # noqa: BLE001 - transformers 5's value when the class cannot be read
        return 1e-6


def shared_width(config: dict) -> tuple[int | None, str]:
    """The shared experts' width (``n_shared_experts * moe_intermediate_size``) and how it is named."""
    n, width = config.get("n_shared_experts"), config.get("moe_intermediate_size")
    ok = isinstance(n, int) and isinstance(width, int)
    return (n * width if ok else None), "n_shared_experts x moe_intermediate_size"


def _rope_start(part: str, config: dict) -> tuple[int, int, int]:
    """(rows of one block, where the rotary rows start in it, how many) for ``part``."""
    rope, nope, kv = config.get("qk_rope_head_dim"), config.get("qk_nope_head_dim"), config.get("kv_lora_rank")
    if part == "mla_q":
        if not (isinstance(rope, int) and isinstance(nope, int)):
            raise BadInput("config.json has no qk_nope_head_dim/qk_rope_head_dim for multi-latent attention")
        return nope + rope, nope, rope
    if not (isinstance(rope, int) and isinstance(kv, int)):
        raise BadInput("config.json has no kv_lora_rank/qk_rope_head_dim for multi-latent attention")
    return kv + rope, kv, rope


def rows(part: str, count: int, config: dict, name: str) -> list[tuple[int, int]]:
    """The row ranges of ``name`` (``count`` rows) in Hugging Face's order: all of them with
    ``rope_interleave`` (HF's default), else each head's rotary rows evens first, then odds.

    Example: ``kv_lora_rank`` 4, ``qk_rope_head_dim`` 4, ``rope_interleave=False``:
    ``kv_a_proj_with_mqa`` is rows ``0-4, 4, 6, 5, 7``."""
    block, start, rope = _rope_start(part, config)
    blocks = config.get("num_attention_heads") if part == "mla_q" else 1
    if not isinstance(blocks, int) or count != blocks * block:
        what = (f"{blocks} heads of {block} (qk_nope_head_dim + qk_rope_head_dim)" if part == "mla_q"
                else f"kv_lora_rank + qk_rope_head_dim = {block}")
        raise BadInput(f"{name}: {count} rows, but config.json's {what} make "
                       f"{blocks * block if isinstance(blocks, int) else '?'}: config.json does not describe this "
                       "model")
    if config.get("rope_interleave", True):
        return [(0, count)]
    if rope % 2:
        raise BadInput(f"{name}: an odd qk_rope_head_dim ({rope}) has no rotary pairs")
    out = []
    for b in range(blocks):
        at = b * block
        out.append((at, at + start))
        out += [(at + start + 2 * j, at + start + 2 * j + 1) for j in range(rope // 2)]
        out += [(at + start + 2 * j + 1, at + start + 2 * j + 2) for j in range(rope // 2)]
    return _merge(out)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if a == b:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def check_config(config: dict, src) -> None:
    """What config.json must say for any DeepSeek-V3 export of a Megatron save (with or without
    the run's arguments): keys and values as many heads as queries (MLA has no query groups)."""
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if kv is not None and kv != heads:
        raise BadInput(f"{src}: config.json's num_key_value_heads {kv} is not num_attention_heads {heads}: "
                       "multi-latent attention gives every head its own key and value; pass --base with a config "
                       "that says so")


def _mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope(config: dict) -> dict:
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else None
    rope = rope or config.get("rope_scaling") or {}
    return {**rope, "rope_theta": rope.get("rope_theta", config.get("rope_theta"))}


def _rope_wrong(args: dict, config: dict) -> list[str]:
    """The rotary type and YaRN's parameters, and the two scalings MLA applies, compared as numbers."""
    m = {k: args.get(k) if args.get(k) is not None else d for k, d in _MEGATRON_DEFAULTS.items()}
    rope = _rope(config)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    wrong = []
    factor = rope.get("factor")
    if m["rope_type"] == "rope":
        if kind != "default":
            wrong.append(f"rope_type='rope' but config.json's rope_type is {kind!r}")
    elif m["rope_type"] == "yarn":
        if kind != "yarn":
            return [f"rope_type='yarn' but config.json's rope_type is {kind!r}"]
        hf = {"rotary_scaling_factor": factor, "original_max_position_embeddings":
              rope.get("original_max_position_embeddings"), "beta_fast": rope.get("beta_fast") or 32,
              "beta_slow": rope.get("beta_slow") or 1}
        wrong += [f"{k}={m[k]!r} but config.json's rope {'factor' if k == 'rotary_scaling_factor' else k} is {v!r}"
                  for k, v in hf.items() if not isinstance(v, (int, float)) or not _close(m[k], v)]
        if rope.get("truncate", True) is not True:
            wrong.append("config.json's rope truncate is false (Megatron rounds YaRN's correction range)")
        if wrong:
            return wrong
        megatron_rot = _mscale(m["rotary_scaling_factor"], m["mscale"]) / _mscale(m["rotary_scaling_factor"],
                                                                                  m["mscale_all_dim"])
        hf_m, hf_all = rope.get("mscale"), rope.get("mscale_all_dim")
        hf_rot = rope.get("attention_factor") or (_mscale(factor, hf_m) / _mscale(factor, hf_all) if hf_m and hf_all
                                                  else _mscale(factor, 1.0))
        if not _close(megatron_rot, hf_rot):
            wrong.append(f"mscale={m['mscale']!r}, mscale_all_dim={m['mscale_all_dim']!r} scale the rotary part by "
                         f"{megatron_rot:.6g} but config.json's rope parameters by {hf_rot:.6g}")
    else:
        wrong.append(f"rope_type={m['rope_type']!r} (rope or yarn expected)")
    # the softmax scale: Megatron multiplies by mscale(factor, mscale_all_dim)**2 whatever its rope type
    megatron_soft = _mscale(m["rotary_scaling_factor"], m["mscale_all_dim"]) ** 2
    hf_all = rope.get("mscale_all_dim") if kind != "default" else None
    hf_soft = _mscale(factor, hf_all) ** 2 if hf_all and isinstance(factor, (int, float)) else 1.0
    if not wrong and not _close(megatron_soft, hf_soft):
        wrong.append(f"rotary_scaling_factor={m['rotary_scaling_factor']!r} with mscale_all_dim="
                     f"{m['mscale_all_dim']!r} scale the attention softmax by {megatron_soft:.6g}, config.json's "
                     f"rope parameters by {hf_soft:.6g}")
    return wrong


def _moe_layers(freq, layers) -> list[bool] | None:
    """Which layers are MoE, as Megatron reads ``moe_layer_freq`` (an int k: every k-th layer)."""
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0 and isinstance(layers, int):
        return [i % freq == 0 for i in range(layers)]
    if isinstance(freq, (list, tuple)) and all(v in (0, 1) for v in freq):
        return [bool(v) for v in freq]
    return None


def wrong_args(args: dict, config: dict) -> list[str]:
    """What in the training arguments ``args`` differs from DeepSeek-V3's ``config`` (each a phrase
    naming the argument); empty when Hugging Face's model computes what Megatron's computed."""
    wrong = []
    eps = latent_norm_eps()
    if isinstance(args.get("norm_epsilon"), (int, float)) and not _close(args["norm_epsilon"], eps):
        wrong.append(f"norm_epsilon={args['norm_epsilon']!r}: Megatron's q/kv latent norms use it, transformers' "
                     f"DeepseekV3 builds q_a_layernorm/kv_a_layernorm with {eps!r} whatever config.json says")
    for k, (key, none) in EQUAL.items():
        if k not in args:
            continue
        a = none if args[k] in (None, 0) and none is not None else args[k]
        c = config.get(key, none)
        c = none if c is None else c
        if not _close(a, c):
            wrong.append(f"{k}={args[k]!r} but config.json's {key} is {config.get(key)!r}")
    topk, groups, group_topk = args.get("moe_router_topk"), args.get("moe_router_num_groups"), args.get(
        "moe_router_group_topk")
    if groups and groups > 1 and group_topk and isinstance(topk, int) and topk // group_topk != 2:
        wrong.append(f"moe_router_topk={topk} with moe_router_group_topk={group_topk}: Megatron scores a group by its "
                     f"top {topk // group_topk} experts, transformers' DeepseekV3 by its top 2")
    if isinstance(topk, int) and bool(config.get("norm_topk_prob")) != (topk > 1):
        wrong.append(f"moe_router_topk={topk}: Megatron's sigmoid router {'normalizes' if topk > 1 else 'does not'} "
                     "normalize the top-k weights but config.json's norm_topk_prob is "
                     f"{config.get('norm_topk_prob')!r}")
    if "moe_shared_expert_intermediate_size" in args:
        have, want = args["moe_shared_expert_intermediate_size"] or 0, shared_width(config)[0] or 0
        if have != want:
            wrong.append(f"moe_shared_expert_intermediate_size={args['moe_shared_expert_intermediate_size']!r} but "
                         f"config.json's n_shared_experts x moe_intermediate_size is {want}")
    if "moe_layer_freq" in args:
        moe = _moe_layers(args["moe_layer_freq"], args.get("num_layers"))
        dense = config.get("first_k_dense_replace") or 0
        layers = config.get("num_hidden_layers")
        hf = [i >= dense for i in range(layers)] if isinstance(layers, int) else None
        if moe is None or moe != hf:
            wrong.append(f"moe_layer_freq={args['moe_layer_freq']!r} but config.json's first_k_dense_replace {dense} "
                         f"of {layers} layers makes layers {dense}.. MoE (transformers' DeepseekV3 has dense layers "
                         "first, then MoE ones)")
    return wrong + _rope_wrong(args, config)


def _close(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)
    return a == b
