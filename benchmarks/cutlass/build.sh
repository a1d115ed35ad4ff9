#!/usr/bin/env bash
# Build libfmoe_fp8_sm90.so from fp8_grouped_sm90.cu for benchmarks/bench_cutlass_fp8.py.
#   benchmarks/cutlass/build.sh OUT.so [CUTLASS_INCLUDE]
# nvcc 13 on PATH: a CUDA toolkit, or the wheels `pip install --target T --no-deps nvidia-cuda-nvcc==V
# nvidia-nvvm==V nvidia-cuda-crt==V nvidia-cuda-runtime nvidia-cuda-cccl` of one release V (13.0.88 built
# issue26_cutlass_grouped_h100.json, for a driver of CUDA 13.0) and PATH=T/nvidia/cu13/bin:$PATH.
# CUTLASS's headers default to those of the installed nvidia-cutlass package (4.2.0.0 was used). No GPU
# is needed to build: sm_90a code only (wgmma needs the "a"); about 1.5 minutes on two cores.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: build.sh OUT.so [CUTLASS_INCLUDE]}"
inc="${2:-$(python3 -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))')}"
root="$(dirname "$(command -v nvcc)")/.."
nvcc -std=c++17 -O3 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
  -Xcompiler -fPIC -shared -cudart static -L"$root/lib" -L"$root/lib64" -I"$inc" -o "$out" "$here/fp8_grouped_sm90.cu"
