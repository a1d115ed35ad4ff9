"""One training step on the 4D mesh, with parameters sharded ZeRO-3 style.

Every parameter lives as a flat shard: expert parameters (this ep rank's experts) split over
``dp_cp``, all others over ``dp_cp_ep``, each padded to a multiple of its group's size. A step

  1. all-gathers this rank's parameters (its pipeline chunks' only), asynchronously, once per step;
  2. runs the microbatches: the pipeline interpreter when pp > 1, else F/B/W stage by stage, with
     the ep and cp groups in every StageContext; losses are seeded 1 / microbatches;
  3. scales the gradients by 1 / (dp x cp x ep) (the step's loss is the mean over data ranks) and
     reduce-scatters them over the shard groups - once per step, after the last W;
  4. frees the gathered parameters.
The optimizer then updates shards (``fmoe.optim`` over the shard dicts, the global norm summed
over the world). Checkpoints hold the canonical, layout-free tensors (:func:`canonical`,
:func:`shard_canonical`), so a run saved on one mesh resumes on another.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from fmoe import dist as D
from fmoe import runner
from fmoe.expert_parallel import expert_range, is_expert_param
from fmoe.mesh import Mesh
from fmoe.stages.context_parallel import split_batch
from fmoe.stages.primitives import fp8_training
from fmoe.stages.spec import Model, StageContext


@dataclass(frozen=True)
class ShardInfo:
    """How one parameter is laid out: full_shape is this rank's (ep-local for experts) full tensor."""

    full_shape: tuple[int, ...]
    group: str  # "dp_cp" or "dp_cp_ep"
    size: int  # ranks in the group
    index: int  # this rank's index in the group

    @property
    def numel(self) -> int:
        return math.prod(self.full_shape)

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.size)


def _group_size_rank(mesh: Mesh, name: str) -> tuple[int, int]:
    g = mesh.group(name)
    return (1, 0) if g is None else (dist.get_world_size(g), dist.get_rank(g))


def layout(
    model: Model, mesh: Mesh, shapes: Mapping[str, Sequence[int]], names: Sequence[str] | None = None
) -> dict[str, ShardInfo]:
    """The shard layout of ``names`` (default: every parameter) on this rank.

    shapes: every parameter's canonical shape (a family's ``param_shapes(cfg)``)."""
    out = {}
    for name in names if names is not None else list(shapes):
        shape = tuple(shapes[name])
        group = "dp_cp" if is_expert_param(name) else "dp_cp_ep"
        if is_expert_param(name) and mesh.ep > 1:
            shape = (model.num_experts // mesh.ep, *shape[1:])
        size, index = _group_size_rank(mesh, group)
        out[name] = ShardInfo(shape, group, size, index)
    return out


def shard_canonical(
    full: Mapping[str, Tensor], infos: Mapping[str, ShardInfo], mesh: Mesh
) -> dict[str, Tensor]:
    """This rank's flat shards of canonical full tensors (experts: slice this ep rank's first).

    ValueError naming the tensor when a full tensor's shape is not the canonical one of ``infos``
    (a tensor of another size would otherwise be flattened and padded into nonsense)."""
    out = {}
    for name, info in infos.items():
        t = full[name]
        expert_sliced = is_expert_param(name) and mesh.ep > 1
        want = (info.full_shape[0] * mesh.ep, *info.full_shape[1:]) if expert_sliced else info.full_shape
        if tuple(t.shape) != tuple(want):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(t.shape)}, the model's layout needs {tuple(want)}"
            )
        if expert_sliced:
            lo, hi = expert_range(t.shape[0], mesh.ep, mesh.coords["ep"])
            t = t[lo:hi]
        flat = t.reshape(-1)
        pad = info.shard_numel * info.size - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        out[name] = flat[info.index * info.shard_numel : (info.index + 1) * info.shard_numel].clone()
    return out


def gather_params(
    shards: Mapping[str, Tensor],
    infos: Mapping[str, ShardInfo],
    mesh: Mesh,
    dtype=None,
    uncast: Collection[str] = (),
) -> dict[str, Tensor]:
    """All-gather the shards into this rank's full (ep-local) parameters, cast to ``dtype`` but for
    the names in ``uncast`` (a model's buffers, whose small updates a bf16 copy would round away)."""
    pending = []
    for name, shard in shards.items():
        info = infos[name]
        src = shard if dtype is None or name in uncast else shard.to(dtype)
        if info.size == 1:
            pending.append((name, None, src))
            continue
        buf = src.new_empty(info.shard_numel * info.size)
        work = dist.all_gather_into_tensor(buf, src.contiguous(), group=mesh.group(info.group), async_op=True)
        pending.append((name, work, buf))
    full = {}
    for name, work, buf in pending:
        if work is not None:
            work.wait()
        info = infos[name]
        full[name] = buf[: info.numel].view(info.full_shape)
    return full


