"""Tiny Mixture-of-Experts models (transformers 5: experts fused in memory) and the real 2-rank
FSDP2 jobs that save and load them, for tests/test_moe.py.

Each family is built from its config with a fixed seed (hidden 64, 4 experts, 2 layers), so a
rank, the test process and a load job all get the same weights. The save job wraps every decoder
layer and then the root with ``fully_shard`` (experts ``[E, ...]`` split ``Shard(0)``: two
experts per rank) and writes what a plain FSDP2 job and verl write: ``dcp.save({"model":
model.state_dict()})`` and ``model_world_size_2_rank_{r}.pt`` (+ ``fsdp_config.json``), each with
``huggingface/config.json`` beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=32, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, rope_scaling=None)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        intermediate_size=32, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
COMMON = dict(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)


def config(family: str, **changes):
    import transformers

    cfg_name, _, kw = FAMILIES[family]
    return getattr(transformers, cfg_name)(**{**COMMON, **kw, **changes})


def build(family: str, seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, FAMILIES[family][1])(config(family))


def _wrap(model) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def save_job(rank: int, world_size: int, root: str, families: tuple[str, ...]) -> None:
    """Every family saved as a plain FSDP2 DCP (``ROOT/FAMILY/dcp``) and as verl's rank files
    (``ROOT/FAMILY/verl``)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    for family in families:
        model = build(family)
        _wrap(model)
        state = model.state_dict()
        base = Path(root) / family
        dcp.save({"model": state}, checkpoint_id=str(base / "dcp"))
        (base / "verl").mkdir(parents=True, exist_ok=True)
        torch.save(state, base / "verl" / f"model_world_size_{world_size}_rank_{rank}.pt")
        if rank == 0:
            for where in ("dcp", "verl"):
                model.config.save_pretrained(base / where / "huggingface")
            (base / "verl" / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world_size}))
        dist.barrier()


def load_job(rank: int, world_size: int, sources: list[tuple[str, str, str]]) -> list:
    """For each ``(family, kind, path)``: a model of another seed, wrapped, then filled from a
    DCP (``dcp.load``) or this rank's file (``load_state_dict``, strict); returns the full
    weights (rank 0), in order."""
    import torch
    import torch.distributed.checkpoint as dcp

    out = []
    for family, kind, path in sources:
        model = build(family, seed=1)
        _wrap(model)
        if kind == "dcp":
            state = model.state_dict()
            dcp.load({"model": state}, checkpoint_id=path)
            model.load_state_dict(state)
        else:
            model.load_state_dict(torch.load(Path(path) / f"model_world_size_{world_size}_rank_{rank}.pt",
                                             weights_only=True))
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        out.append(full if rank == 0 else None)
    return out
