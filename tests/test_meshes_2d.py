"""2-D meshes (issue 10, deliverable 4): HSDP and FSDP+TP saves of real jobs, read, exported and
resharded by ckpt, checked bit for bit against the job's own full state dict.

* HSDP: plain FSDP2 ``fully_shard(..., mesh=2x2 ("replicate", "shard"))`` on the tiny transformers
  Llama, 2 AdamW steps, saved as verl's per-rank files (``model.state_dict()`` /
  ``optimizer.state_dict()`` per rank: DTensors ``(Replicate(), Shard(0))``) and as a DCP
  (``dcp.save`` of ``get_state_dict``). Rank 0 records the full model and optimizer state dicts
  (``StateDictOptions(full_state_dict=True)``).
* FSDP+TP: torchtitan 0.3 llama3, ``parallelize_llama`` at dp_shard=2 x tp=2 with torchtitan's own TP
  plan (colwise wq/wk/wv/w1/w3, rowwise wo/w2, lm_head colwise, tok_embeddings rowwise), which
  leaves ``_StridedShard(0, sf=2)`` on the dp dim of every colwise weight and ``Shard(1)`` on tp
  of the rowwise ones; saved by torchtitan's ``CheckpointManager`` (``step-2/`` DCP) and as
  per-rank ``torch.save(model.state_dict())`` files. The full state dict is each state-dict
  DTensor's ``full_tensor()`` (torch's ``get_model_state_dict(full_state_dict=True)`` fails on
  torchtitan's fused-QKV state-dict hooks: "'FusedQKVLinear' object has no attribute 'wq'").

Expected behaviour: every read/export/convert/reshard is bit-exact (``torch.equal``) against the
full state dict, or refused with exit 3 and nothing written.
"""

from __future__ import annotations

import functools
import os

import pytest
from click.testing import CliRunner
from dist import run_ranks

from ckpt_tools.cli.main import main as cli

pytestmark = pytest.mark.filterwarnings("ignore")

STEPS = 2


def _run(*args: str):
    return CliRunner().invoke(cli, [*args, "--quiet"])


def _ok(*args: str) -> str:
    result = _run(*args)
    assert result.exit_code == 0, result.output
    return result.output


def _assert_equal_sd(got: dict, want: dict, what: str) -> None:
    import torch

    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))[:10]}"
    bad = [k for k in want if not (isinstance(got[k], torch.Tensor) and got[k].dtype == want[k].dtype
                                   and got[k].shape == want[k].shape and torch.equal(got[k], want[k]))]
    assert not bad, f"{what}: not bit-equal: {bad}"


def _assert_equal_optim(got: dict, want: dict, what: str) -> None:
    """FQN-keyed optimizer state dicts (``{"state": {fqn: {name: tensor}}, ...}``), tensors only."""
    import torch

    assert set(got["state"]) == set(want["state"]), f"{what}: parameters differ"
    bad = []
    for fqn, st in want["state"].items():
        assert set(got["state"][fqn]) == set(st), f"{what}: {fqn} state keys differ"
        for name, v in st.items():
            g = torch.as_tensor(got["state"][fqn][name])
            if not (g.dtype == torch.as_tensor(v).dtype and torch.equal(g, torch.as_tensor(v))):
                bad.append(f"{fqn}.{name}")
    assert not bad, f"{what}: not bit-equal: {bad}"


# -- HSDP: plain FSDP2 on a (replicate=2, shard=2) mesh -----------------------------------------

def hsdp_save_job(rank: int, world_size: int, out: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, get_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fw_common import batch_for, tiny_model

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = tiny_model()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x = batch_for(step, rank, world_size)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    torch.save(model.state_dict(), f"{out}/sharded/model_world_size_{world_size}_rank_{rank}.pt")
    torch.save(opt.state_dict(), f"{out}/sharded/optim_world_size_{world_size}_rank_{rank}.pt")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=f"{out}/dcp")
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    fm = get_model_state_dict(model, options=full)
    fo = get_optimizer_state_dict(model, opt, options=full)
    if rank == 0:
        torch.save(fm, f"{out}/full_model.pt")
        torch.save(fo, f"{out}/full_optim.pt")
        model.config.save_pretrained(f"{out}/sharded/huggingface")
        model.config.save_pretrained(f"{out}/hf_config")


