"""Where a layer's time goes, kernel by kernel: the difference of two profiled steps that differ only
in their number of layers, per side, and how far FP8 can go with the rest unchanged.

    python3 -m benchmarks.per_layer_kernels L2.json L4.json [--out per_layer.json]

Each file is ``benchmarks.train_throughput --profile`` output (same sides, micro-batches and
sequence; ``--top-kernels`` high enough to list every kernel). A kernel's time per layer is
(its ms in the larger step - its ms in the smaller) / (layers apart): what is not per layer (the
embedding, the head and loss, the step's fixed part) cancels. Kernels are put in the classes of
``benchmarks.train_throughput.CATEGORIES`` by name (first match wins). A kernel launched as often at
both depths is not launched per layer: what its time moved between the runs (the head's GEMMs ran
2.6 ms a layer apart on one H100) is the fixed part's run-to-run difference, reported as
``fixed_part_ms`` and kept out of the classes, so that it is not read as a layer's cost.

For a BF16 side and an FP8 side (``--bf16``, ``--fp8``) it also gives the bound Amdahl's law puts on
FP8 per layer: the BF16 layer with the GEMMs FP8 replaces (the experts' and the projections') run
at the hardware's FP8 rate (2x BF16 on Hopper) and no quantization at all, everything else as
measured. FP8 per layer cannot beat that with the other kernels as they are.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.train_throughput import CATEGORIES

# what an all-FP8 layer runs in FP8: the BF16 GEMMs per layer (the router's small GEMM is counted
# too, which FP8 leaves in BF16: the bound is that much optimistic; the head's cancels)
REPLACED = ("expert GEMMs (bf16 grouped)", "other GEMMs (head, projections)")
FP8_PARTS = ("fp8 GEMMs", "fp8 quantization")
FP8_RATE = 2.0  # Hopper's dense FP8 tensor-core rate against BF16's


def kernel_class(name: str) -> str:
    """The class of a kernel: ``benchmarks.train_throughput.CATEGORIES``' (first match wins)."""
    low = name.lower()
    return next(c for c, pats in CATEGORIES if any(p in low for p in pats))


def _kernels(result: dict, side: str, path: str) -> dict[str, tuple[float, float]]:
    try:
        top = result["results"][side]["profile"]["top_kernels"]
    except KeyError:
        print(f"{path}: side {side!r} has no profile (run train_throughput with --profile)", file=sys.stderr)
        sys.exit(2)
    out: dict[str, tuple[float, float]] = {}
    for k in top:  # names are cut to 120 characters: kernels that share a prefix are summed
        ms, n = out.get(k["kernel"], (0.0, 0.0))
        out[k["kernel"]] = (ms + k["ms_per_step"], n + k["calls_per_step"])
    return out


def per_layer(small: dict, large: dict, side: str, paths: tuple[str, str]) -> dict:
    """Per-layer ms and launches of each kernel of ``side`` and of each class; the step times."""
    apart = large["shape"]["layers"] - small["shape"]["layers"]
    a, b = _kernels(small, side, paths[0]), _kernels(large, side, paths[1])
    kernels, fixed = {}, {}
    for name in sorted(set(a) | set(b)):
        (ms_a, n_a), (ms_b, n_b) = a.get(name, (0.0, 0.0)), b.get(name, (0.0, 0.0))
        k = {"ms": (ms_b - ms_a) / apart, "launches": (n_b - n_a) / apart}
        (fixed if n_a == n_b else kernels)[name] = k
    classes: dict[str, dict] = {}
    for name, k in kernels.items():
        c = classes.setdefault(kernel_class(name), {"ms": 0.0, "launches": 0.0})
        c["ms"] += k["ms"]
        c["launches"] += k["launches"]
    step = lambda r: r["results"][side]["step_ms"]  # noqa: E731
    return {
        "layer_ms": (step(large) - step(small)) / apart,
        "kernel_ms": sum(k["ms"] for k in kernels.values()),
        "classes": dict(sorted(classes.items(), key=lambda kv: -kv[1]["ms"])),
        "kernels": dict(sorted(kernels.items(), key=lambda kv: -abs(kv[1]["ms"]))),
        "fixed_part_ms": sum(k["ms"] for k in fixed.values()),
        "fixed_kernels": dict(sorted(fixed.items(), key=lambda kv: -abs(kv[1]["ms"]))),
    }


def fp8_bound(bf16: dict, fp8: dict) -> dict:
    """The best FP8 layer with the other kernels as measured (module docstring), and the ratio."""
    replaced = sum(bf16["classes"].get(c, {"ms": 0.0})["ms"] for c in REPLACED)
    best = bf16["layer_ms"] - replaced * (1 - 1 / FP8_RATE)
    fp8_parts = sum(fp8["classes"].get(c, {"ms": 0.0})["ms"] for c in FP8_PARTS)
    return {
        "bf16_layer_ms": bf16["layer_ms"],
        "fp8_layer_ms": fp8["layer_ms"],
        "fp8_speedup": bf16["layer_ms"] / fp8["layer_ms"],  # BF16 time / FP8 time
        "bf16_gemm_ms_fp8_replaces": replaced,
        "best_fp8_layer_ms": best,
        "best_ratio": bf16["layer_ms"] / best,
        "fp8_gemm_and_quant_ms": fp8_parts,
        "rest_bf16_ms": bf16["layer_ms"] - replaced,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("small", help="train_throughput --profile JSON, fewer layers")
    ap.add_argument("large", help="the same with more layers")
    ap.add_argument("--bf16", default="fmoe_graphs", help="the BF16 side")
    ap.add_argument("--fp8", default="fmoe_fp8_graphs", help="the FP8 side")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    runs = []
    for path in (args.small, args.large):
        try:
            with open(path) as f:
                run = json.load(f)
            run["shape"]["layers"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"{path}: not a train_throughput record ({type(e).__name__}: {e})")
        runs.append((run, path))
    (small, small_path), (large, large_path) = sorted(runs, key=lambda r: r[0]["shape"]["layers"])
    if small["shape"]["layers"] == large["shape"]["layers"]:
        ap.error("the two runs have the same number of layers")
    paths = (small_path, large_path)
    sides = {s: per_layer(small, large, s, paths) for s in (args.bf16, args.fp8)}
    out = {"layers": [small["shape"]["layers"], large["shape"]["layers"]], "sides": sides}
    out["fp8_bound"] = fp8_bound(sides[args.bf16], sides[args.fp8])
    names = sorted(set(sides[args.bf16]["classes"]) | set(sides[args.fp8]["classes"]))
    print(f"{'ms per layer':28s} {args.bf16:>16s} {args.fp8:>16s}")
    for c in sorted(names, key=lambda c: -sides[args.bf16]["classes"].get(c, {"ms": 0})["ms"]):
        row = [sides[s]["classes"].get(c, {"ms": 0.0})["ms"] for s in (args.bf16, args.fp8)]
        print(f"{c:28s} {row[0]:16.2f} {row[1]:16.2f}")
    rows = (("sum of kernels", "kernel_ms"), ("layer (step difference)", "layer_ms"),
            ("fixed part's difference", "fixed_part_ms"))  # fmt: skip
    for label, key in rows:
        print(f"{label:28s} {sides[args.bf16][key]:16.2f} {sides[args.fp8][key]:16.2f}")
    b = out["fp8_bound"]
    print(
        f"FP8's speed-up per layer {b['fp8_speedup']:.3f}x; with FP8 GEMMs at {FP8_RATE:g}x and no "
        f"quantization: {b['best_fp8_layer_ms']:.1f} ms, {b['best_ratio']:.3f}x"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
