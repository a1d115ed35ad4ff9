"""Expert parallelism: sharding expert parameters over the ep group, and one training step over it.

Expert parameters are the stacked tensors a model declares (``Model.expert_params``: [E, ...],
experts on dim 0). ep rank r
holds experts [r * E / ep, (r + 1) * E / ep) under the same global names, shaped [E / ep, ...]; every
other parameter is replicated over ep. A step (``ep_step``): each rank runs its own local batch
through the model; the MoE layers' dispatch/combine exchange tokens over the ep group, so each
rank's expert gradients already hold every rank's tokens; the other gradients are summed over the
group (one all-reduce per dtype). The result equals ``fmoe.runner.run_sequential`` over the
concatenated batch with ep x num_microbatches microbatches (rank r's local batch is microbatches
r*m .. r*m + m - 1 of it): the same loss, the expert gradients of its rows, the other gradients.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from fmoe import dist as D
from fmoe import runner
from fmoe.stages import moe
from fmoe.stages.spec import Model, RoutedTokens, StageContext

__all__ = [
    "EPStepResult",
    "all_gather_expert_params",
    "ep_step",
    "expert_range",
    "gather_shards",
    "shard_params",
]


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """[start, stop) of the experts ep rank ``ep_rank`` of ``ep_size`` owns."""
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank {ep_rank} is not a rank of an ep group of size {ep_size}")
    if num_experts % ep_size:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the ep size ({ep_size})")
    per = num_experts // ep_size
    return ep_rank * per, (ep_rank + 1) * per


def shard_params(
    params: Mapping[str, Tensor], experts: Collection[str], ep_size: int, ep_rank: int
) -> dict[str, Tensor]:
    """The params of one ep rank: the expert tensors (``experts``, the model's ``expert_params``)
    sliced to its experts (contiguous copies), the rest shared with ``params``."""
    out = {}
    for name, t in params.items():
        if name in experts:
            start, stop = expert_range(t.shape[0], ep_size, ep_rank)
            out[name] = t[start:stop].clone()
        else:
            out[name] = t
    return out


def gather_shards(shards: Sequence[Mapping[str, Tensor]], experts: Collection[str]) -> dict[str, Tensor]:
    """The full params from every ep rank's shard, in rank order (inverse of ``shard_params``;
    experts: the model's ``expert_params``)."""
    if not shards:
        raise ValueError("gather_shards needs at least one shard")
    names = list(shards[0])
    for r, shard in enumerate(shards):
        if list(shard) != names:
            raise ValueError(f"gather_shards: shard {r} holds other names than shard 0")
    return {n: torch.cat([s[n] for s in shards]) if n in experts else shards[0][n] for n in names}


def all_gather_expert_params(
    params_local: Mapping[str, Tensor], experts: Collection[str], group
) -> dict[str, Tensor]:
    """Collective: every rank gets the full params from the ep ranks' shards (e.g. to checkpoint);
    experts: the model's ``expert_params``."""
    if moe.group_size(group) == 1:
        return dict(params_local)
    out = dict(params_local)
    for name in sorted(params_local):  # the same order on every rank
        if name in experts:
            t = params_local[name].contiguous()
            parts = [torch.empty_like(t) for _ in range(moe.group_size(group))]
            dist.all_gather(parts, t, group=group)
            out[name] = torch.cat(parts)
    return out


@dataclass
class EPStepResult(runner.StepResult):
    """A StepResult (loss and microbatch_losses over the whole ep group, in reference order; grads:
    local expert shards and ep-summed other gradients) plus expert_loads: {MoE layer index: [E]
    int64 routing slots per expert, summed over microbatches and the ep group}."""

    expert_loads: dict[int, Tensor] = field(default_factory=dict)


def _all_reduce_sum(grads: dict[str, Tensor], names: Sequence[str], group) -> None:
    """In place, one flat all-reduce per dtype (names in the same order on every rank)."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for n in names:
        by_dtype.setdefault(grads[n].dtype, []).append(n)
    for dtype in sorted(by_dtype, key=str):
        group_names = by_dtype[dtype]
        flat = torch.cat([grads[n].reshape(-1) for n in group_names])
        dist.all_reduce(flat, group=group)
        offset = 0
        for n in group_names:
            size = grads[n].numel()
            grads[n] = flat[offset : offset + size].view_as(grads[n])
            offset += size


def ep_step(
    model: Model,
    params_local: Mapping[str, Tensor],
    batch_local: runner.Batch,
    num_microbatches: int,
    ep_group,
    seed: int = 0,
) -> EPStepResult:
    """One training step of one ep rank (collective over ``ep_group``; None = ep 1).

    params_local: ``shard_params`` of the full params for this rank (``model.expert_params``); batch_local: this rank's
    {"tokens": [b, s], "labels": [b, s]}, split into ``num_microbatches`` microbatches. Every
    microbatch's losses are scaled by 1 / (ep * num_microbatches), so summing gradients over the ep
    group gives the gradient of the group's mean loss; non-expert gradients come back so summed.
    """
    ep, rank = moe.group_size(ep_group), moe.group_rank(ep_group)
    groups = {"ep": ep_group} if ep > 1 else {}
    loads: dict[int, Tensor] = {}

    def log_routing(i: int, inputs: tuple[Tensor, ...]) -> None:
        if model.stages[i].role == "dispatch":  # its inputs start with RoutedTokens: log the routing
            layer = model.layer_of[i]
            load = moe.expert_load(RoutedTokens._make(inputs[:4]).expert_ids, model.num_experts)
            loads[layer] = loads[layer] + load if layer in loads else load

    microbatches = runner.split_microbatches(batch_local, num_microbatches)
    contexts = [
        StageContext(microbatch=rank * num_microbatches + i, seed=seed, groups=groups)
        for i in range(num_microbatches)
    ]
    losses, grads = runner.execute(
        model, params_local, microbatches, contexts, 1.0 / (ep * num_microbatches), observe=log_routing
    )
    local_losses = torch.stack(losses)
    if ep > 1:
        _all_reduce_sum(grads, [n for n in grads if n not in model.expert_params], ep_group)
        gathered = local_losses.new_empty(ep * num_microbatches)
        D.all_gather_single(gathered, local_losses, group=ep_group)
        all_losses = list(gathered.unbind())
        for layer in sorted(loads):
            dist.all_reduce(loads[layer], group=ep_group)
    else:
        all_losses = losses
    return EPStepResult(runner.mean_loss(all_losses), grads, all_losses, expert_loads=loads)
