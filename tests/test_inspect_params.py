"""``inspect --json``'s (and ``estimate``'s) ``"params"`` is the model's parameter count: a tensor its class holds as a
buffer (DeepSeek-V3's ``mlp.gate.e_score_correction_bias``, saved by ``save_pretrained`` beside
the weights) is not counted, as the class built on the meta device says; the count equals
``sum(p.numel() for p in model.parameters())`` of the model that wrote the checkpoint."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ckpt_tools.cli.main import main as cli

pytestmark = pytest.mark.filterwarnings("ignore")


def _inspect(path) -> dict:
    result = CliRunner().invoke(cli, ["inspect", str(path), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _deepseek():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                            q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)


def _llama():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)  # q/k/v biases: parameters named .bias


@pytest.mark.parametrize("make", [_deepseek, _llama], ids=["deepseek_v3", "qwen2"])
def test_params_are_the_models_parameters(make, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make())
    model.save_pretrained(tmp_path / "hf")
    info = _inspect(tmp_path / "hf")
    params = sum(p.numel() for p in model.parameters())
    held = sum(t.numel() for t in model.state_dict().values())
    assert info["params"] == params, (info["params"], params, held)
    est = CliRunner().invoke(cli, ["estimate", str(tmp_path / "hf"), "--ranks", "2", "--json"], catch_exceptions=False)
    assert est.exit_code == 0, est.output
    assert json.loads(est.output)["params"] == params  # estimate counts what trains, too
    if make is _deepseek:  # the router's bias: 4 per MoE layer, in the file but no parameter
        assert held - params == 4 and "e_score_correction_bias" in json.dumps(
            _inspect_tensors(tmp_path / "hf"))


def _inspect_tensors(path) -> list[str]:
    result = CliRunner().invoke(cli, ["inspect", str(path), "--json", "--tensors"], catch_exceptions=False)
    return [t["name"] for t in json.loads(result.output)["tensors"]]


def test_a_class_that_cannot_be_built_counts_every_tensor(tmp_path):
    """No class to ask (a config naming an architecture transformers lacks): every model tensor
    is counted, and inspect still answers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_deepseek())
    model.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert _inspect(tmp_path / "hf")["params"] == sum(t.numel() for t in model.state_dict().values())
    del torch
