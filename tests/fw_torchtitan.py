"""A real torchtitan 0.3 FSDP2 job (``CheckpointManager`` save / load, ``step-N/`` DCP dirs) on CPU ranks.

Everything that touches the checkpoint is torchtitan's own code: its llama3 model
(``torchtitan.models.llama3``: ``Llama3Model``, fused-QKV attention whose state-dict hooks
split ``wqkv`` into ``wq``/``wk``/``wv``), its own ``parallelize_llama`` (FSDP2 ``fully_shard``
on ``tok_embeddings``, each ``layers.<i>``, ``[norm, lm_head]`` and the root, gradient division
off), its ``OptimizersContainer`` (flat FQN-keyed optimizer state), its ``LRSchedulersContainer``
(warmup + linear decay ``LambdaLR``), its ``ParallelAwareDataloader`` (a
``torchdata.StatefulDataLoader`` that saves ``dataloader.dp_rank_<r>`` + ``dataloader.world_size``),
the trainer's ``train_state`` (a verbatim copy of ``Trainer.state_dict`` / ``load_state_dict``:
``step``, ``ntokens_seen``; see ``TrainState``), its loss (``CrossEntropyLoss``: token sum / global valid tokens), its
``clip_grad_norm_``, and ``torchtitan.components.checkpoint.CheckpointManager`` for saving and
loading. The training step mirrors ``Trainer.train_step`` for the pure-FSDP, non-PP case.

CPU workarounds (fair only in tests, the ones issue 10 names):

* ``torch._utils._get_available_device_type`` returns ``"cpu"`` before torchtitan is imported:
  ``torchtitan.tools.utils`` reads it at import time to pick its device (``"cuda"`` otherwise) and
  ``ParallelDims.build_mesh`` builds its meshes on that device type.
* The attention is torchtitan's causal ``ScaledDotProductAttention`` instead of ``FlexAttention``
  (no CPU backward). ``get_attention_config("sdpa")`` refuses it for language models (it cannot
  take per-document positions), so the flex config the llama3 builder makes is swapped for it
  afterwards; this job feeds plain causal sequences (no ``positions``), where they are the same.
* ``set_force_sum_reduction_for_comms(True)`` on every ``fully_shard`` module: FSDP2 otherwise
  reduce-scatters with ``PREMUL_SUM``, which gloo lacks. torchtitan already turns gradient division
  off (``gradient_divide_factor=1.0``, the loss is divided by the global token count), so a plain
  SUM is exactly its own reduction.

Other choices, not workarounds: ``parallelism.spmd_backend = "partial_dtensor"`` (torchtitan's
classic FSDP2 path: ``fully_shard`` on the 1-D ``fsdp`` mesh, DTensor ``Shard(0)`` parameters).
0.3's default ``"spmd_types"`` fails here inside ``fully_shard`` ("When dp_mesh_dims is provided,
all parameters must be DTensors on the full SPMD mesh") without the rest of ``Trainer.__init__``;
not pursued. ``mixed_precision_param = "float32"`` (the default bf16 compute would blur the 1e-5
loss comparisons), AdamW ``implementation="for-loop"`` (torchtitan's default is "fused").

Initial weights depend on the world size: ``init_weights`` fills each rank's DTensor shard from
the rank's own CPU generator (DTensor's RNG tracker does not run on a CPU mesh), so fresh runs at
different world sizes start apart. Resumes are unaffected: they load the weights.

The data: every step trains on ``fw_common.global_batch(step)`` (12 sequences of 8 tokens: input
= tokens ``[:-1]``, labels = tokens ``[1:]``), split evenly over the DP ranks, served by a tiny
in-memory, ``Stateful`` iterable dataset through torchtitan's ``ParallelAwareDataloader``. Its
position is restored from ``dataloader.dp_rank_<r>`` at the same DP degree. torchtitan cannot
reshard dataloader state (``load_state_dict`` asserts the saved ``world_size`` equals the DP
degree), so a resume at another DP degree needs ``exclude_from_loading=["dataloader"]`` and then
positions the data itself: this job does that from the restored ``train_state.step`` (a real
HF-streaming dataset would restart from its beginning instead).
"""

