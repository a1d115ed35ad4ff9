"""Training throughput of a Qwen3-30B-A3B-shaped MoE on one GPU: fmoe against a plain eager baseline.

    python -m benchmarks.train_throughput --layers 4 --out benchmarks/results/throughput_h200.json
    python -m benchmarks.train_throughput --device cpu --tiny        # CPU smoke run (tests use it)
    python -m benchmarks.train_throughput --recipe recipes/deepseek_v3_16b_a3b.toml --layers 4 \
        --sides fmoe_graphs,fmoe_fp8_graphs                          # another recipe's model, fmoe sides

Both sides train the same model (hidden 2048, 32/4 heads of 128, 128 experts, top-8,
moe_intermediate 768, vocab 151936, sequence 4096, micro-batch 1, bf16 compute, fp32 master weights,
fused AdamW) for --steps steps after --warmup steps:
  fmoe:  the model's stage functions, F/B/W derived by fmoe.stage, fmoe.optim's fused AdamW;
  eager: an ordinary nn.Module with autograd, written as a user would (SDPA, torch._grouped_mm,
         argsort permutation, parameters in bf16, torch.optim.AdamW(fused=True) on them) - so its
         optimizer moves half the bytes of fmoe's fp32-master step;
  fmoe_fp8: fmoe with FP8 GEMMs for the attention projections and experts (--sides to pick), their
         inputs kept for W in FP8 (memory.fp8_cache; the experts' only at --merge-window 1, see
         fmoe.memory_policy; fmoe_fp8_nocache keeps them in bf16).
Every fmoe side runs under the memory policy of --recompute, --recompute-roles and --merge-window
(``fmoe.memory_policy``; default: none, all roles, the whole step), except the fmoe_recompute_* and
fmoe_window1 sides, which set their own, so one call measures the policies side by side:
    python -m benchmarks.train_throughput --microbatches 8 --sides fmoe,fmoe_recompute_full,fmoe_recompute_selective,fmoe_window1
--fp8-tiles NT,WGRAD runs the FP8 GEMMs on other tiles than fp8_gemm's defaults (configs of
benchmarks/bench_fp8_grouped.py), to time a step with them against the defaults in another call.
Model FLOPs per token = 6 x active parameters (attention projections, top-k experts' SwiGLU, router,
LM head) + causal attention's score and value GEMMs (fwd + bwd = 3 x fwd, halved by the mask);
model TFLOP/s = FLOPs per step / step time; MFU against 989 TFLOP/s dense bf16.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import pathlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks import bench_stages
from benchmarks.common import time_ms, write_result
from fmoe import optim, runner
from fmoe.memory_policy import MemoryPolicy
from fmoe.stages import qwen3_moe

PEAK_TFLOPS = 989.0
# the Qwen3-30B-A3B shapes of the stage benchmark, with as many layers as --layers asks
SHAPE = {k: v for k, v in bench_stages.QWEN3_30B_A3B_LAYER.items() if k != "num_hidden_layers"}
TINY = {k: v for k, v in bench_stages.TINY.items() if k != "num_hidden_layers"}


# ------------------------------------------------------------------------------------------------
# the eager baseline


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class EagerMoELayer(nn.Module):
    def __init__(self, cfg: qwen3_moe.Qwen3MoeConfig):
        super().__init__()
        H, d, E, I = cfg.hidden_size, cfg.head_size, cfg.num_experts, cfg.moe_intermediate_size
        self.cfg = cfg
        self.norm1, self.norm2 = RMSNorm(H, cfg.rms_norm_eps), RMSNorm(H, cfg.rms_norm_eps)
        self.q = nn.Linear(H, cfg.num_attention_heads * d, bias=False)
        self.k = nn.Linear(H, cfg.num_key_value_heads * d, bias=False)
        self.v = nn.Linear(H, cfg.num_key_value_heads * d, bias=False)
        self.o = nn.Linear(cfg.num_attention_heads * d, H, bias=False)
        self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        self.gate = nn.Linear(H, E, bias=False)
        self.gate_up = nn.Parameter(torch.randn(E, H, 2 * I) * 0.02)
        self.down = nn.Parameter(torch.randn(E, I, H) * 0.02)

    def forward(self, h, cos, sin):
        cfg, (b, s, H) = self.cfg, h.shape
        x = self.norm1(h)
        q = self.q_norm(self.q(x).view(b, s, -1, cfg.head_size)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, s, -1, cfg.head_size)).transpose(1, 2)
        v = self.v(x).view(b, s, -1, cfg.head_size).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = h + self.o(a.transpose(1, 2).reshape(b, s, -1))
        x = self.norm2(h).view(-1, H)
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        w, ids = probs.topk(cfg.num_experts_per_tok, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        order = ids.view(-1).argsort(stable=True)
        offs = torch.bincount(ids.view(-1), minlength=cfg.num_experts).cumsum(0).to(torch.int32)
        xp = x[order // cfg.num_experts_per_tok]
        if xp.is_cuda:
            gu = torch._grouped_mm(xp, self.gate_up, offs=offs)
            gate, up = gu.chunk(2, dim=-1)
            yp = torch._grouped_mm(F.silu(gate) * up, self.down, offs=offs)
        else:  # CPU smoke runs: the same math as a loop
            yp = _expert_loop(xp, self.gate_up, self.down, offs)
        y = torch.empty_like(yp).index_copy_(0, order, yp).view(-1, cfg.num_experts_per_tok, H)
        return h + (y * w.unsqueeze(-1)).sum(1).view(b, s, H)


def _expert_loop(xp, gate_up, down, offs):
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        gate, up = (xp[start:end] @ gate_up[e]).chunk(2, dim=-1)
        out.append((F.silu(gate) * up) @ down[e])
        start = end
    return torch.cat(out)


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class EagerModel(nn.Module):
    def __init__(self, cfg: qwen3_moe.Qwen3MoeConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(EagerMoELayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens, labels):
        from fmoe.stages.layers import rotary_cos_sin

        h = self.embed(tokens)
        cos, sin = rotary_cos_sin(torch.arange(tokens.shape[1], device=tokens.device), self.cfg.head_size,
                                  self.cfg.rope_theta, h.dtype)  # fmt: skip
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def eager_step_fn(cfg, device, dtype):
    """The baseline as a user writes it: the module in the compute dtype, fused AdamW on it."""
    model = EagerModel(cfg).to(device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")

    def step(tokens, labels, micro_batch: int = 1):
        chunks = tokens.shape[0] // micro_batch
        for i in range(0, tokens.shape[0], micro_batch):  # gradient accumulation over micro-batches
            (model(tokens[i : i + micro_batch], labels[i : i + micro_batch]) / chunks).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


# ------------------------------------------------------------------------------------------------
# fmoe


def fmoe_fp8_step_fn(cfg, device, dtype, memory: MemoryPolicy | None = None, family=qwen3_moe.FAMILY):
    """fmoe with its FP8 GEMMs (attention projections and experts; router and head stay bf16)."""
    return fmoe_step_fn(cfg, device, dtype, fp8=True, memory=memory, family=family)


# fmoe with one of its speed-ups taken out (or, last, FP8 for the expert GEMMs alone), to measure
# each side by side with the others on
FMOE_VARIANTS = {
    "fmoe_unfused": {"fused_blocks": False},  # RMSNorm, SwiGLU, MoE output sum, cross-entropy
    "fmoe_unmerged": {"merge_expert_grads": False},  # expert weight GEMMs once per microbatch + add
    "fmoe_fp32_grads": {"fp32_grads": True},  # fp32 copy of every gradient before the optimizer
    "fmoe_fp8_experts": {"fp8": True, "fp8_dense": False},  # FP8 expert GEMMs, bf16 projections
    # the step and its optimizer update captured once as a CUDA graph and replayed (train.cuda_graphs)
    "fmoe_graphs": {"cuda_graphs": True},
    "fmoe_fp8_graphs": {"fp8": True, "cuda_graphs": True},
    "fmoe_fp8_experts_graphs": {"fp8": True, "fp8_dense": False, "cuda_graphs": True},
    # FP8 with every weight cast to bf16 first, the experts' too (before fp8_mode.quantized_from_master)
    "fmoe_fp8_castall_graphs": {"fp8": True, "fp8_masters": False, "cuda_graphs": True},
    # FP8 forward and input-gradient GEMMs everywhere, the projections' weight gradients in bf16
    "fmoe_fp8_bf16w_graphs": {"fp8": True, "fp8_dense_wgrad": False, "cuda_graphs": True},
    # ... and the experts' weight gradients in bf16 (FP8 forward and input gradient for them too)
    "fmoe_fp8_bf16ew_graphs": {"fp8": True, "fp8_expert_wgrad": False, "cuda_graphs": True},
    # every weight gradient in bf16: FP8 for the forward and input-gradient GEMMs alone
    "fmoe_fp8_bf16allw_graphs": {
        "fp8": True,
        "fp8_dense_wgrad": False,
        "fp8_expert_wgrad": False,
        "cuda_graphs": True,
    },
    # memory policies (issue 25): each stage's F re-run before its B; the norms' and SwiGLU outputs
    # recomputed; each micro-batch's expert weight GEMMs right after its B (no merging over the step)
    "fmoe_recompute_full": {"memory": MemoryPolicy(recompute="full")},
    "fmoe_recompute_selective": {"memory": MemoryPolicy(recompute="selective")},
    "fmoe_window1": {"memory": MemoryPolicy(merge_window=1)},
    # the same under CUDA graphs (what a run with train.cuda_graphs and a [memory] section does)
    "fmoe_graphs_recompute_full": {"cuda_graphs": True, "memory": MemoryPolicy(recompute="full")},
    "fmoe_graphs_recompute_selective": {"cuda_graphs": True, "memory": MemoryPolicy(recompute="selective")},
    "fmoe_graphs_window1": {"cuda_graphs": True, "memory": MemoryPolicy(merge_window=1)},
    "fmoe_offload": {"memory": MemoryPolicy(offload=True)},
    # merge windows between one micro-batch and the whole step, and recomputation with a window of
    # one (what the shipped 30B recipes run: the expert W operands no longer outlive their micro-batch)
    "fmoe_graphs_window2": {"cuda_graphs": True, "memory": MemoryPolicy(merge_window=2)},
    "fmoe_graphs_window4": {"cuda_graphs": True, "memory": MemoryPolicy(merge_window=4)},
    "fmoe_graphs_full_window1": {
        "cuda_graphs": True,
        "memory": MemoryPolicy(merge_window=1, recompute="full"),
    },
    "fmoe_graphs_selective_window1": {
        "cuda_graphs": True,
        "memory": MemoryPolicy(merge_window=1, recompute="selective"),
    },
    "fmoe_offload_window1": {"memory": MemoryPolicy(merge_window=1, offload=True)},
    # FP8 input caching (memory.fp8_cache, on by default): off, and with experts too (window 1)
    "fmoe_fp8_nocache": {"fp8": True, "memory": MemoryPolicy(fp8_cache=False)},
    "fmoe_fp8_window1": {"fp8": True, "memory": MemoryPolicy(merge_window=1)},
    # ... under CUDA graphs: what Qwen3-30B-A3B's auto memory policy runs on one 8-GPU node, in FP8
    "fmoe_fp8_graphs_window1": {"fp8": True, "cuda_graphs": True, "memory": MemoryPolicy(merge_window=1)},
}


CATEGORIES = (  # kernel-name patterns -> share of the step, first match wins
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    ("router/softmax/topk", ("softmax", "topk", "bitonic", "radix")),
    ("permutation", ("sort", "index", "gather", "scatter", "histogram", "bincount", "_expert")),
    ("fp8 quantization", ("quant", "_tile_map")),
    ("fp8 GEMMs", ("_nt_kernel", "_wgrad_kernel", "qqtst")),  # Triton's; cuBLAS block-scaled (nvjet qq)
    ("expert GEMMs (bf16 grouped)", ("groupproblem", "grouped")),
    ("other GEMMs (head, projections)", ("gemm", "xmma", "cutlass", "_mm_", "matmul", "sm90", "nvjet")),
    ("elementwise/norm/other", ("",)),
)


def profile_step(step, tokens, labels, steps: int = 2, top_kernels: int = 40) -> dict:
    """Share of step time per kind of kernel, the GPU's idle share and the kernels that take the
    most time, from torch.profiler."""
    import time as _time

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = _time.perf_counter()
        for _ in range(steps):
            step(tokens, labels)
        torch.cuda.synchronize()
        wall_us = (_time.perf_counter() - t0) * 1e6
    by_cat: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
        if us <= 0 or ev.key.startswith("ProfilerStep"):
            continue
        name = ev.key.lower()
        cat = next(c for c, pats in CATEGORIES if any(p in name for p in pats))
        by_cat[cat] = by_cat.get(cat, 0.0) + us
    busy = sum(by_cat.values())
    shares = {k: v / wall_us for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])}
    shares["idle (GPU waiting on the host)"] = max(0.0, 1.0 - busy / wall_us)
    kernels = sorted(
        ((ev.key, getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0), ev.count)
         for ev in prof.key_averages() if not ev.key.startswith("ProfilerStep")),
        key=lambda kv: -kv[1],
    )  # fmt: skip
    top = [
        {"kernel": k[:120], "ms_per_step": us / 1e3 / steps, "calls_per_step": n / steps}
        for k, us, n in kernels[:top_kernels]
        if us > 0
    ]
    return {"wall_ms_per_step": wall_us / 1e3 / steps, "share": shares, "top_kernels": top}


def op_profile_step(step, tokens, labels, top: int = 25) -> dict:
    """The torch ops (by name and input shapes) whose own kernels take the most device time in one
    step (CPU: host time), from torch.profiler with record_shapes: where a graphed side's kernels
    cannot name the op that launched them, an eager side's step can (e.g. the embedding's
    [vocab, hidden] gradient filled and added each micro-batch)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = tokens.is_cuda
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities, record_shapes=True) as prof:
        step(tokens, labels)
        if cuda:
            torch.cuda.synchronize()
    rows = [
        (
            ev.key,
            str(ev.input_shapes),
            ev.count,
            ev.self_device_time_total if cuda else ev.self_cpu_time_total,
        )
        for ev in prof.key_averages(group_by_input_shape=True)
        if ev.key.startswith("aten::")
    ]
    rows.sort(key=lambda r: -r[3])
    return {
        "time": "device" if cuda else "host",
        "top_ops": [
            {"op": op, "input_shapes": shapes[:200], "calls": n, "ms": us / 1e3}
            for op, shapes, n, us in rows[:top]
            if us > 0
        ],
    }


