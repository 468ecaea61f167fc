"""Plain PyTorch FSDP1 training, saved every way PyTorch documents, on CPU ranks.

``FullyShardedDataParallel(model, use_orig_params=True)`` with each ``LlamaDecoderLayer``
auto-wrapped (``transformer_auto_wrap_policy``), AdamW. After step ``save_at`` the job saves,
each into its own directory under ``out``:

- ``model_optim``: ``dcp.save({"model", "optim"})`` of ``get_state_dict(model, optimizer)``
  (the key PyTorch's DCP tutorial uses);
- ``model_optimizer``: the same under ``"optimizer"``;
- ``app``: the tutorial's ``{"app": AppState}``, one ``Stateful`` holding both (``app.model.*``,
  ``app.optim.*``);
- ``sharded_dcp``: ``SHARDED_STATE_DICT`` model state + ``FSDP.optim_state_dict`` through
  ``dcp.save`` (ShardedTensors);
- ``sharded_pt``: the same per rank with ``torch.save``, named as verl names its rank files
  (``model_/optim_world_size_W_rank_r.pt``);
- ``full``: ``FULL_STATE_DICT`` (``rank0_only``) model and the full FQN-keyed optimizer state in
  one ``torch.save`` file, ``full/full.pt``.

``resume`` loads each of the given directories with that mode's own load path and runs the
remaining steps, so one spawned job checks every mode.

CPU workarounds (fair in tests only): ``sync_module_states=True`` raises for CPU parameters, so
rank 0's parameters are broadcast by hand before wrapping; ``device_id="cpu"``.
``FULL_STATE_DICT`` with ``offload_to_cpu=True`` crashes torch 2.13 on CPU: it is saved with
``offload_to_cpu=False``.
"""

from __future__ import annotations

import functools
import os

from fw_common import batch_for

LR = 1e-2
MODES = ("model_optim", "model_optimizer", "app", "sharded_dcp", "sharded_pt", "full")


def _build(seed: int, tied: bool):
    import torch
    import torch.distributed as dist
    from make_fixtures import tiny_llama_config
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(seed)
    module = LlamaForCausalLM(tiny_llama_config(tied=tied))
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=0)
    model = FSDP(module, use_orig_params=True, device_id="cpu", sync_module_states=False,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                    transformer_layer_cls={LlamaDecoderLayer}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    return model, optimizer


class AppState:
    """The Stateful of PyTorch's DCP tutorial."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def _save(mode: str, path: str, model, optimizer, rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    if mode in ("model_optim", "model_optimizer"):
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim" if mode == "model_optim" else "optimizer": optim_sd}, checkpoint_id=path)
    elif mode == "app":
        dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=path)
    elif mode in ("sharded_dcp", "sharded_pt"):
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            model_sd, optim_sd = model.state_dict(), FSDP.optim_state_dict(model, optimizer)
        if mode == "sharded_dcp":
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        else:
            os.makedirs(path, exist_ok=True)
            torch.save(model_sd, os.path.join(path, f"model_world_size_{world_size}_rank_{rank}.pt"))
            torch.save(optim_sd, os.path.join(path, f"optim_world_size_{world_size}_rank_{rank}.pt"))
    elif mode == "full":
        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            model_sd = model.state_dict()
        # FSDP.full_optim_state_dict on CPU returns exp_avg aliased to exp_avg_sq (torch 2.13):
        # the full optimizer state comes from get_state_dict's full_state_dict option instead
        _, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
        if rank == 0:
            os.makedirs(path, exist_ok=True)
            torch.save({"model": model_sd, "optimizer": optim_sd}, os.path.join(path, "full.pt"))
    else:
        raise ValueError(mode)
    dist.barrier()


def _load(mode: str, path: str, model, optimizer, rank: int, world_size: int) -> None:
    """Each mode's own documented load path (a ``full`` save is loaded after ``ckpt convert --to
    dcp``, through the ``model_optimizer`` path)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    if mode in ("model_optim", "model_optimizer", "full"):
        key = "optim" if mode == "model_optim" else "optimizer"
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, key: optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state[key])
    elif mode == "app":
        dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=path)
    elif mode == "sharded_dcp":
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict()}
            dcp.load(state, checkpoint_id=path)
            model.load_state_dict(state["model"])
            optim = load_sharded_optimizer_state_dict(model_state_dict=state["model"], optimizer_key="optim",
                                                      storage_reader=dcp.FileSystemReader(path))
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, optim["optim"]))
    elif mode == "sharded_pt":
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            model.load_state_dict(torch.load(os.path.join(path, f"model_world_size_{world_size}_rank_{rank}.pt"),
                                             weights_only=False))
            osd = torch.load(os.path.join(path, f"optim_world_size_{world_size}_rank_{rank}.pt"), weights_only=False)
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, osd))
    else:
        raise ValueError(mode)


def _train(model, optimizer, first: int, steps: int, rank: int, world_size: int, on_step=None) -> list[float]:
    import torch.distributed as dist

    losses = []
    model.train()
    for step in range(first, first + steps):
        ids = batch_for(step, rank, world_size)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        g = loss.detach().clone()
        dist.all_reduce(g)
        losses.append(g.item() / world_size)
        if on_step is not None:
            on_step(step + 1)
    return losses


def job(rank: int, world_size: int, out: str, *, save_at: int, steps: int, tied: bool = False,
        modes: tuple[str, ...] = MODES, seed: int = 0) -> list[float]:
    """Train ``steps`` steps, saving every mode of ``modes`` into ``out/<mode>`` after step
    ``save_at``; the global losses of every step."""
    model, optimizer = _build(seed, tied)

    def on_step(done: int) -> None:
        if done == save_at:
            for mode in modes:
                _save(mode, os.path.join(out, mode), model, optimizer, rank, world_size)

    return _train(model, optimizer, 0, steps, rank, world_size, on_step)


def resume(rank: int, world_size: int, out: str, *, paths: dict[str, str], first: int, steps: int,
           tied: bool = False, seed: int = 1) -> dict[str, list[float]]:
    """For each ``mode: path``: a fresh model (another seed, so nothing passes by accident) loaded
    from ``path`` the mode's own way, then ``steps`` steps from step ``first``."""
    results = {}
    for mode, path in paths.items():
        model, optimizer = _build(seed, tied)
        _load(mode, path, model, optimizer, rank, world_size)
        results[mode] = _train(model, optimizer, first, steps, rank, world_size)
    return results
