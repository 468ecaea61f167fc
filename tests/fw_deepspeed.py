"""DeepSpeed ZeRO training on CPU ranks, saved with the engine's own ``save_checkpoint``.

The tests' tiny Llama at hidden 50 (intermediate 75, 5 heads of 10, one KV head): its
parameters' sizes (5050, 2500, 500, 3750, 50) leave stage-3 pads at 3 ranks and a stage-1/2
group pad at 2, and parameters straddle ranks under ``deepspeed.initialize`` with ``torch.optim.AdamW`` as the
client optimizer (``zero_allow_untested_optimizer``), ZeRO stage 1, 2 or 3, fp32 or bf16.
After step ``save_at`` the engine saves ``out/global_step{save_at}/`` (plus ``latest``), then
the job records what the engine itself holds: every parameter's fp32 master and Adam moments,
gathered whole (``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``),
and runs on to ``steps``.

CPU (fair in tests only): ``DS_ACCELERATOR=cpu``, the process group the harness opened (gloo)
and ``LOCAL_RANK`` set as a launcher would; DeepSpeed's shared-memory all-reduce is left off
(``DS_BUILD_OPS=0`` at install, and the op marked unavailable), so nothing is compiled and
collectives go through gloo. DeepSpeed clips gradients at 1.0 unless told: clipping is off, as
in the FSDP2 job resumed from the save.
"""

from __future__ import annotations

import os

from fw_common import GLOBAL_BATCH, batch_for

LR = 1e-2


def model(seed: int, width: int = 50, tied: bool = False):
    """The tiny Llama at hidden ``width`` (50, or the tests' ``odd`` 30), embeddings ``tied``."""
    import torch
    from fw_common import tiny_model
    from make_fixtures import tiny_llama_config
    from transformers import LlamaForCausalLM

    if width == 30:
        return tiny_model(seed, odd=True, tied=tied)
    torch.manual_seed(seed)
    config = tiny_llama_config(tied=tied)
    config.hidden_size, config.intermediate_size = width, width * 3 // 2
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = width // 10, 1, 10
    return LlamaForCausalLM(config)


def _engine(stage: int, bf16: bool, world_size: int, seed: int, width: int, tied: bool, fp16: bool = False):
    import torch.distributed as dist

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # what a launcher sets; the harness opened the gloo group itself (one host)
    os.environ.update(LOCAL_RANK=str(dist.get_rank()), RANK=str(dist.get_rank()),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    import deepspeed
    import torch
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    # DeepSpeed's shared-memory all-reduce is an optional CPU kernel it JIT-compiles with g++ on
    # first use (minutes); marked unavailable, collectives go through the gloo group
    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    if fp16:
        # DeepSpeed's CPU accelerator refuses fp16 unless oneDNN reports the CPU's native fp16
        # instructions (AVX512-FP16/AMX), a property of the machine, not of the save: torch
        # computes fp16 on any CPU, and the files DeepSpeed writes are the same
        from deepspeed.accelerator import get_accelerator

        accel = get_accelerator()
        accel.is_fp16_supported = lambda: True
        accel.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]
    module = model(seed, width, tied)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.01)
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told; the FSDP2 job resumed from it does not
        "bf16": {"enabled": bf16},
        # fp16: DeepSpeed's dynamic loss scaler, started low enough that no step overflows (a
        # skipped step would make the run's losses no reference for a resumed AdamW job)
        "fp16": {"enabled": fp16, "initial_scale_power": 8},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    # a scheduler whose factor stays 1 (the FSDP2 jobs resumed from the save have none): its
    # state (last_epoch, _step_count) is what the save carries
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _constant)
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine


def _constant(step: int) -> float:
    return 1.0


