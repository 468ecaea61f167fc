"""Megatron-Core ``torch_dist`` saves on CPU ranks, with Megatron-Core's own checkpointing code.

A tiny ``GPTModel`` (local layer spec, no Transformer Engine; tensor and pipeline parallel 1,
so the ranks are data-parallel replicas) and ``torch.optim.AdamW``, one step on drawn
gradients (Megatron's forward needs a GPU buffer), then
``dist_checkpointing.save({"model": model.sharded_state_dict(), "optimizer": ...},
sharded_strategy="torch_dist")``: the optimizer's state mapped onto the model's sharded
tensors as Megatron's own ``FP32Optimizer.sharded_state_dict`` maps it
(``get_param_id_to_sharded_param_map`` + ``optim_state_to_sharding_state``).

CPU (fair in tests only): Megatron-Core calls ``torch.cuda.synchronize`` and
``torch.cuda.current_device`` unconditionally; those two, and only those, are stubbed. The MoE
jobs (:func:`moe_job`) also bind the name ``te_general_gemm`` that Megatron-Core 0.16.1's router
reads but never binds without Transformer Engine (:func:`_moe_cpu`). The whole-model forward
(:func:`logits`) passes its causal mask in and answers ``torch.cuda.random.get_rng_state`` with
the CPU's state.
"""

from __future__ import annotations

import os

from fw_common import VOCAB

LR = 1e-2


def _cpu() -> None:
    import torch

    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"  # tensors it makes "on the current device" stay on the CPU


# Llama-style settings (what naming/megatron maps to LlamaForCausalLM): RMSNorm, SwiGLU, no biases,
# GQA (4 heads in 2 query groups), RoPE on the two halves of each head (Megatron's default)
LLAMA = {"normalization": "RMSNorm", "gated_linear_unit": True, "add_bias_linear": False}


