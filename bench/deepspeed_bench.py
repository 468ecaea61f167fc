"""``ckpt export`` of a ZeRO-3 save against DeepSpeed's own ``zero_to_fp32`` (time, peak memory).

    python bench/deepspeed_bench.py [--out DIR] [--layers 2] [--repeat 3]

A real DeepSpeed 0.19.8 job (2 CPU ranks, gloo, AdamW as the client optimizer, ZeRO stage 3)
trains one step of a Llama at hidden 1024 (vocab 32000, 2 layers by default: 90M parameters,
about 1 GiB of fp32 master weights and Adam moments in the optimizer files) and saves it with
``save_checkpoint``. Then, in rounds (medians reported; peak RSS sampled from /proc):

- ``zero_to_fp32``: the script DeepSpeed writes beside the save, ``--safe_serialization``;
- ``ckpt export``: the same fp32 weights as a Hugging Face directory (``--base`` a config).

Both outputs are checked equal tensor by tensor. Page cache is warm for every tool.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent / "fixtures")]

import bench  # noqa: E402  (timed_rounds, table, py)


def _config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2752, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
                       architectures=["LlamaForCausalLM"], dtype="float32")


def _save(rank: int, world_size: int, out: str, layers: int) -> None:
    import torch.distributed as dist

    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    import deepspeed
    import torch
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    from transformers import LlamaForCausalLM

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(layers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {"train_batch_size": 2 * world_size, "train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    ids = torch.randint(0, 32000, (2, 16), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(out, tag="global_step1")
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from dist import run_ranks

    work = args.out or Path(tempfile.mkdtemp(prefix="ckpt-ds-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    run = work / "run"
    if not (run / "latest").is_file():
        run_ranks(functools.partial(_save, layers=args.layers), 2, work, str(run), timeout=1800)
    base = work / "base"
    _config(args.layers).save_pretrained(base)
    size = bench.du(run / "global_step1")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}
    os.environ.update(env)
    bench.REPEAT = args.repeat
    z2f, hf = work / "zero_to_fp32", work / "hf"
    rows = bench.timed_rounds([
        ("zero_to_fp32", [sys.executable, str(run / "zero_to_fp32.py"), str(run), str(z2f), "--safe_serialization"],
         z2f),
        ("ckpt export", [sys.executable, "-m", "ckpt_tools", "export", str(run), str(hf), "--base", str(base),
                         "--quiet"], hf),
    ])
    from safetensors.torch import load_file
    import torch

    a = {}
    for f in sorted(z2f.glob("*.safetensors")):
        a.update(load_file(f))
    b = {}
    for f in sorted(hf.glob("*.safetensors")):
        b.update(load_file(f))
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"ZeRO-3 save: {size / 2**30:.2f} GiB in global_step1/; outputs equal: {same}")
    print(bench.table(rows, rows[0]["seconds"]).replace("× cp", "× zero_to_fp32"))
    print(json.dumps({"save_bytes": size, "equal": same, "rows": rows}))


if __name__ == "__main__":
    main()
