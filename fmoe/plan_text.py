"""What ``fmoe plan`` and ``fmoe train`` print of a memory plan: per-rank terms, the layout table,
the memory policy and its modelled time, and the one line refusing a layout that does not fit."""

from __future__ import annotations

from collections.abc import Sequence

from fmoe.memory_policy import MemoryPolicy
from fmoe.mesh import DIMS
from fmoe.plan import TERMS, GiB, LayoutPlan
from fmoe.plan_policy import PolicyChoice
from fmoe.plan_time import TimeCost

__all__ = [
    "choice_text",
    "gib",
    "human",
    "layout_name",
    "policy_text",
    "rank_lines",
    "refusal",
    "summary",
    "table_lines",
]


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def processes(n: int) -> str:
    """``n`` with its noun: "1 process", "8 processes"."""
    return f"{n} process" if n == 1 else f"{n} processes"


def count(n: int) -> str:
    """A parameter count in three digits with its unit: "30.5B", "1.05M", "262K"."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def human(n: float) -> str:
    """Bytes as MiB below 1 GiB, else GiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def rank_lines(plan: LayoutPlan) -> list[str]:
    """One line per pipeline rank: its global ranks and every term (GiB, or MiB for a small plan)."""
    unit, scale = ("GiB", GiB) if plan.peak >= GiB else ("MiB", 2**20)
    header = ("params", "grads", "optim", "gathered", "activ", "peak")
    lines = [f"{'ranks':>12}  " + " ".join(f"{h:>8}" for h in header) + f"  {unit}"]
    for r, t in enumerate(plan.stage_terms):
        ranks = plan.ranks_of(r)
        span = f"{ranks[0]}" if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
        cells = " ".join(f"{getattr(t, n) / scale:>8.2f}" for n in (*TERMS, "peak"))
        lines.append(f"{span:>12}  {cells}")
    return lines


def layout_name(plan: LayoutPlan) -> str:
    return " ".join(f"{d}={v}" for d, v in zip(DIMS, plan.sizes))


def refusal(plan: LayoutPlan, limit_bytes: float, auto: bool = False) -> str | None:
    """The one line refusing ``plan`` when a rank's peak exceeds ``limit_bytes`` (else None): the
    rank, its peak, its largest term and the memory policy planned (auto: the smallest peak of
    every policy ``memory.policy = "auto"`` tried, none of which fits)."""
    worst = plan.worst()
    if worst.peak <= limit_bytes:
        return None
    term, size = worst.largest_term()
    pp_rank = plan.stage_terms.index(worst)
    tried = " (memory.policy = 'auto': no policy fits, this one has the smallest peak)" if auto else ""
    return (
        f"memory plan: rank {plan.ranks_of(pp_rank)[0]} (pp {pp_rank}) needs {human(worst.peak)}, "
        f"more than the device's {human(limit_bytes)}; its largest term is {term} ({human(size)}) "
        f"on layout {layout_name(plan)} with {policy_text(plan.policy)}{tried}: run `fmoe plan` for "
        f"layouts and policies that fit"
    )


def summary(
    plan: LayoutPlan, limit_bytes: float | None, cost: TimeCost | None = None, auto: bool = False
) -> str:
    """The compact block ``fmoe train`` prints at its start (rank 0) and keeps in memory_plan.txt:
    the layout, the limit, the policy (and whether "auto" chose it) and its modelled time cost."""
    limit = "no limit" if limit_bytes is None else f"{human(limit_bytes)} per device"
    policy = (
        policy_text(plan.policy)
        if cost is None
        else choice_text(plan.policy, cost, auto, limit_bytes is not None)
    )
    head = f"memory plan, {layout_name(plan)} ({plan.schedule}, bubble {plan.bubble:.3f}), {limit}, {policy}:"
    if not plan.activations_planned:
        head += " (activations not planned: fmoe.plan has no formulas for this family)"
    return "\n".join([head, *rank_lines(plan)])


def policy_text(policy: MemoryPolicy) -> str:
    """The ``[memory]`` policy a plan's activations are for, in one phrase."""
    roles = f" ({', '.join(policy.recompute_roles)})" if policy.recompute_roles else ""
    window = "step" if policy.merge_window == 0 else str(policy.merge_window)
    return (f"memory: recompute {policy.recompute}{roles}, merge_window {window}, "
            f"offload {'on' if policy.offload else 'off'}")  # fmt: skip


def choice_text(policy: MemoryPolicy, cost: TimeCost, auto: bool, limited: bool = True) -> str:
    """The policy, who chose it and its modelled cost, in one phrase. limited: whether the device
    has a memory limit (without one "auto" takes the fastest, ``fmoe.plan_policy.choose``)."""
    rule = "the fastest that fits; within 1% of it, the smallest peak" if limited else "no limit, the fastest"
    who = f" (chosen by memory.policy = 'auto': {rule})" if auto else ""
    return f"{policy_text(policy)}{who}, {cost.text()}"


def _policy_cells(choice: PolicyChoice) -> str:
    p, cost = choice.policy, choice.cost
    recompute = p.recompute + ("*" if p.recompute_roles else "")  # *: some roles only
    # a pipeline runs W where its table says: a merge window applies at pp = 1 only
    window = "-" if choice.plan.pp > 1 else "step" if p.merge_window == 0 else str(p.merge_window)
    time = f"+{100 * cost.fraction:.1f}%" if cost.modelled else "?"
    return f"{recompute:<9} {window:>6} {'on' if p.offload else 'off':>7} {time:>7}"


def table_lines(
    plans: Sequence[LayoutPlan], limit_bytes: float | None, choices: Sequence[PolicyChoice] | None = None
) -> list[str]:
    """One line per layout: sizes, schedule, bubble, peak, largest term of its fullest rank, (with
    ``choices``, one per plan: its policy and modelled time per layer), fits."""
    unit, scale = ("GiB", GiB) if max((p.peak for p in plans), default=GiB) >= GiB else ("MiB", 2**20)
    policy_head = f"{'recompute':<9} {'window':>6} {'offload':>7} {'time':>7} " if choices is not None else ""
    lines = [f"{'pp':>3} {'dp':>3} {'cp':>3} {'ep':>3}  {'schedule':<16} {'bubble':>6}  {'peak ' + unit:>9}  "
             f"{f'largest term ({unit})':<24} {policy_head}fits"]  # fmt: skip
    for i, p in enumerate(plans):
        term, size = p.worst().largest_term()
        fits = "yes" if p.fits(limit_bytes) else "no"
        cells = f"{_policy_cells(choices[i])} " if choices is not None else ""
        lines.append(
            f"{p.pp:>3} {p.dp:>3} {p.cp:>3} {p.ep:>3}  {p.schedule:<16} {p.bubble:>6.3f}  {p.peak / scale:>9.2f}  "
            f"{f'{term} {size / scale:.2f}':<24} {cells}{fits}"
        )
    return lines
