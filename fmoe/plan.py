"""The memory plan: what each rank of a (pp, dp, cp, ep) layout holds at its peak, before anything runs.

Pure functions from a recipe's model config, parameter shapes, mesh sizes and schedule table to
bytes; nothing here touches a process group or allocates a tensor. For every rank the plan gives

  params       fp32 master shards (``sharding.planned_layout``: experts over dp x cp after ep
               took its share, the rest over dp x cp x ep, each flat tensor padded to its group)
  optimizer    AdamW's two fp32 moments over the same shards
  grads        the gradients the step holds (``WorkingSet.STEP``: this rank's full gradients, in
               the dtype W makes them, plus the fp32 copy ``parallel_step`` makes before its
               reduce-scatter; ``WorkingSet.UNIT``: the fp32 gradient shards)
  gathered     the parameters gathered in the compute dtype (``STEP``: all of this rank's, for the
               whole step; ``UNIT``: ``working_set.gathered_working_set_bytes``: the step's own gather
               plan per layer or pipeline chunk, replayed, with the full gradients)
  activations  the most bytes of saved activations in flight: the schedule's rows walked in order,
               each F adding its (micro-batch, chunk)'s bytes and each W / BW / FB's backward half
               freeing them (the simulator's ``peak_activations`` count, weighted by chunk)

and the peak those make together (:func:`plan_layout`). :func:`layouts` lists the layouts of N
processes the recipe can run on, ranked by the simulator's bubble; ``fmoe plan`` prints them, and
``fmoe train`` logs its own layout's plan and refuses one that does not fit before the first step.

The activation formulas per family, and their walk over a rank's step, are ``fmoe.plan_activations``;
this module adds the terms up per layout, searches the layouts, and writes the text ``fmoe plan``
and ``fmoe train`` print.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from fmoe import pipeline
from fmoe.gather_plan import per_unit
from fmoe.memory_policy import MemoryPolicy
from fmoe.mesh import DIMS, Mesh, MeshError, check_sizes
from fmoe.plan_activations import ACTIVATION_FORMULAS, FP32, MicroBatch, rank_activation_peaks
from fmoe.plan_fp8 import Fp8Caching
from fmoe.schedules.generators import generate
from fmoe.schedules.simulator import simulate
from fmoe.schedules.table import Schedule, ScheduleError
from fmoe.schedules.verify import validate
from fmoe.sharding import ShardInfo, planned_layout
from fmoe.stages.spec import Model
from fmoe.working_set import gathered_working_set_bytes

__all__ = [
    "DTYPE_BYTES",
    "GiB",
    "LayoutPlan",
    "RankTerms",
    "TERMS",
    "WorkingSet",
    "candidate_sizes",
    "device_limit_bytes",
    "gib",
    "human",
    "layout_name",
    "layouts",
    "policy_text",
    "master_bytes",
    "optimizer_bytes",
    "plan_layout",
    "rank_lines",
    "recipe_working_set",
    "refusal",
    "step_grads_bytes",
    "summary",
    "table_lines",
]

GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
TERMS = ("params", "grads", "optimizer", "gathered", "activations")


class WorkingSet(enum.Enum):
    """Which gather policy the ``gathered`` and ``grads`` terms describe.

    STEP: today's ``parallel_step``: every parameter of the rank gathered once per step and held to
    its end; full gradients held until one reduce-scatter after the last W.
    UNIT: parameters gathered per pipeline chunk (pp > 1) or per layer (pp = 1) just before first
    use, one unit prefetched ahead, freed after last use; each unit's gradients reduce-scattered
    right after its last W (issue 20 part 2).
    """

    STEP = "step"
    UNIT = "unit"


# ------------------------------------------------------------------------------------------------
# parameters, gradients, optimizer state


def master_bytes(infos: Mapping[str, ShardInfo]) -> int:
    """fp32 master weights: every shard."""
    return sum(i.shard_numel for i in infos.values()) * FP32


def optimizer_bytes(infos: Mapping[str, ShardInfo]) -> int:
    """AdamW's exp_avg and exp_avg_sq, fp32, shaped like the shards (its scalars are noise)."""
    return 2 * sum(i.shard_numel for i in infos.values()) * FP32


def _gathered_bytes(info: ShardInfo, compute_bytes: int, uncast: bool) -> int:
    """Bytes ``collectives.gather_params`` makes for one parameter: a buffer of the padded shards in
    the compute dtype (fp32 for a buffer); nothing when the group is one rank and no cast is made
    (the shard itself is used)."""
    element = FP32 if uncast else compute_bytes
    if info.size > 1:
        return info.padded_numel * element
    return 0 if element == FP32 else info.numel * element


