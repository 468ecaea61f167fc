"""torchtitan Mixture-of-Experts models (qwen3 MoE, deepseek_v3) both ways, checked against
torchtitan itself (0.3): its ``state_dict_adapter`` and its ``CheckpointManager``.

* A real torchtitan save exports to exactly what torchtitan's own HF save writes
  (``CheckpointManager`` with ``last_save_in_hf``: its adapter's ``to_hf`` and
  ``HuggingFaceStorageWriter``), bit for bit; ``from_pretrained`` loads the export with nothing
  missing, unexpected or misshapen, its ``save_pretrained`` writes the same tensors back, and it
  computes torchtitan's logits.
* A 2-rank ``fully_shard`` save (each rank holds two of the four experts; the DCP holds the
  global ``[E, ...]`` tensor in pieces, as with expert parallelism) exports the same.
* The three generations of torchtitan's MoE names (``moe.experts.w1`` with ``moe.expert_bias``,
  ``moe.experts.w1_EFD``, ``moe.routed_experts.inner_experts.w1_EFD``) export the same.
* ``convert HUB DST --to dcp --layout torchtitan`` is what ``CheckpointManager`` loads as its
  initial checkpoint: the model then holds exactly what torchtitan's own HF load gives it
  (``from_hf``'s tensors; the routing bias qwen3's HF model lacks at zeros).

Tiny models (dim 64, 4 experts, 2 layers; deepseek_v3's first layer dense), every weight random.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckpt_tools.cli.main import main as cli
from dist import run_ranks

pytest.importorskip("torchtitan.models.deepseek_v3")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

DIM, VOCAB, EXPERTS, LAYERS, HEADS = 64, 128, 4, 2, 4
# 128 tokens: torch's FlexAttention run eagerly on CPU reads past its tensors when the sequence
# is shorter than one 128-token mask block (see tests/test_torchtitan_names.py)
IDS = (torch.arange(128) * 5 + 3).remainder(VOCAB).unsqueeze(0)
FAMILIES = ("qwen3_moe", "deepseek_v3")


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


# -- the two families, as torchtitan and as transformers build them --------------------------

def _tt_config(family: str):
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm

    head = dict(vocab_size=VOCAB, dim=DIM, tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
                lm_head=Linear.Config(in_features=DIM, out_features=VOCAB))
    if family == "qwen3_moe":
        from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm

        return Qwen3Model.Config(**head, norm=_qwen3_norm(DIM), layers=_build_qwen3_moe_layers(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=2, head_dim=16, moe_hidden_dim=32,
            num_experts=EXPERTS, top_k=2, attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=16, max_seq_len=128, theta=1000000.0)))
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers

    return DeepSeekV3Model.Config(**head, norm=RMSNorm.Config(normalized_shape=DIM), mtp_layers=[], layers=_build_dsv3_layers(
        n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=HEADS, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, mscale=1.0, dense_hidden_dim=96, moe_hidden_dim=32,
        num_experts=EXPERTS, num_shared_experts=1, router_top_k=2, router_score_func="sigmoid",
        router_route_norm=True, attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=128, theta=10000.0)))


def _hf_config(family: str, **changes):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  max_position_embeddings=128, moe_intermediate_size=32, num_experts_per_tok=2,
                  norm_topk_prob=True, tie_word_embeddings=False)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=96, num_key_value_heads=2, head_dim=16,
                                           num_experts=EXPERTS, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                           architectures=["Qwen3MoeForCausalLM"], **changes)
    return transformers.DeepseekV3Config(**common, intermediate_size=96, num_key_value_heads=HEADS,
                                         n_routed_experts=EXPERTS, n_shared_experts=1, n_group=1, topk_group=1,
                                         first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                         qk_nope_head_dim=8, v_head_dim=16, rope_scaling=None, rope_theta=10000.0,
                                         routed_scaling_factor=1.0, rms_norm_eps=1e-5,  # torchtitan RMSNorm's default
                                         architectures=["DeepseekV3ForCausalLM"], **changes)


def _adapter(family: str):
    if family == "qwen3_moe":
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter as Adapter
    else:
        from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter as Adapter
    return Adapter(_tt_config(family), None)


def _randomize(model, seed: int, bias: bool):
    """Every weight random, and with ``bias`` the routing bias too (a misplaced tensor shows)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if bias and name.endswith(("expert_bias_E", "e_score_correction_bias")):
                b.normal_(0, 0.1)
    return model


