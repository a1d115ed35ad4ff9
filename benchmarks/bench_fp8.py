"""FP8 kernels on the GPU: check each against its reference, then time them (issue 8).

    python benchmarks/bench_fp8.py --out benchmarks/results/fp8_h200.json

One run does, in this order, saving the JSON after each part:
1. checks: every kernel on fresh random inputs with the caching allocator poisoned with NaN first
   (an unwritten output shows up as NaN): quantization bitwise against its torch reference; GEMMs
   (every tile config timed below) against the reference on dequantized inputs, rel. error <= 1e-3;
   FP8 three-step linear layers against float64 (and bf16's error beside it);
2. block-scaled FP8 GEMM at 8192^3 for a sweep of tile configs, beside cuBLAS block-scaled
   (``F.scaled_mm``, 1x128 x 128x128), cuBLAS row-wise (``torch._scaled_mm``, fast accum) and bf16;
3. every GEMM of a Qwen3-30B-A3B layer, FP8 vs bf16 (``torch.mm``, ``torch._grouped_mm``): attention
   projections over 4096 tokens, expert up (2048 -> 2x768) / down (768 -> 2048) projections over
   131072 routed tokens on 128 experts (multinomial routing: unaligned, uneven groups);
4. quantization and fused kernels' bandwidth, against a measured device-to-device copy
   (swiglu_t: the cached FP8 experts' SwiGLU with its transpose, in one pass or two);
5. a step's merged expert weight gradients: BF16, FP8 on copied rows, FP8 on gathered rows.
Times are medians of ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
import traceback
import types
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
try:
    import fmoe.kernels  # noqa: F401
except ImportError:  # a checkout that is not pip-installed: map the package dirs by hand
    for name, folder in [("fmoe", "fmoe"), ("fmoe.kernels", "fmoe/kernels")]:
        mod = types.ModuleType(name)
        mod.__path__ = [str(REPO / folder)]
        sys.modules[name] = mod

import triton  # noqa: E402

from fmoe.kernels import fp8_gemm as fg  # noqa: E402
from fmoe.kernels import fp8_linear as fl  # noqa: E402
from fmoe.kernels import fp8_quant as fq  # noqa: E402
from fmoe.kernels import fused  # noqa: E402

REFERENCE = {  # /work/shared/REFERENCES.md, same H200, torch 2.11 cu130
    "bf16_mm_8192_tflops": 806.4,
    "fp8_rowwise_cublas_8192_tflops": 1555.6,
    "fp8_blockwise_cublas_8192_tflops": 1266.1,
    "bf16_grouped_mm_up_tflops": 732.6,
    "fp8_rowwise_grouped_mm_up_tflops": 1170.0,
    "hbm_copy_tbps": 4.24,
}
# Tile configs: the software-pipelined ones first; the warp-specialized ones (a producer warpgroup
# and two consumers) are only tried with --ws, after everything else has been saved, because the
# first GPU run of this script hung before its first report and they are the prime suspect.
CONFIGS = {
    "sw128x128w8s4": fg.GemmConfig(128, 128, num_warps=8, num_stages=4),
    "sw128x128w8s3": fg.GemmConfig(128, 128, num_warps=8, num_stages=3),
    "sw128x128w8s5": fg.GemmConfig(128, 128, num_warps=8, num_stages=5),
    "sw128x128w8s4flat": fg.GemmConfig(128, 128, num_warps=8, num_stages=4, flatten=True),
    "sw64x128w4s4x2": fg.GemmConfig(64, 128, num_warps=4, num_stages=4, flatten=True, programs_per_sm=2),
}
WS_CONFIGS = {
    "ws128x128s4": fg.GemmConfig(128, 128, num_warps=4, num_stages=4, warp_specialize=True),
    "ws256x64s4": fg.GemmConfig(256, 64, num_warps=4, num_stages=4, warp_specialize=True),
}
LAYER_CONFIGS = ["sw128x128w8s4", "sw128x128w8s4flat", "sw64x128w4s4x2"]
ROUTED_TOKENS = 131072  # --routed-tokens: 32768 is one 8 x 4096-token micro-batch's fwd/dgrad
DEV = "cuda"
WARMUP, REP = 10, 40
RESULT: dict = {}


T0 = time.time()
OUT: Path | None = None


def log(msg: str) -> None:
    """Progress, flushed at once: a hang shows where it happened."""
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


class Checks(dict):
    """A dict of check results that prints each one as it is recorded."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        log(f"check {key}: {value}")


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=WARMUP, rep=REP, return_mode="median")


def tflops(flop: float, t_ms: float) -> float:
    return flop / t_ms / 1e9


def poison() -> None:
    """Fill free cached memory with 0xFF (NaN in fp32/bf16/e4m3) so unwritten outputs are NaN."""
    n = min(torch.cuda.mem_get_info()[0] // 2, 8 << 30)
    torch.empty(n, dtype=torch.uint8, device=DEV).fill_(0xFF)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and bool(torch.equal(a, b))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def acts(rows: int, cols: int, spread: bool = True) -> torch.Tensor:
    x = torch.randn(rows, cols, device=DEV)
    if spread:  # columns from 1e-9 to 1e3: subnormal E4M3 codes, saturation, zero groups
        x = x * torch.logspace(-9, 3, cols, device=DEV)[torch.randperm(cols, device=DEV)]
        x[1] = 0
    return x.to(torch.bfloat16)


def routed_offs(tokens: int, experts: int, empty: tuple[int, ...] = ()) -> torch.Tensor:
    probs = torch.ones(experts)
    probs[list(empty)] = 0
    counts = torch.bincount(torch.multinomial(probs, tokens, replacement=True), minlength=experts)
    return torch.cumsum(counts, 0).to(torch.int32).to(DEV)


def save(path: Path | None) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(RESULT, indent=1) + "\n")


