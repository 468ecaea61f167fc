"""Large-world fixtures made with torch's own writers, one process, rank by rank.

verl rank files: ``model_/optim_/extra_state_world_size_{W}_rank_{r}.pt`` holding DTensors
(``Shard(0)``) saved under torch's fake process group; DCPs: ``dcp.save``'s own steps run rank
by rank (``DefaultSavePlanner`` local plans -> ``create_global_plan`` -> ``FileSystemWriter``
``prepare_local_plan``/``write_data`` per rank -> ``finish``). ckpt writes none of it.

    python tests/fw_scale.py verl /tmp/v64 --ranks 64 [--optim]
    python tests/fw_scale.py dcp /tmp/d64 --ranks 64 [--optim]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch


def llama_shapes(*, layers: int = 32, hidden: int = 256, inter: int = 448, vocab: int = 1024,
                 split: int = 1, tile: int = 0) -> dict[str, tuple[int, ...]]:
    """A Llama-shaped state dict's names and shapes (``3 + 9 * layers`` tensors). ``split``
    cuts every matrix into that many row blocks (more, smaller tensors; the same bytes);
    ``tile`` into ``tile`` x ``tile`` blocks instead, as an MoE's per-expert layout has tens of
    thousands of small matrices (32: 19,521 tensors, each of whose rows 8 ranks share evenly)."""
    if tile:
        return {(k.removesuffix(".weight") + f".{i}_{j}.weight" if len(s) == 2 else k): ((tile, tile) if len(s) == 2 else s)
                for k, s in llama_shapes(layers=layers, hidden=hidden, inter=inter, vocab=vocab).items()
                for i in range(s[0] // tile if len(s) == 2 else 1) for j in range(s[1] // tile if len(s) == 2 else 1)}
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    mats = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden, hidden),
            "self_attn.v_proj": (hidden, hidden), "self_attn.o_proj": (hidden, hidden),
            "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for m, shape in mats.items():
            if split == 1:
                out[f"{p}{m}.weight"] = shape
            else:
                rows = shape[0] // split
                for j in range(split):
                    out[f"{p}{m}.{j}.weight"] = (rows, shape[1])
        out[p + "input_layernorm.weight"] = (hidden,)
        out[p + "post_attention_layernorm.weight"] = (hidden,)
    out["model.norm.weight"] = (hidden,)
    out["lm_head.weight"] = (vocab, hidden)
    return out


LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
                "intermediate_size": 448, "num_hidden_layers": 32, "num_attention_heads": 4,
                "num_key_value_heads": 4, "vocab_size": 1024, "max_position_embeddings": 256,
                "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "float32"}


def full_state(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _rows(n: int, ws: int, r: int) -> tuple[int, int]:
    size = -(-n // ws) if n else 0
    start = min(r * size, n)
    return start, min(start + size, n)


def _fake(rank: int, ws: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ws)
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (ws,), mesh_dim_names=("fsdp",))


def _dtensors(state: dict, mesh, ws: int, rank: int) -> dict:
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for k, t in state.items():
        a, b = _rows(t.shape[0], ws, rank)
        out[k] = DTensor.from_local(t[a:b].clone(), mesh, [Shard(0)], run_check=False,
                                    shape=t.shape, stride=t.stride())
    return out


def make_verl(out: Path, ws: int, *, optim: bool = False, split: int = 1, tile: int = 0, seed: int = 0,
              shapes: dict | None = None) -> dict:
    """verl's rank files at world size ``ws`` (and ``huggingface/config.json``, for export);
    returns the full state (for checks). ``shapes``: names and shapes (default: Llama-shaped)."""
    import torch.distributed as dist

    out.mkdir(parents=True, exist_ok=True)
    state = full_state(shapes or llama_shapes(split=split, tile=tile), seed)
    moments = {k: (v * 0.1, v.abs() * 0.01) for k, v in state.items()} if optim else {}
    for r in range(ws):
        mesh = _fake(r, ws)
        torch.save(_dtensors(state, mesh, ws, r), out / f"model_world_size_{ws}_rank_{r}.pt")
        if optim:
            a = _dtensors({k: m[0] for k, m in moments.items()}, mesh, ws, r)
            b = _dtensors({k: m[1] for k, m in moments.items()}, mesh, ws, r)
            st = {i: {"step": torch.tensor(3.0), "exp_avg": a[k], "exp_avg_sq": b[k]} for i, k in enumerate(state)}
            groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
                       "params": list(range(len(state)))}]
            torch.save({"state": st, "param_groups": groups}, out / f"optim_world_size_{ws}_rank_{r}.pt")
            torch.save({"lr_scheduler": {"last_epoch": 3}, "rng": {"cpu": torch.get_rng_state()}},
                       out / f"extra_state_world_size_{ws}_rank_{r}.pt")
    dist.destroy_process_group()
    (out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": ws}) + "\n")
    if shapes is None:
        (out / "huggingface").mkdir(exist_ok=True)
        (out / "huggingface" / "config.json").write_text(json.dumps(LLAMA_CONFIG) + "\n")
    return state


def make_dcp(out: Path, ws: int, *, optim: bool = False, split: int = 1, tile: int = 0, seed: int = 0,
             shapes: dict | None = None) -> dict:
    """A DCP at world size ``ws`` by ``dcp.save``'s own steps, rank by rank."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    out.mkdir(parents=True, exist_ok=True)
    state = full_state(shapes or llama_shapes(split=split, tile=tile), seed)
    locals_, planners, writers = [], [], []
    for r in range(ws):
        mesh = _fake(r, ws)
        sd: dict = {"model": _dtensors(state, mesh, ws, r)}
        if optim:
            sd["optimizer"] = {"state": {k: {"step": torch.tensor(3.0),
                                             "exp_avg": v, "exp_avg_sq": w}
                                         for (k, v), w in zip(_dtensors({k: t * 0.1 for k, t in state.items()}, mesh, ws, r).items(),
                                                              _dtensors({k: t.abs() * 0.01 for k, t in state.items()}, mesh, ws, r).values())},
                               "param_groups": [{"lr": 1e-3, "params": list(state)}]}
        planner = DefaultSavePlanner()
        planner.set_up_planner(sd, is_coordinator=(r == 0))
        writer = FileSystemWriter(str(out), single_file_per_rank=True, thread_count=1)
        writer.set_up_storage_writer(r == 0)
        lp = writer.prepare_local_plan(planner.create_local_plan())
        locals_.append(lp)
        planners.append(planner)
        writers.append((writer, sd))
    global_plans, metadata = planners[0].create_global_plan(locals_)
    global_plans = writers[0][0].prepare_global_plan(global_plans)
    results = []
    for r in range(ws):
        _fake(r, ws)
        planner, (writer, sd) = planners[r], writers[r]
        plan = planner.finish_plan(global_plans[r])
        fut = writer.write_data(plan, planner)
        fut.wait()
        results.append(fut.value())
    writers[0][0].finish(metadata, results)
    dist.destroy_process_group()
    return state


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["verl", "dcp"])
    ap.add_argument("out", type=Path)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--optim", action="store_true")
    ap.add_argument("--split", type=int, default=1)
    ap.add_argument("--tile", type=int, default=0)
    a = ap.parse_args()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    (make_verl if a.kind == "verl" else make_dcp)(a.out, a.ranks, optim=a.optim, split=a.split, tile=a.tile)


if __name__ == "__main__":
    main()