def _held(engine) -> dict:
    """The engine's own full fp32 master weights and Adam moments, by parameter name."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = {"fp32": safe_get_full_fp32_param(p).detach().clone().float(),
                     "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").detach().clone(),
                     "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").detach().clone()}
    return out


def _train_step(engine, step: int, rank: int, world_size: int) -> float:
    """One step of the engine on ``step``'s batch; the loss averaged over the ranks."""
    import torch.distributed as dist

    ids = batch_for(step, rank, world_size)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    g = loss.detach().float().clone()
    dist.all_reduce(g)
    return g.item() / world_size


def job(rank: int, world_size: int, out: str, *, stage: int, bf16: bool = False, save_at: int = 2,
        steps: int = 4, seed: int = 0, width: int = 50, tied: bool = False, fp16: bool = False) -> dict:
    """Train ``steps`` steps, saving after ``save_at``; returns the global losses of every step
    and (rank 0) what the engine held at the save."""
    import torch.distributed as dist

    engine = _engine(stage, bf16, world_size, seed, width, tied, fp16)
    losses, held, sched = [], None, None
    for step in range(steps):
        losses.append(_train_step(engine, step, rank, world_size))
        if step + 1 == save_at:
            engine.save_checkpoint(out, tag=f"global_step{save_at}")
            held, sched = _held(engine), engine.lr_scheduler.state_dict()
    dist.barrier()
    return {"losses": losses, "held": held if rank == 0 else None, "lr_scheduler": sched}


def resume_fsdp2(rank: int, world_size: int, path: str, *, first: int, steps: int, seed: int = 1,
                 width: int = 50, sharded: bool = False, tied: bool = False) -> list[float]:
    """An FSDP2 job (``fully_shard`` on each decoder layer, then the root; the same AdamW) that
    loads model and optimizer from the DCP at ``path`` (``get_state_dict`` → ``dcp.load`` →
    ``set_state_dict``), or with ``sharded`` from its rank files (``load_state_dict`` of each
    ``torch.load(weights_only=True)``), then trains ``steps`` steps from step ``first``: the
    global losses. Another seed, so nothing passes by accident."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    module = model(seed, width, tied)
    for layer in module.model.layers:
        fully_shard(layer)
    fully_shard(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.01)
    if sharded:
        module.load_state_dict(torch.load(os.path.join(path, f"model_world_size_{world_size}_rank_{rank}.pt"),
                                          weights_only=True))
        optimizer.load_state_dict(torch.load(os.path.join(path, f"optim_world_size_{world_size}_rank_{rank}.pt"),
                                             weights_only=True))
    else:
        model_sd, optim_sd = get_state_dict(module, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    losses = []
    for step in range(first, first + steps):
        ids = batch_for(step, rank, world_size)
        loss = module(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        g = loss.detach().clone()
        dist.all_reduce(g)
        losses.append(g.item() / world_size)
    return losses


def resume(rank: int, world_size: int, path: str, *, stage: int, bf16: bool = False, first: int, steps: int,
           seed: int = 1, width: int = 50, tied: bool = False, fp16: bool = False) -> dict:
    """A DeepSpeed job at ``world_size`` (the same config and AdamW; another seed, so nothing
    passes by accident) that loads the save at ``path`` with the engine's own
    ``load_checkpoint``, records what the engine then holds (fp32 master and moments, gathered)
    and trains ``steps`` steps from step ``first``: the global losses."""
    import torch.distributed as dist

    engine = _engine(stage, bf16, world_size, seed, width, tied, fp16)
    load_path, _ = engine.load_checkpoint(path)
    if load_path is None:
        raise RuntimeError(f"engine.load_checkpoint({path!r}) found nothing to load")
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:  # stages 1/2 link the parameters to their moments at the first step; asked now
        link()
    held = _held(engine)
    scheduler = engine.lr_scheduler.state_dict()  # as load_checkpoint restored it
    losses = []
    for step in range(first, first + steps):
        losses.append(_train_step(engine, step, rank, world_size))
    dist.barrier()
    return {"losses": losses, "held": held if rank == 0 else None, "global_steps": engine.global_steps,
            "global_samples": engine.global_samples, "lr_scheduler": scheduler}