def part(name: str):
    """Run one part; record its error instead of stopping the run."""

    def wrap(fn):
        def run(*args):
            t0 = time.time()
            try:
                fn(*args)
            except Exception:
                RESULT.setdefault("errors", {})[name] = traceback.format_exc()[-3000:]
                print(f"[{name}] FAILED\n{traceback.format_exc()[-3000:]}", flush=True)
            RESULT.setdefault("part_seconds", {})[name] = round(time.time() - t0, 1)

        return run

    return wrap


# ----------------------------------------------------------------------------------------------
# 1. checks


@part("checks")
def checks() -> None:
    c = RESULT.setdefault("checks", Checks())
    for pow2 in (False, True):
        x = acts(4099, 2112)
        poison()
        got, want = fq.quantize_act(x, pow2_scales=pow2), fq.quantize_act_reference(x, pow2_scales=pow2)
        c[f"quantize_act_bitwise_pow2={pow2}"] = bits_equal(got.data, want.data) and bits_equal(
            got.scale, want.scale
        )
        offs = routed_offs(4099, 16, empty=(0, 7, 15))
        poison()
        rows, cols = fq.quantize_act_t(x, offs, pow2_scales=pow2, with_rows=True)
        rows_w, cols_w = fq.quantize_act_t_reference(x, offs, pow2_scales=pow2, with_rows=True)
        c[f"quantize_act_t_grouped_bitwise_pow2={pow2}"] = all(
            bits_equal(a, b)
            for a, b in [
                (rows.data, rows_w.data),
                (rows.scale, rows_w.scale),
                (cols.data, cols_w.data),
                (cols.scale, cols_w.scale),
            ]
        )
        w = torch.randn(8, 1536, 2112, device=DEV, dtype=torch.bfloat16) * 0.02
        poison()
        got, want = fq.quantize_weight(w, pow2_scales=pow2), fq.quantize_weight_reference(w, pow2_scales=pow2)
        c[f"quantize_weight_bitwise_pow2={pow2}"] = all(
            bits_equal(getattr(got, k), getattr(want, k)) for k in ("data", "scale", "data_t", "scale_t")
        )

    h = (torch.randn(4099, 2 * 768, device=DEV) * 3).bfloat16()
    a, a_ref = fused.swiglu(h), fused.swiglu_reference(h)
    c["swiglu_frac_equal_to_reference"] = float((a == a_ref).float().mean())
    c["swiglu_rel_err"] = rel(a, a_ref)
    q = fused.swiglu_quant(h)
    q_ref = fq.quantize_act(a)
    c["swiglu_quant_bitwise_vs_quantize_of_swiglu"] = bits_equal(q.data, q_ref.data) and bits_equal(
        q.scale, q_ref.scale
    )
    offs = routed_offs(4099, 16, empty=(3,))
    rows, cols = fused.swiglu_quant(h, offs, with_t=True)
    rows_w, cols_w = fq.quantize_act_t(a, offs, with_rows=True)
    c["swiglu_quant_with_t_bitwise"] = bits_equal(cols.data, cols_w.data) and bits_equal(
        rows.data, rows_w.data
    )
    da = torch.randn(4099, 768, device=DEV).bfloat16()
    c["swiglu_backward_rel_err"] = rel(fused.swiglu_backward(h, da), fused.swiglu_backward_reference(h, da))
    x = (torch.randn(4099, 2048, device=DEV) * 3).bfloat16()
    wn = (1 + 0.1 * torch.randn(2048, device=DEV)).bfloat16()
    y, rstd, yq = fused.rmsnorm(x, wn, quantize=True)
    y_ref, rstd_ref = fused.rmsnorm_reference(x, wn)
    c["rmsnorm_rel_err"] = rel(y, y_ref)
    c["rmsnorm_rstd_rel_err"] = rel(rstd, rstd_ref)
    q_ref = fq.quantize_act(y)
    c["rmsnorm_quant_bitwise_vs_quantize_of_y"] = bits_equal(yq.data, q_ref.data) and bits_equal(
        yq.scale, q_ref.scale
    )
    dy = torch.randn_like(x)
    dx, dw = fused.rmsnorm_backward(dy, x, wn, rstd)
    dx_ref, dw_ref = fused.rmsnorm_backward_reference(dy, x, wn.float(), rstd)
    c["rmsnorm_backward_dx_rel_err"] = rel(dx, dx_ref)
    c["rmsnorm_backward_dw_rel_err"] = rel(dw, dw_ref)

    # GEMMs, every config, partial tiles in M, N and a partial 128-group in K
    M, N, K = 1000, 1408, 2112
    a = fq.quantize_act(acts(M, K, spread=False))
    wq = fq.quantize_weight(torch.randn(N, K, device=DEV) * 0.05)
    want = fg.fp8_gemm_nt_reference(a, wq.data, wq.scale, out_dtype=torch.float32)
    E, T = 16, 5003
    offs = routed_offs(T, E, empty=(0, 5, 15))
    ag = fq.quantize_act(acts(T, K, spread=False))
    wg3 = fq.quantize_weight(torch.randn(E, 768, K, device=DEV) * 0.05)
    want_g = fg.fp8_gemm_nt_reference(ag, wg3.data, wg3.scale, offs, out_dtype=torch.float32)
    dyt = fq.quantize_act_t(acts(T, 768, spread=False), offs)
    xt = fq.quantize_act_t(acts(T, K, spread=False), offs)
    want_w = fg.fp8_gemm_wgrad_reference(dyt, xt, out_dtype=torch.float32)
    # bf16 outputs for every config (their rounding, ~2e-3, is far below what a wrong tile or scale
    # gives); FP32 outputs for the default config, to see the accumulation error itself
    for name, cfg in CONFIGS.items():
        save(OUT)
        log(f"gemm checks, config {name}")
        poison()
        c[f"gemm_nt_bf16_rel_err[{name}]"] = rel(fg.fp8_gemm_nt(a, wq.data, wq.scale, config=cfg), want)
        if name in LAYER_CONFIGS:
            poison()
            got = fg.fp8_gemm_nt(ag, wg3.data, wg3.scale, offs, config=cfg)
            c[f"grouped_nt_bf16_rel_err[{name}]"] = rel(got, want_g)
            poison()
            got = fg.fp8_gemm_wgrad(dyt, xt, grouped=True, config=cfg)
            c[f"grouped_wgrad_bf16_rel_err[{name}]"] = rel(got, want_w)
            c[f"grouped_wgrad_empty_experts_zero[{name}]"] = bool(
                (got[0] == 0).all() and (got[5] == 0).all() and (got[15] == 0).all()
            )
    poison()
    c["gemm_nt_rel_err[default]"] = rel(fg.fp8_gemm_nt(a, wq.data, wq.scale, out_dtype=torch.float32), want)
    poison()
    c["grouped_nt_rel_err[default]"] = rel(
        fg.fp8_gemm_nt(ag, wg3.data, wg3.scale, offs, out_dtype=torch.float32), want_g
    )
    poison()
    c["grouped_wgrad_rel_err[default]"] = rel(
        fg.fp8_gemm_wgrad(dyt, xt, grouped=True, out_dtype=torch.float32), want_w
    )

    # three-step FP8 linear layers against float64, with bf16's error beside them
    T, d_in, d_out = 4096, 2048, 1536
    x = torch.randn(T, d_in, device=DEV).bfloat16()
    w = torch.randn(d_out, d_in, device=DEV) * 0.02
    dy = torch.randn(T, d_out, device=DEV).bfloat16()
    w8 = fl.quantize_weight(w)
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    wb = w.bfloat16()
    c["linear_fwd_rel_err_fp8"] = rel(fl.fp8_linear_forward(x, w8), x64 @ w64.t())
    c["linear_fwd_rel_err_bf16"] = rel(x @ wb.t(), x64 @ w64.t())
    c["linear_dgrad_rel_err_fp8"] = rel(fl.fp8_linear_input_grad(dy, w8), dy64 @ w64)
    c["linear_dgrad_rel_err_bf16"] = rel(dy @ wb, dy64 @ w64)
    c["linear_wgrad_rel_err_fp8"] = rel(fl.fp8_linear_weight_grad(x, dy), dy64.t() @ x64)
    c["linear_wgrad_rel_err_bf16"] = rel(dy.t() @ x, dy64.t() @ x64)
    E = 8
    offs = routed_offs(T, E, empty=(2,))
    w3 = torch.randn(E, d_out, d_in, device=DEV) * 0.02
    w38 = fl.quantize_weight(w3)
    y = fl.fp8_grouped_linear_forward(x, w38, offs)
    dx = fl.fp8_grouped_linear_input_grad(dy, w38, offs)
    dw = fl.fp8_grouped_linear_weight_grad(x, dy, offs)
    ys, dxs, dws = [], [], []
    start = 0
    for e, end in enumerate(offs.tolist()):
        ys.append(x64[start:end] @ w3[e].double().t())
        dxs.append(dy64[start:end] @ w3[e].double())
        dws.append(dy64[start:end].t() @ x64[start:end])
        start = end
    c["grouped_fwd_rel_err_fp8"] = rel(y, torch.cat(ys))
    c["grouped_dgrad_rel_err_fp8"] = rel(dx, torch.cat(dxs))
    c["grouped_wgrad_rel_err_fp8"] = rel(dw, torch.stack(dws))
    c["grouped_wgrad_empty_expert_zero"] = bool((dw[2] == 0).all())

    # ours vs cuBLAS block-scaled on the same quantized inputs
    try:
        from torch.nn.functional import ScalingType, SwizzleType, scaled_mm

        a = fq.quantize_act(acts(2048, 2048, spread=False))
        wq = fq.quantize_weight(torch.randn(2048, 2048, device=DEV))
        cub = scaled_mm(
            a.data, wq.data.t(), a.scale, ScalingType.BlockWise1x128, wq.scale.t(), ScalingType.BlockWise128x128,
            swizzle_a=SwizzleType.NO_SWIZZLE, swizzle_b=SwizzleType.NO_SWIZZLE, output_dtype=torch.bfloat16,
        )  # fmt: skip
        c["gemm_nt_rel_diff_vs_cublas_blockwise"] = rel(fg.fp8_gemm_nt(a, wq.data, wq.scale), cub)
    except Exception as e:  # recorded, not fatal
        c["gemm_nt_rel_diff_vs_cublas_blockwise"] = f"n/a: {e!r}"[:300]

    limits = [  # (key prefix, largest acceptable value)
        ("gemm_nt_rel_err", 1e-3), ("grouped_nt_rel_err", 1e-3), ("grouped_wgrad_rel_err[", 1e-3),
        ("gemm_nt_bf16", 5e-3), ("grouped_nt_bf16", 5e-3), ("grouped_wgrad_bf16", 5e-3),
        ("gemm_nt_rel_diff_vs_cublas", 1e-2),
        ("linear_", 0.07), ("grouped_fwd", 0.07), ("grouped_dgrad", 0.07), ("grouped_wgrad_rel_err_fp8", 0.07),
        ("swiglu_rel", 1e-2), ("swiglu_backward", 1e-2), ("rmsnorm_", 1e-2),
    ]  # fmt: skip
    bad = [k for k, v in c.items() if v is False]
    for k, v in c.items():
        limit = next((lim for prefix, lim in limits if k.startswith(prefix)), None)
        if limit is not None and isinstance(v, float) and not v < limit and not k.endswith("_bf16"):
            bad.append(k)
    dict.__setitem__(c, "failed", bad)
    print("checks failed:", bad, flush=True)


