"""Quantized weights in and out: block FP8, MXFP4 and compressed-tensors FP8 sources dequantized
(bit-equal to the reference formulas and to transformers' own dequantization, loaded by
``from_pretrained``), kept quantized without ``--dtype``, ``export --quantize`` (fp8-dynamic bit
for bit what llm-compressor writes, fixtures/fp8_dynamic/; fp8-block loaded by transformers'
FP8 loader), ``inspect``'s report, and bad input refused with exit 3 naming the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (rank files hold DTensors: torch.load needs the class)
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import ckpt_tools
from ckpt_tools.cli.main import main as cli

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "fp8_dynamic"
FP8 = torch.float8_e4m3fn


def run(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(cli, [*map(str, args), "--quiet"], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def block_quantize(w: torch.Tensor, block=(128, 128), ue8m0: bool = False):
    """The reference recipe (DeepSeek/transformers): per block, scale = absmax / 448, codes = w / scale."""
    rows, cols = w.shape
    gr, gc = -(-rows // block[0]), -(-cols // block[1])
    s = torch.empty(gr, gc)
    q = torch.empty(rows, cols, dtype=FP8)
    for i in range(gr):
        for j in range(gc):
            x = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
            a = x.abs().max()
            sc = a / 448 if a > 0 else torch.tensor(1.0)
            if ue8m0:
                sc = torch.pow(2.0, torch.ceil(torch.log2(sc)))
            s[i, j] = sc
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (x / sc).clamp(-448, 448).to(FP8)
    return q, s


def block_dequant(q: torch.Tensor, s: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """``w = float32(q) * s[i // bh, j // bw]`` (DeepSeek-V3's weight_dequant), in float32."""
    rows, cols = q.shape
    full = s.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return q.float() * full


def llama(path: Path, *, hidden=128, inter=256, vocab=256, layers=2, tie=False) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=tie)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def logits(path: Path, **kw) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kw)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    with torch.no_grad():
        return model(torch.arange(3, 19).view(1, 16) % model.config.vocab_size).logits.float()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return llama(tmp_path_factory.mktemp("tiny") / "bf16")


@pytest.fixture(scope="module")
def fp8_block(tiny, tmp_path_factory) -> Path:
    """A block-FP8 checkpoint of ``tiny`` made with ``export --quantize fp8-block``."""
    out = tmp_path_factory.mktemp("blk") / "fp8"
    run("export", tiny, out, "--quantize", "fp8-block")
    return out


def write_hf(path: Path, tensors: dict, config: dict, *, shards: dict[str, list[str]] | None = None) -> Path:
    path.mkdir(parents=True)
    if shards is None:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map = {}
        for file, names in shards.items():
            save_file({n: tensors[n] for n in names}, path / file, metadata={"format": "pt"})
            weight_map.update({n: file for n in names})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    return path


FP8_CONFIG = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                      "activation_scheme": "dynamic", "fmt": "e4m3"}}


# -- block FP8 in ---------------------------------------------------------------------------

