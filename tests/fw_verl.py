"""A real verl 0.9.1 FSDP job (``FSDPCheckpointManager.save_checkpoint`` / ``load_checkpoint``) on CPU ranks.

Three variants of ``job``, each built with verl's own pieces the way verl's FSDP engine
(``verl/workers/engine/fsdp/transformer_impl.py``) builds its actor:

- ``fsdp=2`` (verl ``strategy: fsdp2``): ``verl.utils.fsdp_utils.apply_fsdp2`` (``fully_shard`` on
  every ``LlamaDecoderLayer``, on ``embed_tokens`` and ``lm_head`` - verl wraps those two separately
  when the embeddings are untied - then on the root), then ``fsdp2_load_full_state_dict`` (rank 0's
  weights broadcast to the others, as verl does); gradients clipped with ``fsdp2_clip_grad_norm_``.
- ``fsdp=1`` (verl's default ``strategy: fsdp``): ``FullyShardedDataParallel`` with
  ``use_orig_params=False``, ``get_fsdp_wrap_policy`` (auto-wrap per ``LlamaDecoderLayer``),
  ``param_init_fn=init_fn``, ``get_sharding_strategy`` (FULL_SHARD),
  the device mesh, ``device_id=get_device_id()``, and ``FSDP.set_state_dict_type(SHARDED_STATE_DICT)``
  when world_size > 1; gradients clipped with ``module.clip_grad_norm_``.
- ``lora=True`` (with either; both resume exactly at 4 ranks): peft ``get_peft_model`` with verl's LoRA config
  (``task_type=CAUSAL_LM, r=4, lora_alpha=8, target_modules=[q_proj, v_proj], bias=none``) after
  ``enable_input_require_grads()``, before sharding, as verl does for ``lora_rank > 0``
  (FSDP1 then uses verl's LoRA lambda wrap policy too). verl writes ``lora_train_meta.json``
  for any model carrying a ``peft_config`` with r > 0: no checkpoint option is needed for it.

Optimizer: verl's ``build_optimizer`` (``torch.optim.AdamW``, ``FSDPOptimizerConfig``); LR schedule:
verl's ``get_cosine_schedule_with_warmup`` (passed to the manager as ``lr_scheduler``); the extra
state (``lr_scheduler`` + ``rng``) is what ``FSDPCheckpointManager`` itself saves.
``hf_model=True`` adds ``"hf_model"`` to ``checkpoint.save_contents``, which makes verl also write
the full model as ``huggingface/model.safetensors`` (+ ``generation_config.json``; rank 0, via
``save_pretrained``): the tensors keep the training dtype (fp32 here) while the rewritten
``config.json`` says ``"dtype": "bfloat16"``; with LoRA its keys are peft's
(``base_model.model.…``, ``…q_proj.base_layer.weight``, ``…lora_A.default.weight``). FSDP2 only:
with FSDP1 on CPU, torch's FULL_STATE_DICT unshard (``offload_to_cpu=True``) fails in
``_use_unsharded_views`` ("storage of size 0"), so ``fsdp=1, hf_model=True`` does not run on CPU.

CPU workaround (the one the issue names, fair only in tests): verl's ``get_device_id()`` asks
torch.cuda for the current device; it is replaced by ``lambda: "cpu"`` in ``verl.utils.device``
and in every verl module this job uses that imported it by name (``verl.utils.fsdp_utils``).
FSDP1 only, a second one that torch's FSDP1 (not verl) forces: ``sync_module_states=True`` raises
for CPU parameters, so rank 0's parameters and buffers are broadcast by hand before wrapping (what
``sync_module_states=True`` does) and FSDP1 gets ``sync_module_states=False``.

Deliberate configuration (not workarounds, all verl config options): the device mesh is
``init_device_mesh("cpu", (world_size,), mesh_dim_names=["fsdp"])`` - the mesh verl's
``create_device_mesh`` builds, on the "cpu" device type, because verl's ``get_device_name()``
says "cuda" on a CPU-only host; mixed precision is ``param_dtype=reduce_dtype=buffer_dtype=fp32``
(verl's ``mixed_precision`` config; verl's default bf16 compute would make losses at two world
sizes differ by more than 1e-5 after a rounding flip).
"""

from __future__ import annotations

import os

from fw_common import batch_for, kill_when_written, save_steps, tiny_model

LR = 1e-2
TOTAL_STEPS = 8       # cosine schedule length (the job itself runs ``steps`` steps)
CLIP_GRAD = 1.0       # verl's default ``optim.clip_grad``
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def _cpu_device_id():
    return "cpu"


