"""Expert parallelism (issue 32, item 3): a real torchtitan MoE job with EP, resharded and resumed.

torchtitan 0.3's qwen3 MoE (tiny: dim 64, 4 experts, top-2, 2 layers), parallelized by its own
``parallelize_qwen3`` with ``expert_parallel_degree=2`` over 4 CPU ranks (``dp_shard=4``, so
``efsdp=2``): the routed experts' ``w1_EFD``/``w2_EDF``/``w3_EFD`` are DTensors on the 2-D
``(efsdp, ep)`` mesh with ``(_StridedShard(0, sf=2), Shard(0))``, everything else FSDP2 on 4 ranks.
It trains 2 steps with tokens routed by all-to-all over the ep ranks, saves with its
``CheckpointManager`` (a DCP) and as per-rank ``torch.save(model.state_dict())`` files, then
trains 2 more steps (the uninterrupted run).

* ``ckpt reshard`` of the DCP to 3 ranks (plain FSDP, no EP) and to 2 ranks (EP 2, efsdp 1):
  torchtitan's own loader (``initial_load_path``) restores the model and AdamW state bit for bit
  (each DTensor's ``full_tensor()``), and the resumed job's next two losses are the uninterrupted
  run's (up to float summation order).
* The per-rank files cannot be resharded (a ``_StridedShard`` rank's rows are not one range of the
  tensor): refused with exit 3 saying so, nothing written.
* The EP DCP exports to what torchtitan's own ``to_hf`` gives for the full state.
"""

from __future__ import annotations

import functools
import json
import importlib.util
import os

import pytest
from click.testing import CliRunner
from dist import run_ranks

from ckpt_tools.cli.main import main as cli
from fw_common import GLOBAL_BATCH, VOCAB, close, global_batch
from test_meshes_2d import _assert_equal_sd, _full, _full_optim

# not imported here: the spawned ranks import this module, and torchtitan must be imported there
# only after fw_torchtitan's CPU device patch
pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None, reason="the EP tests need torchtitan 0.3")]

DIM, EXPERTS, STEPS, MORE = 64, 4, 2, 2


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args] + ["--quiet"])


def _config():
    """The tiny qwen3 MoE as torchtitan builds its own (``_build_qwen3_moe_layers``); causal SDPA
    instead of FlexAttention, whose backward does not run on CPU."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm

    layers = _build_qwen3_moe_layers(
        fuse_qkv=True, n_layers=2, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=16, moe_hidden_dim=32,
        num_experts=EXPERTS, top_k=2, attn_backend="flex", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=16, max_seq_len=128, theta=1000000.0))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Qwen3Model.Config(vocab_size=VOCAB, dim=DIM, norm=_qwen3_norm(DIM),
                             tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
                             lm_head=Linear.Config(in_features=DIM, out_features=VOCAB), layers=layers)


def _build(world_size: int, ep: int):
    """The model as torchtitan's Trainer makes it (meta init, ``parallelize_qwen3``, materialize,
    init weights), its AdamW and LR schedule (``fw_torchtitan``'s, as the 2-D mesh tests use)."""
    from fw_torchtitan import TOTAL_STEPS, _cpu_device_patch, build_model, optimizer_parts

    _cpu_device_patch()
    import torch
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.qwen3 import parallelize_qwen3
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    torch.manual_seed(0)
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", data_parallel_shard_degree=world_size,
                                    expert_parallel_degree=ep)
    training = TrainingConfig(mixed_precision_param="float32", steps=TOTAL_STEPS, seq_len=7,
                              local_batch_size=GLOBAL_BATCH // world_size)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    pd = ParallelDims.from_config(parallelism, world_size)
    pd.build_mesh()
    cfg = _config()
    set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=ep > 1)
    model = build_model(cfg, pd, training, parallelism, parallelize=parallelize_qwen3)
    optimizers, lr_schedulers = optimizer_parts(model)
    return model, optimizers, lr_schedulers


def _train(model, optimizers, lr_schedulers, rank: int, world_size: int, steps: range) -> list[float]:
    """torchtitan's loss: this rank's token sum over the global token count (so the summed
    gradients are the global mean's); returns the global loss of each step."""
    import torch
    import torch.distributed as dist

    per = GLOBAL_BATCH // world_size
    losses = []
    for step in steps:
        optimizers.zero_grad()
        seq = global_batch(step)[rank * per:(rank + 1) * per]
        pos = torch.arange(seq.shape[1] - 1).unsqueeze(0).expand(per, -1)
        pred = model(seq[:, :-1], pos)
        loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1), seq[:, 1:].flatten(), reduction="sum")
        loss = loss / (GLOBAL_BATCH * (seq.shape[1] - 1))
        loss.backward()
        optimizers.step()
        lr_schedulers.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
    return losses


def _manager(model, optimizers, lr_schedulers, train_state, **config):
    from torchtitan.components.checkpoint import CheckpointManager

    return CheckpointManager.Config(enable=True, keep_latest_k=0, last_save_model_only=False, **config).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={"train_state": train_state}, sd_adapter=None, base_folder="")