from __future__ import annotations

import os

from fw_common import GLOBAL_BATCH, SEQ, VOCAB, global_batch, kill_when_written, save_steps

# The tiny llama3 (torchtitan's own model classes).
DIM = 32
N_LAYERS = 2
N_HEADS = 4
N_KV_HEADS = 2
# The LR schedule's length: fixed so that a save run and a resume run build the same schedule.
TOTAL_STEPS = 10
WARMUP_STEPS = 2
LR = 1e-2


def _cpu_device_patch() -> None:
    """Make torchtitan pick "cpu" (it reads this once, when ``torchtitan.tools.utils`` is imported)."""
    import sys

    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    if "torchtitan.tools.utils" in sys.modules and sys.modules["torchtitan.tools.utils"].device_type != "cpu":
        raise RuntimeError("torchtitan was imported before the CPU device patch; import it in the rank only")


def model_config():
    """torchtitan's llama3 config, tiny: dim 32, 2 layers, 4 heads, 2 kv heads, vocab 101."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers,
                                          _output_linear_init)
    from torchtitan.models.llama3.model import Llama3Model

    layers = _build_llama3_layers(
        fuse_qkv=True, n_layers=N_LAYERS, dim=DIM, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS,
        hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=16),
        rope=ComplexRoPE.Config(dim=DIM // N_HEADS, max_seq_len=SEQ, theta=500000, scaling="llama"),
        attn_backend="flex")
    for layer in layers:  # CPU workaround: causal SDPA instead of FlexAttention (see module doc)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=layers)


class _Batches:
    """A tiny in-memory, checkpointable iterable dataset: this DP rank's rows of the fixed global
    batches, one sample (input, label) at a time, step after step. Its ``state_dict`` is the
    position, like torchtitan's own text datasets (``sample_idx``)."""

    def __init__(self, dp_rank: int, dp_world_size: int):
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.per = GLOBAL_BATCH // dp_world_size
        self.sample_idx = 0

    def __iter__(self):
        while True:
            step, row = divmod(self.sample_idx, self.per)
            seq = global_batch(step)[self.dp_rank * self.per + row]
            self.sample_idx += 1
            yield {"input": seq[:-1]}, seq[1:]

    def state_dict(self):
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state):
        self.sample_idx = state["sample_idx"]


class TrainState:
    """The ``train_state`` entry of torchtitan's checkpoint: ``Trainer`` registers itself as
    ``states={"train_state": self}``, and ``Trainer.state_dict`` / ``Trainer.load_state_dict``
    (torchtitan/trainer.py) are exactly these two. Copied rather than imported because
    ``torchtitan.trainer`` imports ``torch.utils.tensorboard`` (the ``tensorboard`` package)
    at module level, which the test environment does not need otherwise.
    ``ntokens_seen`` counts this rank's tokens (the trainer sums it over ranks only to log it)."""

    def __init__(self):
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict):
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


def _dataloader(dp_rank: int, dp_world_size: int):
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader

    class Batches(_Batches, IterableDataset):
        pass

    ds = Batches(dp_rank, dp_world_size)
    return ParallelAwareDataloader(ds, dp_rank=dp_rank, dp_world_size=dp_world_size,
                                   batch_size=ds.per, num_workers=0), ds


def build_model(cfg, parallel_dims, training, parallelism, parallelize=None):
    """The model as torchtitan's Trainer.__init__ makes it: meta init, its ``parallelize``
    function (default ``parallelize_llama``), materialize on CPU, init weights."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig

    if parallelize is None:
        from torchtitan.models.llama3 import parallelize_llama as parallelize

    with torch.device("meta"):
        model = cfg.build()
    model = parallelize(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                        compile_config=CompileConfig(), ac_config=None, dump_folder="")
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # CPU workaround: gloo has no PREMUL_SUM
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def optimizer_parts(model):
    """torchtitan's AdamW (one param group, the for-loop implementation) and its linear-decay LR
    schedule over ``TOTAL_STEPS``, as the tests' jobs build them."""
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={
            "lr": LR, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})],
        implementation="for-loop").build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=WARMUP_STEPS, decay_type="linear").build(
        optimizers=optimizers, training_steps=TOTAL_STEPS)
    return optimizers, lr_schedulers


