"""verl's default strategy (FSDP1, ``use_orig_params=False``): optimizer state per flat parameter.

A real verl FSDP1 job at 4 ranks (``fw_verl.job(fsdp=1)``) on the ``odd`` tiny Llama, whose units
(6510 elements per decoder layer, 6090 untied or 3060 tied at the root) are padded at 4 ranks,
so the old padding must really be dropped. The save's flat state is mapped onto parameters from
its ``huggingface/config.json``:

- ``reshard --to 2`` and ``--to 3`` re-chunk each flat parameter and resume in verl's own
  ``FSDPCheckpointManager.load_checkpoint`` with the uninterrupted run's losses;
- ``convert --to dcp`` writes per-parameter moments, bit-equal to FSDP1's own
  ``FSDP.full_optim_state_dict``, and an FSDP2 job at 2 and 3 ranks resumes from it (model,
  optimizer and LR scheduler through ``dcp.load``) with the same losses;
- units that do not add up (a config that is not the model's) are exit 3, nothing written.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from dist import run_ranks
from fw_common import close

import fw_verl
from ckpt_tools.cli.main import main as cli

pytestmark = pytest.mark.filterwarnings("ignore")

SAVE_AT, STEPS = 2, 4


def _ckpt(*args: str) -> str:
    result = CliRunner().invoke(cli, [*args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


class Save:
    def __init__(self, tmp: Path, tied: bool) -> None:
        self.tmp, self.tied = tmp, tied
        self.full_optim = tmp / "full_optim.pt"
        self.path = tmp / "run"
        self.full = run_ranks(functools.partial(fw_verl.job, save_at=SAVE_AT, load=None, steps=STEPS, fsdp=1,
                                                odd=True, tied=tied, full_optim=str(self.full_optim)),
                              4, tmp, str(self.path))[0]

    def resume(self, path: Path, world_size: int, fsdp: int) -> list[float]:
        return run_ranks(functools.partial(fw_verl.job, save_at=None, load=str(path), steps=STEPS - SAVE_AT,
                                           fsdp=fsdp, odd=True, tied=self.tied),
                         world_size, self.tmp, str(self.tmp / f"resume{world_size}_{fsdp}"))[0]

    def reference(self) -> dict:
        import torch

        return torch.load(self.full_optim, weights_only=True)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def save(request, tmp_path_factory):
    return Save(tmp_path_factory.mktemp("tied" if request.param else "untied"), request.param)


def test_source_is_padded_flat_state(save):
    """The case this file is about: one 1-D padded shard per unit, int-keyed."""
    from ckpt_tools.security.safeload import load_torch

    osd = load_torch(save.path / "optim_world_size_4_rank_3.pt")
    assert sorted(osd["state"]) == [0, 1, 2]
    assert all(s["exp_avg"].dim() == 1 for s in osd["state"].values())
    assert osd["state"][1]["exp_avg"].numel() * 4 > 6510  # padded


def test_inspect_counts_both_moments_of_every_parameter(save):
    info = json.loads(_ckpt("inspect", str(save.path), "--json"))
    params = len(save.reference()["state"])
    assert params == (20 if save.tied else 21)
    assert info["groups"]["optimizer"]["num_tensors"] == 3 * params
    assert info["optimizer"]["params"] == params and info["optimizer"]["step"] == SAVE_AT
    assert "flat_parameters" not in info["optimizer"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_reshard_resumes_in_verl_fsdp1(save, world_size, tmp_path):
    from ckpt_tools.security.safeload import load_torch

    dst = tmp_path / "actor"
    _ckpt("reshard", str(save.path), str(dst), "--to", str(world_size), "--quiet")
    assert json.loads((dst / "fsdp_config.json").read_text())["FSDP_version"] == 1
    osd = load_torch(dst / f"optim_world_size_{world_size}_rank_0.pt")
    assert osd["state"][1]["exp_avg"].numel() == -(-6510 // world_size)  # flat again, at the new size
    assert close(save.resume(dst, world_size, fsdp=1), save.full[SAVE_AT:])


@pytest.fixture(scope="module")
def dcp_of(save, tmp_path_factory):
    dst = tmp_path_factory.mktemp("dcp") / "dcp"
    _ckpt("convert", str(save.path), str(dst), "--to", "dcp", "--quiet")
    return dst


def test_convert_dcp_moments_equal_fsdp1_full_optim_state_dict(save, dcp_of, tmp_path):
    """Read back by torch's own DCP loader (dcp_to_torch_save), every moment is FSDP1's own."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(dcp_of), str(tmp_path / "all.pt"))
    got = torch.load(tmp_path / "all.pt", weights_only=True)["optimizer"]["state"]
    ref = save.reference()["state"]
    assert got.keys() == ref.keys()
    for fqn, state in ref.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[fqn][key], state[key]), (fqn, key)
        assert float(got[fqn]["step"]) == float(state["step"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_convert_dcp_resumes_fsdp2(save, dcp_of, world_size):
    assert close(save.resume(dcp_of, world_size, fsdp=2), save.full[SAVE_AT:])


def test_units_that_do_not_add_up_exit_3(save, tmp_path):
    """A config that is not the model's wraps other units: refused before anything is written."""
    src = tmp_path / "src"
    shutil.copytree(save.path, src)
    config = json.loads((src / "huggingface" / "config.json").read_text())
    (src / "huggingface" / "config.json").write_text(json.dumps({**config, "intermediate_size": 46}))
    for args in (["reshard", str(src), str(tmp_path / "a"), "--to", "2"],
                 ["convert", str(src), str(tmp_path / "b"), "--to", "dcp"]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 3, result.output
        assert "flat parameter 1" in result.output and "wrapped otherwise" in result.output, result.output
        assert "Traceback" not in result.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
