"""One rank of the shipped Qwen3-30B-A3B layout (pp = dp = cp = 1, ep = 8) as a one-process proxy on
one GPU: the memory plan against the measured peak of `fmoe train`, and its tokens/s.

    python -m benchmarks.proxy_run --out benchmarks/results/proxy_qwen3_30b_a3b_h200.json

The proxy is recipes/qwen3_30b_a3b.toml with its 128 experts cut to the 16 an ep = 8 rank holds.
The routed rows of a rank are what it computes and saves for its experts: under ep = 8 a rank
receives its micro-batch's 4096 tokens x top-8 = 32,768 rows on average (all ranks send to all), so
the proxy keeps top_k = 8 of its 16 experts (top_k = 1 would route 4,096 rows: an eighth of the
work and of the expert activations). What the proxy cannot show is the communication (no
all-to-all, no gathers: one process) and the sharding of the non-expert parameters (one process
holds all of them, where a rank of the 8 holds an eighth): so its plan is the proxy's own
one-process plan, printed beside the plan of the real layout's rank. Checkpoints are not saved
(an 83 GB state would take minutes to write and is not what is measured here). The memory policy
is the one the real layout's rank runs: the recipe's, or where the recipe leaves it to "auto", what
the plan picks for that rank on a device of ``--device-memory`` GiB (``fmoe.plan_policy.choose``),
set explicitly so the proxy runs it whatever its own plan would pick.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import environment, write_result
from fmoe import plan as memory_plan
from fmoe import plan_policy, plan_text
from fmoe import recipe as R
from fmoe.hf import family
from fmoe.memory_policy import MemoryPolicy
from fmoe.train_state import Checkpointer

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "qwen3_30b_a3b.toml"
EP = 8  # the shipped layout's expert-parallel size


def proxy_recipe(
    folder: Path, steps: int, microbatches: int, device: str, layers: int | None, memory: MemoryPolicy
) -> R.Recipe:
    """The shipped recipe as one ep = 8 rank: 16 experts, top-8, micro-batches of one sequence, the
    memory policy ``memory`` (explicit)."""
    real = R.read_toml(RECIPE)
    model = {**real["model"], "num_experts": real["model"]["num_experts"] // EP}
    if layers is not None:
        model["num_hidden_layers"] = layers
    return R.from_dict({
        "memory": {k: v for k, v in dataclasses.asdict(memory).items() if k != "policy"},
        "optim": {**real["optim"], "warmup": min(real["optim"]["warmup"], steps // 4)},
        "model": model,
        "data": {"path": str(folder / "data"), "build_from": "builtin", "builtin_bytes": 4_000_000,
                 "seq_len": real["data"]["seq_len"]},
        "train": {"steps": steps, "global_batch": microbatches, "microbatches": microbatches,
                  "device": device, "dtype": "bfloat16", "seed": 0},
        "checkpoint": {"dir": str(folder / "ckpt"), "every": steps, "keep": 1, "resume": False},
        "log": {"dir": str(folder / "log"), "every": 5, "progress": False},
    })  # fmt: skip


def planned(recipe: R.Recipe, sizes: tuple[int, int, int, int], device: str) -> memory_plan.LayoutPlan:
    fam = family(recipe.model_family)
    return memory_plan.plan_layout(
        recipe, fam.build(recipe.model), fam.param_shapes(recipe.model), sizes, device=device
    )


def real_rank_choice(layers: int | None, device_gib: float) -> plan_policy.PolicyChoice:
    """The policy and plan of one rank of the shipped layout (``EP`` ranks of experts)."""
    overrides = {} if layers is None else {"model.num_hidden_layers": layers}
    real = R.from_dict(R.read_toml(RECIPE, overrides))
    fam = family(real.model_family)
    return plan_policy.choose(real, fam.build(real.model), fam.param_shapes(real.model), (1, 1, 1, EP),
                              device_gib * 2**30)  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--microbatches", type=int, default=8, help="micro-batches of one sequence per step")
    ap.add_argument("--layers", type=int, default=None, help="cut the model (a smoke run); default 48")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (its peak is not measured)")
    ap.add_argument("--device-memory", type=float, default=139.0, help="GiB per GPU of the real layout")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp())
    real = real_rank_choice(args.layers, args.device_memory)
    recipe = proxy_recipe(folder, args.steps, args.microbatches, args.device, args.layers, real.policy)
    proxy_plan = planned(recipe, (1, 1, 1, 1), args.device)
    Checkpointer.save = lambda self, *a, **k: None  # not measured here (see the module docstring)
    from fmoe.train import train

    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = train(recipe)
    wall = time.perf_counter() - start
    measured = torch.cuda.max_memory_allocated() if args.device == "cuda" else 0
    gib = 2**30
    terms = proxy_plan.stage_terms[0]
    out = {
        "benchmark": "one rank of qwen3_30b_a3b (ep = 8) as a one-process proxy: plan vs measured peak",
        "env": environment(),
        "proxy": {
            "num_experts": recipe.model.num_experts,
            "top_k": recipe.model.num_experts_per_tok,
            "layers": recipe.model.num_hidden_layers,
            "seq": recipe.data.seq_len,
            "microbatches": args.microbatches,
            "sequences_per_microbatch": 1,
            "steps": args.steps,
            "memory": plan_text.policy_text(recipe.memory),
        },  # fmt: skip
        "planned_gib": proxy_plan.peak / gib,
        "planned_terms_gib": {k: getattr(terms, k) / gib for k in memory_plan.TERMS},
        "measured_peak_gib": measured / gib,
        "measured_over_planned": measured / proxy_plan.peak,
        "real_layout_rank_planned_gib": real.plan.peak / gib,
        "real_layout_policy": plan_text.policy_text(real.policy)
        + f" (auto: {real.auto}; {real.cost.text()})",
        "tokens_per_s": result.tokens_per_second,
        "losses_first_last": [result.losses[0], result.losses[-1]],
        "wall_s": wall,
        "anchor": "NeMo AutoModel Qwen3-30B-A3B on 8 H100: 12,040 tokens/s per GPU (with communication; "
        "the proxy has none)",
    }
    print(f"planned {out['planned_gib']:.2f} GiB, measured {out['measured_peak_gib']:.2f} GiB, "
          f"{out['tokens_per_s']:.0f} tokens/s")  # fmt: skip
    write_result(args.out, out)
    return out


if __name__ == "__main__":
    main()
