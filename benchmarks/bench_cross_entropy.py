"""The fused LM-head cross-entropy against ``F.cross_entropy(logits.float(), ...)``, forward + backward.

    python -m benchmarks.bench_cross_entropy --out benchmarks/results/cross_entropy_h200.json  # H200
    python -m benchmarks.bench_cross_entropy --device cpu --tiny                            # CPU smoke run

Workload: [tokens, vocab] bf16 logits (Qwen3's 151936-word vocab, one 4096-token micro-batch) with
uniformly random labels. Both sides are timed the same way: loss, then ``loss.backward()`` into a leaf
(the gradient is freed between calls), and the forward alone; the median of CUDA-event times after
warmup. Before timing, the losses and the gradients of the two are compared (max abs diff, and the
loss's relative difference). ``--sweep`` also times each kernel alone for a few block sizes and warp
counts, so the module's launch constants can be checked. On CPU the fused side takes whatever path the
process allows (the torch reference, or the Triton interpreter when TRITON_INTERPRET=1 was set before
import); the numbers only prove it runs.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.common import time_ms, write_result
from fmoe.kernels import cross_entropy as ce
from fmoe.kernels._triton import use_triton

FWD_SWEEP = [(2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]
BWD_SWEEP = [(2048, 4), (4096, 4), (4096, 8), (8192, 4), (8192, 8), (8192, 16)]


def make_inputs(tokens: int, vocab: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [tokens, vocab] bf16 ~ N(0, 2^2) and labels [tokens] int64 uniform in [0, vocab)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = (torch.randn(tokens, vocab, generator=gen) * 2).to(device=device, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    return logits, labels


def loss_and_grad(fn, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.detach().requires_grad_()
    loss = fn(x, labels)
    loss.backward()
    return loss.detach(), x.grad


def peak_mib(fn, device: str) -> float | None:
    """Peak memory allocated by one ``fn()`` above what was live before it, in MiB (CUDA only)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def sweep(logits, labels, device, warmup, iters, rounds: int = 5) -> dict:
    """Each kernel alone over a few (block_v, num_warps): ms, and GB/s of logits read (+ grad written).

    The configs take turns over ``rounds`` rounds and each reports its median round, so that a clock
    or neighbour change during the sweep does not favour whichever config ran then.
    """
    nbytes = logits.numel() * logits.element_size()
    _, lse, n_valid = ce.cross_entropy_forward(logits, labels)
    grad = torch.ones((), device=device)
    cases = [
        ("forward", b, w, 1, lambda b=b, w=w: ce.cross_entropy_forward(logits, labels, block_v=b, num_warps=w))
        for b, w in FWD_SWEEP
    ] + [
        ("backward", b, w, 2, lambda b=b, w=w: ce.cross_entropy_backward(
            grad, logits, labels, lse, n_valid, block_v=b, num_warps=w))
        for b, w in BWD_SWEEP
    ]  # fmt: skip
    samples = [[] for _ in cases]
    for _ in range(rounds):
        for case, times in zip(cases, samples):
            times.append(time_ms(case[-1], warmup, iters, device))
    out = {"forward": [], "backward": [], "rounds": rounds}
    for (kernel, block, warps, passes, _), ms in zip(cases, samples):
        ms = statistics.median(ms)
        out[kernel].append(
            {"block_v": block, "num_warps": warps, "ms": ms, "GB_per_s": passes * nbytes / ms / 1e6}
        )
    out["best_forward"] = min(out["forward"], key=lambda r: r["ms"])
    out["best_backward"] = min(out["backward"], key=lambda r: r["ms"])
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tiny", action="store_true", help="[16, 1000] logits (CPU smoke run)")
    parser.add_argument("--warmup", type=int, default=None, help="default: 5 on CUDA, 1 on CPU")
    parser.add_argument("--iters", type=int, default=None, help="default: 20 on CUDA, 2 on CPU")
    parser.add_argument("--sweep", action="store_true", help="also time each kernel's launch shapes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the result JSON here")
    args = parser.parse_args(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device")
    cuda = device == "cuda"
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    iters = args.iters if args.iters is not None else (20 if cuda else 2)
    tokens, vocab = (16, 1000) if args.tiny else (args.tokens, args.vocab)
    logits, labels = make_inputs(tokens, vocab, device, args.seed)
    fused_path = use_triton(logits)

    loss, grad = loss_and_grad(ce.cross_entropy, logits, labels)
    want_loss, want_grad = loss_and_grad(ce.cross_entropy_reference, logits, labels)
    check = {
        "loss": float(loss),
        "loss_reference": float(want_loss),
        "loss_max_abs_diff": float((loss - want_loss).abs()),
        "loss_rel_diff": float((loss - want_loss).abs() / want_loss.abs()),
        "grad_max_abs_diff": float((grad.float() - want_grad.float()).abs().max()),
        "grad_max_abs_reference": float(want_grad.float().abs().max()),
        "grad_dtype": str(grad.dtype),
    }
    del grad, want_grad

    def fwd_bwd(fn):
        x = logits.detach().requires_grad_()
        fn(x, labels).backward()

    ms, mem = {}, {}
    for name, fn in (("fused", ce.cross_entropy), ("reference", ce.cross_entropy_reference)):
        ms[f"{name}_fwd_bwd"] = time_ms(lambda fn=fn: fwd_bwd(fn), warmup, iters, device)
        with torch.no_grad():
            ms[f"{name}_fwd"] = time_ms(lambda fn=fn: fn(logits, labels), warmup, iters, device)
        mem[f"{name}_fwd_bwd_peak_MiB"] = peak_mib(lambda fn=fn: fwd_bwd(fn), device)
    logit_bytes = logits.numel() * logits.element_size()
    result = {
        "benchmark": "fused cross-entropy vs F.cross_entropy(logits.float()), forward + backward",
        "shape": {"tokens": tokens, "vocab": vocab, "dtype": str(logits.dtype)},
        "backend": ("triton" if cuda else "triton-interpreter") if fused_path else "torch-reference",
        "launch": {
            "fwd_block_v": ce.FWD_BLOCK_V,
            "fwd_num_warps": ce.FWD_NUM_WARPS,
            "bwd_block_v": ce.BWD_BLOCK_V,
            "bwd_num_warps": ce.BWD_NUM_WARPS,
        },
        "warmup": warmup,
        "iters": iters,
        "check": check,
        "ms": ms,
        "speedup_fwd_bwd": ms["reference_fwd_bwd"] / ms["fused_fwd_bwd"],
        "speedup_fwd": ms["reference_fwd"] / ms["fused_fwd"],
        # the fused side reads the logits twice and writes the gradient once
        "fused_fwd_bwd_GB_per_s": 3 * logit_bytes / ms["fused_fwd_bwd"] / 1e6,
        "memory": mem,
    }
    if args.sweep and cuda and fused_path:
        result["sweep"] = sweep(logits, labels, device, warmup, iters)
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
