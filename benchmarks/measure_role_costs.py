"""The rates the memory policies' time model reads (``fmoe.plan_time.Rates``), measured on this device.

    python -m benchmarks.measure_role_costs --out benchmarks/results/role_costs_h200.json   # H200
    python -m benchmarks.measure_role_costs --smoke                                         # CPU smoke run

At the Qwen3-30B-A3B shapes (hidden 2048, 32 heads x 128, 4 kv heads, 128 experts top 8, expert
width 768, one 4096-token sequence a micro-batch; ``--smoke``: a tiny layer, float32):
  dense_tflops       the attention projections q/k/v/o at 4096 tokens (FLOP-weighted)
  grouped_tflops     both expert weight-gradient GEMMs (``grouped_mm_weight_grad``: what W and a
                     merge window run) at each number of rows per expert in ``--rows``
  attention_tflops   causal SDPA forward (what a full recompute re-runs), 4 x S x S/2 x heads x d FLOPs
  elementwise_gbps   RMSNorm [4096, 2048] and SwiGLU [32768, 2 x 768] forward, bytes read + written
  host_copy_gbps     pinned host <-> device copies of 256 MiB, the slower direction
The JSON's "rates" holds the five figures in ``Rates``' fields: copy them into
``fmoe.plan_time.H200_RATES`` (by hand; say there which file they came from).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import time_ms, write_result
from fmoe.stages import layers
from fmoe.stages.primitives import grouped_mm_weight_grad

SHAPE = dict(
    hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, expert_width=768, seq=4096
)
SMOKE = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2, expert_width=32, seq=64)
ROWS = (64, 128, 256, 512, 1024, 2048, 4096)
SMOKE_ROWS = (2, 8)


def _tensor(*shape, device, dtype, gen):
    """Normal values made on the device (the timed GEMMs do not depend on them; ``gen`` seeds it)."""
    return torch.randn(*shape, generator=gen, device=device, dtype=dtype)


def dense(s: dict, device: str, dtype, iters: int, gen) -> dict:
    """TFLOP/s of the q/k/v/o projections at ``seq`` tokens, each and FLOP-weighted together."""
    t, h, q, kv = s["seq"], s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    out, flops, ms = {}, 0.0, 0.0
    for name, (n_in, n_out) in {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h)}.items():
        x, w = (
            _tensor(t, n_in, device=device, dtype=dtype, gen=gen),
            _tensor(n_out, n_in, device=device, dtype=dtype, gen=gen),
        )
        m = time_ms(lambda x=x, w=w: F.linear(x, w), iters=iters, device=device)
        f = 2 * t * n_in * n_out
        out[name] = f / m / 1e9
        flops, ms = flops + f, ms + m
    return {"per_projection_tflops": out, "tflops": flops / ms / 1e9}


def _both_wgrads(x, dy_up, a, dy_down, offs, e: int) -> None:
    """One expert layer's W: the gate/up gradient [E, 2I, H] and the down gradient [E, H, I]."""
    grouped_mm_weight_grad(x, dy_up, offs, e)
    grouped_mm_weight_grad(a, dy_down, offs, e)


def grouped(s: dict, rows_per_expert: tuple[int, ...], device: str, dtype, iters: int, gen) -> dict:
    """TFLOP/s of the gate/up and down weight-gradient GEMMs at each rows-per-expert."""
    e, h, i = s["experts"], s["hidden"], s["expert_width"]
    out = {}
    for r in rows_per_expert:
        n = e * r
        offs = torch.arange(r, n + 1, r, dtype=torch.int32, device=device)
        x, dy_up = (
            _tensor(n, h, device=device, dtype=dtype, gen=gen),
            _tensor(n, 2 * i, device=device, dtype=dtype, gen=gen),
        )
        a, dy_down = (
            _tensor(n, i, device=device, dtype=dtype, gen=gen),
            _tensor(n, h, device=device, dtype=dtype, gen=gen),
        )

        ms = time_ms(lambda: _both_wgrads(x, dy_up, a, dy_down, offs, e), iters=iters, device=device)  # noqa: B023
        out[r] = (2 * n * h * 2 * i + 2 * n * i * h) / ms / 1e9
    return out


