"""``ckpt latest RUN_DIR`` over DeepSpeed and Megatron-LM run directories.

Real saves on 2 CPU ranks, twice into one run directory (a run that saved at steps 1 and 2):
- DeepSpeed (``fw_deepspeed.job``, ZeRO 2, the engine's own ``save_checkpoint``):
  ``global_step1/``, ``global_step2/`` and the ``latest`` file naming ``global_step2``;
- Megatron-Core (``fw_megatron.job``, ``dist_checkpointing.save``) into ``iter_0000001/`` and
  ``iter_0000002/``, with ``latest_checkpointed_iteration.txt`` written as Megatron-LM's
  ``save_checkpoint`` writes it (the iteration as text).
The newest is made incomplete (a rank's file removed, or Megatron's ``metadata.json``, which
``dist_checkpointing`` writes last): ``latest`` names the older one, the framework's marker is
noted and not trusted, and the framework's own loader resumes from the printed path
(``engine.load_checkpoint`` gives the uninterrupted run's next loss; ``dist_checkpointing.load``
the weights the step-1 job held).
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import pytest
from click.testing import CliRunner
from dist import run_ranks

import fw_deepspeed
import fw_megatron
from ckpt_tools.cli.main import main as cli

pytestmark = pytest.mark.filterwarnings("ignore")
WS = 2


def _cli(*args: str):
    return CliRunner().invoke(cli, [*args], catch_exceptions=False)


# -- DeepSpeed ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ds_run(tmp_path_factory):
    pytest.importorskip("deepspeed", reason="the DeepSpeed tests need deepspeed==0.19.8 (README, Install)")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the spawned ranks inherit it
    root = tmp_path_factory.mktemp("ds_run")
    run = root / "run"
    for save_at in (1, 2):
        result = run_ranks(functools.partial(fw_deepspeed.job, stage=2, save_at=save_at, steps=save_at + 1),
                           WS, root, str(run))[0]
    return run, result["losses"]  # the second job's: steps 1..3, saved after 2


def _ds_loss_after_load(rank: int, world_size: int, run: str, tag: str, step: int) -> float:
    """DeepSpeed's own ``load_checkpoint(run, tag)``, then the loss of step ``step``'s batch."""
    import torch
    import torch.distributed as dist
    from fw_common import batch_for

    engine = fw_deepspeed._engine(2, False, world_size, 1, 50, False)  # another seed: the load must set it all
    engine.load_checkpoint(run, tag=tag)
    with torch.no_grad():
        ids = batch_for(step, rank, world_size)
        loss = engine(input_ids=ids, labels=ids).loss.detach().float().clone()
    dist.all_reduce(loss)
    return loss.item() / world_size


def test_deepspeed_latest_skips_a_step_missing_a_rank_file(ds_run, tmp_path):
    run, losses = ds_run
    assert (run / "latest").read_text().strip() == "global_step2"
    result = _cli("latest", str(run))
    assert result.exit_code == 0 and result.stdout.strip() == str(run / "global_step2"), result.output
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()  # the last rank's
    result = _cli("latest", str(copy))
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(copy / "global_step1")
    assert "deepspeed's latest marker names step 2, which is incomplete; ignored" in result.stderr
    info = json.loads(_cli("latest", str(copy), "--json").stdout)
    newest, older = info["checkpoints"]
    assert (newest["step"], newest["layout"], newest["complete"]) == (2, "deepspeed", False)
    assert newest["missing"] == ["zero_pp_rank_1_mp_rank_00_optim_states.pt missing (rank 1 of 2)"]
    assert (older["step"], older["world_size"], older["complete"]) == (1, WS, True)
    # DeepSpeed's own loader resumes from what latest printed: the uninterrupted run's step-2 loss
    loss = run_ranks(_ds_loss_after_load, WS, tmp_path, str(copy), "global_step1", 1)[0]
    assert abs(loss - losses[1]) <= 1e-5 * abs(losses[1]), (loss, losses[1])


def test_deepspeed_step_cut_short_or_without_model_states(ds_run, tmp_path):
    run, _ = ds_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    rank0 = copy / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with open(rank0, "r+b") as f:
        f.truncate(rank0.stat().st_size // 2)
    (copy / "global_step1" / "mp_rank_00_model_states.pt").unlink()
    result = _cli("latest", str(copy))
    assert result.exit_code == 3, result.output
    assert "global_step2: zero_pp_rank_0_mp_rank_00_optim_states.pt" in result.output, result.output
    assert "global_step1: mp_rank_00_model_states.pt missing" in result.output, result.output


def test_deepspeed_custom_tag_is_checked_as_deepspeed(ds_run, tmp_path):
    """``save_checkpoint(tag="best_2")``: plain claims the directory by its number, DeepSpeed's
    rules judge it (a rank's optimizer file missing is seen)."""
    run, _ = ds_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "global_step2").rename(copy / "best_2")
    (copy / "latest").write_text("best_2")
    assert _cli("latest", str(copy)).stdout.strip() == str(copy / "best_2")
    (copy / "best_2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    info = json.loads(_cli("latest", str(copy), "--json").stdout)
    assert info["latest"] == str(copy / "global_step1")
    assert info["checkpoints"][0]["missing"] == ["zero_pp_rank_1_mp_rank_00_optim_states.pt missing (rank 1 of 2)"]


def test_whole_check_of_a_deepspeed_save(ds_run, tmp_path):
    """The format's completeness rule, asked directly of a step directory and of a run whose
    ``latest`` names one (as any caller of ``formats.whole.check`` would)."""
    from ckpt_tools.formats import whole

    run, _ = ds_run
    for path in (run, run / "global_step2"):
        found = whole.check(path)
        assert (found.format, found.world_size, found.missing) == ("deepspeed", 2, ()), found
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert whole.check(copy).missing == ("global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt missing (rank 1 of 2)",)


# -- Megatron-LM ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    pytest.importorskip("megatron.core", reason="the Megatron tests need megatron-core==0.16.1 (README, Install)")
    root = tmp_path_factory.mktemp("megatron_run")
    run = root / "run"
    held = {}
    for it in (1, 2):
        held[it] = run_ranks(functools.partial(fw_megatron.job, steps=it), WS, root, str(run / f"iter_{it:07d}"))[0]
        # Megatron-LM's save_checkpoint: rank 0 writes the tracker once every rank's save is in
        (run / "latest_checkpointed_iteration.txt").write_text(str(it))
    return run, held


def test_megatron_latest_skips_a_save_cut_off(megatron_run, tmp_path):
    import torch

    run, held = megatron_run
    assert _cli("latest", str(run)).stdout.strip() == str(run / "iter_0000002")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "iter_0000002" / "metadata.json").unlink()  # written last: the save was cut off before it
    result = _cli("latest", str(copy))
    assert result.exit_code == 0 and result.stdout.strip() == str(copy / "iter_0000001"), result.output
    assert "megatron's latest marker names step 2, which is incomplete; ignored" in result.stderr
    info = json.loads(_cli("inspect", str(copy), "--json").stdout)
    assert info["run"] == str(copy) and info["latest"] == str(copy / "iter_0000001")
    assert [(c["step"], c["format"], c["layout"], c["complete"]) for c in info["checkpoints"]] == [
        (2, "dcp", "megatron", False), (1, "dcp", "megatron", True)]
    assert info["checkpoints"][0]["missing"] == [
        "metadata.json missing (dist_checkpointing writes it last: the save was cut off)"]
    # Megatron-Core's own loader loads what latest printed: the weights the step-1 job held
    loaded = run_ranks(fw_megatron.load, WS, tmp_path, result.stdout.strip())[0]
    compared = [k for k in held[1]["model"] if not k.endswith("_extra_state")]
    assert len(compared) > 10
    for k in compared:
        assert torch.equal(loaded[k], held[1]["model"][k]), k


