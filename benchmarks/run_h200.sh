#!/usr/bin/env bash
# One device call's worth of GPU work for issues 19-21, in order of importance, each part bounded:
# the Qwen3 benchmark before (before_tree/: a copy of an older commit) and after, the GPU test tier,
# the end-to-end table at 8 x 2 x 4096, the memory plan against a measured peak, the FP8 kernels.
#   OUT=/tmp/out benchmarks/run_h200.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200}; mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
QWEN="--layers 4 --microbatches 8 --micro-batch 1 --steps 3 --warmup 3"
if [ -d before_tree ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/before ./before_tree >/dev/null 2>&1
  (cd before_tree && PYTHONPATH=/tmp/before timeout 120 python3 -m benchmarks.train_throughput $QWEN \
    --sides fmoe --out "$OUT/qwen3_before.json" 2>&1 | grep -E "ms/step|Error")
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 120 python3 -m benchmarks.train_throughput $QWEN --sides fmoe,fmoe_graphs \
  --out "$OUT/qwen3_after.json" 2>&1 | grep -E "ms/step|Error"
timeout 240 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -4 | tee "$OUT/cuda_tier.txt"
timeout 60 python3 -m benchmarks.plan_vs_measured --out "$OUT/plan_h200.json" 2>&1 | grep -E "planned|Error"
timeout 150 python3 -m benchmarks.train_throughput --layers 4 --microbatches 8 --micro-batch 2 --steps 3 \
  --warmup 3 --sides eager,fmoe,fmoe_graphs,fmoe_fp8_graphs --out "$OUT/tp_L4_mb2.json" 2>&1 | grep -E "ms/step|Error"
timeout 120 python3 benchmarks/bench_fp8.py --parts dense_8192,qwen3_layer,bandwidth --out "$OUT/fp8.json" 2>&1 | tail -3
