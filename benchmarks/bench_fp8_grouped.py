"""The expert-grouped FP8 GEMM's tile configs at one micro-batch's routed rows, against BF16 (issue 26).

    python -m benchmarks.bench_fp8_grouped --out benchmarks/results/fp8_grouped_sweep.json \
        [--configs base,128w8flat,...] [--families qwen3_30b_a3b,deepseek_v3_16b]

For each family and each config: the forward and input-gradient grouped GEMMs of the up and down
projections (``fp8_gemm_nt`` with expert offsets) over one micro-batch's routed rows (4096 tokens x
top-k, multinomial routing: uneven, unaligned groups), checked against the reference on dequantized
inputs (rel. error <= 2^-8: the output's BF16 rounding), and the weight gradients of a step's eight
micro-batches merged (``fp8_gemm_wgrad``, the default merge), each timed beside ``torch._grouped_mm`` in
BF16 on the same rows (medians of ``triton.testing.do_bench``, L2 flushed). Quantization is not
counted here: this is the GEMM alone. The warp-specialized configs may hang Triton 3.6, so run them
in a process of their own under ``timeout``; results are saved after each config. ``pf*``: the scales
prefetched one K-block ahead (``GemmConfig.prefetch_scales``), with group_m 8 (the default), 4, 16.

Measured on an H100 (results/issue26_grouped_sweep_h100.json): the tiles then shipped (``2x4``: 64x128,
two programs per SM) were the fastest of those for every GEMM. A lagged promotion (issue block k+1's
dot before scaling block k's, commit e2779d0) was slower everywhere, warp specialization slower or
hung; so it was removed. On an H200 (results/issue26_prefetch_h200.json) the prefetch sped up the
weight gradient and slowed the forward under Triton 3.6, and the other way round under Triton 3.9:
``fp8_gemm.PREFETCH_SCALES_BY_TRITON`` takes each kernel's faster one. Three programs per SM with
their registers capped (``base`` now, ``fp8_gemm.BASE_CONFIG``) beat ``2x4`` on both families under
Triton 3.6 and on Qwen3 (the one measured) under Triton 3.9, on two H100s
(results/issue26_regcap_h100.json); uncapped (``s3x3``) only two are resident.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import time
from pathlib import Path

import torch

from fmoe.kernels import fp8_gemm as fg
from fmoe.kernels import fp8_quant as fq

CONFIGS = {
    "base": fg.BASE_CONFIG,  # 64x128, 3 stages, 3 programs per SM, registers capped at 168
    "pf": dataclasses.replace(fg.BASE_CONFIG, prefetch_scales=True),
    "pf_g4": dataclasses.replace(fg.BASE_CONFIG, prefetch_scales=True, group_m=4),
    "pf_g16": dataclasses.replace(fg.BASE_CONFIG, prefetch_scales=True, group_m=16),
    # the base tiles until 2026-12-06: two programs per SM of 4 stages, registers uncapped (176 / 182)
    "2x4": fg.GemmConfig(64, 128, num_warps=4, num_stages=4, flatten=True, programs_per_sm=2),
    "2x4_pf": fg.GemmConfig(
        64, 128, num_warps=4, num_stages=4, flatten=True, programs_per_sm=2, prefetch_scales=True
    ),
    # three programs per SM, uncapped: only two are resident, the third runs in a second wave
    "s3x3": fg.GemmConfig(64, 128, num_warps=4, num_stages=3, flatten=True, programs_per_sm=3),
    "r168s2x3": fg.GemmConfig(
        64, 128, num_warps=4, num_stages=2, flatten=True, programs_per_sm=3, max_registers=168
    ),
    # narrower tiles, more of them resident: 64x64 takes ~112 registers and 48 KiB (3 stages)
    "n64s3x4": fg.GemmConfig(64, 64, num_warps=4, num_stages=3, flatten=True, programs_per_sm=4),
    "n64s4x3": fg.GemmConfig(64, 64, num_warps=4, num_stages=4, flatten=True, programs_per_sm=3),
    "128w8flat_pf": fg.GemmConfig(128, 128, num_warps=8, num_stages=4, flatten=True, prefetch_scales=True),
    "128w8flat": fg.GemmConfig(128, 128, num_warps=8, num_stages=4, flatten=True),
    "128w8s3x2": fg.GemmConfig(128, 128, num_warps=8, num_stages=3, flatten=True, programs_per_sm=2),
    "ws128w4": fg.GemmConfig(128, 128, num_warps=4, num_stages=4, warp_specialize=True),
    "ws128w8": fg.GemmConfig(128, 128, num_warps=8, num_stages=4, warp_specialize=True),
    "ws64w4x2": fg.GemmConfig(64, 128, num_warps=4, num_stages=4, warp_specialize=True, programs_per_sm=2),
}
FAMILIES = {  # experts, top-k, hidden, expert intermediate; 4096 tokens a micro-batch
    "qwen3_30b_a3b": (128, 8, 2048, 768),
    "deepseek_v3_16b": (64, 6, 2048, 1408),
}
TOKENS = 4096
MICROBATCHES = 8  # merged into one weight-gradient GEMM per step
# the outputs are the FP32 products rounded to bf16 (unit roundoff 2^-9, to nearest); 2^-8 in
# relative norm leaves a factor 2 for the FP32 summation-order difference from the reference
BF16_REL = 2.0**-8


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error in norm, in float64."""
    return float((got.double() - want.double()).norm() / want.double().norm())