def attention(s: dict, device: str, dtype, iters: int, gen) -> float:
    """TFLOP/s of causal SDPA forward, one sequence, the kv heads repeated to the query heads."""
    shape = (1, s["heads"], s["seq"], s["head_dim"])
    q, k, v = (_tensor(*shape, device=device, dtype=dtype, gen=gen) for _ in range(3))
    ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), iters=iters, device=device)
    flops = 4 * s["seq"] * (s["seq"] / 2) * s["heads"] * s["head_dim"]
    return flops / ms / 1e9


def elementwise(s: dict, device: str, dtype, iters: int, gen) -> dict:
    """GB/s of fmoe's RMSNorm and SwiGLU forward (the blocks selective recomputation re-runs)."""
    t, h, e = s["seq"], s["hidden"], torch.finfo(dtype).bits // 8
    x, w = _tensor(t, h, device=device, dtype=dtype, gen=gen), torch.ones(h, device=device, dtype=dtype)
    norm = 2 * t * h * e / time_ms(lambda: layers.rms_norm(x, w, 1e-6), iters=iters, device=device) / 1e6
    n, i = t * s["top_k"], s["expert_width"]
    gate_up = _tensor(n, 2 * i, device=device, dtype=dtype, gen=gen)
    swiglu = 3 * n * i * e / time_ms(lambda: layers.swiglu(gate_up), iters=iters, device=device) / 1e6
    return {"rmsnorm": norm, "swiglu": swiglu, "gbps": (norm + swiglu) / 2}


def host_copy(device: str, mib: int, iters: int) -> dict:
    """GB/s of a pinned host buffer copied to the device and back (the offload's copies)."""
    n = mib << 20
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=device == "cuda")
    d2h = n / time_ms(lambda: host.copy_(dev, non_blocking=True), iters=iters, device=device) / 1e6
    h2d = n / time_ms(lambda: dev.copy_(host, non_blocking=True), iters=iters, device=device) / 1e6
    return {"d2h": d2h, "h2d": h2d, "gbps": min(d2h, h2d)}


def _figure(x: float) -> float:
    """Four significant digits: what the rates table keeps."""
    return float(f"{x:.4g}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, float32 (CPU smoke run)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    s, rows = (SMOKE, SMOKE_ROWS) if args.smoke else (SHAPE, ROWS)
    dtype = torch.bfloat16 if args.device == "cuda" and not args.smoke else torch.float32
    iters = 1 if args.smoke else args.iters
    gen = torch.Generator(device=args.device).manual_seed(0)
    d = dense(s, args.device, dtype, iters, gen)
    g = grouped(s, rows, args.device, dtype, iters, gen)
    a = attention(s, args.device, dtype, iters, gen)
    ew = elementwise(s, args.device, dtype, iters, gen)
    copy = host_copy(args.device, 1 if args.smoke else 256, iters)
    result = {
        "benchmark": "the memory policies' time model rates (fmoe.plan_time.Rates), Qwen3-30B-A3B shapes",
        "command": "python -m benchmarks.measure_role_costs" + (" --smoke" if args.smoke else ""),
        "shape": {**s, "dtype": str(dtype)},
        "rates": {
            "dense_tflops": _figure(d["tflops"]),
            "grouped_tflops": [[r, _figure(t)] for r, t in g.items()],
            "attention_tflops": _figure(a),
            "elementwise_gbps": _figure(ew["gbps"]),
            "host_copy_gbps": _figure(copy["gbps"]),
        },
        "detail": {"dense": d, "elementwise": ew, "host_copy": copy},
    }
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
