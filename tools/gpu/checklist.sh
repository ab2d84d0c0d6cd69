#!/usr/bin/env bash
# The GPU checklist in one call on a device machine (the device tool's `run`, from the
# repository's root, with wheels for what its image lacks in .whl/: see docs/benchmarks/README.md):
# the CUDA tests, then the 1B decode profile and the benches. Each step has its own time limit and
# the next runs whatever the last did; everything is written under $OUT.
#   bash tools/gpu/checklist.sh [steps...]
#   default: tests graphs graphs-window speculation latency quantized profile concurrency; also: quantized-tests
#   (the quantized-weight tests of tests/test_gpu.py alone: `tests` runs them with the rest)
set -o pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 GPU_REPORT="$OUT/gpu-report.json"
if [ -d .whl ] && [ -z "$NO_WHEELS" ]; then  # NO_WHEELS=1: a dry run here
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH="/tmp/site:$PWD/src"
STEPS=${*:-tests graphs graphs-window speculation latency quantized profile concurrency}

step() {  # name, limit in seconds, command...
  local name=$1 limit=$2 started=$SECONDS
  shift 2
  echo "=== $name (limit ${limit}s)" | tee -a "$OUT/log"
  timeout "$limit" "$@" >>"$OUT/log" 2>&1
  echo "=== $name: rc $? in $((SECONDS - started))s" | tee -a "$OUT/log"
}
BENCH="python3 -m inferencemesh bench"

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__,
  torch.cuda.get_device_name())'
  echo "commit ${COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"; } 2>&1 | tee -a "$OUT/log"

for s in $STEPS; do
  case $s in
    tests) step tests 200 python3 -m pytest -m gpu tests/test_gpu.py tests/test_decode_graphs.py -q -rA --timeout 90 \
      -p no:cacheprovider ;;
    # The decode step eager against CUDA graphs, in one process, batch 1, 8 and 32 (modeling/decode_graphs.py)
    graphs) step graphs 100 python3 tools/gpu/decode_graphs_bench.py --shape llama-1b \
      --json "$OUT/decode-graphs-llama-1b.json" ;;
    # The same for a verify window's shape: 5 positions a row, every row's logits
    graphs-window) step graphs-window 90 python3 tools/gpu/decode_graphs_bench.py --shape llama-1b --window 5 \
      --batches 1 8 --json "$OUT/decode-graphs-window-llama-1b.json" ;;
    quantized-tests) step quantized-tests 90 python3 -m pytest -m gpu tests/test_gpu.py -q -rA --timeout 60 \
      -p no:cacheprovider -k quantized ;;
    latency) step latency 130 $BENCH --shape llama-1b --stages 1,2 --new-tokens 64 --repeats 1 --prompts code \
      --json "$OUT/bench-llama-1b.json" ;;
    profile) step profile 150 python3 tools/gpu_decode_profile.py --shape llama-1b --dtype bfloat16 \
      --json "$OUT/profile-llama-1b.json" ;;
    speculation) step speculation 110 $BENCH --stages 1,2 --speculative none,draft --new-tokens 64 --repeats 1 \
      --json "$OUT/bench-speculation-bundled.json" ;;
    concurrency) step concurrency 90 $BENCH --shape llama-1b --stages 1,2 --concurrency 1,8 --new-tokens 64 \
      --repeats 1 --json "$OUT/bench-concurrency-llama-1b.json" ;;
    # INT8, INT4 and FP8 quantized at load against bf16 on the GPU's kernels: decode batch 1 and 8
    # (as CUDA graphs where captured), prefill, load, bytes (tools/quantized_bench.py)
    quantized) step quantized 120 python3 tools/quantized_bench.py --device cuda --shape llama-1b --rounds 2 \
      --json "$OUT/quantized-cuda.json" ;;
    *) echo "=== $s: no such step" | tee -a "$OUT/log" ;;
  esac
done
echo "=== summary"
grep -E "passed|failed|error|GPU-REPORT|^FAILED|^ERROR" "$OUT/log" | tail -60
grep -E '^\{"(config|batch)"' "$OUT/log"
grep -E "tok/s|acceptance|ratio" "$OUT/log" | grep -v "^\[" | tail -40
grep -E "^(format|bf16|int8|int4|fp8) |^(PASS|FAIL) " "$OUT/log" | tail -20
