#!/usr/bin/env bash
# The checks that need a GPU machine, as one prepared run (nothing is downloaded):
#   1. bench/shard_cuda_check.sh: `ckpt shard --device cuda` over NCCL, with --check against
#      transformers' own from_pretrained;
#   2. a 7B-shaped export (a 12.5 GiB bf16 Llama, 4-rank DCP) to HF safetensors against
#      `cp -r`, accelerate `merge_fsdp_weights` and torch `dcp_to_torch_save`
#      (`bench.py export --gb 12.5 --repeat 1`; each output removed before the next tool runs,
#      so the disk holds the source and one output: ~25 GiB).
# Results are printed and kept in $OUT (default bench/out/gpu).
#
# The machine needs torch (CUDA), transformers, accelerate, safetensors, huggingface_hub, click,
# tqdm and numpy; ckpt's two small native dependencies (xxhash, zlib-ng), where missing, are
# installed from wheels carried in bench/out/wheels, fetched beforehand on a machine with the
# package registries:
#   pip download --only-binary :all: --platform manylinux2014_x86_64 --python-version 3.X \
#       -d bench/out/wheels xxhash zlib-ng          # once for each Python version it may run
# With the project's device tool: run(command="bash bench/gpu_check.sh", carry=["bench/out/wheels"]).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${OUT:-bench/out/gpu}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

# ckpt_tools laid out as an installed copy is (cli/ is its ckpt_tools.cli), without pip
PKG=$(mktemp -d)
cp -r ckpt_tools "$PKG/"
cp -r cli "$PKG/ckpt_tools/cli"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import xxhash, zlib_ng, numpy" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --find-links bench/out/wheels --target "$PKG" xxhash zlib-ng
fi
"$PY" -c "import torch, ckpt_tools; print('torch', torch.__version__, '| ckpt-tools', ckpt_tools.__version__, '|',
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')" | tee "$RESULTS/versions.txt"
nproc; free -g; df -h /tmp

PYTHON="$PY" bash bench/shard_cuda_check.sh 2>&1 | tee "$RESULTS/shard_cuda.txt"
"$PY" bench/bench.py export --gb "${GB:-12.5}" --repeat "${REPEAT:-1}" 2>&1 | tee "$RESULTS/export_7b.txt"
