"""Text and PNG timelines of a simulated schedule, and its figures as a small table."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .simulator import Costs, SimResult
from .table import Action, Schedule

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Colours by action, as in the DualPipe README's figures; chunk 1 is drawn lighter.
COLOURS = {"F": "#f4b183", "B": "#9dc3e6", "W": "#a9d18e", "BW": "#7fa7d6", "FB": "#f6d55c"}


def label(a: Action, chunks: int) -> str:
    """Short name of a compute row: kind + microbatch; lower case for chunk 1 of two, else ``.chunk``.

    FB: forward half then backward half, e.g. ``F7b3`` = forward of mb 7 (chunk 0) with the backward
    of mb 3 (chunk 1).
    """

    def one(kind: str, m: int, c: int) -> str:
        if chunks == 2:
            return (kind if c == 0 else kind.lower()) + str(m)
        return f"{kind}{m}" + (f".{c}" if chunks > 2 else "")

    if a.kind == "FB":
        return one("F", a.microbatch, a.chunk) + one("B", a.b_microbatch, a.b_chunk)
    return one(a.kind, a.microbatch, a.chunk)


def ascii_timeline(schedule: Schedule, result: SimResult, width: int = 160) -> str:
    """One line per rank; each row is a box as long as its simulated time, labelled, '.' where idle."""
    spans = [(t0, t1) for tl in result.timeline for t0, t1, _ in tl if t1 > t0]
    if not spans or result.makespan <= 0:
        return "(nothing to draw)"
    labels = [[label(a, schedule.chunks) for *_, a in tl] for tl in result.timeline]
    shortest = min(t1 - t0 for t0, t1 in spans)
    widest = max((len(x) for row in labels for x in row), default=1) + 1
    scale = min(widest / shortest, width / result.makespan)  # characters per unit of time
    cols = round(result.makespan * scale)
    lines = []
    for r, tl in enumerate(result.timeline):
        line = ["."] * cols
        for (t0, t1, _), text in zip(tl, labels[r]):
            a, b = round(t0 * scale), max(round(t1 * scale), round(t0 * scale) + 1)
            cell = (text + " " * (b - a))[: b - a] if b - a > 1 else text[0]
            line[a:b] = cell
        lines.append(f"rank {r:>{len(str(schedule.pp - 1))}} |{''.join(line[:cols])}|")
    lines.append(
        "F forward, B input grad, W weight grad, BW full backward, FxBy an overlapped pair; "
        + ("lower case: chunk 1; " if schedule.chunks == 2 else "")
        + "'.' idle"
    )
    return "\n".join(lines)


def figures(schedule: Schedule, result: SimResult, costs: Costs) -> str:
    """The simulator's figures per rank, plus makespan and the mean bubble."""

    def num(k: str) -> str:
        v = getattr(costs, k)
        if v is None:
            return {"bw": "b+w", "fb": "f+bw"}[k]
        return "/".join(f"{x:g}" for x in v) if isinstance(v, tuple) else f"{v:g}"

    cost = " ".join(f"{k}={num(k)}" for k in ("f", "b", "w", "bw", "fb", "transfer"))
    out = [
        f"{schedule.name or 'table'}: pp={schedule.pp} microbatches={schedule.microbatches} "
        f"placement={schedule.placement} chunks={schedule.chunks}; costs {cost}",
        f"{'rank':>4} {'busy':>9} {'idle':>9} {'bubble':>7} {'peak act':>8} {'params':>6}",
    ]
    for r in range(schedule.pp):
        out.append(
            f"{r:>4} {result.busy[r]:>9.4g} {result.idle[r]:>9.4g} {result.bubble[r]:>7.1%} "
            f"{result.peak_activations[r]:>8} {result.param_copies[r]:>6.3g}"
        )
    mean = sum(result.bubble) / len(result.bubble)
    out.append(
        f"makespan {result.makespan:.6g}, mean bubble {mean:.1%}, max peak activations {max(result.peak_activations)}"
    )
    return "\n".join(out)


def save_png(schedule: Schedule, result: SimResult, path: str | Path) -> None:
    """:func:`timeline_figure` written to ``path`` as a PNG."""
    timeline_figure(schedule, result).savefig(path, dpi=120)


def timeline_figure(schedule: Schedule, result: SimResult) -> Figure:
    """A timeline coloured by action (chunk 1 lighter), one row per rank, microbatch numbers in boxes;
    a matplotlib Figure (no pyplot: the caller's backend is left alone)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    span = result.makespan or 1.0
    # constrained layout keeps the legend, placed outside the axes below, clear of the x label
    fig = Figure(figsize=(min(max(8.0, span * 0.3), 40.0), 0.45 * schedule.pp + 1.3), layout="constrained")
    ax = fig.subplots()
    shortest = min((t1 - t0 for tl in result.timeline for t0, t1, _ in tl if t1 > t0), default=1.0)
    for r, tl in enumerate(result.timeline):
        for t0, t1, a in tl:
            lighter = a.chunk == 1 and a.kind != "FB"
            ax.barh(
                r,
                t1 - t0,
                left=t0,
                height=0.8,
                color=COLOURS[a.kind],
                alpha=0.55 if lighter else 1.0,
                edgecolor="black",
                linewidth=0.4,
            )
            if (t1 - t0) >= 0.8 * shortest and span / shortest < 400:
                text = f"{a.microbatch}|{a.b_microbatch}" if a.kind == "FB" else str(a.microbatch)
                ax.text((t0 + t1) / 2, r, text, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(schedule.pp), [f"rank {r}" for r in range(schedule.pp)])
    ax.set_ylim(schedule.pp - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel("time")
    mean = sum(result.bubble) / len(result.bubble)
    ax.set_title(
        f"{schedule.name or 'schedule'}  pp={schedule.pp}  microbatches={schedule.microbatches}  "
        f"makespan={result.makespan:.4g}  mean bubble={mean:.1%}",
        fontsize=9,
    )
    kinds = sorted({a.kind for tl in result.timeline for *_, a in tl}, key=list(COLOURS).index)
    names = {
        "F": "F forward",
        "B": "B input grad",
        "W": "W weight grad",
        "BW": "BW full backward",
        "FB": "FB overlapped",
    }
    fig.legend(
        handles=[Patch(color=COLOURS[k], label=names[k]) for k in kinds],
        loc="outside lower center",
        ncol=len(kinds),
        fontsize=7,
        frameon=False,
    )
    return fig
