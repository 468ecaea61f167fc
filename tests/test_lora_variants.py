"""PEFT variants beyond plain LoRA, each from a real ``peft`` model: what ckpt cannot fold in or
write as an adapter is refused (exit 3, named, nothing at DST) by ``export`` in both ``--lora``
modes and by ``convert --to hf``; what it can (rsLoRA, an adapter not named "default", LoRA on
the embedding, in memory and as PEFT saves it) equals PEFT's ``merge_and_unload`` within 1e-5
and loads with ``PeftModel.from_pretrained``.

Single process: the PEFT model's ``state_dict()`` is saved with ``torch.save`` (what a plain
``fully_shard`` job's full state dict holds) beside PEFT's ``adapter_config.json`` and the base
``config.json``; its trainable tensors are perturbed, standing in for training (lora_B is zero
at init).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckpt_tools
from ckpt_tools.cli.main import main as cli

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore")

IDS = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _base():
    from make_fixtures import tiny_llama_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config())


def _save(tmp_path: Path, model, adapter: str = "default") -> Path:
    from make_fixtures import tiny_llama_config

    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    src = tmp_path / "src"
    src.mkdir()
    torch.save(model.state_dict(), src / "model.pt")
    model.peft_config[adapter].save_pretrained(src)
    tiny_llama_config().save_pretrained(src)
    _base().save_pretrained(tmp_path / "base")
    return src


def _peft(config_kw: dict, adapter: str = "default"):
    from peft import LoraConfig, get_peft_model

    kw = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, **config_kw}
    return get_peft_model(_base(), LoraConfig(**kw), adapter_name=adapter)


def _multi():
    from peft import LoraConfig

    model = _peft({})
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj"], lora_dropout=0.0))
    return model


REFUSED = {
    "dora": (lambda: _peft({"use_dora": True}), "DoRA"),
    "lora_bias": (lambda: _peft({"lora_bias": True}), "lora_bias"),
    "two_adapters": (_multi, "2 LoRA adapters"),
    "alpha_pattern": (lambda: _peft({"alpha_pattern": {"v_proj": 16}}), "alpha_pattern"),
}
COMMANDS = {
    "merge": ["export"],
    "adapter": ["export", "--lora", "adapter"],
    "convert": ["convert", "--to", "hf"],
}


@pytest.fixture(scope="module")
def variant_saves(tmp_path_factory):
    out = {}
    for name, (build, _) in REFUSED.items():
        out[name] = _save(tmp_path_factory.mktemp(name), build())
    return out


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("variant", REFUSED)
def test_variant_is_refused(variant_saves, tmp_path, variant, command):
    src = variant_saves[variant]
    args = COMMANDS[command]
    dst = tmp_path / "out"
    r = _cli(args[0], src / "model.pt", dst, *args[1:], "--base", src)
    assert r.exit_code == 3, r.output
    assert REFUSED[variant][1] in r.output and r.output.count("error:") == 1, r.output
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no staging left either


@pytest.mark.parametrize("variant", REFUSED)
def test_inspect_names_the_variant(variant_saves, variant):
    lora = ckpt_tools.inspect(variant_saves[variant] / "model.pt")["lora"]
    assert REFUSED[variant][1] in lora["unsupported"], lora


def _merged_equals_peft(out: Path, model) -> None:
    from transformers import LlamaForCausalLM

    model = model.eval()
    with torch.no_grad():
        want_logits = model(input_ids=IDS).logits
    want = model.merge_and_unload().state_dict()
    got, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for name, t in got.state_dict().items():
        assert torch.allclose(t, want[name], atol=1e-5, rtol=0), name
    with torch.no_grad():
        assert torch.allclose(got(input_ids=IDS).logits, want_logits, atol=1e-5)


def _adapter_equals_peft(out: Path, base: Path, model) -> None:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    loaded = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), out).eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=IDS).logits, model.eval()(input_ids=IDS).logits, atol=1e-5)


HANDLED = {
    "rslora": ({"use_rslora": True}, "default"),
    "named_adapter": ({}, "mine"),
    "embedding": ({"target_modules": ["q_proj", "embed_tokens"]}, "default"),
}


@pytest.mark.parametrize("case", HANDLED)
def test_handled_variant_equals_peft(tmp_path, case):
    """rsLoRA scales by alpha/sqrt(r) (from adapter_config.json's use_rslora); an adapter with
    another name than "default" is the one adapter; an embedding's update is (B @ A).T."""
    config_kw, adapter = HANDLED[case]
    model = _peft(config_kw, adapter=adapter)
    src = _save(tmp_path, model, adapter)
    r = _cli("export", src / "model.pt", tmp_path / "adapter", "--base", src, "--lora", "adapter")
    assert r.exit_code == 0, r.output
    _adapter_equals_peft(tmp_path / "adapter", tmp_path / "base", model)
    r = _cli("export", src / "model.pt", tmp_path / "merged", "--base", src)
    assert r.exit_code == 0, r.output
    _merged_equals_peft(tmp_path / "merged", model)


def test_embedding_lora_as_peft_saves_it(tmp_path):
    """``save_pretrained`` of an embedding LoRA: adapter names without the adapter name, plus the
    embedding's base weight (save_embedding_layers). Adapter-only: merged only with --base."""
    model = _peft(HANDLED["embedding"][0])
    _save(tmp_path, model)
    model.save_pretrained(tmp_path / "saved")
    src = tmp_path / "saved"
    lora = ckpt_tools.inspect(src)["lora"]
    assert (lora["adapter_only"], lora["target_modules"]) == (True, ["embed_tokens", "q_proj"]), lora
    r = _cli("export", src, tmp_path / "adapter", "--base", tmp_path / "base", "--lora", "adapter")
    assert r.exit_code == 0, r.output
    _adapter_equals_peft(tmp_path / "adapter", tmp_path / "base", model)
    r = _cli("export", src, tmp_path / "refused")
    assert r.exit_code == 3 and "--lora adapter" in r.output and "--base" in r.output, r.output
    r = _cli("export", src, tmp_path / "merged", "--base", tmp_path / "base")
    assert r.exit_code == 0, r.output
    _merged_equals_peft(tmp_path / "merged", model)


def test_embedding_lora_with_tied_embeddings_is_refused_when_merged(tmp_path):
    from make_fixtures import tiny_llama_config
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(tiny_llama_config(tied=True)),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"]))
    src = _save(tmp_path, model)
    tiny_llama_config(tied=True).save_pretrained(src)
    r = _cli("export", src / "model.pt", tmp_path / "out", "--base", src)
    assert r.exit_code == 3 and "ties lm_head.weight" in r.output and "--lora adapter" in r.output, r.output
    assert not (tmp_path / "out").exists()
