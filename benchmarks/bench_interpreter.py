"""Interpreter overhead per action, with near-zero-cost stages on CPU (goal: < 30 us).

    python benchmarks/bench_interpreter.py [--microbatches 256] [--stages 4] [--out results.json]

pp=1 (one gloo process): a long 1F1B (F, BW) and ZB-H1 (F, B, W) schedule over a model of trivial
stages. The time of the stage calls themselves (F/B/W of ``fmoe.stage``, measured by running the
same calls directly) is subtracted from the step's time; what remains, per compute row, is the
interpreter's own cost (state dicts, routing, loss bookkeeping, the final loss all-reduce amortised).
pp=2 adds the transfer rows (header + payload over gloo): reported as time per row, not subtracted,
because it is dominated by gloo's localhost latency, not by the interpreter.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from fmoe import dist as D
from fmoe import interpreter
from fmoe import stage as S
from fmoe.schedules.generators import generate
from fmoe.schedules.verify import lower
from fmoe.stages.spec import Model, Stage, StageContext


def trivial_model(num_stages: int) -> Model:
    def embed(p, inputs, ctx):
        return (p["w"] * inputs[0].float(),)

    def mid(p, inputs, ctx):
        return (inputs[0] * p["w"],)

    def head(p, inputs, ctx):
        return (inputs[0].sum(),)

    stages = [Stage("embed", embed, ("e.w",), "e.", batch_inputs=("tokens",))]
    stages += [Stage(f"layers.{i}.mlp", mid, (f"l{i}.w",), f"l{i}.") for i in range(num_stages)]
    stages.append(Stage("head", head, ("h.w",), "h.", batch_inputs=("labels",), losses=(1.0,)))
    layer_of = (-1, *range(num_stages), -1)
    names = [n for s in stages for n in s.params]
    return Model(None, tuple(stages), lambda **_: {n: torch.ones(()) for n in names}, layer_of)


def stage_calls(model: Model, params, batch, microbatches: int) -> float:
    """Seconds for the F, B and W calls of every stage of every microbatch, run directly."""
    t0 = time.perf_counter()
    for m in range(microbatches):
        ctx = StageContext(microbatch=m)
        carry, fwds = (), []
        for stage in model.stages:
            out, fwd = S.forward(stage, params, carry + tuple(batch[k] for k in stage.batch_inputs), ctx)
            carry = out[: len(out) - len(stage.losses)]
            fwds.append(fwd)
        grad: tuple = ()
        for fwd in reversed(fwds):
            n = len(fwd.outputs) - len(fwd.stage.losses)
            g, work = S.backward_input(fwd, grad or (None,) * n, 1.0 / microbatches)
            grad = g[: len(g) - len(fwd.stage.batch_inputs)]
            S.backward_weight(work)
    return time.perf_counter() - t0


def bench(rank: int, world: int, group, microbatches: int, num_stages: int, repeats: int) -> dict:
    model = trivial_model(num_stages)
    params = model.init()
    batch = {
        "tokens": torch.ones(microbatches, 4, dtype=torch.int64),
        "labels": torch.zeros(microbatches, 4, dtype=torch.int64),
    }
    out = {}
    for name in ("1f1b", "zb-h1"):
        schedule = lower(generate(name, world, microbatches))
        interpreter.run_schedule(schedule, model, params, batch, group)  # warm-up
        best = min(
            _timed(lambda s=schedule: interpreter.run_schedule(s, model, params, batch, group))
            for _ in range(repeats)
        )
        rows = len(schedule.actions[rank])
        compute = sum(a.kind in ("F", "B", "W", "BW", "FB") for a in schedule.actions[rank])
        entry = {"step_s": best, "rows": rows, "compute_rows": compute}
        if world == 1:
            calls = min(stage_calls(model, params, batch, microbatches) for _ in range(repeats))
            entry["stage_calls_s"] = calls
            entry["overhead_us_per_action"] = (best - calls) / rows * 1e6
        else:
            entry["us_per_row_including_transfers"] = best / rows * 1e6
        out[name] = entry
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, default=256)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    report = {
        "torch": torch.__version__,
        "microbatches": args.microbatches,
        "trivial_stages": args.stages + 2,
    }
    for pp in (1, 2):
        results = D.spawn(bench, pp, (args.microbatches, args.stages, args.repeats), timeout_s=600)
        for r in results:
            if not r.ok:
                raise SystemExit(f"pp={pp} rank {r.rank} failed: {r.error}\n{r.traceback}")
        report[f"pp{pp}"] = results[0].value
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
