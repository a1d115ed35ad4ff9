"""The micro-batch executor: a stage's F, B and W sequence, written once, and the sequential reference.

Every place that runs stages - the sequential reference, the data-parallel step (``fmoe.parallel``,
pp = 1), the expert-parallel step (``fmoe.expert_parallel.ep_step``) and the pipeline interpreter
(``fmoe.interpreter``, a table's F, B, W, BW and FB rows) - goes through the same four pieces:

    carry, fwd = forward_stage(stage, params, carry, batch, ctx, record)   # inputs, F, loss terms, statistics
    grad, work = backward_stage(fwd, grad, loss_scale)                      # B; W's work kept
    weight_grads(works, merge_later, into=grads)                            # W into the accumulator
    run_steps(num_steps, run_step, hooks, take)                             # StepHooks around each step

and a step's loss comes from ``LossTerms``: every stage's weighted loss outputs per (micro-batch,
loss slot), summed per micro-batch in stage order (``sum_terms``) and averaged (``mean_loss``), the
same float operations whoever ran the stages. ``execute`` is the one-process plan (per micro-batch,
F of every unit first to last, then B + W last to first); ``run_sequential`` is the reference that
every parallel feature is tested against.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fmoe import stage as S
from fmoe.memory_policy import MemoryPolicy
from fmoe.stages.primitives import GroupedWeightGrad, merge_grouped_weight_grads
from fmoe.stages.spec import Model, Stage, StageContext

Batch = Mapping[str, Tensor]


@dataclass
class StepResult:
    """loss: scalar tensor (mean over microbatches); grads: {global name: gradient} for every parameter;
    microbatch_losses: each microbatch's loss; statistics: {Statistic.name: int64 count summed over
    the step's microbatches} for the stages this process ran (``Stage.statistics``)."""

    loss: Tensor
    grads: dict[str, Tensor]
    microbatch_losses: list[Tensor]
    statistics: dict[str, Tensor] = field(default_factory=dict)


def with_positions(batch: Batch) -> dict[str, Tensor]:
    """Add ``positions`` [s] (0..s-1) to a batch of tokens [b, s] that lacks them."""
    out = dict(batch)
    if "positions" not in out:
        out["positions"] = torch.arange(out["tokens"].shape[1], device=out["tokens"].device)
    return out


def split_microbatches(batch: Batch, num_microbatches: int) -> list[dict[str, Tensor]]:
    """Split each [b, ...] field along dim 0 into ``num_microbatches`` equal parts (positions are shared)."""
    batch = with_positions(batch)
    b = batch["tokens"].shape[0]
    if num_microbatches < 1 or b % num_microbatches:
        raise ValueError(f"batch size {b} does not split into {num_microbatches} equal microbatches")
    size = b // num_microbatches
    return [
        {k: (v if k == "positions" else v[i * size : (i + 1) * size]) for k, v in batch.items()}
        for i in range(num_microbatches)
    ]


def stage_inputs(stage: Stage, carry: Sequence[Tensor], batch: Batch) -> tuple[Tensor, ...]:
    """A stage's inputs: the previous stage's carried outputs, then the batch fields it names."""
    missing = [k for k in stage.batch_inputs if k not in batch]
    if missing:
        raise S.StageError(
            f"stage {stage.name!r} needs batch fields {missing}; the batch has {sorted(batch)}"
        )
    return tuple(carry) + tuple(batch[k] for k in stage.batch_inputs)


def split_outputs(stage: Stage, outputs: Sequence[Tensor]) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """(carried outputs, weighted loss terms) of a stage's outputs (its statistics: ``add_statistics``)."""
    n = stage.num_carried(len(outputs))
    terms = tuple(w * outputs[n + i] for i, w in enumerate(stage.losses))
    return tuple(outputs[:n]), terms


def add_statistics(total: dict[str, Tensor], stage: Stage, outputs: Sequence[Tensor]) -> None:
    """total[name] += each of the stage's statistic outputs (the last ``len(stage.statistics)``)."""
    if not stage.statistics:
        return
    for stat, value in zip(stage.statistics, outputs[len(outputs) - len(stage.statistics) :], strict=True):
        value = value.detach()
        total[stat.name] = total[stat.name] + value if stat.name in total else value.clone()