def _model(seed: int, llama: bool = False, tied: bool = False, qkv_bias: bool = False, vocab: int = VOCAB):
    """The tiny GPT, this rank's part of it under tensor/pipeline parallelism (the layers of its
    pipeline stage; embedding on the first, output layer on the last)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    extra = {**LLAMA, "activation_func": torch.nn.functional.silu, "add_qkv_bias": qkv_bias} if llama else {}
    config = TransformerConfig(**extra, num_layers=2, hidden_size=32,
                               tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
                               pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
                               pipeline_dtype=torch.float32, ffn_hidden_size=64, num_attention_heads=4,
                               num_query_groups=2, use_cpu_initialization=True, bias_dropout_fusion=False,
                               masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
                               hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(config, get_gpt_layer_local_spec(normalization=config.normalization), vocab_size=vocab,
                    max_sequence_length=64, position_embedding_type="rope" if llama else "learned_absolute",
                    share_embeddings_and_output_weights=tied,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage())


def job(rank: int, world_size: int, out: str, *, steps: int = 1, seed: int = 0, llama: bool = False,
        tied: bool = False, qkv_bias: bool = False, run_args: dict | None = None, tp: int = 1, pp: int = 1) -> dict:
    """Train ``steps`` steps, save to ``out``; rank 0 returns its model and optimizer state (the
    whole model at ``tp = pp = 1``, else its part). ``run_args``: training arguments saved as
    Megatron-LM saves its ``args`` (a Namespace). ``tp``/``pp``: tensor and pipeline parallel
    sizes (the rest of the ranks data-parallel)."""
    _cpu()
    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map, optim_state_to_sharding_state,
    )

    parallel_state.initialize_model_parallel(tp, pp)
    model = _model(seed, llama, tied, qkv_bias, padded_vocab(tp))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    # its forward needs a GPU (a CUDA activation buffer): the gradients of each step are drawn
    # instead, the same on every rank, so the optimizer holds real AdamW state
    g = torch.Generator().manual_seed(100 + seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
        optimizer.zero_grad()
    model_sd = model.sharded_state_dict()
    optim_sd = optimizer.state_dict()
    id_map = get_param_id_to_sharded_param_map(model_sd, [p for g in optimizer.param_groups for p in g["params"]])
    optim_state_to_sharding_state(optim_sd, id_map, exclude_keys=("step",))
    os.makedirs(out, exist_ok=True)
    torch.distributed.barrier()
    # the default strategy is torch_dist (DCP underneath)
    common = {}
    if run_args is not None:  # as Megatron-LM's save_checkpoint adds them: in the common state (common.pt)
        import argparse

        common = {"args": argparse.Namespace(**run_args), "checkpoint_version": 3.0, "iteration": steps}
    dist_checkpointing.save({"model": model_sd, "optimizer": optim_sd, **common}, out)
    torch.distributed.barrier()
    held = {"model": {k: v.detach().clone() for k, v in model.state_dict().items() if v is not None and torch.is_tensor(v)},
            "optimizer": optimizer.state_dict()}
    if llama and tp == pp == 1:
        held["probe"] = probe(model)
        held["logits"] = logits(model, TOKENS)
    parallel_state.destroy_model_parallel()
    return held if rank == 0 else None


SEQ = 6


def probe(model) -> dict:
    """Megatron-Core's own modules run on a fixed input, per layer: the input norm, Q/K/V as
    ``get_query_key_value_tensors`` splits ``linear_qkv``'s output ([seq, batch, heads, head
    dim]), the same after Megatron's rotary embedding, ``linear_proj`` and the MLP (after its
    norm); plus the final norm. (The whole model's forward: :func:`logits`.)"""
    import torch
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(7)
    x = torch.randn(SEQ, 1, model.config.hidden_size, generator=g)
    freqs = model.rotary_pos_emb(SEQ)
    out = {"x": x}
    with torch.no_grad():
        for i, layer in enumerate(model.decoder.layers):
            normed = layer.input_layernorm(x)
            q, k, v = layer.self_attention.get_query_key_value_tensors(normed)[:3]
            att = layer.self_attention
            context = torch.randn(SEQ, 1, att.query_projection_size, generator=g)
            out[i] = {"input_norm": normed, "q": q, "k": k, "v": v,
                      "q_rot": apply_rotary_pos_emb(q, freqs, model.config),
                      "k_rot": apply_rotary_pos_emb(k, freqs, model.config),
                      "context": context, "proj": att.linear_proj(context)[0],
                      "mlp": layer.mlp(layer.pre_mlp_layernorm(x))[0]}
        out["final_norm"] = model.decoder.final_layernorm(x)
    return out


def load(rank: int, world_size: int, path: str, *, seed: int = 1) -> dict | None:
    """A fresh model (another seed) loaded from ``path`` with Megatron-Core's own
    ``dist_checkpointing.load``; rank 0 returns its state dict."""
    _cpu()
    import torch
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    model = _model(seed)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    model.load_state_dict(loaded["model"])
    out = {k: v.detach().clone() for k, v in model.state_dict().items() if v is not None and torch.is_tensor(v)}
    parallel_state.destroy_model_parallel()
    return out if rank == 0 else None


def resave(rank: int, world_size: int, src: str, out: str, *, tied: bool = False, qkv_bias: bool = False,
           vocab: int = VOCAB) -> None:
    """Megatron-Core's own resharding: a Llama-style model at tensor and pipeline parallel 1 loads
    the save at ``src`` (made at any TP/PP) with ``dist_checkpointing.load`` and saves its
    weights to ``out`` again, at TP = PP = 1, with the same training arguments."""
    _cpu()
    import argparse

    import torch
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    model = _model(1, True, tied, qkv_bias, vocab)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, src)
    model.load_state_dict(loaded["model"])
    os.makedirs(out, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "checkpoint_version": 3.0, "iteration": 1,
                             "args": argparse.Namespace(**{**llama_args(tied, qkv_bias), "padded_vocab_size": vocab})},
                            out)
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()


