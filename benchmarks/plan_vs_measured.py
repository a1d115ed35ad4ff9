"""The memory plan against the measured peak of `fmoe train` on one GPU (pp = dp = cp = ep = 1).

    python -m benchmarks.plan_vs_measured --out benchmarks/results/plan_h200.json

Trains a Qwen3-MoE recipe (bf16 compute, fp32 masters) for two steps on the CUDA device and
compares ``fmoe.plan``'s planned peak of that layout with ``torch.cuda.max_memory_allocated``
(every tensor the run held at once; the CUDA context and the allocator's cached blocks are not
tensors and are in neither figure).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks.common import write_result
from fmoe import plan as memory_plan
from fmoe import recipe as R
from fmoe.hf import family
from fmoe.train import train

MODEL = dict(
    family="qwen3_moe", vocab_size=264, hidden_size=1024, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, head_dim=128, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
    intermediate_size=2048, router_aux_loss_coef=0.01,
)  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (its peak is not measured)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp())
    recipe = R.from_dict({
        "model": MODEL,
        "data": {"path": str(folder / "data"), "build_from": "builtin", "builtin_bytes": 2_000_000,
                 "seq_len": args.seq},
        "train": {"steps": 2, "global_batch": 2 * args.microbatches, "microbatches": args.microbatches,
                  "device": args.device, "dtype": "bfloat16"},
        "optim": {"lr": 1e-4, "min_lr": 1e-5, "warmup": 1},
        "checkpoint": {"dir": str(folder / "ckpt"), "every": 100, "keep": 1},
        "log": {"dir": str(folder / "log"), "every": 1, "progress": False},
    })  # fmt: skip
    fam = family(recipe.model_family)
    model = fam.build(recipe.model)
    planned = memory_plan.plan_layout(
        recipe, model, fam.param_shapes(recipe.model), (1, 1, 1, 1), device=args.device
    )
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    train(recipe)
    measured = torch.cuda.max_memory_allocated() if args.device == "cuda" else 1  # CPU: smoke run
    terms = planned.stage_terms[0]
    out = {
        "benchmark": "fmoe plan vs the measured peak of fmoe train, one GPU, pp=dp=cp=ep=1",
        "shape": {**MODEL, "seq": args.seq, "microbatches": args.microbatches, "sequences_per_microbatch": 2},
        "planned_bytes": planned.peak,
        "planned_terms": {k: getattr(terms, k) for k in memory_plan.TERMS},
        "measured_bytes": measured,
        "planned_over_measured": planned.peak / measured,
    }
    print(f"planned {planned.peak / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB, "
          f"ratio {planned.peak / measured:.3f}")  # fmt: skip
    write_result(args.out, out)
    return out


if __name__ == "__main__":
    main()
