"""Export of a real Megatron-Core GPT with Llama-style settings to Hugging Face's LlamaForCausalLM.

``fw_megatron.llama_job`` saves a tiny ``GPTModel`` (RMSNorm, SwiGLU, no biases, RoPE, 4 heads in
2 query groups; untied and tied embeddings) with Megatron-Core 0.16.1's ``dist_checkpointing``
on 2 CPU ranks, and runs Megatron's own modules on a fixed input (``fw_megatron.probe``). The
export, with ``--base`` a LlamaConfig of matching shapes built here, must load in
``from_pretrained`` with no missing or unexpected keys, and HF's modules on the same input must
give what Megatron's gave: Q/K/V (``linear_qkv`` + ``get_query_key_value_tensors``) and the
same after each side's rotary embedding, ``o_proj``, the MLP, the norms; the embeddings and the
head bit-equal to Megatron's parameters; and HF's logits equal those of Megatron's own
whole-model forward on the same tokens (``fw_megatron.logits``: it runs on CPU when given the
causal mask and the CPU's RNG state for its CUDA RNG tracker).
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


# (tied embeddings, q/k/v biases): Llama untied and tied, Qwen2 (q/k/v biases)
@pytest.fixture(scope="module", params=[(False, False), (True, False), (False, True)], ids=["untied", "tied", "qwen2"])
def save(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_llama")
    tied, qkv_bias = request.param
    held = run_ranks(fw_megatron.llama_job, 2, root, str(root / "save"), tied, qkv_bias)[0]
    held["family"] = "qwen2" if qkv_bias else "llama"
    return root / "save", held, tied


def _base(path, *, tied: bool, family: str = "llama", **changes) -> str:
    from transformers import LlamaConfig, Qwen2Config

    settings = {"vocab_size": fw_megatron.VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": tied, **changes}
    (Qwen2Config if family == "qwen2" else LlamaConfig)(**settings).save_pretrained(path)
    return str(path)


def _export(src, dst, *args: str):
    return CliRunner().invoke(cli, ["export", str(src), str(dst), "--quiet", *args], catch_exceptions=False)


def _close(a, b, what: str) -> None:
    import torch

    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (what, (a - b).abs().max().item())


def test_export_loads_and_computes_what_megatron_computes(save, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # Qwen2's is the same

    path, held, tied = save
    family = held["family"]
    result = _export(path, tmp_path / "hf", "--base", _base(tmp_path / "base", tied=tied, family=family))
    assert result.exit_code == 0, result.output
    assert "left out optimizer state" in result.output  # export is model-only
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    weights = held["model"]
    sd = model.state_dict()
    assert torch.equal(sd["model.embed_tokens.weight"], weights["embedding.word_embeddings.weight"])
    assert torch.equal(sd["lm_head.weight"], weights["embedding.word_embeddings.weight" if tied else "output_layer.weight"])
    biases = [k for k in sd if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]
    assert len(biases) == (6 if family == "qwen2" else 0)
    assert all(sd[k].abs().min() > 0 for k in biases)  # trained a step: the split of each bias is seen
    probe = held["probe"]
    x = probe["x"][:, 0]  # [seq, hidden]: Megatron's [seq, batch=1, hidden]
    seq = x.shape[0]
    heads, groups, head_dim = 4, 2, 8
    positions = torch.arange(seq)[None]
    cos, sin = model.model.rotary_emb(x[None], positions)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            want = probe[i]
            att = layer.self_attn
            normed = layer.input_layernorm(x)
            _close(normed, want["input_norm"][:, 0], f"layer {i} input_layernorm")
            # Megatron's q/k/v are [seq, batch, heads, head_dim]; HF's projections [seq, heads * head_dim]
            q = att.q_proj(want["input_norm"][:, 0]).view(seq, heads, head_dim)
            k = att.k_proj(want["input_norm"][:, 0]).view(seq, groups, head_dim)
            v = att.v_proj(want["input_norm"][:, 0]).view(seq, groups, head_dim)
            for name, got in (("q", q), ("k", k), ("v", v)):
                _close(got, want[name][:, 0], f"layer {i} {name}")
            # RoPE: HF's rotate-half on [batch, heads, seq, head_dim] equals Megatron's non-interleaved rotary
            q_rot, k_rot = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
            _close(q_rot[0].transpose(0, 1), want["q_rot"][:, 0], f"layer {i} rotated q")
            _close(k_rot[0].transpose(0, 1), want["k_rot"][:, 0], f"layer {i} rotated k")
            _close(att.o_proj(want["context"][:, 0]), want["proj"][:, 0], f"layer {i} o_proj")
            _close(layer.mlp(layer.post_attention_layernorm(x)), want["mlp"][:, 0], f"layer {i} mlp")
        _close(model.model.norm(x), probe["final_norm"][:, 0], "final norm")
        # the whole model: HF's logits on the tokens Megatron's own forward ran on
        _close(model(torch.tensor(fw_megatron.TOKENS)).logits, held["logits"], "logits")


def test_export_drops_padded_vocabulary_rows_and_casts(save, tmp_path):
    """Megatron-LM pads the vocabulary; a config with fewer tokens takes the first rows."""
    import torch
    from safetensors.torch import load_file

    path, held, tied = save
    vocab = fw_megatron.VOCAB - 5
    result = _export(path, tmp_path / "hf", "--base",
                     _base(tmp_path / "base", tied=tied, family=held["family"], vocab_size=vocab), "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    got = load_file(tmp_path / "hf" / "model.safetensors")
    embed = held["model"]["embedding.word_embeddings.weight"]
    assert torch.equal(got["model.embed_tokens.weight"], embed[:vocab].to(torch.bfloat16))
    assert ("lm_head.weight" in got) == (not tied)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == vocab


@pytest.mark.parametrize("changes, named", [
    ({"num_key_value_heads": 4}, "query groups"),  # MHA config for a GQA model
    ({"intermediate_size": 128}, "gated MLP"),
    ({"model_type_override": "gpt2"}, "not mapped"),
], ids=["heads", "mlp", "family"])
def test_export_refuses_a_config_that_does_not_fit(save, tmp_path, changes, named):
    path, held, tied = save
    if "model_type_override" in changes:
        from transformers import GPT2Config

        GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=fw_megatron.VOCAB).save_pretrained(tmp_path / "base")
        base = str(tmp_path / "base")
    else:
        base = _base(tmp_path / "base", tied=tied, family=held["family"], **changes)
    result = _export(path, tmp_path / "hf", "--base", base)
    assert result.exit_code == 3, result.output
    assert named in result.output, result.output
    assert not (tmp_path / "hf").exists()


def test_convert_to_dcp_keeps_megatrons_names(save, tmp_path):
    path, _, _ = save
    result = CliRunner().invoke(cli, ["convert", str(path), str(tmp_path / "dcp"), "--to", "dcp", "--quiet"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    info = json.loads(CliRunner().invoke(cli, ["inspect", str(tmp_path / "dcp"), "--json", "--tensors"]).output)
    names = {t["name"] for t in info["tensors"] if t["group"] == "model"}
    assert "decoder.layers.self_attention.linear_qkv.weight" in names and not any("q_proj" in n for n in names)


def test_export_refuses_per_layer_megatron_names(save, tmp_path):
    """``model.state_dict()`` of the same GPT (``decoder.layers.0....``, layers not stacked) is
    not what the map reads: exit 3 saying so, nothing written."""
    import torch

    path, held, tied = save
    torch.save(held["model"], tmp_path / "model.pt")
    result = _export(tmp_path / "model.pt", tmp_path / "hf", "--base", _base(tmp_path / "base", tied=tied,
                                                                           family=held["family"]))
    assert result.exit_code == 3, result.output
    assert "per-layer names" in result.output and "decoder.layers.0." in result.output, result.output
    assert not (tmp_path / "hf").exists()


def test_export_refuses_lora_adapter_of_a_megatron_save(save, tmp_path):
    path, held, tied = save
    result = _export(path, tmp_path / "hf", "--base", _base(tmp_path / "base", tied=tied, family=held["family"]),
                     "--lora", "adapter")
    assert result.exit_code == 3 and "drop --lora adapter" in result.output, result.output
    assert not (tmp_path / "hf").exists()


def test_export_from_a_bucket_equals_local(save, tmp_path):
    """From a bucket the export plans from the fetched headers and moves the row ranges of the
    stacked tensors it maps: the same safetensors as from the local copy."""
    from s3server import bucket_with, ckpt_with
    from safetensors.torch import load_file

    path, held, tied = save
    base = _base(tmp_path / "base", tied=tied, family=held["family"])
    with bucket_with(tmp_path / "s3", path, "save") as (env, _):
        r = ckpt_with(env, "export", "s3://ckpt/save", str(tmp_path / "remote"), "--base", base, "--quiet")
        assert r.returncode == 0, r.stderr
    assert _export(path, tmp_path / "local", "--base", base).exit_code == 0
    a, b = load_file(tmp_path / "local" / "model.safetensors"), load_file(tmp_path / "remote" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].equal(b[k]) for k in a)


@pytest.mark.parametrize("arg, value", [("rotary_interleaved", True), ("swiglu", False), ("normalization", "LayerNorm"),
                                        ("norm_epsilon", 1e-6), ("rotary_base", 500000), ("num_query_groups", 4),
                                        ("use_rope_scaling", True), ("untie_embeddings_and_output_weights", None)])
def test_export_checks_the_saved_training_arguments(save, tmp_path, arg, value):
    """Megatron-LM's ``args`` in ``common.pt`` say what the shapes cannot (the activation, the
    rotary convention, epsilon, theta): an export whose config or map differs is exit 3 naming
    the argument, nothing written."""
    path, held, tied = save

    def change(common):
        args = common["args"]
        setattr(args, arg, tied if value is None else value)  # None: untie flipped

    src = fw_megatron.with_common(path, tmp_path, change)
    result = _export(src, tmp_path / "hf", "--base", _base(tmp_path / "base", tied=tied, family=held["family"]))
    assert result.exit_code == 3, result.output
    assert f"{arg}=" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "hf").exists()


def test_export_checks_the_activation_against_the_arguments(save, tmp_path):
    """``swiglu`` in the arguments, a config whose ``hidden_act`` is not SiLU: exit 3."""
    path, held, tied = save
    result = _export(path, tmp_path / "hf", "--base", _base(tmp_path / "base", tied=tied, family=held["family"],
                                                             hidden_act="gelu"))
    assert result.exit_code == 3 and "hidden_act is 'gelu'" in result.output, result.output


def test_export_without_training_arguments_says_what_it_assumed(save, tmp_path):
    """A Megatron-Core save of the model alone (no ``args``): the shapes are checked, and a note
    says SwiGLU, RMSNorm and the rotary convention were taken from config.json."""
    import torch
    from safetensors.torch import load_file

    path, held, tied = save
    base = _base(tmp_path / "base", tied=tied, family=held["family"])
    with_args = _export(path, tmp_path / "hf_args", "--base", base)
    assert with_args.exit_code == 0 and "training arguments" not in with_args.output, with_args.output
    src = fw_megatron.with_common(path, tmp_path, lambda common: common.pop("args"))
    result = _export(src, tmp_path / "hf", "--base", base)
    assert result.exit_code == 0, result.output
    assert "records no training arguments" in result.output and "only the shapes are checked" in result.output
    a, b = load_file(tmp_path / "hf_args" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unreadable_training_arguments_are_not_unpickled(save, tmp_path):
    """``args`` holding a class the reader does not admit: never constructed; the export goes on as
    without arguments, saying they could not be read."""
    from pathlib import PurePosixPath

    path, held, tied = save
    src = fw_megatron.with_common(path, tmp_path, lambda common: setattr(common["args"], "data_path", PurePosixPath("/data")))
    result = _export(src, tmp_path / "hf", "--base", _base(tmp_path / "base", tied=tied, family=held["family"]))
    assert result.exit_code == 0, result.output
    assert "could not be read" in result.output and "PurePosixPath" in result.output


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2_pp2"])
def test_tensor_and_pipeline_parallel_saves_export_as_megatrons_own_reshard(tp, pp, tmp_path):
    """A save made at tensor and/or pipeline parallel 2 (row-parallel ``linear_proj`` and
    ``linear_fc2`` stored split across columns, SwiGLU's ``linear_fc1`` split in both halves, each
    pipeline stage its own layers, the embedding padded for the tensor-parallel ranks) exports to
    exactly what the export of the same weights gives after Megatron-Core's own
    ``dist_checkpointing.load`` into a tensor- and pipeline-parallel-1 model saved again; and the
    export loads in ``from_pretrained``."""
    import functools

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    save, again = tmp_path / "save", tmp_path / "tp1"
    run_ranks(functools.partial(fw_megatron.llama_job, tp=tp, pp=pp), tp * pp, tmp_path, str(save))
    run_ranks(functools.partial(fw_megatron.resave, vocab=fw_megatron.padded_vocab(tp)), 1, tmp_path, str(save),
              str(again))
    base = _base(tmp_path / "base", tied=False)
    for src, dst in ((save, tmp_path / "hf"), (again, tmp_path / "hf_tp1")):
        result = _export(src, dst, "--base", base)
        assert result.exit_code == 0, result.output
    got, want = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf_tp1" / "model.safetensors")
    assert got.keys() == want.keys() and len(got) == 21
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


# -- Mixture-of-Experts: Megatron-Core's MoE layer (router, SequentialMLP experts) saved at expert
# parallel 2 on 2 CPU ranks, exported to qwen3_moe (QK-norm, per-expert gate/up/down_proj) and
# mixtral (block_sparse_moe.experts.{e}.w1/w2/w3), what save_pretrained writes for each

@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_save(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"megatron_{request.param}")
    held = run_ranks(fw_megatron.moe_job, 2, root, str(root / "save"), request.param)
    return root / "save", held, request.param


def _moe_base(path, family: str, **changes) -> str:
    from transformers import MixtralConfig, Qwen3MoeConfig

    m = fw_megatron.MOE
    settings = {"vocab_size": fw_megatron.VOCAB, "hidden_size": m["hidden"], "num_hidden_layers": 2,
                "num_attention_heads": m["heads"], "num_key_value_heads": m["groups"], "head_dim": m["head_dim"],
                "num_experts_per_tok": m["topk"], "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0, "tie_word_embeddings": False}
    if family == "qwen3_moe":  # Megatron's default router normalizes the top-k weights
        settings.update(intermediate_size=m["ffn"], moe_intermediate_size=m["expert_ffn"], num_experts=m["experts"],
                        norm_topk_prob=True)
        cls = Qwen3MoeConfig
    else:
        settings.update(intermediate_size=m["expert_ffn"], num_local_experts=m["experts"])
        cls = MixtralConfig
    settings.update(changes)
    cls(**settings).save_pretrained(path)
    return str(path)


def test_moe_export_is_what_save_pretrained_writes_and_computes_what_megatron_computes(moe_save, tmp_path):
    """The export loads with no missing or unexpected keys; its file is what ``save_pretrained``
    of the loaded model writes (names and bytes); every expert, the router and the QK-norms are
    Megatron's parameters bit for bit (each rank's experts by their global number); and HF's
    modules on Megatron's inputs give what Megatron's gave: Q/K/V (after QK-norm), rotary,
    ``o_proj``, the router's logits and top-k weights, each expert's MLP, the whole MoE block
    (Megatron's forward across the two expert-parallel ranks), the final norm; and HF's logits
    equal those of Megatron's own whole-model forward on the same tokens."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    path, held, family = moe_save
    result = _export(path, tmp_path / "hf", "--base", _moe_base(tmp_path / "base", family))
    assert result.exit_code == 0, result.output
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert type(model).__name__ == {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[family]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    written = load_file(tmp_path / "hf" / "model.safetensors")
    model.save_pretrained(tmp_path / "resaved")
    resaved = load_file(tmp_path / "resaved" / "model.safetensors")
    assert written.keys() == resaved.keys() and all(torch.equal(written[k], resaved[k]) for k in written)
    m = fw_megatron.MOE
    inter, mlp = m["expert_ffn"], "mlp" if family == "qwen3_moe" else "block_sparse_moe"
    gate, up, down = ("gate_proj", "up_proj", "down_proj") if family == "qwen3_moe" else ("w1", "w3", "w2")
    seen = set()
    for rank in held:  # rank r holds experts 2r, 2r+1 of each layer
        for (layer, e), w in rank["experts"].items():
            at = f"model.layers.{layer}.{mlp}.experts.{e}."
            assert torch.equal(written[f"{at}{gate}.weight"], w["fc1"][:inter])
            assert torch.equal(written[f"{at}{up}.weight"], w["fc1"][inter:])
            assert torch.equal(written[f"{at}{down}.weight"], w["fc2"])
            seen.add((layer, e))
    assert seen == {(layer, e) for layer in range(2) for e in range(m["experts"])}
    weights = held[0]["model"]
    for layer in range(2):
        assert torch.equal(written[f"model.layers.{layer}.{mlp}.gate.weight"],
                           weights[f"decoder.layers.{layer}.mlp.router.weight"])
        if family == "qwen3_moe":
            for qk in ("q", "k"):
                assert torch.equal(written[f"model.layers.{layer}.self_attn.{qk}_norm.weight"],
                                   weights[f"decoder.layers.{layer}.self_attention.{qk}_layernorm.weight"])
    probe = held[0]["probe"]
    x = probe["x"][:, 0]
    seq, heads, groups, head_dim = x.shape[0], m["heads"], m["groups"], m["head_dim"]
    cos, sin = model.model.rotary_emb(x[None], torch.arange(seq)[None])
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            want, att = probe[i], layer.self_attn
            normed = want["input_norm"][:, 0]
            _close(layer.input_layernorm(x), normed, f"layer {i} input_layernorm")
            q = att.q_proj(normed).view(seq, heads, head_dim)
            k = att.k_proj(normed).view(seq, groups, head_dim)
            v = att.v_proj(normed).view(seq, groups, head_dim)
            if family == "qwen3_moe":  # Megatron's get_query_key_value_tensors applies its q/k_layernorm
                q, k = att.q_norm(q), att.k_norm(k)
            for name, got in (("q", q), ("k", k), ("v", v)):
                _close(got, want[name][:, 0], f"layer {i} {name}")
            q_rot, k_rot = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
            _close(q_rot[0].transpose(0, 1), want["q_rot"][:, 0], f"layer {i} rotated q")
            _close(k_rot[0].transpose(0, 1), want["k_rot"][:, 0], f"layer {i} rotated k")
            _close(att.o_proj(want["context"][:, 0]), want["proj"][:, 0], f"layer {i} o_proj")
            moe_in = want["moe_in"][:, 0]
            _close(layer.post_attention_layernorm(x), moe_in, f"layer {i} post_attention_layernorm")
            block = getattr(layer, "mlp")
            logits, top_w, top_i = block.gate(moe_in)
            _close(logits, want["router_logits"][:, 0], f"layer {i} router logits")
            dense = torch.zeros_like(logits).scatter(1, top_i, top_w)  # Megatron's [tokens, E] form
            assert torch.equal(dense != 0, want["routing_map"]), f"layer {i} chosen experts"
            _close(dense, want["router_probs"], f"layer {i} top-k weights")
            for rank in held:
                for e, out in rank["probe"][i]["experts"].items():
                    one = block.experts(moe_in, torch.full((seq, 1), e), torch.ones(seq, 1))
                    _close(one, out, f"layer {i} expert {e}")
            _close(block(moe_in[None])[0], want["mlp"][:, 0], f"layer {i} MoE block")
        _close(model.model.norm(x), probe["final_norm"][:, 0], "final norm")
        # and the whole model: HF's logits on the tokens Megatron's own forward ran on
        tokens = torch.tensor(held[0]["tokens"])
        want = held[0]["logits"]
        assert all(torch.equal(rank["logits"], want) for rank in held)  # both expert-parallel ranks agree
        _close(model(tokens).logits, want, "logits")


@pytest.mark.parametrize("changes, named", [
    ({"experts": 8}, "router.weight: holds 4 experts (its axis after the layer) but config.json says 8"),
    ({"width": 16}, "linear_fc1.weight: one layer is [4, 64, 64]"),
], ids=["count", "width"])
def test_moe_export_refuses_a_config_whose_experts_differ(moe_save, tmp_path, changes, named):
    """A config whose expert count or width is not the save's: exit 3 naming the Megatron
    tensor, nothing written."""
    path, _, family = moe_save
    count, width = ("num_experts", "moe_intermediate_size") if family == "qwen3_moe" else (
        "num_local_experts", "intermediate_size")
    base = _moe_base(tmp_path / "base", family, **({count: changes["experts"]} if "experts" in changes else
                                                    {width: changes["width"]}))
    result = _export(path, tmp_path / "hf", "--base", base)
    assert result.exit_code == 3, result.output
    assert named in result.output and "decoder.layers.mlp." in result.output, result.output
    assert not (tmp_path / "hf").exists()


def test_moe_export_refuses_other_families_by_name(moe_save, tmp_path):
    """A DeepSeek-V3 config (multi-latent attention: tests/test_megatron_deepseek.py) names this
    save's grouped-query attention it has no place for; DeepSeek-V2 is refused by name; a dense
    family's config names the MoE tensors it has no place for."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    path, _, family = moe_save
    DeepseekV3Config(vocab_size=fw_megatron.VOCAB, hidden_size=64, num_hidden_layers=2,
                     n_routed_experts=4).save_pretrained(tmp_path / "ds")
    result = _export(path, tmp_path / "hf", "--base", str(tmp_path / "ds"))
    assert result.exit_code == 3 and "'deepseek_v3'" in result.output, result.output
    assert "grouped-query attention (linear_qkv)" in result.output, result.output
    DeepseekV2Config(vocab_size=fw_megatron.VOCAB, hidden_size=64, num_hidden_layers=2,
                     n_routed_experts=4).save_pretrained(tmp_path / "ds2")
    result = _export(path, tmp_path / "hf", "--base", str(tmp_path / "ds2"))
    assert result.exit_code == 3 and "'deepseek_v2'" in result.output and "deepseek_v3 only" in result.output
    result = _export(path, tmp_path / "hf", "--base", _base(tmp_path / "llama", tied=False, hidden_size=64))
    assert result.exit_code == 3, result.output
    assert "MoE experts" in result.output and "an MoE router" in result.output, result.output
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("arg, value, named", [
    ("moe_router_topk", 4, "moe_router_topk=4 but config.json's num_experts_per_tok is 2"),
    ("moe_router_pre_softmax", True, "moe_router_pre_softmax=True"),
    ("moe_router_score_function", "sigmoid", "moe_router_score_function='sigmoid'"),
    ("moe_shared_expert_intermediate_size", 64, "moe_shared_expert_intermediate_size=64"),
    ("qk_layernorm", None, "qk_layernorm="),
])
def test_moe_export_checks_the_saved_training_arguments(moe_save, tmp_path, arg, value, named):
    """The router's settings the shapes cannot show (top-k, softmax before or after it, the score
    function, shared experts) and QK-norm, from ``common.pt``'s ``args``: exit 3 naming them."""
    path, _, family = moe_save

    def change(common):  # None: QK-norm flipped from what the family has
        setattr(common["args"], arg, family != "qwen3_moe" if value is None else value)

    src = fw_megatron.with_common(path, tmp_path, change)
    result = _export(src, tmp_path / "hf", "--base", _moe_base(tmp_path / "base", family))
    assert result.exit_code == 3, result.output
    assert named in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "hf").exists()


