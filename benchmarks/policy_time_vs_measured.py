"""The memory policies' modelled time cost (``fmoe.plan_time``) against their measured cost per layer.

    python -m benchmarks.policy_time_vs_measured --out benchmarks/results/policy_time_vs_measured_h200.json

Reads the per-layer tables ``benchmarks.train_throughput`` wrote at 4 and 8 layers in one device
call (pairs of JSON files: ``--pair L4.json L8.json``, one or more), takes each policy's measured
milliseconds per layer ((8-layer step - 4-layer step) / 4) beside the same call's policy-free side
(``--base``: fmoe with CUDA graphs, or fmoe eager for the eager policy sides), and prints the
model's prediction of the same shape (Qwen3-30B-A3B layers, the tables' micro-batches, one rank)
beside it. Runs on the CPU: the plan is torch-free arithmetic over recorded figures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import write_result
from benchmarks.train_throughput import FMOE_VARIANTS, SHAPE
from fmoe.memory_policy import MemoryPolicy
from fmoe.plan_activations import MicroBatch
from fmoe.plan_time import H200_RATES, policy_time
from fmoe.stages import qwen3_moe


def per_layer_ms(l4: dict, l8: dict, side: str) -> float | None:
    if side not in l4["results"] or side not in l8["results"]:
        return None
    return (l8["results"][side]["step_ms"] - l4["results"][side]["step_ms"]) / 4


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", nargs=2, action="append", required=True, metavar=("L4_JSON", "L8_JSON"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for p4, p8 in args.pair:
        l4, l8 = (json.loads(Path(p).read_text()) for p in (p4, p8))
        shape = l4["shape"]
        cfg = qwen3_moe.Qwen3MoeConfig(num_hidden_layers=8, **SHAPE)
        model = qwen3_moe.build(cfg)
        mb = MicroBatch(shape["micro_batch"], shape["seq"], shape["seq"], 2, "cuda")
        n = shape["microbatches_per_step"]
        for side, variant in FMOE_VARIANTS.items():
            policy = variant.get("memory")
            if policy is None or per_layer_ms(l4, l8, side) is None:
                continue
            base_side = "fmoe_graphs" if variant.get("cuda_graphs") else "fmoe"
            base_ms = per_layer_ms(l4, l8, base_side)
            if base_ms is None:
                continue
            measured = per_layer_ms(l4, l8, side) / base_ms - 1
            cost = policy_time("qwen3_moe", cfg, model, mb, n, 1, 1, policy, H200_RATES)
            none = policy_time("qwen3_moe", cfg, model, mb, n, 1, 1, MemoryPolicy(), H200_RATES)
            rows.append({
                "side": side, "policy": str(policy), "files": [p4, p8],
                "measured_ms_per_layer": per_layer_ms(l4, l8, side), "base_ms_per_layer": base_ms,
                "measured_extra": measured, "modelled_extra": cost.fraction,
                "modelled_base_ms_per_layer": 1e3 * none.base_s * n / cfg.num_hidden_layers,
            })  # fmt: skip
            print(f"{side:34s} measured {100 * measured:+6.1f}%  modelled {100 * cost.fraction:+6.1f}%")
    out = {"benchmark": "memory policies: modelled extra time per layer vs measured", "rates": str(H200_RATES),
           "rows": rows}  # fmt: skip
    write_result(args.out, out, echo=False)
    return out


if __name__ == "__main__":
    main()
