"""F, B and W of dispatch, mlp and combine of one Qwen3-30B-A3B MoE layer at ep = 1.

    python -m benchmarks.bench_moe --out benchmarks/results/moe_h200.json     # H200: 4096 tokens, bf16
    python -m benchmarks.bench_moe --device cpu --tiny                         # CPU smoke run

hidden 2048, 128 experts, top-8, moe_intermediate 768. Each stage is timed through ``fmoe.stage``
(F = forward, B = backward_input, W = backward_weight) beside plain autograd of the same function.
``--path ep`` runs the expert-parallel code path at ep = 1 (plan, deduped copies, one host sync:
forced by a capacity factor that drops nothing) to show what it costs over the local permutation.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_stages import QWEN3_30B_A3B_LAYER, TINY, bench_stage, layer_inputs
from benchmarks.common import write_result
from fmoe.stages import qwen3_moe

MOE_STAGES = ("dispatch", "mlp", "combine")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--path", choices=("local", "ep"), default="local")
    parser.add_argument("--tiny", action="store_true", help="a tiny layer (CPU smoke run)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    shape = dict(TINY if args.tiny else QWEN3_30B_A3B_LAYER)
    if args.path == "ep":
        shape["moe_capacity_factor"] = float(shape["num_experts"])  # capacity >= every slot: drops nothing
    cfg = qwen3_moe.Qwen3MoeConfig(**shape)
    tokens = 32 if args.tiny else args.tokens
    model = qwen3_moe.build(cfg)
    params = {n: t.to(args.device) for n, t in model.init(seed=0, dtype=dtype).items()}
    with torch.no_grad():
        cases = layer_inputs(model, params, tokens, args.device, dtype)
    rows = {}
    for stage, inputs in cases:
        kind = stage.name.split(".")[-1]
        if kind in MOE_STAGES:
            rows[kind] = bench_stage(stage, params, inputs, args.device, args.iters)
    total = {k: sum(r[k] for r in rows.values()) for k in ("F", "B", "W", "FBW", "autograd")}
    result = {
        "benchmark": "dispatch + mlp + combine F/B/W, one Qwen3-30B-A3B MoE layer, ep = 1",
        "shape": {"tokens": tokens, "dtype": str(dtype), "path": args.path, **shape},
        "ms_per_stage": rows,
        "total_ms": total,
    }
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
