"""The collectives of a sharded step: parameters all-gathered, gradients reduce-scattered, sums over
the world (the gradient norm, the stages' statistics).

A gradient leaves the step in the dtype :func:`reduce_dtype` says (fp32 where it is summed over
ranks or scaled, else as W made it), scaled by the step's 1 / (data ranks) (:func:`scaled_grad`),
and is reduced over its shard group by :func:`start_reduce` - ``reduce_scatter_tensor`` on NCCL, an
all-reduce and a slice on gloo (which has no reduce-scatter) - whose :class:`PendingShard` gives
this rank's shard. The whole-step gathers (:func:`gather_params`, :func:`reduce_scatter_grads`) and
the per-unit ones (``fmoe.gather_plan.UnitGathers``) share these.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from fmoe import dist as D
from fmoe.mesh import Mesh
from fmoe.sharding import ShardInfo
from fmoe.stages.fp8_mode import quantized_from_master
from fmoe.stages.spec import Model

__all__ = [
    "PendingShard",
    "gather_params",
    "reduce_dtype",
    "reduce_scatter_grads",
    "scaled_grad",
    "start_reduce",
    "uncast_params",
    "world_sq_norm",
    "world_statistics",
]


def uncast_params(model: Model, infos: Mapping[str, ShardInfo], fp8: bool) -> frozenset[str]:
    """The names :func:`gather_params` hands over as fp32, uncast: the model's buffers and, in an FP8
    step, the expert weights this rank holds whole (a shard of one rank: handed over as the master
    itself, no copy; ``fp8_mode.quantized_from_master``). Only the buffers' gradients stay fp32: the
    expert weights' come in the compute dtype (``reduce_dtype`` takes ``model.buffers``)."""
    whole = {n: i.full_shape for n, i in infos.items() if i.size == 1} if fp8 else {}
    return frozenset(model.buffers) | quantized_from_master(whole, model.expert_params)


def gather_params(
    shards: Mapping[str, Tensor],
    infos: Mapping[str, ShardInfo],
    mesh: Mesh,
    dtype=None,
    uncast: Collection[str] = (),
) -> dict[str, Tensor]:
    """All-gather the shards into this rank's full (ep-local) parameters, cast to ``dtype`` but for
    the names in ``uncast`` (a model's buffers, whose small updates a bf16 copy would round away; an
    FP8 step's expert weights, read only through their FP8 copies)."""
    pending = []
    for name, shard in shards.items():
        info = infos[name]
        src = shard if dtype is None or name in uncast else shard.to(dtype)
        if info.size == 1:
            pending.append((name, None, src))
            continue
        buf = src.new_empty(info.padded_numel)
        work = D.all_gather_single(buf, src.contiguous(), group=mesh.group(info.group), async_op=True)
        pending.append((name, work, buf))
    full = {}
    for name, work, buf in pending:
        if work is not None:
            work.wait()
        full[name] = infos[name].unpad(buf)
    return full


def reduce_dtype(
    name: str, info: ShardInfo, dtype: torch.dtype | None, scale: float, uncast: Collection[str]
) -> torch.dtype | None:
    """The dtype a gradient is reduced in: fp32 where it is summed over ranks or scaled; None: as
    W made it (no compute dtype, a buffer, or one rank and no scale)."""
    if dtype is None or name in uncast:
        return None
    return torch.float32 if scale != 1.0 or info.size > 1 else None


def scaled_grad(
    g: Tensor, name: str, info: ShardInfo, dtype: torch.dtype | None, scale: float, uncast: Collection[str]
) -> Tensor:
    """A final full gradient ready for its reduction: in ``reduce_dtype``, times ``scale`` (the
    step's 1 / data ranks; in place, so the step must own ``g`` or the cast must have copied it)."""
    to = reduce_dtype(name, info, dtype, scale, uncast)
    if to is not None:
        g = g.to(to)
    return g.mul_(scale) if scale != 1.0 else g


@dataclass
class PendingShard:
    """A gradient shard whose reduction may still be in flight (``start_reduce``).

    out: the [shard_numel] shard, or (whole=True, gloo) the [padded_numel] all-reduced gradient
    whose slice is this rank's; work: the collective's handle (None: nothing in flight)."""

    info: ShardInfo
    out: Tensor
    work: object | None = None
    whole: bool = False

    def wait(self) -> Tensor:
        """This rank's [shard_numel] gradient shard, once the reduction has completed."""
        if self.work is not None:
            self.work.wait()
        return self.info.mine(self.out).clone() if self.whole else self.out


def start_reduce(flat: Tensor, info: ShardInfo, group, *, owned: bool, async_op: bool) -> PendingShard:
    """Sum a [padded_numel] gradient over its shard group, keeping this rank's shard. owned: the
    caller gives ``flat`` away (gloo reduces it in place; else a copy); async_op: return with the
    collective in flight. One rank: ``flat`` itself is the shard, nothing to reduce."""
    if info.size == 1:
        return PendingShard(info, flat)
    if dist.get_backend(group) == "nccl":
        shard = flat.new_empty(info.shard_numel)
        work = D.reduce_scatter_single(shard, flat.contiguous(), group=group, async_op=async_op)
        return PendingShard(info, shard, work)
    flat = flat.contiguous() if owned else flat.clone()  # gloo has no reduce-scatter
    return PendingShard(info, flat, dist.all_reduce(flat, group=group, async_op=async_op), whole=True)


def reduce_scatter_grads(
    grads: Mapping[str, Tensor], infos: Mapping[str, ShardInfo], mesh: Mesh
) -> dict[str, Tensor]:
    """Sum the full gradients over each shard group and keep this rank's shard (flat); the inputs
    are not modified (a gradient of a one-rank group is returned as its flat view)."""
    out = {}
    for name, g in grads.items():
        info = infos[name]
        out[name] = start_reduce(
            info.pad(g.reshape(-1)), info, mesh.group(info.group), owned=False, async_op=False
        ).wait()
    return out


def world_sq_norm(x: Tensor) -> Tensor:
    """For clip_by_global_norm over shards: every element lives on exactly one rank of the world."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


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