@pytest.mark.parametrize("ue8m0", [False, True], ids=["f32-scales", "ue8m0-bf16-scales"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_block_fp8_partial_blocks_dequantize_bit_equal_to_the_formula(tmp_path, dtype, ue8m0):
    """Edge blocks partial in both dimensions, the scale in another shard than its weight."""
    torch.manual_seed(1)
    w = torch.randn(300, 200) * torch.exp(torch.randn(300, 1))
    q, s = block_quantize(w, ue8m0=ue8m0)
    s = s.to(torch.bfloat16) if ue8m0 else s
    tensors = {"layer.weight": q, "layer.weight_scale_inv": s, "norm.weight": torch.randn(200, dtype=torch.bfloat16)}
    cfg = json.loads(json.dumps(FP8_CONFIG))
    if ue8m0:
        cfg["quantization_config"]["scale_fmt"] = "ue8m0"
    src = write_hf(tmp_path / "src", tensors, cfg, shards={"model-00001-of-00002.safetensors": ["layer.weight"],
                                                            "model-00002-of-00002.safetensors": ["layer.weight_scale_inv", "norm.weight"]})
    want = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    run("convert", src, tmp_path / "out", "--to", "hf", "--no-arch-check", "--dtype", dtype)
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == {"layer.weight", "norm.weight"}  # no scale left
    assert got["layer.weight"].dtype == want
    assert torch.equal(got["layer.weight"], block_dequant(q, s).to(want))
    assert torch.equal(got["norm.weight"], tensors["norm.weight"].to(want))
    # the torch writer (no span path: values computed from tensors) gives the same bits
    run("convert", src, tmp_path / "out.pt", "--to", "torch", "--dtype", dtype)
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["layer.weight"], got["layer.weight"])


def test_block_fp8_with_e8m0_scales(tmp_path):
    """DeepSeek-V3.1-style ue8m0 scales stored as float8_e8m0fnu (F8_E8M0): 2 ** (e - 127)."""
    torch.manual_seed(5)
    q, s = block_quantize(torch.randn(256, 384), ue8m0=True)
    e8 = s.to(torch.float8_e8m0fnu)
    assert torch.equal(e8.float(), s)  # powers of two: exact
    cfg = {"quantization_config": {**FP8_CONFIG["quantization_config"], "scale_fmt": "ue8m0"}}
    src = write_hf(tmp_path / "src", {"l.weight": q, "l.weight_scale_inv": e8}, cfg)
    run("convert", src, tmp_path / "out", "--to", "hf", "--no-arch-check", "--dtype", "bf16")
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(got["l.weight"], block_dequant(q, s).to(torch.bfloat16))


def test_block_fp8_export_bf16_equals_transformers_dequantization_and_loads(fp8_block, tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    run("export", fp8_block, tmp_path / "deq", "--dtype", "bf16")
    got = load_file(tmp_path / "deq" / "model.safetensors")
    config = json.loads((tmp_path / "deq" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert not [n for n in got if "scale" in n]
    # transformers' FP8 loader on CPU dequantizes (Fp8Dequantize): the same bits
    reference = AutoModelForCausalLM.from_pretrained(fp8_block).state_dict()
    assert all(torch.equal(reference[n], got[n]) for n in got)
    # and the dequantized model is the bf16 model within FP8's rounding
    assert (logits(tmp_path / "deq") - logits(tiny)).abs().max() < 0.1


@pytest.mark.parametrize("world_size", [1, 3])
def test_block_fp8_to_rank_files_dequantizes_each_ranks_rows(fp8_block, tmp_path, world_size):
    """Shard(0) rows that do not start on a block boundary (3 ranks of 128 rows: 43, 43, 42)."""
    run("export", fp8_block, tmp_path / "deq", "--dtype", "bf16")
    full = load_file(tmp_path / "deq" / "model.safetensors")
    run("convert", fp8_block, tmp_path / "sh", "--to", "sharded", "--world-size", world_size, "--dtype", "bf16")
    parts = [torch.load(tmp_path / "sh" / f"model_world_size_{world_size}_rank_{r}.pt", weights_only=True)
             for r in range(world_size)]
    assert set(parts[0]) == set(full)
    for name, value in full.items():
        assert torch.equal(torch.cat([p[name].to_local() for p in parts]), value), name
    config = json.loads((tmp_path / "sh" / "huggingface" / "config.json").read_text())
    assert "quantization_config" not in config


def test_quantized_kept_quantized_without_dtype_and_dequantized_later(fp8_block, tmp_path):
    """No --dtype: codes and scales move together, bit for bit (hf → dcp → hf), and the DCP copy
    dequantizes (--base for the config) to the same bits as the original."""
    src = load_file(fp8_block / "model.safetensors")
    run("convert", fp8_block, tmp_path / "dcp", "--to", "dcp")
    run("convert", tmp_path / "dcp", tmp_path / "back", "--to", "hf")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert set(back) == set(src)
    assert all(back[n].dtype == src[n].dtype and torch.equal(back[n].view(torch.uint8), src[n].view(torch.uint8))
               for n in src)
    run("export", fp8_block, tmp_path / "a", "--dtype", "bf16")
    run("convert", tmp_path / "dcp", tmp_path / "b", "--to", "hf", "--dtype", "bf16", "--base", fp8_block)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_export_without_dtype_keeps_codes_scales_and_config(fp8_block, tmp_path):
    run("export", fp8_block, tmp_path / "same")
    src, got = load_file(fp8_block / "model.safetensors"), load_file(tmp_path / "same" / "model.safetensors")
    assert set(got) == set(src)
    assert all(got[n].dtype == src[n].dtype and torch.equal(got[n].view(torch.uint8), src[n].view(torch.uint8))
               for n in src)
    config = json.loads((tmp_path / "same" / "config.json").read_text())
    assert config["quantization_config"] == json.loads((fp8_block / "config.json").read_text())["quantization_config"]
    assert config["dtype"] == "bfloat16"


def test_moe_per_expert_fp8_weights_dequantize_per_expert(tmp_path):
    """A DeepSeek-V3-shaped layer: per-expert FP8 weights, each with its scale; the router and
    shared experts' norms unquantized."""
    torch.manual_seed(2)
    tensors, want = {}, {}
    for e in range(3):
        for proj, shape in (("gate_proj", (96, 160)), ("down_proj", (160, 96))):
            w = torch.randn(shape)
            q, s = block_quantize(w)
            name = f"model.layers.3.mlp.experts.{e}.{proj}.weight"
            tensors[name], tensors[name + "_scale_inv"] = q, s
            want[name] = block_dequant(q, s).to(torch.bfloat16)
    tensors["model.layers.3.mlp.gate.weight"] = want["model.layers.3.mlp.gate.weight"] = torch.randn(3, 160).bfloat16()
    src = write_hf(tmp_path / "src", tensors, FP8_CONFIG)
    run("convert", src, tmp_path / "out", "--to", "hf", "--no-arch-check", "--dtype", "bf16")
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)


# -- MXFP4 in -------------------------------------------------------------------------------

def test_mxfp4_experts_dequantize_as_transformers_does_and_load(tmp_path):
    from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM, Mxfp4Config
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                       layer_types=["full_attention"])
    GptOssForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    tensors = {}
    g = torch.Generator().manual_seed(1)
    for name, v in load_file(tmp_path / "bf16" / "model.safetensors").items():
        if ".experts." in name and name.endswith(("gate_up_proj", "down_proj")):
            e, h, o = v.shape  # transformers holds [E, in, out]; the hub packs [E, out, in / 32, 16]
            tensors[name + "_blocks"] = torch.randint(0, 256, (e, o, h // 32, 16), dtype=torch.uint8, generator=g)
            tensors[name + "_scales"] = torch.randint(118, 131, (e, o, h // 32), dtype=torch.uint8, generator=g)
        else:
            tensors[name] = v
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    src = write_hf(tmp_path / "mx", tensors, config)
    out = run("inspect", src, "--json")
    assert json.loads(out)["quantization"] == {"method": "mxfp4", "block_size": [1, 32], "quantized_tensors": 2}

    run("export", src, tmp_path / "deq", "--dtype", "bf16")
    got = load_file(tmp_path / "deq" / "model.safetensors")
    for proj in ("gate_up_proj", "down_proj"):
        n = f"model.layers.0.mlp.experts.{proj}"
        ref = convert_moe_packed_tensors(tensors[n + "_blocks"], tensors[n + "_scales"], dtype=torch.bfloat16)
        assert torch.equal(got[n], ref), n
    assert not [n for n in got if n.endswith(("_blocks", "_scales"))]
    reference = logits(src, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16)
    assert torch.equal(logits(tmp_path / "deq"), reference)
    # rank files: 4 experts over 3 ranks (2, 2, 0), each rank's experts dequantized and transposed
    run("convert", src, tmp_path / "sh", "--to", "sharded", "--world-size", "3", "--dtype", "bf16")
    parts = [torch.load(tmp_path / "sh" / f"model_world_size_3_rank_{r}.pt", weights_only=True) for r in range(3)]
    assert all(torch.equal(torch.cat([p[n].to_local() for p in parts]), v) for n, v in got.items())


# -- compressed-tensors FP8 in / fp8-dynamic out --------------------------------------------

def test_fp8_dynamic_export_is_what_llm_compressor_writes(tmp_path):
    """fixtures/fp8_dynamic/quantized is llm-compressor 0.14.0.1's FP8_DYNAMIC save of
    fixtures/fp8_dynamic/source (make_reference.py): the same tensors, scales and config."""
    run("export", FIXTURE / "source", tmp_path / "q", "--quantize", "fp8-dynamic")
    got = load_file(tmp_path / "q" / "model.safetensors")
    ref = load_file(FIXTURE / "quantized" / "model.safetensors")
    assert set(got) == set(ref)
    for n in ref:
        assert got[n].dtype == ref[n].dtype and got[n].shape == ref[n].shape, n
        assert torch.equal(got[n].view(torch.uint8), ref[n].view(torch.uint8)), n
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    want = json.loads((FIXTURE / "quantized" / "config.json").read_text())
    assert config["quantization_config"] == want["quantization_config"]
    assert config["dtype"] == "bfloat16"


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_compressed_tensors_dequantize_with_per_channel_scales(tmp_path, dtype):
    ref = load_file(FIXTURE / "quantized" / "model.safetensors")
    want = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    run("export", FIXTURE / "quantized", tmp_path / "deq", "--dtype", dtype)
    got = load_file(tmp_path / "deq" / "model.safetensors")
    assert set(got) == {n for n in ref if not n.endswith("_scale")}
    for n, v in got.items():
        if n + "_scale" in ref:  # compressed-tensors: x_q.to(scale.dtype) * scale, exact in float32
            assert torch.equal(v, (ref[n].float() * ref[n + "_scale"].float()).to(want)), n
        else:
            assert torch.equal(v, ref[n].to(want)), n
    assert "quantization_config" not in json.loads((tmp_path / "deq" / "config.json").read_text())
    source = logits(FIXTURE / "source")
    assert (logits(tmp_path / "deq") - source).abs().max() < 0.05 * source.abs().max()


@pytest.mark.parametrize("scheme", ["tensor", "block"])
def test_compressed_tensors_per_tensor_and_block_scales(tmp_path, scheme):
    torch.manual_seed(4)
    w = torch.randn(200, 300) * 3
    if scheme == "tensor":  # FP8: one scale, stored [1]
        s = (w.abs().max() / 448).reshape(1)
        q, want = (w / s).clamp(-448, 448).to(FP8), None
        want = (q.float() * s).to(torch.bfloat16)
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}
    else:  # FP8_BLOCK: a 128x128 grid named by block_structure
        q, s = block_quantize(w)
        want = block_dequant(q, s).to(torch.bfloat16)
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": [128, 128]}
    config = {"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}}
    src = write_hf(tmp_path / "src", {"l.weight": q, "l.weight_scale": s, "l.input_scale": torch.ones(1)}, config)
    info = ckpt_tools.inspect(src)["quantization"]
    assert info["scheme"] == {"tensor": "FP8", "block": "FP8_BLOCK"}[scheme] and info["quantized_tensors"] == 1
    run("convert", src, tmp_path / "out", "--to", "hf", "--no-arch-check", "--dtype", "bf16")
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == {"l.weight"} and torch.equal(got["l.weight"], want)


def test_rank_files_of_a_quantized_checkpoint_reshard_and_dequantize(fp8_block, tmp_path):
    """Codes and scales split across ranks (Shard(0)), resharded, then dequantized from the
    rank files (values computed from the assembled tensors): the same bits as from the hub files."""
    run("convert", fp8_block, tmp_path / "w2", "--to", "sharded", "--world-size", "2")
    run("reshard", tmp_path / "w2", tmp_path / "w3", "--to", "3")
    run("convert", tmp_path / "w3", tmp_path / "q", "--to", "hf")
    src, back = load_file(fp8_block / "model.safetensors"), load_file(tmp_path / "q" / "model.safetensors")
    assert set(back) == set(src) and all(torch.equal(back[n].view(torch.uint8), src[n].view(torch.uint8)) for n in src)
    run("export", fp8_block, tmp_path / "a", "--dtype", "bf16")
    run("export", tmp_path / "w3", tmp_path / "b", "--dtype", "bf16", "--base", fp8_block)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    # rows of 2 ranks from codes and scales held by 3 (each step reads only the chunks' rows it needs)
    run("convert", tmp_path / "w3", tmp_path / "d2", "--to", "sharded", "--world-size", "2", "--dtype", "bf16",
        "--base", fp8_block)
    parts = [torch.load(tmp_path / "d2" / f"model_world_size_2_rank_{r}.pt", weights_only=True) for r in range(2)]
    assert set(parts[0]) == set(a)
    for name, value in a.items():
        assert torch.equal(torch.cat([p[name].to_local() for p in parts]), value), name


# -- fp8-block out --------------------------------------------------------------------------

def test_fp8_block_export_scales_codes_and_transformers_load(fp8_block, tiny):
    src = load_file(tiny / "model.safetensors")
    got = load_file(fp8_block / "model.safetensors")
    config = json.loads((fp8_block / "config.json").read_text())
    assert config["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    assert config["dtype"] == "bfloat16"
    quantized = [n for n in got if n + "_scale_inv" in got]
    assert len(quantized) == 14  # 7 linears x 2 layers
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert got[n].dtype == torch.bfloat16 and torch.equal(got[n], src[n])
    for n in quantized:
        q, s = block_quantize(src[n])
        assert torch.equal(got[n + "_scale_inv"], s), n  # block absmax / 448
        assert torch.equal(got[n].view(torch.uint8), q.view(torch.uint8)), n
    assert (logits(fp8_block) - logits(tiny)).abs().max() < 0.1


def test_fp8_block_quantize_partial_edge_blocks_within_e4m3_rounding(tmp_path):
    from ckpt_tools.storage.lowp import quantize_block

    torch.manual_seed(3)
    w = (torch.randn(200, 300) * torch.exp(torch.randn(200, 1))).to(torch.bfloat16)
    w[130:] = 0  # an all-zero block-row: scale 1, codes 0
    q, s = quantize_block(w)
    assert s.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            assert s[i, j] == (blk.abs().max() / 448 if blk.abs().max() > 0 else 1.0)
    back = block_dequant(q, s)
    # e4m3 has 3 mantissa bits: within half a step (2**-4 relative), plus the subnormal step
    err = (back - w.float()).abs()
    bound = w.float().abs() * 2 ** -4 + s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300] * 2 ** -10
    assert bool((err <= bound).all())


# -- inspect, verify ------------------------------------------------------------------------

def test_inspect_reports_quantization(fp8_block, tiny):
    assert ckpt_tools.inspect(fp8_block)["quantization"] == {"method": "fp8", "block_size": [128, 128],
                                                            "quantized_tensors": 14}
    assert ckpt_tools.inspect(FIXTURE / "quantized")["quantization"] == {
        "method": "compressed-tensors", "scheme": "FP8_DYNAMIC", "quantized_tensors": 14}
    assert ckpt_tools.inspect(tiny)["quantization"] is None


def test_verify_compares_a_quantized_checkpoint_with_its_dequantized_export(fp8_block, tiny, tmp_path):
    run("export", fp8_block, tmp_path / "deq", "--dtype", "bf16")
    report = ckpt_tools.verify(fp8_block, tmp_path / "deq", atol=1e-3)  # bf16's rounding of the exact values
    assert report["ok"] and report["checked"] == 21 and not report["only_in_a"]
    assert not ckpt_tools.verify(fp8_block, tmp_path / "deq")["ok"]  # float32 vs bfloat16: a tolerance is needed
    assert ckpt_tools.verify(fp8_block, tiny, atol=0.01)["ok"]  # the bf16 model it was quantized from
    other = llama(tmp_path / "other", layers=2)
    w = load_file(other / "model.safetensors")
    w["model.layers.1.mlp.up_proj.weight"] = w["model.layers.1.mlp.up_proj.weight"] * 2
    save_file(w, other / "model.safetensors", metadata={"format": "pt"})
    out = run("verify", fp8_block, other, "--atol", "0.01", "--json", code=1)
    assert json.loads(out)["mismatches"] == ["model.layers.1.mlp.up_proj.weight"]


# -- bad input ------------------------------------------------------------------------------

def _bad(tmp_path: Path, tensors: dict, config: dict, *args: str) -> str:
    src = write_hf(tmp_path / "src", tensors, config)
    out = run("convert", src, tmp_path / "out", "--to", "hf", "--no-arch-check", "--dtype", "bf16", *args, code=3)
    assert not (tmp_path / "out").exists()
    return out


def test_scale_grid_that_does_not_fit_is_refused(tmp_path):
    q, _ = block_quantize(torch.randn(300, 200))
    out = _bad(tmp_path, {"l.weight": q, "l.weight_scale_inv": torch.ones(2, 2)}, FP8_CONFIG)
    assert "'l.weight_scale_inv'" in out and "[3, 2]" in out


def test_missing_scale_is_refused(tmp_path):
    q, _ = block_quantize(torch.randn(128, 128))
    out = _bad(tmp_path, {"l.weight": q, "n.weight": torch.ones(4)}, FP8_CONFIG)
    assert "'l.weight'" in out and "scale" in out


def test_unknown_quant_method_is_refused(tmp_path):
    out = _bad(tmp_path, {"l.weight": torch.zeros(4, 4, dtype=torch.int8), "l.scales": torch.ones(4)},
               {"quantization_config": {"quant_method": "awq"}})
    assert "'awq'" in out and "'l.weight'" in out


def test_fp8_without_quantization_config_is_never_cast(tmp_path):
    """Without a config to say how the scales apply, float8 bytes are never cast into weights."""
    q, s = block_quantize(torch.randn(128, 128))
    src = tmp_path / "w.safetensors"
    save_file({"l.weight": q, "l.weight_scale_inv": s}, src)
    out = run("convert", src, tmp_path / "out.pt", "--to", "torch", "--dtype", "bf16", code=3)
    assert "'l.weight'" in out and "quantization_config" in out
    assert not (tmp_path / "out.pt").exists()


def test_quantize_of_a_quantized_source_is_a_usage_error(fp8_block, tmp_path):
    for extra in ((), ("--dtype", "bf16")):
        out = run("export", fp8_block, tmp_path / "o", "--quantize", "fp8-dynamic", *extra, code=2)
        assert "already quantized" in out and "--dtype bf16" in out
        assert not (tmp_path / "o").exists()


def test_shard_of_a_quantized_model_dequantizes_to_the_configs_dtype(fp8_block, tmp_path):
    run("export", fp8_block, tmp_path / "deq", "--dtype", "bf16")
    full = load_file(tmp_path / "deq" / "model.safetensors")
    ckpt_tools.shard(str(fp8_block), tmp_path / "sh", ranks=2, progress=False)
    parts = [torch.load(tmp_path / "sh" / f"model_world_size_2_rank_{r}.pt", weights_only=True) for r in range(2)]
    assert set(parts[0]) == set(full)
    for name, value in full.items():
        assert torch.equal(torch.cat([p[name].to_local() for p in parts]), value), name
    assert "quantization_config" not in json.loads((tmp_path / "sh" / "huggingface" / "config.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deq", "sh"]  # the dequantized copy is gone


def test_dequantization_memory_stays_flat(tmp_path):
    """Peak RSS of `convert --dtype bf16` barely moves from a 4 MiB weight to a 48 MiB one (96
    MiB written): the weight is never materialised whole."""
    import subprocess
    import sys

    peaks = []
    for rows in (512, 6144):
        src = tmp_path / f"src{rows}"
        q = torch.randint(0, 0x7F, (rows, 8192), dtype=torch.uint8).view(FP8)
        write_hf(src, {"l.weight": q, "l.weight_scale_inv": torch.rand(rows // 128, 64)}, FP8_CONFIG)
        del q
        code = ("import resource, ckpt_tools; ckpt_tools.convert(%r, %r, to='hf', dtype='bf16', arch_check=False, progress=False); "
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)") % (str(src), str(tmp_path / f"out{rows}"))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        peaks.append(int(out.stdout.split()[-1]) * 1024)
        assert (tmp_path / f"out{rows}" / "model.safetensors").stat().st_size > rows * 8192 * 2
        shutil.rmtree(src)
    assert peaks[1] - peaks[0] < 64 << 20, peaks  # whole, the float32 values alone would be 192 MiB


@pytest.mark.parametrize("scheme,rows", [("block", (0, 300)), ("block", (128, 300)), ("channel", (5, 77))])
def test_quantizing_as_written_gives_the_whole_weights_codes(tmp_path, scheme, rows):
    """`export --quantize` codes computed a block-row at a time as they are written
    (:class:`QuantSpan`) are the bytes of the whole weight quantized at once, partial edge
    blocks included."""
    from ckpt_tools.core.dtypes import DType
    from ckpt_tools.storage.lowp import QuantSpan, quantize_block, quantize_channel

    torch.manual_seed(5)
    w = (torch.randn(300, 200) * torch.exp(torch.randn(300, 1))).to(torch.bfloat16)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 16 + w.view(torch.uint8).numpy().tobytes())
    span = QuantSpan(((path, 16, w.numel() * 2),), DType("bfloat16"), DType("float8_e4m3fn"), cols=200, rows=rows,
                     scheme=scheme, step=128 if scheme == "block" else 7)
    whole = quantize_block(w)[0] if scheme == "block" else quantize_channel(w, w.dtype)[0]
    got = b"".join(bytes(b) for b in span.blocks())
    assert len(got) == span.nbytes and got == whole[rows[0]:rows[1]].view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("scheme", ["fp8-block", "fp8-dynamic"])
def test_quantize_memory_stays_flat(tmp_path, scheme):
    """Peak RSS of `export --quantize` barely moves from a 4 MiB weight to a 256 MiB one: the
    codes are computed as they are written, never held whole (128 MiB of codes, 512 MiB as
    float32), and the source is read a block-row at a time, not mapped."""
    import subprocess
    import sys

    peaks = []
    for rows in (256, 16384):
        src = tmp_path / f"src{rows}"
        w = torch.randn(rows, 8192).to(torch.bfloat16)
        write_hf(src, {"model.layers.0.mlp.down_proj.weight": w, "model.norm.weight": torch.ones(8192)},
                 {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16"})
        del w
        # VmHWM, not ru_maxrss: the latter keeps the peak of the forked copy of this process
        # (holding the test's tensors) from before the exec
        code = ("import ckpt_tools; ckpt_tools.export(%r, %r, quantize=%r, arch_check=False, progress=False); "
                "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))"
                ) % (str(src), str(tmp_path / f"out{rows}"), scheme)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        peaks.append(int(out.stdout.split()[-1]) * 1024)
        assert (tmp_path / f"out{rows}" / "model.safetensors").stat().st_size > rows * 8192
        shutil.rmtree(src)
    assert peaks[1] - peaks[0] < 64 << 20, peaks  # held whole: 128 MiB of codes, plus the mapped source


@pytest.mark.parametrize("to", ["hf", "dcp"])
def test_dequantize_from_a_bucket_is_what_a_local_source_gives(fp8_block, tmp_path, monkeypatch, to):
    """A block-FP8 checkpoint in a bucket (a real S3 server on 127.0.0.1) dequantizes to the same
    bytes as its local copy: the scales a computed weight needs are fetched with its codes."""
    from s3server import make_bucket, start_server
    from test_objstore import ckpt, upload

    server = start_server(tmp_path / "s3")
    try:
        make_bucket(server, "ckpt")
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        src = upload(fp8_block, "s3://ckpt/fp8")
        r = ckpt("convert", src, tmp_path / "remote", "--to", to, "--dtype", "bf16", "--quiet")
        assert r.returncode == 0, r.stderr
    finally:
        server.stop()
    run("convert", fp8_block, tmp_path / "local", "--to", to, "--dtype", "bf16", "--quiet")
    data = sorted(p.relative_to(tmp_path / "local") for p in (tmp_path / "local").rglob("*")
                  if p.is_file() and p.suffix in (".safetensors", ".distcp"))
    assert data and data == sorted(p.relative_to(tmp_path / "remote") for p in (tmp_path / "remote").rglob("*")
                                   if p.is_file() and p.suffix in (".safetensors", ".distcp"))
    for f in data:
        assert (tmp_path / "remote" / f).read_bytes() == (tmp_path / "local" / f).read_bytes(), f
