"""``export`` writes a directory ``from_pretrained`` loads, or refuses (exit 3 naming ``--base``,
nothing written); ``shard --format dcp`` carries config and tokenizer so its export needs no
``--base``; ``verify MODEL SHARD_OUT`` leaves aside exactly what ``from_pretrained`` ignores.

Every exit-0 export here is loaded by a real ``from_pretrained`` (no missing, unexpected or
misshapen keys) and its weights compared with the source's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ckpt_tools.cli.main import main as cli

FIX = Path(__file__).resolve().parents[1] / "fixtures"


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _loads_clean(path: Path, auto: str = "AutoModelForCausalLM"):
    import transformers

    model, info = getattr(transformers, auto).from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


def _same_weights(out: Path, want: dict[str, torch.Tensor]) -> None:
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


# -- no config at all ------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["dcp", "hf-without-config"])
def test_export_without_a_config_is_refused_naming_base(tmp_path, source):
    """Weights alone are no directory from_pretrained loads: exit 3 naming --base, nothing at
    DST; `convert --to hf` still writes the weights alone; with --base the export loads."""
    if source == "dcp":
        src = FIX / "llama_dcp"
    else:
        src = tmp_path / "src"
        src.mkdir()
        shutil.copyfile(FIX / "llama_hf" / "model.safetensors", src / "model.safetensors")
    r = _cli("export", src, tmp_path / "out")
    assert r.exit_code == 3, r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "--base" in errors[0] and "config.json" in errors[0], r.output
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]

    weights_only = _cli("convert", src, tmp_path / "weights", "--to", "hf", "--quiet")
    assert weights_only.exit_code == 0, weights_only.output
    assert sorted(p.name for p in (tmp_path / "weights").iterdir() if not p.name.startswith(".")) == \
        ["model.safetensors"]

    ok = _cli("export", src, tmp_path / "hf", "--base", FIX / "llama_hf", "--quiet")
    assert ok.exit_code == 0, ok.output
    _loads_clean(tmp_path / "hf")
    _same_weights(tmp_path / "hf", load_file(tmp_path / "weights" / "model.safetensors"))


def test_export_with_a_base_that_has_no_config_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    r = _cli("export", FIX / "llama_dcp", tmp_path / "out", "--base", tmp_path / "empty")
    assert r.exit_code == 3, r.output
    assert "--base" in r.output and "config.json" in r.output
    assert not (tmp_path / "out").exists()


# -- a config.json with no "architectures" ---------------------------------------------------

def _llama_config(tmp_path: Path, name: str, **changes) -> Path:
    """The fixture's config as `LlamaConfig(...).save_pretrained` writes it: no "architectures"."""
    config = json.loads((FIX / "llama_hf" / "config.json").read_text())
    del config["architectures"]
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps({**config, **changes}))
    return tmp_path / name


def test_a_base_without_architectures_is_still_checked(tmp_path):
    """The class follows from model_type and the names (lm_head.weight: LlamaForCausalLM): a
    config that does not fit the weights is exit 3 naming --base; one that fits loads."""
    wrong = _llama_config(tmp_path, "wrong", hidden_size=64)
    r = _cli("export", FIX / "llama_dcp", tmp_path / "refused", "--base", wrong)
    assert r.exit_code == 3, r.output
    assert "misshapen" in r.output and "LlamaForCausalLM" in r.output and "--base" in r.output, r.output
    assert not (tmp_path / "refused").exists()

    right = _llama_config(tmp_path, "right")
    r = _cli("export", FIX / "llama_dcp", tmp_path / "hf", "--base", right)
    assert r.exit_code == 0, r.output
    assert "not checked" not in r.output, r.output
    _loads_clean(tmp_path / "hf")
    _same_weights(tmp_path / "hf", _weights_of(FIX / "llama_dcp", tmp_path / "weights"))


def _weights_of(src: Path, out: Path) -> dict[str, torch.Tensor]:
    """The source's model tensors as `convert --to hf` (weights only) writes them."""
    assert _cli("convert", src, out, "--to", "hf", "--quiet").exit_code == 0
    return load_file(out / "model.safetensors")


