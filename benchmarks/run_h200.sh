#!/usr/bin/env bash
# One device call's GPU work, by part (each bounded to fit one call of 10 minutes):
#   OUT=/tmp/out benchmarks/run_h200.sh tier     # before/after Qwen3 step (before_tree/: an older
#                                                # commit, `git archive <commit> | tar -x -C before_tree`),
#                                                # the GPU test tier (memory policies included)
#   OUT=/tmp/out benchmarks/run_h200.sh policies [SIDES]  # per-layer table, 4 and 8 layers: eager, fmoe
#                                                # (with graphs), and each memory policy, side by side
#   OUT=/tmp/out benchmarks/run_h200.sh deepseek [SIDES] # DeepSeek-V3-16B layers, bf16 and FP8, 4 and 8 layers
#   OUT=/tmp/out benchmarks/run_h200.sh stall    # a checkpoint's training stall, sync vs async (3.1B state)
#   OUT=/tmp/out benchmarks/run_h200.sh fp8      # FP8 kernels: GPU tests, merged W (gathered vs copied),
#                                                # bandwidth, every tile config at a micro-batch's expert rows
#   OUT=/tmp/out benchmarks/run_h200.sh fp8tiles # Qwen3 layers, 4 and 8: BF16, FP8 on the default tiles and
#                                                # FP8 on the previous ones (--fp8-tiles 2x4,2x4_pf)
#   OUT=/tmp/out benchmarks/run_h200.sh fp8step [BEFORE] # Qwen3 FP8 steps (4 and 8 layers) before and after
#                                                # a change, BF16 beside them, and the FP8 GPU tests
#   OUT=/tmp/out benchmarks/run_h200.sh layers   # the GPU tier, then each kernel's ms per layer (BF16 and FP8
#                                                # Qwen3 steps at two layer counts) and the FP8 bound
#   OUT=/tmp/out benchmarks/run_h200.sh variants [SIDES] # Qwen3 steps at two layer counts: BF16, FP8, and FP8
#                                                # with its dense / expert / all weight gradients in BF16
#   OUT=/tmp/out benchmarks/run_h200.sh swiglu_t # the cached FP8 experts' SwiGLU with its transpose in one
#                                                # pass or two, then Qwen3 window-1 steps, BF16 and FP8
#   OUT=/tmp/out benchmarks/run_h200.sh e2e      # issue 26's end-to-end rows: the 4-layer Qwen3 step at
#                                                # 8 x 1 and 8 x 2 x 4096, BF16 and FP8 side by side
#   OUT=/tmp/out benchmarks/run_h200.sh deepgemm DIR [FAMILY]  # DeepGEMM beside fmoe's FP8 GEMMs: build
#                                                # the DeepGEMM checkout DIR (submodules in, no network
#                                                # there), compile its JIT kernels in parallel, time them
# Issue 26's per-layer rows: `policies fmoe_graphs,fmoe_fp8_graphs,fmoe_fp8_bf16allw_graphs` and `deepseek`.
# The whole GPU tier: `TRITON_INTERPRET=0 python3 -m pytest -m cuda tests/`.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200}; mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
QWEN="--microbatches 8 --micro-batch 1 --steps 3 --warmup 3"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
case "${1:-tier}" in
tier)
  if [ -d before_tree ]; then
    python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/before ./before_tree >/dev/null 2>&1
    # from a folder of its own, so that neither this checkout's fmoe nor its editable install is seen
    (cd /tmp && PYTHONPATH=/tmp/before:$OLDPWD/before_tree timeout 100 python3 -m benchmarks.train_throughput \
      --layers 4 $QWEN --sides fmoe,fmoe_graphs --out "$OUT/qwen3_before.json" 2>&1 | grep -E "ms/step|Error")
  fi
  timeout 100 python3 -m benchmarks.train_throughput --layers 4 $QWEN --sides fmoe,fmoe_graphs \
    --out "$OUT/qwen3_after.json" 2>&1 | grep -E "ms/step|Error"
  timeout 300 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_cuda.py tests/test_memory_policy_cuda.py \
    2>&1 | tail -15 | tee "$OUT/cuda_tier.txt"
  ;;
policies)  # the memory policies side by side with eager and fmoe, at 4 (with a profile: the GPU's idle
  # share) and 8 layers in one call, so per layer = (8-layer step - 4-layer step) / 4 on one host
  SIDES=eager,fmoe,fmoe_graphs,fmoe_graphs_recompute_full,fmoe_graphs_recompute_selective,fmoe_graphs_window1,fmoe_offload
  timeout 250 python3 -m benchmarks.train_throughput --layers 4 $QWEN --sides ${2:-$SIDES} --profile \
    --out "$OUT/policies_L4.json" 2>&1 | grep -E "ms/step|Error|error"
  timeout 300 python3 -m benchmarks.train_throughput --layers 8 $QWEN --sides ${2:-$SIDES} \
    --out "$OUT/policies_L8.json" 2>&1 | grep -E "ms/step|Error|error"
  ;;
