"""Time generating, validating, lowering and simulating schedule tables (goal: generate + validate
of pp=64, 512 microbatches under 1 s on CPU).

    python benchmarks/bench_schedules.py [--pp 64] [--microbatches 512] [--repeat 3] [--json FILE]

Prints one line per schedule with the best of ``--repeat`` runs (process CPU time, which a busy
machine disturbs less than wall time; wall time is reported too).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time

from fmoe.schedules.generators import GENERATORS, generate
from fmoe.schedules.simulator import simulate
from fmoe.schedules.verify import lower, validate


def best(fn, repeat: int) -> tuple[float, float, object]:
    cpu, wall, out = float("inf"), float("inf"), None
    for _ in range(repeat):
        c, w = time.process_time(), time.perf_counter()
        out = fn()
        cpu, wall = min(cpu, time.process_time() - c), min(wall, time.perf_counter() - w)
    return cpu, wall, out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    rows = []
    print(f"pp={args.pp} microbatches={args.microbatches}, best of {args.repeat}, seconds of CPU (wall)")
    print(
        f"{'schedule':18} {'rows':>7} {'gen+validate':>14} {'lower':>14} {'validate lowered':>17} {'simulate':>14}"
    )
    for name in GENERATORS:
        g_cpu, g_wall, s = best(lambda n=name: generate(n, args.pp, args.microbatches), args.repeat)
        v_cpu, v_wall, _ = best(lambda s=s: validate(s), args.repeat)
        l_cpu, l_wall, low = best(lambda s=s: lower(s), args.repeat)
        vl_cpu, vl_wall, _ = best(lambda low=low: validate(low), args.repeat)
        s_cpu, s_wall, _ = best(lambda s=s: simulate(s), args.repeat)
        row = {
            "schedule": name,
            "rows": sum(map(len, s.actions)),
            "lowered_rows": sum(map(len, low.actions)),
            "generate_validate_s": g_cpu + v_cpu,
            "generate_validate_wall_s": g_wall + v_wall,
            "lower_s": l_cpu,
            "validate_lowered_s": vl_cpu,
            "simulate_s": s_cpu,
        }
        rows.append(row)
        print(
            f"{name:18} {row['rows']:>7} {g_cpu + v_cpu:>6.3f} ({g_wall + v_wall:.3f}) {l_cpu:>6.3f} ({l_wall:.3f}) "
            f"{vl_cpu:>9.3f} ({vl_wall:.3f}) {s_cpu:>6.3f} ({s_wall:.3f})"
        )
    if args.json:
        meta = {
            "date": datetime.date.today().isoformat(),
            "python": sys.version.split()[0],
            "machine": platform.processor() or platform.machine(),
            "pp": args.pp,
            "microbatches": args.microbatches,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
