"""How long a checkpoint holds training up, synchronous against asynchronous saves, in `fmoe train`'s
own loop: Qwen3-30B-A3B's recipe cut to 4 layers (3.1B parameters: 37 GB of fp32 masters and AdamW
moments), one process, one GPU.

    python -m benchmarks.bench_checkpoint_stall --out $OUT/checkpoint_stall_h200.json   # about 4-5 min on an H200
    python -m benchmarks.bench_checkpoint_stall --smoke                                  # CPU, seconds

For each mode (``checkpoint.asynchronous`` false, then true) one run of --steps steps with a save
every --every steps (and the run's final save), measured by wrapping fmoe's checkpoint functions:
per save, the seconds the training loop spent in ``begin_save`` (agreeing on the pieces; for an
asynchronous save, copying them to pinned host memory) and in ``PendingSave.finish`` (waiting for
the write, then the rename), and the seconds the write itself took (on the writer thread when
asynchronous). Also the run's steady-state tokens/s (``TrainResult.tokens_per_second``: saves and the
first step left out) and its tokens/s over the whole loop with the saves in.

Disk: the state is 37 GB, so the scratch folder (--dir; default the temp folder, or /dev/shm when
that has less than 40 GB free) needs that much free; each save first
removes the older checkpoint (timed apart, not counted as stall), so one checkpoint is on disk at a
time. The data is a byte-tokenized corpus of the Python standard library's docstrings, built first.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import write_result
from fmoe import checkpoint, train
from fmoe import recipe as R

RECIPE = Path(__file__).parents[1] / "recipes" / "qwen3_30b_a3b.toml"
H200 = {"model.num_hidden_layers": 4, "parallel.ep": 1, "train.global_batch": 8, "train.microbatches": 8,
        "data.seq_len": 4096, "train.device": "cuda"}  # fmt: skip
SMOKE = {"model.num_hidden_layers": 2, "model.hidden_size": 64, "model.num_attention_heads": 4,
         "model.num_key_value_heads": 2, "model.head_dim": 16, "model.num_experts": 8,
         "model.num_experts_per_tok": 2, "model.moe_intermediate_size": 32, "model.intermediate_size": 64,
         "model.vocab_size": 512, "parallel.ep": 1, "train.global_batch": 4, "train.microbatches": 2,
         "data.seq_len": 64, "train.device": "cpu", "train.dtype": "float32"}  # fmt: skip


class Timings:
    """Wraps fmoe.checkpoint's save functions for one run; ``saves``: one record per save."""

    def __init__(self, root: Path):
        self.root, self.saves = root, []
        self.real = (checkpoint.begin_save, checkpoint.PendingSave.finish, checkpoint.PendingSave._write)

    def __enter__(self) -> Timings:
        begin, finish, write = self.real
        saves, root = self.saves, self.root

        def timed_begin(dir, step, *args, **kwargs):
            t = time.perf_counter()
            for old in checkpoint.list_checkpoints(root):  # one checkpoint on disk at a time
                shutil.rmtree(old)
            cleared = time.perf_counter() - t
            t = time.perf_counter()
            pending = begin(dir, step, *args, **kwargs)
            saves.append({"step": step, "asynchronous": bool(kwargs.get("background")),
                          "begin_s": time.perf_counter() - t, "cleared_s": cleared})  # fmt: skip
            pending.bench_record = saves[-1]
            return pending

        def timed_finish(self_):
            t = time.perf_counter()
            out = finish(self_)
            self_.bench_record["finish_s"] = time.perf_counter() - t
            self_.bench_record["write_s"] = self_.write_s
            self_.bench_record["stall_s"] = self_.bench_record["begin_s"] + self_.bench_record["finish_s"]
            return out

        def timed_write(self_, files):
            t = time.perf_counter()
            write(self_, files)
            self_.write_s = time.perf_counter() - t

        checkpoint.begin_save = timed_begin
        checkpoint.PendingSave.finish = timed_finish
        checkpoint.PendingSave._write = timed_write
        return self

    def __exit__(self, *exc) -> None:
        checkpoint.begin_save, checkpoint.PendingSave.finish, checkpoint.PendingSave._write = self.real


def run(base: dict, root: Path, asynchronous: bool, steps: int, every: int) -> dict:
    ckpt = root / f"ckpt-{'async' if asynchronous else 'sync'}"
    overrides = {**base, "train.steps": steps, "optim.warmup": 1, "checkpoint.every": every,
                 "checkpoint.keep": 1, "checkpoint.asynchronous": asynchronous, "checkpoint.dir": str(ckpt),
                 "log.dir": str(root / f"log-{asynchronous}"), "log.every": 1, "log.progress": False}  # fmt: skip
    recipe = R.load(RECIPE, overrides)
    with Timings(ckpt) as timings:
        t = time.perf_counter()
        result = train.train(recipe)
        loop_s = time.perf_counter() - t
    state_bytes = sum(f.stat().st_size for f in checkpoint.latest(ckpt).iterdir())
    shutil.rmtree(ckpt)
    tokens = recipe.train.global_batch * recipe.data.seq_len
    return {
        "asynchronous": asynchronous,
        "steps": steps,
        "checkpoint_every": every,
        "checkpoint_bytes": state_bytes,
        "saves": timings.saves,
        "stall_s_per_save": [s.get("stall_s") for s in timings.saves],
        "save_seconds_total": result.save_seconds,
        "tokens_per_s_steady": result.tokens_per_second,
        "mfu_steady": result.mfu,
        # the loop's steps after the first, with the time the saves held it up
        "tokens_per_s_with_saves": (steps - 1)
        * tokens
        / ((steps - 1) * tokens / result.tokens_per_second + result.save_seconds),  # fmt: skip
        "train_call_s": loop_s,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=11)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument(
        "--dir", default=None, help="scratch folder with >= 40 GB free (default: the temp folder)"
    )
    ap.add_argument("--out", default=None, help="write the JSON record here")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on CPU: check the script runs")
    args = ap.parse_args(argv)
    base = SMOKE if args.smoke else H200
    need = 8 << 20 if args.smoke else 40 << 30
    where = args.dir or tempfile.gettempdir()
    if args.dir is None and shutil.disk_usage(where).free < need and Path("/dev/shm").is_dir():
        where = "/dev/shm"  # a small disk: the files go to memory (recorded as "scratch")
    with tempfile.TemporaryDirectory(prefix="fmoe-bench-stall-", dir=where) as scratch:
        root = Path(scratch)
        free = shutil.disk_usage(root).free
        if free < need:
            raise SystemExit(
                f"{root}: {free / 2**30:.1f} GiB free, the checkpoint needs {need / 2**30:.0f}: pass --dir"
            )
        print(f"scratch {root}: {free / 2**30:.0f} GiB free", file=sys.stderr, flush=True)
        base = {**base, "data.path": str(root / "data"), "data.tokenizer": "bytes", "data.build_from": "builtin",
                "data.builtin_bytes": 2_000_000}  # fmt: skip
        runs = []
        for asynchronous in (False, True):
            print(f"run: asynchronous={asynchronous}", file=sys.stderr, flush=True)
            runs.append(run(base, root, asynchronous, args.steps, args.every))
            print(runs[-1], file=sys.stderr, flush=True)
    result = {
        "benchmark": "checkpoint stall, synchronous vs asynchronous, in fmoe train's loop",
        "command": "python -m benchmarks.bench_checkpoint_stall"
        + (" --smoke" if args.smoke else "")
        + f" --steps {args.steps} --every {args.every}",
        "recipe": str(RECIPE.name),
        "scratch": where,
        "overrides": base,
        "runs": runs,
    }
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
