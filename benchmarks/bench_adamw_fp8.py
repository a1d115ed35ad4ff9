"""AdamW over one layer's expert masters, and the FP8 copies of them the next step reads, side by side:

- ``adamw``: the step alone (``fmoe.kernels.adamw.adamw_``);
- ``adamw_then_quantize``: the step, then ``quantize_weight`` of each master (what an FP8 step paid
  before the optimizer kept the copies: the quantization read the fp32 masters once more);
- ``adamw_fp8``: the fused step that writes the copies in its own pass (``adamw_fp8_``).

    python -m benchmarks.bench_adamw_fp8 --out benchmarks/results/adamw_fp8_h100.json

Default shapes: a Qwen3-30B-A3B layer's experts, gate_up [128, 1536, 2048] and down [128, 2048, 768]
(604M fp32 masters, bf16 gradients, clip factor folded in). Without CUDA (or --tiny) two small
weights, so that a test runs it. The copies of the fused step are checked bit for bit against the
step-then-quantize side's before timing. ms are medians of CUDA-event timings (perf_counter on CPU).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import environment, time_ms
from fmoe.kernels import adamw
from fmoe.kernels.fp8_quant import empty_weight, quantize_weight

QWEN3_LAYER = [(128, 1536, 2048), (128, 2048, 768)]
TINY = [(2, 256, 128), (2, 128, 128)]
HYPER = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _tensors(shapes, device):
    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for s in shapes:
        p = torch.randn(s, device=device, generator=g)
        grad = torch.randn(s, device=device, generator=g).bfloat16()
        out.append((p, grad, torch.zeros_like(p), torch.zeros_like(p), empty_weight(s, device)))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--configs",
        default="",
        help="comma list of ROWSxWARPS for the fused kernel to time besides the default",
    )
    args = ap.parse_args(argv)
    device = args.device
    shapes = TINY if args.tiny or device == "cpu" else QWEN3_LAYER
    tensors = _tensors(shapes, device)
    ps, gs, ms, vs, copies = (list(x) for x in zip(*tensors))
    step, lr, scale = (torch.tensor(v, device=device) for v in (1.0, 1e-4, 0.5))
    kw = dict(step=step, lr=lr, grad_scale=scale, **HYPER)

    def plain():
        adamw.adamw_(ps, gs, ms, vs, **kw)

    def then_quantize():
        adamw.adamw_(ps, gs, ms, vs, **kw)
        for p, c in zip(ps, copies):
            quantize_weight(p, out=c)

    def fused():
        adamw.adamw_fp8_(ps, gs, ms, vs, copies, **kw)

    # the fused step's copies and params are those of the step then the quantization, bit for bit
    before = [(p.clone(), m.clone(), v.clone()) for p, m, v in zip(ps, ms, vs)]
    then_quantize()
    expect = [(p.clone(), quantize_weight(p)) for p in ps]
    for (p0, m0, v0), p, m, v in zip(before, ps, ms, vs):
        p.copy_(p0), m.copy_(m0), v.copy_(v0)
    fused()
    for (p_ref, q_ref), p, c in zip(expect, ps, copies):
        same = torch.equal(p, p_ref) and all(
            torch.equal(getattr(c, f).view(torch.uint8), getattr(q_ref, f).view(torch.uint8))
            for f in ("data", "data_t")
        )
        same = same and torch.equal(c.scale, q_ref.scale) and torch.equal(c.scale_t, q_ref.scale_t)
        if not same:
            raise SystemExit(
                "bench_adamw_fp8: the fused step's copies differ from adamw_ then quantize_weight"
            )

    ms_of = {
        name: time_ms(fn, warmup=2, iters=args.iters, device=device)
        for name, fn in (("adamw", plain), ("adamw_then_quantize", then_quantize), ("adamw_fp8", fused))
    }
    default = (adamw.FP8_ROWS, adamw.FP8_WARPS)
    configs = {}
    for config in filter(None, args.configs.split(",")):  # the fused kernel's slices and warps
        adamw.FP8_ROWS, adamw.FP8_WARPS = (int(x) for x in config.split("x"))
        try:
            configs[config] = time_ms(fused, warmup=2, iters=args.iters, device=device)
        finally:
            adamw.FP8_ROWS, adamw.FP8_WARPS = default
    numel = sum(p.numel() for p in ps)
    result = {
        "benchmark": "AdamW over one layer's expert masters with their FP8 copies (benchmarks/bench_adamw_fp8.py)",
        "environment": environment(),
        "shapes": [list(s) for s in shapes],
        "params": numel,
        "ms": ms_of,
        "adamw_fp8_config": f"{default[0]}x{default[1]}",
        "adamw_fp8_ms_by_config": configs,
        "copies_bitwise_step_then_quantize": True,
        "saved_ms": ms_of["adamw_then_quantize"] - ms_of["adamw_fp8"],
        "fused_over_step_then_quantize": ms_of["adamw_then_quantize"] / ms_of["adamw_fp8"],
        # bytes a step moves: p, m, v read and written (fp32), g read (bf16); the copies written
        "adamw_gb_per_s": numel * 26 / ms_of["adamw"] / 1e6,
        "adamw_fp8_gb_per_s": numel * 28 / ms_of["adamw_fp8"] / 1e6,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
