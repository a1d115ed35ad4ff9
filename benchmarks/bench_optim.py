"""Optimizer step time: fmoe.optim vs torch.optim.AdamW (fused, foreach) vs torchopt, side by side.

    python benchmarks/bench_optim.py --out benchmarks/results/optim_h200.json

On CUDA the default is 64 fp32 tensors of 4096 x 4096 = 1,073,741,824 parameters (~17 GB for
params + grads + two moments per optimizer; cases run one after another and free their memory).
Without CUDA (or with --device cpu) the default is 8 x 65,536 so that a test can run it quickly.
Each case is timed over --iters steps after --warmup steps, --repeats times; CUDA cases with CUDA
events, CPU cases with perf_counter. The JSON holds the device, versions, date, median and min ms
per step of every case and each case's ratio to torch.optim.AdamW(fused=True).

bf16 gradients (what a bf16 model's backward gives, fp32 master params): ``fmoe_clip_adamw_bf16_step``
is ``chain(clip_by_global_norm, adamw)`` through ``optim.step`` on the bf16 grads as they are (the
clip factor folded into fmoe's AdamW kernel); ``fmoe_clip_adamw_bf16_old_route`` the same step the
old way: an fp32 copy of every grad, the clip's ``_foreach_mul_`` pass, then ``torch._fused_adamw_``.
Both build the same parameter set (same seeds); ``ratio_bf16_fused_vs_old_route`` compares them.
On an H200 (torch 2.11, Triton 3.6): 7.96 vs 15.77 ms for the default 1.07B params, 23.1 vs 46.6 ms
for 96 x 2**25 = 3.2B (``--tensors 96 --numel 33554432``).

The ``torchopt_*`` cases compare with torchopt's AdamW where torchopt is installed
(``pip install torchopt``); it is not a dependency of fmoe, and without it they are listed under
``skipped`` with the reason.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fmoe import optim

LR, BETAS, EPS, WD, MAX_NORM = 1e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


def _tensors(n: int, numel: int, device: str, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (numel // 4096, 4096) if numel % 4096 == 0 else (numel,)
    return [torch.randn(shape, device=device, generator=g) for _ in range(n)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn: Callable[[], None], device: str, iters: int, warmup: int, repeats: int) -> list[float]:
    """ms per call of fn, one figure per repeat."""
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t0) * 1e3 / iters)
    return out


# Every case builder returns a zero-argument step function; its tensors live in the closure and are
# freed when the function is dropped.


def _torch_adamw(n, numel, device, **kw):
    params = [p.requires_grad_(True) for p in _tensors(n, numel, device, 0)]
    for p, g in zip(params, _tensors(n, numel, device, 1)):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
    return opt.step


def _torch_clip_adamw_fused(n, numel, device):
    params = [p.requires_grad_(True) for p in _tensors(n, numel, device, 0)]
    for p, g in zip(params, _tensors(n, numel, device, 1)):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)

    def run():
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        opt.step()

    return run


def _fmoe(tx_fn, route="step"):
    def build(n, numel, device):
        params = {f"layers.{i}.w": p for i, p in enumerate(_tensors(n, numel, device, 0))}
        grads = dict(zip(params, _tensors(n, numel, device, 1)))
        tx = tx_fn()
        box = [params, tx.init(params)]

        def run():
            if route == "step":
                box[0], box[1] = optim.step(tx, grads, box[1], box[0])
            else:
                updates, box[1] = tx.update(grads, box[1], box[0])
                box[0] = optim.apply_updates(box[0], updates)

        return run

    return build


def _fmoe_clip_adamw_bf16(route: str):
    """chain(clip, adamw) on bf16 grads: "fused" hands them to optim.step as they are; "old" makes
    the fp32 copy, scales it with the clip's update (``_foreach_mul_``) and runs torch's fused AdamW."""

    def build(n, numel, device):
        params = {f"layers.{i}.w": p for i, p in enumerate(_tensors(n, numel, device, 0))}
        grads = {name: g.bfloat16() for name, g in zip(params, _tensors(n, numel, device, 1))}
        clip, adam = optim.clip_by_global_norm(MAX_NORM), optim.adamw(_schedule(), *BETAS, EPS, WD)
        tx = optim.chain(clip, adam)
        box = [params, tx.init(params)]

        def run():
            if route == "fused":
                box[0], box[1] = optim.step(tx, grads, box[1], box[0])
            else:
                g32, box[1] = clip.update({k: g.float() for k, g in grads.items()}, box[1], box[0])
                box[0], box[1] = optim.step(adam, g32, box[1], box[0])

        return run

    return build


def _torchopt(accelerated: bool):
    def build(n, numel, device):
        try:
            import torchopt
        except ImportError:
            raise RuntimeError(
                "torchopt is not installed (an optional comparison: pip install torchopt)"
            ) from None

        params = tuple(_tensors(n, numel, device, 0))
        grads = tuple(_tensors(n, numel, device, 1))
        tx = torchopt.adamw(LR, betas=BETAS, eps=EPS, weight_decay=WD, use_accelerated_op=accelerated)
        box = [params, tx.init(params)]

        def run():
            updates, box[1] = tx.update(grads, box[1], params=box[0], inplace=True)
            box[0] = torchopt.apply_updates(box[0], updates, inplace=True)

        return run

    return build


def _schedule():
    return optim.warmup_cosine(LR, warmup=100, total=10_000, final=LR / 10)


CASES: dict[str, Callable] = {
    "torch_adamw_fused": lambda n, numel, d: _torch_adamw(n, numel, d, fused=True),
    "torch_adamw_foreach": lambda n, numel, d: _torch_adamw(n, numel, d, foreach=True),
    "fmoe_adamw_step": _fmoe(lambda: optim.adamw(LR, *BETAS, EPS, WD)),
    "fmoe_adamw_step_schedule": _fmoe(lambda: optim.adamw(_schedule(), *BETAS, EPS, WD)),
    "torch_clip_adamw_fused": _torch_clip_adamw_fused,
    "fmoe_clip_adamw_step": _fmoe(
        lambda: optim.chain(optim.clip_by_global_norm(MAX_NORM), optim.adamw(_schedule(), *BETAS, EPS, WD))
    ),
    "fmoe_clip_adamw_bf16_step": _fmoe_clip_adamw_bf16("fused"),
    "fmoe_clip_adamw_bf16_old_route": _fmoe_clip_adamw_bf16("old"),
    "fmoe_adamw_update_apply": _fmoe(lambda: optim.adamw(LR, *BETAS, EPS, WD), route="update"),
    "torchopt_adamw": _torchopt(accelerated=False),
    "torchopt_adamw_accelerated": _torchopt(accelerated=True),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--tensors", type=int, default=None, help="number of parameter tensors")
    ap.add_argument("--numel", type=int, default=None, help="elements per tensor")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of: " + ",".join(CASES))
    args = ap.parse_args(argv)

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    big = device == "cuda"
    n = args.tensors or (64 if big else 8)
    numel = args.numel or (4096 * 4096 if big else 65536)
    iters = args.iters or (20 if big else 5)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        print(f"error: unknown case(s) {unknown}; known: {list(CASES)}", file=sys.stderr)
        return 2

    ms: dict[str, float] = {}
    ms_min: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for name in cases:
        try:
            run = CASES[name](n, numel, device)
            times = _time(run, device, iters, args.warmup, args.repeats)
        except Exception as e:  # e.g. torchopt missing or its accelerated op not built for this device
            skipped[name] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            print(f"{name:28s} skipped: {skipped[name]}", file=sys.stderr)
        else:
            ms[name], ms_min[name] = statistics.median(times), min(times)
            print(f"{name:28s} {ms[name]:9.3f} ms/step (min {ms_min[name]:.3f})", file=sys.stderr)
        run = None
        if device == "cuda":
            torch.cuda.empty_cache()

    base = ms.get("torch_adamw_fused")
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    result = {
        "benchmark": "optim_step",
        "device": device,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "params": n * numel,
        "tensors": n,
        "numel": numel,
        "dtype": "float32",  # params, moments and grads; the *_bf16_* cases take bf16 grads
        "iters": iters,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "hyper": {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD, "max_norm": MAX_NORM},
        "ms_per_step": ms,
        "ms_per_step_min": ms_min,
        "ratio_vs_torch_fused": {k: v / base for k, v in ms.items()} if base else {},
        "ratio_clip_vs_torch_clip_fused": (
            ms["fmoe_clip_adamw_step"] / ms["torch_clip_adamw_fused"]
            if {"fmoe_clip_adamw_step", "torch_clip_adamw_fused"} <= ms.keys()
            else None
        ),
        "ratio_bf16_fused_vs_old_route": (
            ms["fmoe_clip_adamw_bf16_step"] / ms["fmoe_clip_adamw_bf16_old_route"]
            if {"fmoe_clip_adamw_bf16_step", "fmoe_clip_adamw_bf16_old_route"} <= ms.keys()
            else None
        ),
        "skipped": skipped,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