def sum_terms(terms: Sequence[Tensor]) -> Tensor:
    """A microbatch's loss from its loss terms, always summed in stage order (bitwise reproducible)."""
    total = terms[0].float()
    for t in terms[1:]:
        total = total + t.float()
    return total


def mean_loss(microbatch_losses: Sequence[Tensor]) -> Tensor:
    """The step's loss: the micro-batches' losses added in micro-batch order, then divided. One add
    at a time (not a reduction kernel, whose order differs between devices), so the same losses give
    the same bits on any device: the pipeline forms it from its terms on the host, the sequential
    runner where the losses are."""
    total = microbatch_losses[0]
    for loss in microbatch_losses[1:]:
        total = total + loss
    return total / len(microbatch_losses)


def accumulate(total: dict[str, Tensor], grads: Mapping[str, Tensor]) -> None:
    """total[name] += grads[name], in place, creating entries as needed.

    Takes ownership of the tensors of ``grads``: the first one of a name becomes the accumulator, so
    a step's gradients are not copied once more. That is sound for W's results (``backward_weight``,
    ``merged_weight_grads``), which share memory with nothing else (rule 2 of ``fmoe.stage``'s
    ownership rules); pass other tensors only if nothing else reads them until the step's end.
    """
    for name, g in grads.items():
        if name in total:
            total[name] += g
        else:
            total[name] = g


class LossTerms:
    """A step's weighted loss outputs: the value of (micro-batch m, loss slot j), slots numbered in
    stage order over every stage's ``Stage.losses``. Each is written once, by whoever ran the stage;
    the values stay where they were made (no host sync) until the step's losses are formed."""

    def __init__(self, model: Model):
        self.first_slot, n = [], 0
        for stage in model.stages:
            self.first_slot.append(n)
            n += len(stage.losses)
        if n == 0:
            raise S.StageError("the model has no loss outputs (Stage.losses); nothing to train")
        self.num_slots = n
        self.values: dict[tuple[int, int], Tensor] = {}

    def record(self, microbatch: int, stage_index: int, terms: Sequence[Tensor]) -> None:
        """Keep the weighted loss terms stage ``stage_index`` produced for ``microbatch``."""
        for j, t in enumerate(terms):
            self.values[(microbatch, self.first_slot[stage_index] + j)] = t.detach()

    def loss(self, microbatch: int) -> Tensor:
        """One micro-batch's loss: its terms summed in slot (stage) order, all of them recorded here."""
        return sum_terms([self.values[(microbatch, j)] for j in range(self.num_slots)])

    def matrix(self, num_microbatches: int, device: torch.device) -> Tensor:
        """[microbatches, slots] float32 on ``device``, zero where this process ran no stage: the
        sum of all pipeline ranks' matrices holds every term exactly once."""
        out = torch.zeros(num_microbatches, self.num_slots, dtype=torch.float32, device=device)
        for (m, j), t in self.values.items():
            out[m, j] = t.float().reshape(())
        return out

    def losses_from(self, matrix: Tensor) -> list[Tensor]:
        """Each micro-batch's loss from a summed ``matrix`` (the same operations as ``loss``)."""
        return [sum_terms([row[j] for j in range(self.num_slots)]) for row in matrix]


def forward_stage(
    microbatch: int,
    index: int,
    stage: Stage,
    params: Mapping[str, Tensor],
    carry: Sequence[Tensor],
    batch: Batch,
    ctx: StageContext,
    terms: LossTerms,
    statistics: dict[str, Tensor] | None = None,
    observe: Callable[[int, tuple[Tensor, ...]], None] | None = None,
    memory: MemoryPolicy | None = None,
) -> tuple[tuple[Tensor, ...], S.Forwarded]:
    """F of model stage ``index`` for the step's micro-batch number ``microbatch`` (``ctx`` its
    context): its inputs (the carry, then the batch fields it names), the forward, its loss terms
    into ``terms`` (row ``microbatch``), its statistics into
    ``statistics`` (if given); observe(index, inputs) runs first if given; memory: the step's
    memory policy (whether the stage is recomputed or offloaded; None: neither). Returns (the carry
    for the next stage, what B needs)."""
    inputs = stage_inputs(stage, carry, batch)
    if observe is not None:
        observe(index, inputs)
    mode = "none" if memory is None else memory.stage_mode(stage, ctx)
    outputs, fwd = S.forward(stage, params, inputs, ctx, mode)
    carry, stage_terms = split_outputs(stage, outputs)
    terms.record(microbatch, index, stage_terms)
    if statistics is not None:
        add_statistics(statistics, stage, outputs)
    return carry, fwd


