"""Checkpoint save and load, sharded (every rank writes and reads its own pieces) against gathered
(every tensor gathered to rank 0, which writes one folder; every rank reads the whole file and keeps
its slice: fmoe's checkpoints before sharding), for a ~1.1B-parameter Qwen3-MoE on CPU processes.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_checkpoint --nproc 4 --out benchmarks/results/checkpoint_sharded_cpu.json

Layout: dp = nproc (ZeRO: every tensor split over the ranks). State: the parameters in bfloat16 and
the optimizer's step count (no Adam moments: the gathered form of fp32 masters plus two moments
would need ~36 GB at once on this 24 GB machine, which is the point of sharding). Per rank: wall time
of save (including the checksums) and load (including verification: each rank a share of the files
for sharded; rank 0 all of them for gathered), and the resident peak above the rank's baseline
(``fmoe.memory``: VmHWM).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import environment
from fmoe import checkpoint, memory, sharding, train_state
from fmoe import dist as D
from fmoe.mesh import build_mesh
from fmoe.stages import qwen3_moe

CONFIG = dict(
    vocab_size=32768, hidden_size=2048, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4,
    head_dim=128, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=768, intermediate_size=6144,
)  # fmt: skip
SMOKE = dict(CONFIG, hidden_size=256, num_hidden_layers=2, num_experts=4, vocab_size=1024, intermediate_size=512,
             moe_intermediate_size=128, num_attention_heads=4, head_dim=64, num_key_value_heads=2)  # fmt: skip
DTYPE = torch.bfloat16


def _measure(fn) -> tuple[float, int, object]:
    """(seconds, resident peak above the baseline in bytes, fn's result), all ranks started together."""
    cpu = torch.device("cpu")
    dist.barrier()
    base = memory.reset_peak(cpu)
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, memory.peak_bytes(cpu) - base, out


def worker(rank: int, world: int, group, root: str, config: dict) -> dict:
    torch.set_num_threads(1)
    cfg = qwen3_moe.Qwen3MoeConfig(**config)
    model, shapes = qwen3_moe.build(cfg), qwen3_moe.param_shapes(cfg)
    mesh = build_mesh(1, world, 1, 1)
    infos = sharding.layout(model, mesh, shapes)
    gen = torch.Generator().manual_seed(rank)
    shards = {n: torch.randn(i.shard_numel, generator=gen).to(DTYPE) for n, i in infos.items()}
    state = {"step": torch.tensor(7, dtype=torch.int64)}
    own = sum(t.numel() * t.element_size() for t in shards.values())
    out: dict = {"rank": rank, "own_shard_bytes": own}

    # sharded
    sharded_dir = Path(root) / "sharded"

    def save_sharded():
        return checkpoint.save_sharded(
            sharded_dir, 1, train_state.checkpoint_shards(shards, infos, mesh, shapes),
            train_state.opt_canonical(state, infos, mesh, shapes), {"data_cursor": 0},
        )  # fmt: skip

    seconds, peak, path = _measure(save_sharded)
    out["sharded_save"] = {"seconds": seconds, "peak_extra_bytes": peak}

    def load_sharded():
        reason = train_state.verify_share(path, rank, world)
        assert reason is None, reason
        ck = checkpoint.open_checkpoint(path, check_integrity=False)
        return {n: train_state.read_shard(ck, "model", n, n, infos[n], mesh, shapes[n], "cpu") for n in infos}

    seconds, peak, loaded = _measure(load_sharded)
    assert all(torch.equal(loaded[n], shards[n]) for n in shards)
    del loaded
    out["sharded_load"] = {"seconds": seconds, "peak_extra_bytes": peak}
    out["sharded_files_bytes"] = sum(p.stat().st_size for p in Path(path).iterdir())
    dist.barrier()  # every rank has measured the folder before rank 0 removes it
    if rank == 0:
        shutil.rmtree(sharded_dir)

    # gathered: fmoe's checkpoints before sharding
    gathered_dir = Path(root) / "gathered"

    def save_gathered():
        full = sharding.canonical(shards, infos, mesh, list(shapes))
        if rank == 0:
            return checkpoint.save(gathered_dir, 1, full, dict(state), {"data_cursor": 0})
        return None

    seconds, peak, path = _measure(save_gathered)
    out["gathered_save"] = {"seconds": seconds, "peak_extra_bytes": peak}
    box = [None if path is None else str(path)]
    dist.broadcast_object_list(box, src=0)

    def load_gathered():
        if rank == 0:
            checkpoint.verify(box[0])
        dist.barrier()
        full, _, _ = checkpoint.load(box[0], expected_shapes=shapes, check_integrity=False)
        return sharding.shard_canonical(full, infos, mesh)

    seconds, peak, loaded = _measure(load_gathered)
    assert all(torch.equal(loaded[n], shards[n]) for n in shards)
    out["gathered_load"] = {"seconds": seconds, "peak_extra_bytes": peak}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--dir", default=None, help="scratch folder (default: a temp folder)")
    ap.add_argument("--out", default=None, help="write the JSON record here")
    ap.add_argument("--smoke", action="store_true", help="a few-MB model: check the script runs")
    args = ap.parse_args()
    config = SMOKE if args.smoke else CONFIG
    shapes = qwen3_moe.param_shapes(qwen3_moe.Qwen3MoeConfig(**config))
    params = sum(math.prod(s) for s in shapes.values())
    with tempfile.TemporaryDirectory(prefix="fmoe-bench-ckpt-", dir=args.dir) as root:
        results = D.spawn(worker, args.nproc, (root, config), timeout_s=3000)
    for r in results:
        if not r.ok:
            raise SystemExit(f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}")
    ranks = [r.value for r in results]
    summary = {
        kind: {
            "seconds_max": max(v[kind]["seconds"] for v in ranks),
            "peak_extra_gib_max": max(v[kind]["peak_extra_bytes"] for v in ranks) / 2**30,
            "peak_extra_gib_sum": sum(v[kind]["peak_extra_bytes"] for v in ranks) / 2**30,
        }
        for kind in ("sharded_save", "sharded_load", "gathered_save", "gathered_load")
    }
    record = {
        "benchmark": "checkpoint save/load, sharded vs gathered",
        "command": "OMP_NUM_THREADS=1 python -m benchmarks.bench_checkpoint --nproc "
        f"{args.nproc} --out {args.out}",
        "model": {
            "family": "qwen3_moe",
            **CONFIG,
            "parameters": params,
            "dtype": str(DTYPE),
            "largest_tensor_bytes": max(math.prod(s) for s in shapes.values()) * DTYPE.itemsize,
        },  # fmt: skip
        "layout": {"pp": 1, "dp": args.nproc, "cp": 1, "ep": 1},
        "optimizer_state": "step count only (see the script's docstring)",
        "summary": summary,
        "ranks": ranks,
        "environment": environment(),
    }
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