# ----------------------------------------------------------------------------------------------
# 2. 8192^3


@part("dense_8192")
def dense_8192() -> None:
    r = RESULT.setdefault("dense_8192", {"tflops": {}})
    n = 8192
    flop = 2.0 * n**3
    xb = torch.randn(n, n, device=DEV).bfloat16()
    wb = (torch.randn(n, n, device=DEV) * 0.02).bfloat16()
    a = fq.quantize_act(xb)
    w8 = fq.quantize_weight(wb)
    for name, cfg in CONFIGS.items():
        log(f"8192^3 config {name}")
        t = ms(lambda cfg=cfg: fg.fp8_gemm_nt(a, w8.data, w8.scale, config=cfg))
        r["tflops"][f"triton_fp8_block[{name}]"] = tflops(flop, t)
        print(f"8192^3 triton fp8 block {name}: {tflops(flop, t):.0f} TFLOP/s", flush=True)
    r["tflops"]["bf16_torch_mm"] = tflops(flop, ms(lambda: torch.mm(xb, wb.t())))
    try:
        from torch.nn.functional import ScalingType, SwizzleType, scaled_mm

        def cublas_block():
            return scaled_mm(
                a.data, w8.data.t(), a.scale, ScalingType.BlockWise1x128, w8.scale.t(), ScalingType.BlockWise128x128,
                swizzle_a=SwizzleType.NO_SWIZZLE, swizzle_b=SwizzleType.NO_SWIZZLE, output_dtype=torch.bfloat16,
            )  # fmt: skip

        r["tflops"]["cublas_fp8_blockwise_F.scaled_mm"] = tflops(flop, ms(cublas_block))
    except Exception as e:
        r["cublas_blockwise_error"] = repr(e)[:300]
    sa, sb = torch.rand(n, 1, device=DEV) + 0.5, torch.rand(1, n, device=DEV) + 0.5
    r["tflops"]["cublas_fp8_rowwise_scaled_mm_fast_accum"] = tflops(
        flop,
        ms(
            lambda: torch._scaled_mm(
                a.data, w8.data.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True
            )
        ),
    )
    best = max((v, k) for k, v in r["tflops"].items() if k.startswith("triton"))
    r["best_triton"] = {"config": best[1], "tflops": best[0]}
    cub = r["tflops"].get("cublas_fp8_blockwise_F.scaled_mm")
    r["best_over_cublas_blockwise_measured"] = best[0] / cub if cub else None
    r["best_over_cublas_blockwise_reference_1266"] = best[0] / REFERENCE["fp8_blockwise_cublas_8192_tflops"]
    r["best_over_cublas_rowwise_measured"] = best[0] / r["tflops"]["cublas_fp8_rowwise_scaled_mm_fast_accum"]
    print(json.dumps(r, indent=1), flush=True)


