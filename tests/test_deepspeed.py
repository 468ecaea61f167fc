"""DeepSpeed ZeRO saves (stages 1, 2 and 3) read, exported and converted, against DeepSpeed itself.

Real DeepSpeed 0.19.8 jobs on CPU ranks (``fw_deepspeed.job``: the tiny Llama at hidden 50,
``torch.optim.AdamW`` as the client optimizer) save after step 2 with the engine's own
``save_checkpoint`` and run on to step 4; once per session:

- ZeRO 1, bf16, 2 ranks (``bf16_zero_pp_rank_*`` files; ``module`` holds bf16 weights);
- ZeRO 2, 3 ranks and ZeRO 3, 3 ranks (fp32), where parameters straddle ranks and stage 3
  pads each parameter at its tail.

Checked: ``inspect`` (format, stage, world size, step); ``export`` bit-equal to DeepSpeed's
own ``zero_to_fp32`` (and its bf16 cast for the bf16 run); ``convert --to dcp`` holding the
engine's own fp32 master and Adam moments (gathered in the job with DeepSpeed's
``safe_get_full_*``), read back by torch's DCP loader; FSDP2 jobs at 2 and 3 ranks resumed from it
continuing with the DeepSpeed run's losses, and so does one loading ``convert --to sharded``
rank files at 2 ranks; ``convert --to torch`` holds the whole training state; forged files
refused with exit 3.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from dist import run_ranks
from fw_common import close

import fw_deepspeed
from ckpt_tools.cli.main import main as cli

pytest.importorskip("deepspeed", reason="the DeepSpeed tests need deepspeed==0.19.8 (README, Install)")
pytestmark = pytest.mark.filterwarnings("ignore")

SAVE_AT, STEPS = 2, 4
CASES = {"z1_bf16_2": (1, True, 2), "z2_3": (2, False, 3), "z3_3": (3, False, 3)}


class Save:
    def __init__(self, root: Path, stage: int, bf16: bool, world_size: int) -> None:
        self.path, self.stage, self.bf16, self.world_size = root / "run", stage, bf16, world_size
        self.root = root
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the spawned ranks inherit it
        result = run_ranks(functools.partial(fw_deepspeed.job, stage=stage, bf16=bf16, save_at=SAVE_AT, steps=STEPS),
                           world_size, root, str(self.path))[0]
        self.losses, self.held = result["losses"], result["held"]


@pytest.fixture(scope="session")
def saves(tmp_path_factory):
    return {case: Save(tmp_path_factory.mktemp(case), *args) for case, args in CASES.items()}


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    """A config beside nothing else: what ``export --base`` takes the HF assets from."""
    path = tmp_path_factory.mktemp("base")
    fw_deepspeed.model(0).config.save_pretrained(path)
    return path


def _ckpt(*args: str) -> str:
    result = CliRunner().invoke(cli, [*args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _refused(*args: str) -> str:
    result = CliRunner().invoke(cli, [*args])
    assert result.exit_code == 3, result.output
    assert "Traceback" not in result.output
    return result.output


def _zero_to_fp32(path: Path) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(path))


@pytest.mark.parametrize("case", CASES)
def test_inspect(saves, case):
    save = saves[case]
    info = json.loads(_ckpt("inspect", str(save.path), "--json"))
    assert (info["format"], info["world_size"], info["zero_stage"], info["global_step"]) == (
        "deepspeed", save.world_size, save.stage, SAVE_AT)
    assert info["mixed_precision"] == ("bf16" if save.bf16 else None)
    assert info["groups"]["model"]["num_tensors"] == len(save.held)
    assert info["groups"]["optimizer"]["num_tensors"] == 3 * len(save.held)  # exp_avg, exp_avg_sq, step
    assert info["optimizer"]["step"] == SAVE_AT
    # the step directory itself is the same checkpoint
    inner = json.loads(_ckpt("inspect", str(save.path / f"global_step{SAVE_AT}"), "--json"))
    assert inner["num_tensors"] == info["num_tensors"]


@pytest.mark.parametrize("case", CASES)
def test_export_bit_equal_to_zero_to_fp32(saves, base, case, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    save = saves[case]
    ref = _zero_to_fp32(save.path)
    args = ["--dtype", "bf16"] if save.bf16 else []
    _ckpt("export", str(save.path), str(tmp_path / "hf"), "--base", str(base), "--quiet", *args)
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert got.keys() == ref.keys()
    for name, tensor in ref.items():
        want = tensor.to(torch.bfloat16) if save.bf16 else tensor
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert all(torch.equal(v, got[k]) for k, v in model.state_dict().items() if k in got)


@pytest.fixture(scope="session")
def dcp_of(saves, tmp_path_factory):
    out = {}
    for case, save in saves.items():
        dst = tmp_path_factory.mktemp(f"dcp_{case}") / "dcp"
        _ckpt("convert", str(save.path), str(dst), "--to", "dcp", "--quiet")
        out[case] = dst
    return out


@pytest.mark.parametrize("case", CASES)
def test_convert_dcp_holds_the_engines_master_and_moments(saves, dcp_of, case, tmp_path):
    """Read back by torch's own DCP loader, every tensor is what DeepSpeed's engine held."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(dcp_of[case]), str(tmp_path / "all.pt"))
    got = torch.load(tmp_path / "all.pt", weights_only=True)
    held = saves[case].held
    assert got["model"].keys() == held.keys() == got["optimizer"]["state"].keys()
    for fqn, want in held.items():
        assert torch.equal(got["model"][fqn], want["fp32"]), fqn
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["optimizer"]["state"][fqn][key], want[key]), (fqn, key)
        assert float(got["optimizer"]["state"][fqn]["step"]) == SAVE_AT
    (group,) = got["optimizer"]["param_groups"]
    assert group["params"] == list(held) and group["lr"] == fw_deepspeed.LR


