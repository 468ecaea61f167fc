"""Mixture-of-Experts models end to end (issue 32).

- ``export`` of a real 2-rank FSDP2 save (DCP and verl rank files, transformers 5's fused
  experts) writes exactly what ``save_pretrained`` writes for that model type: per-expert tensors
  for Qwen3-MoE, DeepSeek-V3 and Mixtral (``block_sparse_moe.experts.{e}.w1``), fused for gpt-oss;
  same names, dtypes and bytes; ``from_pretrained`` loads it with nothing missing or unexpected and
  computes the source model's logits. A per-expert (transformers-4 layout) source exports as it is.
- ``shard`` of the hub directory and ``convert --to dcp|sharded`` of it write the fused names the
  FSDP2 training model holds: a 2-rank ``fully_shard`` job takes them (``dcp.load``, strict
  ``load_state_dict``) and holds the source's weights; ``shard`` → ``export`` gives the hub
  files back bit for bit.
- Bad input is exit 3 naming the tensor, with nothing written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ckpt_tools.cli.main import main as cli
from dist import run_ranks
from fw_moe import FAMILIES, build, load_job, save_job

SPLIT = ("qwen3_moe", "mixtral", "deepseek_v3")  # per-expert on the hub


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> dict[str, Path]:
    """``save_pretrained`` of each family's model (the hub layout)."""
    root = tmp_path_factory.mktemp("moe_ref")
    out = {}
    for family in FAMILIES:
        build(family).save_pretrained(root / family)
        out[family] = root / family
    return out


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe_saves")
    run_ranks(save_job, 2, root, str(root), tuple(FAMILIES))
    return root


def _same_files(out: Path, ref: Path) -> None:
    got, want = load_file(out / "model.safetensors"), load_file(ref / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(got[name].view(torch.uint8), value.view(torch.uint8)), name


def _loads_like(out: Path, family: str) -> None:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = torch.arange(12).view(2, 6) % 101
    with torch.no_grad():
        assert torch.equal(model(ids).logits, build(family).eval()(ids).logits)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kind", ["dcp", "verl"])
def test_export_of_an_fsdp2_save_is_what_save_pretrained_writes(saves, refs, tmp_path, family, kind):
    out = tmp_path / "out"
    r = _cli("export", saves / family / kind, out)
    assert r.exit_code == 0, r.output
    _same_files(out, refs[family])
    _loads_like(out, family)


def test_per_expert_source_exports_as_it_is(refs, tmp_path):
    """A transformers-4 save holds the hub layout already: a torch state dict of per-expert names."""
    src = tmp_path / "t4"
    src.mkdir()
    torch.save(load_file(refs["mixtral"] / "model.safetensors"), src / "pytorch_model.bin")
    (src / "config.json").write_text((refs["mixtral"] / "config.json").read_text())
    out = tmp_path / "out"
    r = _cli("export", src / "pytorch_model.bin", out, "--base", refs["mixtral"])
    assert r.exit_code == 0, r.output
    _same_files(out, refs["mixtral"])


def test_shard_and_convert_write_what_training_loads(refs, tmp_path):
    """``convert`` of each hub directory (in-process), ``shard`` of one (its own 2-rank job); each
    output exports back to the hub files bit for bit, and a 2-rank FSDP2 job loads it."""
    sources = []
    # DeepSeek's e_score_correction_bias is a buffer, which fully_shard leaves a plain tensor:
    # --to sharded writes it whole on every rank, as the training job's own save does
    for family, kind in (("qwen3_moe", "sharded"), ("mixtral", "sharded"), ("deepseek_v3", "dcp"),
                         ("deepseek_v3", "sharded")):
        out = tmp_path / family / kind
        r = _cli("convert", refs[family], out, "--to", kind, "--world-size", 2, "--quiet")
        assert r.exit_code == 0, r.output
        sources.append((family, kind, str(out)))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    for rank in (0, 1):  # the buffer whole on each rank, a plain tensor; the weights DTensors
        sd = torch.load(tmp_path / "deepseek_v3" / "sharded" / f"model_world_size_2_rank_{rank}.pt", weights_only=False)
        assert type(sd[bias]) is torch.Tensor and sd[bias].shape == build("deepseek_v3").state_dict()[bias].shape
        assert type(sd["model.embed_tokens.weight"]).__name__ == "DTensor"
    shard_out = tmp_path / "deepseek_v3" / "shard"
    r = _cli("shard", refs["deepseek_v3"], shard_out, "--ranks", 2, "--quiet")
    assert r.exit_code == 0, r.output
    sources.append(("deepseek_v3", "sharded", str(shard_out)))
    for family, _, out in sources:
        back = Path(out + "-back")
        r = _cli("export", out, back, "--base", refs[family])
        assert r.exit_code == 0, r.output
        _same_files(back, refs[family])
    loaded = run_ranks(load_job, 2, tmp_path, sources)
    for (family, kind, _), got in zip(sources, loaded[0]):
        want = build(family).state_dict()
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) for k in want), (family, kind)


