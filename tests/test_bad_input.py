"""Bad inputs: each is refused with exit code 3 and one `error: ` line, and no pickle payload runs.

Payloads are real: a class whose ``__reduce__`` returns ``(os.system, ("touch CANARY",))``;
test_payload_is_live shows that unpickling it the unsafe way does create the canary.
"""

from __future__ import annotations

import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckpt_tools
from ckpt_tools import formats
from ckpt_tools.cli.main import main
from ckpt_tools.errors import BadInput, UnsafeInput

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
ROOT = FIXTURES.parent


class Evil:
    """Unpickling this runs a shell command that creates ``canary``."""

    def __init__(self, canary: Path):
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.canary))}",))


@dataclass
class Bad:
    path: Path
    mention: str  # the error line must name this (the file at fault)
    unsafe: bool = False


def _copy(name: str, tmp: Path) -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp / name))


def _truncate(file: Path, keep: int) -> None:
    os.truncate(file, keep if keep >= 0 else file.stat().st_size + keep)


def _load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=True)


# -- the cases: each builds one bad input under tmp and says what the error must name -----------

def missing_path(tmp, canary):
    return Bad(tmp / "no_such_checkpoint", "no_such_checkpoint")


def empty_dir(tmp, canary):
    (tmp / "empty").mkdir()
    return Bad(tmp / "empty", "empty")