def backward_stage(
    fwd: S.Forwarded, grad: Sequence[Tensor | None], loss_scale: float
) -> tuple[tuple[Tensor | None, ...], S.WeightGradWork]:
    """B of one stage: ``grad`` is the gradient of its carried outputs (empty: none flows in, only its
    loss outputs, seeded with ``loss_scale``). Returns (the gradient of the previous stage's carried
    outputs - the batch fields' gradients dropped -, the W work)."""
    stage = fwd.stage
    grad_out = tuple(grad) if grad else (None,) * stage.num_carried(len(fwd.outputs))
    grad_in, work = S.backward_input(fwd, grad_out, loss_scale)
    return tuple(grad_in[: len(grad_in) - len(stage.batch_inputs)]), work


def forward_microbatch(
    model: Model,
    params: Mapping[str, Tensor],
    batch: Batch,
    ctx: StageContext,
    statistics: dict[str, Tensor] | None = None,
) -> tuple[list[S.Forwarded], Tensor]:
    """F of every stage for one microbatch: (what B needs per stage, the microbatch's loss)."""
    terms = LossTerms(model)
    carry: tuple[Tensor, ...] = ()
    fwds = []
    for i, stage in enumerate(model.stages):
        carry, fwd = forward_stage(ctx.microbatch, i, stage, params, carry, batch, ctx, terms, statistics)
        fwds.append(fwd)
    return fwds, terms.loss(ctx.microbatch)


def backward_microbatch(fwds: Sequence[S.Forwarded], loss_scale: float) -> list[S.WeightGradWork]:
    """B of every stage, last to first; returns each stage's W work (in forward order)."""
    works: list[S.WeightGradWork | None] = [None] * len(fwds)
    grad: tuple[Tensor | None, ...] = ()
    for i in range(len(fwds) - 1, -1, -1):
        grad, works[i] = backward_stage(fwds[i], grad, loss_scale)
    return works  # type: ignore[return-value]


