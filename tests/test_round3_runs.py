"""Round 3 from real use (issue 31): what a saved state holds decides what it is.

- a tensor saved beside a nested model (``torch.get_rng_state()``) is the job's state, not a weight;
- rank files the user named (``model_rank{r}.pt``) are a per-rank set, known by their DTensors;
- one rank file of a set is refused as a whole checkpoint; a run directory stays a run beside a stray file;
- ``--overwrite`` replaces only a checkpoint;
- ``convert --to dcp --keys`` names the top-level keys a loader expects.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from dist import run_ranks
from fw_common import tiny_model

import ckpt_tools
from ckpt_tools.cli.main import main as cli

pytestmark = pytest.mark.filterwarnings("ignore")


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("base") / "base"
    tiny_model(0).save_pretrained(out)
    return out


def test_rng_beside_nested_model_is_not_a_weight(tmp_path, base):
    """``dcp.save({"model": sd, "rng": torch.get_rng_state()})``: rng is extra state, left out of
    the export, which from_pretrained loads with no unexpected key."""
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaForCausalLM

    sd = tiny_model(0).state_dict()
    dcp.save({"model": sd, "rng": torch.get_rng_state()}, checkpoint_id=str(tmp_path / "dcp"))
    info = ckpt_tools.inspect(tmp_path / "dcp")
    assert info["groups"]["model"]["num_tensors"] == len(sd)
    assert info["groups"]["extra"]["num_tensors"] == 1
    result = _cli("export", tmp_path / "dcp", tmp_path / "hf", "--base", base, "--quiet")
    assert result.exit_code == 0, result.output
    _, loading = LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not loading["unexpected_keys"] and not loading["missing_keys"], loading


def test_overwrite_replaces_only_a_checkpoint(tmp_path, fixtures_dir):
    """A DST holding the user's notes beside another model is refused (exit 4, named, untouched);
    an earlier ckpt output and a model saved by save_pretrained are replaced."""
    import shutil

    src = fixtures_dir / "llama_dcp"
    dst = tmp_path / "dst"
    shutil.copytree(fixtures_dir / "llama_hf", dst / "other_model")
    (dst / "notes.txt").write_text("keep me")
    result = _cli("convert", src, dst, "--to", "hf", "--overwrite")
    assert result.exit_code == 4, result.output
    assert result.stderr.startswith("error: ") and "notes.txt" in result.stderr
    assert (dst / "notes.txt").read_text() == "keep me" and (dst / "other_model" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # no staging left behind

    for earlier in (tmp_path / "ours", tmp_path / "hub"):
        if earlier.name == "ours":
            assert _cli("convert", src, earlier, "--to", "torch", "--quiet").exit_code == 0
        else:
            tiny_model(1).save_pretrained(earlier)
        result = _cli("convert", src, earlier, "--to", "hf", "--overwrite", "--quiet")
        assert result.exit_code == 0, result.output
        assert (earlier / "model.safetensors").is_file()


def _rank_saves(rank: int, world_size: int, out: str) -> None:
    """One step of the tiny Llama under ``fully_shard`` on 2 ranks, saved as users save it:
    rank files in verl's names and in their own (the seed's ``model_rank{r}.pt``), a DCP in a
    run's step folder; rank 0 also the full state dict."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    model = tiny_model(0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(12).reshape(2, 6) % 101
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    for d in ("verl_named", "user_named"):
        os.makedirs(os.path.join(out, d), exist_ok=True)
    torch.save(model.state_dict(), os.path.join(out, "verl_named", f"model_world_size_{world_size}_rank_{rank}.pt"))
    torch.save(opt.state_dict(), os.path.join(out, "verl_named", f"optim_world_size_{world_size}_rank_{rank}.pt"))
    torch.save(model.state_dict(), os.path.join(out, "user_named", f"model_rank{rank}.pt"))
    torch.save(opt.state_dict(), os.path.join(out, "user_named", f"optim_rank{rank}.pt"))
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=os.path.join(out, "run", "step_1"))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    full_optim = _full_optim(model, opt)
    if rank == 0:
        torch.save(full, os.path.join(out, "full.pt"))
        torch.save(full_optim, os.path.join(out, "full_optim.pt"))


