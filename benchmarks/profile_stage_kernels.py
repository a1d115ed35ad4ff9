"""GPU kernel time of the attn stage of a Qwen3-30B-A3B layer: fmoe F+B+W vs plain autograd.

    python -m benchmarks.profile_stage_kernels          # CUDA only

Shows whether B + W launch the same GPU work as one backward (they do: see
benchmarks/results/stages_attn_profile_h200.json), so a wall-time gap is host overhead.
"""

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import bench_stages as BS
from fmoe import stage as S
from fmoe.stages import qwen3_moe
from fmoe.stages.spec import StageContext

cfg = qwen3_moe.Qwen3MoeConfig(**BS.QWEN3_30B_A3B_LAYER)
model = qwen3_moe.build(cfg)
params = {n: t.to("cuda") for n, t in model.init(seed=0, dtype=torch.bfloat16).items()}
with torch.no_grad():
    cases = BS.layer_inputs(model, params, 4096, "cuda", torch.bfloat16)
stage, inputs = cases[0]
ctx = StageContext()
outs, _ = S.forward(stage, params, inputs, ctx)
g = BS.grad_outputs_for(stage, outs)
leaf = {n: params[n].detach().requires_grad_() for n in stage.params}


def ours():
    o, f = S.forward(stage, params, inputs, ctx)
    _, w = S.backward_input(f, g)
    S.backward_weight(w)


def plain():
    x = [t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs]
    o = S.call(stage, leaf, x, ctx)
    ts = [a for a, b in zip(o, g) if b is not None and a.requires_grad] + [stage.losses[0] * o[-1]]
    gs = [b for a, b in zip(o, g) if b is not None and a.requires_grad] + [torch.ones_like(o[-1])]
    torch.autograd.backward(ts, gs)
    for p in leaf.values():
        p.grad = None


for name, fn in (("ours", ours), ("plain", plain)):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    cuda = sorted(
        [e for e in ka if (getattr(e, "device_time_total", 0) or 0) > 0], key=lambda e: -e.device_time_total
    )
    total = sum(e.self_device_time_total for e in ka) / 5 / 1e3
    print(f"== {name}: GPU self time per call {total:.3f} ms")
    for e in cuda[:22]:
        print(f"  {e.self_device_time_total / 5 / 1e3:8.3f} ms  n={e.count // 5:4d}  {e.key[:110]}")
