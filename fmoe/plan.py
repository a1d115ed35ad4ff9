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
               plan per layer or pipeline chunk, replayed, with the full gradients); with
               ``train.fp8``, also the step's FP8 copies of the weights (:func:`fp8_weight_bytes`)
  activations  the most bytes of saved activations in flight: the schedule's rows walked in order,
               each F adding its (micro-batch, chunk)'s bytes and each W / BW / FB's backward half
               freeing them (the simulator's ``peak_activations`` count, weighted by chunk)

and the peak those make together (:func:`plan_layout`; :func:`plan_policies` for several memory
policies at once). :func:`layouts` lists the layouts of N
processes the recipe can run on, ranked by the simulator's bubble; ``fmoe plan`` prints them, and
``fmoe train`` logs its own layout's plan and refuses one that does not fit before the first step.

The activation formulas per family, and their walk over a rank's step, are ``fmoe.plan_activations``;
this module adds the terms up per layout and searches the layouts. ``fmoe.plan_policy`` picks a
layout's memory policy (``memory.policy = "auto"``); ``fmoe.plan_text`` writes what ``fmoe plan``
and ``fmoe train`` print.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from fmoe import pipeline
from fmoe.collectives import uncast_params
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
    "FP8_BLOCK",
    "GiB",
    "LayoutPlan",
    "RankTerms",
    "TERMS",
    "WorkingSet",
    "candidate_sizes",
    "device_limit_bytes",
    "fp8_weight_bytes",
    "layouts",
    "master_bytes",
    "micro_batch",
    "optimizer_bytes",
    "plan_layout",
    "plan_policies",
    "recipe_working_set",
    "step_grads_bytes",
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
    the compute dtype (fp32 where ``uncast``: a buffer, or an FP8 step's expert weight); nothing when
    the group is one rank and no cast is made (the shard itself is used)."""
    element = FP32 if uncast else compute_bytes
    if info.size > 1:
        return info.padded_numel * element
    return 0 if element == FP32 else info.numel * element


FP8_BLOCK = 128  # the FP8 weights' block (``fmoe.kernels.fp8_quant``: 128 x 128 scales)


def fp8_weight_bytes(infos: Mapping[str, ShardInfo], fp8_dense: bool) -> int:
    """With ``train.fp8``: the FP8 copies a step makes of its weights (``fmoe.stages.fp8_mode``:
    each weight quantized once per step, the copy kept to the step's end) - the weight and its
    transpose in E4M3 (1 byte an element each) and their 128 x 128 block scales (fp32, twice). Counted
    for every weight whose last two dims are multiples of 128 (the experts'; the dense ones too unless
    ``train.fp8_dense`` is off): an upper bound, for the embedding, the router and the LM head, which
    stay in the compute dtype, are counted where their dims allow."""
    total = 0
    for info in infos.values():
        shape = info.full_shape
        if len(shape) < 2 or shape[-1] % FP8_BLOCK or shape[-2] % FP8_BLOCK:
            continue
        if info.expert or fp8_dense:
            total += 2 * info.numel + 2 * FP32 * (info.numel // FP8_BLOCK**2)
    return total


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


def micro_batch(recipe, sizes: tuple[int, int, int, int], device: str) -> MicroBatch:
    """One micro-batch of a rank of layout ``sizes``: the recipe's batch over dp x ep and its
    micro-batches, each sequence split over cp."""
    _, dp, cp, ep = sizes
    t = recipe.train
    seqs = t.global_batch // (dp * ep) // t.microbatches
    return MicroBatch(seqs, recipe.data.seq_len // cp, recipe.data.seq_len, DTYPE_BYTES[t.dtype], device)


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
    ``[memory]`` policy the activations are planned for (default: the recipe's ``memory``; an
    "auto" one is planned as its fields, recompute none, merge_window 0, offload off: what it
    becomes with no device limit; ``fmoe.plan_policy.choose`` picks one for a limit)."""
    policy = recipe.memory if policy is None else policy
    return plan_policies(recipe, model, shapes, sizes, [policy], table=table, device=device,
                         working_set=working_set)[0]  # fmt: skip


def plan_policies(
    recipe, model: Model, shapes: Mapping[str, Sequence[int]], sizes: tuple[int, int, int, int],
    policies: Sequence[MemoryPolicy], *, table: Schedule | None = None, device: str = "cuda",
    working_set: WorkingSet | None = None,
) -> list[LayoutPlan]:  # fmt: skip
    """``plan_layout`` of ``sizes`` under each of ``policies``, in order: the terms no policy changes
    (parameters, optimizer state, gathers, gradients) computed once."""
    pp, dp, cp, ep = sizes
    if working_set is None:
        working_set = recipe_working_set(recipe, sizes)
    if pp > 1 and table is None:
        table = _table(recipe, pp)
    mb = micro_batch(recipe, sizes, device)
    bubble = max(simulate(table).bubble) if table is not None else 0.0
    states = [_rank_state(recipe, model, shapes, sizes, table, r, mb, working_set) for r in range(pp)]
    name = "-" if table is None else (recipe.parallel.schedule if pp > 1 else "-")
    planned = recipe.model_family in ACTIVATION_FORMULAS
    return [
        LayoutPlan(
            pp,
            dp,
            cp,
            ep,
            name,
            bubble,
            tuple(_rank_terms(recipe, model, table, s, mb, working_set, policy, ep) for s in states),
            activations_planned=planned,
            policy=policy,
        )  # fmt: skip
        for policy in policies
    ]


@dataclass(frozen=True)
class _RankState:
    """What a pipeline rank holds whatever the memory policy (bytes), and its gradients' sizes."""

    pp_rank: int
    rank: int
    params: int
    optimizer: int
    gathered: int
    grads: int
    grad_bytes: dict[str, int]  # {name: bytes of its full gradient in the dtype W makes it}


def _rank_state(
    recipe, model: Model, shapes: Mapping[str, Sequence[int]], sizes: tuple[int, int, int, int],
    table: Schedule | None, r: int, mb: MicroBatch, working_set: WorkingSet,
) -> _RankState:  # fmt: skip
    """The policy-free terms of pipeline rank ``r`` (its dp = cp = ep = 0 member: every member
    holds the same)."""
    pp, dp, cp, ep = sizes
    t, e, buffers = recipe.train, mb.compute_bytes, frozenset(model.buffers)
    mesh = Mesh(pp, dp, cp, ep, rank=r * dp * cp * ep, coords={**dict.fromkeys(DIMS, 0), "pp": r})
    names = pipeline.local_param_names(model, table, rank=r) if table is not None else list(shapes)
    infos = planned_layout(model, mesh, shapes, names)
    w_bytes = {n: i.numel * (FP32 if n in buffers else e) for n, i in infos.items()}
    if working_set is WorkingSet.STEP:
        uncast = uncast_params(model, infos, t.fp8)  # an FP8 step's whole expert weights too: no copy
        gathered = sum(_gathered_bytes(i, e, n in uncast) for n, i in infos.items())
        if t.fp8:  # the FP8 copies of the gathered weights (FP8 steps gather once a step)
            gathered += fp8_weight_bytes({n: i for n, i in infos.items() if n not in buffers}, t.fp8_dense)
        grads = step_grads_bytes(infos, e, dp, cp, ep, buffers)
    else:
        gathered = gathered_working_set_bytes(
            model, mesh, shapes, names, None if t.dtype == "float32" else torch.bfloat16,
            num_microbatches=t.microbatches, schedule=table if pp > 1 else None,
        )  # fmt: skip
        grads = sum(i.shard_numel for i in infos.values()) * FP32
    return _RankState(r, mesh.rank, master_bytes(infos), optimizer_bytes(infos), gathered, grads, w_bytes)


def _rank_terms(
    recipe, model: Model, table: Schedule | None, s: _RankState, mb: MicroBatch, working_set: WorkingSet,
    policy: MemoryPolicy, ep: int,
) -> RankTerms:  # fmt: skip
    """The terms of pipeline rank ``s.pp_rank`` under ``policy``: its activations added to ``s``."""
    family = ACTIVATION_FORMULAS.get(recipe.model_family)
    acts = acts_and_grads = 0
    if family is not None:
        t, pp = recipe.train, 1 if table is None else table.pp
        fp8 = Fp8Caching.of(
            t.fp8,
            t.fp8_dense,
            policy,
            pp,
            t.microbatches,
            model.num_experts // ep,
            t.fp8_dense_wgrad,
            t.fp8_expert_wgrad,
        )
        acts, acts_and_grads = rank_activation_peaks(
            family, recipe.model, model, table, s.pp_rank, mb, s.grad_bytes, t.microbatches, policy, ep, fp8
        )  # fmt: skip
    if working_set is WorkingSet.STEP:
        peak = s.params + s.optimizer + max(s.gathered + acts_and_grads, s.grads)
    else:
        peak = s.params + s.optimizer + s.grads + s.gathered + acts
    return RankTerms(s.rank, (s.pp_rank, 0, 0, 0), s.params, s.grads, s.optimizer, s.gathered, acts, peak)


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
# the recipe's own layout (``fmoe train``) and the command line (``fmoe plan``)


def device_limit_bytes(recipe, device_type: str, cuda_total: int | None = None) -> float | None:
    """The bytes a rank may plan for: ``train.device_memory_gib`` when set, else the CUDA device's
    total (``cuda_total``), else no limit (a CPU run without the field)."""
    if recipe.train.device_memory_gib > 0:
        return recipe.train.device_memory_gib * GiB
    return float(cuda_total) if device_type == "cuda" and cuda_total else None