# -- bad input: exit 3 naming the tensor, nothing written ------------------------------------

def _hub_copy(ref: Path, dst: Path, drop: str | None = None, **config) -> Path:
    dst.mkdir()
    tensors = load_file(ref / "model.safetensors")
    if drop:
        del tensors[drop]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((ref / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return dst


@pytest.mark.parametrize("command", ["shard", "convert"])
def test_a_missing_expert_tensor_is_named(refs, tmp_path, command):
    gone = "model.layers.1.mlp.experts.2.up_proj.weight"
    src = _hub_copy(refs["qwen3_moe"], tmp_path / "src", drop=gone)
    out = tmp_path / "out"
    args = ("--ranks", 2) if command == "shard" else ("--to", "dcp")
    r = _cli(command, src, out, *args)
    assert r.exit_code == 3 and gone in r.output, r.output
    assert not out.exists()


def test_an_expert_count_the_config_disagrees_with_is_named(saves, tmp_path):
    src = saves / "mixtral" / "dcp"
    base = tmp_path / "base"
    base.mkdir()
    cfg = json.loads((src / "huggingface" / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 8}))
    out = tmp_path / "out"
    r = _cli("export", src, out, "--base", base)
    assert r.exit_code == 3 and "model.layers.0.mlp.experts.gate_up_proj" in r.output and "8" in r.output, r.output
    assert not out.exists()


def test_without_transformers_an_moe_export_names_the_extra(saves, tmp_path):
    out = tmp_path / "out"
    code = ("import sys; sys.modules['transformers'] = None; from ckpt_tools.cli.main import main; "
            f"main(['export', {str(saves / 'qwen3_moe' / 'dcp')!r}, {str(out)!r}])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 3 and "[hf]" in p.stderr, p.stderr
    assert not out.exists()


# -- inspect and estimate ---------------------------------------------------------------------

def test_inspect_and_estimate_count_experts(saves, refs):
    model = build("qwen3_moe")
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    for path, layout in ((saves / "qwen3_moe" / "dcp", "fused"), (saves / "qwen3_moe" / "verl", "fused"),
                         (refs["qwen3_moe"], "per_expert")):
        r = _cli("inspect", path, "--json")
        info = json.loads(r.output)
        assert info["params"] == total and info["moe"] == {"num_experts": 4, "layout": layout}, path
    r = _cli("estimate", refs["qwen3_moe"], "--ranks", 2, "--json")
    est = json.loads(r.output)
    assert est["params"] == total and est["active_params"] == total - routed // 2  # top 2 of 4 experts
    assert est["moe"] == {"num_experts": 4, "layout": "per_expert"}


def test_a_dense_model_has_no_experts(fixtures_dir):
    info = json.loads(_cli("inspect", fixtures_dir / "llama_dcp", "--json").output)
    assert info["moe"] is None and info["params"] > 0


# -- the plan alone, from names and shapes -----------------------------------------------------

def test_a_transposing_layout_is_refused_by_name():
    from ckpt_tools.core.dtypes import DType
    from ckpt_tools.errors import BadInput
    from ckpt_tools.naming import experts

    shapes = {"model.language_model.layers.0.mlp.experts.gate_up_proj": ((4, 64, 64), DType("float32"))}
    with pytest.raises(BadInput, match="Transpose"):
        experts.to_hub({"model_type": "qwen3_vl_moe", "num_experts": 4}, shapes, Path("src"))


def test_the_plan_is_row_ranges():
    """Mixtral's fused [E, 2I, H] -> per-expert w1 (gate rows) and w3 (up rows), from the registry."""
    from ckpt_tools.core.dtypes import DType
    from ckpt_tools.naming import experts

    f32 = DType("float32")
    shapes = {"model.layers.0.mlp.experts.gate_up_proj": ((3, 8, 5), f32),
              "model.layers.0.mlp.experts.down_proj": ((3, 5, 4), f32), "model.norm.weight": ((5,), f32)}
    plan = experts.to_hub({"model_type": "mixtral", "num_local_experts": 3}, shapes, Path("src"))
    w3 = plan["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    assert w3.shape == (4, 5) and w3.runs == (experts.Run("model.layers.0.mlp.experts.gate_up_proj", 2 * 8 + 4, 0, 4),)
    assert plan["model.norm.weight"].same == "model.norm.weight" and len(plan) == 3 * 3 + 1
    assert list(experts._boxes((3, 4), 2, 7)) == [((0, 2), (1, 2), 2), ((1, 0), (1, 4), 4), ((2, 0), (1, 1), 8)]


def test_torchtitan_grouped_experts_export_as_its_own_to_hf(refs, tmp_path):
    """A torchtitan qwen3 MoE save (``moe.routed_experts.inner_experts.w1_EFD`` [E, F, D], made by
    torchtitan's own ``from_hf``) exports to the per-expert hub tensors its ``to_hf`` gives."""
    import torch.distributed.checkpoint as dcp

    pytest.importorskip("torchtitan")
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    spec = model_registry("debugmodel_moe")
    for layer in spec.model.layers:
        if layer.moe is not None:
            layer.moe.num_experts = 4
    adapter = Qwen3StateDictAdapter(spec.model, None)
    titan = adapter.from_hf(load_file(refs["qwen3_moe"] / "model.safetensors"))
    dcp.save(titan, checkpoint_id=str(tmp_path / "step-10"))
    out = tmp_path / "out"
    r = _cli("export", tmp_path / "step-10", out, "--base", refs["qwen3_moe"])
    assert r.exit_code == 0, r.output
    _same_files(out, refs["qwen3_moe"])
    theirs = adapter.to_hf(titan)
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(theirs) and all(torch.equal(got[k], theirs[k]) for k in theirs)


def test_lora_merge_into_fused_experts_is_refused(tmp_path):
    """PEFT LoRA on a transformers-5 MoE: merging would need the experts split as well; refused
    (exit 3 naming --lora adapter) rather than written under the fused names."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build("qwen3_moe"), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    src = tmp_path / "src"
    src.mkdir()
    torch.save(model.state_dict(), src / "model.pt")
    model.base_model.model.config.save_pretrained(src)
    model.peft_config["default"].save_pretrained(src)
    out = tmp_path / "out"
    r = _cli("export", src / "model.pt", out, "--base", src)
    assert r.exit_code == 3 and "--lora adapter" in r.output, r.output
    assert not out.exists()


def test_a_torch_saved_fused_state_dict_exports(refs, tmp_path):
    """``torch.save(model.state_dict())`` of a transformers-5 model: expert rows read from the
    file's storage records."""
    src = tmp_path / "src"
    src.mkdir()
    torch.save(build("mixtral").state_dict(), src / "model.pt")
    out = tmp_path / "out"
    r = _cli("export", src / "model.pt", out, "--base", refs["mixtral"])
    assert r.exit_code == 0, r.output
    _same_files(out, refs["mixtral"])
