"""Export of a real Megatron-Core DeepSeek-V3-style GPT to Hugging Face's DeepseekV3ForCausalLM.

``fw_megatron_mla.mla_job`` saves a tiny ``GPTModel`` with multi-latent attention, a dense first
layer, then MoE layers with a shared expert and DeepSeek's sigmoid router with expert bias
(4 experts, top 2), built from Megatron-Core 0.16.1's own local layer spec on CPU and saved with
its own ``dist_checkpointing`` (torch_dist) at expert parallel 2 on 2 gloo ranks, with
Megatron-LM's ``args``. The export, with ``--base`` a DeepseekV3Config of matching shapes built
here, must load in ``from_pretrained`` with no missing or unexpected keys, be what
``save_pretrained`` of the loaded model writes (names and bytes), hold Megatron's parameters bit
for bit, and give the logits of Megatron's own whole-model forward on the same tokens
(rtol 1e-5), for both of transformers' rotary layouts (``rope_interleave`` true: rows as they are;
false: the rotary rows reordered). What it cannot map is exit 3, nothing written.
"""

from __future__ import annotations

import functools
import json

import pytest
from click.testing import CliRunner
from dist import run_ranks

import fw_megatron
import fw_megatron_mla
from ckpt_tools.cli.main import main as cli

pytest.importorskip("megatron.core", reason="the Megatron tests need megatron-core==0.16.1 (README, Install)")
pytestmark = pytest.mark.filterwarnings("ignore")
M = fw_megatron_mla.MLA


def _save(tmp_path_factory, name: str, **options):
    root = tmp_path_factory.mktemp(name)
    held = run_ranks(functools.partial(fw_megatron_mla.mla_job, **options), 2, root, str(root / "save"))
    return root / "save", held, options


@pytest.fixture(scope="module")
def rope_save(tmp_path_factory):
    """Query latent (``linear_q_down_proj``/``linear_q_up_proj``), plain rope."""
    return _save(tmp_path_factory, "mla_rope", q_lora=True, yarn=False)


@pytest.fixture(scope="module")
def yarn_save(tmp_path_factory):
    """No query latent (``q_lora_rank=None``: ``linear_q_proj``), YaRN rope."""
    return _save(tmp_path_factory, "mla_yarn", q_lora=False, yarn=True)


def _base(path, *, q_lora: bool = True, yarn: bool = False, **changes) -> str:
    from transformers import DeepseekV3Config

    y = fw_megatron_mla.YARN
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": y["rotary_scaling_factor"],
            "original_max_position_embeddings": y["original_max_position_embeddings"], "beta_fast": y["beta_fast"],
            "beta_slow": y["beta_slow"], "mscale": y["mscale"], "mscale_all_dim": y["mscale_all_dim"]} if yarn else {
        "rope_type": "default", "rope_theta": 10000.0}
    settings = {"vocab_size": fw_megatron_mla.VOCAB, "hidden_size": M["hidden"], "intermediate_size": M["ffn"],
                "moe_intermediate_size": M["expert_ffn"], "num_hidden_layers": M["layers"],
                "num_attention_heads": M["heads"], "num_key_value_heads": M["heads"], "n_shared_experts": M["shared"],
                "n_routed_experts": M["experts"], "num_experts_per_tok": M["topk"],
                "routed_scaling_factor": M["scaling"], "kv_lora_rank": M["kv_lora_rank"],
                "q_lora_rank": M["q_lora_rank"] if q_lora else None, "qk_rope_head_dim": M["qk_pos_emb_head_dim"],
                "qk_nope_head_dim": M["qk_head_dim"], "v_head_dim": M["v_head_dim"], "n_group": 1, "topk_group": 1,
                "first_k_dense_replace": 1, "norm_topk_prob": True, "max_position_embeddings": 64,
                "rms_norm_eps": fw_megatron_mla.EPS, "rope_parameters": rope, "tie_word_embeddings": False,
                **changes}
    DeepseekV3Config(**settings).save_pretrained(path)
    return str(path)


def _export(src, dst, *args: str):
    return CliRunner().invoke(cli, ["export", str(src), str(dst), "--quiet", *args], catch_exceptions=False)


