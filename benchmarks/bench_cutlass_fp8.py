"""fmoe's Triton FP8 expert GEMMs against CUTLASS's Hopper blockwise-scaled grouped kernels (issue 26).

Is the expert GEMMs' speed (about 650 TFLOP/s, 1.4x BF16 forward and 1.0-1.1x its weight gradient on an
H100) the Triton kernel's limit or the recipe's? This times the same products, at the experts' shapes
of one micro-batch (forward / input gradient) and of a step's 8 micro-batches merged (weight gradient),
on three sides in one process: BF16 ``torch._grouped_mm``, ``fmoe.kernels.fp8_gemm`` (Triton), and
CUTLASS 4's ptr-array FP8 kernels with DeepSeek-V3's block scales (``benchmarks/cutlass/``, two tile
schedules: 0 cooperative 128x128, 1 ping-pong 64x128), after checking CUTLASS's results against the
float32 reference (ragged experts, empty ones, K = 768 and 1408, a CUDA graph replay).

    benchmarks/cutlass/build.sh /tmp/libfmoe_fp8_sm90.so      # nvcc 13 + nvidia-cutlass's headers
    python3 -m benchmarks.bench_cutlass_fp8 --lib /tmp/libfmoe_fp8_sm90.so --out results.json  # repo root

CUDA only (sm_90). The CUTLASS forward reads its activation scales row-major (see the .cu): the
transposing copy is timed apart (``scale_transpose_ms``), outside the GEMM's time.
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

import torch

import fmoe.kernels.fp8_gemm as fg
import fmoe.kernels.fp8_quant as fq
from benchmarks.bench_fp8_grouped import (
    BF16_REL,
    FAMILIES,
    MICROBATCHES,
    NT_CHECKS,
    TOKENS,
    WGRAD_CHECKS,
    expert_gemms,
    ms,
    nt_case,
    rel,
    routed_counts,
    wgrad_case,
)
from benchmarks.common import write_result

VARIANTS = (0, 1)


class Cutlass:
    """The ctypes face of libfmoe_fp8_sm90.so; argument and workspace buffers come from torch's allocator
    per call (stream-ordered, so calls on other streams never share one)."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        p, i, i64, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_size_t
        lib.fmoe_fp8_grouped_args_bytes.restype = size
        lib.fmoe_fp8_grouped_args_bytes.argtypes = [i]
        lib.fmoe_fp8_grouped_workspace_bytes.restype = size
        lib.fmoe_fp8_grouped_workspace_bytes.argtypes = [i, i]
        lib.fmoe_fp8_grouped_gemm_nt.restype = i
        lib.fmoe_fp8_grouped_gemm_nt.argtypes = [i, p, p, i64, p, p, p, p, i, i, i, p, p, size, i, p]
        lib.fmoe_fp8_grouped_gemm_wgrad.restype = i
        lib.fmoe_fp8_grouped_gemm_wgrad.argtypes = [i, p, p, p, p, p, p, p, i, i, i, i64, p, p, size, i, p]
        self.lib = lib
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count

    def _buffers(self, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        args = torch.empty(self.lib.fmoe_fp8_grouped_args_bytes(groups), dtype=torch.uint8, device="cuda")
        ws = max(self.lib.fmoe_fp8_grouped_workspace_bytes(groups, self.sms), 1)
        return args, torch.empty(ws, dtype=torch.uint8, device="cuda")

    def nt(self, variant: int, a: fq.Fp8Act, b: torch.Tensor, b_scale: torch.Tensor, offs: torch.Tensor, out):
        """out [rows, N] bf16 = grouped a @ b[e]^T; a's scales row-major (``a.scale.contiguous()``)."""
        rows, k = a.data.shape
        groups, n = b.shape[0], b.shape[1]
        assert a.scale.is_contiguous() and b.is_contiguous() and b_scale.is_contiguous()
        args, ws = self._buffers(groups)
        stream = torch.cuda.current_stream().cuda_stream
        rc = self.lib.fmoe_fp8_grouped_gemm_nt(
            variant, a.data.data_ptr(), a.scale.data_ptr(), rows, b.data_ptr(), b_scale.data_ptr(),
            out.data_ptr(), offs.data_ptr(), groups, n, k, args.data_ptr(), ws.data_ptr(), ws.numel(),
            self.sms, stream,
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"fmoe_fp8_grouped_gemm_nt: status {rc}")
        return out

    def wgrad(self, variant: int, a: fq.Fp8ActT, b: fq.Fp8ActT, out):
        """out [E, M, N] bf16 = a_e @ b_e^T over each expert's tokens (dW = dy^T x)."""
        m, cap = a.data.shape
        groups = a.group_len.numel()
        assert a.scale.stride() == (1, m) and b.scale.stride() == (1, b.data.shape[0])
        args, ws = self._buffers(groups)
        stream = torch.cuda.current_stream().cuda_stream
        rc = self.lib.fmoe_fp8_grouped_gemm_wgrad(
            variant, a.data.data_ptr(), a.scale.data_ptr(), b.data.data_ptr(), b.scale.data_ptr(),
            out.data_ptr(), a.group_start.data_ptr(), a.group_len.data_ptr(), groups, m, b.data.shape[0], cap,
            args.data_ptr(), ws.data_ptr(), ws.numel(), self.sms, stream,
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"fmoe_fp8_grouped_gemm_wgrad: status {rc}")
        return out


def row_major(a: fq.Fp8Act) -> fq.Fp8Act:
    return fq.Fp8Act(a.data, a.scale.contiguous())


def checks(cut: Cutlass) -> dict:
    """Relative error against the float32 product of the dequantized operands (Triton's beside it)."""
    out = {}
    for name, counts, n, k in NT_CHECKS:
        offs, x, _, a, w8 = nt_case(counts, n, k, seed=0)
        ref = fg.fp8_gemm_nt_reference(a, w8.data, w8.scale, offs, out_dtype=torch.float32)
        row = {"triton": rel(fg.fp8_gemm_nt(a, w8.data, w8.scale, offs), ref)}
        for v in VARIANTS:
            y = torch.full((x.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
            cut.nt(v, row_major(a), w8.data, w8.scale, offs, y)
            row[f"cutlass{v}"] = rel(y, ref)
        out[name] = row
    for name, counts, m, n in WGRAD_CHECKS:
        _, _, _, at, bt = wgrad_case(counts, m, n, seed=7)
        ref = fg.fp8_gemm_wgrad_reference(at, bt, out_dtype=torch.float32)
        row = {"triton": rel(fg.fp8_gemm_wgrad(at, bt, grouped=True), ref)}
        for v in VARIANTS:
            dw = torch.full((len(counts), m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            cut.wgrad(v, at, bt, dw)
            row[f"cutlass{v}"] = rel(dw, ref)  # an empty expert's NaNs left unwritten would show here
        out[name] = row
    # captured in a CUDA graph and replayed into a zeroed output
    offs, x, _, a, w8 = nt_case([0, 33, 250, 128, 700, 1, 0, 90], 512, 768, seed=3)
    ar, y = row_major(a), torch.empty(x.shape[0], 512, dtype=torch.bfloat16, device="cuda")
    cut.nt(1, ar, w8.data, w8.scale, offs, y)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        cut.nt(1, ar, w8.data, w8.scale, offs, y)
    torch.cuda.current_stream().wait_stream(side)
    y.zero_()
    graph.replay()
    out["nt_graph_replay"] = {
        "cutlass1": rel(y, fg.fp8_gemm_nt_reference(a, w8.data, w8.scale, offs, out_dtype=torch.float32))
    }
    return out


def _ratios(r: dict, flop: float) -> dict:
    best = min(r[f"cutlass{v}_ms"] for v in VARIANTS)
    for key in ("bf16", "triton", *(f"cutlass{v}" for v in VARIANTS)):
        r[f"{key}_tflops"] = flop / r[f"{key}_ms"] / 1e9
    r["triton_x_bf16"] = r["bf16_ms"] / r["triton_ms"]
    r["best_cutlass_x_bf16"] = r["bf16_ms"] / best
    r["best_cutlass_x_triton"] = r["triton_ms"] / best
    return {k: round(v, 4) for k, v in r.items()}


def _time_nt(cut: Cutlass, counts: list[int], n: int, k: int) -> dict:
    offs, x, w, a, w8 = nt_case(counts, n, k, seed=1)
    rows = x.shape[0]
    wt, ar, y = w.transpose(-2, -1), row_major(a), torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
    r = {
        "bf16_ms": ms(lambda: torch._grouped_mm(x, wt, offs=offs)),
        "triton_ms": ms(lambda: fg.fp8_gemm_nt(a, w8.data, w8.scale, offs)),
        "scale_transpose_ms": ms(lambda: a.scale.contiguous()),
    }
    for v in VARIANTS:
        r[f"cutlass{v}_ms"] = ms(lambda v=v: cut.nt(v, ar, w8.data, w8.scale, offs, y))
    return _ratios(r, 2.0 * rows * n * k)


def _time_wgrad(cut: Cutlass, counts: list[int], m: int, n: int) -> dict:
    offs, dy, x, at, bt = wgrad_case(counts, m, n, seed=2)
    dyt, dw = dy.t().contiguous(), torch.empty(len(counts), m, n, dtype=torch.bfloat16, device="cuda")
    r = {
        "bf16_ms": ms(lambda: torch._grouped_mm(dyt, x, offs=offs)),
        "triton_ms": ms(lambda: fg.fp8_gemm_wgrad(at, bt, grouped=True)),
    }
    for v in VARIANTS:
        r[f"cutlass{v}_ms"] = ms(lambda v=v: cut.wgrad(v, at, bt, dw))
    return _ratios(r, 2.0 * dy.shape[0] * m * n)


def timing(cut: Cutlass, experts: int, top_k: int, hidden: int, inter: int) -> dict:
    """ms, TFLOP/s and ratios of each side: the four GEMMs of one micro-batch's routed rows, then the two
    weight gradients of a step's micro-batches merged."""
    gen = torch.Generator().manual_seed(0)
    counts = routed_counts(experts, TOKENS * top_k, gen).tolist()
    res = {}
    for name, (n, k) in expert_gemms(hidden, inter).items():
        res[name] = _time_nt(cut, counts, n, k)
        print(name, res[name], flush=True)
    merged = (
        (routed_counts(experts, TOKENS * top_k * MICROBATCHES, gen) + 15) // 16 * 16
    ).tolist()  # _grouped_mm: 16-aligned K
    for name, (m, n) in {"up_wgrad": (2 * inter, hidden), "down_wgrad": (hidden, inter)}.items():
        res[name] = _time_wgrad(cut, merged, m, n)
        print(name, res[name], flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lib", required=True, help="libfmoe_fp8_sm90.so from benchmarks/cutlass/build.sh")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = p.parse_args()
    cut = Cutlass(args.lib)
    result = {
        "sms": cut.sms,
        "timing": "triton.testing.do_bench median (bench_fp8_grouped.ms)",
        "rel_err_vs_fp32_reference": checks(cut),
    }
    errors = [e for row in result["rel_err_vs_fp32_reference"].values() for e in row.values()]
    # the bf16 rounding of the FP32 products, with room for the summation order (a wrong scale: 0.1 or more)
    result["all_match_reference"] = all(e < BF16_REL for e in errors)  # NaN compares False
    print(json.dumps(result["rel_err_vs_fp32_reference"], indent=1), flush=True)
    if not result["all_match_reference"]:
        print(
            f"WARNING: a relative error is not below {BF16_REL}: the timings below are of wrong results",
            flush=True,
        )
    for family, shape in FAMILIES.items():
        print(family, flush=True)
        result[family] = timing(cut, *shape)
    write_result(args.out, result, echo=False)  # with the environment: GPU, versions, host CPU, date


if __name__ == "__main__":
    main()