def routed_counts(experts: int, rows: int, generator: torch.Generator) -> torch.Tensor:
    """[experts] int64 rows of each expert when ``rows`` routing slots pick experts uniformly at random
    (uneven, unaligned groups, as a router's are)."""
    draws = torch.multinomial(torch.ones(experts), rows, True, generator=generator)
    return torch.bincount(draws, minlength=experts)


# ragged experts, empty ones and the K the families use, against which other kernels are checked
# before they are timed (bench_cutlass_fp8, bench_deepgemm_fp8): (name, rows of each expert, N, K)
NT_CHECKS = (
    ("nt_k768", [0, 1, 127, 128, 129, 0, 300, 7], 256, 768),
    ("nt_k1408", [5, 0, 64, 65, 200, 0, 0, 1], 384, 1408),
    ("nt_k2048", [0, 0, 0, 513, 2, 3, 0, 70], 1536, 2048),
)
# (name, rows of each expert, M, N) of dW[e] = dy_e^T x_e
WGRAD_CHECKS = (
    ("wgrad_ragged", [0, 1, 127, 128, 129, 0, 300, 700], 256, 384),
    ("wgrad_ragged2", [64, 0, 0, 1000, 5, 0, 2, 129], 2048, 768),
)


def nt_case(counts: list[int], n: int, k: int, seed: int):
    """Ragged expert rows and their weights for ``y = x @ w[e]^T``: (offs [E] int32, x [rows, k] bf16,
    w [E, n, k] bf16, quantize_act(x), quantize_weight(w)), on the GPU, from ``seed``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    offs = torch.cumsum(torch.as_tensor(counts), 0).to(torch.int32).cuda()
    x = torch.randn(int(offs[-1]), k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(len(counts), n, k, device="cuda", generator=g) * 0.02).bfloat16()
    return offs, x, w, fq.quantize_act(x), fq.quantize_weight(w)


def wgrad_case(counts: list[int], m: int, n: int, seed: int):
    """Ragged expert rows for ``dW[e] = dy_e^T x_e``: (offs, dy [rows, m] bf16, x [rows, n] bf16, and
    both quantized along tokens, quantize_act_t), on the GPU, from ``seed``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    offs = torch.cumsum(torch.as_tensor(counts), 0).to(torch.int32).cuda()
    rows = int(offs[-1])
    dy = torch.randn(rows, m, device="cuda", generator=g).bfloat16()
    x = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    return offs, dy, x, fq.quantize_act_t(dy, offs), fq.quantize_act_t(x, offs)