def fsdp2_load_job(rank: int, world_size: int, src: str):
    """A plain FSDP2 job at ``world_size`` (1-D mesh) resuming from the DCP ``src`` with
    ``dcp.load`` + ``set_state_dict``; returns rank 0's full model and optimizer state dicts."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, get_state_dict,
                                                         set_state_dict)
    from torch.distributed.fsdp import fully_shard

    from fw_common import tiny_model

    model = tiny_model(seed=123)  # other weights: everything must come from the checkpoint
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optimizer": osd}
    dcp.load(sd, checkpoint_id=src)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    fm = get_model_state_dict(model, options=full)
    fo = get_optimizer_state_dict(model, opt, options=full)
    return (fm, fo) if rank == 0 else None


@pytest.fixture(scope="module")
def hsdp_save(tmp_path_factory):
    import torch

    out = tmp_path_factory.mktemp("hsdp")
    (out / "sharded").mkdir()
    run_ranks(hsdp_save_job, 4, out, str(out))
    return {"dir": out, "sharded": out / "sharded", "dcp": out / "dcp",
            "model": torch.load(out / "full_model.pt", weights_only=True),
            "optim": torch.load(out / "full_optim.pt", weights_only=True)}


@pytest.mark.parametrize("src", ["sharded", "dcp"])
def test_hsdp_inspect(hsdp_save, src):
    import json

    info = json.loads(_ok("inspect", str(hsdp_save[src]), "--json"))
    assert (info["format"], info["world_size"]) == (src, 4)
    assert info["groups"]["model"]["num_tensors"] == len(hsdp_save["model"])


@pytest.mark.parametrize("src", ["sharded", "dcp"])
def test_hsdp_export_bit_exact(hsdp_save, tmp_path, src):
    from safetensors.torch import load_file

    dst = tmp_path / "hf"
    _ok("export", str(hsdp_save[src]), str(dst), "--base", str(hsdp_save["dir"] / "hf_config"))
    _assert_equal_sd(load_file(dst / "model.safetensors"), hsdp_save["model"], f"export of {src}")


@pytest.mark.parametrize("src", ["sharded", "dcp"])
def test_hsdp_convert_torch_bit_exact(hsdp_save, tmp_path, src):
    import torch

    dst = tmp_path / "full.pt"
    _ok("convert", str(hsdp_save[src]), str(dst), "--to", "torch")
    got = torch.load(dst, weights_only=True)
    _assert_equal_sd(got["model"], hsdp_save["model"], f"convert --to torch of {src} (model)")
    _assert_equal_optim(got["optimizer"], hsdp_save["optim"], f"convert --to torch of {src} (optimizer)")


def test_hsdp_sharded_reshard_refused(hsdp_save, tmp_path):
    """Per-rank files of an HSDP job: ckpt writes 1-D FSDP2 rank files, which an HSDP job does not
    take; refusing (exit 3, nothing written) is what ckpt does and is correct."""
    dst = tmp_path / "ws2"
    result = _run("reshard", str(hsdp_save["sharded"]), str(dst), "--to", "2")
    assert result.exit_code == 3, result.output
    assert "2-D device mesh" in result.output
    assert not dst.exists()


@pytest.mark.parametrize("to", [2, 3])
def test_hsdp_dcp_reshard_loads_bit_exact(hsdp_save, tmp_path, to):
    dst = tmp_path / f"ws{to}"
    _ok("reshard", str(hsdp_save["dcp"]), str(dst), "--to", str(to))
    assert sorted(p.name for p in dst.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(to)]
    fm, fo = run_ranks(fsdp2_load_job, to, tmp_path, str(dst))[0]
    _assert_equal_sd(fm, hsdp_save["model"], f"{to}-rank FSDP2 load of the resharded HSDP DCP (model)")
    _assert_equal_optim(fo, hsdp_save["optim"], f"{to}-rank FSDP2 load of the resharded HSDP DCP (optimizer)")


def test_hsdp_sharded_convert_dcp_loads_bit_exact(hsdp_save, tmp_path):
    """What the refusal above tells the user to do: convert the per-rank files to DCP."""
    dst = tmp_path / "dcp2"
    _ok("convert", str(hsdp_save["sharded"]), str(dst), "--to", "dcp", "--world-size", "2")
    fm, fo = run_ranks(fsdp2_load_job, 2, tmp_path, str(dst))[0]
    _assert_equal_sd(fm, hsdp_save["model"], "2-rank FSDP2 load of the converted HSDP files (model)")
    _assert_equal_optim(fo, hsdp_save["optim"], "2-rank FSDP2 load of the converted HSDP files (optimizer)")


# -- FSDP + TP: torchtitan llama3, dp_shard=2 x tp=2 -------------------------------------------

def _tt_build(world_size: int, dp_shard: int, tp: int):
    """torchtitan's llama3 (tiny), parallelized by its own ``parallelize_llama`` with its TP plan."""
    from fw_torchtitan import TOTAL_STEPS, _cpu_device_patch, build_model, model_config

    _cpu_device_patch()
    import torch
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    from fw_common import SEQ

    torch.manual_seed(0)
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", data_parallel_shard_degree=dp_shard,
                                    tensor_parallel_degree=tp)
    training = TrainingConfig(mixed_precision_param="float32", steps=TOTAL_STEPS, seq_len=SEQ - 1,
                              local_batch_size=12 // dp_shard)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    pd = ParallelDims.from_config(parallelism, world_size)
    pd.build_mesh()
    cfg = model_config()
    # what Llama3Model.Config.update_from_config does in the Trainer: the TP plan on every sub-config
    set_llama3_sharding_config(cfg, enable_sp=False)
    return build_model(cfg, pd, training, parallelism), pd, cfg


def _tt_parts(model):
    from fw_torchtitan import optimizer_parts

    return optimizer_parts(model)


def _full(sd: dict) -> dict:
    """A state dict's tensors gathered whole (DTensor.full_tensor(): all placements, _StridedShard included)."""
    import torch
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
            for k, v in sd.items() if isinstance(v, torch.Tensor)}


