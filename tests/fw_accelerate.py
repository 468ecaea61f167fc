"""A real accelerate FSDP2 job (``save_state`` / ``load_state``, SHARDED_STATE_DICT) on CPU ranks.

The one CPU workaround (fair only in tests): accelerate 1.x turns FSDP on only for GPU-like
distributed types, so after ``Accelerator(cpu=True, fsdp_plugin=...)`` the state is told it is
FSDP. Everything else, saving and loading included, is accelerate's own code.

``lora=True``: the tiny Llama is wrapped by peft ``get_peft_model`` (``LORA``: r=4, alpha=8 on
q_proj/v_proj) before ``prepare``, only the adapter trains, and PEFT's ``adapter_config.json`` is
saved beside the state (what a user's script or the Trainer does; ``save_state`` itself does not).
``full_to``: rank 0 also writes the full trained state dict there when it saves (the reference the
tests compare exports against).
"""

from __future__ import annotations

import os

from fw_common import batch_for, tiny_model


def _accelerator():
    import torch.distributed as dist
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()),
                      LOCAL_RANK=str(dist.get_rank()), LOCAL_WORLD_SIZE=str(dist.get_world_size()))
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT",
                                            reshard_after_forward=True, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    # one scheduler step per optimizer step whatever the world size, so runs at different world
    # sizes follow one LR schedule
    acc = Accelerator(cpu=True, fsdp_plugin=plugin, step_scheduler_with_optimizer=False)
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return acc


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _model(seed: int, lora: bool):
    model = tiny_model(seed)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**LORA))
    return model


def job(rank: int, world_size: int, out: str, *, save_at: int | None, load: str | None, steps: int,
        seed: int = 0, lora: bool = False, full_to: str | None = None) -> list[float]:
    """Train ``steps`` steps on the fixed global batches; save after step ``save_at`` (into
    ``out``) or start from ``load``. Returns the global loss of every step run."""
    import torch
    import torch.distributed as dist

    acc = _accelerator()
    model = _model(seed, lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = acc.prepare(model, opt, sched)
    first = 0
    if load:
        acc.load_state(load)
        first = int(sched.scheduler.last_epoch)
    losses = []
    for step in range(first, first + steps):
        ids = batch_for(step, rank, world_size)
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        g = loss.detach().clone()
        dist.all_reduce(g)
        losses.append(g.item() / world_size)
        if save_at is not None and step + 1 == save_at:
            acc.save_state(out)
            if lora and acc.is_main_process:
                acc.unwrap_model(model).peft_config["default"].save_pretrained(out)
            if full_to:
                _save_full(model, full_to if rank == 0 else None)
    return losses


def _save_full(model, path: str | None) -> None:
    """The full (unsharded) state dict, gathered on every rank, written by the one given a path."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if path:
        torch.save(full, path)
