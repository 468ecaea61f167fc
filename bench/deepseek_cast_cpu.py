"""The peer for ``bench/fp8_bench.py``: DeepSeek-V3's ``inference/fp8_cast_bf16.py`` run on CPU.

    python bench/deepseek_cast_cpu.py SRC DST

Its logic as that script has it (read, not copied): every shard loaded whole with
``safetensors.torch.load_file``; each one-byte weight multiplied by its ``_scale_inv`` block by
block in float32 and stored as bf16 (``weight_dequant``: ``y = x.float() * s``, there a Triton
kernel on the GPU, here the same product in torch on the CPU); the shard written whole with
``save_file``; scales looked up in other shards through a cache of the two most recent files;
the index rewritten without the scale names. Like the original it leaves config.json (and its
``quantization_config``) alone and copies nothing else.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def weight_dequant(x: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """``x.float() * s`` per ``block`` x ``block`` tile (edge tiles partial), as bf16."""
    m, n = x.shape
    scale = s.repeat_interleave(block, dim=0)[:m].repeat_interleave(block, dim=1)[:, :n]
    return (x.to(torch.float32) * scale).to(torch.bfloat16)


def main(src: str, dst: str) -> None:
    torch.set_default_dtype(torch.bfloat16)
    os.makedirs(dst, exist_ok=True)
    index = json.loads((Path(src) / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    loaded: dict[str, dict[str, torch.Tensor]] = {}
    scale_names = []

    def tensor(name: str) -> torch.Tensor:
        file = weight_map[name]
        if file not in loaded:
            loaded[file] = load_file(os.path.join(src, file))
        return loaded[file][name]

    for file in sorted(set(weight_map.values())):
        shard = load_file(os.path.join(src, file))
        loaded[file] = shard
        out = {}
        for name, w in shard.items():
            if name.endswith("_scale_inv"):
                continue
            if w.element_size() == 1:
                scale_names.append(name + "_scale_inv")
                out[name] = weight_dequant(w, tensor(name + "_scale_inv"))
            else:
                out[name] = w
        save_file(out, os.path.join(dst, file))
        while len(loaded) > 2:
            del loaded[next(iter(loaded))]
    for name in scale_names:
        weight_map.pop(name, None)
    (Path(dst) / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                       indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:3])