def _full_optim(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _load_with_keys(rank: int, world_size: int, src: str, out: str) -> None:
    """A 2-rank job whose loader names the optimizer ``optim`` (PyTorch's DCP tutorial):
    ``dcp.load({"model", "optim"})`` then ``set_state_dict``; rank 0 writes what it then holds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                         set_state_dict)
    from torch.distributed.fsdp import fully_shard

    model = tiny_model(5)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(12).reshape(2, 6) % 101
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # the optimizer's state exists, so every entry is loaded over
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=src)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    full_optim = _full_optim(model, opt)
    if rank == 0:
        torch.save({"model": full, "optim": full_optim}, out)


@pytest.fixture(scope="module")
def rank_saves(tmp_path_factory):
    out = tmp_path_factory.mktemp("rank_saves")
    run_ranks(_rank_saves, 2, out, str(out))
    return out


@pytest.mark.parametrize("args", [["inspect"], ["reshard", "{dst}", "--to", "1"], ["export", "{dst}"]])
@pytest.mark.parametrize("name", ["verl_named/model_world_size_2_rank_0.pt", "user_named/model_rank1.pt"])
def test_one_rank_file_is_not_a_checkpoint(rank_saves, tmp_path, base, args, name):
    src = rank_saves / name
    result = _cli(args[0], src, *[a.format(dst=tmp_path / "out") for a in args[1:]],
                  *(["--base", base] if args[0] == "export" else []))
    assert result.exit_code == 3, result.output
    which = "rank 0 of a 2-rank save" if "world_size" in name else "one rank's part of a sharded save"
    assert which in result.stderr and f"({src.parent})" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_user_named_rank_files(rank_saves, tmp_path):
    """``model_rank{r}.pt`` + ``optim_rank{r}.pt``: a 2-rank set (plain layout), model and
    optimizer read; converted to one torch file it is the job's full state dict."""
    src = rank_saves / "user_named"
    info = ckpt_tools.inspect(src)
    assert (info["format"], info["layout"], info["world_size"]) == ("sharded", "plain", 2)
    assert info["side_files"] == []
    full = torch.load(rank_saves / "full.pt", weights_only=True)
    assert info["groups"]["model"]["num_tensors"] == len(full)
    assert info["groups"]["optimizer"]["num_tensors"] == 3 * len(full)
    result = _cli("convert", src, tmp_path / "out.pt", "--to", "torch", "--quiet")
    assert result.exit_code == 0, result.output
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    got = got.get("model", got)
    assert sorted(got) == sorted(full) and all(torch.equal(got[k], full[k]) for k in full)


def test_run_dir_with_a_stray_file_is_a_run(rank_saves, tmp_path, base):
    """A run directory holding a stray ``.pt`` beside its step folder is listed as a run; export
    of it is refused (exit 3) naming ``ckpt latest``."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(rank_saves / "run", run)
    shutil.copy(rank_saves / "full.pt", run / "stray.pt")
    info = json.loads(_cli("inspect", run, "--json").stdout)
    assert [c["path"] for c in info["checkpoints"]] == [str(run / "step_1")]
    result = _cli("export", run, tmp_path / "out", "--base", base)
    assert result.exit_code == 3, result.output
    assert "a run directory" in result.stderr and f"ckpt latest {run}" in result.stderr
    assert not (tmp_path / "out").exists()


def test_rank_files_to_dcp_with_the_loaders_keys(rank_saves, tmp_path):
    """``convert --to dcp --keys optimizer=optim``: a job that loads ``{"model", "optim"}`` gets
    back exactly the saved model and optimizer (without --keys its dcp.load finds no ``optim``)."""
    dst = tmp_path / "dcp"
    result = _cli("convert", rank_saves / "verl_named", dst, "--to", "dcp", "--keys", "model=model,optimizer=optim",
                  "--quiet")
    assert result.exit_code == 0, result.output
    run_ranks(_load_with_keys, 2, tmp_path, str(dst), str(tmp_path / "loaded.pt"))
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    want = torch.load(rank_saves / "full.pt", weights_only=True)
    assert all(torch.equal(loaded["model"][k], v) for k, v in want.items())
    want_optim = torch.load(rank_saves / "full_optim.pt", weights_only=True)
    assert sorted(loaded["optim"]["state"]) == sorted(want_optim["state"])
    for fqn, states in want_optim["state"].items():
        for name, v in states.items():
            assert torch.equal(loaded["optim"]["state"][fqn][name], v), (fqn, name)
    bad = _cli("convert", rank_saves / "verl_named", tmp_path / "x", "--to", "dcp", "--keys", "optimizer")
    assert bad.exit_code == 2 and "--keys" in bad.output
