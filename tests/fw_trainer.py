"""A real ``transformers.Trainer`` FSDP2 job (SHARDED_STATE_DICT) on CPU ranks, saved by the Trainer's
own ``_save_checkpoint`` and resumed by ``trainer.train(resume_from_checkpoint=...)``.

The one CPU workaround (fair only in tests, the same as ``fw_accelerate``): accelerate 1.x turns FSDP
on only for GPU-like distributed types, so right after the Trainer creates its
``Accelerator(cpu=True, fsdp_plugin=...)`` the state is told it is FSDP (``_CpuFsdpTrainer``).
The plugin is the Trainer's own, built from ``TrainingArguments.fsdp_config``. Everything else --
wrapping (``fully_shard``), optimizer, scheduler, data loading, saving and loading -- is the
Trainer's / accelerate's own code.

Data: a map-style dataset of ``12 * max_steps`` rows, rows ``12*s .. 12*s+11`` being
``fw_common.global_batch(s)``, read with ``train_sampling_strategy="sequential"``. accelerate's
``BatchSamplerShard`` hands rank ``r`` batch ``s*world_size + r`` of size ``12 // world_size``,
i.e. exactly ``batch_for(s, r, world_size)``; the job asserts that on every step. On resume the
Trainer skips the first ``global_step`` batches of the epoch itself, at any world size.

Losses: each rank records the loss ``compute_loss`` returns (its own mean over its tokens, which is
what the Trainer back-propagates; every rank has the same token count), and at the end one
all-reduce turns them into the global mean over the 12 sequences of each step. The Trainer's own
logged loss is rounded, so it is not used for the 1e-5 comparison.

``lora=True``: the model is peft ``get_peft_model(tiny_model, LoraConfig(**fw_accelerate.LORA))``, so
the Trainer saves what it saves for PEFT models (under FSDP: the adapter's DTensors only, in
``pytorch_model_fsdp_0/``; without: ``adapter_model.safetensors`` + ``adapter_config.json``).
``fsdp=False``: a plain single-process Trainer (no FSDP, no CPU workaround). ``full_to``: the full
trained state dict is written there at the end (rank 0), the reference the tests compare against.
"""

from __future__ import annotations

import os

from fw_common import GLOBAL_BATCH, batch_for, global_batch, kill_when_written, save_steps, tiny_model

__all__ = ["job", "checkpoint_dir"]


def checkpoint_dir(out: str, step: int) -> str:
    """Where the Trainer saves the checkpoint of ``step`` under ``out`` (its ``output_dir``)."""
    return os.path.join(out, f"checkpoint-{step}")


def _set_env_from_dist() -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()),
                      LOCAL_RANK=str(dist.get_rank()), LOCAL_WORLD_SIZE=str(dist.get_world_size()))


class _Rows:
    """Map-style dataset: row ``i`` is sequence ``i % 12`` of ``global_batch(i // 12)``."""

    def __init__(self, n_steps: int):
        import torch

        self.ids = torch.cat([global_batch(s) for s in range(n_steps)])

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer_class():
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    from transformers import Trainer

    class _CpuFsdpTrainer(Trainer):
        """``Trainer`` plus the CPU-FSDP workaround and a per-step record of the local loss."""

        def _build_accelerator_args(self, **kwargs):
            # Keep the plugin the Trainer built from `fsdp_config` (accelerate drops it on CPU).
            self._fsdp_plugin = kwargs.get("fsdp_plugin")
            return super()._build_accelerator_args(**kwargs)

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            if not self.args.fsdp:
                return
            plugin = self._fsdp_plugin
            assert plugin is not None and plugin.fsdp_version == 2, plugin
            state = self.accelerator.state
            # CPU workaround named in issue 10 (see the module docstring).
            state.distributed_type = DistributedType.FSDP
            state.fsdp_plugin = plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            # What the Trainer derives from the state right after creating the accelerator.
            self.is_fsdp_enabled = True
            assert self.accelerator.is_fsdp2

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            import torch
            import torch.distributed as dist

            if model.training:
                step = self.state.global_step
                want = batch_for(step, dist.get_rank(), dist.get_world_size())
                if not torch.equal(inputs["input_ids"].cpu(), want):
                    raise AssertionError(f"rank {dist.get_rank()} step {step}: not batch_for({step}, ...)")
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                loss = out[0] if return_outputs else out
                self.step_losses.append((self.state.global_step, loss.detach().float().clone()))
            return out

    return _CpuFsdpTrainer


