"""Real frameworks' checkpoints through ``ckpt reshard``, resumed by the frameworks' own loaders.

For each framework: a 4-rank job saves with the framework's own code after step 2 and runs on to
step 4 (the uninterrupted losses); ``ckpt reshard --to 2`` and ``--to 3`` write the save for
another world size; the framework's own loader resumes at 2 and 3 ranks and must reproduce the
uninterrupted steps 3-4 within 1e-5 relative. The jobs are in ``fw_<framework>.py``.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from dist import run_ranks
from fw_common import close

from ckpt_tools.cli.main import main as cli
from ckpt_tools.formats.dcp import METADATA

pytestmark = pytest.mark.filterwarnings("ignore")

SAVE_AT, STEPS = 2, 4


def _ckpt(*args: str) -> str:
    result = CliRunner().invoke(cli, [*args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _inspect(path) -> dict:
    return json.loads(_ckpt("inspect", str(path), "--json"))


def _dcp_keys(part) -> tuple[set, dict]:
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(part)).read_metadata()
    return set(meta.state_dict_metadata), meta.planner_data


class Framework:
    """One framework's 4-rank save, shared by the cases that reshard and resume it."""

    def __init__(self, job, tmp, *, save_dir=lambda out: out, **kw):
        self.job, self.tmp, self.kw = job, tmp, kw
        out = tmp / "run"
        self.full = run_ranks(functools.partial(job, save_at=SAVE_AT, load=None, steps=STEPS, **kw), 4, tmp, str(out))[0]
        self.saved = Path(save_dir(str(out)))

    def resume(self, path, world_size: int) -> list[float]:
        return run_ranks(functools.partial(self.job, save_at=None, load=str(path), steps=STEPS - SAVE_AT, **self.kw),
                         world_size, self.tmp, str(self.tmp / f"resume{world_size}"))[0]


@pytest.fixture(scope="module")
def accelerate_save(tmp_path_factory):
    import fw_accelerate

    return Framework(fw_accelerate.job, tmp_path_factory.mktemp("accelerate"))


@pytest.fixture(scope="module")
def trainer_save(tmp_path_factory):
    import fw_trainer

    return Framework(fw_trainer.job, tmp_path_factory.mktemp("trainer"),
                     save_dir=lambda out: fw_trainer.checkpoint_dir(out, SAVE_AT))


# -- accelerate ------------------------------------------------------------------------------

def test_accelerate_inspect(accelerate_save):
    info = _inspect(accelerate_save.saved)
    assert (info["format"], info["layout"], info["fsdp_version"], info["world_size"]) == ("dcp", "accelerate", None, 4)
    assert info["side_files"] == [f"random_states_{r}.pkl" for r in range(4)] + ["scheduler.bin"]


