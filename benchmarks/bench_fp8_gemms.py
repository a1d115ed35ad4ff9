"""Every GEMM of a Qwen3-30B-A3B and a DeepSeek-V3-16B layer: BF16 against FP8 on Triton and on cuBLAS,
with and without the activations' quantization (issue 26's per-GEMM table).

    python -m benchmarks.bench_fp8_gemms --out benchmarks/results/fp8_gemms_h200.json   # < 3 min on an H200
    python -m benchmarks.bench_fp8_gemms --tiny --device cpu                           # CPU smoke run

GEMMs, as the layer runs them (weights [out, in]; M = 8 x 4096 tokens; the experts' rows are the
tokens' top-k picks among the experts, grouped by expert, from random router scores):
  dense projections (q / k / v / o; DeepSeek: q, kv_b, o, shared experts): forward y = x w^T, input
  gradient dx = dy w, weight gradient dw = dy^T x;
  grouped expert up (in -> 2 x moe_intermediate) and down (moe_intermediate -> in): the same three,
  per expert.
Paths, each timed alone (``gemm``) and with the quantization of its activations counted
(``with_quant``: x rows for the forward, dy rows for the input gradient, dy and x along tokens for
the weight gradient; the weights are quantized once per optimizer step and not counted):
  bf16:   ``torch.mm`` / ``torch._grouped_mm`` (as fmoe's BF16 layers call them);
  triton: fmoe's Triton block-scaled kernels (``backend="triton"``);
  cublas: cuBLAS block-scaled ``scaled_mm`` (``backend="cublas"``), the dense GEMMs where it applies;
  scaled_grouped_mm: torch's grouped FP8 GEMM with 1x128 / 128x128 block scales, probed; the error
  text is recorded where torch refuses it.
Each row gives TFLOP/s (2 M N K / time) and the ratio to BF16; ``rel_diff_cublas_triton`` is
||C_cublas - C_triton|| / ||C_triton|| (same FP8 operands: only the accumulation differs).
Times: medians of ``triton.testing.do_bench`` on CUDA (L2 flushed between calls), of
``benchmarks.common.time_ms`` on CPU.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import time_ms, write_result
from fmoe.kernels import fp8_gemm as fg
from fmoe.kernels import fp8_quant as fq
from fmoe.kernels._triton import use_triton
from fmoe.kernels.fp8_cublas import cublas_available, cublas_supports, cublas_weight_scale
from fmoe.stages.primitives import grouped_mm, grouped_mm_weight_grad

TOKENS = 8 * 4096
# dense weights [out, in] that run in FP8 (every dim a multiple of 128), and the experts
FAMILIES = {
    "qwen3_30b_a3b": {
        "dense": {"q_proj": (4096, 2048), "k_proj": (512, 2048), "v_proj": (512, 2048), "o_proj": (2048, 4096)},
        "experts": 128, "top_k": 8, "hidden": 2048, "moe_intermediate": 768,
    },
    "deepseek_v3_16b": {  # MLA without query compression: q 16 x 192, kv_b 512 -> 16 x (128 + 128)
        "dense": {"q_proj": (3072, 2048), "kv_b_proj": (4096, 512), "o_proj": (2048, 2048),
                  "shared_gate_up": (5632, 2048), "shared_down": (2048, 2816)},
        "experts": 64, "top_k": 6, "hidden": 2048, "moe_intermediate": 1408,
    },
}  # fmt: skip
TINY = {
    "tiny": {
        "dense": {"q_proj": (256, 128), "o_proj": (128, 256)},
        "experts": 4, "top_k": 2, "hidden": 128, "moe_intermediate": 256,
    }
}  # fmt: skip


def _timer(device: str):
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=10, rep=30, return_mode="median")
    return lambda fn: time_ms(fn, warmup=1, iters=2, device="cpu")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _routed_offs(tokens: int, experts: int, top_k: int, device: str) -> torch.Tensor:
    """Cumulative end rows of each expert's rows: top-k of random router scores per token."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randn(tokens, experts, generator=gen).topk(top_k, dim=-1).indices
    return torch.bincount(ids.flatten(), minlength=experts).cumsum(0).to(torch.int32).to(device)