def test_no_architectures_and_no_head_is_checked_as_automodel(tmp_path):
    """Names without lm_head.weight: AutoModel's class for the model_type (here BertModel)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=24)
    BertModel(config).save_pretrained(tmp_path / "src")
    for name in ("src",):
        cfg = json.loads((tmp_path / name / "config.json").read_text())
        del cfg["architectures"]
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    base = tmp_path / "wide"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 64}))
    r = _cli("export", tmp_path / "src", tmp_path / "refused", "--base", base)
    assert r.exit_code == 3, r.output
    assert "BertModel" in r.output and "intermediate.dense.weight" in r.output, r.output
    assert not (tmp_path / "refused").exists()

    r = _cli("export", tmp_path / "src", tmp_path / "hf")
    assert r.exit_code == 0, r.output
    _loads_clean(tmp_path / "hf", "AutoModel")
    _same_weights(tmp_path / "hf", load_file(tmp_path / "src" / "model.safetensors"))


# -- shard --format dcp, then export with no --base ------------------------------------------

def test_shard_dcp_then_export_needs_no_base(tmp_path):
    r = _cli("shard", FIX / "llama_hf", tmp_path / "dcp", "--ranks", "2", "--format", "dcp",
             "--with-optimizer", "adamw", "--quiet")
    assert r.exit_code == 0, r.output
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "dcp" / "huggingface" / name).read_bytes() == (FIX / "llama_hf" / name).read_bytes(), name
    r = _cli("export", tmp_path / "dcp", tmp_path / "hf", "--quiet")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and (tmp_path / "hf" / "generation_config.json").is_file()
    _loads_clean(tmp_path / "hf")
    _same_weights(tmp_path / "hf", load_file(FIX / "llama_hf" / "model.safetensors"))
    # the side folder is carried by a reshard, and the reshard exports without --base too
    assert _cli("reshard", tmp_path / "dcp", tmp_path / "dcp3", "--to", "3", "--quiet").exit_code == 0
    assert (tmp_path / "dcp3" / "huggingface" / "config.json").is_file()
    assert _cli("export", tmp_path / "dcp3", tmp_path / "hf3", "--quiet").exit_code == 0
    _loads_clean(tmp_path / "hf3")


# -- verify MODEL SHARD_OUT ------------------------------------------------------------------

def _tiny_bert_with_position_ids(path: Path) -> None:
    """A BERT whose file holds `embeddings.position_ids`, as older BERT/MiniLM files do: a buffer
    transformers now computes, which from_pretrained ignores and shard leaves out."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=24)
    BertForMaskedLM(config).save_pretrained(path)
    sd = load_file(path / "model.safetensors")
    sd["bert.embeddings.position_ids"] = torch.arange(24).unsqueeze(0)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def bert_sharded(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bert")
    _tiny_bert_with_position_ids(root / "bert")
    r = _cli("shard", root / "bert", root / "ws2", "--ranks", "2", "--quiet")
    assert r.exit_code == 0, r.output
    return root / "bert", root / "ws2"


def test_verify_model_against_its_shard_ignores_what_from_pretrained_ignores(bert_sharded):
    model, sharded = bert_sharded
    r = _cli("verify", model, sharded)
    assert r.exit_code == 0, r.output
    assert "note: bert.embeddings.position_ids only in A: from_pretrained ignores it" in r.output, r.output
    r = _cli("verify", sharded, model, "--json")
    report = json.loads(r.stdout)
    assert r.exit_code == 0 and report["ok"] and not report["only_in_b"], r.output


def test_verify_still_fails_on_a_real_difference(bert_sharded, tmp_path):
    """A tensor from_pretrained would call unexpected, or a changed value, stays exit 1."""
    model, sharded = bert_sharded
    extra = tmp_path / "extra"
    shutil.copytree(model, extra)
    sd = load_file(extra / "model.safetensors")
    sd["bert.encoder.layer.0.surprise.weight"] = torch.zeros(4)
    save_file(sd, extra / "model.safetensors", metadata={"format": "pt"})
    r = _cli("verify", extra, sharded)
    assert r.exit_code == 1, r.output
    assert "only in A (1): bert.encoder.layer.0.surprise.weight" in r.output, r.output

    changed = tmp_path / "changed"
    shutil.copytree(model, changed)
    sd = load_file(changed / "model.safetensors")
    sd["bert.embeddings.word_embeddings.weight"][3, 1] += 1
    save_file(sd, changed / "model.safetensors", metadata={"format": "pt"})
    r = _cli("verify", changed, sharded)
    assert r.exit_code == 1, r.output
    assert "differs: bert.embeddings.word_embeddings.weight" in r.output, r.output

    missing = tmp_path / "missing"  # the other side lacks a weight the model needs: never "ignored"
    shutil.copytree(model, missing)
    sd = load_file(missing / "model.safetensors")
    del sd["bert.encoder.layer.0.output.dense.bias"]
    save_file(sd, missing / "model.safetensors", metadata={"format": "pt"})
    r = _cli("verify", model, missing)
    assert r.exit_code == 1, r.output
    assert "only in A (1): bert.encoder.layer.0.output.dense.bias" in r.output, r.output
    assert "from_pretrained ignores" not in r.output, r.output
