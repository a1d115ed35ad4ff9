"""F, B and W of each stage of one Qwen3-30B-A3B-shaped MoE layer, beside plain autograd.

    python -m benchmarks.bench_stages --out benchmarks/results/stages_h200.json      # H200 shapes
    python -m benchmarks.bench_stages --device cpu --tiny                           # CPU smoke run

For each stage: F = ``fmoe.stage.forward``, B = ``backward_input``, W = ``backward_weight``; the
reference is the same stage function run forward then ``torch.autograd.backward`` over its inputs and
parameters. The layer rows sum the five stages; "ratio" = (F + B + W) / autograd forward+backward.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import time_ms, write_result
from fmoe import runner
from fmoe import stage as S
from fmoe.stages import qwen3_moe
from fmoe.stages.spec import StageContext

QWEN3_30B_A3B_LAYER = dict(
    vocab_size=151936,
    hidden_size=2048,
    num_hidden_layers=1,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    intermediate_size=6144,
    router_aux_loss_coef=0.001,
)
TINY = dict(QWEN3_30B_A3B_LAYER, vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64)  # fmt: skip


def layer_inputs(model, params, seq: int, device: str, dtype):
    """Each layer stage's inputs, from one forward of the embedding and the layer."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (1, seq), generator=gen).to(device)
    batch = runner.with_positions({"tokens": tokens, "labels": tokens})
    carry, cases = (), []
    for stage in model.stages[:-1]:
        inputs = runner.stage_inputs(stage, carry, batch)
        if stage.name != "embed":
            cases.append((stage, inputs))
        carry, _ = runner.split_outputs(stage, S.call(stage, params, inputs, StageContext()))
    return cases


def grad_outputs_for(stage, outputs):
    carried = outputs[: len(outputs) - len(stage.losses)]
    return [torch.randn_like(o) if o.is_floating_point() else None for o in carried]


def bench_stage(stage, params, inputs, device, iters):
    ctx = StageContext()
    outputs, _ = S.forward(stage, params, inputs, ctx)
    grads_out = grad_outputs_for(stage, outputs)
    state = {}

    def run_f():
        state["fwd"] = S.forward(stage, params, inputs, ctx)[1]

    def run_b():
        state["work"] = S.backward_input(state["fwd"], grads_out)[1]

    def run_w():
        S.backward_weight(state["work"])

    samples = {"F": [], "B": [], "W": []}
    for i in range(iters + 2):  # the first two rounds warm up
        for name, fn in (("F", run_f), ("B", run_b), ("W", run_w)):
            ms = time_ms(fn, warmup=0, iters=1, device=device)
            if i >= 2:
                samples[name].append(ms)
    timings = {name: sorted(v)[len(v) // 2] for name, v in samples.items()}

    def run_fbw():
        run_f()
        run_b()
        run_w()

    # F, B and W back to back in one timed region, as autograd's forward+backward is timed
    timings["FBW"] = time_ms(run_fbw, warmup=2, iters=iters, device=device)

    leaf_params = {n: params[n].detach().requires_grad_() for n in stage.params}

    def run_autograd():
        x = [t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs]
        out = S.call(stage, leaf_params, x, ctx)
        carried = len(out) - len(stage.losses)
        tensors = [o for o, g in zip(out, grads_out) if g is not None and o.requires_grad]
        grads = [g for o, g in zip(out, grads_out) if g is not None and o.requires_grad]
        tensors += [w * out[carried + i] for i, w in enumerate(stage.losses)]
        grads += [torch.ones_like(out[carried + i]) for i in range(len(stage.losses))]
        if tensors:
            torch.autograd.backward(tensors, grads)
        for p in leaf_params.values():
            p.grad = None

    timings["autograd"] = time_ms(run_autograd, warmup=2, iters=iters, device=device)
    return timings


def bench_layer(cases, params, device, iters) -> dict:
    """The whole layer in one timed region: F of all five stages, B last to first, then W;
    against autograd forward through the five stage functions and one backward."""
    stages = [s for s, _ in cases]
    first_inputs = cases[0][1]
    batch_fields = {"positions": first_inputs[1]}
    ctx = StageContext()
    h0 = first_inputs[0]
    g_out = torch.randn_like(h0)

    def ours():
        carry, fwds = (h0,), []
        for stage in stages:
            outputs, fwd = S.forward(stage, params, runner.stage_inputs(stage, carry, batch_fields), ctx)
            carry, _ = runner.split_outputs(stage, outputs)
            fwds.append(fwd)
        grad, works = (g_out,), []
        for fwd in reversed(fwds):
            grad_in, work = S.backward_input(fwd, grad)
            grad = grad_in[: len(grad_in) - len(fwd.stage.batch_inputs)]
            works.append(work)
        for work in works:
            S.backward_weight(work)

    leaves = {n: params[n].detach().requires_grad_() for s in stages for n in s.params}

    def plain():
        h = h0.detach().requires_grad_()
        carry, terms = (h,), []
        for stage in stages:
            outputs = S.call(stage, leaves, runner.stage_inputs(stage, carry, batch_fields), ctx)
            carry, t = runner.split_outputs(stage, outputs)
            terms += t
        torch.autograd.backward([carry[0], *terms], [g_out, *[torch.ones_like(t) for t in terms]])
        for p in leaves.values():
            p.grad = None

    t_ours = time_ms(ours, warmup=2, iters=iters, device=device)
    t_plain = time_ms(plain, warmup=2, iters=iters, device=device)
    return {"layer_FBW": t_ours, "layer_autograd": t_plain, "ratio": t_ours / t_plain}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="a tiny layer (CPU smoke run)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    cfg = qwen3_moe.Qwen3MoeConfig(**(TINY if args.tiny else QWEN3_30B_A3B_LAYER))
    seq = 32 if args.tiny else args.seq
    model = qwen3_moe.build(cfg)
    params = {n: t.to(args.device) for n, t in model.init(seed=0, dtype=dtype).items()}
    rows = {}
    with torch.no_grad():
        cases = layer_inputs(model, params, seq, args.device, dtype)
    for stage, inputs in cases:
        rows[stage.name.split(".")[-1]] = bench_stage(stage, params, inputs, args.device, args.iters)
    layer = {k: sum(r[k] for r in rows.values()) for k in ("F", "B", "W", "FBW", "autograd")}
    layer["ratio_sum_of_stages"] = layer["FBW"] / layer["autograd"]
    layer.update(bench_layer(cases, params, args.device, args.iters))
    result = {
        "benchmark": "stage F/B/W vs autograd, one Qwen3-30B-A3B-shaped MoE layer",
        "shape": {
            "seq": seq,
            "micro_batch": 1,
            "dtype": str(dtype),
            **(TINY if args.tiny else QWEN3_30B_A3B_LAYER),
        },
        "ms_per_stage": rows,
        "layer_ms": layer,
        "goal": "F+B+W <= 1.05 x autograd forward+backward",
    }
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