# ----------------------------------------------------------------------------------------------
# 3. Qwen3-30B-A3B layer


def _best(fns: dict) -> dict:
    out = {name: ms(fn) for name, fn in fns.items()}
    name = min(out, key=out.get)
    return {"ms_by_config": out, "best_config": name, "ms": out[name]}


def _three_gemms(flop: float, fp8: dict, bf16: dict, quant_ms: float) -> dict:
    """fp8: step -> {config: fn}; bf16: step -> fn. Times each, with the speedups."""
    row = {}
    for step, fns in fp8.items():
        row[step] = _best(fns)
        t = ms(bf16[step])
        row[step].update(
            fp8_tflops=tflops(flop, row[step]["ms"]), bf16_ms=t, bf16_tflops=tflops(flop, t),
            speedup_vs_bf16=t / row[step]["ms"],
        )  # fmt: skip
    row["act_quant_ms (x and dy, rows + transposed)"] = quant_ms
    fp8_total = sum(row[s]["ms"] for s in fp8) + quant_ms
    row["three_gemms_plus_quant_speedup_vs_bf16"] = sum(row[s]["bf16_ms"] for s in fp8) / fp8_total
    return row


def _linear_row(tok: int, d_out: int, d_in: int) -> dict:
    x = torch.randn(tok, d_in, device=DEV).bfloat16()
    dy = torch.randn(tok, d_out, device=DEV).bfloat16()
    w = (torch.randn(d_out, d_in, device=DEV) * 0.02).bfloat16()
    w8 = fq.quantize_weight(w)
    xr, xt = fq.quantize_act_t(x, with_rows=True)
    dyr, dyt = fq.quantize_act_t(dy, with_rows=True)
    cfgs = {k: CONFIGS[k] for k in LAYER_CONFIGS}
    fp8 = {
        "fwd": {k: (lambda c=c: fg.fp8_gemm_nt(xr, w8.data, w8.scale, config=c)) for k, c in cfgs.items()},
        "dgrad": {
            k: (lambda c=c: fg.fp8_gemm_nt(dyr, w8.data_t, w8.scale_t, config=c)) for k, c in cfgs.items()
        },
        "wgrad": {
            k: (lambda c=c: fg.fp8_gemm_wgrad(dyt, xt, grouped=False, config=c)) for k, c in cfgs.items()
        },
    }
    bf16 = {"fwd": lambda: x @ w.t(), "dgrad": lambda: dy @ w, "wgrad": lambda: dy.t() @ x}
    quant = ms(lambda: fq.quantize_act_t(x, with_rows=True)) + ms(
        lambda: fq.quantize_act_t(dy, with_rows=True)
    )
    return _three_gemms(2.0 * tok * d_in * d_out, fp8, bf16, quant)