def _operands(M: int, N: int, K: int, E: int | None, device: str, dtype):
    gen = torch.Generator(device=device).manual_seed(M + N + K)
    x = torch.randn(M, K, generator=gen, device=device).to(dtype)
    dy = torch.randn(M, N, generator=gen, device=device).to(dtype)
    shape = (N, K) if E is None else (E, N, K)
    w = (torch.randn(*shape, generator=gen, device=device) * 0.02).to(dtype)
    return x, dy, w


def _probe_scaled_grouped_mm(xq: fq.Fp8Act, w8: fq.Fp8Weight, offs: torch.Tensor) -> dict:
    """torch's grouped FP8 GEMMs with DeepSeek's block scales: api -> {"call": a callable that ran
    once} or {"refused": why}."""
    calls = {}
    if hasattr(F, "scaled_grouped_mm"):
        sb = cublas_weight_scale(w8.scale)  # [E, L4, N/128], each expert's as the dense GEMM takes it
        blocks = F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128
        calls["F.scaled_grouped_mm"] = lambda: F.scaled_grouped_mm(
            xq.data, w8.data.transpose(-2, -1), xq.scale, blocks[0], sb, blocks[1], offs=offs
        )
    if hasattr(torch, "_scaled_grouped_mm"):
        calls["torch._scaled_grouped_mm"] = lambda: torch._scaled_grouped_mm(
            xq.data, w8.data.transpose(-2, -1), xq.scale, w8.scale.transpose(-2, -1), offs=offs,
            out_dtype=torch.bfloat16,
        )  # fmt: skip
    if not calls:
        return {"any": {"refused": "this torch has neither F.scaled_grouped_mm nor torch._scaled_grouped_mm"}}
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = {"call": call}
        except Exception as e:  # noqa: BLE001 - the refusal's text is the finding
            out[name] = {"refused": f"{type(e).__name__}: {str(e)[:400]}"}
    return out


def _paths(kind: str, x, dy, w, offs, w8, tri: str, cublas: bool):
    """name -> (gemm-only call, call with the quantization counted) of one GEMM; and its bf16 call."""
    grouped = offs is not None
    if kind == "forward":
        bf16 = (lambda: grouped_mm(x, w.transpose(-2, -1), offs)) if grouped else (lambda: x @ w.t())
        q = fq.quantize_act(x)
        fp8 = {b: (lambda b=b: fg.fp8_gemm_nt(q, w8.data, w8.scale, offs, backend=b),
                   lambda b=b: fg.fp8_gemm_nt(fq.quantize_act(x), w8.data, w8.scale, offs, backend=b))
               for b in [tri, "cublas"][: 1 + cublas]}  # fmt: skip
    elif kind == "input_grad":
        bf16 = (lambda: grouped_mm(dy, w, offs)) if grouped else (lambda: dy @ w)
        q = fq.quantize_act(dy)
        fp8 = {b: (lambda b=b: fg.fp8_gemm_nt(q, w8.data_t, w8.scale_t, offs, backend=b),
                   lambda b=b: fg.fp8_gemm_nt(fq.quantize_act(dy), w8.data_t, w8.scale_t, offs, backend=b))
               for b in [tri, "cublas"][: 1 + cublas]}  # fmt: skip
    else:
        E = w.shape[0] if grouped else 1
        bf16 = (lambda: grouped_mm_weight_grad(x, dy, offs, E)) if grouped else (lambda: dy.t() @ x)
        a, b_ = fq.quantize_act_t(dy, offs), fq.quantize_act_t(x, offs)

        def quantized_wgrad(b):
            return fg.fp8_gemm_wgrad(fq.quantize_act_t(dy, offs), fq.quantize_act_t(x, offs), grouped=grouped,
                                     backend=b)  # fmt: skip

        fp8 = {b: (lambda b=b: fg.fp8_gemm_wgrad(a, b_, grouped=grouped, backend=b), lambda b=b: quantized_wgrad(b))
               for b in [tri, "cublas"][: 1 + cublas]}  # fmt: skip
    return bf16, fp8


