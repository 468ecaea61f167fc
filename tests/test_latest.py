"""``ckpt latest RUN_DIR`` and ``ckpt inspect RUN_DIR``: the newest complete checkpoint of a run.

Real runs: a plain FSDP2 job (``fully_shard`` + ``dcp.save``) and the frameworks' own saves
(verl's ``FSDPCheckpointManager``, the transformers ``Trainer``, torchtitan's
``CheckpointManager``; the jobs in ``fw_*.py``) write checkpoints at steps 1, 2 and 3 of a
4-step run on 2 CPU ranks; a second job resumes at 3 and is SIGKILLed once the first files of
its step-4 save exist; then one file of step 3 is truncated. ``ckpt latest`` must name step 2,
and the framework's own loader, resuming from the printed path, must give the uninterrupted
run's losses for steps 3-4. The rest (nothing complete, an empty directory, a checkpoint given
itself, a symlink out of RUN_DIR, manifests, no torch import) run on copies of the fixtures.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from dist import run_ranks
from fw_common import batch_for, close, kill_when_written, tiny_model

import ckpt_tools
from ckpt_tools.cli.main import main as cli
from ckpt_tools.errors import BadInput

pytestmark = pytest.mark.filterwarnings("ignore")

WS, SAVES, STEPS = 2, (1, 2, 3), 4


def _cli(*args: str):
    return CliRunner().invoke(cli, [*args], catch_exceptions=False)


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


# -- a plain FSDP2 job: fully_shard + torch.distributed.checkpoint ------------------------------

def _fsdp2_job(rank: int, world_size: int, run: str, *, saves: tuple[int, ...], load: str | None, steps: int,
               kill_in: str | None = None, losses_to: str | None = None, folder: str = "step_{}",
               optim_key: str = "optim") -> list[float]:
    """Train ``steps`` steps of the tiny Llama under ``fully_shard``; after each step in
    ``saves`` ``dcp.save`` model, optimizer (under ``optim_key``) and step into
    ``run/<folder with the step>``; start from ``load`` with ``dcp.load`` when given.
    ``losses_to``: rank 0 writes the losses so far there before each save (the job may be
    killed in one: ``kill_in``)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    model = tiny_model(0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = 0
    if load:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, optim_key: osd, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=load)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state[optim_key])
        first = int(state["step"])
    losses = []
    for step in range(first, first + steps):
        ids = batch_for(step, rank, world_size)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        g = loss.detach().clone()
        dist.all_reduce(g)
        losses.append(g.item() / world_size)
        if step + 1 in saves:
            if losses_to and rank == 0:
                Path(losses_to).write_text(json.dumps(losses))
            target = os.path.join(run, folder.format(step + 1))
            if kill_in:
                kill_when_written(kill_in)
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, optim_key: osd, "step": torch.tensor(step + 1)}, checkpoint_id=target)
    return losses


def test_fsdp2_run_killed_and_truncated(tmp_path):
    run = tmp_path / "run"
    full = run_ranks(functools.partial(_fsdp2_job, saves=SAVES, load=None, steps=STEPS - 1), WS, tmp_path, str(run))[0]
    # the job goes on from step 3 and is killed in its step-4 save, once its first file exists
    with pytest.raises(RuntimeError):
        run_ranks(functools.partial(_fsdp2_job, saves=(4,), load=str(run / "step_3"), steps=1,
                                    kill_in=str(run / "step_4"), losses_to=str(tmp_path / "losses.json")),
                  WS, tmp_path, str(run))
    full += json.loads((tmp_path / "losses.json").read_text())
    killed = run / "step_4"
    assert any(killed.iterdir()) and not (killed / ".metadata").exists(), sorted(os.listdir(killed))
    assert ckpt_tools.latest(run) == str(run / "step_3")
    _truncate(run / "step_3" / "__1_0.distcp")

    result = _cli("latest", str(run))
    assert result.exit_code == 0, result.output
    printed = result.stdout.strip()
    assert printed == str(run / "step_2")
    info = json.loads(_cli("inspect", str(run), "--json").stdout)
    by_step = {c["step"]: c for c in info["checkpoints"]}
    assert [c["step"] for c in info["checkpoints"]] == [4, 3, 2, 1]
    assert not by_step[4]["complete"] and ".metadata missing" in by_step[4]["missing"][0]
    assert not by_step[3]["complete"] and "__1_0.distcp truncated" in by_step[3]["missing"][0]
    assert by_step[2]["complete"] and (by_step[2]["format"], by_step[2]["layout"], by_step[2]["world_size"]) == \
        ("dcp", "plain", WS)

    resumed = run_ranks(functools.partial(_fsdp2_job, saves=(), load=printed, steps=2), WS, tmp_path, str(run))[0]
    assert close(resumed, full[2:4]), (resumed, full)


