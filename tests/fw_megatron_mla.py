"""A tiny DeepSeek-V3-style Megatron-Core GPT saved with ``torch_dist`` on CPU ranks.

Multi-latent attention (``MLASelfAttention``, Megatron's local layer spec: ``linear_q_down_proj``,
``q_layernorm``, ``linear_q_up_proj``, ``linear_kv_down_proj``, ``kv_layernorm``,
``linear_kv_up_proj``, ``linear_proj``; or ``linear_q_proj`` with ``q_lora_rank=None``), a dense
first layer (``moe_layer_freq=[0, 1, 1]``) then MoE layers with a shared expert and DeepSeek's
sigmoid router with expert bias, 4 experts, top 2 (or every layer MoE, ``freq=1``: Megatron then
stacks the layers on one axis), saved at expert parallel 2 on 2 gloo ranks with Megatron-Core's
own ``dist_checkpointing`` (and Megatron-LM's ``args``), as :mod:`fw_megatron` saves its MoE GPTs.
Every rank returns its parameters, its experts by global number and the logits of Megatron's own
whole-model forward (:func:`fw_megatron.logits`).
"""

from __future__ import annotations

import os

from fw_common import VOCAB
from fw_megatron import LLAMA, TOKENS, _cpu, _moe_cpu, logits

MLA = {"hidden": 64, "heads": 4, "layers": 3, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_head_dim": 16,
       "qk_pos_emb_head_dim": 8, "v_head_dim": 12, "ffn": 96, "expert_ffn": 32, "experts": 4, "topk": 2,
       "shared": 1, "scaling": 2.5, "freq": [0, 1, 1]}
