"""`ckpt estimate`: parameter counts and per-rank memory, checked against hand-computed figures."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from ckpt_tools.errors import BadInput, UsageError
from ckpt_tools.commands.estimate import estimate, plan_memory, unit_of

LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
}
LLAMA2_7B_PARAMS = 6_738_415_616


def write_config(directory, config: dict):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def llama_count(*, vocab, hidden, inter, layers, heads, kv_heads, tied) -> int:
    kv = hidden // heads * kv_heads
    block = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden  # attn, mlp, 2 norms
    return vocab * hidden + layers * block + hidden + (0 if tied else vocab * hidden)


def bert_count(*, vocab, hidden, inter, layers, positions, types, head) -> int:
    linear = lambda i, o: i * o + o  # noqa: E731
    embeddings = (vocab + positions + types) * hidden + 2 * hidden
    block = 4 * linear(hidden, hidden) + linear(hidden, inter) + linear(inter, hidden) + 4 * hidden
    if head == "BertModel":
        extra = linear(hidden, hidden)  # pooler
    else:  # BertForMaskedLM: transform dense + LayerNorm + decoder bias; decoder weight tied
        extra = linear(hidden, hidden) + 2 * hidden + vocab
    return embeddings + layers * block + extra


def tiny_llama(tied: bool, kv_heads: int = 2) -> tuple[dict, int]:
    dims = dict(vocab=50, hidden=32, inter=48, layers=2, heads=4, kv_heads=kv_heads)
    config = {**LLAMA2_7B, "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": kv_heads,
              "tie_word_embeddings": tied}
    return config, llama_count(**dims, tied=tied)


def tiny_bert(head: str) -> tuple[dict, int]:
    config = {"architectures": [head], "model_type": "bert", "vocab_size": 50, "hidden_size": 16,
              "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "max_position_embeddings": 20, "type_vocab_size": 2}
    return config, bert_count(vocab=50, hidden=16, inter=32, layers=2, positions=20, types=2, head=head)


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """An empty HF cache under tmp_path, offline: nothing reaches the network or the user's cache."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_llama2_7b_figures_from_the_issue(tmp_path):
    est = estimate(str(write_config(tmp_path / "llama2-7b", LLAMA2_7B)), ranks=4)
    assert est.params == LLAMA2_7B_PARAMS
    assert est.source == "config"
    out = est.to_json()
    assert out["params"] == LLAMA2_7B_PARAMS and out["ranks"] == 4
    # FSDP: a quarter of the 16 B/param, plus the largest unit (the root: embeddings, lm_head,
    # norm) gathered unsharded in fp32, the same rule as with --mixed-precision and --cpu-offload
    unit = 2 * 32000 * 4096 + 4096
    assert out["ddp"]["per_rank_bytes"] == 16 * LLAMA2_7B_PARAMS
    assert out["fsdp"]["per_rank_bytes"] == math.ceil(16 * LLAMA2_7B_PARAMS / 4) + 4 * unit
    assert round(out["ddp"]["per_rank_bytes"] / 1e9, 1) == 107.8
    assert round(out["fsdp"]["per_rank_bytes"] / 1e9) == 28
    assert out["fsdp"] == {
        "per_rank_bytes": 4 * LLAMA2_7B_PARAMS + 4 * unit, "params_bytes": LLAMA2_7B_PARAMS + 4 * unit,
        "grads_bytes": LLAMA2_7B_PARAMS, "optimizer_bytes": 2 * LLAMA2_7B_PARAMS,
        "cpu_per_rank_bytes": 0, "cpu": {"params_bytes": 0, "grads_bytes": 0, "optimizer_bytes": 0},
    }
    assert out["options"] == {"optimizer": "adamw", "master_dtype": "fp32",
                              "mixed_precision": None, "cpu_offload": False}
    json.dumps(out)  # plain JSON types only
    table = est.table()
    assert "6,738,415,616" in table and "107.81 GB" in table and "28.00 GB" in table
    assert "gathered unsharded: (root)" in table


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(tiny_llama(tied=False), id="llama-untied-gqa"),
        pytest.param(tiny_llama(tied=True), id="llama-tied-gqa"),
        pytest.param(tiny_llama(tied=True, kv_heads=4), id="llama-tied-mha"),
        pytest.param(tiny_bert("BertModel"), id="bert-base-model"),
        pytest.param(tiny_bert("BertForMaskedLM"), id="bert-masked-lm"),
    ],
)
@pytest.mark.parametrize("ranks", [1, 2, 8])
def test_tiny_configs_counted_by_hand(tmp_path, case, ranks):
    config, expected = case
    est = estimate(str(write_config(tmp_path / "m", config)), ranks=ranks)
    assert est.params == expected
    assert est.ddp.gpu.total == 16 * expected
    gathered = 4 * est.largest_unit_params
    assert est.fsdp.gpu.total >= math.ceil(16 * expected / ranks) + gathered  # uneven rows only add padding
    if ranks == 1:
        assert est.fsdp.gpu.total == est.ddp.gpu.total + gathered