def _patch_cpu() -> None:
    """verl's ``get_device_id`` -> "cpu", in verl.utils.device and where it was imported by name."""
    import sys

    import verl.utils.device
    import verl.utils.fsdp_utils  # noqa: F401 - imported here so its by-name binding exists

    verl.utils.device.get_device_id = _cpu_device_id
    for name in ("verl.utils.fsdp_utils", "verl.utils.checkpoint.fsdp_checkpoint_manager",
                 "verl.utils.checkpoint.checkpoint_manager"):
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "get_device_id"):
            mod.get_device_id = _cpu_device_id


def _build(world_size: int, fsdp: int, lora: bool, seed: int, trainable_only: bool = False, **shape):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from verl.utils.fsdp_utils import get_fsdp_wrap_policy, init_fn
    from verl.workers.engine.fsdp.utils import get_sharding_strategy

    mesh = init_device_mesh("cpu", mesh_shape=(world_size,), mesh_dim_names=["fsdp"])
    module = tiny_model(seed, **shape)  # fp32, as verl loads a training model
    if lora:
        from peft import LoraConfig, TaskType, get_peft_model

        module.enable_input_require_grads()
        module = get_peft_model(module, LoraConfig(task_type=TaskType.CAUSAL_LM, bias="none", **LORA))

    if fsdp == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardedStateDictConfig, StateDictType

        # CPU workaround #2 (torch's FSDP1, not verl): with sync_module_states=True, FSDP1 refuses
        # CPU parameters ("...requires them to be on GPU"). verl passes True so that rank 0's
        # weights reach the other ranks; the same broadcast is done here by hand, then False.
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0)
        module = FSDP(
            module,
            param_init_fn=init_fn,
            auto_wrap_policy=get_fsdp_wrap_policy(module=module, config={}, is_lora=lora),
            device_id=_cpu_device_id(),
            sharding_strategy=get_sharding_strategy(mesh, zero3_enable=True),
            mixed_precision=MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                           buffer_dtype=torch.float32),
            sync_module_states=False,  # see above (verl: True)
            device_mesh=mesh,
            forward_prefetch=False,
            use_orig_params=False,
            cpu_offload=None,
        )
        if world_size == 1:  # as verl's _build_fsdp_module (the manager switches to SHARDED itself)
            from torch.distributed.fsdp import FullStateDictConfig

            FSDP.set_state_dict_type(module, state_dict_type=StateDictType.FULL_STATE_DICT,
                                     state_dict_config=FullStateDictConfig())
        else:
            FSDP.set_state_dict_type(module, state_dict_type=StateDictType.SHARDED_STATE_DICT,
                                     state_dict_config=ShardedStateDictConfig())
    elif fsdp == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from verl.utils.fsdp_utils import apply_fsdp2, fsdp2_load_full_state_dict

        mp_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                         cast_forward_inputs=True)
        fsdp_kwargs = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": None,
                       "reshard_after_forward": True}
        full_state = module.state_dict()
        apply_fsdp2(module, fsdp_kwargs, {})
        fsdp2_load_full_state_dict(module, full_state, mesh, None)
    else:
        raise ValueError(f"fsdp must be 1 or 2, got {fsdp!r}")

    from verl.utils.torch_functional import get_cosine_schedule_with_warmup
    from verl.workers.config.optimizer import FSDPOptimizerConfig, build_optimizer

    optim_config = FSDPOptimizerConfig(lr=LR, weight_decay=0.01, clip_grad=CLIP_GRAD,
                                       lr_scheduler_type="cosine", total_training_steps=TOTAL_STEPS,
                                       min_lr_ratio=0.1)
    # trainable_only: the optimizer over the parameters that train (a LoRA run's adapters), as
    # jobs that pass ``filter(lambda p: p.requires_grad, ...)`` build it: its ids number those only
    params = [p for p in module.parameters() if p.requires_grad] if trainable_only else module.parameters()
    optimizer = build_optimizer(params, optim_config)
    lr_scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=0,
                                                   num_training_steps=TOTAL_STEPS, min_lr_ratio=0.1)
    return module, optimizer, lr_scheduler


def _load_dcp(module, optimizer, lr_scheduler, path: str) -> None:
    """An FSDP2 job's own resume from a DCP holding model, optimizer and LR scheduler."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(module, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd, "lr_scheduler": lr_scheduler.state_dict()}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    lr_scheduler.load_state_dict(state["lr_scheduler"])


def _dataloader_state(steps: int) -> dict:
    """What verl's trainer saves as ``global_step_N/data.pt``: its ``StatefulDataLoader``'s
    ``state_dict()`` after ``steps`` batches."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(list(range(64)), batch_size=4)
    it = iter(loader)
    for _ in range(steps):
        next(it)
    return loader.state_dict()