def step_grads_bytes(
    infos: Mapping[str, ShardInfo], compute_bytes: int, dp: int, cp: int, ep: int, buffers
) -> int:
    """``WorkingSet.STEP``: the full gradients W makes (in the compute dtype; a buffer's in fp32),
    plus the fp32 copy ``parallel_step`` makes of each one it scales or sums over ranks, plus the
    fp32 shards the reduce-scatter returns - all alive together at the end of the step."""
    total = 0
    scale = dp * cp * ep != 1
    for name, info in infos.items():
        element = FP32 if name in buffers else compute_bytes
        total += info.numel * element
        if element != FP32 and (scale or info.size > 1):
            total += info.numel * FP32  # g.float(): the compute-dtype gradient is still referenced
        if info.size > 1:
            total += info.shard_numel * FP32
    return total


# ------------------------------------------------------------------------------------------------
# one rank, one layout


@dataclass(frozen=True)
class RankTerms:
    """One rank's planned memory, bytes. ``peak`` = params + optimizer + the larger of the step
    phase (gathered + activations + the gradients W has made) and, under ``WorkingSet.STEP``, the
    reduce phase after the last W (``grads``: full gradients, their fp32 copy and the shards)."""

    rank: int
    coords: tuple[int, int, int, int]  # (pp, dp, cp, ep) indices
    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: int
    peak: int

    def largest_term(self) -> tuple[str, int]:
        return max(((n, getattr(self, n)) for n in TERMS), key=lambda kv: kv[1])


@dataclass(frozen=True)
class LayoutPlan:
    """A layout's plan: sizes, the schedule's simulated bubble (max over pipeline ranks; 0 for
    pp = 1), and one RankTerms per pipeline rank (the ranks of a pipeline stage hold the same)."""

    pp: int
    dp: int
    cp: int
    ep: int
    schedule: str
    bubble: float
    stage_terms: tuple[RankTerms, ...]  # index: pipeline rank
    activations_planned: bool = True  # False: a family the activation formulas do not know (0 counted)
    policy: MemoryPolicy = field(default_factory=MemoryPolicy)  # the [memory] the activations assume

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.cp, self.ep)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.ep

    @property
    def peak(self) -> int:
        return max(t.peak for t in self.stage_terms)

    def worst(self) -> RankTerms:
        return max(self.stage_terms, key=lambda t: t.peak)

    def ranks_of(self, pp_rank: int) -> list[int]:
        """The global ranks of pipeline rank ``pp_rank`` (``fmoe.mesh``: pp is the outermost dim)."""
        per = self.dp * self.cp * self.ep
        return list(range(pp_rank * per, (pp_rank + 1) * per))

    def fits(self, limit_bytes: float | None) -> bool:
        return limit_bytes is None or self.peak <= limit_bytes


def _table(recipe, pp: int) -> Schedule | None:
    """The recipe's schedule for ``pp`` ranks (None for pp = 1); ScheduleError if it cannot be made."""
    if pp == 1:
        return None
    p = recipe.parallel
    if p.schedule.endswith(".csv"):
        from fmoe.schedules.table import read_csv

        table = read_csv(p.schedule)
        if table.pp != pp or table.microbatches != recipe.train.microbatches:
            raise ScheduleError(f"{p.schedule} is for pp={table.pp}, microbatches={table.microbatches}")
    else:
        options = {"chunks": p.chunks} if p.schedule == "interleaved-1f1b" else {}
        table = generate(p.schedule, pp, recipe.train.microbatches, **options)
    validate(table)
    return table


