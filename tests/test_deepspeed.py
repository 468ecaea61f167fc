"""DeepSpeed ZeRO saves (stages 1, 2 and 3) read, exported and converted, against DeepSpeed itself.

Real DeepSpeed 0.19.8 jobs on CPU ranks (``fw_deepspeed.job``: the tiny Llama at hidden 50,
``torch.optim.AdamW`` as the client optimizer) save after step 2 with the engine's own
``save_checkpoint`` and run on to step 4; once per session:

- ZeRO 1, bf16, 2 ranks (``bf16_zero_pp_rank_*`` files; ``module`` holds bf16 weights);
- ZeRO 2, fp16, 2 ranks (files named as fp32's; ``module`` holds fp16 weights, the optimizer
  file DeepSpeed's ``DynamicLossScaler``);
- ZeRO 2, 3 ranks and ZeRO 3, 3 ranks (fp32), where parameters straddle ranks and stage 3
  pads each parameter at its tail.

Checked: ``inspect`` (format, stage, world size, step); ``export`` bit-equal to DeepSpeed's
own ``zero_to_fp32`` (and its bf16/fp16 cast for the mixed-precision runs); ``convert --to dcp`` holding the
engine's own fp32 master and Adam moments (gathered in the job with DeepSpeed's
``safe_get_full_*``), read back by torch's DCP loader; FSDP2 jobs at 2 and 3 ranks resumed from it
continuing with the DeepSpeed run's losses, and so does one loading ``convert --to sharded``
rank files at 2 ranks; ``convert --to torch`` holds the whole training state (DeepSpeed's
``lr_scheduler`` included); forged files refused with exit 3.

Written as DeepSpeed saves at another world size (``reshard --to M``, ``convert --to
deepspeed``): at the source's own size the files come back pickle for pickle and bit for bit;
at M (ZeRO 1 bf16 2 → 3, ZeRO 2 fp16 2 → 3, ZeRO 2 and 3 3 → 2) DeepSpeed's own ``engine.load_checkpoint`` in an
M-rank job holds the source's fp32 master and moments bit for bit, its step counters and
scheduler, and trains on with the DeepSpeed run's losses; what the writer cannot prove is exit 3
with nothing written.
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
CASES = {"z1_bf16_2": (1, "bf16", 2), "z2_fp16_2": (2, "fp16", 2), "z2_3": (2, None, 3), "z3_3": (3, None, 3)}


class Save:
    def __init__(self, root: Path, stage: int, precision: str | None, world_size: int) -> None:
        self.path, self.stage, self.precision, self.world_size = root / "run", stage, precision, world_size
        self.root = root
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the spawned ranks inherit it
        result = run_ranks(functools.partial(fw_deepspeed.job, stage=stage, save_at=SAVE_AT, steps=STEPS,
                                             **self.precision_args),
                           world_size, root, str(self.path))[0]
        self.losses, self.held, self.scheduler = result["losses"], result["held"], result["lr_scheduler"]

    @property
    def precision_args(self) -> dict:
        return {self.precision: True} if self.precision else {}  # bf16=True / fp16=True

    @property
    def dtype(self):
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision, torch.float32)


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
    assert info["mixed_precision"] == save.precision
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
    args = ["--dtype", save.precision] if save.precision else []
    _ckpt("export", str(save.path), str(tmp_path / "hf"), "--base", str(base), "--quiet", *args)
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert got.keys() == ref.keys()
    for name, tensor in ref.items():
        want = tensor.to(save.dtype)
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
    assert got["lr_scheduler"] == saves[case].scheduler  # DeepSpeed's lr_scheduler, as the job's extra state


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
    assert got["lr_scheduler"] == save.scheduler


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


def test_verify_against_its_conversion(saves, tmp_path):
    """``verify`` reads the ZeRO save as any other source."""
    save = saves["z2_3"]
    _ckpt("convert", str(save.path), str(tmp_path / "all.pt"), "--to", "torch", "--quiet")
    assert json.loads(_ckpt("verify", str(save.path), str(tmp_path / "all.pt"), "--json"))["ok"]


@pytest.fixture(scope="session")
def tied(tmp_path_factory):
    """ZeRO 3 at 3 ranks with tied embeddings: DeepSpeed saves ``lm_head.weight`` as a shared
    parameter (``shared_params``), its state once."""
    root = tmp_path_factory.mktemp("tied")
    save = Save.__new__(Save)
    save.path, save.stage, save.precision, save.world_size = root / "run", 3, None, 3
    result = run_ranks(functools.partial(fw_deepspeed.job, stage=3, save_at=SAVE_AT, steps=STEPS, tied=True),
                       3, root, str(save.path))[0]
    save.losses, save.held, save.scheduler = result["losses"], result["held"], result["lr_scheduler"]
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
    out = _refused("reshard", str(src), str(tmp_path / "ds"), "--to", "2")  # the writer reads the same way
    assert "param_shapes" in out and not (tmp_path / "ds").exists(), out


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


# -- written as DeepSpeed saves at another world size (reshard --to M, convert --to deepspeed) ----

def _load_all(step_dir: Path) -> dict:
    """Every file of a ZeRO step directory, loaded with DeepSpeed's classes (the test's own files)."""
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401  (its classes, for the unpickler)

    return {p.name: torch.load(p, weights_only=False) for p in sorted(step_dir.glob("*.pt"))}


def _bits(t):
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()]) if t.is_floating_point() else t


def _same(a, b, where: str = "") -> list[str]:
    """Where two loaded pickles differ (tensors bit for bit, dtype included)."""
    import torch

    if torch.is_tensor(a):
        # equal, or bit for bit (torch.equal says a NaN differs from itself, and a stage-3
        # source's padding holds what DeepSpeed's buffers held: NaN bits now and then)
        same = torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and (
            torch.equal(a, b) or torch.equal(_bits(a), _bits(b)))
        return [] if same else [where]
    if isinstance(a, dict):
        if not isinstance(b, dict) or list(a) != list(b):
            return [where]
        return [d for k in a for d in _same(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [where]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{where}[{i}]")]
    if hasattr(a, "__dict__") and not isinstance(a, type):  # DeepSpeed's objects (loss scaler): their fields
        return [where] if type(a) is not type(b) else _same(vars(a), vars(b), f"{where}.__dict__")
    return [] if repr(a) == repr(b) else [where]


@pytest.mark.parametrize("case", CASES)
def test_reshard_to_the_same_world_size_round_trips(saves, case, tmp_path):
    """At its own world size the written save is the source, pickle for pickle and bit for bit
    (stage 3's padding elements aside: DeepSpeed leaves them as its buffers held them, ckpt
    writes zeros)."""
    import torch

    save = saves[case]
    _ckpt("reshard", str(save.path), str(tmp_path / "out"), "--to", str(save.world_size), "--quiet")
    assert (tmp_path / "out" / "latest").read_text() == f"global_step{SAVE_AT}"
    src, got = _load_all(save.path / f"global_step{SAVE_AT}"), _load_all(tmp_path / "out" / f"global_step{SAVE_AT}")
    assert list(src) == list(got)
    for r in range(save.world_size if save.stage == 3 else 0):
        # the elements of rank r's flat partition that are padding: each parameter's tail
        name = f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        shapes = src[name.replace("optim", "model")]["param_shapes"][0].values()
        pad = torch.cat([torch.arange(-(-s.numel() // save.world_size)) + r * -(-s.numel() // save.world_size)
                         >= s.numel() for s in shapes])
        osd_src, osd_got = src[name]["optimizer_state_dict"], got[name]["optimizer_state_dict"]
        for holder_src, holder_got, key in [(osd_src["fp32_flat_groups"], osd_got["fp32_flat_groups"], 0),
                                            *[(osd_src["optimizer_state_dict"]["state"][0],
                                               osd_got["optimizer_state_dict"]["state"][0], k)
                                              for k in ("exp_avg", "exp_avg_sq")]]:
            a, b = holder_src[key], holder_got[key]
            assert torch.equal(b[~pad], a[~pad]) and not b[pad].any(), (name, key)
            holder_got[key] = a
    for name in src:
        assert not _same(src[name], got[name], name)


RESUMED = [("z1_bf16_2", 3), ("z2_fp16_2", 3), ("z2_3", 2), ("z3_3", 2)]


@pytest.fixture(scope="session")
def resumed(saves, tmp_path_factory):
    """Each case resharded to M, then loaded by a DeepSpeed job at M ranks that trains on."""
    out = {}
    for case, world in RESUMED:
        save, root = saves[case], tmp_path_factory.mktemp(f"ds_{case}_to_{world}")
        _ckpt("reshard", str(save.path), str(root / "ds"), "--to", str(world), "--quiet")
        out[case, world] = run_ranks(functools.partial(fw_deepspeed.resume, stage=save.stage, **save.precision_args,
                                                       first=SAVE_AT, steps=STEPS - SAVE_AT),
                                     world, root, str(root / "ds"))[0]
    return out


@pytest.mark.parametrize("case, world", RESUMED)
def test_reshard_loads_in_deepspeed_at_m_ranks(saves, resumed, case, world):
    """DeepSpeed's own ``engine.load_checkpoint`` at M ranks takes the written save: the fp32
    master and Adam moments it then holds are the source's bit for bit, its step counters are
    carried, and training continues with the uninterrupted run's losses."""
    import torch

    save, got = saves[case], resumed[case, world]
    assert got["held"].keys() == save.held.keys()
    for fqn, want in save.held.items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got["held"][fqn][key], want[key]), (fqn, key)
    assert (got["global_steps"], got["global_samples"]) == (STEPS, STEPS * 12)
    assert got["lr_scheduler"] == save.scheduler  # as load_checkpoint restored it
    want = save.losses[SAVE_AT:]
    # the first step is computed from the loaded weights alone; after it, a bf16/fp16 run's gradients
    # are reduced in 16 bits across M ranks instead of N, which rounds otherwise (fp32 runs: every step)
    upto = 1 if save.precision else len(want)
    assert close(got["losses"][:upto], want[:upto]), (got["losses"], want)
    assert close(got["losses"], want, rel=1e-3), (got["losses"], want)



