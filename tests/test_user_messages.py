"""What a user reads: ``inspect`` reads an optimizer's ``step`` from its bytes (no torch),
``--quiet`` hides progress bars only (``warning:`` and ``note:`` lines still print), and a
damaged file gets one ``error:`` line naming it, what is wrong and what to do.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckpt_tools
from ckpt_tools.cli.main import main as cli
from ckpt_tools.core.dtypes import DType
from ckpt_tools.engine.reader import Reader
from ckpt_tools.formats import describe

FIX = Path(__file__).resolve().parents[1] / "fixtures"


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _errors(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.lstrip().startswith("error")]


# -- inspect: the step without torch ---------------------------------------------------------

# the program ends with os._exit once its command is done (no atexit): the check runs there
_RUN_CLI = ("import os, runpy, sys; _exit = os._exit; "
            "os._exit = lambda code: (print('TORCH', 'torch' in sys.modules, file=sys.stderr), sys.stderr.flush(), "
            "_exit(code)); "
            "sys.argv = ['ckpt', 'inspect', sys.argv[1], '--json']; "
            "runpy.run_module('ckpt_tools', run_name='__main__')")


@pytest.mark.parametrize("source", ["llama_dcp", "llama_accelerate", "llama_sharded_ws2", "shard-dcp"])
def test_inspect_reads_the_step_without_torch(tmp_path, source):
    """`ckpt inspect --json` of a checkpoint with optimizer state, in a fresh process: torch is
    never imported, and the step is the value torch reads."""
    if source == "shard-dcp":  # a DCP saved by torch's own dcp.save (step 0, int-free float32)
        src = tmp_path / "dcp"
        r = _cli("shard", FIX / "llama_hf", src, "--ranks", "2", "--format", "dcp", "--with-optimizer", "adamw",
                 "--quiet")
        assert r.exit_code == 0, r.output
    else:
        src = FIX / source
    out = subprocess.run([sys.executable, "-c", _RUN_CLI, str(src)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "TORCH False" in out.stderr, out.stderr
    got = json.loads(out.stdout)["optimizer"]["step"]
    ckpt = describe(src)
    step = next(t for t in ckpt.group("optimizer") if t.state == "step")
    with Reader(ckpt) as r:
        want = r.full(step).item()  # torch's reading of the same bytes
    assert got == want and type(got) is type(want), (got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
                                   torch.int32, torch.uint8, torch.bool])
def test_scalar_from_bytes_is_item(dtype):
    from ckpt_tools.core.dtypes import scalar_from_bytes

    value = torch.tensor(True if dtype == torch.bool else 1234.5 if dtype.is_floating_point else 200, dtype=dtype)
    data = value.reshape(1).view(torch.uint8).numpy().tobytes()
    assert scalar_from_bytes(data, DType.of(dtype)) == value.item()
    assert scalar_from_bytes(data + b"\0", DType.of(dtype)) is None


# -- --quiet hides bars, not warnings or notes -----------------------------------------------

@pytest.mark.parametrize("args, said", [
    (["export", FIX / "llama_sharded_ws2", "{out}"], "note: the export holds the model only; left out optimizer"),
    (["convert", FIX / "llama_dcp", "{out}", "--to", "sharded"], "note: the rank files' device mesh is unnamed"),
    (["reshard", FIX / "llama_sharded_ws2", "{out}", "--to", "3"], "warning: extra state rng differs between ranks"),
    (["convert", FIX / "llama_dcp", "{out}", "--to", "hf"], "note: no config.json or tokenizer found"),
], ids=["export-note", "convert-note", "reshard-warning", "convert-hf-note"])
def test_quiet_keeps_warnings_and_notes(tmp_path, args, said):
    args = [str(a).replace("{out}", str(tmp_path / "out")) for a in args]
    loud = subprocess.run([sys.executable, "-m", "ckpt_tools", *args], capture_output=True, text=True, timeout=120)
    shutil.rmtree(tmp_path / "out")
    quiet = subprocess.run([sys.executable, "-m", "ckpt_tools", *args, "--quiet"], capture_output=True, text=True,
                           timeout=120)
    assert loud.returncode == quiet.returncode == 0, (loud.stderr, quiet.stderr)
    assert said in loud.stderr and said in quiet.stderr, quiet.stderr
    assert "wrote" in loud.stderr and "wrote" not in quiet.stderr  # the progress lines are what --quiet hides
    kept = [ln for ln in loud.stderr.splitlines() if ln.startswith(("warning:", "note:"))]
    assert [ln for ln in quiet.stderr.splitlines() if ln.startswith(("warning:", "note:"))] == kept
    if "export" in args:
        _, info = __import__("transformers").AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                                               output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


# -- damaged files ---------------------------------------------------------------------------

def _truncate(path: Path, keep: int) -> int:
    size = path.stat().st_size
    os.truncate(path, keep)
    return size


def test_truncated_safetensors_says_truncated_and_what_it_needs(tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(FIX / "llama_hf", src)
    full = _truncate(src / "model.safetensors", (src / "model.safetensors").stat().st_size - 1000)
    said = (f"{src / 'model.safetensors'}: truncated: {full - 1000:,} bytes on disk, "
            f"but its header needs {full:,} (1,000 missing); copy the file again")
    for args in (["inspect", src], ["export", src, tmp_path / "out"]):
        r = _cli(*args)
        assert r.exit_code == 3, r.output
        (line,) = _errors(r.output)
        assert line.startswith(f"error: {said}"), line
        assert "outside the" not in line
    _verify_finds(src, said)


def _verify_finds(src: Path, said: str) -> None:
    """verify reports a damaged file as a finding: FAILED, exit 1 (CONTRACT.md), naming it."""
    r = _cli("verify", src)
    assert r.exit_code == 1, r.output
    assert r.stdout.splitlines()[0] == f"{src} (unreadable): FAILED, 0 tensors read", r.output
    assert f"problem: {src}: cannot be read: {said}" in r.output, r.output


@pytest.mark.parametrize("cut", [1, 21, 5000, "half"])
def test_truncated_rank_file_is_one_clear_line(tmp_path, cut):
    src = tmp_path / "sh"
    shutil.copytree(FIX / "llama_sharded_ws2", src)
    f = src / "optim_world_size_2_rank_1.pt"
    size = f.stat().st_size
    _truncate(f, size // 2 if cut == "half" else size - cut)
    for args in (["inspect", src], ["reshard", src, tmp_path / "out", "--to", "3"]):
        r = _cli(*args)
        assert r.exit_code == 3, r.output
        (line,) = _errors(r.output)
        assert line.startswith(f"error: {f}: truncated: ") and line.endswith("copy the file again"), line
        assert "miniz" not in line and "None" not in line and "Errno" not in line, line
        assert not (tmp_path / "out").exists()
    _verify_finds(src, f"{f}: truncated: ")


def test_dcp_missing_a_data_file_is_one_clear_line(tmp_path):
    src = tmp_path / "dcp"
    shutil.copytree(FIX / "llama_dcp", src)
    (src / "__1_0.distcp").unlink()
    for args in (["inspect", src], ["export", src, tmp_path / "out", "--base", FIX / "llama_hf"],
                 ["reshard", src, tmp_path / "out", "--to", "3"]):
        r = _cli(*args)
        assert r.exit_code == 3, r.output
        (line,) = _errors(r.output)
        assert line.startswith(f"error: {src / '__1_0.distcp'}: missing; .metadata lists 2 data files"), line
        assert not (tmp_path / "out").exists()
    _verify_finds(src, f"{src / '__1_0.distcp'}: missing; .metadata lists 2 data files")


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_truncated_dcp_file_is_one_clear_line(tmp_path, name):
    src = tmp_path / "dcp"
    shutil.copytree(FIX / "llama_dcp", src)
    _truncate(src / name, (src / name).stat().st_size // 2)
    r = _cli("inspect", src)
    assert r.exit_code == 3, r.output
    (line,) = _errors(r.output)
    assert line.startswith(f"error: {src / name}: ") and "truncated" in line and "copy" in line, line


@pytest.mark.parametrize("damage", ["truncated-rank-file", "missing-distcp", "truncated-safetensors"])
def test_verify_of_a_damaged_copy_names_the_file(tmp_path, damage):
    """A copy ckpt wrote (with its manifest), then damaged: verify says FAILED (exit 1) naming
    the file and what is wrong, never a format of None or torch's own text."""
    out = tmp_path / "copy"
    if damage == "truncated-rank-file":
        ckpt_tools.reshard(FIX / "llama_sharded_ws2", out, to=2, progress=False)
        f = out / "model_world_size_2_rank_1.pt"
        _truncate(f, f.stat().st_size // 2)
    elif damage == "missing-distcp":
        ckpt_tools.reshard(FIX / "llama_dcp", out, to=2, progress=False)
        f = out / "__1_0.distcp"
        f.unlink()
    else:
        ckpt_tools.convert(FIX / "llama_dcp", out, to="hf", progress=False)
        f = out / "model.safetensors"
        _truncate(f, f.stat().st_size // 2)
    r = _cli("verify", out)
    assert r.exit_code == 1, r.output
    head = r.stdout.splitlines()[0]
    assert head == f"{out} (unreadable): FAILED, 0 tensors read", r.output
    assert "None" not in r.output and "miniz" not in r.output and "Errno" not in r.output, r.output
    assert f"problem: {f}: " in r.output