def plan_layout(
    recipe,
    model: Model,
    shapes: Mapping[str, Sequence[int]],
    sizes: tuple[int, int, int, int],
    *,
    table: Schedule | None = None,
    device: str = "cuda",
    working_set: WorkingSet | None = None,
    policy: MemoryPolicy | None = None,
) -> LayoutPlan:
    """The plan of ``recipe`` on mesh ``sizes`` = (pp, dp, cp, ep).

    table: the pipeline schedule (default: the recipe's, made for pp); device: "cuda" or "cpu";
    working_set: None plans what ``parallel_step`` will do (``recipe_working_set``); policy: the
    ``[memory]`` policy the activations are planned for (default: the recipe's ``memory``)."""
    pp, dp, cp, ep = sizes
    policy = recipe.memory if policy is None else policy
    if working_set is None:
        working_set = recipe_working_set(recipe, sizes)
    t = recipe.train
    if pp > 1 and table is None:
        table = _table(recipe, pp)
    seqs = t.global_batch // (dp * ep) // t.microbatches
    mb = MicroBatch(seqs, recipe.data.seq_len // cp, recipe.data.seq_len, DTYPE_BYTES[t.dtype], device)
    bubble = max(simulate(table).bubble) if table is not None else 0.0
    terms = tuple(
        _rank_terms(recipe, model, shapes, sizes, table, r, mb, working_set, policy) for r in range(pp)
    )
    name = "-" if table is None else (recipe.parallel.schedule if pp > 1 else "-")
    planned = recipe.model_family in ACTIVATION_FORMULAS
    return LayoutPlan(pp, dp, cp, ep, name, bubble, terms, activations_planned=planned, policy=policy)


def _rank_terms(
    recipe, model: Model, shapes: Mapping[str, Sequence[int]], sizes: tuple[int, int, int, int],
    table: Schedule | None, r: int, mb: MicroBatch, working_set: WorkingSet, policy: MemoryPolicy,
) -> RankTerms:  # fmt: skip
    """The terms of pipeline rank ``r`` (its dp = cp = ep = 0 member: every member holds the same)."""
    pp, dp, cp, ep = sizes
    t, e, buffers = recipe.train, mb.compute_bytes, frozenset(model.buffers)
    mesh = Mesh(pp, dp, cp, ep, rank=r * dp * cp * ep, coords={**dict.fromkeys(DIMS, 0), "pp": r})
    names = pipeline.local_param_names(model, table, rank=r) if table is not None else list(shapes)
    infos = planned_layout(model, mesh, shapes, names)
    params, opt = master_bytes(infos), optimizer_bytes(infos)
    family = ACTIVATION_FORMULAS.get(recipe.model_family)
    acts = acts_and_grads = 0
    if family is not None:
        w_bytes = {n: i.numel * (FP32 if n in buffers else e) for n, i in infos.items()}
        fp8 = Fp8Caching.of(t.fp8, t.fp8_dense, policy, pp, t.microbatches, model.num_experts // ep)
        acts, acts_and_grads = rank_activation_peaks(
            family, recipe.model, model, table, r, mb, w_bytes, t.microbatches, policy, ep, fp8
        )
    if working_set is WorkingSet.STEP:
        gathered = sum(_gathered_bytes(i, e, n in buffers) for n, i in infos.items())
        grads = step_grads_bytes(infos, e, dp, cp, ep, buffers)
        peak = params + opt + max(gathered + acts_and_grads, grads)
    else:
        gathered = gathered_working_set_bytes(
            model, mesh, shapes, names, None if t.dtype == "float32" else torch.bfloat16,
            num_microbatches=t.microbatches, schedule=table if pp > 1 else None,
        )  # fmt: skip
        grads = sum(i.shard_numel for i in infos.values()) * FP32
        peak = params + opt + grads + gathered + acts
    return RankTerms(mesh.rank, (r, 0, 0, 0), params, grads, opt, gathered, acts, peak)


def recipe_working_set(recipe, sizes: tuple[int, int, int, int]) -> WorkingSet:
    """The gathers ``parallel_step`` does for this recipe on these sizes: per unit
    (``parallel.gather = "chunk"``) where some parameter is sharded (dp x cp x ep > 1) and FP8 is
    off, else once for the step (``gather_plan.per_unit``, the step's own test)."""
    _, dp, cp, ep = sizes
    unit = per_unit(recipe.parallel.gather, recipe.train.fp8, sharded=dp * cp * ep > 1)
    return WorkingSet.UNIT if unit else WorkingSet.STEP


def candidate_sizes(
    recipe, nproc: int, supports_cp: bool, num_experts: int
) -> list[tuple[int, int, int, int]]:
    """Every (pp, dp, cp, ep) of ``nproc`` processes the recipe's sizes allow (``check_sizes``)."""
    out = []
    divisors = [d for d in range(1, nproc + 1) if nproc % d == 0]
    t = recipe.train
    for pp in divisors:
        for dp in divisors:
            for cp in divisors:
                if nproc % (pp * dp * cp) or (cp > 1 and not supports_cp):
                    continue
                ep = nproc // (pp * dp * cp)
                try:
                    check_sizes(pp, dp, cp, ep, nproc, microbatches=t.microbatches, schedule=recipe.parallel.schedule,
                                num_experts=num_experts, seq_len=recipe.data.seq_len,
                                global_batch=t.global_batch)  # fmt: skip
                except MeshError:
                    continue
                out.append((pp, dp, cp, ep))
    return out


def layouts(
    recipe, model: Model, shapes, nproc: int, *, supports_cp: bool, device: str = "cuda",
    working_set: WorkingSet | None = None, policy: MemoryPolicy | None = None,
) -> list[LayoutPlan]:  # fmt: skip
    """The plans of every layout of ``nproc`` processes the recipe can run, fewest idle first
    (bubble, then peak bytes). A pp whose schedule cannot be made (too few micro-batches) is left out."""
    plans = []
    for sizes in candidate_sizes(recipe, nproc, supports_cp, model.num_experts):
        try:
            plans.append(
                plan_layout(
                    recipe, model, shapes, sizes, device=device, working_set=working_set, policy=policy
                )
            )
        except (ScheduleError, ValueError):
            continue
    return sorted(plans, key=lambda p: (round(p.bubble, 6), p.peak, p.sizes))


# ------------------------------------------------------------------------------------------------
# text


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


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


def refusal(plan: LayoutPlan, limit_bytes: float) -> str | None:
    """The one line refusing ``plan`` when a rank's peak exceeds ``limit_bytes`` (else None): the
    rank, its peak and its largest term."""
    worst = plan.worst()
    if worst.peak <= limit_bytes:
        return None
    term, size = worst.largest_term()
    pp_rank = plan.stage_terms.index(worst)
    return (
        f"memory plan: rank {plan.ranks_of(pp_rank)[0]} (pp {pp_rank}) needs {human(worst.peak)}, "
        f"more than the device's {human(limit_bytes)}; its largest term is {term} ({human(size)}) "
        f"on layout {layout_name(plan)}: run `fmoe plan` for layouts that fit"
    )


# ------------------------------------------------------------------------------------------------
# the recipe's own layout (``fmoe train``) and the command line (``fmoe plan``)


def device_limit_bytes(recipe, device_type: str, cuda_total: int | None = None) -> float | None:
    """The bytes a rank may plan for: ``train.device_memory_gib`` when set, else the CUDA device's
    total (``cuda_total``), else no limit (a CPU run without the field)."""
    if recipe.train.device_memory_gib > 0:
        return recipe.train.device_memory_gib * GiB
    return float(cuda_total) if device_type == "cuda" and cuda_total else None


def summary(plan: LayoutPlan, limit_bytes: float | None) -> str:
    """The compact block ``fmoe train`` prints at its start (rank 0)."""
    limit = "no limit" if limit_bytes is None else f"{human(limit_bytes)} per device"
    head = (f"memory plan, {layout_name(plan)} ({plan.schedule}, bubble {plan.bubble:.3f}), {limit}, "
            f"{policy_text(plan.policy)}:")  # fmt: skip
    if not plan.activations_planned:
        head += " (activations not planned: fmoe.plan has no formulas for this family)"
    return "\n".join([head, *rank_lines(plan)])


def policy_text(policy: MemoryPolicy) -> str:
    """The ``[memory]`` policy a plan's activations are for, in one phrase."""
    roles = f" ({', '.join(policy.recompute_roles)})" if policy.recompute_roles else ""
    window = "step" if policy.merge_window == 0 else str(policy.merge_window)
    return (f"memory: recompute {policy.recompute}{roles}, merge_window {window}, "
            f"offload {'on' if policy.offload else 'off'}")  # fmt: skip


def table_lines(plans: Sequence[LayoutPlan], limit_bytes: float | None) -> list[str]:
    """One line per layout: sizes, schedule, bubble, peak, largest term of its fullest rank, fits."""
    unit, scale = ("GiB", GiB) if max((p.peak for p in plans), default=GiB) >= GiB else ("MiB", 2**20)
    lines = [f"{'pp':>3} {'dp':>3} {'cp':>3} {'ep':>3}  {'schedule':<16} {'bubble':>6}  {'peak ' + unit:>9}  "
             f"{f'largest term ({unit})':<24} fits"]  # fmt: skip
    for p in plans:
        term, size = p.worst().largest_term()
        fits = "yes" if p.fits(limit_bytes) else "no"
        lines.append(
            f"{p.pp:>3} {p.dp:>3} {p.cp:>3} {p.ep:>3}  {p.schedule:<16} {p.bubble:>6.3f}  {p.peak / scale:>9.2f}  "
            f"{f'{term} {size / scale:.2f}':<24} {fits}"
        )
    return lines