def test_tied_llama_counts_the_shared_matrix_once(tmp_path):
    untied = estimate(str(write_config(tmp_path / "u", tiny_llama(tied=False)[0])), ranks=1)
    tied = estimate(str(write_config(tmp_path / "t", tiny_llama(tied=True)[0])), ranks=1)
    assert untied.params - tied.params == 50 * 32


# names and shapes chosen so fully_shard's ceil(dim0 / ranks) padding shows; ranks=2:
# rows per rank 3*3 + 2*2 + 1 + 1 = 15 elements; units: root 15+1=16, layers.0 6, layers.1 2
SHAPES = {"embed.weight": (5, 3), "layers.0.w": (3, 2), "layers.1.w": (2,), "norm.scale": ()}


@pytest.mark.parametrize(
    ("mp", "offload", "ddp", "fsdp_gpu", "fsdp_cpu"),
    [
        (None, False, 16 * 24, 16 * 15 + 4 * 16, 0),  # one rule: the gathered unit, fp32 here
        ("bf16", False, 18 * 24, 16 * 15 + 2 * 16, 0),
        ("fp16", False, 18 * 24, 16 * 15 + 2 * 16, 0),
        (None, True, 16 * 24, 4 * 16, 16 * 15),
        ("bf16", True, 18 * 24, 2 * 16, 16 * 15),
    ],
)
def test_plan_memory_small_numbers(mp, offload, ddp, fsdp_gpu, fsdp_cpu):
    est = plan_memory(SHAPES, ranks=2, mixed_precision=mp, cpu_offload=offload)
    assert est.params == 24
    assert (est.largest_unit, est.largest_unit_params) == ("(root)", 16)
    assert est.ddp.gpu.total == ddp and est.ddp.cpu.total == 0
    assert est.fsdp.gpu.total == fsdp_gpu
    assert est.fsdp.cpu.total == fsdp_cpu
    assert est.to_json()["fsdp"]["per_rank_bytes"] == fsdp_gpu
    assert est.to_json()["fsdp"]["cpu_per_rank_bytes"] == fsdp_cpu


@pytest.mark.parametrize(
    ("name", "unit"),
    [("model.layers.3.mlp.up_proj.weight", "model.layers.3"), ("bert.encoder.layer.11.output.dense.bias",
     "bert.encoder.layer.11"), ("lm_head.weight", "(root)"), ("model.norm.weight", "(root)")],
)
def test_unit_of(name, unit):
    assert unit_of(name) == unit


