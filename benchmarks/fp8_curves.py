"""FP8 against BF16 training on real text: the same 4-layer Qwen3-30B-A3B-shaped model, seed and data,
200 steps each; both loss curves in one PNG and the final-loss ratio (issue 26's quality goal).

    python -m benchmarks.fp8_curves --out benchmarks/results/fp8_curves_h200   # both runs, ~2 min on an H200
    python -m benchmarks.fp8_curves --tiny --device cpu --out /tmp/curves     # CPU smoke run

Model: benchmarks.train_throughput's Qwen3-30B-A3B shapes (hidden 2048, 32 / 4 heads of 128, 128
experts, top-8, moe_intermediate 768) at --layers 4, with a byte vocabulary (257 ids, padded to
512) instead of 151936. Data: the English prose that ships with Python (``fmoe.data.builtin_corpus``:
the reference manual's topics and the stdlib's docstrings, no download), UTF-8 byte tokens, windows of
--seq tokens in the seeded order of ``fmoe.data.batches``: both runs read the same batches.
Training: fp32 master weights, bf16 compute, clip 1.0, AdamW (0.9, 0.95, wd 0.1), warmup then cosine;
``fp8``: every eligible linear and expert GEMM in FP8 (``fp8_training``; router and LM head bf16).
Written to --out: curves.json (both loss sequences, the environment, the settings, the ratio of the
mean loss over the last --tail steps, FP8 / BF16) and curves.png.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import write_result
from benchmarks.train_throughput import SHAPE, TINY
from fmoe import data, optim, runner
from fmoe.lr_schedules import warmup_cosine
from fmoe.stages import qwen3_moe
from fmoe.stages.fp8_mode import quantized_from_master
from fmoe.stages.primitives import fp8_training

BYTE_VOCAB = 512  # the bytes tokenizer's 257 ids, padded


def dataset(root: Path, corpus_bytes: int) -> data.TokenDataset:
    """The builtin corpus as byte tokens under ``root`` (built once, reused)."""
    out = root / "bytes"
    if not (out / "index.json").exists():
        corpus = data.builtin_corpus(root / "corpus.jsonl", corpus_bytes)
        data.build([corpus], out, tokenizer="bytes", workers=1)
    return data.TokenDataset(out)


def train(cfg, ds, *, fp8: bool, args, device: str) -> list[float]:
    """Losses of ``args.steps`` steps from seed 0 on the seeded batches of ``ds``."""
    model = qwen3_moe.build(cfg)
    params = model.init(seed=0, dtype=torch.float32, device=device)
    lr = warmup_cosine(args.lr, args.warmup, args.steps, final=args.lr / 10)
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr, 0.9, 0.95, 1e-8, 0.1))
    opt = tx.init(params)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    # as fmoe train: an FP8 step reads its expert weights' fp32 masters, with no bf16 copy of them
    shapes = {n: tuple(t.shape) for n, t in params.items()}
    masters = quantized_from_master(shapes, model.expert_params) if fp8 else frozenset()
    stream = data.batches(ds, seq=args.seq, global_batch=args.batch, micro_batch=1, seed=0)
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        batch = next(stream)
        tokens, labels = (t.view(-1, args.seq).to(device) for t in (batch.tokens, batch.labels))
        compute = {n: t if n in masters else t.to(dtype) for n, t in params.items()}
        with fp8_training(fp8):
            out = runner.run_sequential(model, compute, {"tokens": tokens, "labels": labels}, args.batch)
        del compute
        params, opt = optim.step(tx, out.grads, opt, params)
        losses.append(float(out.loss))
        if step % 20 == 0 or step == args.steps - 1:
            print(f"{'fp8' if fp8 else 'bf16'} step {step}: loss {losses[-1]:.4f} ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr, flush=True)  # fmt: skip
    return losses


def plot(path: Path, curves: dict[str, list[float]], title: str) -> str:
    """Both curves in one PNG (matplotlib; without it, a plain raster of the same lines)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        _png_lines(path, list(curves.values()))
        return "plain raster (matplotlib is not installed): bf16 black, fp8 red"
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name, linewidth=1.2)
    ax.set(xlabel="step", ylabel="training loss (nats per byte)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return "matplotlib"


def _png_lines(path: Path, curves: list[list[float]], w: int = 800, h: int = 450) -> None:
    """Polylines on white as an RGB PNG with only the standard library (black, then red)."""
    import struct
    import zlib

    lo = min(min(c) for c in curves)
    hi = max(max(c) for c in curves)
    px = bytearray(b"\xff" * (w * h * 3))
    for colour, ys in zip(((0, 0, 0), (220, 30, 30)), curves):
        pts = [
            (i * (w - 1) // max(len(ys) - 1, 1), int((hi - y) / max(hi - lo, 1e-9) * (h - 1)))
            for i, y in enumerate(ys)
        ]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            n = max(abs(x1 - x0), abs(y1 - y0), 1)
            for k in range(n + 1):
                x, y = x0 + (x1 - x0) * k // n, y0 + (y1 - y0) * k // n
                px[(y * w + x) * 3 : (y * w + x) * 3 + 3] = bytes(colour)
    raw = b"".join(b"\x00" + bytes(px[r * w * 3 : (r + 1) * w * 3]) for r in range(h))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--out", default="benchmarks/results/fp8_curves_h200", help="folder for curves.json / .png"
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=None, help="fewer experts than the 128 of the shape")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2, help="sequences per step (one micro-batch each)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument(
        "--tail", type=int, default=20, help="the final loss is the mean over this many last steps"
    )
    ap.add_argument("--corpus-bytes", type=int, default=4 << 20)
    ap.add_argument(
        "--data-dir",
        default=str(Path(tempfile.gettempdir()) / "fmoe_fp8_curves"),
        help="the built corpus (reused)",
    )
    ap.add_argument("--tiny", action="store_true", help="tiny model and run (CPU smoke run)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.seq, args.steps, args.warmup, args.tail, args.batch = 32, 3, 1, 2, 2
        args.corpus_bytes = min(args.corpus_bytes, 200_000)
    # tiny: every dim a multiple of 128 where FP8 applies (q, o, the experts), so FP8 runs
    tiny = dict(TINY, hidden_size=128, head_dim=32, moe_intermediate_size=128)
    shape = dict(tiny if args.tiny else SHAPE, vocab_size=BYTE_VOCAB)
    if args.experts:
        shape["num_experts"] = args.experts
    cfg = qwen3_moe.Qwen3MoeConfig(num_hidden_layers=args.layers, **shape)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ds = dataset(Path(args.data_dir) / ("tiny" if args.tiny else "full"), args.corpus_bytes)
    data.check_vocab(ds, cfg.vocab_size)
    curves, seconds = {}, {}
    for name, fp8 in (("bf16", False), ("fp8", True)):
        t0 = time.perf_counter()
        curves[name] = train(cfg, ds, fp8=fp8, args=args, device=args.device)
        seconds[name] = time.perf_counter() - t0
        if args.device == "cuda":
            torch.cuda.empty_cache()
        if name == "bf16":  # kept if the FP8 run is cut short
            write_result(
                out / "curves.json", {"partial": True, "losses": curves, "seconds": seconds}, echo=False
            )
    tail = {k: statistics.fmean(v[-args.tail :]) for k, v in curves.items()}
    ratio = tail["fp8"] / tail["bf16"]
    title = f"{args.layers}-layer Qwen3-30B-A3B shapes, byte text, {args.batch} x {args.seq} tokens/step"
    how = plot(out / "curves.png", curves, f"{title}: fp8 / bf16 = {ratio:.4f}")
    result = {
        "benchmark": "FP8 vs BF16 training curves, same seed and data (issue 26)",
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "data_dir")},
        "model": shape | {"num_hidden_layers": args.layers},
        "dataset_tokens": ds.n_tokens,
        "losses": curves,
        "seconds": seconds,
        f"mean_loss_last_{args.tail}": tail,
        "final_loss_ratio_fp8_over_bf16": ratio,
        "final_step_ratio_fp8_over_bf16": curves["fp8"][-1] / curves["bf16"][-1],
        "finite": all(math.isfinite(x) for v in curves.values() for x in v),
        "goal": "final loss within 1.5% (ratio in [0.985, 1.015])",
        "png": str(out / "curves.png") + f" ({how})",
    }
    write_result(out / "curves.json", result, echo=False)
    print(f"final loss fp8 / bf16 = {ratio:.4f} (mean of the last {args.tail} steps)", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
