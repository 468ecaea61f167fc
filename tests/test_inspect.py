"""`ckpt inspect` through the CLI: JSON numbers overall and per group, tensor names, the summary.

Expected numbers come from test_readers' reference (safetensors, torch.load, dcp_to_torch_save and
the tensors the tests saved), never from ckpt_tools.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckpt_tools
from ckpt_tools.cli.main import main
from test_readers import ALL_CASES, FIXTURE_CASES, REFERENCE_BIN, get_case, load  # the reference side

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def case(request, tmp_path_factory):
    return get_case(request.param, tmp_path_factory)


def invoke(*args) -> object:
    result = CliRunner().invoke(main, ["inspect", *map(str, args)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def inspect_json(*args) -> dict:
    return json.loads(invoke(*args, "--json").stdout)


def dtype_name(v) -> str:
    return str(v.dtype).removeprefix("torch.")


def expected_groups(case) -> dict[str, dict[str, int]]:
    groups: dict[str, dict[str, int]] = {}
    for (group, _), v in case.expected.items():
        g = groups.setdefault(group, {"num_tensors": 0, "total_bytes": 0})
        g["num_tensors"] += 1
        g["total_bytes"] += v.numel() * v.element_size()
    return groups


@pytest.mark.parametrize("case", ALL_CASES, indirect=True)
def test_json_numbers(case):
    info = inspect_json(case.path)
    want_groups = expected_groups(case)
    assert info["format"] == case.format
    assert info["world_size"] == case.world_size
    assert info["num_tensors"] == len(case.expected)
    assert info["total_bytes"] == sum(v.numel() * v.element_size() for v in case.expected.values())
    assert info["dtypes"] == dict(Counter(dtype_name(v) for v in case.expected.values()))
    for name, want in want_groups.items():
        got = info["groups"][name]
        assert (got["num_tensors"], got["total_bytes"]) == (want["num_tensors"], want["total_bytes"]), name
    # a group the reference has no tensors in (extra state: schedulers, RNG) reports none
    assert all(g["num_tensors"] == 0 and g["total_bytes"] == 0
               for name, g in info["groups"].items() if name not in want_groups)


@pytest.mark.parametrize("case", ALL_CASES, indirect=True)
def test_json_tensors_are_state_dict_names(case):
    info = inspect_json(case.path, "--tensors")
    got = {(t["group"], t["name"]): (tuple(t["shape"]), t["dtype"]) for t in info["tensors"]}
    assert len(got) == len(info["tensors"])
    assert got == {k: (tuple(v.shape), dtype_name(v)) for k, v in case.expected.items()}


LLAMA_FIXTURES = [n for n in FIXTURE_CASES if "tied" not in n]


@pytest.mark.parametrize("case", LLAMA_FIXTURES, indirect=True)
def test_model_names_spelled_like_the_state_dict(case):
    """DCP's `model.` prefix, verl's rank files, HF shards: all list pytorch_model.bin's keys."""
    info = inspect_json(case.path, "--tensors")
    names = [t["name"] for t in info["tensors"] if t["group"] == "model"]
    assert set(names) == set(load(REFERENCE_BIN))
    assert "model.layers.0.self_attn.q_proj.weight" in names


@pytest.mark.parametrize("case", ALL_CASES, indirect=True)
def test_human_summary(case):
    out = invoke(case.path).stdout
    assert re.search(rf"\b{case.format}\b", out)
    if case.world_size is not None:
        assert re.search(rf"world size\D{{0,4}}{case.world_size}\b", out), out
    if case.step is not None:
        assert re.search(rf"\bstep\D{{0,4}}{case.step:g}\b", out), out


@pytest.mark.parametrize("case", ["llama_hf", "llama_sharded_ws2"], indirect=True)
def test_human_summary_with_tensors(case):
    out = invoke(case.path, "--tensors").stdout
    assert all(name in out for _, name in case.expected)


@pytest.mark.parametrize("case", ["llama_sharded_ws2", "llama_dcp", "llama_hf_sharded", "llama_torch_training.pt"],
                         indirect=True)
def test_python_api_matches_cli(case):
    api = ckpt_tools.inspect(case.path, tensors=True)
    assert json.loads(json.dumps(api, default=str)) == inspect_json(case.path, "--tensors")


def test_save_pretrained_directory(tmp_path, tiny_llama):
    """A real HF model directory, saved in the test, sharded by save_pretrained."""
    from safetensors import safe_open

    model = tiny_llama()
    model.save_pretrained(tmp_path / "m", max_shard_size="50KB")
    files = sorted((tmp_path / "m").glob("*.safetensors"))
    assert len(files) >= 2
    want = {}
    for f in files:
        with safe_open(f, "pt") as st:
            for k in st.keys():
                s = st.get_slice(k)
                want[k] = (s.get_shape(), s.get_dtype())
    info = inspect_json(tmp_path / "m", "--tensors")
    sd = model.state_dict()
    assert (info["format"], info["world_size"], info["num_tensors"]) == ("hf", None, 21)
    assert info["total_bytes"] == sum(v.numel() * v.element_size() for v in sd.values())
    assert info["groups"]["model"]["total_bytes"] == info["total_bytes"]
    assert {t["name"] for t in info["tensors"]} == set(want) == set(sd)
    assert all(t["shape"] == list(sd[t["name"]].shape) for t in info["tensors"])


def test_single_file_paths(fixtures_dir):
    assert inspect_json(fixtures_dir / "llama_hf" / "model.safetensors")["num_tensors"] == 21
    assert inspect_json(fixtures_dir / "llama_torch" / "pytorch_model.bin")["format"] == "torch"


def test_optimizer_step_and_params_in_json(fixtures_dir):
    info = inspect_json(fixtures_dir / "llama_tied_sharded_ws2")
    assert info["optimizer"]["step"] == 3
    assert info["optimizer"]["params"] == 20


def test_python_m_ckpt_tools(fixtures_dir):
    """The real entry point, in its own process (one spawn: ~3 s)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "ckpt_tools", "inspect", "--json", str(fixtures_dir / "llama_hf")],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert (info["format"], info["num_tensors"], info["total_bytes"]) == ("hf", 21, 25056 * 2)