def _rope_rows(block: int, start: int, rope: int, blocks: int) -> list[int]:
    """Megatron's row for each of HF's rows when HF rotates halves (``rope_interleave=False``)."""
    order = []
    for b in range(blocks):
        at = b * block
        order += [*range(at, at + start), *(at + start + 2 * j for j in range(rope // 2)),
                  *(at + start + 2 * j + 1 for j in range(rope // 2))]
    return order


@pytest.mark.parametrize("interleave", [True, False], ids=["rope_interleave", "rope_halves"])
@pytest.mark.parametrize("which", ["rope_save", "yarn_save"], ids=["q_latent_rope", "q_proj_yarn"])
def test_export_is_what_save_pretrained_writes_and_computes_what_megatron_computes(request, which, interleave,
                                                                                   tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path, held, options = request.getfixturevalue(which)
    base = _base(tmp_path / "base", q_lora=options["q_lora"], yarn=options["yarn"], rope_interleave=interleave)
    result = _export(path, tmp_path / "hf", "--base", base)
    assert result.exit_code == 0, result.output
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    written = load_file(tmp_path / "hf" / "model.safetensors")
    model.save_pretrained(tmp_path / "resaved")
    resaved = load_file(tmp_path / "resaved" / "model.safetensors")
    assert written.keys() == resaved.keys() and all(torch.equal(written[k], resaved[k]) for k in written)
    # Megatron's parameters, bit for bit (the rotary rows reordered for rope_interleave=False)
    w = held[0]["model"]
    heads, nope, rope, kv = M["heads"], M["qk_head_dim"], M["qk_pos_emb_head_dim"], M["kv_lora_rank"]
    q_rows = _rope_rows(nope + rope, nope, rope, heads) if not interleave else list(range(heads * (nope + rope)))
    kv_rows = _rope_rows(kv + rope, kv, rope, 1) if not interleave else list(range(kv + rope))
    for i in range(M["layers"]):
        at, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        pairs = {"self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
                 "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
                 "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
                 "input_layernorm.weight": "input_layernorm.weight",
                 "post_attention_layernorm.weight": "pre_mlp_layernorm.weight"}
        if options["q_lora"]:
            pairs.update({"self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
                          "self_attn.q_a_layernorm.weight": "self_attention.q_layernorm.weight"})
        for hf, megatron in pairs.items():
            assert torch.equal(written[at + hf], w[mg + megatron]), hf
        q = "self_attn.q_b_proj.weight" if options["q_lora"] else "self_attn.q_proj.weight"
        q_mg = "self_attention.linear_q_up_proj.weight" if options["q_lora"] else "self_attention.linear_q_proj.weight"
        assert torch.equal(written[at + q], w[mg + q_mg][q_rows])
        assert torch.equal(written[at + "self_attn.kv_a_proj_with_mqa.weight"],
                           w[mg + "self_attention.linear_kv_down_proj.weight"][kv_rows])
        if i == 0:  # the dense first layer
            fc1, ffn = w[mg + "mlp.linear_fc1.weight"], M["ffn"]
            assert torch.equal(written[at + "mlp.gate_proj.weight"], fc1[:ffn])
            assert torch.equal(written[at + "mlp.up_proj.weight"], fc1[ffn:])
            assert torch.equal(written[at + "mlp.down_proj.weight"], w[mg + "mlp.linear_fc2.weight"])
            continue
        assert torch.equal(written[at + "mlp.gate.weight"], w[mg + "mlp.router.weight"])
        bias = written[at + "mlp.gate.e_score_correction_bias"]
        assert torch.equal(bias, w[mg + "mlp.router.expert_bias"]) and bias.abs().min() > 0
        shared, width = w[mg + "mlp.shared_experts.linear_fc1.weight"], M["shared"] * M["expert_ffn"]
        assert torch.equal(written[at + "mlp.shared_experts.gate_proj.weight"], shared[:width])
        assert torch.equal(written[at + "mlp.shared_experts.up_proj.weight"], shared[width:])
        assert torch.equal(written[at + "mlp.shared_experts.down_proj.weight"],
                           w[mg + "mlp.shared_experts.linear_fc2.weight"])
    seen, inter = set(), M["expert_ffn"]
    for rank in held:  # rank r holds experts 2r, 2r+1 of each MoE layer
        for (layer, e), ew in rank["experts"].items():
            at = f"model.layers.{layer}.mlp.experts.{e}."
            assert torch.equal(written[at + "gate_proj.weight"], ew["fc1"][:inter])
            assert torch.equal(written[at + "up_proj.weight"], ew["fc1"][inter:])
            assert torch.equal(written[at + "down_proj.weight"], ew["fc2"])
            seen.add((layer, e))
    assert seen == {(layer, e) for layer in (1, 2) for e in range(M["experts"])}
    # the whole model: HF's logits on the tokens Megatron's own forward ran on
    want = held[0]["logits"]
    assert all(torch.equal(rank["logits"], want) for rank in held)  # both expert-parallel ranks agree
    with torch.no_grad():
        got = model(torch.tensor(held[0]["tokens"])).logits
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max().item()


def test_every_layer_moe_stacked_save_exports(tmp_path):
    """``moe_layer_freq=1`` (no dense layer): Megatron stacks the layers on one axis
    (``decoder.layers.mlp.router.expert_bias`` ``[L, E]``); with ``first_k_dense_replace: 0``
    the export loads with no missing or unexpected keys, is what ``save_pretrained`` writes, holds
    each layer's expert bias and gives Megatron's logits."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    held = run_ranks(functools.partial(fw_megatron_mla.mla_job, freq=1), 2, tmp_path, str(tmp_path / "save"))
    info = json.loads(CliRunner().invoke(cli, ["inspect", str(tmp_path / "save"), "--json", "--tensors"]).output)
    shapes = {t["name"]: t["shape"] for t in info["tensors"]}
    assert shapes["decoder.layers.mlp.router.expert_bias"] == [M["layers"], M["experts"]]
    assert info["moe"] == {"num_experts": M["experts"], "layout": "stacked"}
    result = _export(tmp_path / "save", tmp_path / "hf", "--base", _base(tmp_path / "base", first_k_dense_replace=0))
    assert result.exit_code == 0, result.output
    model, loading = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"] and not loading["mismatched_keys"], loading
    written = load_file(tmp_path / "hf" / "model.safetensors")
    model.save_pretrained(tmp_path / "resaved")
    resaved = load_file(tmp_path / "resaved" / "model.safetensors")
    assert written.keys() == resaved.keys() and all(torch.equal(written[k], resaved[k]) for k in written)
    for i in range(M["layers"]):
        assert torch.equal(written[f"model.layers.{i}.mlp.gate.e_score_correction_bias"],
                           held[0]["model"][f"decoder.layers.{i}.mlp.router.expert_bias"])
    with torch.no_grad():
        got = model(torch.tensor(held[0]["tokens"])).logits
    assert torch.allclose(got, held[0]["logits"], rtol=1e-5, atol=1e-6), (got - held[0]["logits"]).abs().max()


def test_bf16_export_keeps_the_router_in_float32_as_save_pretrained_does(rope_save, tmp_path):
    """``--dtype bf16``: transformers' DeepseekV3 keeps its router (``gate.weight``,
    ``e_score_correction_bias``) in float32 at bf16 (its ``_keep_in_fp32_modules_strict``), and
    so does the export: it is what ``save_pretrained`` of the model loaded with
    ``dtype=torch.bfloat16`` writes, and the expert bias is Megatron's float32 bias exactly (bf16
    would round it, and the choice of experts with it)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path, held, _ = rope_save
    result = _export(path, tmp_path / "hf", "--base", _base(tmp_path / "base"), "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    written = load_file(tmp_path / "hf" / "model.safetensors")
    fp32 = sorted(k for k, v in written.items() if v.dtype == torch.float32)
    assert fp32 == sorted(f"model.layers.{i}.mlp.gate.{w}" for i in (1, 2) for w in ("weight", "e_score_correction_bias"))
    assert all(v.dtype == torch.bfloat16 for k, v in written.items() if k not in fp32)
    for i in (1, 2):
        assert torch.equal(written[f"model.layers.{i}.mlp.gate.e_score_correction_bias"],
                           held[0]["model"][f"decoder.layers.{i}.mlp.router.expert_bias"])
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).save_pretrained(tmp_path / "resaved")
    resaved = load_file(tmp_path / "resaved" / "model.safetensors")
    assert written.keys() == resaved.keys()
    assert all(written[k].dtype == resaved[k].dtype and torch.equal(written[k], resaved[k]) for k in written)


# the Transformer-Engine spec's names for the same norms: fused into the following linear layer
_TE_NAMES = {"self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
             "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def test_transformer_engine_norm_names_export_the_same(rope_save, tmp_path):
    """The TE layer spec fuses the q/kv latent norms into ``linear_q_up_proj``/``linear_kv_up_proj``
    (``layer_norm_weight``) and a dense layer's pre-MLP norm into ``linear_fc1``: the save's tensors
    under those names (written again with torch's own DCP) export to the same bytes."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, _, _ = rope_save
    dcp_to_torch_save(path, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    renamed = {}
    for name, t in whole.items():
        if not torch.is_tensor(t) or "_extra_state" in name:
            continue
        layer, _, rest = name.partition(".self_attention.") if ".self_attention." in name else (None, None, None)
        if layer is not None and "self_attention." + rest in _TE_NAMES:
            name = f"{layer}.{_TE_NAMES['self_attention.' + rest]}"
        elif name == "decoder.layers.0.pre_mlp_layernorm.weight":  # the dense layer's norm (MoE layers keep theirs)
            name = "decoder.layers.0." + _TE_NAMES["pre_mlp_layernorm.weight"]
        renamed[name] = t
    assert sum("layer_norm_weight" in n for n in renamed) == 2 * M["layers"] + 1
    dcp.save(renamed, checkpoint_id=str(tmp_path / "te"), no_dist=True)
    base = _base(tmp_path / "base")
    for src, dst in ((path, tmp_path / "hf"), (tmp_path / "te", tmp_path / "hf_te")):
        result = _export(src, dst, "--base", base)
        assert result.exit_code == 0, result.output
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf_te" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("changes, named", [
    ({"norm_epsilon": 1e-5}, "norm_epsilon=1e-05: Megatron's q/kv latent norms use it"),
    ({"moe_router_score_function": "softmax"}, "moe_router_score_function='softmax'"),
    ({"moe_router_enable_expert_bias": False}, "moe_router_enable_expert_bias=False"),
    ({"moe_router_topk_scaling_factor": None}, "moe_router_topk_scaling_factor=None but config.json's "
                                               "routed_scaling_factor is 2.5"),
    ({"moe_router_num_groups": 2, "moe_router_group_topk": 1},
     "moe_router_num_groups=2 but config.json's n_group is 1"),
    ({"moe_layer_freq": [1, 1, 1]}, "moe_layer_freq=[1, 1, 1] but config.json's first_k_dense_replace 1"),
    ({"moe_shared_expert_intermediate_size": 64}, "moe_shared_expert_intermediate_size=64"),
    ({"moe_shared_expert_gate": True}, "moe_shared_expert_gate=True"),
    ({"qk_head_dim": 8}, "qk_head_dim=8 but config.json's qk_nope_head_dim is 16"),
    ({"rope_type": "yarn"}, "rope_type='yarn' but config.json's rope_type is 'default'"),
    ({"mscale_all_dim": 1.0}, "scale the attention softmax by"),
    ({"rotary_interleaved": True}, "rotary_interleaved=True"),
    ({"mtp_num_layers": 1}, "mtp_num_layers=1"),
    ({"moe_router_topk": 1}, "moe_router_topk=1"),
], ids=["eps", "softmax", "no_bias", "scaling", "groups", "freq", "shared", "gate", "head_dim", "yarn", "mscale",
        "interleaved", "mtp", "topk"])
def test_export_checks_the_saved_training_arguments(rope_save, tmp_path, changes, named):
    """What the shapes cannot show, from ``common.pt``'s ``args``: exit 3 naming the argument,
    nothing written."""
    path, _, _ = rope_save

    def change(common):
        for k, v in changes.items():
            setattr(common["args"], k, v)

    result = _export(fw_megatron.with_common(path, tmp_path, change), tmp_path / "hf", "--base", _base(tmp_path / "base"))
    assert result.exit_code == 3, result.output
    assert named in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "hf").exists()


def test_group_limited_routing_transformers_cannot_compute_is_refused(rope_save, tmp_path):
    """Megatron scores an expert group by its top ``topk // group_topk`` experts, transformers'
    DeepseekV3 by its top 2: 4 groups of which 2 are kept at top 2 is exit 3 even with a config
    that names the same groups."""
    path, _, _ = rope_save

    def change(common):
        common["args"].moe_router_num_groups, common["args"].moe_router_group_topk = 4, 2

    src = fw_megatron.with_common(path, tmp_path, change)
    result = _export(src, tmp_path / "hf", "--base", _base(tmp_path / "base", n_group=4, topk_group=2))
    assert result.exit_code == 3 and "scores a group by its top 1 experts" in result.output, result.output


@pytest.mark.parametrize("changes, named", [
    ({"num_key_value_heads": 2}, "num_key_value_heads 2 is not num_attention_heads 4"),
    ({"norm_topk_prob": False}, "norm_topk_prob is False"),
    ({"rms_norm_eps": 1e-5}, "config.json's rms_norm_eps is 1e-05"),
    ({"routed_scaling_factor": 1.0}, "routed_scaling_factor is 1.0"),
    ({"first_k_dense_replace": 0}, "config.json's first_k_dense_replace 0 of 3 layers"),
    ({"n_shared_experts": 2}, "n_shared_experts x moe_intermediate_size"),
    ({"q_lora_rank": 32}, "q_lora_rank=24 but config.json's q_lora_rank is 32"),
], ids=["kv_heads", "norm_topk", "eps", "scaling", "dense", "shared", "q_lora"])
def test_export_refuses_a_config_that_does_not_fit(rope_save, tmp_path, changes, named):
    path, _, _ = rope_save
    result = _export(path, tmp_path / "hf", "--base", _base(tmp_path / "base", **changes))
    assert result.exit_code == 3, result.output
    assert named in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "hf").exists()


def test_export_without_training_arguments_says_what_it_assumed(rope_save, tmp_path):
    """A save of the model alone: the shapes are checked, the export is the same, and a note says
    what was taken from config.json."""
    import torch
    from safetensors.torch import load_file

    path, _, _ = rope_save
    base = _base(tmp_path / "base")
    assert _export(path, tmp_path / "with_args", "--base", base).exit_code == 0
    result = _export(fw_megatron.with_common(path, tmp_path, lambda common: common.pop("args")), tmp_path / "hf", "--base", base)
    assert result.exit_code == 0, result.output
    assert "records no training arguments" in result.output and "latent norms' epsilon" in result.output
    a, b = load_file(tmp_path / "with_args" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_multi_token_prediction_layers_are_refused(tmp_path):
    """Megatron's MTP block (``mtp_num_layers=1``: ``mtp.layers.0.*``) has no place in transformers'
    DeepseekV3: exit 3 naming it, nothing written."""
    run_ranks(functools.partial(fw_megatron_mla.mla_job, mtp=True), 2, tmp_path, str(tmp_path / "save"))
    result = _export(tmp_path / "save", tmp_path / "hf", "--base", _base(tmp_path / "base"))
    assert result.exit_code == 3, result.output
    assert "multi-token prediction layers" in result.output and "mtp.layers.0." in result.output, result.output
    assert not (tmp_path / "hf").exists()


def test_inspect_reports_the_experts_of_a_save_with_dense_layers(rope_save):
    """``inspect --json`` of a save whose layers are not homogeneous (one key per layer,
    ``decoder.layers.1.mlp.experts.experts.linear_fc1.weight`` ``[E, 2F, H]``, no layer axis):
    the expert count is the first axis, not the second."""
    path, _, _ = rope_save
    info = json.loads(CliRunner().invoke(cli, ["inspect", str(path), "--json"]).output)
    assert info["layout"] == "megatron" and info["moe"] == {"num_experts": M["experts"], "layout": "stacked"}