def host_profile_step(step, tokens, labels, top: int = 30) -> dict:
    """Where the host's time goes in one step (cProfile): the functions with the most own time.
    A step whose GPU idles is bound by these."""
    import cProfile
    import pstats
    import time as _time

    prof = cProfile.Profile()
    t0 = _time.perf_counter()
    prof.runcall(step, tokens, labels)
    if tokens.is_cuda:
        torch.cuda.synchronize()
    wall_ms = (_time.perf_counter() - t0) * 1e3
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, own s, cum s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    funcs = [
        {
            "function": f"{pathlib.Path(f).name}:{line}({name})",
            "calls": n,
            "own_ms": own * 1e3,
            "cum_ms": cum * 1e3,
        }
        for (f, line, name), (_, n, own, cum, _) in rows
    ]
    return {"wall_ms": wall_ms, "top_own_time": funcs}


def fmoe_step_fn(
    cfg,
    device,
    dtype,
    *,
    fp8: bool = False,
    fused_blocks: bool = True,
    merge_expert_grads: bool = True,
    fp32_grads: bool = False,
    fp8_dense: bool = True,
    fp8_dense_wgrad: bool = True,
    fp8_expert_wgrad: bool = True,
    fp8_masters: bool = True,
    cuda_graphs: bool = False,
    memory: MemoryPolicy | None = None,
    family=qwen3_moe.FAMILY,
):
    from fmoe.cuda_graphs import GraphedStep
    from fmoe.stages import layers
    from fmoe.stages.fp8_mode import quantized_from_master
    from fmoe.stages.primitives import fp8_training

    model = family.build(cfg)
    params = model.init(seed=0, dtype=torch.float32, device=device)
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-4, 0.9, 0.95, 1e-8, 0.1))
    state = {"opt": tx.init(params), "params": params}
    # as fmoe train on one process: an FP8 step reads its expert weights' fp32 masters (no bf16 copy)
    shapes = {n: tuple(t.shape) for n, t in params.items()}
    masters = quantized_from_master(shapes, model.expert_params) if fp8 and fp8_masters else frozenset()

    def pure_step(p, opt, tokens, labels, micro_batch: int):
        compute = (
            p if dtype == torch.float32 else {n: t if n in masters else t.to(dtype) for n, t in p.items()}
        )
        unfused = contextlib.nullcontext() if fused_blocks else _blocks_unfused(layers)
        microbatches, policy = tokens.shape[0] // micro_batch, memory or MemoryPolicy()
        fp8_mode = fp8_training(  # with the policy's FP8 input caching, as fmoe train
            fp8, dense=fp8_dense, dense_wgrad=fp8_dense_wgrad, expert_wgrad=fp8_expert_wgrad,
            cache_inputs=policy.fp8_cache,
            cache_expert_inputs=policy.fp8_cache_experts(1, microbatches),
        )  # fmt: skip
        with fp8_mode, unfused:
            out = runner.run_sequential(
                model,
                compute,
                {"tokens": tokens, "labels": labels},
                microbatches,
                merge_expert_grads=merge_expert_grads,
                memory=memory,
            )
        del compute
        # the optimizer reads the bf16 gradients as they are (its kernel widens them to fp32)
        grads = {n: g.float() for n, g in out.grads.items()} if fp32_grads else out.grads
        return optim.step(tx, grads, opt, p)

    run = GraphedStep(pure_step) if cuda_graphs and device == "cuda" else pure_step  # CPU: eager

    def step(tokens, labels, micro_batch: int = 1):
        state["params"], state["opt"] = run(state["params"], state["opt"], tokens, labels, micro_batch)

    return step