def test_plain_dcp_in_step_folders(tmp_path):
    """``dcp.save`` of model, optimizer and step into ``step-N/`` (torchtitan's folder names, none
    of its entries): plain checkpoints, complete, and the one printed resumes the job."""
    run = tmp_path / "run"
    job = functools.partial(_fsdp2_job, folder="step-{}", optim_key="optimizer")
    full = run_ranks(functools.partial(job, saves=(1, 2), load=None, steps=STEPS), WS, tmp_path, str(run))[0]
    result = _cli("latest", str(run))
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(run / "step-2")
    info = json.loads(_cli("inspect", str(run), "--json").stdout)
    assert [(c["step"], c["layout"], c["complete"]) for c in info["checkpoints"]] == [(2, "plain", True),
                                                                                       (1, "plain", True)]
    resumed = run_ranks(functools.partial(job, saves=(), load=result.stdout.strip(), steps=2), WS, tmp_path,
                        str(tmp_path / "resumed"))[0]
    assert close(resumed, full[2:4])


# -- the frameworks' own saves -------------------------------------------------------------------

class _Verl:
    marker = True  # latest_checkpointed_iteration.txt
    truncated = "actor/model_world_size_2_rank_1.pt"

    @staticmethod
    def dir(run: Path, step: int) -> Path:
        return run / f"global_step_{step}"

    def __init__(self):
        import fw_verl

        self.job = fw_verl.job

    def write(self, run: Path, tmp: Path) -> list[float]:
        out = str(run / "global_step_{step}" / "actor")
        full = run_ranks(functools.partial(self.job, save_at=SAVES, load=None, steps=STEPS), WS, tmp, out)[0]
        with pytest.raises(RuntimeError):
            run_ranks(functools.partial(self.job, save_at=4, load=str(run / "global_step_3" / "actor"), steps=1,
                                        kill_in=str(run / "global_step_4")), WS, tmp, out)
        return full

    def resume(self, printed: str, tmp: Path) -> list[float]:
        # verl's trainer resumes from global_step_N: the actor's manager loads global_step_N/actor
        return run_ranks(functools.partial(self.job, save_at=None, load=os.path.join(printed, "actor"), steps=2),
                         WS, tmp, str(tmp / "resumed"))[0]


class _Trainer:
    marker = False
    truncated = "pytorch_model_fsdp_0/__1_0.distcp"

    @staticmethod
    def dir(run: Path, step: int) -> Path:
        return run / f"checkpoint-{step}"

    def __init__(self):
        import fw_trainer

        self.job = fw_trainer.job

    def write(self, run: Path, tmp: Path) -> list[float]:
        full = run_ranks(functools.partial(self.job, save_at=SAVES, load=None, steps=STEPS), WS, tmp, str(run))[0]
        with pytest.raises(RuntimeError):
            run_ranks(functools.partial(self.job, save_at=4, load=str(run / "checkpoint-3"), steps=1,
                                        kill_in=str(run / "checkpoint-4")), WS, tmp, str(run))
        return full

    def resume(self, printed: str, tmp: Path) -> list[float]:
        return run_ranks(functools.partial(self.job, save_at=None, load=printed, steps=2), WS, tmp,
                         str(tmp / "resumed"))[0]


class _Torchtitan:
    marker = False
    truncated = "__1_0.distcp"

    @staticmethod
    def dir(run: Path, step: int) -> Path:
        return run / f"step-{step}"

    def __init__(self):
        import fw_torchtitan

        self.job = fw_torchtitan.job

    def write(self, run: Path, tmp: Path) -> list[float]:
        full = run_ranks(functools.partial(self.job, save_at=SAVES, load=None, steps=STEPS), WS, tmp, str(run))[0]
        with pytest.raises(RuntimeError):
            run_ranks(functools.partial(self.job, save_at=4, load=str(run / "step-3"), steps=1,
                                        kill_in=str(run / "step-4")), WS, tmp, str(run))
        return full

    def resume(self, printed: str, tmp: Path) -> list[float]:
        return run_ranks(functools.partial(self.job, save_at=None, load=printed, steps=2), WS, tmp, None)[0]