def llama_job(rank: int, world_size: int, out: str, tied: bool = False, qkv_bias: bool = False, tp: int = 1,
              pp: int = 1) -> dict:
    """:func:`job` with the Llama-style settings (``LLAMA``), tied or untied embeddings; with
    ``qkv_bias``, Qwen2's (biases on Q, K and V only); at tensor/pipeline parallel ``tp``/``pp``."""
    return job(rank, world_size, out, llama=True, tied=tied, qkv_bias=qkv_bias, tp=tp, pp=pp,
               run_args={**llama_args(tied, qkv_bias), "tensor_model_parallel_size": tp,
                         "pipeline_model_parallel_size": pp, "padded_vocab_size": padded_vocab(tp)})


def padded_vocab(tp: int) -> int:
    """The vocabulary as Megatron-LM pads it for ``tp`` tensor-parallel ranks (each holds an equal
    slice of the embedding; here a multiple of ``tp``, Megatron-LM's default is of 128 * tp)."""
    return -(-VOCAB // tp) * tp


def llama_args(tied: bool = False, qkv_bias: bool = False) -> dict:
    """The Megatron-LM arguments (``pretrain_gpt.py`` flags) that train :func:`_model`'s Llama-style
    GPT, as its ``args`` Namespace holds them (a dtype and an enum among them, as there)."""
    import torch
    from megatron.core.transformer.enums import AttnBackend

    return {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4, "kv_channels": 8,
            "group_query_attention": True, "num_query_groups": 2, "swiglu": True, "normalization": "RMSNorm",
            "norm_epsilon": 1e-5, "position_embedding_type": "rope", "rotary_interleaved": False,
            "rotary_percent": 1.0, "rotary_base": 10000, "use_rope_scaling": False, "qk_layernorm": False,
            "num_experts": None, "add_qkv_bias": qkv_bias, "add_bias_linear": False,
            "untie_embeddings_and_output_weights": not tied, "padded_vocab_size": VOCAB,
            "params_dtype": torch.float32, "attention_backend": AttnBackend.auto, "iteration": 1}


# -- Mixture-of-Experts (qwen3_moe: QK-norm; mixtral: none): Megatron-Core's MoE layer, local spec
# (SequentialMLP), 4 experts, top 2, saved at expert parallel 2 on the 2 ranks
MOE = {"hidden": 64, "heads": 4, "groups": 2, "head_dim": 16, "ffn": 128, "expert_ffn": 32, "experts": 4, "topk": 2}


def _moe_cpu() -> None:
    """Megatron-Core 0.16.1's router calls ``te_general_gemm`` by name when Transformer Engine is
    not installed, where the name was never bound (its import failed): bound to None, which is
    what its own check then tests for, so the router's matmul runs in torch."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _moe_model(family: str, ep: int, moe_layer_freq=1, etp: int = 1, vocab: int = VOCAB):
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    qk = family == "qwen3_moe"
    config = TransformerConfig(**LLAMA, activation_func=torch.nn.functional.silu, num_layers=2,
                               hidden_size=MOE["hidden"], ffn_hidden_size=MOE["ffn"], num_attention_heads=MOE["heads"],
                               num_query_groups=MOE["groups"], kv_channels=MOE["head_dim"], qk_layernorm=qk,
                               num_moe_experts=MOE["experts"], moe_router_topk=MOE["topk"],
                               moe_ffn_hidden_size=MOE["expert_ffn"], moe_grouped_gemm=False,
                               expert_model_parallel_size=ep, moe_token_dispatcher_type="allgather",
                               expert_tensor_parallel_size=etp,
                               moe_router_load_balancing_type="none", moe_layer_freq=moe_layer_freq,
                               pipeline_dtype=torch.float32,
                               use_cpu_initialization=True, bias_dropout_fusion=False, masked_softmax_fusion=False,
                               persist_layer_norm=False, gradient_accumulation_fusion=False, hidden_dropout=0.0,
                               attention_dropout=0.0)
    if moe_layer_freq == 1:
        spec = get_gpt_layer_local_spec(num_experts=MOE["experts"], moe_grouped_gemm=False, qk_layernorm=qk,
                                        normalization="RMSNorm")
    else:  # a spec per layer: dense where moe_layer_freq says 0
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(config, spec, vocab_size=vocab, max_sequence_length=64, position_embedding_type="rope")


def moe_args(family: str) -> dict:
    """The Megatron-LM arguments that train :func:`_moe_model` (``pretrain_gpt.py`` flags)."""
    return {**llama_args(), "hidden_size": MOE["hidden"], "ffn_hidden_size": MOE["ffn"], "kv_channels": MOE["head_dim"],
            "num_attention_heads": MOE["heads"], "num_query_groups": MOE["groups"],
            "qk_layernorm": family == "qwen3_moe", "num_experts": MOE["experts"], "moe_router_topk": MOE["topk"],
            "moe_ffn_hidden_size": MOE["expert_ffn"], "moe_router_pre_softmax": False,
            "moe_router_score_function": "softmax", "moe_shared_expert_intermediate_size": None,
            "moe_router_enable_expert_bias": False, "moe_router_topk_scaling_factor": None,
            "moe_router_num_groups": None, "moe_layer_freq": 1, "moe_grouped_gemm": False,
            "expert_model_parallel_size": 2, "moe_token_dispatcher_type": "allgather"}


def moe_job(rank: int, world_size: int, out: str, family: str = "qwen3_moe", ep: int = 2, etp: int = 1) -> dict:
    """A tiny MoE GPT at expert parallel ``ep`` (rank r holds experts ``r*E/ep ..``), its weights
    drawn (the experts differently on each rank, the replicated ones alike), saved with
    ``dist_checkpointing`` (torch_dist) and Megatron-LM's ``args``; every rank returns its
    parameters, its experts by global number and :func:`moe_probe`. ``etp``: the experts' own
    tensor parallel (Megatron's ``expert_tensor_parallel_size``; tensor parallel > 1 for the rest
    of an MoE model needs sequence parallel, which torch's norms refuse); no probe then."""
    _cpu()
    _moe_cpu()
    import argparse
    import zlib

    import torch
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    torch.manual_seed(0)
    model = _moe_model(family, ep, etp=etp)
    local, first = MOE["experts"] // ep, parallel_state.get_expert_model_parallel_rank() * (MOE["experts"] // ep)
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms away from 1, experts different on each rank
            expert = "local_experts" in name
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + (1000 * rank if expert else 0))
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if "norm" in name else 0.05))
    os.makedirs(out, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "checkpoint_version": 3.0, "iteration": 1,
                             "args": argparse.Namespace(**{**moe_args(family), "expert_model_parallel_size": ep,
                                                           "expert_tensor_parallel_size": etp})}, out)
    torch.distributed.barrier()
    experts = {}
    for i, layer in enumerate(model.decoder.layers):
        for j, mlp in enumerate(layer.mlp.experts.local_experts):
            experts[(i, first + j)] = {"fc1": mlp.linear_fc1.weight.detach().clone(),
                                              "fc2": mlp.linear_fc2.weight.detach().clone()}
    held = {"model": {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)},
            "experts": experts, "probe": moe_probe(model, first) if etp == 1 else None,
            "tokens": TOKENS, "logits": logits(model, TOKENS) if etp == 1 else None}
    parallel_state.destroy_model_parallel()
    return held


