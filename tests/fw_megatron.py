"""Megatron-Core ``torch_dist`` saves on CPU ranks, with Megatron-Core's own checkpointing code.

A tiny ``GPTModel`` (local layer spec, no Transformer Engine; tensor and pipeline parallel 1,
so the ranks are data-parallel replicas) and ``torch.optim.AdamW``, one step on drawn
gradients (Megatron's forward needs a GPU buffer), then
``dist_checkpointing.save({"model": model.sharded_state_dict(), "optimizer": ...},
sharded_strategy="torch_dist")``: the optimizer's state mapped onto the model's sharded
tensors as Megatron's own ``FP32Optimizer.sharded_state_dict`` maps it
(``get_param_id_to_sharded_param_map`` + ``optim_state_to_sharding_state``).

CPU (fair in tests only): Megatron-Core calls ``torch.cuda.synchronize`` and
``torch.cuda.current_device`` unconditionally; those two, and only those, are stubbed.
"""

from __future__ import annotations

import os

from fw_common import VOCAB

LR = 1e-2


def _cpu() -> None:
    import torch

    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"  # tensors it makes "on the current device" stay on the CPU


def _model(seed: int):
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                               num_query_groups=2, use_cpu_initialization=True, bias_dropout_fusion=False,
                               masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
                               hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=64)


def job(rank: int, world_size: int, out: str, *, steps: int = 1, seed: int = 0) -> dict:
    """Train ``steps`` steps, save to ``out``; rank 0 returns its full model and optimizer state."""
    _cpu()
    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map, optim_state_to_sharding_state,
    )

    parallel_state.initialize_model_parallel(1, 1)
    model = _model(seed)
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
    dist_checkpointing.save({"model": model_sd, "optimizer": optim_sd}, out)
    torch.distributed.barrier()
    held = {"model": {k: v.detach().clone() for k, v in model.state_dict().items() if v is not None and torch.is_tensor(v)},
            "optimizer": optimizer.state_dict()}
    parallel_state.destroy_model_parallel()
    return held if rank == 0 else None


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