def _tt_model(family: str, seed: int, bias: bool | None = None):
    # qwen3's HF model has no routing bias: a trained one cannot be exported as it routes (see
    # test_a_learned_qwen3_routing_bias_is_refused_unless_asked)
    return _randomize(_tt_config(family).build(), seed, family == "deepseek_v3" if bias is None else bias)


def _tt_logits(model):
    pos = torch.arange(IDS.shape[1]).unsqueeze(0)
    with torch.no_grad():
        return model(IDS, pos, model.get_attention_masks(pos))


def _manager(model, folder: Path, sd_adapter=None, **config):
    from torchtitan.components.checkpoint import CheckpointManager

    return CheckpointManager(CheckpointManager.Config(enable=True, folder="checkpoint", **config), dataloader=None,
                             model_parts=[model], optimizers=None, lr_schedulers=None, states={},
                             sd_adapter=sd_adapter, base_folder=str(folder))


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _same_bits(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), name


@pytest.fixture(scope="module", params=FAMILIES)
def tt_save(request, tmp_path_factory):
    """A torchtitan save of one family (``step-3/``, DCP), torchtitan's own HF save of the same
    model (``step-4/``, safetensors), the state dict saved, the model, and an HF config folder."""
    family = request.param
    root = tmp_path_factory.mktemp(f"tt_{family}")
    model = _tt_model(family, 0)
    _manager(model, root / "job", last_save_model_only=True).save(curr_step=3, last_step=True)
    _manager(model, root / "hfjob", sd_adapter=_adapter(family), last_save_model_only=True,
             last_save_in_hf=True).save(curr_step=4, last_step=True)
    _hf_config(family).save_pretrained(root / "hfconfig")
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    return family, root / "job" / "checkpoint" / "step-3", root / "hfjob" / "checkpoint" / "step-4", sd, model, root


def test_export_is_torchtitans_own_hf_save(tt_save, tmp_path):
    from transformers import AutoModelForCausalLM

    family, step, theirs, sd, model, root = tt_save
    r = _cli("export", step, tmp_path / "hf", "--base", root / "hfconfig")
    assert r.exit_code == 0, r.output
    got = _safetensors(tmp_path / "hf")
    want = _safetensors(theirs)
    assert any(".mlp.experts.3.down_proj." in n for n in want)  # per expert, as the hub holds them
    _same_bits(got, want)
    _same_bits(got, {k: v for k, v in _adapter(family).to_hf(sd).items()})
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(hf).__name__ == _hf_config(family).architectures[0]
    hf.save_pretrained(tmp_path / "again")  # what transformers itself writes for this model type
    _same_bits(_safetensors(tmp_path / "again"), got)
    with torch.no_grad():
        ours, theirs_logits = hf(input_ids=IDS).logits, _tt_logits(model)
    # torchtitan's grouped experts compute in bfloat16 (GroupedExperts casts), HF's in float32:
    # the logits agree to bfloat16's precision (measured: 2e-3 at most), where two experts
    # swapped move them by 0.3
    assert torch.isfinite(theirs_logits).all()
    assert (ours - theirs_logits).abs().max() < 0.02, (ours - theirs_logits).abs().max()
    assert "warning" not in r.output


