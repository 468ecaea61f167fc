"""PEFT LoRA under FSDP2: ``export`` merges it as PEFT's ``merge_and_unload`` does, or writes an
adapter ``PeftModel.from_pretrained`` loads, or refuses.

One real 2-rank ``fully_shard`` job (tests/dist.py, gloo on CPU) trains a tiny Llama wrapped by
``peft.get_peft_model`` for two AdamW steps (so lora_B is not zero) and saves it three ways:
verl's per-rank files (``model.state_dict()`` of each rank, + ``lora_train_meta.json``), the
LoRA-only variant of those files (verl's ``save_lora_only``), a plain ``dcp.save`` of
``get_model_state_dict`` with PEFT's own ``adapter_config.json`` beside it, and accelerate's
``save_state`` layout (``pytorch_model_fsdp_0/``, written as fixtures/make_fixtures.py mirrors
``save_fsdp_model``; accelerate's and the Trainer's own saves are in test_lora_frameworks.py).
Rank 0 also saves the
full trained state dict: the reference is PEFT itself, run on it in the test process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckpt_tools
from ckpt_tools.cli.main import main as cli

try:
    from dist import run_ranks
except ImportError:  # tests/ imported as a package
    from tests.dist import run_ranks

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

R, ALPHA, TARGETS = 4, 8, ["q_proj", "v_proj"]
WS = 2


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _peft_model(seed: int = 0):
    from make_fixtures import tiny_llama_config
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM(tiny_llama_config())
    return get_peft_model(base, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))


def _train_and_save(rank: int, world_size: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    out = Path(out)
    model = _peft_model()
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    sd = model.state_dict()
    torch.save(sd, out / "verl" / f"model_world_size_{world_size}_rank_{rank}.pt")
    torch.save({k: v for k, v in sd.items() if ".lora_" in k},
               out / "verl_lora_only" / f"model_world_size_{world_size}_rank_{rank}.pt")
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(out / "dcp"))
    # accelerate's save_state layout, as fixtures/make_fixtures.py mirrors it (save_fsdp_model's options)
    options = StateDictOptions(full_state_dict=False, cpu_offload=True, broadcast_from_rank0=False)
    dcp.save({"model": get_model_state_dict(model, options=options)},
             checkpoint_id=str(out / "accelerate" / "pytorch_model_fsdp_0"))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, out / "trained.pt")


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    from make_fixtures import tiny_llama_config

    out = tmp_path_factory.mktemp("lora")
    for d in ("verl", "verl_lora_only", "dcp", "accelerate"):
        (out / d).mkdir()
    run_ranks(_train_and_save, WS, out / "rdv", str(out))
    for d in ("verl", "verl_lora_only"):
        (out / d / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": WS}))
        tiny_llama_config().save_pretrained(out / d / "huggingface")
        (out / d / "lora_train_meta.json").write_text(json.dumps({"r": R, "lora_alpha": ALPHA, "task_type": "CAUSAL_LM"}))
    for d in ("dcp", "accelerate"):  # PEFT's own adapter_config.json, as Trainer saves it beside the state
        _peft_model().peft_config["default"].save_pretrained(out / d)
        tiny_llama_config().save_pretrained(out / d)
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(tiny_llama_config()).save_pretrained(out / "base")  # the frozen base, as trained from
    return out


def _trained(saves: Path):
    model = _peft_model(seed=99)
    model.load_state_dict(torch.load(saves / "trained.pt", weights_only=True))
    return model.eval()


IDS = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])


@pytest.mark.parametrize("layout", ["verl", "dcp", "accelerate"])
def test_merge_equals_peft_merge_and_unload(saves, tmp_path, layout):
    from transformers import LlamaForCausalLM

    r = _cli("export", saves / layout, tmp_path / "out")
    assert r.exit_code == 0, r.output
    trained = _trained(saves)
    with torch.no_grad():
        want_logits = trained(input_ids=IDS).logits
    lora_b = next(v for k, v in trained.state_dict().items() if "lora_B" in k)
    assert lora_b.abs().max() > 0  # the update is real: a merge that dropped it would differ
    merged = trained.merge_and_unload()
    got, info = LlamaForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    want = merged.state_dict()
    for name, t in got.state_dict().items():
        assert torch.allclose(t, want[name], atol=1e-5, rtol=0), name
    with torch.no_grad():
        assert torch.allclose(got(input_ids=IDS).logits, want_logits, atol=1e-4)


@pytest.mark.parametrize("layout", ["verl", "dcp", "accelerate", "verl_lora_only"])
def test_adapter_loads_with_peft(saves, tmp_path, layout):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    r = _cli("export", saves / layout, tmp_path / "adapter", "--lora", "adapter")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir() if not p.name.startswith(".")) == [
        "adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (R, ALPHA, TARGETS)
    base = LlamaForCausalLM.from_pretrained(saves / "base")
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    trained = _trained(saves)
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=IDS).logits, trained(input_ids=IDS).logits, atol=1e-5)


def test_inspect_reports_lora(saves):
    full = ckpt_tools.inspect(saves / "verl")["lora"]
    assert full == {**full, "rank": R, "alpha": ALPHA, "target_modules": TARGETS, "adapter_only": False}
    only = ckpt_tools.inspect(saves / "verl_lora_only")["lora"]
    assert only["adapter_only"] is True and only["rank"] == R
    assert ckpt_tools.inspect(saves / "dcp")["lora"]["alpha"] == ALPHA
    assert ckpt_tools.inspect(saves / "base")["lora"] is None


def test_lora_only_merge_needs_base_weights(saves, tmp_path):
    from transformers import LlamaForCausalLM

    r = _cli("export", saves / "verl_lora_only", tmp_path / "out")
    assert r.exit_code == 3, r.output
    assert "--lora adapter" in r.output and "--base" in r.output
    assert not (tmp_path / "out").exists()
    r = _cli("export", saves / "verl_lora_only", tmp_path / "out", "--base", saves / "base")
    assert r.exit_code == 0, r.output
    got, info = LlamaForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    want = _trained(saves).merge_and_unload().state_dict()
    for name, t in got.state_dict().items():
        assert torch.allclose(t, want[name], atol=1e-5, rtol=0), name


def test_unknown_alpha_is_refused_until_given(saves, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(saves / "verl", src)
    (src / "lora_train_meta.json").unlink()
    r = _cli("export", src, tmp_path / "out")
    assert r.exit_code == 3 and "--lora-alpha" in r.output, r.output
    assert not (tmp_path / "out").exists()
    assert ckpt_tools.inspect(src)["lora"]["alpha"] is None
    wrong = _cli("export", src, tmp_path / "wrong", "--lora-alpha", str(ALPHA * 2))
    right = _cli("export", src, tmp_path / "right", "--lora-alpha", str(ALPHA))
    assert wrong.exit_code == right.exit_code == 0
    report = ckpt_tools.verify(tmp_path / "right", tmp_path / "wrong")
    assert not report["ok"] and any("q_proj" in m for m in report["mismatches"])
    expected = tmp_path / "expected"
    assert _cli("export", saves / "verl", expected).exit_code == 0
    assert ckpt_tools.verify(tmp_path / "right", expected)["ok"]


def test_convert_to_hf_merges_too(saves, tmp_path):
    r = _cli("convert", saves / "verl", tmp_path / "out", "--to", "hf", "--model-only")
    assert r.exit_code == 0, r.output
    names = ckpt_tools.inspect(tmp_path / "out", tensors=True)["tensors"]
    assert not [t for t in names if "lora_" in t["name"] or "base_layer" in t["name"] or t["name"].startswith("base_model")]


def test_verify_says_what_an_adapter_only_checkpoint_is(saves):
    r = _cli("verify", saves / "verl_lora_only")
    assert r.exit_code == 0, r.output
    assert "LoRA adapter weights only" in r.output and "not a model" in r.output


def test_adapter_of_a_checkpoint_without_lora_is_refused(tmp_path, fixtures_dir):
    r = _cli("export", fixtures_dir / "llama_hf", tmp_path / "out", "--lora", "adapter")
    assert r.exit_code == 3 and "no LoRA" in r.output, r.output


def test_adapter_for_another_base_is_refused(saves, tmp_path):
    config = json.loads((saves / "verl" / "huggingface" / "config.json").read_text())
    config["num_key_value_heads"] = config["num_attention_heads"]  # v_proj grows: not the trained base
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps(config))
    r = _cli("export", saves / "verl_lora_only", tmp_path / "out", "--lora", "adapter", "--base", tmp_path / "other")
    assert r.exit_code == 3 and "v_proj.weight" in r.output and "misshapen" in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_modules_to_save_replace_their_original_when_merged(tmp_path):
    """PEFT's trained copy of a whole module (``modules_to_save``) is what merge_and_unload keeps."""
    from make_fixtures import tiny_llama_config
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(tiny_llama_config()),
                           LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, modules_to_save=["lm_head"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:  # stands in for training: lora_B and the lm_head copy change
                p.add_(torch.randn_like(p) * 0.1)
    src = tmp_path / "src"
    src.mkdir()
    torch.save(model.state_dict(), src / "model.pt")
    model.peft_config["default"].save_pretrained(src)
    tiny_llama_config().save_pretrained(src)
    r = _cli("export", src / "model.pt", tmp_path / "out", "--base", src)
    assert r.exit_code == 0, r.output
    got, info = LlamaForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    want = model.merge_and_unload().state_dict()
    for name, t in got.state_dict().items():
        assert torch.allclose(t, want[name], atol=1e-5, rtol=0), name
    r = _cli("export", src / "model.pt", tmp_path / "adapter", "--base", src, "--lora", "adapter")
    assert r.exit_code == 3 and "modules_to_save" in r.output, r.output
