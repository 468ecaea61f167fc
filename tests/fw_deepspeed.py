"""DeepSpeed ZeRO training on CPU ranks, saved with the engine's own ``save_checkpoint``.

The tests' tiny Llama (``odd``: hidden 30, so groups, alignment and stage-3 partitions are
padded at 2 and 3 ranks) under ``deepspeed.initialize`` with ``torch.optim.AdamW`` as the
client optimizer (``zero_allow_untested_optimizer``), ZeRO stage 1, 2 or 3, fp32 or bf16.
After step ``save_at`` the engine saves ``out/global_step{save_at}/`` (plus ``latest``), then
the job records what the engine itself holds: every parameter's fp32 master and Adam moments,
gathered whole (``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``),
and runs on to ``steps``.

CPU (fair in tests only): ``DS_ACCELERATOR=cpu`` and the process group the harness opened
(gloo); DeepSpeed's shared-memory all-reduce stays off (``DS_BUILD_OPS=0`` at install), so no
op is compiled and collectives go through gloo.
"""

from __future__ import annotations

import os

from fw_common import GLOBAL_BATCH, batch_for

LR = 1e-2


def _engine(stage: int, bf16: bool, world_size: int, seed: int, odd: bool):
    import torch.distributed as dist

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # what a launcher sets; the harness opened the gloo group itself (one host)
    os.environ.update(LOCAL_RANK=str(dist.get_rank()), RANK=str(dist.get_rank()),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    import deepspeed
    import torch
    from fw_common import tiny_model

    model = tiny_model(seed, odd=odd)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _held(engine) -> dict:
    """The engine's own full fp32 master weights and Adam moments, by parameter name."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = {"fp32": safe_get_full_fp32_param(p).detach().clone().float(),
                     "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").detach().clone(),
                     "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").detach().clone()}
    return out


def job(rank: int, world_size: int, out: str, *, stage: int, bf16: bool = False, save_at: int = 2,
        steps: int = 4, seed: int = 0, odd: bool = True) -> dict:
    """Train ``steps`` steps, saving after ``save_at``; returns the global losses of every step
    and (rank 0) what the engine held at the save."""
    import torch
    import torch.distributed as dist

    engine = _engine(stage, bf16, world_size, seed, odd)
    losses, held = [], None
    for step in range(steps):
        ids = batch_for(step, rank, world_size)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        g = loss.detach().float().clone()
        dist.all_reduce(g)
        losses.append(g.item() / world_size)
        if step + 1 == save_at:
            engine.save_checkpoint(out, tag=f"global_step{save_at}")
            held = _held(engine)
    dist.barrier()
    return {"losses": losses, "held": held if rank == 0 else None, "dtype": str(torch.bfloat16 if bf16 else "")}