def _check_fully_sharded(model) -> None:
    """The prepared model must be FSDP2: root and every decoder layer ``FSDPModule``, every parameter a
    DTensor sharded (``Shard(0)``) over all ranks."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    assert isinstance(model, FSDPModule), type(model)
    layers = [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]
    assert layers and all(isinstance(m, FSDPModule) for m in layers), "decoder layers not fully_shard-ed"
    params = list(model.parameters())
    assert params and all(isinstance(p, DTensor) for p in params), "parameters are not DTensors"
    ws = dist.get_world_size()
    assert all(p.device_mesh.size() == ws and p.placements[0].is_shard(0) for p in params), "not Shard(0)"


def job(rank: int, world_size: int, out: str, *, save_at: int | tuple[int, ...] | None, load: str | None, steps: int,
        seed: int = 0, lora: bool = False, fsdp: bool = True, full_to: str | None = None,
        kill_in: str | None = None) -> list[float]:
    """Train ``steps`` optimizer steps on the fixed global batches with a real ``Trainer`` (FSDP2).

    ``out`` is the Trainer's ``output_dir``; with ``save_at`` the Trainer saves after that step into
    ``checkpoint_dir(out, save_at)`` (``out/checkpoint-{save_at}``), and only then. With ``load``
    (a ``checkpoint-N`` directory) it resumes there via ``train(resume_from_checkpoint=load)`` and
    runs steps ``N .. N+steps-1``. Returns the global (mean over the 12 sequences) loss of each step run.
    ``save_at`` may name several steps (a ``checkpoint-N`` each); ``kill_in``: this process is
    SIGKILLed once a file exists there (a save cut off mid-write).
    """
    import json

    import torch
    import torch.distributed as dist
    from transformers import TrainerCallback, TrainingArguments, default_data_collator

    _set_env_from_dist()
    saves = save_steps(save_at)
    if kill_in:
        kill_when_written(kill_in)
    first = 0
    if load:
        with open(os.path.join(load, "trainer_state.json")) as f:
            first = int(json.load(f)["global_step"])
    max_steps = first + steps
    per = GLOBAL_BATCH // world_size
    assert per * world_size == GLOBAL_BATCH, world_size

    args = TrainingArguments(
        output_dir=out,
        use_cpu=True,
        ddp_backend="gloo",
        fsdp="full_shard auto_wrap" if fsdp else "",
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                     "state_dict_type": "SHARDED_STATE_DICT", "reshard_after_forward": True,
                     "cpu_ram_efficient_loading": False} if fsdp else None,
        per_device_train_batch_size=per,
        gradient_accumulation_steps=1,
        max_steps=max_steps,
        train_sampling_strategy="sequential",
        dataloader_drop_last=True,
        dataloader_num_workers=0,
        optim="adamw_torch",
        learning_rate=1e-2,
        weight_decay=0.01,
        # Step-dependent but independent of max_steps, so the saved scheduler state matters and an
        # uninterrupted run of any length has the same schedule: lr = 1e-2 / sqrt(step + 1).
        lr_scheduler_type="inverse_sqrt",
        lr_scheduler_kwargs={"timescale": 1},
        warmup_steps=0,
        save_strategy="steps" if saves else "no",
        save_steps=1,
        logging_steps=1,
        report_to=[],
        seed=seed,
        data_seed=seed,
        disable_tqdm=True,
        log_level="error",
    )

    class _SaveOnlyAt(TrainerCallback):
        # save_steps=save_at would also save at every multiple of it; keep only checkpoint-{save_at}.
        def on_step_end(self, a, state, control, **kw):
            control.should_save = state.global_step in saves
            return control

    cls = _trainer_class()
    model = tiny_model(seed)
    if lora:
        from fw_accelerate import LORA
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**LORA))
    trainer = cls(model=model, args=args, train_dataset=_Rows(max_steps),
                  data_collator=default_data_collator, callbacks=[_SaveOnlyAt()])
    trainer.step_losses = []
    trainer.train(resume_from_checkpoint=load) if load else trainer.train()
    if fsdp:
        _check_fully_sharded(trainer.model_wrapped)
    if full_to:
        from fw_accelerate import _save_full

        _save_full(trainer.model_wrapped, full_to if rank == 0 else None)

    got = [s for s, _ in trainer.step_losses]
    assert got == list(range(first, max_steps)), got
    local = torch.stack([l for _, l in trainer.step_losses])
    dist.all_reduce(local)
    return [x / world_size for x in local.tolist()]
