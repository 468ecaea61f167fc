"""The command group as a user meets it: help, version, estimate, shard, verify exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckpt_tools.cli.main import main

COMMANDS = ["inspect", "convert", "export", "reshard", "shard", "verify", "estimate"]


def _run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_version() -> None:
    result = _run("--version")
    assert result.exit_code == 0 and "ckpt, version" in result.output


@pytest.mark.parametrize("cmd", COMMANDS)
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_every_command_has_help_quiet_and_debug(cmd: str, flag: str) -> None:
    result = _run(cmd, flag)
    assert result.exit_code == 0
    assert "--quiet" in result.output and "--debug" in result.output


def test_bad_flag_is_a_usage_error() -> None:
    assert _run("reshard", "a", "b", "--to", "0").exit_code == 2
    assert _run("convert", "a", "b", "--to", "onnx").exit_code == 2


def test_estimate_json(fixtures_dir: Path) -> None:
    result = _run("estimate", fixtures_dir / "llama_hf", "--ranks", "4", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    params = 25_056  # fixtures/README.md: the tiny Llama, untied
    assert report["params"] == params and report["ranks"] == 4
    assert report["ddp"]["per_rank_bytes"] == 16 * params
    assert report["fsdp"]["per_rank_bytes"] >= 16 * params // 4


def test_shard_command_writes_a_loadable_checkpoint(fixtures_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "sharded"
    result = _run("shard", fixtures_dir / "llama_hf_sharded", dst, "--ranks", "1", "--with-optimizer", "adamw",
                  "--check", "--quiet")
    assert result.exit_code == 0, result.output
    assert "largest difference from the unsharded model 0" in result.output
    sd = torch.load(dst / "model_world_size_1_rank_0.pt", weights_only=True)
    ref = torch.load(fixtures_dir / "llama_torch" / "pytorch_model.bin", weights_only=True)
    assert {k: v.full_tensor() for k, v in sd.items()}.keys() == ref.keys()
    assert all(torch.equal(sd[k].to_local(), ref[k]) for k in ref)
    assert json.loads((dst / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": 1}


def test_verify_exit_codes(fixtures_dir: Path, tmp_path: Path) -> None:
    same = _run("verify", fixtures_dir / "llama_sharded_ws2", fixtures_dir / "llama_dcp", "--json", "--quiet")
    assert same.exit_code == 0 and json.loads(same.output)["ok"]
    different = _run("verify", fixtures_dir / "llama_sharded_ws2", fixtures_dir / "llama_hf", "--quiet")
    assert different.exit_code == 1  # the hf fixture is bf16: not bit-equal
    within = _run("verify", fixtures_dir / "llama_sharded_ws2", fixtures_dir / "llama_hf", "--atol", "0.01", "--quiet")
    assert within.exit_code == 0, within.output
    missing = _run("verify", tmp_path / "nothing")
    assert missing.exit_code == 3 and missing.stderr.startswith("error: ")