def moe_probe(model, first: int) -> dict:
    """:func:`probe`'s attention pieces, plus per layer Megatron's MoE modules on the normed
    input: the router's logits (``gating``) and its top-k weights (``forward``: ``[tokens, E]``,
    zero where an expert is not chosen), each local expert's MLP on every token (by global
    number); :func:`probe`'s ``"mlp"`` is here the whole MoE layer's forward (router, allgather
    dispatch across the expert-parallel ranks, experts, combine), which runs on CPU."""
    import torch

    model.eval()
    out = probe(model)
    x = out["x"]
    with torch.no_grad():
        for i, layer in enumerate(model.decoder.layers):
            moe_in = layer.pre_mlp_layernorm(x)
            probs, routing = layer.mlp.router(moe_in)
            out[i].update({"moe_in": moe_in, "router_logits": layer.mlp.router.gating(moe_in), "router_probs": probs,
                           "routing_map": routing,
                           "experts": {first + j: e(moe_in.view(-1, moe_in.shape[-1]))[0]
                                       for j, e in enumerate(layer.mlp.experts.local_experts)}})
    return out


def moe_resave(rank: int, world_size: int, src: str, out: str, family: str = "qwen3_moe", vocab: int = VOCAB) -> None:
    """Megatron-Core's own resharding of experts: the MoE model at expert parallel 1 (every expert
    on this one rank) loads the expert-parallel save at ``src`` with ``dist_checkpointing.load``
    and saves it again to ``out``, with the same training arguments."""
    _cpu()
    _moe_cpu()
    import argparse

    import torch
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    model = _moe_model(family, 1, vocab=vocab)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, src)
    model.load_state_dict(loaded["model"])
    os.makedirs(out, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "checkpoint_version": 3.0, "iteration": 1,
                             "args": argparse.Namespace(**{**moe_args(family), "expert_model_parallel_size": 1,
                                                           "padded_vocab_size": vocab})}, out)
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()


