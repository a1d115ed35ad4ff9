"""One launch each of the grouped FP8 GEMMs at Qwen3's expert up-projection shapes (the forward over a
micro-batch's routed rows, the merged weight gradient of a step) per tile config, and of the BF16
``torch._grouped_mm`` they replace: a fixed, small workload for Nsight Compute (issue 26).

    ncu --clock-control none -k regex:'_nt_kernel|_wgrad_kernel|cutlass' --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats \
        python3 -m benchmarks.probe_fp8_gemm_once base,pf
"""

from __future__ import annotations

import sys

import torch

from benchmarks.bench_fp8_grouped import CONFIGS, FAMILIES, _gemms, _wgrads
from fmoe.kernels import fp8_gemm as fg


def main(names: list[str]) -> None:
    bad = sorted(set(names) - set(CONFIGS))
    if bad or not torch.cuda.is_available():
        print(
            f"probe_fp8_gemm_once.py: {'unknown configs ' + str(bad) if bad else 'needs a CUDA GPU'}",
            file=sys.stderr,
        )
        sys.exit(2)
    family = FAMILIES["qwen3_30b_a3b"]
    offs, a, b, b_scale, x16, w16, _ = _gemms(*family)["up_fwd"]
    dyt, xt, dyt16, x16w, offs_w, _ = _wgrads(*family)["up_wgrad"]
    for name in names:
        fg.fp8_gemm_nt(a, b, b_scale, offs, config=CONFIGS[name])
        fg.fp8_gemm_wgrad(dyt, xt, grouped=True, config=CONFIGS[name])
    torch._grouped_mm(x16, w16, offs=offs)
    torch._grouped_mm(dyt16, x16w, offs=offs_w)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["base"])