@pytest.mark.parametrize("framework", [_Verl, _Trainer, _Torchtitan], ids=["verl", "trainer", "torchtitan"])
def test_framework_run_killed_and_truncated(framework, tmp_path):
    fw = framework()
    run = tmp_path / "run"
    full = fw.write(run, tmp_path)
    killed = fw.dir(run, 4)
    assert any(p.is_file() for p in killed.rglob("*")), "the killed save left no file"
    entries = {c["step"]: c for c in ckpt_tools.inspect(run)["checkpoints"]}
    assert not entries[4]["complete"], entries[4]  # premise: the kill landed mid-write
    assert ckpt_tools.latest(run) == str(fw.dir(run, 3))
    _truncate(fw.dir(run, 3) / fw.truncated)

    result = _cli("latest", str(run))
    assert result.exit_code == 0, result.output
    printed = result.stdout.strip()
    assert printed == str(fw.dir(run, 2))
    if fw.marker:  # the framework's own "latest" marker names step 3: said, and not trusted
        assert "latest marker names step 3, which is incomplete; ignored" in result.stderr
    print(_cli("inspect", str(run)).stdout)  # the table, shown when an assertion below fails
    entries = {c["step"]: c for c in json.loads(_cli("inspect", str(run), "--json").stdout)["checkpoints"]}
    assert sorted(entries) == [1, 2, 3, 4]
    assert not entries[3]["complete"] and any("truncated" in m or "not a readable" in m for m in entries[3]["missing"])
    assert entries[2]["complete"] and entries[2]["world_size"] == WS

    assert close(fw.resume(printed, tmp_path), full[2:4])


def test_trainer_rank_rng_state_lost(tmp_path):
    """A real 2-rank Trainer run whose newest save lost rank 1's ``rng_state_1.pth`` (that rank
    killed after rank 0 wrote ``trainer_state.json``): incomplete, the save before it is taken."""
    import fw_trainer

    run = tmp_path / "run"
    run_ranks(functools.partial(fw_trainer.job, save_at=(1, 2), load=None, steps=2), WS, tmp_path, str(run))
    newest = run / "checkpoint-2"
    assert (newest / "trainer_state.json").is_file() and (newest / "rng_state_0.pth").is_file()
    (newest / "rng_state_1.pth").unlink()
    result = _cli("latest", str(run))
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(run / "checkpoint-1")
    entries = {c["step"]: c for c in json.loads(_cli("inspect", str(run), "--json").stdout)["checkpoints"]}
    assert not entries[2]["complete"] and entries[2]["missing"][0].startswith("rng_state_1.pth missing (rank 1 of 2")
    assert entries[1]["complete"], entries[1]


def test_verl_step_dir_taken_by_every_command(tmp_path):
    """What ``latest`` prints for verl (``global_step_N``, beside its ``data.pt``) is what every
    command takes: inspect, verify and export read its ``actor/``; reshard writes a
    ``global_step_N`` verl's trainer resumes from (actor resharded, data.pt carried)."""
    import fw_verl
    from transformers import LlamaForCausalLM

    run = tmp_path / "run"
    out = str(run / "global_step_{step}" / "actor")
    full = run_ranks(functools.partial(fw_verl.job, save_at=(1, 2), load=None, steps=STEPS), WS, tmp_path, out)[0]
    printed = _cli("latest", str(run)).stdout.strip()
    assert printed == str(run / "global_step_2") and (run / "global_step_2" / "data.pt").is_file()
    info = json.loads(_cli("inspect", printed, "--json").stdout)
    assert (info["format"], info["layout"], info["world_size"]) == ("sharded", "verl", WS)
    assert info["groups"]["optimizer"]["num_tensors"] == 3 * info["groups"]["model"]["num_tensors"]
    assert _cli("verify", printed, os.path.join(printed, "actor")).exit_code == 0
    result = _cli("export", printed, str(tmp_path / "hf"), "--quiet")
    assert result.exit_code == 0, result.output
    _, loading = LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    dst = tmp_path / "resharded" / "global_step_2"
    result = _cli("reshard", printed, str(dst), "--to", "1", "--quiet")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in dst.iterdir()) == ["actor", "data.pt"]
    assert (dst / "data.pt").read_bytes() == (run / "global_step_2" / "data.pt").read_bytes()
    resumed = run_ranks(functools.partial(fw_verl.job, save_at=None, load=str(dst / "actor"), steps=2), 1, tmp_path,
                        str(tmp_path / "resumed"))[0]
    assert close(resumed, full[2:4])


# -- hand-made runs from the fixtures ----------------------------------------------------------

def _run_of(fixtures_dir: Path, root: Path, **dirs: str) -> Path:
    root.mkdir()
    for name, fixture in dirs.items():
        shutil.copytree(fixtures_dir / fixture, root / name)
    return root


