"""PEFT LoRA saved by the frameworks themselves: accelerate's ``Accelerator.save_state`` (FSDP2,
2 CPU ranks, ``fw_accelerate.job(lora=True)``) and the transformers ``Trainer``'s ``checkpoint-N/``
(FSDP2 at 2 ranks, and a plain single-process Trainer: ``fw_trainer.job(lora=True)``).

Each job trains a tiny Llama wrapped by ``peft.get_peft_model`` for 2 steps and saves with its
own code; rank 0 also writes the full trained state dict. The reference is PEFT itself on that
state: ``merge_and_unload`` for ``--lora merge``, the trained ``PeftModel``'s logits for
``--lora adapter`` loaded by ``PeftModel.from_pretrained``.

What the frameworks write (seen here, accelerate 1.15, transformers 5.x):
- accelerate ``save_state``: the whole PEFT state dict (base + adapter, adapter name kept) in
  ``pytorch_model_fsdp_0/``; no adapter_config.json (the job saves PEFT's beside it).
- Trainer with FSDP2 (SHARDED_STATE_DICT): only the adapter (``get_peft_model_state_dict``:
  PEFT's saved names, adapter name removed) in ``pytorch_model_fsdp_0/``, and no
  adapter_config.json, so alpha must be given.
- Trainer without FSDP: ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT's
  ``save_pretrained``) beside ``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from dist import run_ranks

import ckpt_tools
from ckpt_tools.cli.main import main as cli

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore")

STEPS = 2
IDS = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """``{name: (checkpoint dir, trained state dict file)}`` plus the base model dir."""
    import fw_accelerate
    import fw_trainer
    from fw_common import tiny_model

    out = tmp_path_factory.mktemp("lora_fw")
    jobs = {
        "accelerate": (fw_accelerate.job, 2, {}, lambda d: d),
        "trainer_fsdp": (fw_trainer.job, 2, {}, lambda d: fw_trainer.checkpoint_dir(d, STEPS)),
        "trainer_single": (fw_trainer.job, 1, {"fsdp": False}, lambda d: fw_trainer.checkpoint_dir(d, STEPS)),
    }
    found = {}
    for name, (job, ws, kw, where) in jobs.items():
        trained = out / f"{name}_trained.pt"
        run_ranks(functools.partial(job, save_at=STEPS, load=None, steps=STEPS, lora=True, full_to=str(trained), **kw),
                  ws, out, str(out / name))
        found[name] = (Path(where(str(out / name))), trained)
    tiny_model(0).save_pretrained(out / "base")  # the frozen base every job started from
    found["base"] = out / "base"
    return found


def _trained(trained: Path):
    import fw_accelerate

    model = fw_accelerate._model(99, lora=True)  # other seed: every value comes from the file
    model.load_state_dict(torch.load(trained, weights_only=True))
    lora_b = next(v for k, v in model.state_dict().items() if "lora_B" in k)
    assert lora_b.abs().max() > 0  # trained: a merge or adapter that dropped the update would differ
    return model.eval()


def _check_merged(out: Path, trained: Path) -> None:
    from transformers import LlamaForCausalLM

    model = _trained(trained)
    with torch.no_grad():
        want_logits = model(input_ids=IDS).logits
    want = model.merge_and_unload().state_dict()
    got, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert sorted(got.state_dict()) == sorted(want)
    for name, t in got.state_dict().items():
        assert torch.allclose(t, want[name], atol=1e-5, rtol=0), name
    with torch.no_grad():
        assert torch.allclose(got(input_ids=IDS).logits, want_logits, atol=1e-5)


def _check_adapter(out: Path, trained: Path, base: Path) -> None:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8, ["q_proj", "v_proj"])
    loaded = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), out).eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=IDS).logits, _trained(trained)(input_ids=IDS).logits, atol=1e-5)


# -- accelerate save_state -------------------------------------------------------------------

def test_accelerate_save_state_inspect(saves):
    info = ckpt_tools.inspect(saves["accelerate"][0])
    assert (info["format"], info["layout"]) == ("dcp", "accelerate")
    lora = info["lora"]
    assert (lora["rank"], lora["alpha"], lora["target_modules"], lora["adapter_only"]) == (4, 8, ["q_proj", "v_proj"], False)


def test_accelerate_save_state_merge_equals_peft(saves, tmp_path):
    src, trained = saves["accelerate"]
    r = _cli("export", src, tmp_path / "out", "--base", saves["base"], "--quiet")
    assert r.exit_code == 0, r.output
    _check_merged(tmp_path / "out", trained)


def test_accelerate_save_state_adapter_loads_with_peft(saves, tmp_path):
    src, trained = saves["accelerate"]
    r = _cli("export", src, tmp_path / "adapter", "--lora", "adapter", "--base", saves["base"], "--quiet")
    assert r.exit_code == 0, r.output
    _check_adapter(tmp_path / "adapter", trained, saves["base"])


# -- Trainer checkpoint-N --------------------------------------------------------------------

TRAINERS = ["trainer_fsdp", "trainer_single"]
ALPHA_ARGS = {"trainer_fsdp": ["--lora-alpha", "8"], "trainer_single": []}  # FSDP's checkpoint-N has no adapter_config.json


@pytest.mark.parametrize("name", TRAINERS)
def test_trainer_lora_inspect(saves, name):
    info = ckpt_tools.inspect(saves[name][0])
    lora = info["lora"]
    assert (lora["rank"], lora["target_modules"], lora["adapter_only"]) == (4, ["q_proj", "v_proj"], True)
    assert lora["alpha"] == (8 if name == "trainer_single" else None)
    assert info["layout"] == ("trainer" if name == "trainer_fsdp" else "plain")
    r = _cli("verify", saves[name][0])
    assert r.exit_code == 0 and "LoRA adapter weights only" in r.output, r.output


def test_trainer_fsdp_alpha_is_asked_for(saves, tmp_path):
    r = _cli("export", saves["trainer_fsdp"][0], tmp_path / "adapter", "--lora", "adapter", "--base", saves["base"])
    assert r.exit_code == 3 and "--lora-alpha" in r.output, r.output
    assert not (tmp_path / "adapter").exists()


@pytest.mark.parametrize("name", TRAINERS)
def test_trainer_lora_adapter_loads_with_peft(saves, tmp_path, name):
    src, trained = saves[name]
    r = _cli("export", src, tmp_path / "adapter", "--lora", "adapter", "--base", saves["base"], *ALPHA_ARGS[name])
    assert r.exit_code == 0, r.output
    _check_adapter(tmp_path / "adapter", trained, saves["base"])


@pytest.mark.parametrize("command", [["export"], ["convert", "--to", "hf"]])
@pytest.mark.parametrize("name", TRAINERS)
def test_trainer_lora_merge_without_base_weights_is_refused(saves, tmp_path, name, command):
    base_config = tmp_path / "config_only"  # a config is not weights: still nothing to merge into
    base_config.mkdir()
    (base_config / "config.json").write_text((saves["base"] / "config.json").read_text())
    for extra in ([], ["--base", base_config]):
        dst = tmp_path / f"out{len(extra)}"
        r = _cli(command[0], src := saves[name][0], dst, *command[1:], *extra)
        assert r.exit_code == 3, (src, r.output)
        assert ("--lora adapter" in r.output and "--base" in r.output) or "no weights to merge" in r.output, r.output
        assert not dst.exists()


@pytest.mark.parametrize("name", TRAINERS)
def test_trainer_lora_merge_with_base_equals_peft(saves, tmp_path, name):
    src, trained = saves[name]
    r = _cli("export", src, tmp_path / "out", "--base", saves["base"], *ALPHA_ARGS[name], "--quiet")
    assert r.exit_code == 0, r.output
    _check_merged(tmp_path / "out", trained)