def bench_gemm(name: str, kind: str, M: int, N: int, K: int, E: int | None, offs, device: str, timer) -> dict:
    """One GEMM of the layer on every path. M rows (tokens, or routed rows), weight [(E,) N, K]."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, dy, w = _operands(M, N, K, E, device, dtype)
    w8 = fq.quantize_weight(w)
    tri = "triton" if use_triton(x) else "torch"  # CPU: the interpreter, or the reference without it
    gemm_m, gemm_n, gemm_k = {"forward": (M, N, K), "input_grad": (M, K, N), "weight_grad": (N, K, M)}[kind]
    cublas = (
        E is None
        and cublas_available(x.device)
        and cublas_supports(
            gemm_m, gemm_n, gemm_k, wgrad=kind == "weight_grad", grouped=False, out_dtype=torch.bfloat16
        )
    )
    flops = 2.0 * gemm_m * gemm_n * gemm_k
    bf16, fp8 = _paths(kind, x, dy, w, offs, w8, tri, cublas)
    row = {"gemm": name, "kind": kind, "M": gemm_m, "N": gemm_n, "K": gemm_k, "experts": E}
    ms = timer(bf16)
    row["bf16"] = {"ms": ms, "tflops": flops / ms / 1e9}
    outs = {}
    for path, (gemm, with_quant) in fp8.items():
        try:
            outs[path] = gemm()
        except (RuntimeError, ValueError, NotImplementedError) as e:  # torch refused: that is the finding
            row[path] = {"refused": f"{type(e).__name__}: {str(e)[:400]}"}
            continue
        t, tq = timer(gemm), timer(with_quant)
        row[path if path != "torch" else "torch_reference"] = {
            "ms": t, "tflops": flops / t / 1e9, "ratio_to_bf16": ms / t,
            "with_quant_ms": tq, "with_quant_tflops": flops / tq / 1e9, "with_quant_ratio_to_bf16": ms / tq,
        }  # fmt: skip
    ratios = [
        r["with_quant_ratio_to_bf16"] for r in row.values() if isinstance(r, dict) and "with_quant_ms" in r
    ]
    row["best_fp8_with_quant_ratio_to_bf16"] = max(ratios, default=None)
    if "cublas" in outs:
        row["rel_diff_cublas_triton"] = _rel(outs["cublas"], outs[tri])
    elif E is None and "cublas" not in row:
        row["cublas"] = {"not_run": "cuBLAS block-scaled FP8 unavailable here or this shape unsupported"}
    return row


def probe_grouped(name: str, M: int, N: int, K: int, E: int, offs, timer) -> dict:
    """torch's grouped FP8 GEMM with block scales (forward) beside the Triton one, or why it is refused."""
    x, _, w = _operands(M, N, K, E, "cuda", torch.bfloat16)
    w8, q = fq.quantize_weight(w), fq.quantize_act(x)
    want = fg.fp8_gemm_nt(q, w8.data, w8.scale, offs, backend="triton")
    flops = 2.0 * M * N * K
    probe = _probe_scaled_grouped_mm(q, w8, offs)
    for res in probe.values():
        if "call" in res:
            call = res.pop("call")
            t = timer(call)
            res.update(ms=t, tflops=flops / t / 1e9, rel_diff_to_triton=_rel(call(), want))
    return {"gemm": name, "kind": "forward", "M": M, "N": N, "K": K, "experts": E, "scaled_grouped_mm": probe}