def test_tied_reshard_loads_in_deepspeed_at_2(tied, tmp_path):
    """ZeRO 3 with tied embeddings (``shared_params``), 3 → 2 ranks: the same, through DeepSpeed."""
    import torch

    _ckpt("reshard", str(tied.path), str(tmp_path / "ds"), "--to", "2", "--quiet")
    got = run_ranks(functools.partial(fw_deepspeed.resume, stage=3, first=SAVE_AT, steps=STEPS - SAVE_AT, tied=True),
                    2, tmp_path, str(tmp_path / "ds"))[0]
    assert got["held"].keys() == tied.held.keys()
    assert all(torch.equal(got["held"][fqn][k], want[k]) for fqn, want in tied.held.items() for k in want)
    assert close(got["losses"], tied.losses[SAVE_AT:]), (got["losses"], tied.losses[SAVE_AT:])

def test_convert_to_deepspeed_is_the_reshard(saves, tmp_path):
    """``convert --to deepspeed --world-size M`` of a ZeRO save writes what ``reshard --to M`` does."""
    save = saves["z2_3"]
    _ckpt("reshard", str(save.path), str(tmp_path / "r"), "--to", "2", "--quiet")
    _ckpt("convert", str(save.path), str(tmp_path / "c"), "--to", "deepspeed", "--world-size", "2", "--quiet")
    step = f"global_step{SAVE_AT}"
    a, b = _load_all(tmp_path / "r" / step), _load_all(tmp_path / "c" / step)
    assert list(a) == list(b) and not [d for n in a for d in _same(a[n], b[n], n)]
    info = json.loads(_ckpt("inspect", str(tmp_path / "c"), "--json"))
    assert (info["format"], info["world_size"], info["zero_stage"]) == ("deepspeed", 2, 2)


