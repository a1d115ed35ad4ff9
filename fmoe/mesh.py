"""The ("pp", "dp", "cp", "ep") process mesh, checked up front.

Rank layout: ``rank = ((pp_i * dp + dp_i) * cp + cp_i) * ep + ep_i`` — ep innermost, then cp, so their
frequent all-to-all and K/V traffic stays among neighbouring ranks (inside a node). Groups:

  pp         the pipeline ranks sharing (dp_i, cp_i, ep_i)        send/recv of activations
  ep         expert-parallel ranks                               dispatch / combine all-to-all
  cp         context-parallel ranks                              K/V all-gather
  dp_cp      expert parameters' shard group (they are already split over ep)
  dp_cp_ep   every other parameter's shard group (ZeRO-3)
Data: each (dp_i, ep_i) pair reads its own slice of the global batch (ep ranks are data-parallel
for the non-expert layers); the cp ranks of a pair split each of its sequences.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

DIMS = ("pp", "dp", "cp", "ep")


class MeshError(ValueError):
    """Sizes that cannot form a mesh; the message says which to change."""


def check_sizes(
    pp: int, dp: int, cp: int, ep: int, world: int, *, microbatches: int | None = None, schedule: str | None = None,
    num_experts: int | None = None, seq_len: int | None = None, global_batch: int | None = None,
) -> None:  # fmt: skip
    """Raise MeshError naming the fields to change when the sizes cannot run."""
    for name, value in zip(DIMS, (pp, dp, cp, ep)):
        if not isinstance(value, int) or value < 1:
            raise MeshError(f"parallel.{name} must be an int >= 1, got {value!r}")
    if pp * dp * cp * ep != world:
        raise MeshError(
            f"parallel.pp x dp x cp x ep = {pp} x {dp} x {cp} x {ep} = {pp * dp * cp * ep}, but the job has "
            f"{world} process{'' if world == 1 else 'es'}: change the sizes or torchrun's --nproc-per-node"
        )
    if microbatches is not None and schedule in ("dualpipev", "dualpipe") and microbatches < 2 * pp:
        raise MeshError(
            f"{schedule} needs train.microbatches >= 2 x parallel.pp = {2 * pp}, got {microbatches}: "
            f"raise train.microbatches or lower parallel.pp"
        )
    if num_experts is not None and num_experts % ep:
        raise MeshError(f"model.num_experts ({num_experts}) must be a multiple of parallel.ep ({ep})")
    if seq_len is not None and seq_len % (2 * cp):
        raise MeshError(
            f"data.seq_len ({seq_len}) must be a multiple of 2 x parallel.cp = {2 * cp} (zigzag split)"
        )
    if global_batch is not None and microbatches is not None and global_batch % (dp * ep * microbatches):
        raise MeshError(
            f"train.global_batch ({global_batch}) must be a multiple of parallel.dp x parallel.ep x "
            f"train.microbatches = {dp} x {ep} x {microbatches}"
        )


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the mesh and its process groups (None where a group has one rank)."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    rank: int = 0
    coords: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIMS, 0))
    groups: dict[str, Any] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.ep

    @property
    def data_ranks(self) -> int:
        """How many ranks read different data: dp x ep (cp ranks share sequences)."""
        return self.dp * self.ep

    @property
    def data_rank(self) -> int:
        return self.coords["dp"] * self.ep + self.coords["ep"]

    def group(self, name: str) -> Any:
        return self.groups.get(name)

    def stage_groups(self) -> dict[str, Any]:
        """The groups stage functions see in their StageContext."""
        return {k: self.groups[k] for k in ("ep", "cp") if self.groups.get(k) is not None}


def rank_of(coords: dict[str, int], sizes: dict[str, int]) -> int:
    r = 0
    for d in DIMS:
        r = r * sizes[d] + coords[d]
    return r


def build_mesh(pp: int = 1, dp: int = 1, cp: int = 1, ep: int = 1) -> Mesh:
    """Make every group of the mesh (collective: all ranks call it with the same sizes)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_sizes(pp, dp, cp, ep, world)
    if world == 1:
        return Mesh(pp, dp, cp, ep)
    sizes = dict(zip(DIMS, (pp, dp, cp, ep)))
    rank = dist.get_rank()
    coords, rest = {}, rank
    for d in reversed(DIMS):
        coords[d] = rest % sizes[d]
        rest //= sizes[d]
    coords = {d: coords[d] for d in DIMS}
    spans = {"pp": ("pp",), "dp": ("dp",), "cp": ("cp",), "ep": ("ep",), "dp_cp": ("dp", "cp"),
             "dp_cp_ep": ("dp", "cp", "ep")}  # fmt: skip
    groups: dict[str, Any] = {}
    for name, dims in spans.items():
        fixed = [d for d in DIMS if d not in dims]
        mine = None
        # every rank creates every group, in the same order (new_group is collective)
        for fixed_values in itertools.product(*(range(sizes[d]) for d in fixed)):
            members = []
            for varying in itertools.product(*(range(sizes[d]) for d in dims)):
                c = dict(zip(fixed, fixed_values)) | dict(zip(dims, varying))
                members.append(rank_of(c, sizes))
            if len(members) == 1:
                continue
            g = dist.new_group(members)
            if rank in members:
                mine = g
        groups[name] = mine
    return Mesh(pp, dp, cp, ep, rank, coords, groups)