def initial_load(src: str, model, optimizers, lr_schedulers, train_state) -> None:
    """Resume from the DCP ``src`` as torchtitan's ``checkpoint.initial_load_path`` does (model,
    optimizer, LR schedule and train state; not the dataloader); raise if nothing was loaded."""
    import os

    from torchtitan.components.checkpoint import CheckpointManager

    ck = CheckpointManager.Config(enable=True, keep_latest_k=0, interval=10**9, last_save_model_only=False,
                                  folder=os.path.join(src, "no-such-folder"), initial_load_path=os.path.abspath(src),
                                  initial_load_model_only=False, exclude_from_loading=["dataloader"]).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={"train_state": train_state}, sd_adapter=None, base_folder="")
    try:
        if not ck.load(step=-1):
            raise RuntimeError(f"torchtitan loaded nothing from {src}")
    finally:
        ck.close()


def job(rank: int, world_size: int, out: str | None, *, save_at: int | tuple[int, ...] | None, load: str | None,
        steps: int, seed: int = 0, exclude_from_loading: tuple[str, ...] | None = None,
        kill_in: str | None = None) -> list[float]:
    """Train ``steps`` steps on the fixed global batches; save after step ``save_at`` (into the
    checkpoint folder ``out``: torchtitan writes ``out/step-<save_at>/``) or start from ``load``.

    ``load`` is either a ``step-N`` DCP dir (loaded through ``checkpoint.initial_load_path`` with
    ``initial_load_model_only=False``) or a checkpoint folder holding ``step-N`` dirs (torchtitan's
    own resume: ``checkpoint.folder`` = that folder, the latest step is loaded). Training continues
    at the restored ``train_state.step``; with ``save_at`` too, a folder resume saves into that
    folder (``out`` must be None or the same), a step-dir resume into ``out``.

    ``exclude_from_loading`` is torchtitan's ``checkpoint.exclude_from_loading``. ``None`` (default)
    means: ``("dataloader",)`` when this rank cannot take the saved dataloader state
    (``dataloader_loadable``: another DP degree, or no ``dataloader.dp_rank_<r>``), which is what a
    torchtitan user resuming at another DP degree has to set; then the data is positioned from the
    restored ``train_state.step``. Pass ``()`` to see torchtitan's own failure instead.
    Returns the global loss (torchtitan's: token sum over all ranks / global tokens) of each step.
    ``save_at`` may name several steps (a ``step-N`` each); ``kill_in``: this process is
    SIGKILLed once a file exists there (a save cut off mid-write).
    """
    _cpu_device_patch()
    import torch
    import torch.distributed as dist
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    torch.manual_seed(seed)
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    training = TrainingConfig(mixed_precision_param="float32", steps=TOTAL_STEPS, seq_len=SEQ - 1,
                              local_batch_size=GLOBAL_BATCH // world_size)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, world_size)
    parallel_dims.build_mesh()
    batch_mesh = parallel_dims.get_mesh("batch") if parallel_dims.dp_enabled else None
    dp_degree, dp_rank = (batch_mesh.size(), batch_mesh.get_local_rank()) if batch_mesh else (1, 0)

    model = build_model(model_config(), parallel_dims, training, parallelism)
    model.train()
    model_parts = [model]

    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={
            "lr": LR, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})],
        implementation="for-loop").build(model_parts=model_parts)
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=WARMUP_STEPS, decay_type="linear").build(
        optimizers=optimizers, training_steps=TOTAL_STEPS)
    loss_fn = CrossEntropyLoss.Config().build()

    train_state = TrainState()
    dataloader, dataset = _dataloader(dp_rank, dp_degree)

    saves = save_steps(save_at)
    ckpt_kwargs = dict(enable=True, keep_latest_k=0, interval=saves[0] if len(saves) == 1 else 1,
                       last_save_model_only=False)
    if load and os.path.isfile(os.path.join(load, ".metadata")):
        # torchtitan takes initial_load_path only while checkpoint.folder holds no step-N: with
        # out=None point the folder at a path that does not exist (nothing is saved there).
        ckpt_kwargs.update(folder=os.path.abspath(out or os.path.join(load, "no-such-folder")),
                           initial_load_path=os.path.abspath(load), initial_load_model_only=False)
    elif load:
        if save_at is not None and out is not None and os.path.abspath(out) != os.path.abspath(load):
            raise ValueError("resuming from a checkpoint folder saves into that folder; pass out=None or out=load")
        ckpt_kwargs.update(folder=os.path.abspath(load))
    else:
        ckpt_kwargs.update(folder=os.path.abspath(out))
    if exclude_from_loading is None:  # auto: what a user resuming at another DP degree must set
        exclude_from_loading = () if not load or dataloader_loadable(load, dp_rank, dp_degree) else ("dataloader",)
    ckpt_kwargs.update(exclude_from_loading=list(exclude_from_loading))
    checkpointer = CheckpointManager.Config(**ckpt_kwargs).build(
        dataloader=dataloader, model_parts=model_parts, optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={"train_state": train_state}, sd_adapter=None, base_folder="")
    try:
        if load:
            if not checkpointer.load(step=-1):
                raise RuntimeError(f"torchtitan found no checkpoint to load at {load}")
            if "dataloader" in exclude_from_loading:
                # torchtitan cannot reshard dataloader state; put the data where the run was.
                dataset.sample_idx = train_state.step * dataset.per

        losses = []
        data_iter = iter(dataloader)
        for _ in range(steps):
            train_state.step += 1
            # Trainer.train_step, pure FSDP, one microbatch, no PP.
            optimizers.zero_grad()
            input_dict, labels = next(data_iter)
            local_valid_tokens = torch.tensor(labels.numel(), dtype=torch.int64)
            global_valid_tokens = (dist_utils.dist_sum_tensor(local_valid_tokens, batch_mesh)
                                   if batch_mesh else local_valid_tokens)
            train_state.ntokens_seen += labels.numel()
            pred = model(input_dict["input"])
            loss, _ = loss_fn(pred, labels, global_valid_tokens)
            del pred
            loss.backward()
            dist_utils.clip_grad_norm_([p for m in model_parts for p in m.parameters()], training.max_norm,
                                       foreach=True, pp_mesh=None, ep_enabled=False)
            optimizers.step()
            lr_schedulers.step()
            g = loss.detach().clone()
            dist.all_reduce(g)  # sum of (local token sum / global tokens) = global mean
            losses.append(g.item())
            if train_state.step in saves:
                # interval == save_at (1 for several), so torchtitan's own _should_save says yes here.
                if kill_in:
                    kill_when_written(kill_in)
                checkpointer.save(train_state.step, last_step=False)
        return losses
    finally:
        checkpointer.close()


