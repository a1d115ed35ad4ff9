"""Timed simulation of a schedule under a cost model: makespan, bubbles, activation memory.

Each rank runs its compute rows in order; a row starts when the rank is free and its inputs are
there: the forward activation of the previous stage and the gradient of the next stage, plus
``transfer`` when they come from another rank. Communication is modelled as asynchronous (it
overlaps compute), so the figures depend only on the compute order and SEND/RECV rows are skipped:
``simulate(lower(s)) == simulate(s)``. Deadlock freedom of the rows as written is ``validate``'s job.
"""

from __future__ import annotations

from dataclasses import dataclass

from .table import Action, Schedule, ScheduleError, num_stages
from .verify import checked, timeline

Cost = float | tuple[float, ...]


@dataclass(frozen=True)
class Costs:
    """Durations of the actions of one chunk: a number for every stage, or a tuple indexed by stage.

    ``b`` is the input gradient, ``w`` the weight gradient, ``bw`` a full backward (default ``b + w``),
    ``fb`` an FB row (indexed by its forward half's stage; default ``f + bw``, i.e. no overlap gain).
    ``transfer`` is the time an activation or gradient spends between two ranks.
    """

    f: Cost = 1.0
    b: Cost = 1.0
    w: Cost = 1.0
    bw: Cost | None = None
    fb: Cost | None = None
    transfer: float = 0.0

    def __post_init__(self):
        for name in ("f", "b", "w", "bw", "fb", "transfer"):
            v = getattr(self, name)
            vals = v if isinstance(v, tuple) else (v,)
            if v is None and name in ("bw", "fb"):
                continue
            if name == "transfer" and isinstance(v, tuple):
                raise ScheduleError("Costs.transfer must be one number")
            if not vals or not all(isinstance(x, int | float) and x >= 0 for x in vals):
                raise ScheduleError(f"Costs.{name} must be a number >= 0 or a tuple of them, got {v!r}")

    def per_stage(self, stages: int) -> dict[str, tuple[float, ...]]:
        """Every cost as a tuple of ``stages`` numbers (defaults of bw and fb filled in)."""
        out = {}
        for name in ("f", "b", "w", "bw", "fb"):
            v = getattr(self, name)
            if v is None:  # bw = b + w, fb = f + bw
                x, y = ("b", "w") if name == "bw" else ("f", "bw")
                v = tuple(p + q for p, q in zip(out[x], out[y]))
            if not isinstance(v, tuple):
                v = (float(v),) * stages
            if len(v) != stages:
                raise ScheduleError(f"Costs.{name} has {len(v)} entries, the schedule has {stages} stages")
            out[name] = tuple(float(x) for x in v)
        return out


@dataclass(frozen=True)
class SimResult:
    """Figures of one simulated step.

    ``busy[r]`` / ``idle[r]``: time rank r computes / waits within ``makespan``; ``bubble[r]`` =
    ``idle[r] / makespan``. ``peak_activations[r]``: most (microbatch, chunk) pairs whose F has run and
    whose W (or BW) has not, counted in row order (an FB counts its forward before freeing its
    backward). ``param_copies[r]``: parameters held relative to one model copy split evenly over pp
    ranks (2 for DualPipe, 1 otherwise). ``timeline[r]``: (start, end, action) of every compute row.
    """

    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    bubble: tuple[float, ...]
    peak_activations: tuple[int, ...]
    param_copies: tuple[float, ...]
    timeline: tuple[tuple[tuple[float, float, Action], ...], ...]


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Run ``schedule`` (validated first) under ``costs`` (default: F = B = W = 1, no transfer time)."""
    costs = costs or Costs()
    c = costs.per_stage(num_stages(schedule))
    scan = checked(schedule)
    table = {"F": c["f"], "B": c["b"], "W": c["w"], "BW": c["bw"], "FB": c["fb"]}
    durations = [
        [table[acts[op[0]].kind][op[7]] for op in ops]  # FB: by its forward half's stage
        for acts, ops in zip(schedule.actions, scan.ops)
    ]
    starts = timeline(schedule, scan.ops, scan.keys, durations, costs.transfer)
    makespan = max((t[-1] + d[-1] for t, d in zip(starts, durations) if t), default=0.0)
    busy = tuple(sum(durations[r]) for r in range(schedule.pp))
    idle = tuple(makespan - b for b in busy)
    peaks = []
    for acts in schedule.actions:
        live = peak = 0
        for a in acts:
            if a.kind in ("F", "FB"):
                live += 1
                peak = max(peak, live)
            if a.kind in ("W", "BW", "FB"):
                live -= 1
        peaks.append(peak)
    copies = schedule.chunks * schedule.pp / num_stages(schedule)
    return SimResult(
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble=tuple(i / makespan if makespan else 0.0 for i in idle),
        peak_activations=tuple(peaks),
        param_copies=(copies,) * schedule.pp,
        timeline=tuple(
            tuple(
                (t, t + d, schedule.actions[r][op[0]])
                for t, d, op in zip(starts[r], durations[r], scan.ops[r])
            )
            for r in range(schedule.pp)
        ),
    )