def test_llama2_7b_mixed_precision_adds_the_largest_unit(tmp_path):
    model = str(write_config(tmp_path / "llama2-7b", LLAMA2_7B))
    est = estimate(model, ranks=4, mixed_precision="bf16")
    embed = 32000 * 4096
    assert (est.largest_unit, est.largest_unit_params) == ("(root)", 2 * embed + 4096)
    assert est.ddp.gpu.total == 18 * LLAMA2_7B_PARAMS
    assert est.fsdp.gpu.total == 4 * LLAMA2_7B_PARAMS + 2 * (2 * embed + 4096)
    offloaded = estimate(model, ranks=4, mixed_precision="bf16", cpu_offload=True)
    assert offloaded.fsdp.gpu.total == 2 * (2 * embed + 4096)
    assert offloaded.fsdp.cpu.total == 4 * LLAMA2_7B_PARAMS
    assert "CPU offload" in offloaded.table()


def _safetensors_model(directory) -> tuple[dict[str, torch.Tensor], int]:
    torch.manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(10, 4, dtype=torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4),
        "model.layers.0.input_layernorm.weight": torch.ones(4, dtype=torch.float16),
        "model.position_ids": torch.arange(7),  # an integer buffer, not a parameter
    }
    directory.mkdir(parents=True, exist_ok=True)
    return tensors, sum(t.numel() for t in tensors.values() if t.is_floating_point())


def test_counts_from_a_single_safetensors_header(tmp_path):
    tensors, expected = _safetensors_model(tmp_path / "m")
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    est = estimate(str(tmp_path / "m"), ranks=2)  # no config.json needed
    assert (est.params, est.source) == (expected, "safetensors")
    assert est.largest_unit == "(root)" and est.largest_unit_params == 40


@pytest.mark.parametrize("all_shards", [True, False])
def test_sharded_safetensors_use_headers_only_when_every_shard_is_there(tmp_path, all_shards):
    config, config_count = tiny_llama(tied=False)
    model_dir = write_config(tmp_path / "m", config)
    tensors, expected = _safetensors_model(model_dir)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for i, (file, keys) in enumerate(shards.items()):
        if all_shards or i == 0:
            save_file({k: tensors[k] for k in keys}, model_dir / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    est = estimate(str(model_dir), ranks=2)
    assert (est.params, est.source) == ((expected, "safetensors") if all_shards else (config_count, "config"))


def test_truncated_safetensors_is_bad_input(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"\xff\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(BadInput, match="model.safetensors"):
        estimate(str(tmp_path / "m"), ranks=2)


def test_repo_id_resolves_from_the_offline_cache(tmp_path, offline_hub):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = offline_hub / "models--someorg--tiny-llama"
    write_config(repo / "snapshots" / commit, tiny_llama(tied=True)[0])
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    est = estimate("someorg/tiny-llama", ranks=2)
    assert est.params == tiny_llama(tied=True)[1]
    assert est.to_json()["model"] == "someorg/tiny-llama"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("{tmp}/does-not-exist", "no such directory"),
        ("{tmp}/file.txt", "is a file"),
        ("{tmp}/empty", "no config.json"),
        ("ckpt-tools-test/no-such-model", "HF_HUB_OFFLINE=1"),
        ("not a valid repo id!", "not a valid hub repo id"),
    ],
)
def test_missing_model_is_bad_input(tmp_path, offline_hub, model, message):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInput, match=message):
        estimate(model.format(tmp=tmp_path), ranks=2)


@pytest.mark.parametrize(
    "config",
    [{"model_type": "no-such-architecture"}, {**LLAMA2_7B, "hidden_size": 30}],  # 30 % 32 heads != 0
    ids=["unknown-model-type", "inconsistent-sizes"],
)
def test_unreadable_config_is_bad_input(tmp_path, config):
    with pytest.raises(BadInput, match="config.json"):
        estimate(str(write_config(tmp_path / "m", config)), ranks=2)


@pytest.mark.parametrize(("ranks", "mp"), [(0, None), (-1, None), (True, None), (2, "fp8"), (2, "fp32")])
def test_bad_options_are_usage_errors(tmp_path, ranks, mp):
    with pytest.raises(UsageError):
        estimate(str(write_config(tmp_path / "m", LLAMA2_7B)), ranks=ranks, mixed_precision=mp)
