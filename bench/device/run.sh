#!/usr/bin/env bash
# One GPU machine run (after bench/device/prepare.sh here; `run` with carry [".gpu"]):
# `pytest -m gpu`, the torch engine's batch against transformers', and the node arena's bench,
# each logged under $OUT (the device tool brings $OUT back). Each step has its own time limit,
# so that one that hangs leaves the others their time; gpu_arena logs each step to stderr.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/device.txt" 2>&1
step() { # name, seconds, command...
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - t0)) s"
  tail -3 "$OUT/$name.log"
}
step pytest_gpu 200 python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/integration/test_arena_sharing.py \
  tests/integration/test_fill_progress.py tests/unit/test_row_sampling.py tests/unit/test_torch_batch_tiny.py \
  tests/unit/test_arena_sharing.py tests/unit/test_arena.py
step torch_batching 130 python3 -m bench.torch_batching --skeleton .gpu/skeleton --crowds 1,32,64 --out "$OUT"
step gpu_arena "${GPU_ARENA_S:-200}" python3 -m bench.gpu_arena --skeleton .gpu/skeleton --shapes smol \
  --out "$OUT/gpu_arena.json"
