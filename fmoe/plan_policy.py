"""The memory policy a layout runs: the recipe's, or under ``memory.policy = "auto"`` the fastest
that fits.

``choose`` plans a layout under every candidate policy (``candidates``: merge windows, recompute
none / selective / full, offload off / on; the parameter terms planned once, ``plan.plan_policies``),
prices each with the time model (``fmoe.plan_time``) and keeps the fastest whose planned peak fits
the device - where costs are within ``TIE_FRACTION`` of the step's time of the fastest, the one with
the smallest peak (headroom the model's resolution cannot price); with no limit the choice is
recompute none, merge_window 0, offload off (the fastest: it adds nothing). When none fits, the one with the
smallest peak is returned, marked as not fitting, for the refusal to name. An explicit policy is
planned and priced as it is. ``fmoe train`` calls it once in setup (``fmoe.train_setup``); ``fmoe
plan`` for every layout (``choose_layouts``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fmoe.memory_policy import MemoryPolicy
from fmoe.plan import LayoutPlan, WorkingSet, candidate_sizes, micro_batch, plan_policies
from fmoe.plan_time import H200_RATES, Rates, TimeCost, policy_time
from fmoe.schedules.table import Schedule, ScheduleError
from fmoe.stages.spec import Model

__all__ = [
    "CANDIDATE_WINDOWS",
    "TIE_FRACTION",
    "PolicyChoice",
    "candidates",
    "choose",
    "choose_layouts",
    "policy_cost",
]

# the merge windows "auto" tries at pp = 1 (0: the whole step); pipelines do not merge (window 0 only)
CANDIDATE_WINDOWS = (0, 1, 2, 4)
# on a device with a limit, policies whose modelled costs differ by less than this share of the
# step's time are a tie, won by the smaller peak: the model is measured to within 6% per layer
# (benchmarks/results/policy_time_vs_measured_h200.json), so 1% is below what it resolves
TIE_FRACTION = 0.01


@dataclass(frozen=True)
class PolicyChoice:
    """A layout's plan under the policy it runs (``plan.policy``, always explicit), that policy's
    modelled time, whether "auto" picked it, and whether it fits the device."""

    plan: LayoutPlan
    cost: TimeCost
    auto: bool
    fits: bool

    @property
    def policy(self) -> MemoryPolicy:
        return self.plan.policy


def candidates(pp: int, microbatches: int, fp8_cache: bool = True) -> list[MemoryPolicy]:
    """The explicit policies "auto" picks among, the ones expected cheaper first (offload last,
    then recompute none, selective, full, then the window): a tie goes to the earlier. A window is
    tried at pp = 1 only and below the step's micro-batches (a window of all of them is window 0).
    fp8_cache: the recipe's ``memory.fp8_cache``, which "auto" does not choose and keeps."""
    windows = [w for w in CANDIDATE_WINDOWS if w == 0 or (pp == 1 and w < microbatches)]
    return [
        MemoryPolicy(merge_window=w, recompute=recompute, offload=offload, fp8_cache=fp8_cache)
        for offload in (False, True)
        for recompute in ("none", "selective", "full")
        for w in windows
    ]


def policy_cost(recipe, model: Model, plan: LayoutPlan, device: str, rates: Rates = H200_RATES) -> TimeCost:
    """The time model of ``plan``'s policy on its layout (``fmoe.plan_time.policy_time``)."""
    mb = micro_batch(recipe, plan.sizes, device)
    return policy_time(recipe.model_family, recipe.model, model, mb, recipe.train.microbatches,
                       plan.pp, plan.ep, plan.policy, rates)  # fmt: skip


def choose(
    recipe, model: Model, shapes: Mapping[str, Sequence[int]], sizes: tuple[int, int, int, int],
    limit_bytes: float | None, *, policy: MemoryPolicy | None = None, table: Schedule | None = None,
    device: str = "cuda", working_set: WorkingSet | None = None, rates: Rates = H200_RATES,
) -> PolicyChoice:  # fmt: skip
    """The policy layout ``sizes`` runs (see the module docstring). policy: default the recipe's
    ``memory``; limit_bytes: the device's (None: no limit, everything fits)."""
    policy = recipe.memory if policy is None else policy
    auto = policy.policy == "auto"
    tried = candidates(sizes[0], recipe.train.microbatches, policy.fp8_cache) if auto else [policy]
    plans = plan_policies(
        recipe, model, shapes, sizes, tried, table=table, device=device, working_set=working_set
    )
    costs = [policy_cost(recipe, model, p, device, rates) for p in plans]
    fitting = [i for i, p in enumerate(plans) if p.fits(limit_bytes)]
    if fitting and limit_bytes is not None:
        # costs within TIE_FRACTION of the fastest are one cost to the model (measured within 6%
        # per layer): of those, the smallest peak, for headroom against the plan's own error
        fastest = min(costs[i].extra_s for i in fitting)
        near = [i for i in fitting if costs[i].extra_s <= fastest + TIE_FRACTION * costs[i].base_s]
        best = min(near, key=lambda i: (plans[i].peak, i))
    elif fitting:  # no limit: memory is no concern, the fastest (recompute none, the step's merge)
        best = min(fitting, key=lambda i: (costs[i].extra_s, i))
    else:  # nothing fits: the smallest peak, for the refusal
        best = min(range(len(plans)), key=lambda i: (plans[i].peak, costs[i].extra_s, i))
    return PolicyChoice(plans[best], costs[best], auto, bool(fitting))


def choose_layouts(
    recipe, model: Model, shapes, nproc: int, limit_bytes: float | None, *, supports_cp: bool,
    device: str = "cuda", working_set: WorkingSet | None = None, policy: MemoryPolicy | None = None,
) -> list[PolicyChoice]:  # fmt: skip
    """``choose`` for every layout of ``nproc`` processes the recipe can run, fewest idle first
    (bubble, then peak bytes), as ``plan.layouts`` orders them; a pp whose schedule cannot be made
    is left out."""
    out = []
    for sizes in candidate_sizes(recipe, nproc, supports_cp, model.num_experts):
        try:
            out.append(choose(recipe, model, shapes, sizes, limit_bytes, policy=policy, device=device,
                              working_set=working_set))  # fmt: skip
        except (ScheduleError, ValueError):
            continue
    return sorted(out, key=lambda c: (round(c.plan.bubble, 6), c.plan.peak, c.plan.sizes))
