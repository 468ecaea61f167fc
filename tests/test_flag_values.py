"""Flag values a user types: sizes with any unit, torch's dtype names, formats in any case.
Each is taken (and does what it says on the files written) or is a usage error (exit 2) with
the fix; none is an internal error (exit 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from ckpt_tools.cli.main import main as cli
from ckpt_tools.commands.options import parse_size

FIX = Path(__file__).resolve().parents[1] / "fixtures"


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.parametrize("text, size", [
    ("2GiB", 2 * 2**30), ("500M", 500 * 10**6), ("500MB", 500 * 10**6), ("5GB", 5 * 10**9),
    ("2gb", 2 * 10**9), ("40KB", 40_000), ("40kib", 40 * 1024), ("1000000", 10**6), ("1.5KB", 1500),
    (" 3 MiB ", 3 * 2**20), (123, 123),
])
def test_sizes_are_read_as_hugging_face_reads_them(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["0", "0GB", "-5", "abc", "5 GBs", "GB", ""])
def test_sizes_that_allow_no_shard_are_usage_errors(tmp_path, text):
    r = _cli("convert", FIX / "llama_hf", tmp_path / "out", "--to", "hf", "--max-shard-size", text)
    assert r.exit_code == 2, r.output
    assert "--max-shard-size" in r.output and "internal error" not in r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, files", [("20000", 3), ("2GiB", 1), ("500M", 1)])
def test_a_size_in_bytes_or_binary_units_splits_the_export(tmp_path, text, files):
    """llama_hf's weights are 48.9 KiB in bfloat16: 20,000 bytes a shard gives 3 files."""
    r = _cli("export", FIX / "llama_hf", tmp_path / "out", "--max-shard-size", text)
    assert r.exit_code == 0, r.output
    shards = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(shards) == files, shards
    for name in shards:
        with safe_open(tmp_path / "out" / name, "pt") as f:
            assert sum(f.get_slice(k).get_shape()[0] for k in f.keys()) > 0


@pytest.mark.parametrize("args, dtype", [(["--dtype", "bfloat16"], "BF16"), (["--dtype", "FP16"], "F16"),
                                         (["--dtype", "float32", "--to", "HF"], "F32")])
def test_torch_dtype_names_and_any_case_are_taken(tmp_path, args, dtype):
    if "--to" not in args:
        args = [*args, "--to", "hf"]
    r = _cli("convert", FIX / "llama_sharded_ws2", tmp_path / "out", *args)
    assert r.exit_code == 0, r.output
    header = (tmp_path / "out" / "model.safetensors").read_bytes()
    n = int.from_bytes(header[:8], "little")
    dtypes = {v["dtype"] for k, v in json.loads(header[8:8 + n]).items() if k != "__metadata__"}
    assert dtypes == {dtype}


@pytest.mark.parametrize("flag, value, hint", [("--dtype", "bf61", "did you mean bf16?"),
                                               ("--dtype", "bfloat61", "did you mean bf16?"),
                                               ("--to", "hff", "did you mean hf?")])
def test_a_near_miss_is_a_usage_error_with_a_suggestion(tmp_path, flag, value, hint):
    args = ["--to", "hf"] if flag != "--to" else []
    r = _cli("convert", FIX / "llama_hf", tmp_path / "out", flag, value, *args)
    assert r.exit_code == 2, r.output
    assert hint in r.output, r.output


def test_one_rank_is_one_rank(tmp_path):
    r = _cli("convert", FIX / "llama_sharded_ws2", tmp_path / "out", "--to", "sharded", "--world-size", "1")
    assert r.exit_code == 0, r.output
    assert "1 rank," in r.output and "1 ranks" not in r.output, r.output


def test_shard_without_transformers_names_the_install(tmp_path):
    code = ("import sys; sys.modules['transformers'] = None; from ckpt_tools.cli.main import main; "
            f"main(['shard', {str(FIX / 'llama_hf')!r}, {str(tmp_path / 'out')!r}, '--ranks', '2'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 3, r.stderr
    assert "pip install 'ckpt-tools[hf]'" in r.stderr and "internal error" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_config_without_architectures_gets_the_checked_class(tmp_path):
    """``LlamaConfig(...).save_pretrained`` writes no ``architectures``; the export writes the
    class its names were checked against, as ``save_pretrained`` of the model would."""
    config = json.loads((FIX / "llama_hf" / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text(json.dumps(config))
    r = _cli("export", FIX / "llama_sharded_ws2", tmp_path / "out", "--base", tmp_path / "base")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert type(model).__name__ == "LlamaForCausalLM" and not any(info.values()), info
