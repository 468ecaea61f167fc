"""Megatron-Core ``torch_dist`` saves: the DCP they are, read with Megatron's extras.

A real Megatron-Core 0.16.1 save (``fw_megatron.job``: a tiny ``GPTModel`` and AdamW state,
``dist_checkpointing.save`` with the default ``torch_dist`` strategy, 2 CPU ranks) holds
``all_local_plans`` (``SavePlan``, ``WriteItem``, ...) in its ``.metadata``: read as inert
records. Checked against torch's own reader of the same save (``dcp_to_torch_save``, i.e.
``_load_state_dict(no_dist=True)``): ``inspect`` lists what it reads, ``convert --to dcp``
holds the same tensors and Megatron-Core's own ``dist_checkpointing.load`` loads it back;
``export`` of this model (Megatron's default GPT: LayerNorm, GELU, biases) is exit 3 naming what the
name map does not cover; the Llama-style export is tested in ``test_megatron_export.py``.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from dist import run_ranks

import fw_megatron
from ckpt_tools.cli.main import main as cli

pytest.importorskip("megatron.core", reason="the Megatron tests need megatron-core==0.16.1 (README, Install)")
pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def save(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    held = run_ranks(fw_megatron.job, 2, root, str(root / "save"))[0]
    return root / "save", held


def _ckpt(*args: str) -> str:
    result = CliRunner().invoke(cli, [*args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _torch_read(path, tmp_path, name: str) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(tmp_path / name))
    return torch.load(tmp_path / name, weights_only=True)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_source_holds_megatrons_save_plans(save):
    path, _ = save
    assert b"all_local_plans" in (path / ".metadata").read_bytes() and (path / "common.pt").is_file()


def test_inspect_lists_what_torch_reads(save, tmp_path):
    import torch

    path, _ = save
    info = json.loads(_ckpt("inspect", str(path), "--json", "--tensors"))
    assert (info["format"], info["layout"]) == ("dcp", "megatron")
    assert set(info["side_files"]) == {"common.pt", "metadata.json"}
    # Megatron's optimizer keys (optimizer.state.exp_avg.<key>) read per parameter
    assert info["optimizer"]["type"] == "Adam/AdamW" and info["optimizer"]["params"] == info["groups"]["model"]["num_tensors"]
    ref = {k: v for k, v in _flat(_torch_read(path, tmp_path, "src.pt")).items() if torch.is_tensor(v)}
    # Megatron's keys are flat (``embedding.word_embeddings.weight``, ``optimizer.state.exp_avg.<key>``):
    # the model's are read under their own names, the optimizer's under ``state.``
    got = {(t["name"] if t["group"] == "model" else f"{t['group']}.{t['name']}"): (tuple(t["shape"]), t["dtype"])
           for t in info["tensors"]}
    assert got == {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in ref.items()}


def test_convert_dcp_equals_the_source_and_megatron_loads_it(save, tmp_path):
    import torch

    path, held = save
    _ckpt("convert", str(path), str(tmp_path / "dcp"), "--to", "dcp", "--quiet")
    src, dst = _torch_read(path, tmp_path, "src.pt"), _torch_read(tmp_path / "dcp", tmp_path, "dst.pt")
    src, dst = _flat(src), _flat(dst)
    assert src.keys() == dst.keys()
    for k, v in src.items():
        assert torch.equal(v, dst[k]) if torch.is_tensor(v) else v == dst[k], k
    assert (tmp_path / "dcp" / "common.pt").read_bytes() == (path / "common.pt").read_bytes()
    loaded = run_ranks(fw_megatron.load, 2, tmp_path, str(tmp_path / "dcp"))[0]
    compared = [k for k in held["model"] if k in loaded and not k.endswith("_extra_state")]
    assert len(compared) == len(held["model"]) - sum(k.endswith("_extra_state") for k in held["model"]) > 10
    for k in compared:
        assert torch.equal(loaded[k], held["model"][k]), k


def test_export_refuses_a_megatron_model_the_map_does_not_cover(save, tmp_path):
    """This save is Megatron-Core's default GPT (LayerNorm with biases, a non-gated GELU MLP with
    biases, learned absolute positions): not a Llama, so exit 3 naming what has no counterpart,
    nothing written; without a config, exit 3 naming --base."""
    from transformers import LlamaConfig

    path, _ = save
    base = tmp_path / "base"
    LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(base)
    for args in (["export", str(path), str(tmp_path / "hf"), "--base", str(base)],
                 ["convert", str(path), str(tmp_path / "hf"), "--to", "hf", "--base", str(base)]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 3, result.output
        assert "no Hugging Face counterpart" in result.output, result.output
        for named in ("LayerNorm (the map is for RMSNorm): decoder.final_layernorm.bias",
                      "linear biases: decoder.layers.mlp.linear_fc1.bias",
                      "learned absolute positions (the map is for RoPE): embedding.position_embeddings.weight"):
            assert named in result.output, (named, result.output)
    result = CliRunner().invoke(cli, ["export", str(path), str(tmp_path / "hf")])
    assert result.exit_code == 3 and "--base" in result.output, result.output
    assert not (tmp_path / "hf").exists()