def test_megatron_rank_file_missing(megatron_run, tmp_path):
    run, _ = megatron_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    distcp = sorted((copy / "iter_0000002").glob("*.distcp"))
    distcp[-1].unlink()
    (copy / "iter_0000001" / "common.pt").unlink()
    result = _cli("latest", str(copy))
    assert result.exit_code == 3, result.output
    assert f"iter_0000002: {distcp[-1].name}" in result.output and "iter_0000001: common.pt missing" in result.output, \
        result.output


def test_latest_of_runs_in_a_bucket(ds_run, megatron_run, tmp_path):
    """The same runs in a bucket: ``latest`` judges each step from the ranges it fetches (the
    model states' pickle, zip directories, DCP metadata) and names the same steps as locally."""
    from s3server import bucket_with, ckpt_with

    with bucket_with(tmp_path / "s3", ds_run[0], "ds") as (env, fs):
        fs.put(str(megatron_run[0]), "ckpt/megatron", recursive=True)
        for name, step in {"ds": "global_step2", "megatron": "iter_0000002"}.items():
            r = ckpt_with(env, "latest", f"s3://ckpt/{name}")
            assert (r.returncode, r.stdout.strip()) == (0, f"s3://ckpt/{name}/{step}"), r.stderr
        fs.rm("ckpt/ds/global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt")
        r = ckpt_with(env, "latest", "s3://ckpt/ds")
        assert (r.returncode, r.stdout.strip()) == (0, "s3://ckpt/ds/global_step1"), r.stderr