def _grouped_row(offs: torch.Tensor, d_out: int, d_in: int) -> dict:
    T, E = int(offs[-1]), offs.numel()
    x = torch.randn(T, d_in, device=DEV).bfloat16()
    dy = torch.randn(T, d_out, device=DEV).bfloat16()
    w = (torch.randn(E, d_out, d_in, device=DEV) * 0.02).bfloat16()
    w8 = fq.quantize_weight(w)
    xr, xt = fq.quantize_act_t(x, offs, with_rows=True)
    dyr, dyt = fq.quantize_act_t(dy, offs, with_rows=True)
    cfgs = {k: CONFIGS[k] for k in LAYER_CONFIGS}
    fp8 = {
        "fwd": {
            k: (lambda c=c: fg.fp8_gemm_nt(xr, w8.data, w8.scale, offs, config=c)) for k, c in cfgs.items()
        },
        "dgrad": {
            k: (lambda c=c: fg.fp8_gemm_nt(dyr, w8.data_t, w8.scale_t, offs, config=c))
            for k, c in cfgs.items()
        },
        "wgrad": {
            k: (lambda c=c: fg.fp8_gemm_wgrad(dyt, xt, grouped=True, config=c)) for k, c in cfgs.items()
        },
    }
    dy_t = dy.t()
    try:
        torch._grouped_mm(dy_t, x, offs=offs)
    except Exception:  # a transposed view refused: time it on a contiguous copy
        dy_t = dy_t.contiguous()
    bf16 = {
        "fwd": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
        "dgrad": lambda: torch._grouped_mm(dy, w, offs=offs),
        "wgrad": lambda: torch._grouped_mm(dy_t, x, offs=offs),
    }
    quant = ms(lambda: fq.quantize_act_t(x, offs, with_rows=True)) + ms(
        lambda: fq.quantize_act_t(dy, offs, with_rows=True)
    )
    row = _three_gemms(2.0 * T * d_in * d_out, fp8, bf16, quant)
    row["bf16_wgrad_dy_t_contiguous_copy"] = dy_t.is_contiguous()
    sa, sb = torch.rand(T, device=DEV) + 0.5, torch.rand(E, d_out, device=DEV) + 0.5
    try:
        t = ms(
            lambda: torch._scaled_grouped_mm(
                xr.data,
                w8.data.transpose(-2, -1),
                sa,
                sb,
                offs=offs,
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
            )
        )
        row["fwd"]["cublas_rowwise_scaled_grouped_mm_tflops"] = tflops(2.0 * T * d_in * d_out, t)
    except Exception as e:
        row["fwd"]["cublas_rowwise_scaled_grouped_mm_error"] = repr(e)[:300]
    return row


@part("qwen3_layer")
def qwen3_layer() -> None:
    r = RESULT.setdefault("qwen3_30b_a3b_layer", {})
    attn = {"q_proj": (4096, 2048), "k_proj": (512, 2048), "v_proj": (512, 2048), "o_proj": (2048, 4096)}
    offs = routed_offs(ROUTED_TOKENS, 128)
    experts = {"experts_up (2048 -> 2x768)": (1536, 2048), "experts_down (768 -> 2048)": (2048, 768)}
    r["shapes"] = {
        "attention_tokens": 4096,
        "routed_tokens": ROUTED_TOKENS,
        "experts": 128,
        **attn,
        **experts,
    }
    r["configs"] = LAYER_CONFIGS
    for name, (d_out, d_in) in experts.items():
        log(name)
        r[name] = _grouped_row(offs, d_out, d_in)
        save(OUT)
        print(
            name, {s: round(r[name][s]["speedup_vs_bf16"], 2) for s in ("fwd", "dgrad", "wgrad")}, flush=True
        )
    for name, (d_out, d_in) in attn.items():
        log(name)
        r[name] = _linear_row(4096, d_out, d_in)
        save(OUT)
        print(
            name, {s: round(r[name][s]["speedup_vs_bf16"], 2) for s in ("fwd", "dgrad", "wgrad")}, flush=True
        )