@pytest.mark.parametrize("to", [2, 3])
def test_accelerate_reshard_resumes(accelerate_save, tmp_path, to):
    src, dst = accelerate_save.saved, tmp_path / f"ws{to}"
    result = CliRunner().invoke(cli, ["reshard", str(src), str(dst), "--to", str(to), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "warning: rank-local files random_states_0.pkl" in result.output  # dropped, and said so
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert _dcp_keys(dst / part) == _dcp_keys(src / part)  # no key renamed, nested or un-nested
        assert sorted(p.name for p in (dst / part).iterdir()) == [METADATA] + [f"__{r}_0.distcp" for r in range(to)]
    assert (dst / "scheduler.bin").read_bytes() == (src / "scheduler.bin").read_bytes()
    assert not list(dst.glob("random_states_*"))
    info = _inspect(dst)
    assert (info["layout"], info["world_size"]) == ("accelerate", to)
    assert close(accelerate_save.resume(dst, to), accelerate_save.full[SAVE_AT:])


def test_accelerate_keep_first(accelerate_save, tmp_path):
    src, dst = accelerate_save.saved, tmp_path / "ws3"
    _ckpt("reshard", str(src), str(dst), "--to", "3", "--rank-local", "keep-first", "--quiet")
    for r in range(3):
        assert (dst / f"random_states_{r}.pkl").read_bytes() == (src / f"random_states_{r}.pkl").read_bytes()
    assert not (dst / "random_states_3.pkl").exists()


# -- transformers Trainer --------------------------------------------------------------------

def test_trainer_inspect(trainer_save):
    info = _inspect(trainer_save.saved)
    assert (info["format"], info["layout"], info["fsdp_version"], info["world_size"]) == ("dcp", "trainer", None, 4)
    assert set(info["side_files"]) >= {"scheduler.pt", "trainer_state.json"} | {f"rng_state_{r}.pth" for r in range(4)}


@pytest.mark.parametrize("to", [2, 3])
def test_trainer_reshard_resumes(trainer_save, tmp_path, to):
    src, dst = trainer_save.saved, tmp_path / f"checkpoint-{SAVE_AT}"
    _ckpt("reshard", str(src), str(dst), "--to", str(to), "--quiet")
    for name in ("scheduler.pt", "trainer_state.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()
    assert not list(dst.glob("rng_state_*"))
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert _dcp_keys(dst / part) == _dcp_keys(src / part)
    assert _inspect(dst)["layout"] == "trainer"
    assert close(trainer_save.resume(dst, to), trainer_save.full[SAVE_AT:])


# -- torchtitan ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def torchtitan_save(tmp_path_factory):
    import fw_torchtitan

    return Framework(fw_torchtitan.job, tmp_path_factory.mktemp("torchtitan"),
                     save_dir=lambda out: f"{out}/step-{SAVE_AT}")


def test_torchtitan_inspect(torchtitan_save):
    info = _inspect(torchtitan_save.saved)
    assert (info["format"], info["layout"], info["fsdp_version"], info["world_size"]) == ("dcp", "torchtitan", 2, 4)
    assert info["side_files"] == []
    names = {t["name"] for t in json.loads(_ckpt("inspect", str(torchtitan_save.saved), "--json", "--tensors"))["tensors"]}
    assert "tok_embeddings.weight" in names  # top-level model keys, as torchtitan saved them


@pytest.mark.parametrize("to", [2, 3])
def test_torchtitan_reshard_resumes(torchtitan_save, tmp_path, to):
    """torchtitan resumes the resharded step-N/ as its own reshard-at-load of the 4-rank save
    does (the same losses, bit for bit there); the data-loader state is rank-local and dropped,
    so the job excludes it from loading, as torchtitan asks of any resume at another DP degree."""
    src, dst = torchtitan_save.saved, tmp_path / "folder" / f"step-{SAVE_AT}"
    result = CliRunner().invoke(cli, ["reshard", str(src), str(dst), "--to", str(to), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "warning: rank-local entries dataloader.dp_rank_0" in result.output
    assert 'checkpoint.exclude_from_loading = ["dataloader"]' in result.output  # what the user must then do
    keys, planner = _dcp_keys(dst)
    src_keys, src_planner = _dcp_keys(src)
    dropped = {f"dataloader.dp_rank_{r}" for r in range(4)}
    assert keys == src_keys - dropped
    assert planner == {k: v for k, v in src_planner.items() if k not in dropped}
    assert close(torchtitan_save.resume(dst.parent, to), torchtitan_save.full[SAVE_AT:])
    own = torchtitan_save.resume(src.parent, to)  # torchtitan's own reshard-at-load of the same save
    assert close(own, torchtitan_save.full[SAVE_AT:])


# -- verl ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def verl_fsdp2_save(tmp_path_factory):
    import fw_verl

    return Framework(fw_verl.job, tmp_path_factory.mktemp("verl2"), fsdp=2)


@pytest.fixture(scope="module")
def verl_lora_save(tmp_path_factory):
    import fw_verl

    return Framework(fw_verl.job, tmp_path_factory.mktemp("verl_lora"), fsdp=2, lora=True, hf_model=True)


def test_verl_fsdp2_inspect(verl_fsdp2_save):
    info = _inspect(verl_fsdp2_save.saved)
    assert (info["format"], info["layout"], info["fsdp_version"], info["world_size"]) == ("sharded", "verl", 2, 4)
    assert info["side_files"] == ["huggingface/config.json", "huggingface/tokenizer.json", "huggingface/tokenizer_config.json"]


@pytest.mark.parametrize("to", [1, 2, 3])  # 1: written by torch's writer, its mesh named as verl's
def test_verl_fsdp2_reshard_resumes(verl_fsdp2_save, tmp_path, to):
    src, dst = verl_fsdp2_save.saved, tmp_path / "actor"
    _ckpt("reshard", str(src), str(dst), "--to", str(to), "--quiet")
    assert json.loads((dst / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": to}
    assert close(verl_fsdp2_save.resume(dst, to), verl_fsdp2_save.full[SAVE_AT:])


def test_verl_resumes_from_another_format_with_its_mesh_named(verl_fsdp2_save, tmp_path):
    """verl's save converted to DCP and back to rank files at 2 ranks with --layout verl: verl's
    loader takes them (its model's mesh is named ("fsdp",), and load_state_dict copies DTensors
    only between meshes of the same names) and the run resumes."""
    dcp_dir, dst = tmp_path / "dcp", tmp_path / "actor"
    _ckpt("convert", str(verl_fsdp2_save.saved), str(dcp_dir), "--to", "dcp", "--quiet")
    _ckpt("convert", str(dcp_dir), str(dst), "--to", "sharded", "--world-size", "2", "--layout", "verl", "--quiet")
    assert close(verl_fsdp2_save.resume(dst, 2), verl_fsdp2_save.full[SAVE_AT:])


def test_verl_lora_side_files_carried(verl_lora_save, tmp_path):
    """LoRA runs: lora_train_meta.json (the merger's alpha) and huggingface/model.safetensors
    come out byte for byte; the resharded LoRA job resumes."""
    src, dst = verl_lora_save.saved, tmp_path / "actor"
    info = _inspect(src)
    assert {"lora_train_meta.json", "huggingface/model.safetensors"} <= set(info["side_files"])
    _ckpt("reshard", str(src), str(dst), "--to", "2", "--quiet")
    for name in info["side_files"]:
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    assert close(verl_lora_save.resume(dst, 2), verl_lora_save.full[SAVE_AT:])


@pytest.fixture(scope="module")
def verl_lora_adapters_save(tmp_path_factory):
    """LoRA whose optimizer is built over the trainable parameters only (the adapters): its
    int ids number those, not the model's parameters."""
    import fw_verl

    return Framework(fw_verl.job, tmp_path_factory.mktemp("verl_lora_adapters"), fsdp=2, lora=True,
                     trainable_only=True)


def test_verl_lora_adapters_only_optimizer(verl_lora_adapters_save, tmp_path):
    """The optimizer's states are named after the adapters they belong to; the save reshards
    (verl's loader resumes it at 2 ranks) and exports."""
    from transformers import LlamaForCausalLM

    src = verl_lora_adapters_save.saved
    info = json.loads(_ckpt("inspect", str(src), "--json", "--tensors"))
    states = {t["name"] for t in info["tensors"] if t["group"] == "optimizer"}
    assert info["optimizer"]["params"] == 8 and len(states) == 24, info["optimizer"]
    assert all(".lora_A." in n or ".lora_B." in n for n in states), sorted(states)
    _ckpt("reshard", str(src), str(tmp_path / "actor"), "--to", "2", "--quiet")
    assert close(verl_lora_adapters_save.resume(tmp_path / "actor", 2), verl_lora_adapters_save.full[SAVE_AT:])
    _ckpt("export", str(src), str(tmp_path / "hf"), "--quiet")
    _, loading = LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading


@pytest.fixture(scope="module")
def verl_fsdp1_save(tmp_path_factory):
    """A real verl FSDP1 (use_orig_params=False) save: optimizer state per flat parameter."""
    import fw_verl

    tmp = tmp_path_factory.mktemp("verl1")
    run_ranks(functools.partial(fw_verl.job, save_at=SAVE_AT, load=None, steps=SAVE_AT, fsdp=1), 4, tmp, str(tmp / "run"))
    return tmp / "run"


def test_verl_fsdp1_inspect(verl_fsdp1_save):
    """Flat-parameter optimizer state, mapped onto the parameters through the model's config
    (tests/test_fsdp1_flat.py resumes such saves)."""
    info = _inspect(verl_fsdp1_save)
    assert (info["layout"], info["fsdp_version"]) == ("verl", 1)
    assert "flat_parameters" not in info["optimizer"]
    assert info["groups"]["optimizer"]["num_tensors"] == 3 * info["groups"]["model"]["num_tensors"]


@pytest.mark.parametrize("args", [["reshard", "--to", "2"], ["convert", "--to", "dcp"]])
def test_verl_fsdp1_flat_optimizer_refused_without_config(verl_fsdp1_save, tmp_path, args):
    """Without the model's config the flat parameters' make-up is unknown: exit 3, nothing written."""
    src, dst = tmp_path / "src", tmp_path / "out"
    shutil.copytree(verl_fsdp1_save, src, ignore=shutil.ignore_patterns("huggingface"))
    assert _inspect(src)["optimizer"]["flat_parameters"] is True
    result = CliRunner().invoke(cli, [args[0], str(src), str(dst), *args[1:]])
    assert result.exit_code == 3, result.output
    assert "flat parameter" in result.output and "config.json" in result.output and "--model-only" in result.output
    assert result.output.count("error:") == 1
    assert not dst.exists()


def test_verl_fsdp1_model_exports(verl_fsdp1_save, tmp_path):
    """The model files of an FSDP1 save are whole DTensor shards: export is exact."""
    import torch
    from safetensors.torch import load_file

    dst = tmp_path / "hf"
    _ckpt("export", str(verl_fsdp1_save), str(dst), "--quiet")
    sd = load_file(dst / "model.safetensors")
    from ckpt_tools.security.safeload import load_torch  # torch.load(weights_only=True), DTensor globals allowed

    ranks = [load_torch(verl_fsdp1_save / f"model_world_size_4_rank_{r}.pt") for r in range(4)]
    assert sorted(sd) == sorted(ranks[0])
    for name, value in sd.items():
        assert torch.equal(value, torch.cat([rank[name]._local_tensor for rank in ranks])), name


def test_trainer_export_loads_in_transformers(trainer_save, fixtures_dir, tmp_path):
    """A Trainer checkpoint-N/ exports under the architecture's own names (checked before writing):
    from_pretrained finds no missing or unexpected keys and the weights are the saved ones."""
    import torch
    from transformers import AutoModelForCausalLM

    dst = tmp_path / "hf"
    _ckpt("export", str(trainer_save.saved), str(dst), "--base", str(fixtures_dir / "llama_hf"), "--quiet")
    model, info = AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    torch_out = tmp_path / "full.pt"
    _ckpt("convert", str(trainer_save.saved), str(torch_out), "--to", "torch", "--model-only", "--quiet")
    saved = torch.load(torch_out, weights_only=True)
    saved = saved.get("model", saved)
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name


# -- export of every framework's own save: loads clean or refuses ----------------------------

@pytest.mark.parametrize("name", ["accelerate", "trainer", "verl_fsdp2", "verl_lora"])
def test_export_loads_clean_or_refuses(request, fixtures_dir, tmp_path, name):
    """Each framework's real save: export under a config with one layer more is exit 3 naming the
    missing layer, nothing written; under its own config from_pretrained finds no missing,
    unexpected or misshapen keys (verl's config is its huggingface/ folder, the others' --base)."""
    from transformers import AutoModelForCausalLM

    src = tmp_path / "src"
    shutil.copytree(request.getfixturevalue(f"{name}_save").saved, src)
    own = src / "huggingface" / "config.json"
    config_file = own if own.is_file() else tmp_path / "base" / "config.json"
    config_file.parent.mkdir(exist_ok=True)
    good = json.loads((own if own.is_file() else fixtures_dir / "llama_hf" / "config.json").read_text())
    base = [] if own.is_file() else ["--base", str(config_file.parent)]
    config_file.write_text(json.dumps({**good, "num_hidden_layers": good["num_hidden_layers"] + 1}))
    for command in (["export"], ["convert", "--to", "hf"]):
        r = CliRunner().invoke(cli, [command[0], str(src), str(tmp_path / "bad"), *command[1:], *base])
        assert r.exit_code == 3, r.output
        assert f"missing (model.layers.{good['num_hidden_layers']}." in r.output, r.output
        assert not (tmp_path / "bad").exists()
    config_file.write_text(json.dumps(good))
    _ckpt("export", str(src), str(tmp_path / "hf"), *base, "--quiet")
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
