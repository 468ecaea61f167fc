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