deepseek)  # issue 26's DeepSeek-V3-16B rows: bf16 and FP8 with graphs, 4 and 8 layers in one call
  for L in 4 8; do
    timeout 250 python3 -m benchmarks.train_throughput --recipe recipes/deepseek_v3_16b_a3b.toml --layers $L \
      $QWEN --sides ${2:-fmoe_graphs,fmoe_fp8_graphs} --out "$OUT/deepseek_v3_16b_L$L.json" 2>&1 | grep -E "ms/step|Error"
  done
  ;;
fp8)
  timeout 150 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_cuda.py -k "fp8 or quant or merged" \
    2>&1 | tail -6 | tee "$OUT/cuda_tier_fp8.txt"
  timeout 200 python3 benchmarks/bench_fp8.py --parts merge,bandwidth --out "$OUT/fp8_merge_bandwidth.json" \
    2>&1 | grep -A40 "==== summary"
  timeout 200 python3 benchmarks/bench_fp8.py --parts qwen3_layer --routed-tokens 32768 \
    --layer-configs sw128x128w8s4,sw128x128w8s3,sw128x128w8s5,sw128x128w8s4flat,sw64x128w4s4x2 \
    --out "$OUT/fp8_layer_32768.json" 2>&1 | grep -A40 "==== summary"
  ;;
fp8tiles)  # the FP8 GEMMs' default tiles against the previous ones in a step, BF16 beside them
  for L in 4 8; do
    timeout 200 python3 -m benchmarks.train_throughput --layers $L $QWEN --sides fmoe_graphs,fmoe_fp8_graphs \
      --out "$OUT/fp8tiles_L$L.json" 2>&1 | grep -E "ms/step|Error"
    timeout 110 python3 -m benchmarks.train_throughput --layers $L $QWEN --sides fmoe_fp8_graphs \
      --fp8-tiles 2x4,2x4_pf --out "$OUT/fp8tiles_previous_L$L.json" 2>&1 | grep -E "ms/step|Error"
  done
  ;;
deepgemm)  # bench_deepgemm_fp8's docstring says how DIR is made; about 60 s to build, 25 s to compile
  DG=$(cd "${2:?deepgemm DIR}" && pwd); export DG_JIT_CACHE_DIR=/tmp/dgcache PYTHONPATH="$PWD:$DG"
  for h in cute cutlass; do  # the JIT reads CUTLASS's headers under deep_gemm/include (setup.py's build_py)
    [ -d "$DG/deep_gemm/include/$h" ] || cp -r "$DG/third-party/cutlass/include/$h" "$DG/deep_gemm/include/"
  done
  (cd "$DG" && DG_USE_LOCAL_VERSION=0 timeout 150 python3 setup.py build_ext --inplace > "$OUT/dg_build.log" 2>&1) || exit 1
  # DeepGEMM's JIT crashes in std::regex under the older libstdc++ torch's environment loads first
  export LD_PRELOAD=/lib/x86_64-linux-gnu/libstdc++.so.6
  for key in $(python3 -m benchmarks.bench_deepgemm_fp8 --list-keys); do
    timeout 100 python3 -m benchmarks.bench_deepgemm_fp8 --compile-only "$key" > /dev/null 2>&1 &
  done; wait
  source=$(basename "$DG")  # its own commit only where DIR is a clone (else git would name an outer repo's)
  [ -e "$DG/.git" ] && source=$(git -C "$DG" rev-parse --short HEAD)
  timeout 300 python3 -m benchmarks.bench_deepgemm_fp8 ${3:+--family $3} --source "DeepGEMM $source" \
    --out "$OUT/deepgemm.json" 2>&1 | tail -20
  ;;
fp8step)  # an FP8 change against the tree BEFORE (default before_tree/, made with `git archive`), Qwen3 at 4
  # and 8 layers in one call (per layer = (8-layer step - 4-layer step) / 4): BF16, FP8 and FP8 with BF16
  # expert weight gradients after it, BF16 and FP8 before it, each process's peak memory; the FP8 GPU tests first.
  # LAYERS="2 4" on an H100 (8 FP8 layers need more than its 80 GB)
  BEFORE=$(cd "${2:-before_tree}" && pwd)
  timeout 110 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_cuda.py tests/test_fp8_cache_cuda.py \
    -k "fp8 or quant or gathered or merged or swiglu or cache or permute" 2>&1 | tail -6 | tee "$OUT/cuda_fp8.txt"
  rm -rf /tmp/before  # no earlier install left under it
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/before "$BEFORE" > "$OUT/before_install.log" 2>&1
  for L in ${LAYERS:-4 8}; do  # 110 + 2 x (140 + 100) s: within a call's 600
    timeout 140 python3 -m benchmarks.train_throughput --layers $L $QWEN \
      --sides fmoe_graphs,fmoe_fp8_graphs,fmoe_fp8_bf16ew_graphs --out "$OUT/after_L$L.json" 2>&1 | grep -E "ms/step|Error"
    # from a folder of its own, so that neither this checkout's fmoe nor its editable install is seen
    (cd /tmp && PYTHONPATH=/tmp/before:$BEFORE timeout 100 python3 -m benchmarks.train_throughput --layers $L \
      $QWEN --sides fmoe_graphs,fmoe_fp8_graphs --out "$OUT/before_L$L.json" 2>&1 | grep -E "ms/step|Error")
  done
  ;;