# transformers' DeepseekV3 builds its q/kv latent norms with RMSNorm's default epsilon, 1e-6; Megatron
# uses one epsilon for every norm: DeepSeek-V3's own 1e-6
EPS = 1e-6
YARN = {"rotary_scaling_factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def _mla_cpu() -> None:
    """Without Transformer Engine, Megatron-Core 0.16.1's ``extensions.transformer_engine`` still
    imports, binding ``TELinear`` to a ``MagicMock`` placeholder, so ``multi_latent_attention``
    sets ``HAVE_TE = True`` and its ``isinstance(self.linear_proj, TELinear)`` raises ``TypeError:
    isinstance() arg 2 must be a type``. Set to what its own ``ImportError`` branch sets."""
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False


def _local_core_attention():
    """Megatron-Core 0.16.1's local ``DotProductAttention`` as MLA's local spec builds it: MLA
    passes ``k_channels``/``v_channels`` (TE's attention takes them; the local one raises
    ``TypeError: DotProductAttention.__init__() got an unexpected keyword argument 'k_channels'``).
    Its forward already takes the key's width from the key and the value's from the value; only
    its output width comes from ``kv_channels``, which the config sets to ``v_head_dim``. So the
    two arguments are dropped and Megatron's own attention (its ``softmax_scale``, mask, softmax)
    runs unchanged."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalMLAAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            assert v_channels in (None, self.hidden_size_per_attention_head), v_channels

    return LocalMLAAttention


def _model(ep: int, q_lora: bool, yarn: bool, mtp: bool = False, freq=MLA["freq"], vocab: int = VOCAB):
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    m = MLA
    rope = {"rope_type": "yarn", **YARN} if yarn else {"rope_type": "rope"}
    config = MLATransformerConfig(
        **LLAMA, **rope, activation_func=torch.nn.functional.silu, num_layers=m["layers"], hidden_size=m["hidden"],
        ffn_hidden_size=m["ffn"], num_attention_heads=m["heads"], q_lora_rank=m["q_lora_rank"] if q_lora else None,
        kv_lora_rank=m["kv_lora_rank"], qk_head_dim=m["qk_head_dim"], qk_pos_emb_head_dim=m["qk_pos_emb_head_dim"],
        v_head_dim=m["v_head_dim"], kv_channels=m["v_head_dim"], qk_layernorm=True, layernorm_epsilon=EPS,
        rotary_base=10000, num_moe_experts=m["experts"],
        moe_router_topk=m["topk"], moe_ffn_hidden_size=m["expert_ffn"],
        moe_shared_expert_intermediate_size=m["shared"] * m["expert_ffn"], moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=m["scaling"],
        moe_router_dtype="fp32", moe_grouped_gemm=False, expert_model_parallel_size=ep,
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none", moe_layer_freq=freq,
        pipeline_dtype=torch.float32, use_cpu_initialization=True, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0, mtp_num_layers=1 if mtp else None)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = _local_core_attention()
    extra = {}
    if mtp:  # DeepSeek-V3's multi-token prediction layer (mtp.layers.0.*), which HF's model has no place for
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        extra["mtp_block_spec"] = get_gpt_mtp_block_spec(config, spec.layer_specs[-1], use_transformer_engine=False)
    return GPTModel(config, spec, vocab_size=vocab, max_sequence_length=64, position_embedding_type="rope", **extra)


def mla_args(q_lora: bool = True, yarn: bool = False, ep: int = 2, freq=MLA["freq"]) -> dict:
    """The Megatron-LM arguments (``pretrain_gpt.py`` flags) that train :func:`_model`."""
    import torch

    m = MLA
    rope = {"rope_type": "yarn", **YARN} if yarn else {"rope_type": "rope"}
    return {"num_layers": m["layers"], "hidden_size": m["hidden"], "ffn_hidden_size": m["ffn"],
            "num_attention_heads": m["heads"], "multi_latent_attention": True,
            "q_lora_rank": m["q_lora_rank"] if q_lora else None, "kv_lora_rank": m["kv_lora_rank"],
            "qk_head_dim": m["qk_head_dim"], "qk_pos_emb_head_dim": m["qk_pos_emb_head_dim"],
            "v_head_dim": m["v_head_dim"], "qk_layernorm": True, **rope, "rotary_base": 10000,
            "rotary_interleaved": False, "rotary_percent": 1.0, "swiglu": True, "normalization": "RMSNorm",
            "norm_epsilon": EPS, "position_embedding_type": "rope", "use_rope_scaling": False,
            "add_bias_linear": False, "add_qkv_bias": False, "untie_embeddings_and_output_weights": True,
            "padded_vocab_size": VOCAB, "num_experts": m["experts"], "moe_router_topk": m["topk"],
            "moe_ffn_hidden_size": m["expert_ffn"],
            "moe_shared_expert_intermediate_size": m["shared"] * m["expert_ffn"],
            "moe_shared_expert_gate": False, "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True, "moe_router_topk_scaling_factor": m["scaling"],
            "moe_router_pre_softmax": False, "moe_router_num_groups": None, "moe_router_group_topk": None,
            "moe_layer_freq": freq, "moe_grouped_gemm": False, "expert_model_parallel_size": ep,
            "moe_token_dispatcher_type": "allgather", "mtp_num_layers": None, "params_dtype": torch.float32,
            "iteration": 1}


def mla_job(rank: int, world_size: int, out: str, q_lora: bool = True, yarn: bool = False, ep: int = 2,
            mtp: bool = False, freq=MLA["freq"]) -> dict:
    """Draw the tiny model's weights (norms away from 1, the experts different on each rank, the
    router's expert bias nonzero), save at expert parallel ``ep``; every rank returns its
    parameters, its experts by global number and Megatron's logits on :data:`fw_megatron.TOKENS`."""
    _cpu()
    _moe_cpu()
    _mla_cpu()
    import argparse
    import zlib

    import torch
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    torch.manual_seed(0)
    model = _model(ep, q_lora, yarn, mtp, freq)
    first = parallel_state.get_expert_model_parallel_rank() * (MLA["experts"] // ep)
    with torch.no_grad():
        for name, p in model.named_parameters():
            expert = "local_experts" in name
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + (1000 * rank if expert else 0))
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if "norm" in name else 0.05))
        for i, layer in enumerate(model.decoder.layers):  # the aux-loss-free balancing's learned bias
            bias = getattr(getattr(layer.mlp, "router", None), "expert_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(50 + i)) * 0.1)
    os.makedirs(out, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "checkpoint_version": 3.0, "iteration": 1,
                             "args": argparse.Namespace(**{**mla_args(q_lora, yarn, ep, freq),
                                                           "mtp_num_layers": 1 if mtp else None})}, out)
    torch.distributed.barrier()
    experts = {}
    for i, layer in enumerate(model.decoder.layers):
        for j, mlp in enumerate(getattr(getattr(layer.mlp, "experts", None), "local_experts", ())):
            experts[(i, first + j)] = {"fc1": mlp.linear_fc1.weight.detach().clone(),
                                       "fc2": mlp.linear_fc2.weight.detach().clone()}
    held = {"model": {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)},
            "experts": experts, "tokens": TOKENS, "logits": None if mtp else logits(model, TOKENS)}
    parallel_state.destroy_model_parallel()
    return held
