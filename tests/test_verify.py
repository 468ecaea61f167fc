"""``verify``: one checkpoint (manifest, coverage, every chunk readable) and two checkpoints
(same tensors, bit for bit or within a tolerance), on checkpoints the tool itself wrote."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ckpt_tools
from ckpt_tools.storage import manifest
from ckpt_tools.errors import BadInput, UsageError
from ckpt_tools.commands.verify import format_report, verify

SRC_NAME = "llama_sharded_ws2"
NUM_TENSORS = 84  # 21 model + 63 optimizer (exp_avg, exp_avg_sq, step per parameter)
NUM_MODEL = 21

# output name and convert options per format; sharded goes to a new world size on the way
OUTPUTS = {
    "sharded": ("sharded3", {"to": "sharded", "world_size": 3}),
    "dcp": ("dcp", {"to": "dcp"}),
    "hf": ("hf", {"to": "hf"}),
    "torch": ("full.pt", {"to": "torch"}),
    "hf-file": ("model.safetensors", {"to": "hf"}),
}
# every file that holds tensors or describes where they are, per output
DATA_FILES = {
    "sharded": [f"{k}_world_size_3_rank_{r}.pt" for k in ("model", "optim", "extra_state") for r in range(3)],
    "dcp": [".metadata", "__0_0.distcp", "__1_0.distcp"],
    "hf": ["model.safetensors"],
    "torch": [""],  # the output is the file itself
    "hf-file": [""],
}


@pytest.fixture(scope="module")
def src(fixtures_dir: Path) -> Path:
    return fixtures_dir / SRC_NAME


@pytest.fixture(scope="module")
def converted(src: Path, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("converted")
    paths = {}
    for fmt, (name, options) in OUTPUTS.items():
        paths[fmt] = out / name
        ckpt_tools.convert(src, paths[fmt], progress=False, **options)
    return paths


def _copy(path: Path, dst_dir: Path) -> Path:
    dst = dst_dir / path.name
    (shutil.copytree if path.is_dir() else shutil.copy2)(path, dst)
    return dst


def _flip_middle(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


# -- damage ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(DATA_FILES))
def test_data_file_lists_are_complete(fmt: str, converted: dict[str, Path]) -> None:
    """The flipped-byte cases below cover every data file the writers produce."""
    out = converted[fmt]
    if out.is_file():
        assert DATA_FILES[fmt] == [""]
        return
    listed = set(manifest.read(out)["files"])
    assets = {f for f in listed if f.endswith(".json") or f.startswith("huggingface/")}
    assert listed - assets == set(DATA_FILES[fmt])


@pytest.mark.parametrize("fmt, file", [(fmt, f) for fmt, files in DATA_FILES.items() for f in files],
                         ids=[f"{fmt}-{f or 'file'}" for fmt, files in DATA_FILES.items() for f in files])
def test_flipped_byte_is_caught(fmt: str, file: str, converted: dict[str, Path], src: Path, tmp_path: Path) -> None:
    out = _copy(converted[fmt], tmp_path)
    target = out / file if file else out
    _flip_middle(target)

    if out.is_dir():  # a manifest: the checksum names the file, whatever the byte broke
        alone = verify(out, progress=False)
        assert not alone["ok"]
        assert any("checksum mismatch" in p and str(target) in p for p in alone["problems"]), alone["problems"]
    else:  # a lone file carries its own checks: zip CRC32s (torch), a header checksum (safetensors)
        try:
            alone = verify(out, progress=False)
        except BadInput:
            pass  # the flip broke the structure itself: refused as corrupt
        else:
            assert not alone["ok"] and alone["problems"], alone

    against = verify(src, out, progress=False)  # and it never matches the source
    assert not against["ok"]
    assert against["problems"] or against["mismatches"]
    json.dumps(against)


def test_truncated_file_is_a_finding_with_a_manifest(converted: dict[str, Path], tmp_path: Path) -> None:
    out = _copy(converted["dcp"], tmp_path)
    data = out / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    report = verify(out, progress=False)
    assert not report["ok"]
    assert any("__1_0.distcp: size mismatch" in p for p in report["problems"]), report["problems"]


def test_truncated_file_without_manifest_is_bad_input(fixtures_dir: Path, tmp_path: Path) -> None:
    """A DCP written by torch (no manifest) whose data file lost its tail: nothing says what it
    should be, so it is a corrupt input (exit 3), named, like `inspect` would say."""
    out = _copy(fixtures_dir / "llama_dcp", tmp_path)
    data = out / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(BadInput, match=r"__1_0\.distcp.*truncated"):
        verify(out, progress=False)


def test_missing_and_resized_files_are_findings(converted: dict[str, Path], tmp_path: Path) -> None:
    out = _copy(converted["sharded"], tmp_path)
    (out / "huggingface" / "tokenizer.json").unlink()
    with open(out / "extra_state_world_size_3_rank_1.pt", "ab") as f:
        f.write(b"\0" * 10)
    report = verify(out, progress=False)
    assert not report["ok"]
    text = "\n".join(report["problems"])
    assert "tokenizer.json: missing" in text
    assert "extra_state_world_size_3_rank_1.pt: size mismatch" in text


def test_damage_that_breaks_describing_is_still_a_finding(converted: dict[str, Path], tmp_path: Path) -> None:
    """The manifest explains why the checkpoint cannot be read: exit 1 with the cause, not exit 3."""
    out = _copy(converted["dcp"], tmp_path)
    (out / ".metadata").write_bytes(b"garbage")
    report = verify(out, progress=False)
    assert not report["ok"] and report["checked"] == 0
    assert any(".metadata: size mismatch" in p for p in report["problems"])
    assert any("cannot be read" in p for p in report["problems"])


def test_a_damaged_file_without_manifest_is_a_finding_and_no_checkpoint_raises(tmp_path: Path) -> None:
    """A file of a known format that its bytes do not hold is what verify is for: a finding
    (exit 1), naming the file; a path that is no checkpoint at all is BadInput (exit 3)."""
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\xff" * 16)
    report = verify(bad, progress=False)
    assert not report["ok"] and any(str(bad) in p and "safetensors" in p for p in report["problems"]), report
    with pytest.raises(BadInput):
        verify(tmp_path / "nothing-here", progress=False)


# -- equal checkpoints ----------------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_converted_checkpoint_verifies_alone(fmt: str, converted: dict[str, Path]) -> None:
    report = verify(converted[fmt], nan_check=True, progress=False)
    assert report["ok"], format_report(report)
    assert report["checked"] == (NUM_MODEL if fmt.startswith("hf") else NUM_TENSORS)
    assert report["mismatches"] == [] and report["problems"] == []


@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_converted_equals_source(fmt: str, converted: dict[str, Path], src: Path) -> None:
    report = verify(src, converted[fmt], progress=False)
    assert report["ok"], format_report(report)
    assert report["checked"] == (NUM_MODEL if fmt.startswith("hf") else NUM_TENSORS)
    # and the other way round
    assert verify(converted[fmt], src, progress=False)["ok"]


@pytest.mark.parametrize("a, b", [("sharded", "dcp"), ("dcp", "torch"), ("torch", "hf"), ("sharded", "hf")])
def test_outputs_equal_each_other(a: str, b: str, converted: dict[str, Path]) -> None:
    report = verify(converted[a], converted[b], progress=False)
    assert report["ok"], format_report(report)
    assert report["checked"] == (NUM_MODEL if "hf" in (a, b) else NUM_TENSORS)


@pytest.mark.parametrize("source, to", [(SRC_NAME, 3), (SRC_NAME, 8), (SRC_NAME, 1), ("llama_dcp", 3)])
def test_resharded_equals_original(source: str, to: int, fixtures_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "resharded"
    ckpt_tools.reshard(fixtures_dir / source, out, to=to, progress=False)
    report = verify(fixtures_dir / source, out, progress=False)
    assert report["ok"], format_report(report)
    assert report["checked"] == NUM_TENSORS


@pytest.mark.parametrize("other, checked", [("llama_dcp", NUM_TENSORS), ("llama_accelerate", NUM_TENSORS),
                                            ("llama_torch_training.pt", NUM_TENSORS)])
def test_fixtures_of_one_job_agree(other: str, checked: int, fixtures_dir: Path, src: Path) -> None:
    """Files torch, accelerate and verl wrote themselves (no manifest) compare equal across layouts."""
    report = verify(src, fixtures_dir / other, progress=False)
    assert report["ok"], format_report(report)
    assert report["checked"] == checked


def test_tied_hf_export_compares_lm_head_with_embedding(fixtures_dir: Path) -> None:
    report = verify(fixtures_dir / "llama_tied_sharded_ws2", fixtures_dir / "llama_tied_hf", progress=False)
    assert report["ok"], format_report(report)
    assert report["checked"] == NUM_MODEL  # 20 parameters + lm_head, compared with the embedding


def test_blocks_across_uneven_chunks(converted: dict[str, Path], src: Path, monkeypatch) -> None:
    """Tiny blocks: every tensor is compared a few rows at a time across both sides' uneven
    shard boundaries (3 ranks vs 2), and one changed element is counted exactly once."""
    # the module, not the function ckpt_tools may export under the same name
    v = importlib.import_module("ckpt_tools.commands.compare")
    monkeypatch.setattr(v, "BLOCK_BYTES", 3 * 32 * 8)  # three rows of 32 float64
    report = verify(src, converted["sharded"], progress=False)
    assert report["ok"], format_report(report)
    assert report["checked"] == NUM_TENSORS


# -- differences ----------------------------------------------------------------------------

def _st(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file(tensors, str(path))
    return path


def test_one_changed_element_is_reported(tmp_path: Path) -> None:
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    changed = w.clone()
    changed[2, 1] += 0.5
    a = _st(tmp_path / "a.safetensors", {"w": w, "b": torch.ones(3)})
    b = _st(tmp_path / "b.safetensors", {"w": changed, "b": torch.ones(3)})
    report = verify(a, b, progress=False)
    assert not report["ok"]
    assert report["checked"] == 2 and report["mismatches"] == ["w"]
    assert "1 of 12 elements" in report["differences"][0]["reason"]
    assert not verify(a, b, atol=0.1, progress=False)["ok"]
    assert verify(a, b, atol=0.6, progress=False)["ok"]
    assert verify(a, b, rtol=0.1, progress=False)["ok"]  # 0.5 / 7


def test_names_on_one_side_shape_and_dtype_are_mismatches(tmp_path: Path) -> None:
    a = _st(tmp_path / "a.safetensors", {"same": torch.ones(2), "only_a": torch.ones(1),
                                         "shape": torch.ones(2, 3), "dtype": torch.ones(4)})
    b = _st(tmp_path / "b.safetensors", {"same": torch.ones(2), "only_b": torch.ones(1),
                                         "shape": torch.ones(3, 2), "dtype": torch.ones(4, dtype=torch.float16)})
    report = verify(a, b, progress=False)
    assert not report["ok"]
    assert report["only_in_a"] == ["only_a"] and report["only_in_b"] == ["only_b"]
    assert report["mismatches"] == ["dtype", "only_a", "only_b", "shape"]
    assert report["checked"] == 3
    reasons = {d["name"]: d["reason"] for d in report["differences"]}
    assert "shape" in reasons["shape"] and "dtype" in reasons["dtype"]


def test_bf16_cast_passes_with_tolerance_only(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "bf16.pt"
    ckpt_tools.convert(src, out, to="torch", dtype="bf16", progress=False)
    strict = verify(src, out, progress=False)
    assert not strict["ok"]
    assert any("dtype float32 vs bfloat16" in d["reason"] for d in strict["differences"])
    loose = verify(src, out, rtol=1e-2, progress=False)
    assert loose["ok"], format_report(loose)
    assert loose["checked"] == NUM_TENSORS
    assert not verify(src, out, atol=1e-9, progress=False)["ok"]  # bf16 rounding is bigger than that


def test_nan_check(tmp_path: Path) -> None:
    bad = torch.ones(5)
    bad[3] = float("nan")
    p = _st(tmp_path / "nan.safetensors", {"w": bad, "i": torch.arange(3), "inf": torch.tensor([float("inf")])})
    assert verify(p, progress=False)["ok"]
    report = verify(p, nan_check=True, progress=False)
    assert not report["ok"] and report["nonfinite"] == ["inf", "w"]
    # bit-identical NaNs are equal; nan_check still flags them
    q = _st(tmp_path / "copy.safetensors", {"w": bad, "i": torch.arange(3), "inf": torch.tensor([float("inf")])})
    assert verify(p, q, progress=False)["ok"]
    assert verify(p, q, nan_check=True, progress=False)["nonfinite"] == ["inf", "w"]


def test_bad_tolerance_is_a_usage_error(tmp_path: Path) -> None:
    p = _st(tmp_path / "a.safetensors", {"w": torch.ones(1)})
    with pytest.raises(UsageError):
        verify(p, p, atol=-1)
    with pytest.raises(UsageError):
        verify(p, p, rtol=float("nan"))


def test_progress_bar_only_on_a_terminal(src: Path, converted: dict[str, Path], capsys) -> None:
    """Into a pipe or a log (here: captured) no bar is drawn, with or without progress; bars on
    a terminal are tested in test_cli_output.py."""
    verify(src, converted["dcp"], progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "comparing" not in captured.err and "\r" not in captured.err
    verify(src, converted["dcp"], progress=False)
    assert capsys.readouterr().err == ""


def test_report_is_json_and_readable(converted: dict[str, Path], src: Path) -> None:
    report = verify(src, converted["hf"], progress=False)
    assert json.loads(json.dumps(report))["ok"] is True
    text = format_report(report)
    assert text.splitlines()[0].endswith(f"OK, {NUM_MODEL} tensors compared")


# -- CLI ------------------------------------------------------------------------------------

def _cli():
    from ckpt_tools.cli.main import main

    if "verify" not in main.commands:
        pytest.skip("`ckpt verify` is not wired into cli/main.py yet")
    from click.testing import CliRunner

    return main, CliRunner()


def test_cli_verify(converted: dict[str, Path], src: Path, tmp_path: Path) -> None:
    main, runner = _cli()
    ok = runner.invoke(main, ["verify", str(src), str(converted["dcp"]), "--json", "--quiet"], catch_exceptions=False)
    assert ok.exit_code == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["ok"] is True and report["checked"] == NUM_TENSORS and report["mismatches"] == []

    out = tmp_path / "bf16.pt"
    ckpt_tools.convert(src, out, to="torch", dtype="bf16", progress=False)
    differ = runner.invoke(main, ["verify", str(src), str(out), "--quiet"], catch_exceptions=False)
    assert differ.exit_code == 1
    assert "model.embed_tokens.weight" in differ.stdout  # names what differs
    close = runner.invoke(main, ["verify", str(src), str(out), "--rtol", "1e-2", "--quiet"], catch_exceptions=False)
    assert close.exit_code == 0, close.stdout

    damaged = _copy(converted["hf"], tmp_path)
    _flip_middle(damaged / "model.safetensors")
    alone = runner.invoke(main, ["verify", str(damaged), "--json", "--quiet"], catch_exceptions=False)
    assert alone.exit_code == 1 and json.loads(alone.stdout)["ok"] is False

    missing = runner.invoke(main, ["verify", str(tmp_path / "nope")], catch_exceptions=False)
    assert missing.exit_code == 3
    assert missing.stderr.startswith("error: ")


def test_untied_lm_head_missing_from_hf_is_compared_with_embedding(tmp_path: Path) -> None:
    embed = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    full = _st(tmp_path / "full.safetensors", {"model.embed_tokens.weight": embed, "lm_head.weight": embed + 1})
    tied = _st(tmp_path / "tied.safetensors", {"model.embed_tokens.weight": embed})
    report = verify(full, tied, progress=False)
    assert not report["ok"] and report["mismatches"] == ["lm_head.weight"]
    same = _st(tmp_path / "same.safetensors", {"model.embed_tokens.weight": embed, "lm_head.weight": embed.clone()})
    report = verify(tied, same, progress=False)
    assert report["ok"] and report["checked"] == 2