def _step_dir(load: str) -> str:
    """``load`` itself when it is a DCP dir, else its latest ``step-N`` (torchtitan's own rule)."""
    import re

    if os.path.isfile(os.path.join(load, ".metadata")):
        return load
    steps = [int(m.group(1)) for n in os.listdir(load) if (m := re.fullmatch(r"step-(\d+)", n))
             and os.path.isfile(os.path.join(load, n, ".metadata"))]
    if not steps:
        raise FileNotFoundError(f"no step-N checkpoint under {load}")
    return os.path.join(load, f"step-{max(steps)}")


def dataloader_loadable(load: str, dp_rank: int, dp_degree: int) -> bool:
    """Whether torchtitan's ``ParallelAwareDataloader.load_state_dict`` can take this checkpoint's
    ``dataloader`` entry on this rank: it holds ``dataloader.dp_rank_<r>`` and its
    ``dataloader.world_size`` is the current DP degree (else torchtitan asserts "dp_degree is
    inconsistent before and after checkpoint, dataloader resharding is not supported yet", or DCP
    fails on the missing key). Read with DCP on this rank alone."""
    import warnings

    import torch.distributed.checkpoint as dcp

    path = _step_dir(load)
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if f"dataloader.dp_rank_{dp_rank}" not in keys or "dataloader.world_size" not in keys:
        return False
    sd = {"dataloader.world_size": 0}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return int(sd["dataloader.world_size"]) == dp_degree