def test_nothing_complete(fixtures_dir, tmp_path):
    run = _run_of(fixtures_dir, tmp_path / "run", step_1="llama_sharded_ws2", step_2="llama_dcp")
    (run / "step_1" / "model_world_size_2_rank_1.pt").unlink()
    _truncate(run / "step_2" / "__0_0.distcp")
    result = _cli("latest", str(run))
    assert result.exit_code == 3 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: ") and "no complete checkpoint" in line
    assert "step_1: " in line and "missing ranks [1]" in line
    assert "step_2: __0_0.distcp truncated" in line
    with pytest.raises(BadInput):
        ckpt_tools.latest(run)
    result = _cli("latest", str(run), "--json")
    assert result.exit_code == 3
    info = json.loads(result.stdout)
    assert info["latest"] is None and [c["complete"] for c in info["checkpoints"]] == [False, False]


def test_empty_and_missing_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "absent"):
        result = _cli("latest", str(path))
        assert result.exit_code == 3 and result.stdout == ""
        assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1
    assert _cli("latest").exit_code == 2  # usage
    assert _cli("latest", str(tmp_path), "--bogus").exit_code == 2


@pytest.mark.parametrize("fixture", ["llama_dcp", "llama_sharded_ws2", "llama_hf_sharded", "llama_accelerate"])
def test_a_checkpoint_itself(fixtures_dir, tmp_path, fixture):
    ckpt = shutil.copytree(fixtures_dir / fixture, tmp_path / fixture)
    result = _cli("latest", str(ckpt))
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{ckpt}\n"


def test_a_checkpoint_itself_incomplete(fixtures_dir, tmp_path):
    ckpt = shutil.copytree(fixtures_dir / "llama_dcp", tmp_path / "ckpt")
    (ckpt / ".metadata").rename(ckpt / ".metadata.tmp")  # as torch leaves a save cut off
    result = _cli("latest", str(ckpt))
    assert result.exit_code == 3 and ".metadata missing (only .metadata.tmp" in result.stderr


def test_symlink_out_of_run_dir_refused(fixtures_dir, tmp_path):
    outside = shutil.copytree(fixtures_dir / "llama_dcp", tmp_path / "elsewhere")
    run = _run_of(fixtures_dir, tmp_path / "run", step_1="llama_dcp")
    (run / "step_2").symlink_to(outside, target_is_directory=True)
    assert _cli("latest", str(run)).stdout.strip() == str(run / "step_1")  # never the newer one outside
    entry = ckpt_tools.inspect(run)["checkpoints"][0]
    assert (entry["step"], entry["complete"]) == (2, False) and "leads out of RUN_DIR" in entry["missing"][0]
    shutil.rmtree(run / "step_1")
    result = _cli("latest", str(run))
    assert result.exit_code == 3 and "step_2: leads out of RUN_DIR through a symlink" in result.stderr
    # a symlink that stays inside is followed like any directory
    (run / "step_2").unlink()
    shutil.copytree(outside, run / "data")
    (run / "step_3").symlink_to(run / "data", target_is_directory=True)
    assert _cli("latest", str(run)).stdout.strip() == str(run / "step_3")


def test_step_by_number_not_mtime(fixtures_dir, tmp_path):
    run = _run_of(fixtures_dir, tmp_path / "run", ckpt_9="llama_dcp", ckpt_10="llama_dcp", ckpt_100="llama_dcp")
    os.utime(run / "ckpt_9", (time.time() + 100, time.time() + 100))
    assert ckpt_tools.latest(run) == str(run / "ckpt_100")


def test_trainer_rules(fixtures_dir, tmp_path):
    """Side files the Trainer's resume reads: trainer_state.json (written last) and, beside an
    optimizer, scheduler.pt (without it the Trainer silently starts a fresh optimizer)."""
    run = tmp_path / "out"
    for step in (5, 10):
        shutil.copytree(fixtures_dir / "llama_accelerate", run / f"checkpoint-{step}")
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        shutil.copy(run / f"checkpoint-{step}" / "scheduler.bin", run / f"checkpoint-{step}" / "scheduler.pt")
    (run / "checkpoint-10" / "scheduler.pt").unlink()
    assert ckpt_tools.latest(run) == str(run / "checkpoint-5")
    assert ckpt_tools.latest(run / "checkpoint-5") == str(run / "checkpoint-5")  # itself, by its name
    with pytest.raises(BadInput, match="scheduler.pt missing"):
        ckpt_tools.latest(run / "checkpoint-10")
    (run / "checkpoint-5" / "trainer_state.json").unlink()
    info = ckpt_tools.inspect(run)
    missing = {c["step"]: c["missing"] for c in info["checkpoints"]}
    assert any(m.startswith("scheduler.pt missing") for m in missing[10])
    assert any(m.startswith("trainer_state.json missing") for m in missing[5])
    assert all(c["layout"] == "trainer" for c in info["checkpoints"])