layers)  # the whole GPU tier, then where a layer's time goes: Qwen3 BF16 and FP8 steps at two layer counts,
  # every kernel profiled, and benchmarks.per_layer_kernels' difference (the FP8 bound included). LAYERS
  # defaults to "4 8" on a GPU of more than 100 GB, else "2 4" (8 FP8 layers need more than an H100's 80 GB)
  MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  [ "$MEM" -gt 100000 ] && DEFAULT="4 8" || DEFAULT="2 4"
  # TESTS: the GPU tests to run first (default: the whole tier)
  timeout 230 python3 -m pytest -m cuda -q -p no:cacheprovider ${TESTS:-tests/} 2>&1 | tail -12 | tee "$OUT/cuda_tier.txt"
  RUNS=()
  for L in ${LAYERS:-$DEFAULT}; do  # 230 + 2 x 150 s: within a call's 600
    rm -f "$OUT/layers_L$L.json"  # no earlier run's file stands in for one that did not finish
    timeout 150 python3 -m benchmarks.train_throughput --layers $L $QWEN --sides fmoe_graphs,fmoe_fp8_graphs \
      --profile --top-kernels 300 --out "$OUT/layers_L$L.json" 2>&1 | grep -E "ms/step|Error"
    RUNS+=("$OUT/layers_L$L.json")
  done
  python3 -m benchmarks.per_layer_kernels "${RUNS[@]}" --out "$OUT/per_layer.json"
  ;;
variants)  # which FP8 weight gradients pay on the current code: BF16, FP8, and FP8 with the dense / expert /
  # all weight gradients in BF16 (fp8_dense_wgrad, fp8_expert_wgrad), side by side at two layer counts (LAYERS
  # as in `layers`); MB=2 for 8 x 2 x 4096 tokens a step
  MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  [ "$MEM" -gt 100000 ] && DEFAULT="4 8" || DEFAULT="2 4"
  SIDES=fmoe_graphs,fmoe_fp8_graphs,fmoe_fp8_bf16w_graphs,fmoe_fp8_bf16ew_graphs,fmoe_fp8_bf16allw_graphs
  for L in ${LAYERS:-$DEFAULT}; do
    rm -f "$OUT/variants_L$L.json"
    timeout 290 python3 -m benchmarks.train_throughput --layers $L --microbatches 8 --micro-batch ${MB:-1} \
      --steps 3 --warmup 3 --sides ${2:-$SIDES} --out "$OUT/variants_L$L.json" 2>&1 | grep -E "ms/step|Error"
  done
  ;;
swiglu_t)  # the cached FP8 experts' SwiGLU with its transpose, one pass or two (bench_fp8's swiglu_t),
  # then Qwen3 steps at merge window 1 (what the auto memory policy runs on one node), BF16 and FP8, at
  # two layer counts (LAYERS as in `layers`)
  MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  [ "$MEM" -gt 100000 ] && DEFAULT="4 8" || DEFAULT="2 4"
  timeout 120 python3 benchmarks/bench_fp8.py --parts swiglu_t --out "$OUT/swiglu_t.json" 2>&1 | grep -E "swiglu_t|Error"
  for L in ${LAYERS:-$DEFAULT}; do
    rm -f "$OUT/window1_L$L.json"
    timeout 150 python3 -m benchmarks.train_throughput --layers $L $QWEN --sides fmoe_graphs_window1,fmoe_fp8_graphs_window1 \
      --out "$OUT/window1_L$L.json" 2>&1 | grep -E "ms/step|Error"
  done
  ;;
e2e)  # 8 x 2 x 4096 fits an H100 now (FP8 peak 70.6 GB, BF16 73.9: issue26_session_2026-12-07_h100.json)
  for MB in 1 2; do
    rm -f "$OUT/e2e_8x$MB.json"
    timeout 200 python3 -m benchmarks.train_throughput --layers 4 --microbatches 8 --micro-batch $MB --steps 5 \
      --warmup 3 --sides fmoe_graphs,fmoe_fp8_graphs --out "$OUT/e2e_8x$MB.json" 2>&1 | grep -E "ms/step|Error"
  done
  ;;
stall)  # then the tier's tests and the before/after step, as far as the call's time allows
  timeout 400 python3 -m benchmarks.bench_checkpoint_stall --out "$OUT/checkpoint_stall_h200.json" 2>&1 | tail -25
  timeout 100 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -4 \
    | tee "$OUT/cuda_tier.txt"
  ;;
esac