# ----------------------------------------------------------------------------------------------
# 4. bandwidth


def _copy_tbps() -> float:
    """A device-to-device copy's bandwidth, TB/s (512 MiB, read and written)."""
    src = torch.randn(1 << 28, device=DEV).bfloat16()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / ms(lambda: dst.copy_(src)) / 1e9


@part("bandwidth")
def bandwidth() -> None:
    r = RESULT.setdefault("bandwidth", {})
    copy = _copy_tbps()
    r["copy_tbps_measured"] = copy
    T, H, E = 131072, 2048, 128
    x = torch.randn(T, H, device=DEV).bfloat16()
    offs = routed_offs(T, E)
    cap = (T // 128 + E) * 128

    def tbps(nbytes, t):
        return {"ms": t, "tbps": nbytes / t / 1e9, "of_copy": nbytes / t / 1e9 / copy}

    rows_bytes = T * H * 3 + T * H // 128 * 4
    sweep = {}
    for br, nw in [(32, 4), (64, 4), (64, 8), (128, 8)]:
        fq.ROWS_BLOCK_R, fq.ROWS_WARPS = br, nw
        sweep[f"block_r={br},warps={nw}"] = tbps(rows_bytes, ms(lambda: fq.quantize_act(x)))
    r["quantize_act_sweep"] = sweep
    best = max(sweep, key=lambda k: sweep[k]["tbps"])
    fq.ROWS_BLOCK_R, fq.ROWS_WARPS = (int(v.split("=")[1]) for v in best.split(","))
    r["quantize_act [131072, 2048] bf16"] = {**sweep[best], "launch": best}

    t_bytes = T * H * 2 + H * cap + H * cap // 128 * 4
    rt_bytes = t_bytes + T * H + T * H // 128 * 4
    sweep = {}
    for nw in (8, 16, 4):
        fq.TILES_WARPS = nw
        sweep[f"warps={nw}"] = tbps(rt_bytes, ms(lambda: fq.quantize_act_t(x, offs, with_rows=True)))
    r["quantize_act_t_with_rows_sweep"] = sweep
    best = max(sweep, key=lambda k: sweep[k]["tbps"])
    fq.TILES_WARPS = int(best.split("=")[1])
    r["quantize_act_t grouped + rows [131072, 2048] (fused, one read)"] = {**sweep[best], "launch": best}
    r["quantize_act_t grouped [131072, 2048]"] = tbps(t_bytes, ms(lambda: fq.quantize_act_t(x, offs)))

    w = (torch.randn(E, 1536, H, device=DEV) * 0.02).bfloat16()
    r["quantize_weight [128, 1536, 2048] bf16"] = tbps(w.numel() * 4, ms(lambda: fq.quantize_weight(w)))
    h = torch.randn(T, 1536, device=DEV).bfloat16()
    s_bytes = T * 1536 * 2 + T * 768 + 768 * cap + (T + cap) * 6 * 4
    r["swiglu_quant with_t [131072, 2x768]"] = tbps(
        s_bytes, ms(lambda: fused.swiglu_quant(h, offs, with_t=True))
    )
    r["swiglu_quant rows [131072, 2x768]"] = tbps(T * 1536 * 2 + T * 768, ms(lambda: fused.swiglu_quant(h)))
    r["swiglu bf16 [131072, 2x768]"] = tbps(T * 1536 * 2 + T * 768 * 2, ms(lambda: fused.swiglu(h)))
    da = torch.randn(T, 768, device=DEV).bfloat16()
    r["swiglu_backward [131072, 2x768]"] = tbps(
        T * 1536 * 4 + T * 768 * 2, ms(lambda: fused.swiglu_backward(h, da))
    )
    xn = x[:65536]
    wn = torch.ones(H, device=DEV).bfloat16()
    r["rmsnorm [65536, 2048]"] = tbps(xn.numel() * 4, ms(lambda: fused.rmsnorm(xn, wn)))
    r["rmsnorm+quant [65536, 2048]"] = tbps(xn.numel() * 5, ms(lambda: fused.rmsnorm(xn, wn, quantize=True)))
    _, rstd = fused.rmsnorm(xn, wn)
    dyn = torch.randn_like(xn)
    r["rmsnorm_backward [65536, 2048]"] = tbps(
        xn.numel() * 6, ms(lambda: fused.rmsnorm_backward(dyn, xn, wn, rstd))
    )
    for k, v in r.items():
        print(
            k,
            v if not isinstance(v, dict) or "tbps" not in v else f"{v['tbps']:.2f} TB/s ({v['of_copy']:.0%})",
        )


# ----------------------------------------------------------------------------------------------
# 4b. SwiGLU's FP8 output with its token-wise transpose: one pass or two


def swiglu_t_two_pass(h: torch.Tensor, offs: torch.Tensor) -> tuple[fq.Fp8Act, fq.Fp8ActT]:
    """swiglu_quant(h, offs, with_t=True) in two passes: SwiGLU with its FP8 rows, then the
    token-wise quantization of the bf16 product (the same bits)."""
    a, rows = fused.swiglu(h, quantize=True)
    return rows, fq.quantize_act_t(a, offs)


SWIGLU_T_SHAPES = {  # family -> (tokens a micro-batch, experts, top-k, expert width)
    "qwen3_30b_a3b": (4096, 128, 8, 768),
    "deepseek_v3_16b": (4096, 64, 6, 1408),
}


@part("swiglu_t")
def swiglu_t() -> None:
    """SwiGLU's FP8 rows and token-wise transpose (what the FP8 experts cached at merge window 1
    until their W read the rows instead: grouped_linear's w_reads_rows; no training path runs it
    now), from one pass (swiglu_quant(with_t=True): the tile kernel recomputing
    SwiGLU, 32% of a copy at Qwen3's rows on an H100, issue26_tile_launch_2026-12-07_h100.json)
    against two (swiglu_t_two_pass), each checked bitwise against the reference first."""
    r = RESULT.setdefault("swiglu_t", {})
    copy = _copy_tbps()
    r["copy_tbps_measured"] = copy
    for family, (tokens, experts, top_k, inter) in SWIGLU_T_SHAPES.items():
        offs = routed_offs(tokens * top_k, experts)
        h = (torch.randn(tokens * top_k, 2 * inter, device=DEV) * 3).bfloat16()
        want = fq.quantize_act_t_reference(fused.swiglu(h), offs, with_rows=True)
        rows = h.shape[0]
        one_pass_bytes = rows * 2 * inter * 2 + rows * inter + (rows // 128 + experts) * 128 * inter
        row = {"shape": [rows, 2 * inter]}
        fns = {
            "one_pass": partial(fused.swiglu_quant, h, offs, with_t=True),
            "two_pass": partial(swiglu_t_two_pass, h, offs),
        }
        for name, fn in fns.items():
            poison()
            ok = all(bits_equal(a, b) for a, b in zip(_flat(fn()), _flat(want), strict=True))
            t = ms(fn)
            row[name] = {"ms": t, "bits_equal": ok, "one_pass_bytes_of_copy": one_pass_bytes / t / 1e9 / copy}
        row["two_pass_speedup"] = row["one_pass"]["ms"] / row["two_pass"]["ms"]
        r[family] = row
        log(f"swiglu_t {family}: {json.dumps(row)}")
        save(OUT)


def _flat(out) -> list[torch.Tensor]:
    """The data and scale tensors of an Fp8Act / Fp8ActT or a tuple of them, in order."""
    pairs = out if isinstance(out, tuple) else (out,)
    return [t for a in pairs for t in (a.data, a.scale)]


# ----------------------------------------------------------------------------------------------
# 5. a step's merged expert weight gradients


def _merge_row(d_in: int, d_out: int, rows: int = 32768) -> dict:
    from fmoe.stages import primitives

    parts = {True: [], False: [], "rows": []}
    for _ in range(8):
        offs = routed_offs(rows, 128)
        x, dy = acts(rows, d_in, spread=False), acts(rows, d_out, spread=False)
        for fp8 in (True, False):
            parts[fp8].append(primitives.GroupedWeightGrad(x, dy, offs, 128, fp8=fp8))
        # as the runtime keeps it: dy's FP8 rows (B's input-gradient operand), requantized by W
        dy_rows = fq.quantize_act(dy)
        parts["rows"].append(
            primitives.GroupedWeightGrad(x, dy_rows, offs, 128, fp8=True, out_dtype=dy.dtype)
        )
    row = {"bf16_ms": ms(lambda: primitives.merge_grouped_weight_grads(parts[False]))}
    gathered = primitives.merge_grouped_weight_grads(parts[True])
    row["fp8_gathered_ms"] = ms(lambda: primitives.merge_grouped_weight_grads(parts[True]))
    row["fp8_dy_rows_gathered_ms"] = ms(lambda: primitives.merge_grouped_weight_grads(parts["rows"]))
    real_max = fq.GATHER_MAX_PARTS
    fq.GATHER_MAX_PARTS = 1  # the rows copied into one tensor (scatter_rows), then quantized
    try:
        copied = primitives.merge_grouped_weight_grads(parts[True])
        row["fp8_copied_bitwise_equal"] = bits_equal(copied, gathered)
        row["fp8_copied_ms"] = ms(lambda: primitives.merge_grouped_weight_grads(parts[True]))
    finally:
        fq.GATHER_MAX_PARTS = real_max
    row["fp8_gathered_speedup_vs_bf16"] = row["bf16_ms"] / row["fp8_gathered_ms"]
    row["fp8_copied_speedup_vs_bf16"] = row["bf16_ms"] / row["fp8_copied_ms"]
    return row


@part("merge")
def merge() -> None:
    """W of one Qwen3 MoE layer for a step of 8 micro-batches x 4096 tokens x top-8 (8 parts of
    32768 routed rows, 128 experts), merged: BF16 (rows copied, torch._grouped_mm), FP8 with the rows
    copied then quantized, FP8 quantizing them where they lie (the same bits, checked), and FP8 with
    dy kept as its FP8 rows and requantized where they lie (what the runtime keeps)."""
    r = RESULT.setdefault("merge_8x32768", {})
    weights = {"experts_up (2048 -> 2x768)": (2048, 1536), "experts_down (768 -> 2048)": (768, 2048)}
    for name, (d_in, d_out) in weights.items():
        log(f"merge {name}")
        r[name] = _merge_row(d_in, d_out)
        print(name, json.dumps(r[name]), flush=True)
        save(OUT)


@part("warp_specialized")
def warp_specialized() -> None:
    """Check, then time at 8192^3 and on the expert up-projection, each warp-specialized config."""
    r = RESULT.setdefault("warp_specialized", {})
    a = fq.quantize_act(acts(1000, 2112, spread=False))
    wq = fq.quantize_weight(torch.randn(1408, 2112, device=DEV) * 0.05)
    want = fg.fp8_gemm_nt_reference(a, wq.data, wq.scale, out_dtype=torch.float32)
    n = 8192
    xa = fq.quantize_act(torch.randn(n, n, device=DEV).bfloat16())
    w8 = fq.quantize_weight((torch.randn(n, n, device=DEV) * 0.02).bfloat16())
    for name, cfg in WS_CONFIGS.items():
        log(f"warp-specialized {name}: first launch (a hang here is the kernel)")
        poison()
        r[f"gemm_nt_bf16_rel_err[{name}]"] = rel(fg.fp8_gemm_nt(a, wq.data, wq.scale, config=cfg), want)
        torch.cuda.synchronize()
        save(OUT)
        r[f"tflops_8192[{name}]"] = tflops(
            2.0 * n**3, ms(lambda cfg=cfg: fg.fp8_gemm_nt(xa, w8.data, w8.scale, config=cfg))
        )
        log(f"{name}: {r}")
        save(OUT)


def main() -> None:
    global OUT, ROUTED_TOKENS, LAYER_CONFIGS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")
    p.add_argument("--parts", default="checks,dense_8192,qwen3_layer,bandwidth,merge")
    p.add_argument("--routed-tokens", type=int, default=ROUTED_TOKENS, help="qwen3_layer's expert rows")
    p.add_argument("--layer-configs", default=",".join(LAYER_CONFIGS), help="qwen3_layer's tile configs")
    p.add_argument("--ws", action="store_true", help="then check and time the warp-specialized configs")
    args = p.parse_args()
    unknown = sorted(set(args.layer_configs.split(",")) - set(CONFIGS)) + sorted(
        set(args.parts.split(",")) - set(PARTS)
    )
    if unknown:
        p.exit(
            2,
            f"bench_fp8.py: --layer-configs/--parts: unknown {unknown}; configs {list(CONFIGS)}, parts {list(PARTS)}\n",
        )
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8.py needs a CUDA GPU (the kernels' CPU tests are tests/test_kernels_*)")
    props = torch.cuda.get_device_properties(0)
    RESULT["environment"] = {
        "gpu": torch.cuda.get_device_name(),
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "deep_gemm": fg._deep_gemm() is not None,
    }
    RESULT["reference_figures"] = REFERENCE
    RESULT["timing"] = f"triton.testing.do_bench median, warmup {WARMUP} ms, rep {REP} ms"
    torch.manual_seed(0)
    OUT, ROUTED_TOKENS, LAYER_CONFIGS = args.out, args.routed_tokens, args.layer_configs.split(",")
    parts = args.parts.split(",") + (["warp_specialized"] if args.ws else [])
    for name in parts:
        log(f"part {name}")
        PARTS[name]()
        save(args.out)
    summary()
    print("errors:", list(RESULT.get("errors", {})))


PARTS = {
    "checks": checks,
    "dense_8192": dense_8192,
    "qwen3_layer": qwen3_layer,
    "bandwidth": bandwidth,
    "swiglu_t": swiglu_t,
    "merge": merge,
    "warp_specialized": warp_specialized,
}


def summary() -> None:
    """The figures the issue asks for, last in the log."""
    print("\n==== summary ====")
    c = RESULT.get("checks", {})
    print("checks failed:", c.get("failed"))
    d = RESULT.get("dense_8192", {})
    for k, v in d.get("tflops", {}).items():
        print(f"8192^3 {k}: {v:.0f} TFLOP/s")
    for k in ("best_over_cublas_blockwise_measured", "best_over_cublas_blockwise_reference_1266"):
        if d.get(k):
            print(f"8192^3 {k}: {d[k]:.3f}")
    for name, row in RESULT.get("qwen3_30b_a3b_layer", {}).items():
        if "fwd" not in row:
            continue
        steps = " ".join(
            f"{s}: {row[s]['fp8_tflops']:.0f} vs {row[s]['bf16_tflops']:.0f} TF ({row[s]['speedup_vs_bf16']:.2f}x, {row[s]['best_config']})"
            for s in ("fwd", "dgrad", "wgrad")
        )
        print(f"{name}: {steps}; with quant {row['three_gemms_plus_quant_speedup_vs_bf16']:.2f}x")
    for k, v in RESULT.get("merge_8x32768", {}).items():
        print(f"merged W {k}: bf16 {v['bf16_ms']:.2f} ms, fp8 copied {v['fp8_copied_ms']:.2f}, "
              f"gathered {v['fp8_gathered_ms']:.2f} (bitwise equal: {v['fp8_copied_bitwise_equal']})")  # fmt: skip
    for k, v in RESULT.get("warp_specialized", {}).items():
        print(f"warp-specialized {k}: {v}")
    for k, v in RESULT.get("bandwidth", {}).items():
        if isinstance(v, dict) and "tbps" in v:
            print(f"{k}: {v['tbps']:.2f} TB/s = {v['of_copy']:.0%} of copy")
        elif not isinstance(v, dict):
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
