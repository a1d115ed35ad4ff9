"""The embedded default run (``fmoe train`` with no arguments) as a newcomer runs it: wall and CPU time.

    python benchmarks/default_run.py [--busy N] [--set train.threads=2 ...] [--out result.json]

Runs ``python -m fmoe train [--set ...]`` as a child process in a fresh working directory (so it
builds its data and starts from step 0, as on a fresh machine; ``--data DIR`` reuses a built
``data/`` folder to time the training alone) and records its wall time and its CPU time (user + sys
of the child, from ``resource.getrusage(RUSAGE_CHILDREN)``). ``--busy N`` first starts N processes
that spin on the CPU (a shared, busy machine), each ending by itself after ``--busy-seconds`` and
killed when the run ends; their CPU time is not counted (they are reaped after the measurement).
Compare thread counts with ``--set train.threads=1`` / ``--set train.threads=2``.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks.common`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result

SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def start_busy(n: int, seconds: float) -> list[subprocess.Popen]:
    """n child processes spinning on the CPU for at most ``seconds`` each."""
    return [subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=seconds)]) for _ in range(n)]


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def run_default(overrides: list[str], workdir: Path, busy: int, busy_seconds: float) -> dict:
    """Run ``fmoe train`` (plus ``--set`` overrides) in ``workdir``; wall and CPU seconds of the child."""
    cmd = [sys.executable, "-m", "fmoe", "train", *(a for s in overrides for a in ("--set", s))]
    spinners = start_busy(busy, busy_seconds)
    try:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        child = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the spinners are not reaped yet
    finally:
        stop_busy(spinners)
    if child.returncode != 0:
        raise SystemExit(f"fmoe train failed (exit {child.returncode}):\n{child.stderr[-4000:]}")
    user, sys_ = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    final = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else ""
    return {
        "command": " ".join(["fmoe", "train", *(a for s in overrides for a in ("--set", s))]),
        "busy_processes": busy,
        "wall_s": round(wall, 3),
        "cpu_user_s": round(user, 3),
        "cpu_sys_s": round(sys_, 3),
        "cpu_s": round(user + sys_, 3),
        "cpu_per_wall": round((user + sys_) / max(wall, 1e-9), 3),
        "final_line": final,
        "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override passed to fmoe train (e.g. train.steps=5, train.threads=2)")  # fmt: skip
    ap.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU during the run")
    ap.add_argument(
        "--busy-seconds", type=float, default=3600.0, help="each spinner ends by itself after this"
    )
    ap.add_argument("--data", default=None, help="a built data/ folder to copy in (times the training alone)")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    if args.busy < 0:
        ap.error("--busy must be >= 0")
    with tempfile.TemporaryDirectory(prefix="fmoe-default-run-") as tmp:
        workdir = Path(tmp)
        if args.data:
            shutil.copytree(args.data, workdir / "data")
        result = run_default(args.set, workdir, args.busy, args.busy_seconds)
    result["reused_data"] = bool(args.data)
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
