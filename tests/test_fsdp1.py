"""Plain PyTorch FSDP1 training saved every way PyTorch documents, through ckpt, resumed.

A 4-rank FSDP1 job (``use_orig_params=True``, each decoder layer wrapped, AdamW; the job is
``fw_fsdp1.py``) saves after step 2 in six ways and runs on to step 4. For each save: ``inspect``
counts the model and the optimizer; ``reshard --to 2`` (``convert --to dcp --world-size 2`` for
the full file) resumes in that save's own load path at 2 ranks with the uninterrupted losses;
``convert --to torch`` and ``--to sharded`` keep every moment under the optimizer; ``export``
loads in ``from_pretrained`` with the saved weights' logits. Untied and tied embeddings.
"""

from __future__ import annotations

import functools
import json
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from dist import run_ranks
from fw_common import close

import ckpt_tools
import fw_fsdp1
from ckpt_tools.cli.main import main as cli

pytestmark = pytest.mark.filterwarnings("ignore")

SAVE_AT, STEPS = 2, 4
DCP_MODES = ("model_optim", "model_optimizer", "app", "sharded_dcp")


def _ckpt(*args: str) -> str:
    result = CliRunner().invoke(cli, [*args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _inspect(path) -> dict:
    return json.loads(_ckpt("inspect", str(path), "--json"))


class Run:
    """One 4-rank job's saves (``saves/<mode>``), its uninterrupted losses, and the 2-rank
    resume of every save after ckpt wrote it for 2 ranks."""

    def __init__(self, tmp: Path, tied: bool) -> None:
        self.tmp, self.tied = tmp, tied
        self.saves = tmp / "saves"
        self.full = run_ranks(functools.partial(fw_fsdp1.job, save_at=SAVE_AT, steps=STEPS, tied=tied),
                              4, tmp, str(self.saves))[0]
        out = tmp / "ws2"
        paths = {}
        for mode in DCP_MODES + ("sharded_pt",):
            _ckpt("reshard", str(self.saves / mode), str(out / mode), "--to", "2", "--quiet")
            paths[mode] = str(out / mode)
        _ckpt("convert", str(self.saves / "full" / "full.pt"), str(out / "full"), "--to", "dcp",
              "--world-size", "2", "--quiet")
        paths["full"] = str(out / "full")
        self.resumed = run_ranks(functools.partial(fw_fsdp1.resume, paths=paths, first=SAVE_AT,
                                                   steps=STEPS - SAVE_AT, tied=tied), 2, tmp, str(tmp / "resume"))[0]

    def reference(self) -> dict:
        """The full training state at the save, as the job's own FULL_STATE_DICT file holds it."""
        import torch

        return torch.load(self.saves / "full" / "full.pt", weights_only=True)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def run(request, tmp_path_factory):
    return Run(tmp_path_factory.mktemp("tied" if request.param else "untied"), request.param)


def _counts(run: Run) -> tuple[int, int]:
    """Model tensors and optimizer tensors (3 per parameter: step, exp_avg, exp_avg_sq)."""
    state = run.reference()
    return len(state["model"]), 3 * len(state["optimizer"]["state"])


@pytest.mark.parametrize("mode", fw_fsdp1.MODES)
def test_inspect_counts_model_and_optimizer(run, mode):
    model, optimizer = _counts(run)
    path = run.saves / mode / ("full.pt" if mode == "full" else "")
    info = _inspect(path)
    assert info["groups"]["model"]["num_tensors"] == model, info["groups"]
    assert info["groups"]["optimizer"]["num_tensors"] == optimizer, info["groups"]
    assert "extra" not in info["groups"], info["groups"]
    assert info["optimizer"]["step"] == SAVE_AT


@pytest.mark.parametrize("mode", fw_fsdp1.MODES)
def test_resumes_at_two_ranks(run, mode):
    assert close(run.resumed[mode], run.full[SAVE_AT:]), (mode, run.resumed[mode], run.full[SAVE_AT:])


@pytest.mark.parametrize("mode", DCP_MODES)
def test_dcp_keys_kept(run, mode):
    """The resharded DCP keeps the saved keys (``optim``, ``app.model``...), as its loader asks."""
    from torch.distributed.checkpoint import FileSystemReader

    src = FileSystemReader(str(run.saves / mode)).read_metadata().state_dict_metadata
    dst = FileSystemReader(str(run.tmp / "ws2" / mode)).read_metadata().state_dict_metadata
    assert set(src) == set(dst)


@pytest.mark.parametrize("mode", ["model_optim", "app", "sharded_dcp", "sharded_pt"])
def test_convert_keeps_every_moment(run, mode, tmp_path):
    """--to torch: the moments under "optimizer", the model alone under "model", equal to the
    job's own full state; --to sharded: optimizer files holding them; each summary counts them."""
    import torch

    ref = run.reference()
    model, optimizer = _counts(run)
    out = tmp_path / "full.pt"
    report = ckpt_tools.convert(run.saves / mode, out, to="torch", progress=False)
    assert report["num_tensors"] == model + optimizer
    got = torch.load(out, weights_only=True)
    assert sorted(got["model"]) == sorted(ref["model"])
    assert got["optimizer"]["state"].keys() == ref["optimizer"]["state"].keys()
    for fqn, state in ref["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(got["optimizer"]["state"][fqn][key], value), (fqn, key)
    assert [g["params"] for g in got["optimizer"]["param_groups"]] == [g["params"] for g in ref["optimizer"]["param_groups"]]

    sharded = tmp_path / "sharded"
    report = ckpt_tools.convert(run.saves / mode, sharded, to="sharded", world_size=2, progress=False)
    assert report["num_tensors"] == model + optimizer
    assert sorted(p.name for p in sharded.glob("optim_world_size_2_rank_*.pt")) == [
        "optim_world_size_2_rank_0.pt", "optim_world_size_2_rank_1.pt"]
    info = _inspect(sharded)
    assert (info["groups"]["model"]["num_tensors"], info["groups"]["optimizer"]["num_tensors"]) == (model, optimizer)


@pytest.mark.parametrize("mode", fw_fsdp1.MODES)
def test_export_loads_with_the_saved_logits(run, mode, fixtures_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    base = fixtures_dir / ("llama_tied_hf" if run.tied else "llama_hf")
    dst = tmp_path / "hf"
    _ckpt("export", str(run.saves / mode / ("full.pt" if mode == "full" else "")), str(dst), "--base", str(base), "--quiet")
    model, info = AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    reference.load_state_dict(run.reference()["model"])
    ids = torch.arange(16).reshape(2, 8)
    assert torch.equal(model(ids).logits, reference(ids).logits)


def test_fsdp1_rank_files_stay_fsdp1(run, tmp_path):
    """reshard of SHARDED_STATE_DICT rank files writes ShardedTensors and keeps FSDP_version 1
    (the resume above loads them in FSDP1's own load path); rank files that are not a copy of
    the source (here: the model alone) are FSDP2, and it says so."""
    out = run.tmp / "ws2" / "sharded_pt"
    assert json.loads((out / "fsdp_config.json").read_text())["FSDP_version"] == 1
    for name in ("model_world_size_2_rank_1.pt", "optim_world_size_2_rank_0.pt"):
        with zipfile.ZipFile(out / name) as z:
            pickle = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
        assert b"ShardedTensor" in pickle and b"DTensor" not in pickle, name
    assert _inspect(out)["fsdp"] == "FSDP1 (ShardedTensor)"
    result = CliRunner().invoke(cli, ["convert", str(run.saves / "sharded_pt"), str(tmp_path / "v2"), "--to",
                                      "sharded", "--world-size", "2", "--model-only"])
    assert result.exit_code == 0, result.output
    assert "note: written as FSDP2" in result.output
    assert json.loads((tmp_path / "v2" / "fsdp_config.json").read_text())["FSDP_version"] == 2