@contextlib.contextmanager
def _blocks_unfused(layers):
    fused = layers._fused
    layers._fused = lambda t: False
    try:
        yield
    finally:
        layers._fused = fused


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument(
        "--micro-batch",
        type=int,
        default=1,
        help="sequences per micro-batch (a step takes microbatches x micro-batch sequences)",
    )
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument(
        "--recipe",
        default=None,
        help="the model of this recipe, cut to --layers (fmoe sides only; e.g. recipes/deepseek_v3_16b_a3b.toml)",
    )
    ap.add_argument(
        "--sides",
        default="eager,fmoe",
        help="comma list of: eager, fmoe, fmoe_fp8, " + ", ".join(FMOE_VARIANTS),
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="CUDA: time shares of each side's step by kernel kind, and its top kernels",
    )
    ap.add_argument(
        "--top-kernels", type=int, default=40, help="with --profile: how many of the longest kernels to list"
    )
    ap.add_argument(
        "--op-profile",
        action="store_true",
        help="one step of each side: the torch ops, with their input shapes, that take the most time "
        "(name eager sides: a graphed step's ops are not seen)",
    )
    ap.add_argument("--op-profile-top", type=int, default=25, help="with --op-profile: how many ops to list")
    ap.add_argument(
        "--host-profile",
        action="store_true",
        help="cProfile one step of each side: the host functions that take the most time",
    )
    ap.add_argument(
        "--recompute", default="none", help="the fmoe sides' recomputation: none, full, selective"
    )
    ap.add_argument(
        "--recompute-roles", default="", help="comma list of stage roles it applies to (default: all)"
    )
    ap.add_argument(
        "--merge-window", type=int, default=0, help="expert W merged over this many micro-batches (0: all)"
    )
    ap.add_argument(
        "--fp8-tiles",
        default=None,
        help="NT,WGRAD: the FP8 GEMMs' tiles, configs of benchmarks/bench_fp8_grouped.py (e.g. 2x4,2x4_pf); "
        "default: fp8_gemm's DEFAULT_CONFIG, WGRAD_CONFIG",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for flag, n in (("--top-kernels", args.top_kernels), ("--op-profile-top", args.op_profile_top)):
        if n < 1:
            ap.error(f"{flag}: expected a count >= 1, got {n}")
    tiles = _fp8_tiles(args.fp8_tiles, ap)
    try:
        roles = tuple(r.strip() for r in args.recompute_roles.split(",") if r.strip())
        policy = MemoryPolicy(args.merge_window, args.recompute, roles)
    except ValueError as e:
        ap.error(str(e).replace("MemoryPolicy.", "--").replace("_", "-"))
    family = qwen3_moe.FAMILY
    if args.recipe is not None:  # another family's real shapes (the eager side is Qwen3's module)
        from fmoe import recipe as R

        chosen = R.load_model(args.recipe)
        family = R.model_family(chosen.model_family)
        cfg = dataclasses.replace(chosen.model, num_hidden_layers=args.layers)
        if "eager" in args.sides.split(","):
            ap.error("--sides: eager is a Qwen3 module; with --recipe, fmoe sides only")
    else:
        cfg = qwen3_moe.Qwen3MoeConfig(num_hidden_layers=args.layers, **(TINY if args.tiny else SHAPE))
    seq = 32 if args.tiny else args.seq
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    if args.micro_batch < 1 or args.microbatches < 1:
        ap.error(
            f"--microbatches and --micro-batch: must be >= 1, got {args.microbatches}, {args.micro_batch}"
        )
    m = args.microbatches * args.micro_batch  # sequences per step
    tokens = torch.randint(0, cfg.vocab_size, (m, seq), generator=gen).to(args.device)
    labels = torch.randint(0, cfg.vocab_size, (m, seq), generator=gen).to(args.device)
    flops = m * seq * family.train_flops_per_token(cfg, seq)
    sides = [side.strip() for side in args.sides.split(",") if side.strip()]
    known = ["eager", "fmoe", "fmoe_fp8", *FMOE_VARIANTS]
    unknown = [side for side in sides if side not in known]
    if unknown or not sides:
        ap.error(f"--sides: unknown {unknown or 'none given'}; known: {', '.join(known)}")
    shape = {
        "layers": args.layers,
        "seq": seq,
        "micro_batch": args.micro_batch,
        "microbatches_per_step": args.microbatches,
        "dtype": str(dtype),
        "memory": dataclasses.asdict(policy),  # of the fmoe sides that do not set their own
        **({"fp8_tiles": args.fp8_tiles} if tiles else {}),
        **(
            {"recipe": args.recipe, **dataclasses.asdict(cfg)}
            if args.recipe
            else TINY
            if args.tiny
            else SHAPE
        ),
    }

    def record(results: dict, pending: list[str]) -> dict:
        eager = results.get("eager")
        ratios = {
            f"{k}_over_eager": eager["step_ms"] / v["step_ms"]
            for k, v in results.items()
            if eager and k != "eager"
        }
        out = {
            "benchmark": "train throughput, Qwen3-30B-A3B-shaped MoE, one GPU",
            "shape": shape,
            "flops_per_step": flops,
            "results": {**results, **ratios},
            "goal": ">= 450 model TFLOP/s bf16, >= 600 fp8, >= 1.3x eager",
        }
        return {**out, "sides_not_run": pending} if pending else out

    results = {}
    with _fp8_tiles_in_use(tiles):
        for i, side in enumerate(sides):
            if side in FMOE_VARIANTS:
                step = fmoe_step_fn(
                    cfg, args.device, dtype, family=family, **{"memory": policy, **FMOE_VARIANTS[side]}
                )
            elif side == "eager":
                step = eager_step_fn(cfg, args.device, dtype)
            else:
                make = {"fmoe": fmoe_step_fn, "fmoe_fp8": fmoe_fp8_step_fn}[side]
                step = make(cfg, args.device, dtype, memory=policy, family=family)
            step = functools.partial(step, micro_batch=args.micro_batch)
            ms = time_ms(
                lambda step=step: step(tokens, labels),
                warmup=args.warmup,
                iters=args.steps,
                device=args.device,
            )
            tflops = flops / (ms / 1e3) / 1e12
            results[side] = {"step_ms": ms, "tokens_per_s": m * seq / (ms / 1e3), "model_tflops": tflops,
                             "mfu": tflops / PEAK_TFLOPS}  # fmt: skip
            print(f"{side}: {ms:.1f} ms/step, {tflops:.1f} model TFLOP/s", file=sys.stderr, flush=True)
            if args.profile and args.device == "cuda":
                results[side]["profile"] = profile_step(step, tokens, labels, top_kernels=args.top_kernels)
            if args.op_profile:
                results[side]["op_profile"] = op_profile_step(step, tokens, labels, top=args.op_profile_top)
            if args.host_profile:
                results[side]["host_profile"] = host_profile_step(step, tokens, labels)
            if args.device == "cuda":
                results[side]["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            del step
            if i + 1 < len(sides):  # what is measured so far survives a run killed in a later side
                write_result(args.out, record(results, sides[i + 1 :]), echo=False)
    final = record(results, [])
    write_result(args.out, final)
    return final


def _fp8_tiles(names: str | None, ap: argparse.ArgumentParser):
    """--fp8-tiles "NT,WGRAD" -> (nt GemmConfig, wgrad GemmConfig), or None (the defaults)."""
    if names is None:
        return None
    from benchmarks.bench_fp8_grouped import CONFIGS

    parts = [n.strip() for n in names.split(",")]
    unknown = [n for n in parts if n not in CONFIGS]
    if len(parts) != 2 or unknown:
        ap.error(f"--fp8-tiles: expected NT,WGRAD of {', '.join(CONFIGS)}; got {names!r}")
    return CONFIGS[parts[0]], CONFIGS[parts[1]]


@contextlib.contextmanager
def _fp8_tiles_in_use(tiles):
    """fp8_gemm's default tiles replaced by ``tiles`` for the block (restored after)."""
    from fmoe.kernels import fp8_gemm

    saved = fp8_gemm.DEFAULT_CONFIG, fp8_gemm.WGRAD_CONFIG
    if tiles is not None:
        fp8_gemm.DEFAULT_CONFIG, fp8_gemm.WGRAD_CONFIG = tiles
    try:
        yield
    finally:
        fp8_gemm.DEFAULT_CONFIG, fp8_gemm.WGRAD_CONFIG = saved


if __name__ == "__main__":
    main()