def _sharded_save(rank: int, world_size: int, family: str, dst: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    model = _tt_model(family, 0)
    for layer in model.layers.values() if hasattr(model.layers, "values") else model.layers:
        fully_shard(layer)
    fully_shard(model)
    experts = model.state_dict()["layers.1.moe.routed_experts.inner_experts.w1_EFD"]
    assert experts.to_local().shape[0] == EXPERTS // world_size  # each rank holds its experts only
    dcp.save(model.state_dict(), checkpoint_id=dst)


def test_a_two_rank_save_exports_the_same(tt_save, tmp_path):
    family, _, theirs, _, _, root = tt_save
    run_ranks(_sharded_save, 2, tmp_path, family, str(tmp_path / "step-2"))
    r = _cli("export", tmp_path / "step-2", tmp_path / "hf", "--base", root / "hfconfig")
    assert r.exit_code == 0, r.output
    _same_bits(_safetensors(tmp_path / "hf"), _safetensors(theirs))


GENERATIONS = {
    # torchtitan's MoE until 2026-05: moe.experts.w1 [E, F, D], moe.expert_bias; attention wq, output
    "2025": lambda k: (k.replace("moe.routed_experts.inner_experts.", "moe.experts.").replace("_EFD", "")
                       .replace("_EDF", "").replace("moe.expert_bias_E", "moe.expert_bias")
                       .replace("attention.qkv_linear.", "attention.").replace("lm_head.", "output.")),
    # 2026-05 to 2026-07: shape suffixes, no routed_experts/inner_experts modules yet
    "2026-05": lambda k: k.replace("moe.routed_experts.inner_experts.", "moe.experts."),
}


@pytest.mark.parametrize("generation", list(GENERATIONS))
def test_older_torchtitan_moe_names_export_the_same(tt_save, tmp_path, generation):
    import torch.distributed.checkpoint as dcp

    family, _, theirs, sd, _, root = tt_save
    older = {GENERATIONS[generation](k): v for k, v in sd.items()}
    assert set(older) != set(sd)
    dcp.save(older, checkpoint_id=str(tmp_path / "old"))
    r = _cli("export", tmp_path / "old", tmp_path / "hf", "--base", root / "hfconfig")
    assert r.exit_code == 0, r.output
    _same_bits(_safetensors(tmp_path / "hf"), _safetensors(theirs))


def _hub(family: str, folder: Path, seed: int = 1):
    """``save_pretrained`` of a random HF model (DeepSeek's routing bias random too)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = _randomize(AutoModelForCausalLM.from_config(_hf_config(family)), seed, True)
    model.save_pretrained(folder)
    return folder, model


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_hub_to_torchtitan_is_what_its_own_hf_load_gives(tmp_path, family, world_size):
    hub, hf = _hub(family, tmp_path / "hub")
    dst = tmp_path / "initial"
    r = _cli("convert", hub, dst, "--to", "dcp", "--layout", "torchtitan", "--world-size", world_size)
    assert r.exit_code == 0, r.output
    ours = _tt_model(family, 7)  # other weights: a load that did nothing would show
    _manager(ours, tmp_path / "job", initial_load_path=str(dst), initial_load_model_only=True).load(step=-1)
    got = ours.state_dict()
    want = _adapter(family).from_hf(load_file(hub / "model.safetensors"))
    assert any(k.endswith("inner_experts.w2_EDF") and v.shape[0] == EXPERTS for k, v in want.items())
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    # what torchtitan's own initial load from the hub gives a freshly built model, every state
    fresh = _tt_config(family).build()
    _manager(fresh, tmp_path / "job2", sd_adapter=_adapter(family), initial_load_path=str(hub),
             initial_load_model_only=True, initial_load_in_hf=True).load(step=-1)
    theirs = fresh.state_dict()
    assert sorted(got) == sorted(theirs)
    for name, t in theirs.items():
        assert torch.equal(got[name], t), name
    if family == "qwen3_moe":  # HF's Qwen3-MoE has no routing bias: torchtitan's starts at zeros
        assert not got["layers.1.moe.expert_bias_E"].any()
    if world_size == 1:  # the same model: HF's logits to bfloat16's precision (torchtitan's experts)
        with torch.no_grad():
            assert (_tt_logits(ours) - hf(input_ids=IDS).logits).abs().max() < 0.02


def test_a_multi_token_prediction_layer_is_refused(tmp_path):
    """DeepSeek's hub keeps its MTP layer after the last decoder layer: not mapped (exit 3)."""
    from safetensors.torch import save_file

    hub, _ = _hub("deepseek_v3", tmp_path / "hub")
    weights = load_file(hub / "model.safetensors")
    weights[f"model.layers.{LAYERS}.enorm.weight"] = torch.ones(DIM)
    save_file(weights, hub / "model.safetensors", metadata={"format": "pt"})
    r = _cli("convert", hub, tmp_path / "out", "--to", "dcp", "--layout", "torchtitan")
    assert r.exit_code == 3 and f"model.layers.{LAYERS}.enorm.weight" in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_a_missing_expert_is_refused(tmp_path):
    from safetensors.torch import save_file

    hub, _ = _hub("qwen3_moe", tmp_path / "hub")
    weights = load_file(hub / "model.safetensors")
    del weights["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(weights, hub / "model.safetensors", metadata={"format": "pt"})
    r = _cli("convert", hub, tmp_path / "out", "--to", "dcp", "--layout", "torchtitan")
    assert r.exit_code == 3 and "model.layers.1.mlp.experts.2.up_proj.weight" in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_deepseek_without_interleaved_rotary_is_refused(tt_save, tmp_path):
    """HF's DeepSeek-V3 with ``rope_interleave: false`` rotates halves, torchtitan pairs: the
    names would map and the model would compute something else (exit 3 both ways)."""
    family, step, *_ = tt_save
    if family != "deepseek_v3":
        pytest.skip("deepseek_v3's rotary convention")
    _hf_config(family, rope_interleave=False).save_pretrained(tmp_path / "cfg")
    r = _cli("export", step, tmp_path / "hf", "--base", tmp_path / "cfg")
    assert r.exit_code == 3 and "rope_interleave" in r.output, r.output
    hub, _ = _hub(family, tmp_path / "hub")
    _hf_config(family, rope_interleave=False).save_pretrained(hub)
    r = _cli("convert", hub, tmp_path / "tt", "--to", "dcp", "--layout", "torchtitan")
    assert r.exit_code == 3 and "rope_interleave" in r.output, r.output


def test_a_learned_qwen3_routing_bias_is_refused_unless_asked(tmp_path):
    """torchtitan's qwen3 MoE learns ``expert_bias_E`` (load balancing), which HF's Qwen3-MoE has
    no tensor for: without it the model routes differently, so the export is exit 3 naming the
    tensor; ``--no-arch-check`` writes torchtitan's own ``to_hf`` (bias left out) with a warning."""
    model = _tt_model("qwen3_moe", 0, bias=True)
    _manager(model, tmp_path / "job", last_save_model_only=True).save(curr_step=1, last_step=True)
    _hf_config("qwen3_moe").save_pretrained(tmp_path / "cfg")
    src = tmp_path / "job" / "checkpoint" / "step-1"
    r = _cli("export", src, tmp_path / "hf", "--base", tmp_path / "cfg")
    assert r.exit_code == 3 and "layers.0.moe.expert_bias_E" in r.output and "--no-arch-check" in r.output, r.output
    assert not (tmp_path / "hf").exists()
    r = _cli("export", src, tmp_path / "hf", "--base", tmp_path / "cfg", "--no-arch-check")
    assert r.exit_code == 0, r.output
    assert "warning:" in r.output and "layers.0.moe.expert_bias_E" in r.output and "route" in r.output, r.output
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    _same_bits(_safetensors(tmp_path / "hf"), _adapter("qwen3_moe").to_hf(sd))


def test_torchtitans_multi_token_prediction_layers_are_refused_on_export(tt_save, tmp_path):
    import torch.distributed.checkpoint as dcp

    family, _, _, sd, _, root = tt_save
    if family != "deepseek_v3":
        pytest.skip("deepseek_v3's multi-token prediction")
    dcp.save({**sd, "mtp_layers.0.enorm.weight": torch.ones(DIM)}, checkpoint_id=str(tmp_path / "mtp"))
    r = _cli("export", tmp_path / "mtp", tmp_path / "hf", "--base", root / "hfconfig")
    assert r.exit_code == 3 and "mtp_layers.0.enorm.weight" in r.output, r.output
    assert not (tmp_path / "hf").exists()