def _full_optim(optimizers) -> dict:
    """torchtitan's flattened optimizer state (``state.<fqn>.<name>``), tensors gathered whole."""
    return _full({k: v for k, v in optimizers.state_dict().items() if k.startswith("state.")})


def tt_tp_save_job(rank: int, world_size: int, out: str) -> None:
    from fw_torchtitan import TrainState, _cpu_device_patch

    _cpu_device_patch()  # before any torchtitan import
    import torch
    from torch.distributed.tensor import DTensor
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    from fw_common import global_batch

    model, pd, cfg = _tt_build(world_size, dp_shard=2, tp=2)
    model.train()
    optimizers, lr_schedulers = _tt_parts(model)
    dp_rank = pd.get_mesh("batch").get_local_rank()
    for step in range(STEPS):
        optimizers.zero_grad()
        seq = global_batch(step)[dp_rank * 6:(dp_rank + 1) * 6]
        pred = model(seq[:, :-1])
        if isinstance(pred, DTensor):
            pred = pred.full_tensor()
        torch.nn.functional.cross_entropy(pred.flatten(0, 1), seq[:, 1:].flatten()).backward()
        optimizers.step()
        lr_schedulers.step()
    sd = model.state_dict()
    torch.save(sd, f"{out}/sharded/model_world_size_{world_size}_rank_{rank}.pt")
    train_state = TrainState()
    train_state.step = STEPS
    ck = CheckpointManager.Config(enable=True, keep_latest_k=0, interval=STEPS, last_save_model_only=False,
                                  folder=os.path.abspath(f"{out}/tt")).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={"train_state": train_state}, sd_adapter=None, base_folder="")
    ck.save(STEPS, last_step=False)
    ck.close()
    full, full_optim = _full(sd), _full_optim(optimizers)
    if rank == 0:
        placements = {k: [str(p) for p in v.placements] for k, v in sd.items() if isinstance(v, DTensor)}
        torch.save({"model": full, "optim": full_optim, "placements": placements,
                    "hf": Llama3StateDictAdapter(cfg, None).to_hf(dict(full))}, f"{out}/full.pt")
        from transformers import LlamaConfig

        # the same model as Hugging Face describes it (for export's --base)
        LlamaConfig(hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=101, tie_word_embeddings=False,
                    rope_theta=500000.0).save_pretrained(f"{out}/hf_config")


def tt_load_job(rank: int, world_size: int, src: str, *, dp_shard: int, tp: int):
    """A torchtitan job at dp_shard x tp resuming from the DCP ``src`` with its ``CheckpointManager``
    (``initial_load_path``, model + optimizer + lr_scheduler + train_state); returns rank 0's full
    model state and flattened optimizer state."""
    from fw_torchtitan import TrainState, _cpu_device_patch, initial_load

    _cpu_device_patch()  # before any torchtitan import
    model, _, _ = _tt_build(world_size, dp_shard=dp_shard, tp=tp)
    optimizers, lr_schedulers = _tt_parts(model)
    train_state = TrainState()
    initial_load(src, model, optimizers, lr_schedulers, train_state)
    assert train_state.step == STEPS
    full, full_optim = _full(model.state_dict()), _full_optim(optimizers)
    return (full, full_optim) if rank == 0 else None


@pytest.fixture(scope="module")
def tp_save(tmp_path_factory):
    import torch

    out = tmp_path_factory.mktemp("fsdp_tp")
    (out / "sharded").mkdir()
    run_ranks(tt_tp_save_job, 4, out, str(out))
    full = torch.load(out / "full.pt", weights_only=True)
    return {"dir": out, "sharded": out / "sharded", "dcp": out / "tt" / f"step-{STEPS}", **full}


