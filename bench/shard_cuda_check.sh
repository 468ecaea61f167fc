#!/usr/bin/env bash
# GPU check of `ckpt shard --device cuda` (NCCL, fully_shard on CUDA, rows read straight into
# device shards). Builds a synthetic ~1.1B-parameter Llama (TinyLlama's shape, random bf16
# weights; nothing is downloaded), shards it at 1 rank per visible GPU (capped at 1 by default),
# and prints wall time, peak host RSS and peak device memory per rank, and the --check
# difference against transformers' own from_pretrained.
#
#   bash bench/shard_cuda_check.sh [WORKDIR]        # default: bench/out/cuda (git-ignored)
#   RANKS=2 bash bench/shard_cuda_check.sh          # on a host with 2+ GPUs
#
# Needs: torch with CUDA, transformers>=5, safetensors, ckpt-tools importable (pip install -e .).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
WORK=${1:-bench/out/cuda}
RANKS=${RANKS:-1}
mkdir -p "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false

"$PY" - "$WORK" "$RANKS" <<'PYEOF'
import json, sys, time
from pathlib import Path

import torch

work, ranks = Path(sys.argv[1]), int(sys.argv[2])
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible; this check needs a GPU")
print(f"torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}", flush=True)

src = work / "llama-1b"
if not (src / "model.safetensors.index.json").is_file():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    t = time.time()
    torch.manual_seed(0)
    with torch.device("cuda"):  # random init on the GPU: seconds instead of minutes
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(src, max_shard_size="1GB")
    n = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    print(f"built {n / 1e9:.2f}B params in {time.time() - t:.1f}s -> {src}", flush=True)

from ckpt_tools import shard

runs = [
    dict(format="sharded", with_optimizer="adamw", check=True),
    dict(format="dcp", mixed_precision="bf16", check=True),
    dict(format="sharded", cpu_offload=True, check=True),
]
for opts in runs:
    dst = work / ("out-" + "-".join(f"{k}={v}" for k, v in opts.items() if k != "check"))
    t = time.time()
    report = shard(str(src), dst, ranks=ranks, device="cuda", overwrite=True, progress=False, **opts)
    print(json.dumps({
        "options": opts, "ranks": ranks, "seconds": round(time.time() - t, 1),
        "model_GiB": round(report["bytes"] / 2**30, 2),
        "peak_rss_GiB": [round(b / 2**30, 2) for b in report["peak_rss_bytes"]],
        "peak_device_GiB": [round(b / 2**30, 2) for b in report["peak_device_bytes"]],
        "max_abs_diff": report.get("max_abs_diff"),
    }), flush=True)
PYEOF
