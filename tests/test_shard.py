"""`shard`: an HF model laid out as N-rank FSDP2 checkpoints, checked by their real consumers.

Most cases call ``shard`` inside a gloo job from tests/dist.py (the torchrun-like "join" path),
then, in the same job, build a fresh model, ``fully_shard`` it and load the files the way a
training job resumes. A few cases call ``shard`` from this process, which spawns its own ranks.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpt_tools.errors import BadInput, DestinationError, UsageError
from ckpt_tools.commands.shard import read_sources, shard
from ckpt_tools.commands.shard_job import build_meta_model, commit, plan_reads, transformer_blocks

try:
    from dist import run_ranks
except ImportError:  # tests/ imported as a package
    from tests.dist import run_ranks

REPO = Path(__file__).resolve().parents[1]
VOCAB = 101  # not divisible by 2 or 3: uneven Shard(0) rows


def _fixtures_module():
    path = REPO / "fixtures" / "make_fixtures.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("_ckpt_make_fixtures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _llama_config(tied: bool):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=tied)


def _bert_config():
    from transformers import BertConfig

    return BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=64)


def _make_source(root: Path, name: str) -> Path:
    """llama: fp32 in 3 safetensors files + index; llama_tied: bf16, one file; bert: BertModel."""
    from transformers import BertModel, LlamaForCausalLM

    torch.manual_seed(0)
    path = root / name
    if name == "bert":
        BertModel(_bert_config()).save_pretrained(path, safe_serialization=True)
        return path
    tied = name == "llama_tied"
    model = LlamaForCausalLM(_llama_config(tied))
    if tied:
        model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    else:
        model.save_pretrained(path, safe_serialization=True, max_shard_size="40KB")
    fixtures = _fixtures_module()
    if fixtures is not None:
        fixtures.build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {name: _make_source(root, name) for name in ("llama", "llama_tied", "bert")}


def _source_tensors(src: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _expected(src: Path, key: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    if key == "lm_head.weight" and key not in tensors:  # tied: the file keeps the embedding only
        return tensors["model.embed_tokens.weight"]
    return tensors[key]


# ---------------------------------------------------------------- the consumer side, in a job


def _consumer_model(src: str):
    """What a training job does: the model from its config, each block then the root sharded."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, BertModel, LlamaForCausalLM

    config = AutoConfig.from_pretrained(src)
    torch.manual_seed(123)  # weights that differ from the checkpoint's
    if config.model_type == "bert":
        model = BertModel(config)
        blocks = model.encoder.layer
    else:
        model = LlamaForCausalLM(config).to(config.dtype)
        blocks = model.model.layers
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _shard_and_resume(rank, world_size, src, dst, fmt):
    """One rank: shard (joining this job), then resume from the result and take a train step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    report = shard(src, dst, ranks=world_size, format=fmt, with_optimizer="adamw", check=True, progress=False)
    model = _consumer_model(src)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if fmt == "sharded":
        model_file = Path(dst) / f"model_world_size_{world_size}_rank_{rank}.pt"
        optim_file = Path(dst) / f"optim_world_size_{world_size}_rank_{rank}.pt"
        model.load_state_dict(torch.load(model_file, weights_only=True))
        optimizer.load_state_dict(torch.load(optim_file, weights_only=True))
    else:
        msd, osd = get_state_dict(model, optimizer)
        dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=dst)
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    loaded = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}  # before the step
    steps = {float(s["step"]) for s in optimizer.state.values()}
    ids = torch.arange(16).reshape(2, 8) % VOCAB
    outputs = model(input_ids=ids).to_tuple()  # every output, so every parameter gets a gradient
    sum(o.float().pow(2).mean() for o in outputs if isinstance(o, torch.Tensor)).backward()
    optimizer.step()  # training continues from the loaded state
    after = {float(s["step"]) for s in optimizer.state.values()}
    return {"report": report, "loaded": loaded if rank == 0 else None, "steps": (steps, after)}


def _gather_sharded(dst: Path, world_size: int, kind: str) -> list[dict]:
    return [torch.load(dst / f"{kind}_world_size_{world_size}_rank_{r}.pt", weights_only=True)
            for r in range(world_size)]


def _full(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.to_local() for p in pieces], dim=0)


CASES = [(name, n, "sharded") for name in ("llama", "llama_tied", "bert") for n in (1, 2, 3)]
CASES += [("llama_tied", 2, "dcp"), ("bert", 3, "dcp"), ("llama", 1, "dcp")]


@pytest.mark.parametrize("name,world_size,fmt", CASES, ids=[f"{m}-ws{n}-{f}" for m, n, f in CASES])
def test_shard_bit_exact_and_resumable(sources, tmp_path, name, world_size, fmt):
    src, dst = sources[name], tmp_path / "out"
    results = run_ranks(_shard_and_resume, world_size, tmp_path, str(src), str(dst), fmt, timeout=240)
    tensors = _source_tensors(src)

    report = results[0]["report"]
    assert report["dst"] == str(dst) and report["ranks"] == world_size and report["format"] == fmt
    assert len(report["peak_rss_bytes"]) == world_size and all(b > 0 for b in report["peak_rss_bytes"])
    assert report["max_abs_diff"] == 0.0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []  # no temp left

    if fmt == "sharded":
        models = _gather_sharded(dst, world_size, "model")
        written = {k: _full([m[k] for m in models]) for k in models[0]}
        optims = _gather_sharded(dst, world_size, "optim")
        assert json.loads((dst / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": world_size}
        assert (dst / "huggingface" / "config.json").read_bytes() == (src / "config.json").read_bytes()
        if name.startswith("llama"):
            assert (dst / "huggingface" / "tokenizer.json").is_file() == (src / "tokenizer.json").is_file()
        # int-keyed, one zero state per parameter, all of this rank's rows
        for r, osd in enumerate(optims):
            assert sorted(osd["state"]) == list(range(len(osd["state"])))
            for state, key in zip(osd["state"].values(), [k for k in models[r] if k != "lm_head.weight"
                                                          or name != "llama_tied"]):
                assert float(state["step"]) == 0.0
                assert state["exp_avg"].to_local().shape == models[r][key].to_local().shape
                assert not state["exp_avg"].to_local().any() and not state["exp_avg_sq"].to_local().any()
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(dst, tmp_path / "full.pt")
        full = torch.load(tmp_path / "full.pt", weights_only=True)
        written = full["model"]
        assert all(float(v["step"]) == 0.0 for v in full["optimizer"]["state"].values())

    expected_keys = set(tensors) | ({"lm_head.weight"} if name == "llama_tied" else set())
    assert set(written) == expected_keys
    for key, value in written.items():
        want = _expected(src, key, tensors)
        assert value.dtype == want.dtype, key
        assert torch.equal(value.view(torch.uint8) if value.dtype == torch.bfloat16 else value,
                           want.view(torch.uint8) if want.dtype == torch.bfloat16 else want), key

    # the consumer job loaded exactly these values, found step 0 and trained on
    for key, value in results[0]["loaded"].items():
        assert torch.equal(value, _expected(src, key, tensors)), key
    for result in results:
        assert result["steps"] == ({0.0}, {1.0})


def test_spawned_ranks_mixed_precision_offload_overwrite(sources, tmp_path):
    """From a plain process: spawns its own ranks; bf16 compute + CPU offload; replaces DST."""
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.safetensors").write_text("old")
    report = shard(str(sources["llama"]), dst, ranks=2, format="sharded", mixed_precision="bf16",
                   cpu_offload=True, check=True, overwrite=True, progress=False)
    assert not (dst / "old.safetensors").exists()
    assert sorted(p.name for p in dst.iterdir()) == [
        ".ckpt-manifest.json", "fsdp_config.json", "huggingface",
        "model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]
    from ckpt_tools.commands.verify import verify

    checked = verify(dst, progress=False)  # the manifest, written last, lists every rank's file
    assert checked["ok"], checked["problems"] or checked["mismatches"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp or old copy left beside it
    assert len(report["peak_rss_bytes"]) == 2
    assert 0.0 < report["max_abs_diff"] < 0.1  # bf16 compute against the fp32 reference
    tensors = _source_tensors(sources["llama"])
    models = _gather_sharded(dst, 2, "model")
    for key in tensors:  # the policies change the compute, never what is saved
        assert torch.equal(_full([m[key] for m in models]), tensors[key]), key


def _failing_rank(ctx, kind):
    import torch.distributed as dist

    if ctx.rank == 1:
        raise DestinationError("/somewhere: out of space") if kind == "ckpt" else ValueError("boom")
    dist.barrier()  # the others wait in a collective the failed rank never joins
    return ctx.rank


@pytest.mark.parametrize("kind", ["ckpt", "bug"])
def test_a_failing_rank_stops_the_job(kind):
    from ckpt_tools.runtime.launch import RankFailed, run

    expected = DestinationError if kind == "ckpt" else RankFailed
    with pytest.raises(expected, match="out of space" if kind == "ckpt" else "rank 1 of 2 failed: ValueError: boom"):
        run(_failing_rank, kind, ranks=2)


# ---------------------------------------------------------------- no ranks needed


def test_existing_destination_refused(sources, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep").write_text("x")
    with pytest.raises(DestinationError, match="--overwrite"):
        shard(str(sources["llama"]), dst, ranks=2, progress=False)
    assert (dst / "keep").read_text() == "x"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("kwargs,flag", [
    ({"ranks": 0}, "--ranks"), ({"ranks": 2, "format": "hf"}, "--format"),
    ({"ranks": 2, "device": "tpu"}, "--device"), ({"ranks": 2, "mixed_precision": "fp8"}, "--mixed-precision"),
    ({"ranks": 2, "with_optimizer": "sgd"}, "--with-optimizer"),
], ids=["ranks", "format", "device", "mixed-precision", "optimizer"])
def test_bad_options(sources, tmp_path, kwargs, flag):
    with pytest.raises(UsageError, match=flag):
        shard(str(sources["llama"]), tmp_path / "out", progress=False, **kwargs)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a host without CUDA")
def test_cuda_without_gpu_is_a_usage_error(sources, tmp_path):
    with pytest.raises(UsageError, match="no CUDA device"):
        shard(str(sources["llama"]), tmp_path / "out", ranks=1, device="cuda", progress=False)


def _offline_cache(tmp_path, monkeypatch) -> Path:
    import huggingface_hub.constants

    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))  # read at call time
    return cache


def test_offline_hub_id_from_the_cache(sources, tmp_path, monkeypatch):
    from ckpt_tools.commands.shard import fetch_model

    cache = _offline_cache(tmp_path, monkeypatch)
    repo = cache / "models--someorg--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    shutil.copytree(sources["llama"], snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    assert fetch_model("someorg/tiny") == snapshot
    with pytest.raises(BadInput, match="HF_HUB_OFFLINE"):
        shard("nobody-here/no-such-model", tmp_path / "out", ranks=1, progress=False)
    assert not (tmp_path / "out").exists()


def test_config_that_does_not_match_the_weights(sources, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(sources["llama"], src)
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = 48
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInput, match="config does not match"):
        shard(str(src), tmp_path / "out", ranks=2, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def _meta(name: str, sources):
    from transformers import AutoConfig

    src = sources[name]
    srcs = read_sources(src)
    return build_meta_model(AutoConfig.from_pretrained(src), srcs), srcs


@pytest.mark.parametrize("world_size,rank,rows", [(1, 0, (0, 101)), (2, 1, (51, 101)), (3, 2, (68, 101)),
                                                  (4, 3, (78, 101)), (8, 7, (91, 101))])
def test_plan_reads_rows_and_tied_weights(sources, world_size, rank, rows):
    model, srcs = _meta("llama_tied", sources)
    reads = {r.target: r for r in plan_reads(model, srcs, world_size=world_size, rank=rank)}
    assert "lm_head.weight" not in reads  # one read for the tied pair
    embed = reads["model.embed_tokens.weight"]
    assert (embed.start, embed.stop) == rows
    assert embed.source.dtype == torch.bfloat16
    assert set(reads) == set(srcs)


def test_transformer_blocks(sources):
    from transformers import BertForMaskedLM

    llama, _ = _meta("llama", sources)
    assert transformer_blocks(llama) == list(llama.model.layers)
    bert, _ = _meta("bert", sources)
    assert transformer_blocks(bert) == [bert.embeddings, *bert.encoder.layer]
    with torch.device("meta"):
        mlm = BertForMaskedLM(_bert_config())  # decoder tied to the word embeddings
    assert transformer_blocks(mlm) == list(mlm.bert.encoder.layer)


def test_commit_keeps_old_until_new_is_in_place(tmp_path):
    dst, new = tmp_path / "dst", tmp_path / ".dst.ckpt-tmp-x"
    dst.mkdir()
    (dst / "a").write_text("old")
    new.mkdir()
    (new / "b").write_text("new")
    with pytest.raises(DestinationError):
        commit(new, dst, overwrite=False)
    assert (dst / "a").read_text() == "old" and new.is_dir()
    commit(new, dst, overwrite=True)
    assert [p.name for p in dst.iterdir()] == ["b"]
    assert [p.name for p in tmp_path.iterdir()] == ["dst"]