def moe_uneven_job(rank: int, world_size: int, out: str) -> dict | None:
    """A qwen3_moe-style GPT whose first layer is dense (``moe_layer_freq=[0, 1]``, Qwen3-MoE's
    ``mlp_only_layers=[0]``), saved at expert parallel 2: Megatron saves layers that are not
    homogeneous under one key per layer (``decoder.layers.1.mlp.router.weight`` ``[E, H]``).
    Rank r returns its parameters and its experts by global number."""
    _cpu()
    _moe_cpu()
    import argparse

    import torch
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    torch.manual_seed(0)
    model = _moe_model("qwen3_moe", 2, moe_layer_freq=[0, 1])
    os.makedirs(out, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "checkpoint_version": 3.0, "iteration": 1,
                             "args": argparse.Namespace(**{**moe_args("qwen3_moe"), "moe_layer_freq": [0, 1]})}, out)
    torch.distributed.barrier()
    local = MOE["experts"] // 2
    held = {"model": {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)},
            "experts": {(1, rank * local + j): {"fc1": e.linear_fc1.weight.detach().clone(),
                                                "fc2": e.linear_fc2.weight.detach().clone()}
                        for j, e in enumerate(model.decoder.layers[1].mlp.experts.local_experts)}}
    parallel_state.destroy_model_parallel()
    return held


TOKENS = [[3, 14, 15, 92, 65, 35, 89, 79]]  # one fixed sequence of token ids < VOCAB


def logits(model, tokens: list[list[int]]):
    """Megatron-Core's own whole-model forward on CPU: ``GPTModel(tokens, positions,
    attention_mask)`` -> logits ``[batch, seq, vocab]``. Two things stand in for a GPU: the causal
    mask is passed in (Megatron builds its default one on ``cuda``), and the dropout around
    attention forks the CUDA RNG tracker, which reads the CUDA RNG state: ``torch.cuda.random.
    get_rng_state`` returns the CPU's and the tracker is given that state (in eval with dropout 0
    no random number is drawn). Every rank must call it (the MoE layer's dispatch is collective)."""
    import torch
    import torch.cuda.random
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.cuda.random.get_rng_state = lambda device="cuda": torch.get_rng_state()
    get_cuda_rng_tracker().set_states({"model-parallel-rng": torch.get_rng_state()})
    ids = torch.tensor(tokens)
    seq = ids.shape[1]
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]  # True: masked
    model.eval()
    with torch.no_grad():
        return model(ids, torch.arange(seq)[None].expand_as(ids), attention_mask=causal)


def with_common(save_dir, tmp_path, change) -> str:
    """A copy of the save whose ``common.pt`` (the test's own file, so loaded whole) is changed
    by ``change(common)``; its path."""
    import shutil

    import torch

    copy = tmp_path / "changed"
    shutil.copytree(save_dir, copy)
    common = torch.load(copy / "common.pt", weights_only=False)
    change(common)
    torch.save(common, copy / "common.pt")
    return str(copy)