def test_moe_router_normalization_is_checked(moe_save, tmp_path):
    """Megatron's default router normalizes the top-k weights (``moe_router_pre_softmax=False``):
    a qwen3_moe config with ``norm_topk_prob`` false is exit 3 (Mixtral always normalizes);
    without training arguments the export says in a note that the router's weighing was taken
    from config.json."""
    path, _, family = moe_save
    if family == "qwen3_moe":
        result = _export(path, tmp_path / "hf", "--base", _moe_base(tmp_path / "base", family, norm_topk_prob=False))
        assert result.exit_code == 3 and "config.json's norm_topk_prob is False" in result.output, result.output
    src = fw_megatron.with_common(path, tmp_path, lambda common: common.pop("args"))
    result = _export(src, tmp_path / "hf", "--base", _moe_base(tmp_path / "base2", family))
    assert result.exit_code == 0 and "top-k weighing" in result.output, result.output


def test_moe_expert_parallel_save_exports_as_megatrons_own_reshard(moe_save, tmp_path):
    """The expert-parallel-2 save (each rank's experts stored as its own pieces of the global
    ``[L, E, 2F, H]`` tensor) exports to exactly what the export of the same weights gives after
    Megatron-Core's own ``dist_checkpointing.load`` into an expert-parallel-1 model saved again."""
    import torch
    from safetensors.torch import load_file

    path, _, family = moe_save
    again = tmp_path / "ep1"
    run_ranks(fw_megatron.moe_resave, 1, tmp_path, str(path), str(again), family)
    base = _moe_base(tmp_path / "base", family)
    for src, dst in ((path, tmp_path / "hf"), (again, tmp_path / "hf_ep1")):
        result = _export(src, dst, "--base", base)
        assert result.exit_code == 0, result.output
    got, want = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf_ep1" / "model.safetensors")
    assert got.keys() == want.keys() and len(got) == 3 + 2 * (7 + 3 * fw_megatron.MOE["experts"] + (
        2 if family == "qwen3_moe" else 0))  # per layer: q/k/v/o, 2 norms, router, experts (+ QK-norms)
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]