def _gemms_of(spec: dict, tokens: int):
    """(name, M rows, N, K, experts or None) of every GEMM-owning weight of a layer."""
    for name, (N, K) in spec["dense"].items():
        yield name, tokens, N, K, None
    H, inter = spec["hidden"], spec["moe_intermediate"]
    for name, (N, K) in {"experts_up": (2 * inter, H), "experts_down": (H, inter)}.items():
        yield name, tokens * spec["top_k"], N, K, spec["experts"]


def run(families: dict, tokens: int, device: str, save=lambda rows, probes: None) -> tuple[list, list]:
    """The table's rows and the scaled_grouped_mm probes; ``save(rows, probes)`` after each row (a
    later crash keeps them). The probes run last: a call torch accepts but gets wrong could take
    the CUDA context down with it."""
    timer = _timer(device)
    rows, probes = [], []
    for fam, spec in families.items():
        offs = _routed_offs(tokens, spec["experts"], spec["top_k"], device)
        for name, M, N, K, E in _gemms_of(spec, tokens):
            for kind in ("forward", "input_grad", "weight_grad"):
                rows.append(
                    {"family": fam, **bench_gemm(name, kind, M, N, K, E, offs if E else None, device, timer)}
                )
                _say(rows[-1])
                save(rows, probes)
        if device == "cuda":
            torch.cuda.empty_cache()
    for fam, spec in families.items() if device == "cuda" else ():
        offs = _routed_offs(tokens, spec["experts"], spec["top_k"], device)
        for name, M, N, K, E in _gemms_of(spec, tokens):
            if E is not None:
                probes.append({"family": fam, **probe_grouped(name, M, N, K, E, offs, timer)})
                print(f"{fam} {name}: {probes[-1]['scaled_grouped_mm']}", file=sys.stderr, flush=True)
                save(rows, probes)
    return rows, probes


def _say(row: dict) -> None:
    parts = [f"{row['family']} {row['gemm']} {row['kind']} {row['M']}x{row['N']}x{row['K']}:",
             f"bf16 {row['bf16']['tflops']:.0f}"]  # fmt: skip
    for path in ("triton", "cublas", "torch_reference"):
        r = row.get(path, {})
        if "refused" in r:
            parts.append(f"{path} refused ({r['refused'][:80]})")
        if "tflops" in r:
            parts.append(
                f"{path} {r['tflops']:.0f} ({r['ratio_to_bf16']:.2f}x; +quant {r['with_quant_ratio_to_bf16']:.2f}x)"
            )
    print(" ".join(parts), file=sys.stderr, flush=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma list of {', '.join(FAMILIES)}")
    ap.add_argument("--tokens", type=int, default=TOKENS, help="tokens of the layer (8 x 4096)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        families, tokens = TINY, 128
    else:
        names = [f.strip() for f in args.families.split(",") if f.strip()]
        unknown = [f for f in names if f not in FAMILIES]
        if unknown or not names:
            ap.error(f"--families: unknown {unknown or 'none given'}; known: {', '.join(FAMILIES)}")
        families, tokens = {f: FAMILIES[f] for f in names}, args.tokens
    head = {
        "benchmark": "FP8 GEMMs of a layer: BF16 vs Triton vs cuBLAS block-scaled, with and without quantization",
        "tokens": tokens,
        "families": families,
        "cublas_available": cublas_available(torch.device(args.device)),
        "goal": "every FP8 GEMM >= 1.3x the BF16 GEMM it replaces, with its quantization counted (issue 26)",
    }

    def save(rows, probes):
        write_result(args.out, {**head, "rows": rows, "scaled_grouped_mm_probes": probes}, echo=False)

    rows, probes = run(families, tokens, args.device, save)
    result = {**head, "rows": rows, "scaled_grouped_mm_probes": probes}
    write_result(args.out, result, echo=False)
    return result


if __name__ == "__main__":
    main()