def ep_save_job(rank: int, world_size: int, out: str):
    from fw_torchtitan import TrainState, _cpu_device_patch

    _cpu_device_patch()
    import torch
    from torch.distributed.tensor import DTensor

    model, optimizers, lr_schedulers = _build(world_size, ep=2)
    model.train()
    _train(model, optimizers, lr_schedulers, rank, world_size, range(STEPS))
    sd = model.state_dict()
    torch.save(sd, f"{out}/sharded/model_world_size_{world_size}_rank_{rank}.pt")
    train_state = TrainState()
    train_state.step = STEPS
    ck = _manager(model, optimizers, lr_schedulers, train_state, interval=STEPS, folder=os.path.abspath(f"{out}/tt"))
    ck.save(STEPS, last_step=False)
    ck.close()
    full, full_optim = _full(sd), _full_optim(optimizers)
    more = _train(model, optimizers, lr_schedulers, rank, world_size, range(STEPS, STEPS + MORE))
    if rank == 0:
        placements = {k: ([repr(p) for p in v.placements], v.device_mesh.mesh_dim_names)
                      for k, v in sd.items() if isinstance(v, DTensor)}
        torch.save({"model": full, "optim": full_optim, "placements": placements, "more": more}, f"{out}/full.pt")


def ep_load_job(rank: int, world_size: int, src: str, *, ep: int):
    """A torchtitan job at ``world_size`` ranks and ``ep`` resuming from the DCP ``src``; rank 0
    returns the restored full model and optimizer state and the losses of the next steps."""
    from fw_torchtitan import TrainState, _cpu_device_patch, initial_load

    _cpu_device_patch()
    model, optimizers, lr_schedulers = _build(world_size, ep=ep)
    train_state = TrainState()
    initial_load(src, model, optimizers, lr_schedulers, train_state)
    assert train_state.step == STEPS
    full, full_optim = _full(model.state_dict()), _full_optim(optimizers)
    model.train()
    more = _train(model, optimizers, lr_schedulers, rank, world_size, range(STEPS, STEPS + MORE))
    return (full, full_optim, more) if rank == 0 else None


@pytest.fixture(scope="module")
def ep_save(tmp_path_factory):
    import torch

    out = tmp_path_factory.mktemp("ep")
    (out / "sharded").mkdir()
    run_ranks(ep_save_job, 4, out, str(out), timeout=600)
    full = torch.load(out / "full.pt", weights_only=True)
    return {"sharded": out / "sharded", "dcp": out / "tt" / f"step-{STEPS}", **full}


def test_the_job_holds_experts_on_the_ep_mesh(ep_save):
    """What the job is: experts on (efsdp, ep) with a _StridedShard, the rest FSDP on 4 ranks."""
    experts = {k: v for k, v in ep_save["placements"].items() if "routed_experts" in k}
    assert len(experts) == 2 * 3
    for name, (placements, mesh) in experts.items():
        assert tuple(mesh) == ("efsdp", "ep") and placements == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"], (name, placements)
    assert ep_save["placements"]["layers.0.moe.router.gate.weight"] == (["Shard(dim=0)"], ("fsdp",))
    info = json.loads(CliRunner().invoke(cli, ["inspect", str(ep_save["dcp"]), "--json"]).output)
    assert info["moe"]["num_experts"] == EXPERTS, info["moe"]


@pytest.mark.parametrize("to,ep", [(3, 1), (2, 2)], ids=["fsdp3", "ep2"])
def test_ep_dcp_reshards_and_resumes(ep_save, tmp_path, to, ep):
    dst = tmp_path / "folder" / f"step-{STEPS}"
    r = _cli("reshard", ep_save["dcp"], dst, "--to", to)
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in dst.glob("*.distcp")) == [f"__{i}_0.distcp" for i in range(to)]
    model, optim, more = run_ranks(functools.partial(ep_load_job, ep=ep), to, tmp_path, str(dst), timeout=600)[0]
    _assert_equal_sd(model, ep_save["model"], f"torchtitan {to} ranks, ep {ep} (model)")
    _assert_equal_sd(optim, ep_save["optim"], f"torchtitan {to} ranks, ep {ep} (optimizer)")
    assert close(more, ep_save["more"], rel=1e-4), (more, ep_save["more"])


@pytest.mark.parametrize("cmd", [["reshard", "--to", "2"], ["export"]], ids=lambda c: c[0])
def test_ep_rank_files_are_refused(ep_save, tmp_path, cmd):
    """Per-rank files of the EP job: a _StridedShard rank's rows are not one range; exit 3, nothing written."""
    dst = tmp_path / "out"
    r = _cli(cmd[0], ep_save["sharded"], dst, *cmd[1:])
    assert r.exit_code == 3, r.output
    assert "hostile" not in r.output and ("_StridedShard" in r.output or "DCP" in r.output), r.output
    assert not dst.exists()


def test_ep_dcp_exports_what_torchtitan_to_hf_gives(ep_save, tmp_path):
    import torch
    from safetensors.torch import load_file
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
    from transformers import Qwen3MoeConfig

    base = tmp_path / "cfg"
    Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=DIM, moe_intermediate_size=32, intermediate_size=32,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   num_experts=EXPERTS, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                   mlp_only_layers=[], max_position_embeddings=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                   tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"]).save_pretrained(base)
    r = _cli("export", ep_save["dcp"], tmp_path / "hf", "--base", base)
    assert r.exit_code == 0, r.output
    want = Qwen3StateDictAdapter(_config(), None).to_hf(dict(ep_save["model"]))
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