def test_moe_save_of_layers_not_homogeneous_exports(tmp_path):
    """``moe_layer_freq=[0, 1]`` (a dense first layer) at expert parallel 2: Megatron saves one key
    per layer (``decoder.layers.1.mlp.router.weight`` ``[E, H]``). With a qwen3_moe config whose
    ``mlp_only_layers`` is ``[0]`` the export loads with no missing or unexpected keys, is what
    ``save_pretrained`` writes, and holds Megatron's dense MLP and experts bit for bit; a config
    that says every layer is MoE is exit 3 (the architecture check), nothing written."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    held = run_ranks(fw_megatron.moe_uneven_job, 2, tmp_path, str(tmp_path / "save"))
    info = json.loads(CliRunner().invoke(cli, ["inspect", str(tmp_path / "save"), "--json", "--tensors"]).output)
    assert [t["shape"] for t in info["tensors"] if t["name"] == "decoder.layers.1.mlp.router.weight"] == [[4, 64]]
    result = _export(tmp_path / "save", tmp_path / "all_moe", "--base", _moe_base(tmp_path / "b1", "qwen3_moe"))
    assert result.exit_code == 3 and "model.layers.0.mlp" in result.output, result.output
    assert not (tmp_path / "all_moe").exists()
    base = _moe_base(tmp_path / "b2", "qwen3_moe", mlp_only_layers=[0])
    result = _export(tmp_path / "save", tmp_path / "hf", "--base", base)
    assert result.exit_code == 0, result.output
    model, loading = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"] and not loading["mismatched_keys"], loading
    written = load_file(tmp_path / "hf" / "model.safetensors")
    model.save_pretrained(tmp_path / "resaved")
    resaved = load_file(tmp_path / "resaved" / "model.safetensors")
    assert written.keys() == resaved.keys() and all(torch.equal(written[k], resaved[k]) for k in written)
    dense, ffn, inter = held[0]["model"], fw_megatron.MOE["ffn"], fw_megatron.MOE["expert_ffn"]
    assert torch.equal(written["model.layers.0.mlp.gate_proj.weight"], dense["decoder.layers.0.mlp.linear_fc1.weight"][:ffn])
    assert torch.equal(written["model.layers.0.mlp.up_proj.weight"], dense["decoder.layers.0.mlp.linear_fc1.weight"][ffn:])
    assert torch.equal(written["model.layers.0.mlp.down_proj.weight"], dense["decoder.layers.0.mlp.linear_fc2.weight"])
    assert torch.equal(written["model.layers.1.mlp.gate.weight"], dense["decoder.layers.1.mlp.router.weight"])
    experts = {k: w for rank in held for k, w in rank["experts"].items()}
    assert sorted(e for _, e in experts) == [0, 1, 2, 3]
    for (layer, e), w in experts.items():
        at = f"model.layers.{layer}.mlp.experts.{e}."
        assert torch.equal(written[at + "gate_proj.weight"], w["fc1"][:inter])
        assert torch.equal(written[at + "up_proj.weight"], w["fc1"][inter:])
        assert torch.equal(written[at + "down_proj.weight"], w["fc2"])


def test_moe_expert_tensor_parallel_save_exports_as_megatrons_own_reshard(tmp_path):
    """A qwen3_moe save at expert tensor parallel 2 (each expert's ``[gate; up]`` split in both
    halves across the ranks, its ``linear_fc2`` split on its columns) exports to exactly what
    Megatron's own reshard to one rank exports to."""
    import functools

    import torch
    from safetensors.torch import load_file

    save, again = tmp_path / "save", tmp_path / "etp1"
    run_ranks(functools.partial(fw_megatron.moe_job, ep=1, etp=2), 2, tmp_path, str(save), "qwen3_moe")
    run_ranks(fw_megatron.moe_resave, 1, tmp_path, str(save), str(again), "qwen3_moe")
    base = _moe_base(tmp_path / "base", "qwen3_moe")
    for src, dst in ((save, tmp_path / "hf"), (again, tmp_path / "hf_etp1")):
        result = _export(src, dst, "--base", base)
        assert result.exit_code == 0, result.output
    got, want = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf_etp1" / "model.safetensors")
    assert got.keys() == want.keys() and "model.layers.1.mlp.experts.3.down_proj.weight" in got
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
