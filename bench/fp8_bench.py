"""Block FP8 → bf16 (``ckpt convert --to hf --dtype bf16``) beside ``cp -r`` of the same source.

    python bench/fp8_bench.py [--gb 1.0] [--repeat 3] [--out DIR]

Makes a DeepSeek/Qwen-style block-FP8 checkpoint of Llama-7B layer shapes (vocab 8000) (float8_e4m3fn codes,
float32 ``weight_scale_inv`` per 128x128 block, bf16 embeddings and norms) of about ``--gb``
GB, then times, ``--repeat`` rounds, ``cp -r`` of it (alone, and followed by ``sync``: ckpt's output is
on the disk when it exits) and ckpt's dequantization, and reports medians, the medians of each
round's ratios, the load average and peak RSS, and the same for DeepSeek-V3's ``fp8_cast_bf16.py``
logic run on CPU (``bench/deepseek_cast_cpu.py``), the tool people use for this today. The output holds twice the source's bytes (bf16 is
two bytes an element), so the ratio is against a copy of half what ckpt writes.
Page cache is not dropped between runs (no root assumed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_source(root: Path, gb: float) -> Path:
    h, i, v = 4096, 11008, 8000  # vocab cut: the FP8 weights dominate, as in a large model
    src = root / "fp8"
    src.mkdir()
    layer = [("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (h, h)), ("self_attn.v_proj", (h, h)),
             ("self_attn.o_proj", (h, h)), ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)),
             ("mlp.down_proj", (h, i))]
    per_layer = sum(a * b for _, (a, b) in layer)
    layers = max(1, int((gb * 1e9 - 2 * v * h * 2) // per_layer))
    g = torch.Generator().manual_seed(0)
    weight_map = {}

    def codes(shape):  # e4m3 codes without the NaN ones (0x7F, 0xFF)
        u = torch.randint(0, 0x7F, shape, dtype=torch.uint8, generator=g)
        return (u | (torch.randint(0, 2, shape, dtype=torch.uint8, generator=g) << 7)).view(torch.float8_e4m3fn)

    for n in range(layers):
        shard = {}
        for name, (a, b) in layer:
            key = f"model.layers.{n}.{name}.weight"
            shard[key] = codes((a, b))
            shard[key + "_scale_inv"] = torch.rand(-(-a // 128), -(-b // 128), generator=g) * 1e-3
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shard[f"model.layers.{n}.{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
        file = f"model-{n + 1:05d}-of-{layers + 1:05d}.safetensors"
        save_file(shard, src / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in shard})
    last = {"model.embed_tokens.weight": torch.randn(v, h, generator=g).bfloat16(),
            "lm_head.weight": torch.randn(v, h, generator=g).bfloat16(), "model.norm.weight": torch.ones(h).bfloat16()}
    file = f"model-{layers + 1:05d}-of-{layers + 1:05d}.safetensors"
    save_file(last, src / file, metadata={"format": "pt"})
    weight_map.update({k: file for k in last})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": i,
        "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": v,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3",
                                "activation_scheme": "dynamic"}}))
    return src


def timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t


def timed_rss(cmd: list[str]) -> tuple[float, int, float]:
    """Wall seconds, the child's peak RSS and its CPU seconds (user + system: on a shared
    machine the steadier figure), from ``/usr/bin/time`` (whose own small process is what the
    child forks from: this process's ``ru_maxrss`` of children would count a forked copy of
    this one)."""
    t = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "maxrss_kb %M cpu %U %S", *cmd], check=True, stderr=subprocess.PIPE,
                          text=True)
    line = [x.split() for x in done.stderr.splitlines() if x.startswith("maxrss_kb")][-1]
    return time.perf_counter() - t, int(line[1]) * 1024, float(line[3]) + float(line[4])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--no-peer", action="store_true", help="skip DeepSeek's script (30 s a run)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fp8bench-", dir=args.out))
    load = [os.getloadavg()[0]]
    try:
        src = make_source(root, args.gb)
        size = sum(f.stat().st_size for f in src.iterdir())
        runs: dict[str, list[float]] = {"cp": [], "cp_sync": [], "ckpt": [], "ckpt_cpu": [], "deepseek_cpu": [],
                                        "deepseek_cpu_cpu": []}
        rss = {}
        peer_script = Path(__file__).with_name("deepseek_cast_cpu.py")
        for r in range(args.repeat):  # each round: the baselines right before the tools (a virtual disk drifts)
            runs["cp"].append(timed(["cp", "-r", str(src), str(root / f"cp{r}")]))
            shutil.rmtree(root / f"cp{r}")
            subprocess.run(["sync"], check=True)
            runs["cp_sync"].append(timed(["sh", "-c", f"cp -r '{src}' '{root / f'cps{r}'}' && sync"]))
            shutil.rmtree(root / f"cps{r}")
            subprocess.run(["sync"], check=True)
            t, rss["ckpt"], cpu = timed_rss([sys.executable, "-m", "ckpt_tools", "convert", str(src),
                                        str(root / f"bf16_{r}"), "--to", "hf", "--dtype", "bf16", "--quiet"])
            runs["ckpt"].append(t)
            runs["ckpt_cpu"].append(cpu)
            out = sum(f.stat().st_size for f in (root / f"bf16_{r}").iterdir())
            shutil.rmtree(root / f"bf16_{r}")
            subprocess.run(["sync"], check=True)
            if not args.no_peer:
                t, rss["deepseek_cpu"], cpu = timed_rss([sys.executable, str(peer_script), str(src), str(root / f"ds_{r}")])
                runs["deepseek_cpu"].append(t)
                runs["deepseek_cpu_cpu"].append(cpu)
                shutil.rmtree(root / f"ds_{r}")
            load.append(os.getloadavg()[0])
        med = {k: statistics.median(v) for k, v in runs.items() if v}
        pairs = {f"ratio_{k}_over_{b}": statistics.median(x / y for x, y in zip(runs[k], runs[b]))
                 for k in ("ckpt", "deepseek_cpu") if runs[k] for b in ("cp", "cp_sync")}
        print(json.dumps({"source_bytes": size, "output_bytes": out, **{f"{k}_s": v for k, v in med.items()},
                          **pairs, "load_average_1min": load, "peak_rss_bytes": rss, "runs": runs}, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
