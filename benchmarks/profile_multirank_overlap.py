"""pp = 2 DualPipeV on ONE GPU under gloo, two ranks: how much of a rank's communication-stream
activity overlaps its compute.

    TRITON_INTERPRET=0 python3 -m benchmarks.profile_multirank_overlap --out benchmarks/results/multirank_overlap_h200.json

Each rank runs ``--steps`` pipeline steps (after one warm-up step) under torch.profiler and reads
its own trace: the compute stream is the stream with the most kernel time; communication is the
rank's copies between host and device on every other stream (the pipeline's staged transfers on
``fmoe.p2p.copy_stream``, gloo's own copies for the loss all-reduce). The overlap share is
|union(communication intervals) n union(compute kernel intervals)| / |union(communication)|: the
part of the communication during which the same rank's compute stream was running kernels (under
DualPipeV the compute then is another micro-batch's: the one being transferred has its producer
done, before the copy, and its consumer queued after it). ``--device cpu`` runs the same steps on the
CPU (no streams: no overlap to measure), so the script can be checked without a GPU.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import environment, write_result
from fmoe import dist as D

__all__ = ["main", "overlap"]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap(trace_events: list[dict]) -> dict:
    """The overlap figures of one process's chrome-trace events (``ts``/``dur`` in microseconds)."""
    per_stream: dict[int, dict[str, list]] = {}
    for e in trace_events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy"):
            continue
        stream = int(e.get("args", {}).get("stream", -1))
        kind = "kernels" if e["cat"] == "kernel" else "copies"
        per_stream.setdefault(stream, {"kernels": [], "copies": []})[kind].append(
            (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        )
    if not per_stream:
        return {"overlap_share": None, "why": "no GPU activity in the trace"}
    compute = max(per_stream, key=lambda s: _length(_union(per_stream[s]["kernels"])))
    kernels = _union(per_stream[compute]["kernels"])
    comm = _union([iv for s, v in per_stream.items() if s != compute for iv in v["copies"]])
    comm_us = _length(comm)
    both = _intersection(comm, kernels)
    return {
        "compute_stream": compute,
        "compute_us": _length(kernels),
        "comm_us": comm_us,
        "overlap_us": both,
        "overlap_share": both / comm_us if comm_us else None,
        "streams": {
            str(s): {"kernels_us": _length(_union(v["kernels"])), "copies_us": _length(_union(v["copies"]))}
            for s, v in per_stream.items()
        },
    }


def _rank(rank: int, world: int, group, args: dict, trace_dir: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from fmoe import interpreter, pipeline
    from fmoe.schedules.generators import generate
    from fmoe.stages import qwen3_moe

    device = torch.device("cuda", 0) if args["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = qwen3_moe.Qwen3MoeConfig(
        vocab_size=args["vocab"], hidden_size=args["hidden"], num_hidden_layers=args["layers"],
        num_attention_heads=args["hidden"] // 128, num_key_value_heads=max(1, args["hidden"] // 512),
        head_dim=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=args["hidden"],
        intermediate_size=4 * args["hidden"], mlp_only_layers=(0,),
    )  # fmt: skip
    model = qwen3_moe.build(cfg)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    params = {n: t.to(dtype) for n, t in model.init(seed=0, device=device).items()}
    gen = torch.Generator().manual_seed(1)
    shape = (args["microbatches"], args["seq"])
    batch = {
        k: torch.randint(0, cfg.vocab_size, shape, generator=gen).to(device) for k in ("tokens", "labels")
    }
    schedule = generate("dualpipev", 2, args["microbatches"])
    local = {n: params[n] for n in pipeline.local_param_names(model, schedule, rank=rank)}

    def step():
        interpreter.pipeline_step(schedule, model, local, batch, group)
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up: Triton compiles, the allocators fill
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args["steps"]):
            step()
        wall = time.perf_counter() - start
    path = Path(trace_dir) / f"rank{rank}.json"
    prof.export_chrome_trace(str(path))
    result = overlap(json.loads(path.read_text())["traceEvents"])
    result["step_ms"] = 1e3 * wall / args["steps"]
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--trace-dir", default=None, help="keep each rank's chrome trace here")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    args = vars(a)
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = a.trace_dir or tmp
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        results = D.spawn(_rank, 2, (args, trace_dir), timeout_s=540)
    for r in results:
        if not r.ok:
            raise SystemExit(f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}")
    result = {
        "what": "pp=2 DualPipeV, two ranks on one device under gloo: a rank's host<->device copies on its "
        "non-compute streams overlapping its compute-stream kernels (share of the copies' time)",
        "args": args,
        "ranks": [r.value for r in results],
        "environment": environment(),
    }
    write_result(a.out, result)
    return result


if __name__ == "__main__":
    main()