def test_accelerate_project_dir(fixtures_dir, tmp_path):
    project = tmp_path / "project"
    for step in (0, 1):
        shutil.copytree(fixtures_dir / "llama_accelerate", project / "checkpoints" / f"checkpoint_{step}")
    shutil.rmtree(project / "checkpoints" / "checkpoint_1" / "optimizer_0")
    assert ckpt_tools.latest(project) == str(project / "checkpoints" / "checkpoint_0")
    assert ckpt_tools.latest(project / "checkpoints") == str(project / "checkpoints" / "checkpoint_0")
    entry = ckpt_tools.inspect(project)["checkpoints"][0]
    assert entry["layout"] == "accelerate" and entry["missing"][0].startswith("optimizer_0/ missing")


def test_manifest_sizes_and_verify(fixtures_dir, tmp_path):
    run = tmp_path / "run"
    src = fixtures_dir / "llama_dcp"
    for step in (1, 2):
        assert _cli("convert", str(src), str(run / f"step_{step}"), "--to", "dcp", "--quiet").exit_code == 0
    assert ckpt_tools.latest(run) == str(run / "step_2")
    # same size, other bytes: only --verify's checksums see it
    f = run / "step_2" / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    assert ckpt_tools.latest(run) == str(run / "step_2")
    result = _cli("latest", str(run), "--verify")
    assert result.exit_code == 0 and result.stdout.strip() == str(run / "step_1")
    # an extra byte: the manifest's size catches it without --verify (the DCP offsets do not)
    with open(f, "ab") as fh:
        fh.write(b"\0")
    entry = ckpt_tools.inspect(run)["checkpoints"][0]
    assert not entry["complete"] and "the manifest says" in entry["missing"][0]


def test_inspect_run_table(fixtures_dir, tmp_path):
    run = _run_of(fixtures_dir, tmp_path / "run", step_1="llama_sharded_ws2", step_2="llama_dcp")
    (run / "notes").mkdir()  # not a checkpoint, not listed
    _truncate(run / "step_2" / "__1_0.distcp")
    result = _cli("inspect", str(run))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[1].split()[:7] == ["step", "path", "format", "layout", "ranks", "size", "complete"]
    assert lines[2].split()[:5] == ["2", "step_2", "dcp", "plain", "2"] and "no: __1_0.distcp truncated" in lines[2]
    assert lines[3].split()[:5] == ["1", "step_1", "sharded", "plain", "2"] and lines[3].endswith("yes")
    assert lines[-1] == f"  latest complete: {run / 'step_1'}"
    info = json.loads(_cli("inspect", str(run), "--json").stdout)
    assert set(info) >= {"run", "checkpoints"}
    assert set(info["checkpoints"][0]) >= {"path", "step", "format", "layout", "world_size", "complete", "missing"}
    # a checkpoint is still inspected as one
    assert json.loads(_cli("inspect", str(run / "step_1"), "--json").stdout)["format"] == "sharded"


def test_no_torch_import(fixtures_dir, tmp_path):
    """The whole path reads headers and listings: torch is never imported."""
    run = _run_of(fixtures_dir, tmp_path / "run", step_1="llama_sharded_ws2", step_2="llama_dcp",
                  step_3="llama_hf_sharded", step_4="llama_accelerate")
    code = ("import sys, ckpt_tools; from ckpt_tools.commands.latest import run_listing; "
            f"info = run_listing({str(run)!r}); assert all(c['complete'] for c in info['checkpoints']), info; "
            "print(info['latest'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(run / "step_4"), "False"]


def test_plain_run_beside_other_files(fixtures_dir, tmp_path):
    """A run directory holding a torch file of its own (arguments, a final export) still lists its
    numbered checkpoints; the numbered parts of an accelerate save are never steps."""
    run = _run_of(fixtures_dir, tmp_path / "run", step_1="llama_dcp", step_2="llama_accelerate")
    shutil.copy(fixtures_dir / "llama_torch_training.pt", run / "args.pt")
    assert ckpt_tools.latest(run) == str(run / "step_2")
    assert [c["step"] for c in json.loads(_cli("latest", str(run), "--json").stdout)["checkpoints"]] == [2, 1]
