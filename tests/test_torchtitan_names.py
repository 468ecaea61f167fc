"""torchtitan names both ways, checked against torchtitan itself (0.3).

* A real torchtitan save (``CheckpointManager.save`` of a tiny llama3 ``Llama3Model``) exports to
  exactly what torchtitan's own ``Llama3StateDictAdapter.to_hf`` gives, bit for bit, loads with
  ``from_pretrained`` (no missing or unexpected keys) and computes torchtitan's logits.
* ``convert HF DST --to dcp --layout torchtitan`` is what ``CheckpointManager`` loads as its
  initial checkpoint: the model then holds ``from_hf``'s tensors bit for bit and computes
  ``from_pretrained``'s logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckpt_tools.cli.main import main as cli

pytest.importorskip("torchtitan.models.llama3")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

DIM, HEADS, KV_HEADS, VOCAB, LAYERS, FFN = 32, 4, 2, 64, 2, 64
# 128 tokens: torch's FlexAttention run eagerly on CPU reads past its tensors when the sequence is
# shorter than one 128-token mask block (8 tokens gave NaN or other logits from run to run, in a
# fresh process too), so the forward is compared on one whole block
IDS = (torch.arange(128) * 4 + 1).remainder(VOCAB).unsqueeze(0)


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _tt_config():
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3 import _build_llama3_layers

    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM), lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_llama3_layers(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=FFN,
                                    rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=128, theta=10000.0),
                                    attn_backend="flex"))


def _hf_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                       rope_theta=10000.0, rms_norm_eps=1e-5,  # torchtitan RMSNorm default tie_word_embeddings=False,
                       architectures=["LlamaForCausalLM"])


def _tt_model(seed: int):
    torch.manual_seed(seed)
    model = _tt_config().build()
    with torch.no_grad():  # every tensor random, norms included, so a misplaced one shows
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def _tt_logits(model):
    pos = torch.arange(IDS.shape[1]).unsqueeze(0)
    with torch.no_grad():
        return model(IDS, pos, model.get_attention_masks(pos))


def _manager(model, folder: Path, **config):
    from torchtitan.components.checkpoint import CheckpointManager

    return CheckpointManager(CheckpointManager.Config(enable=True, folder="checkpoint", **config), dataloader=None,
                             model_parts=[model], optimizers=None, lr_schedulers=None, states={}, sd_adapter=None,
                             base_folder=str(folder))


def _adapter():
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    return Llama3StateDictAdapter(_tt_config(), None)


@pytest.fixture(scope="module")
def tt_save(tmp_path_factory):
    """A torchtitan save, the state dict it saved, and an HF config folder for --base."""
    root = tmp_path_factory.mktemp("tt")
    model = _tt_model(0)
    _manager(model, root / "job", last_save_model_only=True).save(curr_step=5, last_step=True)
    _hf_config().save_pretrained(root / "hfconfig")
    return root / "job" / "checkpoint" / "step-5", {k: v.clone() for k, v in model.state_dict().items()}, model, root


def test_export_is_bit_equal_to_torchtitans_to_hf(tt_save, tmp_path):
    from transformers import LlamaForCausalLM

    step, sd, model, root = tt_save
    r = _cli("export", step, tmp_path / "hf", "--base", root / "hfconfig")
    assert r.exit_code == 0, r.output
    got = load_file(tmp_path / "hf" / "model.safetensors")
    want = _adapter().to_hf(sd)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    hf, info = LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=IDS).logits, _tt_logits(model), atol=1e-4)


def test_export_refuses_a_config_its_names_do_not_fit(tt_save, tmp_path):
    """torchtitan names mapped to HF ones are checked like any others: a config with one layer
    more is exit 3 by name, nothing written (export and convert --to hf)."""
    step, *_ = tt_save
    config = _hf_config()
    config.num_hidden_layers += 1
    config.save_pretrained(tmp_path / "wrong")
    for args in (["export"], ["convert", "--to", "hf"]):
        r = _cli(args[0], step, tmp_path / "hf", *args[1:], "--base", tmp_path / "wrong")
        assert r.exit_code == 3 and f"missing (model.layers.{LAYERS}." in r.output, r.output
        assert not (tmp_path / "hf").exists()


def test_older_torchtitan_spelling_maps_the_same(tt_save, tmp_path):
    import torch.distributed.checkpoint as dcp

    step, sd, _, root = tt_save
    older = {k.replace("attention.qkv_linear.", "attention.").replace("lm_head.", "output."): v for k, v in sd.items()}
    dcp.save(older, checkpoint_id=str(tmp_path / "old"))
    assert _cli("export", tmp_path / "old", tmp_path / "hf", "--base", root / "hfconfig").exit_code == 0
    got = load_file(tmp_path / "hf" / "model.safetensors")
    for name, t in _adapter().to_hf(sd).items():
        assert torch.equal(got[name], t), name


def test_export_without_a_config_refuses(tt_save, tmp_path):
    step, *_ = tt_save
    r = _cli("export", step, tmp_path / "hf")
    assert r.exit_code == 3 and "--base" in r.output, r.output
    assert not (tmp_path / "hf").exists()


def test_fused_qkv_is_refused(tmp_path, tt_save):
    import torch.distributed.checkpoint as dcp

    _, sd, _, root = tt_save
    fused = dict(sd)
    for i in range(LAYERS):
        parts = [fused.pop(f"layers.{i}.attention.qkv_linear.w{x}.weight") for x in "qkv"]
        fused[f"layers.{i}.attention.qkv_linear.wqkv.weight"] = torch.cat(parts)
    dcp.save(fused, checkpoint_id=str(tmp_path / "fused"))
    r = _cli("export", tmp_path / "fused", tmp_path / "hf", "--base", root / "hfconfig")
    assert r.exit_code == 3 and "wqkv" in r.output, r.output


@pytest.mark.parametrize("world_size", [1, 3])
def test_hf_to_torchtitan_loads_in_checkpoint_manager(tmp_path, world_size):
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    hf = LlamaForCausalLM(_hf_config())
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    hf.save_pretrained(tmp_path / "hf")
    dst = tmp_path / "initial"
    r = _cli("convert", tmp_path / "hf", dst, "--to", "dcp", "--layout", "torchtitan", "--world-size", world_size)
    assert r.exit_code == 0, r.output
    model = _tt_model(7)  # other weights: a load that did nothing would show
    _manager(model, tmp_path / "job", initial_load_path=str(dst), initial_load_model_only=True).load(step=-1)
    want = _adapter().from_hf({k: v.clone() for k, v in hf.state_dict().items()})
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    with torch.no_grad():
        assert torch.allclose(_tt_logits(model), hf(input_ids=IDS).logits, atol=1e-4)


def _qwen3():
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers, _qwen3_norm

    head_dim = 8
    return Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=_qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_qwen3_layers(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=head_dim,
                                   hidden_dim=FFN, attn_backend="flex",
                                   rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=128, theta=1000000.0)))


def test_qwen3_both_ways_match_torchtitans_adapter(tmp_path):
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = _qwen3().build()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    _manager(model, tmp_path / "job", last_save_model_only=True).save(curr_step=2, last_step=True)
    Qwen3Config(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=8, max_position_embeddings=128,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                architectures=["Qwen3ForCausalLM"]).save_pretrained(tmp_path / "cfg")
    r = _cli("export", tmp_path / "job" / "checkpoint" / "step-2", tmp_path / "hf", "--base", tmp_path / "cfg")
    assert r.exit_code == 0, r.output
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    want = Qwen3StateDictAdapter(_qwen3(), None).to_hf(sd)
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    _, info = Qwen3ForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    back = tmp_path / "back"
    assert _cli("convert", tmp_path / "hf", back, "--to", "dcp", "--layout", "torchtitan").exit_code == 0
    other = _qwen3().build()
    _manager(other, tmp_path / "job2", initial_load_path=str(back), initial_load_model_only=True).load(step=-1)
    for name, t in sd.items():
        assert torch.equal(other.state_dict()[name], t), name
