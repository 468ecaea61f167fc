"""Layouts on the committed fixtures (fast; the real frameworks' saves are in test_frameworks.py)."""

from __future__ import annotations

import pytest

import ckpt_tools
from ckpt_tools.formats import describe
from ckpt_tools.layouts import carry_plan, layout_of


@pytest.mark.parametrize("name, layout, fsdp, side", [
    ("llama_sharded_ws2", "verl", 2, ["huggingface/config.json", "huggingface/generation_config.json",
                                      "huggingface/tokenizer.json", "huggingface/tokenizer_config.json"]),
    ("llama_accelerate", "accelerate", None, ["random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"]),
    ("llama_dcp", "plain", None, []),
    ("llama_hf_sharded", "plain", None, ["config.json", "generation_config.json", "tokenizer.json",
                                         "tokenizer_config.json"]),
    ("llama_torch", "plain", None, []),
])
def test_inspect_reports_layout(fixtures_dir, name, layout, fsdp, side):
    info = ckpt_tools.inspect(fixtures_dir / name)
    assert (info["layout"], info["fsdp_version"], info["side_files"]) == (layout, fsdp, side)


@pytest.mark.parametrize("to, policy, kept", [
    (2, "drop", ["random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"]),  # same world: all
    (1, "drop", ["scheduler.bin"]),
    (1, "keep-first", ["random_states_0.pkl", "scheduler.bin"]),
    (3, "keep-first", ["random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"]),
])
def test_rank_local_files_follow_policy(fixtures_dir, to, policy, kept):
    lay = layout_of(describe(fixtures_dir / "llama_accelerate"))
    warnings = []
    carry = carry_plan(lay, src_world=2, dst_world=to, policy=policy, warn=warnings.append)
    assert list(carry.files) == kept
    assert bool(warnings) == (to != 2)


def test_dcp_reshard_keeps_keys_and_entries(fixtures_dir, tmp_path):
    """A DCP → DCP reshard keeps every key and planner path; non-tensor items are the same bytes."""
    from torch.distributed.checkpoint import FileSystemReader

    src = fixtures_dir / "llama_dcp"
    ckpt_tools.reshard(src, tmp_path / "out", to=3, progress=False)
    a, b = FileSystemReader(str(src)).read_metadata(), FileSystemReader(str(tmp_path / "out")).read_metadata()
    assert a.planner_data == b.planner_data
    assert set(a.state_dict_metadata) == set(b.state_dict_metadata)

    def blob(root, meta, fqn):
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = meta.storage_data[MetadataIndex(fqn)]
        return (root / info.relative_path).read_bytes()[info.offset:info.offset + info.length]

    objects = [k for k, v in a.state_dict_metadata.items() if type(v).__name__ == "BytesStorageMetadata"]
    assert objects
    for fqn in objects:
        assert blob(src, a, fqn) == blob(tmp_path / "out", b, fqn), fqn


def test_sharded_reshard_keeps_fsdp_config_fields(fixtures_dir, tmp_path):
    import json
    import shutil

    src = tmp_path / "src"
    shutil.copytree(fixtures_dir / "llama_sharded_ws2", src)
    (src / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 2, "note": "kept"}))
    (src / "lora_train_meta.json").write_text('{"r": 4, "lora_alpha": 8}')
    ckpt_tools.reshard(src, tmp_path / "out", to=3, progress=False)
    assert json.loads((tmp_path / "out" / "fsdp_config.json").read_text()) == {
        "FSDP_version": 2, "world_size": 3, "note": "kept"}
    assert (tmp_path / "out" / "lora_train_meta.json").read_bytes() == (src / "lora_train_meta.json").read_bytes()


def test_torchtitan_reshard_warning_says_what_the_loader_needs(tmp_path):
    """Dropping torchtitan's ``dataloader.dp_rank_*`` entries is not enough to say: its loader
    then needs ``checkpoint.exclude_from_loading = ["dataloader"]``, and the warning says so.
    (The real torchtitan save and resume are in test_frameworks.py; this is the layout alone, on
    a DCP with torchtitan's top-level keys written by ``dcp.save`` in one process.)"""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from click.testing import CliRunner

    from ckpt_tools.cli.main import main

    src = tmp_path / "run" / "step-10"
    state = {"tok_embeddings.weight": torch.randn(8, 4), "train_state": {"step": 10},
             "dataloader": {"dp_rank_0": b"pos-0", "dp_rank_1": b"pos-1"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(src), no_dist=True)
    assert ckpt_tools.inspect(src)["layout"] == "torchtitan"
    result = CliRunner().invoke(main, ["reshard", str(src), str(tmp_path / "out" / "step-10"), "--to", "2", "--quiet"])
    assert result.exit_code == 0, result.output
    (line,) = [x for x in result.output.splitlines() if x.startswith("warning: rank-local entries dataloader.dp_rank_0")]
    assert 'checkpoint.exclude_from_loading = ["dataloader"]' in line, line
