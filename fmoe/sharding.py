"""Where each parameter lives on the mesh: the shard layout, and the canonical tensors it maps to.

Every parameter lives as a flat shard: expert parameters (this ep rank's experts, rows
``expert_range`` of the canonical tensor's dim 0) split over ``dp_cp``, all others over
``dp_cp_ep``, each padded with zeros to a multiple of its group's size. :class:`ShardInfo` holds one
parameter's layout and its pad / slice arithmetic; :func:`layout` builds it from the mesh's process
groups, :func:`planned_layout` from the mesh's sizes alone (``fmoe plan``). The canonical
(layout-free) tensors checkpoints hold map to shards through :func:`shard_canonical` and
:func:`shard_range` (this rank's piece) and back through :func:`canonical` (gathered on rank 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from fmoe import dist as D
from fmoe.expert_parallel import expert_range
from fmoe.mesh import Mesh
from fmoe.stages.spec import Model

__all__ = [
    "SHARD_GROUPS",
    "ShardInfo",
    "add_to_shards",
    "canonical",
    "layout",
    "local_shape",
    "planned_layout",
    "shard_canonical",
    "shard_group",
    "shard_range",
]

SHARD_GROUPS = ("dp_cp", "dp_cp_ep")  # the mesh groups a parameter is sharded over (``fmoe.mesh``)


@dataclass(frozen=True)
class ShardInfo:
    """How one parameter is laid out: full_shape is this rank's (ep-local for experts) full tensor.

    A flat shard is [shard_numel]; the group's shards together are the full tensor flattened and
    zero-padded to [padded_numel], rank ``index`` holding elements [index x shard_numel, + shard_numel)."""

    full_shape: tuple[int, ...]
    group: str  # "dp_cp" or "dp_cp_ep"
    size: int  # ranks in the group
    index: int  # this rank's index in the group
    expert: bool = False  # one of the model's expert_params (split over ep on dim 0 first)

    @property
    def numel(self) -> int:
        return math.prod(self.full_shape)

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.size)

    @property
    def padded_numel(self) -> int:
        """What the group's shards hold together: the full tensor's elements and the padding."""
        return self.shard_numel * self.size

    def pad(self, flat: Tensor) -> Tensor:
        """flat [numel] zero-padded to [padded_numel]; ``flat`` itself when no padding is needed."""
        pad = self.padded_numel - flat.numel()
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat

    def mine(self, padded: Tensor) -> Tensor:
        """This rank's [shard_numel] slice (a view) of a [padded_numel] flat tensor."""
        return padded[self.index * self.shard_numel : (self.index + 1) * self.shard_numel]

    def unpad(self, padded: Tensor) -> Tensor:
        """The [full_shape] tensor (a view) of a [padded_numel] flat tensor, its padding left out."""
        return padded[: self.numel].view(self.full_shape)

    def held(self) -> tuple[int, int]:
        """[start, stop) of the full tensor's flat elements this rank's shard holds, padding excluded."""
        first = min(self.index * self.shard_numel, self.numel)
        return first, min(first + self.shard_numel, self.numel)


def shard_group(expert: bool) -> str:
    """The group a parameter is sharded over: experts (``Model.expert_params``, already split over
    ep) over dp x cp, the rest over dp x cp x ep."""
    return "dp_cp" if expert else "dp_cp_ep"


def _ep_split(expert: bool, ep: int) -> bool:
    """Whether a canonical tensor is split over ep ranks along dim 0 (an expert tensor, ep > 1)."""
    return expert and ep > 1