@pytest.mark.parametrize("case, world_size", [("z2_3", 2), ("z3_3", 2), ("z3_3", 3)])
def test_convert_dcp_resumes_fsdp2(saves, dcp_of, case, world_size, tmp_path):
    """AdamW is the same algorithm in both (DeepSpeed's gradient clipping off): the FSDP2 job
    continues with the uninterrupted DeepSpeed run's losses."""
    save = saves[case]
    losses = run_ranks(functools.partial(fw_deepspeed.resume_fsdp2, first=SAVE_AT, steps=STEPS - SAVE_AT),
                       world_size, tmp_path, str(dcp_of[case]))[0]
    assert close(losses, save.losses[SAVE_AT:]), (losses, save.losses[SAVE_AT:])


def test_convert_sharded_resumes_fsdp2_at_2(saves, tmp_path):
    """Rank files at 2 ranks from a 3-rank ZeRO-2 save: each FSDP2 rank loads its own files
    (``load_state_dict``) and continues with the DeepSpeed run's losses."""
    save = saves["z2_3"]
    _ckpt("convert", str(save.path), str(tmp_path / "sharded"), "--to", "sharded", "--world-size", "2", "--quiet")
    losses = run_ranks(functools.partial(fw_deepspeed.resume_fsdp2, first=SAVE_AT, steps=STEPS - SAVE_AT,
                                         sharded=True), 2, tmp_path, str(tmp_path / "sharded"))[0]
    assert close(losses, save.losses[SAVE_AT:]), (losses, save.losses[SAVE_AT:])


def test_convert_torch_is_the_whole_training_state(saves, tmp_path):
    import torch

    save = saves["z3_3"]
    _ckpt("convert", str(save.path), str(tmp_path / "all.pt"), "--to", "torch", "--quiet")
    got = torch.load(tmp_path / "all.pt", weights_only=True)
    for fqn, want in save.held.items():
        assert torch.equal(got["model"][fqn], want["fp32"]), fqn
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["optimizer"]["state"][fqn][key], want[key]), (fqn, key)