def reduce_scatter_grads(
    grads: Mapping[str, Tensor], infos: Mapping[str, ShardInfo], mesh: Mesh
) -> dict[str, Tensor]:
    """Sum the full gradients over each shard group and keep this rank's shard (flat)."""
    out = {}
    for name, g in grads.items():
        info = infos[name]
        flat = g.reshape(-1)
        pad = info.shard_numel * info.size - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        group = mesh.group(info.group)
        if info.size == 1:
            out[name] = flat  # the caller's gradient itself: nothing to reduce
        elif dist.get_backend(group) == "nccl":
            shard = flat.new_empty(info.shard_numel)
            dist.reduce_scatter_tensor(shard, flat.contiguous(), group=group)
            out[name] = shard
        else:  # gloo has no reduce-scatter
            flat = flat.clone()
            dist.all_reduce(flat, group=group)
            out[name] = flat[info.index * info.shard_numel : (info.index + 1) * info.shard_numel].clone()
    return out


def local_batch(batch: runner.Batch, mesh: Mesh) -> dict[str, Tensor]:
    """This rank's share of the global batch: its data rank's rows, then its cp share of each sequence."""
    b = batch["tokens"].shape[0]
    per = b // mesh.data_ranks
    r = mesh.data_rank
    out = {k: v[r * per : (r + 1) * per] for k, v in batch.items() if k != "positions"}
    if mesh.cp > 1:
        out = split_batch(out, mesh.cp, mesh.coords["cp"])
    return runner.with_positions(out)


def _local_step(
    model: Model, params, batch, num_microbatches: int, mesh: Mesh, seed: int
) -> runner.StepResult:
    """pp = 1: every stage on this rank, microbatch after microbatch (F all, B all, W all)."""
    grads: dict[str, Tensor] = {}
    merge_later: dict = {}  # expert weight GEMMs, merged over the step's microbatches
    losses = []
    statistics: dict[str, Tensor] = {}
    groups = mesh.stage_groups()
    for i, mb in enumerate(runner.split_microbatches(batch, num_microbatches)):
        ctx = StageContext(microbatch=mesh.data_rank * num_microbatches + i, seed=seed, groups=groups)
        fwds, loss = runner.forward_microbatch(model, params, mb, ctx, statistics)
        losses.append(loss)
        works = runner.backward_microbatch(fwds, 1.0 / num_microbatches)
        runner.weight_grads(works, merge_later, into=grads)
    runner.accumulate(grads, runner.merged_weight_grads(merge_later))
    return runner.StepResult(
        runner.mean_loss(losses), runner.zero_missing(grads, params, list(params)), losses, statistics
    )


class ShardedStep(NamedTuple):
    """What ``parallel_step`` returns. loss: the step's loss, identical on every rank; grad_shards:
    this rank's gradient shards; statistics: {Statistic.name: int64 count} of every stage of the
    model, summed over the step's microbatches and over the world (identical on every rank)."""

    loss: Tensor
    grad_shards: dict[str, Tensor]
    statistics: dict[str, Tensor]