def local_shape(expert: bool, shape: Sequence[int], num_experts: int, ep: int) -> tuple[int, ...]:
    """The shape of this rank's full tensor of canonical shape ``shape``: an expert tensor's
    [num_experts, ...] becomes [num_experts / ep, ...] (this ep rank's experts); others unchanged."""
    if _ep_split(expert, ep):
        return (num_experts // ep, *shape[1:])
    return tuple(shape)


def _infos(
    model: Model, mesh: Mesh, shapes: Mapping[str, Sequence[int]], names: Sequence[str],
    place: Callable[[str], tuple[int, int]],
) -> dict[str, ShardInfo]:  # fmt: skip
    """{name: ShardInfo}; place(group): (ranks in the group, this rank's index in it)."""
    places = {g: place(g) for g in SHARD_GROUPS}
    out = {}
    for name in names:
        expert = name in model.expert_params
        group = shard_group(expert)
        out[name] = ShardInfo(
            local_shape(expert, shapes[name], model.num_experts, mesh.ep), group, *places[group], expert
        )
    return out


def layout(
    model: Model, mesh: Mesh, shapes: Mapping[str, Sequence[int]], names: Sequence[str] | None = None
) -> dict[str, ShardInfo]:
    """The shard layout of ``names`` (default: every parameter) on this rank, from its process groups.

    shapes: every parameter's canonical shape (a family's ``param_shapes(cfg)``)."""

    def place(group: str) -> tuple[int, int]:
        g = mesh.group(group)
        return (1, 0) if g is None else (dist.get_world_size(g), dist.get_rank(g))

    return _infos(model, mesh, shapes, names if names is not None else list(shapes), place)


def planned_layout(
    model: Model, mesh: Mesh, shapes: Mapping[str, Sequence[int]], names: Sequence[str]
) -> dict[str, ShardInfo]:
    """``layout`` from the mesh's sizes and coordinates alone (no process group): what a rank of a
    mesh not built yet would hold (``Mesh(pp, dp, cp, ep, rank, coords)``)."""
    c = mesh.coords
    places = {"dp_cp": (mesh.dp * mesh.cp, c["dp"] * mesh.cp + c["cp"]),
              "dp_cp_ep": (mesh.dp * mesh.cp * mesh.ep, (c["dp"] * mesh.cp + c["cp"]) * mesh.ep + c["ep"])}  # fmt: skip
    return _infos(model, mesh, shapes, names, places.__getitem__)


def shard_canonical(
    full: Mapping[str, Tensor], infos: Mapping[str, ShardInfo], mesh: Mesh
) -> dict[str, Tensor]:
    """This rank's flat shards of canonical full tensors (experts: slice this ep rank's first).

    ValueError naming the tensor when a full tensor's shape is not the canonical one of ``infos``
    (a tensor of another size would otherwise be flattened and padded into nonsense)."""
    out = {}
    for name, info in infos.items():
        t = full[name]
        expert_sliced = _ep_split(info.expert, mesh.ep)
        want = (info.full_shape[0] * mesh.ep, *info.full_shape[1:]) if expert_sliced else info.full_shape
        if tuple(t.shape) != tuple(want):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(t.shape)}, the model's layout needs {tuple(want)}"
            )
        if expert_sliced:
            lo, hi = expert_range(t.shape[0], mesh.ep, mesh.coords["ep"])
            t = t[lo:hi]
        out[name] = info.mine(info.pad(t.reshape(-1))).clone()
    return out


def shard_range(name: str, info: ShardInfo, mesh: Mesh, shape: Sequence[int]) -> tuple[int, int]:
    """[start, stop): the elements of canonical tensor ``name`` (of canonical ``shape``, flattened)
    that this rank's flat shard holds, its padding excluded: the slice ``shard_canonical`` takes.
    Experts: this ep rank's experts are rows [lo, hi) of the canonical tensor, so its ep-local
    tensor is the flat range from lo x (elements per expert)."""
    base = 0
    if _ep_split(info.expert, mesh.ep):
        lo, _ = expert_range(shape[0], mesh.ep, mesh.coords["ep"])
        base = lo * math.prod(shape[1:])
    start, stop = info.held()
    return base + start, base + stop


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


def _local_full(name: str, shard: Tensor, info: ShardInfo, mesh: Mesh) -> Tensor:
    """The canonical tensor ``name`` from this rank's shard: all-gathered over its shard group, then
    (experts) over ep; every rank of the groups takes part."""
    full = shard
    if info.size > 1:
        full = shard.new_empty(info.padded_numel)
        D.all_gather_single(full, shard.contiguous(), group=mesh.group(info.group))
    full = info.unpad(full)
    if _ep_split(info.expert, mesh.ep):
        parts = [torch.empty_like(full) for _ in range(mesh.ep)]
        dist.all_gather(parts, full.contiguous(), group=mesh.group("ep"))
        full = torch.cat(parts)
    return full


def canonical(
    tensors: Mapping[str, Tensor], infos: Mapping[str, ShardInfo], mesh: Mesh, names: Sequence[str]
) -> dict[str, Tensor] | None:
    """Gather flat shards into canonical full tensors (all experts, all pipeline ranks' params) on
    global rank 0 (None elsewhere). tensors: {name: shard} for this rank's ``infos``."""
    local = {name: _local_full(name, shard, infos[name], mesh).cpu() for name, shard in tensors.items()}
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