def expert_gemms(hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    """(N, K) of the SwiGLU experts' four NT GEMMs (y = x @ w^T) of one micro-batch: gate/up and down,
    forward and input gradient."""
    return {
        "up_fwd": (2 * inter, hidden),
        "up_dgrad": (hidden, 2 * inter),
        "down_fwd": (hidden, inter),
        "down_dgrad": (inter, hidden),
    }


def _gemms(experts: int, top_k: int, hidden: int, inter: int) -> dict:
    """name -> (offs, a: Fp8Act, b fp8 [E, N, K], b_scale, bf16 a, bf16 b [E, K, N] view)."""
    rows = TOKENS * top_k
    counts = routed_counts(experts, rows, torch.Generator().manual_seed(0))
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    out = {}
    for name, (n, k) in expert_gemms(hidden, inter).items():
        x = torch.randn(rows, k, device="cuda").bfloat16()
        w = (torch.randn(experts, n, k, device="cuda") * 0.02).bfloat16()
        w8 = fq.quantize_weight(w)
        out[name] = (offs, fq.quantize_act(x), w8.data, w8.scale, x, w.transpose(-2, -1), 2.0 * rows * n * k)
    return out


def _wgrads(experts: int, top_k: int, hidden: int, inter: int) -> dict:
    """name -> (dy^T: Fp8ActT, x^T: Fp8ActT, bf16 dy^T [N, rows], bf16 x [rows, K], offs, flop): the
    weight gradients of a step's MICROBATCHES micro-batches merged into one grouped GEMM each."""
    counts = routed_counts(experts, TOKENS * top_k * MICROBATCHES, torch.Generator().manual_seed(1))
    counts = (counts + 15) // 16 * 16  # torch._grouped_mm's reduced groups: 16-element aligned sizes
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    rows = int(counts.sum())
    out = {}
    for name, (n, k) in {"up_wgrad": (2 * inter, hidden), "down_wgrad": (hidden, inter)}.items():
        x = torch.randn(rows, k, device="cuda").bfloat16()
        dy = torch.randn(rows, n, device="cuda").bfloat16()
        out[name] = (fq.quantize_act_t(dy, offs), fq.quantize_act_t(x, offs), dy.t().contiguous(), x, offs,
                     2.0 * rows * n * k)  # fmt: skip
    return out


def run(configs: list[str], families: list[str], path: Path | None) -> dict:
    result = json.loads(path.read_text()) if path and path.exists() else {}
    result["environment"] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    for fam in families:
        r = result.setdefault(fam, {})
        gemms, wgrads = _gemms(*FAMILIES[fam]), _wgrads(*FAMILIES[fam])
        if "bf16" not in r:
            r["bf16"] = {
                n: ms(lambda g=g: torch._grouped_mm(g[4], g[5], offs=g[0])) for n, g in gemms.items()
            }
            for n, w in wgrads.items():
                r["bf16"][n] = ms(lambda w=w: torch._grouped_mm(w[2], w[3], offs=w[4]))
        for name in configs:
            cfg = CONFIGS[name]
            log(f"{fam} {name}: first launch")
            row = {"config": repr(cfg)}
            for n, g in gemms.items():
                got = fg.fp8_gemm_nt(g[1], g[2], g[3], g[0], config=cfg)
                want = fg.fp8_gemm_nt_reference(g[1], g[2], g[3], g[0], out_dtype=torch.float32)
                err = rel(got, want)
                t = ms(lambda g=g, cfg=cfg: fg.fp8_gemm_nt(g[1], g[2], g[3], g[0], config=cfg))
                row[n] = {"ms": t, "tflops": g[6] / t / 1e9, "x_bf16": r["bf16"][n] / t, "rel_err": err}
            for n, (dyt, xt, _, _, _, flop) in wgrads.items():
                got = fg.fp8_gemm_wgrad(dyt, xt, grouped=True, config=cfg)
                want = fg.fp8_gemm_wgrad_reference(dyt, xt, out_dtype=torch.float32)
                err = rel(got, want)
                t = ms(lambda dyt=dyt, xt=xt, cfg=cfg: fg.fp8_gemm_wgrad(dyt, xt, grouped=True, config=cfg))
                row[n] = {"ms": t, "tflops": flop / t / 1e9, "x_bf16": r["bf16"][n] / t, "rel_err": err}
            row["all4_x_bf16"] = sum(r["bf16"][n] for n in gemms) / sum(row[n]["ms"] for n in gemms)
            row["wgrads_x_bf16"] = sum(r["bf16"][n] for n in wgrads) / sum(row[n]["ms"] for n in wgrads)
            row["ok"] = all(row[n]["rel_err"] <= BF16_REL for n in [*gemms, *wgrads])
            r[name] = row
            log(f"{fam} {name}: " + " ".join(f"{n} {row[n]['tflops']:.0f}TF {row[n]['x_bf16']:.2f}x" for n in [*gemms, *wgrads])
                + f" | fwd+dgrad {row['all4_x_bf16']:.3f}x wgrad {row['wgrads_x_bf16']:.3f}x ok={row['ok']}")  # fmt: skip
            if path:
                path.write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--configs", default=",".join(k for k in CONFIGS if not k.startswith("ws")))
    p.add_argument("--families", default=",".join(FAMILIES))
    args = p.parse_args()
    configs, families = args.configs.split(","), args.families.split(",")
    bad = sorted(set(configs) - set(CONFIGS)) + sorted(set(families) - set(FAMILIES))
    if bad:
        p.exit(2, f"bench_fp8_grouped.py: --configs/--families: unknown {bad}\n")
    if not torch.cuda.is_available():
        p.exit(2, "bench_fp8_grouped.py: needs a CUDA GPU\n")
    run(configs, families, args.out)


if __name__ == "__main__":
    main()