def job(rank: int, world_size: int, out: str, *, save_at: int | tuple[int, ...] | None, load: str | None, steps: int,
        seed: int = 0, fsdp: int = 2, lora: bool = False, hf_model: bool = False,
        kill_in: str | None = None, full_optim: str | None = None, trainable_only: bool = False,
        **shape) -> list[float]:
    """Train ``steps`` steps on the fixed global batches; save after step ``save_at`` into ``out``
    with ``FSDPCheckpointManager.save_checkpoint(out, global_step=save_at)``, or start from ``load``
    with ``FSDPCheckpointManager.load_checkpoint(load)`` (continuing at the saved step, read back
    from the restored LR scheduler). Returns the global (all-reduced mean) loss of every step run.

    ``fsdp``: 2 (``fully_shard``) or 1 (``FullyShardedDataParallel``, ``use_orig_params=False``);
    ``lora``: peft LoRA r=4/alpha=8 on q_proj/v_proj; ``hf_model``: also save
    ``huggingface/model.safetensors`` (``checkpoint.save_contents`` += ``hf_model``); ``shape``:
    ``tied``/``odd`` for :func:`fw_common.tiny_model`.

    A run saving as it goes: ``save_at`` several steps and ``out`` with ``{step}``
    (``run/global_step_{step}/actor``, as verl's trainer lays it out), and after each save rank 0
    writes ``latest_checkpointed_iteration.txt`` beside the step dirs, as verl's trainer does.
    ``kill_in``: this process is SIGKILLed once a file exists there (a save cut off mid-write).

    ``load`` may also be a DCP directory (FSDP2 only): then the job resumes as PyTorch documents
    it, ``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``, with the LR scheduler's state
    under ``lr_scheduler``. ``full_optim``: FSDP1 only, also write ``FSDP.full_optim_state_dict``
    there at each save (rank 0). ``trainable_only``: the optimizer is built over the parameters
    with ``requires_grad`` only (with ``lora``: the adapters), so its int ids number those."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")
    _patch_cpu()
    from make_fixtures import build_tokenizer
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from verl.trainer.config import CheckpointConfig
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.fsdp_utils import fsdp2_clip_grad_norm_

    module, optimizer, lr_scheduler = _build(world_size, fsdp, lora, seed, trainable_only, **shape)
    contents = ["model", "optimizer", "extra"] + (["hf_model"] if hf_model else [])
    manager = FSDPCheckpointManager(
        model=module,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        processing_class=build_tokenizer(),
        checkpoint_config=CheckpointConfig(save_contents=contents, load_contents=["model", "optimizer", "extra"]),
    )
    first = 0
    if load and os.path.isfile(os.path.join(load, ".metadata")):
        _load_dcp(module, optimizer, lr_scheduler, load)
        first = int(lr_scheduler.last_epoch)
    elif load:
        manager.load_checkpoint(load)
        first = int(lr_scheduler.last_epoch)

    losses = []
    module.train()
    for step in range(first, first + steps):
        ids = batch_for(step, rank, world_size)
        loss = module(input_ids=ids, labels=ids).loss
        loss.backward()
        # verl's FSDPEngine.optimizer_step
        if isinstance(module, FSDP):
            grad_norm = module.clip_grad_norm_(CLIP_GRAD)
        elif isinstance(module, FSDPModule):
            grad_norm = fsdp2_clip_grad_norm_(module.parameters(), max_norm=CLIP_GRAD)
        else:  # pragma: no cover
            raise AssertionError(type(module))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if not torch.isfinite(grad_norm):
            raise RuntimeError(f"grad_norm is not finite at step {step}: {grad_norm}")
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        g = loss.detach().clone()
        dist.all_reduce(g)
        losses.append(g.item() / world_size)
        if step + 1 in save_steps(save_at):
            if kill_in:
                kill_when_written(kill_in)
            manager.save_checkpoint(out.format(step=step + 1), global_step=step + 1)
            if full_optim:  # FSDP1's own full optimizer state, to compare with (a collective)
                full = FSDP.full_optim_state_dict(module, optimizer)
                if rank == 0:
                    torch.save(full, full_optim)
            if "{step}" in out and rank == 0:  # verl's trainer, after its save returned
                run = os.path.dirname(os.path.dirname(out.format(step=step + 1)))
                # its dataloader's state beside the roles (ray_trainer._save_checkpoint: data.pt)
                torch.save(_dataloader_state(step + 1), os.path.join(run, f"global_step_{step + 1}", "data.pt"))
                with open(os.path.join(run, "latest_checkpointed_iteration.txt"), "w") as f:
                    f.write(str(step + 1))
    return losses