def weight_grads(
    works: Sequence[S.WeightGradWork],
    merge_later: dict[str, list[GroupedWeightGrad]] | None = None,
    into: dict[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """W of every stage, summed by parameter name (expert GEMMs left in ``merge_later`` if given).

    into: accumulate into this dict (in place, as ``accumulate`` does; dense weight GEMMs add to
    the existing gradient inside the GEMM) and return it; else a new dict."""
    total: dict[str, Tensor] = {} if into is None else into
    for work in works:
        accumulate(total, S.backward_weight(work, merge_later, into=total))
    return total


def merged_weight_grads(merge_later: dict[str, list[GroupedWeightGrad]]) -> dict[str, Tensor]:
    """The expert weight gradients that ``weight_grads`` left, one merged GEMM per parameter."""
    grads = {name: merge_grouped_weight_grads(parts) for name, parts in merge_later.items()}
    merge_later.clear()
    return grads


def zero_missing(
    grads: dict[str, Tensor], params: Mapping[str, Tensor], names: Sequence[str]
) -> dict[str, Tensor]:
    """Every parameter in ``names`` gets a gradient entry (zeros where none flowed), in that order."""
    return {n: grads[n] if n in grads else torch.zeros_like(params[n]) for n in names}


@dataclass(frozen=True)
class UnitStep:
    """One step of the micro-batch executor (``execute``): phase "F" runs the forward of one unit's
    stages for one microbatch; phase "BW" runs their B (last stage first) and then their W."""

    microbatch: int
    phase: str  # "F" or "BW"
    unit: int


def execution_units(model: Model) -> list[tuple[int, ...]]:
    """The executor's units, in forward order: the stages before the first transformer layer, each
    layer's stages (``Model.layer_of``), the stages after the last layer (empty runs left out)."""
    from fmoe.pipeline import layer_units  # pipeline imports nothing of the runner

    prefix, layers, suffix = layer_units(model)
    return [tuple(u) for u in (prefix, *layers, suffix) if u]


def microbatch_plan(num_units: int, num_microbatches: int) -> list[UnitStep]:
    """The executor's order: per microbatch, F of every unit first to last, then B + W of every unit
    last to first (one microbatch's activations alive at a time)."""
    plan = []
    for m in range(num_microbatches):
        plan += [UnitStep(m, "F", u) for u in range(num_units)]
        plan += [UnitStep(m, "BW", u) for u in reversed(range(num_units))]
    return plan


@dataclass(frozen=True)
class StepHooks:
    """What a caller runs around the steps of an executor (``execute``'s plan steps, or the pipeline
    interpreter's actions): how ``fmoe.parallel`` gathers a unit's parameters just before it is used
    and reduce-scatters its gradients as soon as they are final.

    before(k): step k is about to run; the parameters it reads must be readable when this returns.
    after(k): step k has run (called before its gradients are taken: parameters may be freed).
    take: {step k: parameter names whose gradients are final once step k has run}; after ``after(k)``
        the executor pops them from its accumulator (zeros where no gradient flowed; the parameters'
        data is not read) and hands them to ``taken``.
    taken(grads): {name: full gradient}, owned by the callee from then on.
    """

    before: Callable[[int], None]
    after: Callable[[int], None]
    take: Mapping[int, tuple[str, ...]]
    taken: Callable[[dict[str, Tensor]], None]


def run_merged(
    grads: dict[str, Tensor], merge_later: dict[str, list[GroupedWeightGrad]] | None, names: Iterable[str]
) -> None:
    """Run the merged expert GEMMs ``merge_later`` holds for ``names`` into the accumulator ``grads``
    (a merge window's end, or a gradient taken)."""
    if merge_later:
        pending = {n: merge_later.pop(n) for n in names if n in merge_later}
        accumulate(grads, merged_weight_grads(pending))


def take_grads(
    grads: dict[str, Tensor],
    merge_later: dict[str, list[GroupedWeightGrad]] | None,
    params: Mapping[str, Tensor],
    names: Sequence[str],
) -> dict[str, Tensor]:
    """Pop the final gradients of ``names`` from an accumulator: their merged expert GEMMs added,
    zeros where no gradient flowed (shaped and typed like ``params[n]``, whose data is not read)."""
    run_merged(grads, merge_later, names)
    return {n: grads.pop(n) if n in grads else torch.zeros_like(params[n]) for n in names}


def run_steps(
    num_steps: int,
    run_step: Callable[[int], None],
    hooks: StepHooks | None,
    take: Callable[[Sequence[str]], dict[str, Tensor]],
) -> set[str]:
    """Run steps 0..num_steps-1 with ``hooks`` around each: before(k), run_step(k), after(k), then
    the gradients final after step k (``take(names)``) handed to ``hooks.taken``. Returns the names
    taken (none without hooks): the caller returns the rest."""
    for k in range(num_steps):
        if hooks is not None:
            hooks.before(k)
        run_step(k)
        if hooks is not None:
            hooks.after(k)
            if k in hooks.take:
                hooks.taken(take(hooks.take[k]))
    return {n for names in hooks.take.values() for n in names} if hooks is not None else set()


def execute(
    model: Model,
    params: Mapping[str, Tensor],
    microbatches: Sequence[Batch],
    contexts: Sequence[StageContext],
    loss_scale: float,
    *,
    merge_expert_grads: bool = True,
    statistics: dict[str, Tensor] | None = None,
    observe: Callable[[int, tuple[Tensor, ...]], None] | None = None,
    hooks: StepHooks | None = None,
    memory: MemoryPolicy | None = None,
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """The micro-batch executor: run ``microbatch_plan`` over ``execution_units`` in one process;
    return (each microbatch's loss, {name: gradient} summed over the microbatches).

    microbatches: {"tokens": [b, s], "labels": [b, s], "positions": [s]} each, contexts: one
    StageContext each; loss_scale: the seed of every loss output; merge_expert_grads: one expert
    weight GEMM per merge window (``memory.merge_window``; 0: the step) at the window's last B of
    the unit; statistics: summed into if given; observe(stage index, inputs): before each F;
    hooks: ``StepHooks`` (k counts the plan's steps); memory: ``fmoe.memory_policy`` (None: defaults).
    The gradients hold every parameter ``hooks`` did not take (zeros where none flowed), in model
    order, added in microbatch order: bitwise independent of the hooks and the recomputation; the
    merge window changes only the order an expert gradient's terms are summed in.
    """
    memory = memory or MemoryPolicy()
    units = execution_units(model)
    plan = microbatch_plan(len(units), len(microbatches))
    grads: dict[str, Tensor] = {}
    merge_later: dict[str, list[GroupedWeightGrad]] | None = {} if merge_expert_grads else None
    terms = LossTerms(model)
    carry: tuple = ()  # the microbatch in flight: F's carry, then B's output gradient
    fwds: list[S.Forwarded | None] = [None] * len(model.stages)

    def run_step(k: int) -> None:
        nonlocal carry
        step = plan[k]
        mb, ctx = microbatches[step.microbatch], contexts[step.microbatch]
        if step.phase == "F":
            for i in units[step.unit]:
                carry, fwds[i] = forward_stage(
                    step.microbatch, i, model.stages[i], params, carry, mb, ctx, terms, statistics, observe,
                    memory,
                )  # fmt: skip
            if step.unit == len(units) - 1:
                carry = ()  # B starts from the loss outputs alone
            return
        works = []
        for i in reversed(units[step.unit]):
            fwd, fwds[i] = fwds[i], None  # drop the activation as soon as its B has run
            carry, work = backward_stage(fwd, carry, loss_scale)
            works.append(work)
        weight_grads(works[::-1], merge_later, into=grads)
        if memory.merge_closes(step.microbatch, len(microbatches)):  # this unit's window ends
            run_merged(grads, merge_later, unit_params[step.unit])

    unit_params = [{n for i in unit for n in model.stages[i].params} for unit in units]
    taken = run_steps(len(plan), run_step, hooks, lambda names: take_grads(grads, merge_later, params, names))
    rest = [n for n in model.param_names() if n not in taken]
    losses = [terms.loss(m) for m in range(len(microbatches))]
    return losses, take_grads(grads, merge_later, params, rest)


def run_sequential(
    model: Model,
    params: Mapping[str, Tensor],
    batch: Batch,
    num_microbatches: int = 1,
    seed: int = 0,
    merge_expert_grads: bool = True,
    memory: MemoryPolicy | None = None,
) -> StepResult:
    """One training step's loss and gradients (``execute``: per microbatch F of all stages, then B
    last to first, each layer's W after its B).

    batch: {"tokens": [b, s] int64, "labels": [b, s] int64, optional "positions"}.
    merge_expert_grads: run the expert-grouped weight GEMMs once for the whole step over all its
    microbatches' rows (``merge_grouped_weight_grads``) instead of once per microbatch plus an add;
    the inputs and output gradients of those GEMMs are then held until the step's end (or the end
    of ``memory.merge_window`` micro-batches); memory: see ``execute``.
    """
    microbatches = split_microbatches(batch, num_microbatches)
    contexts = [StageContext(microbatch=i, seed=seed) for i in range(num_microbatches)]
    statistics: dict[str, Tensor] = {}
    losses, grads = execute(
        model, params, microbatches, contexts, 1.0 / num_microbatches,
        merge_expert_grads=merge_expert_grads, statistics=statistics, memory=memory,
    )  # fmt: skip
    return StepResult(mean_loss(losses), grads, losses, statistics)


def model_loss(
    model: Model, params: Mapping[str, Tensor], batch: Batch, num_microbatches: int = 1, seed: int = 0
) -> Tensor:
    """The same step's loss as one plain differentiable function of ``params`` (no derivation):
    the reference ``run_sequential`` is checked against with ``torch.autograd``."""
    losses = []
    for i, mb in enumerate(split_microbatches(batch, num_microbatches)):
        carry: tuple[Tensor, ...] = ()
        terms: list[Tensor] = []
        for stage in model.stages:
            outputs = S.call(
                stage, params, stage_inputs(stage, carry, mb), StageContext(microbatch=i, seed=seed)
            )
            carry, stage_terms = split_outputs(stage, outputs)
            terms.extend(stage_terms)
        losses.append(sum_terms(terms))
    return mean_loss(losses)