def unrelated_files(tmp, canary):
    d = tmp / "photos"
    d.mkdir()
    (d / "README.md").write_text("# holiday\n")
    (d / "data.csv").write_text("a,b\n1,2\n")
    (d / "cat.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    return Bad(d, "photos")


def hf_index_names_missing_shard(tmp, canary):
    d = _copy("llama_hf_sharded", tmp)
    (d / "model-00002-of-00003.safetensors").unlink()
    return Bad(d, "model-00002-of-00003.safetensors")


def bin_index_names_missing_shard(tmp, canary):
    sd = _load(FIXTURES / "llama_torch" / "pytorch_model.bin")
    d = tmp / "bin_shards"
    d.mkdir()
    keys = list(sd)
    split = {"pytorch_model-00001-of-00002.bin": keys[:10], "pytorch_model-00002-of-00002.bin": keys[10:]}
    torch.save({k: sd[k] for k in keys[:10]}, d / "pytorch_model-00001-of-00002.bin")
    index = {"metadata": {"total_size": 100224}, "weight_map": {k: f for f, ks in split.items() for k in ks}}
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return Bad(d, "pytorch_model-00002-of-00002.bin")


def missing_model_rank_file(tmp, canary):
    d = _copy("llama_sharded_ws2", tmp)
    (d / "model_world_size_2_rank_1.pt").unlink()
    return Bad(d, "model_world_size_2_rank_1.pt")


def missing_optim_rank_file(tmp, canary):
    d = _copy("llama_sharded_ws8", tmp)
    (d / "optim_world_size_8_rank_5.pt").unlink()
    return Bad(d, "optim_world_size_8_rank_")


def config_world_size_disagrees(tmp, canary):
    d = _copy("llama_sharded_ws2", tmp)
    (d / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    return Bad(d, "fsdp_config.json")


def names_say_1_but_mesh_says_2(tmp, canary):
    d = _copy("llama_sharded_ws2", tmp)
    for kind in ("model", "optim", "extra_state"):
        (d / f"{kind}_world_size_2_rank_1.pt").unlink()
        (d / f"{kind}_world_size_2_rank_0.pt").rename(d / f"{kind}_world_size_1_rank_0.pt")
    (d / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    return Bad(d, "model_world_size_1_rank_0.pt")


def two_world_sizes_mixed(tmp, canary):
    d = _copy("llama_sharded_ws2", tmp)
    for f in (FIXTURES / "llama_sharded_ws8").glob("*_world_size_8_rank_*.pt"):
        shutil.copy(f, d / f.name)
    return Bad(d, "llama_sharded_ws2")


def rank_file_copied_from_another_rank(tmp, canary):
    d = _copy("llama_sharded_ws2", tmp)
    shutil.copy(d / "model_world_size_2_rank_0.pt", d / "model_world_size_2_rank_1.pt")
    return Bad(d, "model_world_size_2_rank_1.pt")


KEY = "model.lm_head.weight"


def _edit_dcp_metadata(tmp, edit) -> Path:
    d = _copy("llama_dcp", tmp)
    with open(d / ".metadata", "rb") as fh:
        meta = pickle.load(fh)  # the fixture, trusted
    edit(meta)
    (d / ".metadata").write_bytes(pickle.dumps(meta))
    return d


def dcp_metadata_hole(tmp, canary):
    return Bad(_edit_dcp_metadata(tmp, lambda meta: meta.state_dict_metadata[KEY].chunks.pop()), "lm_head.weight")


def dcp_metadata_overlap(tmp, canary):
    """The second chunk moved up one row (its bytes still found): rows overlap, the last row is a hole."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    def overlap(meta):
        chunks = meta.state_dict_metadata[KEY].chunks
        last = chunks[-1]
        moved = torch.Size([last.offsets[0] - 1, 0])
        chunks[-1] = type(last)(offsets=moved, sizes=last.sizes)
        meta.storage_data[MetadataIndex(KEY, moved)] = meta.storage_data.pop(MetadataIndex(KEY, last.offsets))

    return Bad(_edit_dcp_metadata(tmp, overlap), "lm_head.weight")


def dcp_metadata_chunk_named_twice(tmp, canary):
    """A chunk listed twice (its storage entry once): each chunk's entry is taken as it is
    described, so the second finds none; refused, never read as two copies of one place."""

    def twice(meta):
        chunks = meta.state_dict_metadata[KEY].chunks
        chunks[-1] = chunks[0]

    return Bad(_edit_dcp_metadata(tmp, twice), "lm_head.weight")


def index_names_file_outside_dir(tmp, canary):
    d = _copy("llama_hf_sharded", tmp)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "../model-00003-of-00003.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(d / "model-00003-of-00003.safetensors", tmp / "model-00003-of-00003.safetensors")
    return Bad(d, "../model-00003-of-00003.safetensors")


def truncated_safetensors(tmp, canary):
    d = _copy("llama_hf", tmp)
    _truncate(d / "model.safetensors", -1000)
    return Bad(d, "model.safetensors")


def truncated_safetensors_in_header(tmp, canary):
    f = tmp / "cut.safetensors"
    shutil.copy(FIXTURES / "llama_hf" / "model.safetensors", f)
    _truncate(f, 100)
    return Bad(f, "cut.safetensors")


def truncated_safetensors_shard(tmp, canary):
    d = _copy("llama_hf_sharded", tmp)
    _truncate(d / "model-00003-of-00003.safetensors", -4)
    return Bad(d, "model-00003-of-00003.safetensors")


def garbage_safetensors_header(tmp, canary):
    f = tmp / "garbage.safetensors"
    raw = bytearray((FIXTURES / "llama_hf" / "model.safetensors").read_bytes())
    raw[8:40] = b"{not json" + b" " * 23
    f.write_bytes(bytes(raw))
    return Bad(f, "garbage.safetensors")


def truncated_torch_bin(tmp, canary):
    d = _copy("llama_torch", tmp)
    _truncate(d / "pytorch_model.bin", -5000)
    return Bad(d, "pytorch_model.bin")


def truncated_rank_file(tmp, canary):
    d = _copy("llama_sharded_ws2", tmp)
    _truncate(d / "optim_world_size_2_rank_1.pt", -300)
    return Bad(d, "optim_world_size_2_rank_1.pt")


def random_bytes_pt(tmp, canary):
    f = tmp / "noise.pt"
    f.write_bytes(bytes(range(256)) * 8)
    return Bad(f, "noise.pt")


def torchscript_archive(tmp, canary):
    f = tmp / "scripted.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), f)
    return Bad(f, "scripted.pt", unsafe=True)


def distcp_file_instead_of_dir(tmp, canary):
    d = _copy("llama_dcp", tmp)
    return Bad(d / "__0_0.distcp", "__0_0.distcp")


def dcp_data_file_missing(tmp, canary):
    d = _copy("llama_dcp", tmp)
    (d / "__1_0.distcp").unlink()
    return Bad(d, "__1_0.distcp")


def dcp_garbage_metadata(tmp, canary):
    d = _copy("llama_dcp", tmp)
    (d / ".metadata").write_bytes(b"\x80\x04garbage" * 10)
    return Bad(d, ".metadata")


def truncated_distcp(tmp, canary):
    d = _copy("llama_dcp", tmp)
    _truncate(d / "__1_0.distcp", (d / "__1_0.distcp").stat().st_size // 2)
    return Bad(d, "__1_0.distcp")


# payloads in every file a reader unpickles

def payload_pt_zip(tmp, canary):
    f = tmp / "evil.pt"
    torch.save({"weight": torch.ones(2), "bias": Evil(canary)}, f)
    return Bad(f, "evil.pt", unsafe=True)


def payload_pt_legacy_format(tmp, canary):
    f = tmp / "evil_legacy.pt"
    torch.save({"weight": torch.ones(2), "bias": Evil(canary)}, f, _use_new_zipfile_serialization=False)
    return Bad(f, "evil_legacy.pt", unsafe=True)


def payload_plain_pickle_bin(tmp, canary):
    d = tmp / "hf_bin"
    d.mkdir()
    with open(d / "pytorch_model.bin", "wb") as fh:
        pickle.dump({"weight": Evil(canary)}, fh)
    return Bad(d, "pytorch_model.bin", unsafe=True)


def payload_in_training_dict_optimizer(tmp, canary):
    obj = _load(FIXTURES / "llama_torch_training.pt")
    obj["optimizer"]["state"]["lm_head.weight"]["exp_avg"] = Evil(canary)
    f = tmp / "training.pt"
    torch.save(obj, f)
    return Bad(f, "training.pt", unsafe=True)


def _rank_file_payload(tmp, canary, kind: str):
    d = _copy("llama_sharded_ws2", tmp)
    f = d / f"{kind}_world_size_2_rank_1.pt"
    obj = _load(f) if kind != "extra_state" else {}
    obj["injected"] = Evil(canary)
    torch.save(obj, f)
    return Bad(d, f.name, unsafe=True)


def payload_in_rank_model_file(tmp, canary):
    return _rank_file_payload(tmp, canary, "model")


def payload_in_rank_optim_file(tmp, canary):
    return _rank_file_payload(tmp, canary, "optim")


def payload_in_rank_extra_state_file(tmp, canary):
    return _rank_file_payload(tmp, canary, "extra_state")


def payload_dcp_metadata(tmp, canary):
    d = _copy("llama_dcp", tmp)
    (d / ".metadata").write_bytes(pickle.dumps(Evil(canary)))
    return Bad(d, ".metadata", unsafe=True)


def payload_deep_in_real_dcp_metadata(tmp, canary):
    """DCP's own classes first, so an allow-list must hold all the way down."""
    d = _copy("llama_dcp", tmp)
    with open(d / ".metadata", "rb") as fh:
        meta = pickle.load(fh)  # the fixture, trusted
    key = next(iter(meta.planner_data))
    meta.planner_data[key] = (Evil(canary),)
    (d / ".metadata").write_bytes(pickle.dumps(meta))
    return Bad(d, ".metadata", unsafe=True)


def payload_accelerate_optimizer_metadata(tmp, canary):
    d = _copy("llama_accelerate", tmp)
    (d / "optimizer_0" / ".metadata").write_bytes(pickle.dumps(Evil(canary), protocol=2))
    return Bad(d, ".metadata", unsafe=True)


CASES = [missing_path, empty_dir, unrelated_files, hf_index_names_missing_shard, bin_index_names_missing_shard,
         missing_model_rank_file, missing_optim_rank_file, config_world_size_disagrees, names_say_1_but_mesh_says_2,
         two_world_sizes_mixed, rank_file_copied_from_another_rank, dcp_metadata_hole, dcp_metadata_overlap,
         dcp_metadata_chunk_named_twice,
         index_names_file_outside_dir, truncated_safetensors, truncated_safetensors_in_header, truncated_safetensors_shard,
         garbage_safetensors_header, truncated_torch_bin, truncated_rank_file, random_bytes_pt, torchscript_archive,
         distcp_file_instead_of_dir, dcp_data_file_missing, dcp_garbage_metadata,
         payload_pt_zip, payload_pt_legacy_format, payload_plain_pickle_bin, payload_in_training_dict_optimizer,
         payload_in_rank_model_file, payload_in_rank_optim_file, payload_in_rank_extra_state_file,
         payload_dcp_metadata, payload_deep_in_real_dcp_metadata, payload_accelerate_optimizer_metadata]
PARAMS = [pytest.param(c, id=c.__name__) for c in CASES] + [
    pytest.param(truncated_distcp, id="truncated_distcp")]


@pytest.fixture
def canary(tmp_path) -> Path:
    return tmp_path / "CANARY"


@pytest.mark.parametrize("build", PARAMS)
def test_cli_exit_3_and_one_error_line(build, tmp_path, canary):
    bad = build(tmp_path, canary)
    result = CliRunner().invoke(main, ["inspect", str(bad.path)], catch_exceptions=False)
    assert not canary.exists(), "the pickle payload ran"
    assert result.exit_code == 3, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert bad.mention in lines[0]


@pytest.mark.parametrize("build", PARAMS)
def test_library_raises_bad_input(build, tmp_path, canary):
    bad = build(tmp_path, canary)
    with pytest.raises(UnsafeInput if bad.unsafe else BadInput):
        ckpt_tools.inspect(bad.path)
    assert not canary.exists(), "the pickle payload ran"


@pytest.mark.parametrize("build", [payload_pt_zip, payload_deep_in_real_dcp_metadata, payload_in_rank_model_file],
                         ids=lambda b: b.__name__)
def test_payload_is_live(build, tmp_path, canary):
    """The canary is reachable: loading the same bytes the unsafe way does run the payload."""
    bad = build(tmp_path, canary)
    file = bad.path if bad.path.is_file() else next(bad.path.rglob(bad.mention))
    if file.suffix == ".pt":
        torch.load(file, weights_only=False)
    else:
        pickle.loads(file.read_bytes())
    assert canary.exists()


def test_unsafe_error_names_the_global_and_does_not_advise_weights_only_false(tmp_path, canary):
    bad = payload_pt_zip(tmp_path, canary)
    result = CliRunner().invoke(main, ["inspect", str(bad.path)], catch_exceptions=False)
    assert result.exit_code == 3
    assert "system" in result.stderr  # posix.system / os.system: what was refused
    assert "weights_only` set to `False`" not in result.stderr


def test_payload_in_dcp_bytes_item_is_refused_by_reader(tmp_path, canary):
    """A DCP object entry (a torch.save blob inside a .distcp) is loaded weights_only too."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.ones(3)}, "note": Evil(canary)}, checkpoint_id=str(tmp_path / "d"),
                 no_dist=True)
    assert not canary.exists()
    # refused while describing (every object item is loaded weights_only then), not only on read
    with pytest.raises(UnsafeInput):
        formats.describe(tmp_path / "d")
    assert not canary.exists()


def test_real_process_prints_one_line(tmp_path, canary):
    """Outside CliRunner (and pytest's warning capture): no stray warning or log line on stderr."""
    bad = payload_in_rank_model_file(tmp_path, canary)
    proc = subprocess.run([sys.executable, "-m", "ckpt_tools", "inspect", str(bad.path)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert not canary.exists()
    assert proc.returncode == 3
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr


def test_debug_shows_traceback(tmp_path):
    result = CliRunner().invoke(main, ["inspect", "--debug", str(tmp_path / "missing")], catch_exceptions=False)
    assert result.exit_code == 3
    assert "Traceback" in result.stderr and result.stderr.rstrip().splitlines()[-1].startswith("error: ")