def world_statistics(model: Model, local: Mapping[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """Every statistic of ``model`` summed over the world: one int64 all-reduce of all of them, in
    model order (a rank adds zeros for the stages it does not run). Integer sums are exact, so the
    result is bitwise the same on every rank whatever the reduction order."""
    stats = model.statistics()
    if not stats:
        return {}
    sizes = [math.prod(s.shape) for s in stats]
    flat = torch.zeros(sum(sizes), dtype=torch.int64, device=device)
    for s, part in zip(stats, flat.split(sizes)):
        if s.name in local:
            part.copy_(local[s.name].reshape(-1))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flat)
    return {s.name: part.view(s.shape) for s, part in zip(stats, flat.split(sizes))}


def add_to_shards(
    shards: Mapping[str, Tensor], updates: Mapping[str, Tensor], infos: Mapping[str, ShardInfo], mesh: Mesh
) -> dict[str, Tensor]:
    """shards + this rank's slice of each canonical update ({name: full tensor}, the same on every
    rank) for the names this rank holds; a new dict (the inputs are not mutated). Every copy of a
    shard adds the same numbers, so replicas stay bitwise identical."""
    mine = {n: u for n, u in updates.items() if n in infos}
    parts = shard_canonical(mine, {n: infos[n] for n in mine}, mesh)
    out = dict(shards)
    for name, part in parts.items():
        out[name] = shards[name] + part.to(device=shards[name].device, dtype=shards[name].dtype)
    return out


def parallel_step(
    model: Model,
    shards: Mapping[str, Tensor],
    infos: Mapping[str, ShardInfo],
    batch: runner.Batch,
    num_microbatches: int,
    mesh: Mesh,
    *,
    schedule=None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    fp8: bool = False,
    fp8_dense: bool = True,
    timeout_s: float = D.DEFAULT_TIMEOUT_S,
) -> ShardedStep:
    """One step on this rank: (the step's loss, identical on every rank; this rank's gradient shards;
    the step's statistics summed over the world, see ``ShardedStep``).

    shards/infos: this rank's parameter shards and their layout (``layout``); batch: the GLOBAL
    batch (every rank passes the same; each takes its share); schedule: a table for pp > 1; fp8:
    the step's GEMMs in FP8 (each weight quantized once here, reused by every microbatch; with
    fp8_dense=False only the expert GEMMs, see ``fp8_training``); timeout_s: how long a pipeline
    rank waits for a peer before it gives up (``fmoe.dist.wait``). The
    gradient shards are fp32 where they were summed over ranks, else in the compute dtype.
    """
    params = gather_params(shards, infos, mesh, dtype, uncast=model.buffers)
    mine = local_batch(batch, mesh)
    with fp8_training(fp8, dense=fp8_dense):
        if mesh.pp > 1:
            from fmoe.interpreter import run_schedule

            result = run_schedule(
                schedule,
                model,
                params,
                mine,
                mesh.group("pp"),
                seed=seed,
                stage_groups=mesh.stage_groups(),
                timeout_s=timeout_s,
            )
        else:
            result = _local_step(model, params, mine, num_microbatches, mesh, seed)
    del params
    scale = 1.0 / (mesh.dp * mesh.cp * mesh.ep)
    grads = result.grads
    if dtype is not None:
        # Sums over ranks and the 1/ranks scale run in fp32. A gradient that nothing reduces or
        # scales (one rank) goes to the optimizer in the compute dtype: its AdamW kernel reads it as
        # it is, so the step writes no fp32 copy of every gradient.
        grads = {n: g.float() if scale != 1.0 or infos[n].size > 1 else g for n, g in grads.items()}
    if scale != 1.0:
        grads = {n: g.mul_(scale) for n, g in grads.items()}  # the step owns these tensors
    grad_shards = reduce_scatter_grads(grads, infos, mesh)
    loss = result.loss.detach().clone().float()
    data = mesh.group("dp_cp_ep")
    if data is not None:
        dist.all_reduce(loss, group=data)
    device = next(iter(shards.values())).device
    return ShardedStep(loss * scale, grad_shards, world_statistics(model, result.statistics, device))


def world_sq_norm(x: Tensor) -> Tensor:
    """For clip_by_global_norm over shards: every element lives on exactly one rank of the world."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


# ------------------------------------------------------------------------------------------------
# canonical (layout-free) tensors for checkpoints


def canonical(
    tensors: Mapping[str, Tensor], infos: Mapping[str, ShardInfo], mesh: Mesh, names: Sequence[str]
) -> dict[str, Tensor] | None:
    """Gather flat shards into canonical full tensors (all experts, all pipeline ranks' params) on
    global rank 0 (None elsewhere). tensors: {name: shard} for this rank's ``infos``."""
    local = {}
    for name, shard in tensors.items():
        info = infos[name]
        full = shard
        if info.size > 1:
            buf = shard.new_empty(info.shard_numel * info.size)
            dist.all_gather_into_tensor(buf, shard.contiguous(), group=mesh.group(info.group))
            full = buf
        full = full[: info.numel].view(info.full_shape)
        if is_expert_param(name) and mesh.ep > 1:
            parts = [torch.empty_like(full) for _ in range(mesh.ep)]
            dist.all_gather(parts, full.contiguous(), group=mesh.group("ep"))
            full = torch.cat(parts)
        local[name] = full.cpu()
    if mesh.pp > 1:
        # one holder per (pp rank): the dp=cp=ep=0 member of each pipeline group sends to rank 0
        gathered = [None] * mesh.pp if mesh.rank == 0 else None
        first = all(mesh.coords[d] == 0 for d in ("dp", "cp", "ep"))
        if first:
            dist.gather_object(local, gathered, dst=0, group=mesh.group("pp"))
        if mesh.rank != 0:
            return None
        merged: dict[str, Tensor] = {}
        for part in gathered:
            merged.update(part)
        return {n: merged[n] for n in names if n in merged}
    return {n: local[n] for n in names if n in local} if mesh.rank == 0 else None