def test_without_optimizer_files(saves, tmp_path):
    """Stages 1/2 without the optimizer files: the model is the module DeepSpeed saved (bf16 in a
    bf16 run); stage 3 keeps no weights outside them: exit 3 saying so."""
    import torch
    from safetensors.torch import load_file

    src, step = _copy(saves["z1_bf16_2"], tmp_path)
    for f in step.glob("*optim_states.pt"):
        f.unlink()
    info = json.loads(_ckpt("inspect", str(src), "--json"))
    assert info["zero_stage"] is None and info["dtypes"] == {"bfloat16": len(saves["z1_bf16_2"].held)}
    _ckpt("convert", str(src), str(tmp_path / "hf"), "--to", "hf", "--quiet")
    module = torch.load(step / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert got.keys() == module.keys() and all(torch.equal(got[k], v) for k, v in module.items())
    src3, step3 = _copy(saves["z3_3"], tmp_path / "z3")
    for f in step3.glob("*optim_states.pt"):
        f.unlink()
    assert "keeps its weights only in the optimizer files" in _refused("inspect", str(src3))


def test_verify_against_its_conversion_and_reshard_refused(saves, tmp_path):
    """``verify`` reads the ZeRO save as any other source; ``reshard`` (which keeps the source's
    format) is refused: writing ``deepspeed`` is not done yet, and the message says what to do."""
    save = saves["z2_3"]
    _ckpt("convert", str(save.path), str(tmp_path / "all.pt"), "--to", "torch", "--quiet")
    assert json.loads(_ckpt("verify", str(save.path), str(tmp_path / "all.pt"), "--json"))["ok"]
    out = _refused("reshard", str(save.path), str(tmp_path / "r"), "--to", "2")
    assert "reads but does not write" in out and "--to sharded" in out, out


@pytest.fixture(scope="session")
def tied(tmp_path_factory):
    """ZeRO 3 at 3 ranks with tied embeddings: DeepSpeed saves ``lm_head.weight`` as a shared
    parameter (``shared_params``), its state once."""
    root = tmp_path_factory.mktemp("tied")
    save = Save.__new__(Save)
    save.path, save.stage, save.bf16, save.world_size = root / "run", 3, False, 3
    result = run_ranks(functools.partial(fw_deepspeed.job, stage=3, save_at=SAVE_AT, steps=STEPS, tied=True),
                       3, root, str(save.path))[0]
    save.losses, save.held = result["losses"], result["held"]
    return save


def test_tied_export_and_fsdp2_resume(tied, tmp_path):
    import torch
    from safetensors.torch import load_file

    base = tmp_path / "base"
    fw_deepspeed.model(0, tied=True).config.save_pretrained(base)
    _ckpt("export", str(tied.path), str(tmp_path / "hf"), "--base", str(base), "--quiet")
    got, ref = load_file(tmp_path / "hf" / "model.safetensors"), _zero_to_fp32(tied.path)
    assert "lm_head.weight" in ref and got.keys() == ref.keys() - {"lm_head.weight"}  # written once, as HF ties it
    assert all(torch.equal(got[k], ref[k]) for k in got)
    _ckpt("convert", str(tied.path), str(tmp_path / "dcp"), "--to", "dcp", "--quiet")
    losses = run_ranks(functools.partial(fw_deepspeed.resume_fsdp2, first=SAVE_AT, steps=STEPS - SAVE_AT, tied=True),
                       2, tmp_path, str(tmp_path / "dcp"))[0]
    assert close(losses, tied.losses[SAVE_AT:]), (losses, tied.losses[SAVE_AT:])


def _rewrite(path: Path, change) -> None:
    """Load one of the fixture's own files (DeepSpeed's classes: the test trusts its own save),
    change it, save it back."""
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401  (its classes, for the unpickler)

    obj = torch.load(path, weights_only=False)
    change(obj)
    torch.save(obj, path)


def _copy(save: Save, tmp_path: Path) -> tuple[Path, Path]:
    src = tmp_path / "src"
    shutil.copytree(save.path, src)
    return src, src / f"global_step{SAVE_AT}"


@pytest.mark.parametrize("case", ["z2_3", "z3_3"])
def test_forged_param_shapes_exit_3(saves, case, tmp_path):
    import torch

    src, step = _copy(saves[case], tmp_path)
    name = "mp_rank_00_model_states.pt" if saves[case].stage < 3 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    _rewrite(step / name, lambda m: m["param_shapes"][0].update({"model.norm.weight": torch.Size([60])}))
    out = _refused("convert", str(src), str(tmp_path / "out"), "--to", "dcp")
    assert "param_shapes" in out and "group 0" in out, out
    assert not (tmp_path / "out").exists()


def test_partitions_that_do_not_add_up_exit_3(saves, tmp_path):
    src, step = _copy(saves["z2_3"], tmp_path)

    def cut(o):
        groups = o["optimizer_state_dict"]["single_partition_of_fp32_groups"]
        groups[0] = groups[0][:-7].clone()

    _rewrite(step / "zero_pp_rank_1_mp_rank_00_optim_states.pt", cut)
    out = _refused("export", str(src), str(tmp_path / "out"))
    assert "do not add up" in out, out


def _forge_stage(o):
    o["optimizer_state_dict"]["zero_stage"] = 7


FORGED = {
    "group padding mid-way": (lambda o: o["optimizer_state_dict"].update(group_paddings=[5]), "padded on rank 0"),
    "alignment paddings": (lambda o: o["optimizer_state_dict"].update(
        param_alignment_paddings=[[1] * len(o["optimizer_state_dict"]["param_alignment_paddings"][0])]),
        "do not add up"),
    "paddings not a list": (lambda o: o["optimizer_state_dict"].update(group_paddings="x"), "paddings do not match"),
    "unknown stage": (_forge_stage, "ZeRO stage 7"),
}


@pytest.mark.parametrize("forged", FORGED)
def test_forged_partition_facts_exit_3(saves, forged, tmp_path):
    change, says = FORGED[forged]
    src, step = _copy(saves["z2_3"], tmp_path)
    _rewrite(step / "zero_pp_rank_0_mp_rank_00_optim_states.pt", change)
    out = _refused("convert", str(src), str(tmp_path / "out"), "--to", "dcp")
    assert says in out, out


def test_missing_rank_exit_3(saves, tmp_path):
    src, step = _copy(saves["z3_3"], tmp_path)
    (step / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    out = _refused("inspect", str(src))
    assert "ranks [0, 2]" in out, out


def test_pickle_naming_another_class_exit_3(saves, tmp_path):
    import argparse

    src, step = _copy(saves["z2_3"], tmp_path)
    _rewrite(step / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
             lambda o: o["optimizer_state_dict"].update(extra=argparse.Namespace(x=1)))
    out = _refused("inspect", str(src))
    assert "argparse.Namespace" in out, out
