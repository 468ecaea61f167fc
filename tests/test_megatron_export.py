"""Export of a real Megatron-Core GPT with Llama-style settings to Hugging Face's LlamaForCausalLM.

``fw_megatron.llama_job`` saves a tiny ``GPTModel`` (RMSNorm, SwiGLU, no biases, RoPE, 4 heads in
2 query groups; untied and tied embeddings) with Megatron-Core 0.16.1's ``dist_checkpointing``
on 2 CPU ranks, and runs Megatron's own modules on a fixed input (``fw_megatron.probe``: the
whole model's forward does not run on CPU, its attention forks the CUDA RNG tracker). The
export, with ``--base`` a LlamaConfig of matching shapes built here, must load in
``from_pretrained`` with no missing or unexpected keys, and HF's modules on the same input must
give what Megatron's gave: Q/K/V (``linear_qkv`` + ``get_query_key_value_tensors``) and the
same after each side's rotary embedding, ``o_proj``, the MLP, the norms; the embeddings and the
head bit-equal to Megatron's parameters.
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


def _with_common(save_dir, tmp_path, change) -> str:
    """A copy of the save whose ``common.pt`` (the test's own file, so loaded whole) is changed."""
    import shutil

    import torch

    copy = tmp_path / "changed"
    shutil.copytree(save_dir, copy)
    common = torch.load(copy / "common.pt", weights_only=False)
    change(common)
    torch.save(common, copy / "common.pt")
    return str(copy)


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

    src = _with_common(path, tmp_path, change)
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
    src = _with_common(path, tmp_path, lambda common: common.pop("args"))
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
    src = _with_common(path, tmp_path, lambda common: setattr(common["args"], "data_path", PurePosixPath("/data")))
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