def test_tp_job_has_strided_shards(tp_save):
    """The job is what it claims: _StridedShard on the dp dim of colwise weights, Shard(1) on tp."""
    p = tp_save["placements"]
    assert p["layers.0.feed_forward.w1.weight"] == ["_S(0, 2)", "S(0)"]
    assert p["lm_head.weight"] == ["_S(0, 2)", "S(0)"]
    assert p["layers.0.attention.wo.weight"] == ["S(0)", "S(1)"]


def test_tp_dcp_inspect(tp_save):
    import json

    info = json.loads(_ok("inspect", str(tp_save["dcp"]), "--json"))
    assert (info["format"], info["layout"], info["world_size"]) == ("dcp", "torchtitan", 4)
    assert info["groups"]["model"]["num_tensors"] == len(tp_save["model"])


def test_tp_dcp_convert_torch_bit_exact(tp_save, tmp_path):
    import torch

    dst = tmp_path / "full.pt"
    _ok("convert", str(tp_save["dcp"]), str(dst), "--to", "torch")
    got = torch.load(dst, weights_only=True)
    _assert_equal_sd(got["model"], tp_save["model"], "convert --to torch of the FSDP+TP DCP (model)")
    flat = {f"state.{fqn}.{name}": v for fqn, st in got["optimizer"]["state"].items() for name, v in st.items()}
    _assert_equal_sd(flat, tp_save["optim"], "convert --to torch of the FSDP+TP DCP (optimizer)")


def test_tp_dcp_export_bit_exact(tp_save, tmp_path):
    """Every exported tensor is bit-equal to the job's full state dict, under whichever names export
    writes: the DCP's own (torchtitan's) or Hugging Face's (then against torchtitan's own
    ``Llama3StateDictAdapter.to_hf`` of the full state dict, rotary row order included)."""
    from safetensors.torch import load_file

    dst = tmp_path / "hf"
    _ok("export", str(tp_save["dcp"]), str(dst), "--base", str(tp_save["dir"] / "hf_config"))
    got = load_file(dst / "model.safetensors")
    want = tp_save["model"] if "tok_embeddings.weight" in got else tp_save["hf"]
    _assert_equal_sd(got, want, "export of the FSDP+TP DCP")


def test_tp_dcp_export_hf_names(tp_save, tmp_path):
    """CONTRACT ("Names and LoRA in export"): torchtitan's names are mapped to Hugging Face's,
    bit-equal to torchtitan's own conversion. Not a 2-D mesh matter; fails today on any
    torchtitan DCP (export writes ``tok_embeddings.weight`` ... as they are, exit 0, even with a
    LlamaConfig ``--base`` whose names it should check)."""
    from safetensors.torch import load_file

    dst = tmp_path / "hf"
    _ok("export", str(tp_save["dcp"]), str(dst), "--base", str(tp_save["dir"] / "hf_config"))
    _assert_equal_sd(load_file(dst / "model.safetensors"), tp_save["hf"], "export of the FSDP+TP DCP (HF names)")


@pytest.mark.parametrize("dp_shard,tp", [(2, 1), (1, 2), (3, 1)], ids=["fsdp2", "tp2", "fsdp3"])
def test_tp_dcp_reshard_loads_bit_exact(tp_save, tmp_path, dp_shard, tp):
    to = dp_shard * tp
    dst = tmp_path / "folder" / f"step-{STEPS}"
    _ok("reshard", str(tp_save["dcp"]), str(dst), "--to", str(to))
    assert sorted(p.name for p in dst.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(to)]
    fm, fo = run_ranks(functools.partial(tt_load_job, dp_shard=dp_shard, tp=tp), to, tmp_path, str(dst))[0]
    _assert_equal_sd(fm, tp_save["model"], f"torchtitan dp_shard={dp_shard} tp={tp} load (model)")
    _assert_equal_sd(fo, tp_save["optim"], f"torchtitan dp_shard={dp_shard} tp={tp} load (optimizer)")


@pytest.mark.parametrize("cmd", [["export"], ["convert", "--to", "torch"], ["convert", "--to", "dcp"],
                                 ["reshard", "--to", "2"], ["inspect"]], ids=lambda c: "-".join(c))
def test_tp_sharded_refused(tp_save, tmp_path, cmd):
    """Per-rank files holding _StridedShard DTensors: refused (exit 3) by every command, nothing written."""
    dst = tmp_path / "out"
    args = [cmd[0], str(tp_save["sharded"])] + ([] if cmd[0] == "inspect" else [str(dst)]) + cmd[1:]
    result = _run(*args)
    assert result.exit_code == 3, result.output
    # refused by the placement check, or earlier by the pickle gate, which meets the mesh first:
    # either way for what it is (see the README's limits), never as a corrupt or hostile file
    assert result.output.count("error:") == 1 and str(tp_save["sharded"]) in result.output
    assert "hostile" not in result.output and ("_StridedShard" in result.output or "DCP" in result.output)
    assert not dst.exists()
