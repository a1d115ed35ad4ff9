"""The sequential reference: a model's stages run one after another in one process.

Every parallel feature (pipeline schedules, expert and data parallelism) is tested against
:func:`run_sequential`. A step's loss is the mean over microbatches of each microbatch's loss, the
sum of every stage's weighted loss outputs (cross-entropy, router aux losses).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fmoe import stage as S
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
    return torch.stack(list(microbatch_losses)).sum() / len(microbatch_losses)


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


def forward_microbatch(
    model: Model,
    params: Mapping[str, Tensor],
    batch: Batch,
    ctx: StageContext,
    statistics: dict[str, Tensor] | None = None,
) -> tuple[list[S.Forwarded], Tensor]:
    """F of every stage for one microbatch: (what B needs per stage, the microbatch's loss).

    statistics: if given, the stages' statistic outputs are added into it (``add_statistics``)."""
    carry: tuple[Tensor, ...] = ()
    fwds, terms = [], []
    for stage in model.stages:
        outputs, fwd = S.forward(stage, params, stage_inputs(stage, carry, batch), ctx)
        carry, stage_terms = split_outputs(stage, outputs)
        if statistics is not None:
            add_statistics(statistics, stage, outputs)
        fwds.append(fwd)
        terms.extend(stage_terms)
    return fwds, sum_terms(terms)


def backward_microbatch(fwds: Sequence[S.Forwarded], loss_scale: float) -> list[S.WeightGradWork]:
    """B of every stage, last to first; returns each stage's W work (in forward order)."""
    works: list[S.WeightGradWork | None] = [None] * len(fwds)
    grad: tuple[Tensor | None, ...] = ()
    for i in range(len(fwds) - 1, -1, -1):
        fwd = fwds[i]
        carried = fwd.stage.num_carried(len(fwd.outputs))
        grad_out = grad if grad else (None,) * carried
        grad_in, works[i] = S.backward_input(fwd, grad_out, loss_scale)
        grad = grad_in[: len(grad_in) - len(fwd.stage.batch_inputs)]
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


def run_sequential(
    model: Model,
    params: Mapping[str, Tensor],
    batch: Batch,
    num_microbatches: int = 1,
    seed: int = 0,
    merge_expert_grads: bool = True,
) -> StepResult:
    """One training step's loss and gradients: per microbatch F of all stages, B last to first, then W.

    batch: {"tokens": [b, s] int64, "labels": [b, s] int64, optional "positions"}.
    merge_expert_grads: run the expert-grouped weight GEMMs once for the whole step over all its
    microbatches' rows (``merge_grouped_weight_grads``) instead of once per microbatch plus an add;
    the inputs and output gradients of those GEMMs are then held until the step's end.
    """
    microbatches = split_microbatches(batch, num_microbatches)
    grads: dict[str, Tensor] = {}
    merge_later: dict[str, list[GroupedWeightGrad]] | None = {} if merge_expert_grads else None
    losses = []
    statistics: dict[str, Tensor] = {}
    for i, mb in enumerate(microbatches):
        ctx = StageContext(microbatch=i, seed=seed)
        fwds, loss = forward_microbatch(model, params, mb, ctx, statistics)
        losses.append(loss)
        weight_grads(backward_microbatch(fwds, 1.0 / num_microbatches), merge_later, into=grads)
    if merge_later:
        accumulate(grads, merged_weight_grads(merge_later))
    grads = zero_missing(grads, params, model.param_names())
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