def test_refused_writes_nothing(saves, tmp_path):
    """What cannot be written as a ZeRO save is exit 3, and DST is not created: another source
    (a DCP has no ZeRO stage or ds_config), a save whose layout is not DeepSpeed's (forged
    group paddings that still add up), and a save with files of other parallel ranks."""
    save = saves["z2_3"]
    _ckpt("convert", str(save.path), str(tmp_path / "dcp"), "--to", "dcp", "--quiet")
    out = _refused("convert", str(tmp_path / "dcp"), str(tmp_path / "o1"), "--to", "deepspeed", "--world-size", "2")
    assert "only a DeepSpeed ZeRO save" in out and not (tmp_path / "o1").exists(), out

    src, step = _copy(save, tmp_path)
    _rewrite(step / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
             lambda o: o["optimizer_state_dict"].update(param_alignment_paddings=None))
    out = _refused("reshard", str(src), str(tmp_path / "o2"), "--to", "2")
    assert "param_alignment_paddings" in out and not (tmp_path / "o2").exists(), out

    src3, step3 = _copy(save, tmp_path / "pp")
    shutil.copyfile(step3 / "mp_rank_00_model_states.pt", step3 / "mp_rank_01_model_states.pt")
    out = _refused("reshard", str(src3), str(tmp_path / "o3"), "--to", "2")
    assert "mp_rank_01_model_states.pt" in out and not (tmp_path / "o3").exists(), out


@pytest.mark.parametrize("case", ["z1_bf16_2", "z3_3"])
def test_from_and_to_a_bucket_equal_local(saves, base, case, tmp_path):
    """A ZeRO save in a bucket: ``reshard`` bucket → bucket and ``export`` bucket → local give
    what they give on the local copy (DeepSpeed's own pickles compared, every tensor bit for
    bit): the writer's pickle records and flat pieces are all fetched, none read as holes."""
    from s3server import bucket_with, ckpt_with
    from safetensors.torch import load_file

    save = saves[case]
    to = 3 if save.world_size == 2 else 2
    args = ["--dtype", save.precision] if save.precision else []
    with bucket_with(tmp_path / "s3", save.path, "run") as (env, fs):
        r = ckpt_with(env, "reshard", "s3://ckpt/run", "s3://ckpt/out", "--to", str(to), "--quiet")
        assert r.returncode == 0, r.stderr
        fs.get("ckpt/out", str(tmp_path / "got"), recursive=True)
        r = ckpt_with(env, "export", "s3://ckpt/run", str(tmp_path / "hf_remote"), "--base", str(base), "--quiet", *args)
        assert r.returncode == 0, r.stderr
    _ckpt("reshard", str(save.path), str(tmp_path / "want"), "--to", str(to), "--quiet")
    step = f"global_step{SAVE_AT}"
    assert (tmp_path / "got" / "latest").read_text() == step
    want, got = _load_all(tmp_path / "want" / step), _load_all(tmp_path / "got" / step)
    assert list(want) == list(got)
    for name in want:
        assert not _same(want[name], got[name], name)
    _ckpt("export", str(save.path), str(tmp_path / "hf_local"), "--base", str(base), "--quiet", *args)
    a, b = load_file(tmp_path / "hf_local" / "model.safetensors"), load_file(tmp_path / "hf_remote" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].equal(b[k]) for k in a)
