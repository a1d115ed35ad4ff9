"""Sharded planning: what each rank holds (:class:`Shard`), the ranks' agreement on it, and the
index it gives (which rank writes which range of which canonical tensor).

Nothing here knows the parallel layout: callers say which range of which canonical tensor they
hold, so a run can resume on another layout. A range several ranks hold (replicas) is written
once, by the lowest of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from fmoe.checkpoint_format import KINDS, dtype_name, rank_file

__all__ = [
    "Held",
    "Shard",
    "all_gather_objects",
    "first_nonfinite",
    "held_ranges",
    "plan",
    "rank_world",
    "whole",
]


class Shard(NamedTuple):
    """What one rank holds of one canonical tensor, for :func:`save_sharded`.

    data: 1-D, any device and dtype: elements [start, start + data.numel()) of the canonical tensor
    flattened row-major (empty when the rank's range lies wholly in padding); shape: the canonical
    tensor's shape."""

    data: Tensor
    start: int
    shape: tuple[int, ...]


def whole(t: Tensor) -> Shard:
    """A whole tensor as a :class:`Shard` (replicated values such as the optimizer's step count)."""
    return Shard(t.detach().reshape(-1), 0, tuple(t.shape))


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (small, picklable), in rank order; [obj] without a process group."""
    rank, world = rank_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


class Held(NamedTuple):
    """What one rank holds of one canonical tensor, as the ranks exchange it (small, picklable):
    elements [start, stop) of a tensor of ``shape`` (a list: the index's JSON) and ``dtype``
    (:func:`fmoe.checkpoint_format.dtype_name`)."""

    start: int
    stop: int
    shape: list[int]
    dtype: str


def held_ranges(shards: Mapping[str, Shard], what: str) -> dict[str, Held]:
    """{name: Held} of this rank's shards (ValueError naming a malformed one)."""
    out = {}
    for name, s in shards.items():
        if not (isinstance(name, str) and isinstance(s, Shard) and isinstance(s.data, Tensor)):
            raise ValueError(f"checkpoint save: {what} entry {name!r} is not a str -> Shard pair")
        numel = math.prod(s.shape)
        stop = s.start + s.data.numel()
        if s.data.dim() != 1 or not 0 <= s.start <= stop <= numel:
            raise ValueError(
                f"checkpoint save: {what}[{name!r}] holds elements [{s.start}, {stop}) of a tensor of "
                f"{numel} elements (data of shape {tuple(s.data.shape)}; 1-D expected)"
            )
        out[name] = Held(s.start, stop, list(s.shape), dtype_name(s.data.dtype))
    return out


def first_nonfinite(tensors: Mapping[tuple[str, str], Tensor]) -> str | None:
    """'<kind> tensor <name>' of the first floating tensor holding a NaN or an infinity, else None;
    one host sync per device for all of them."""
    keys = [k for k, t in tensors.items() if t.is_floating_point() and t.numel()]
    by_device: dict[torch.device, list[tuple[str, str]]] = {}
    for k in keys:
        by_device.setdefault(tensors[k].device, []).append(k)
    bad = set()
    for group in by_device.values():
        flags = torch.stack([~torch.isfinite(tensors[k]).all() for k in group]).tolist()
        bad |= {k for k, flag in zip(group, flags) if flag}
    first = next((k for k in keys if k in bad), None)
    return None if first is None else f"{first[0]} tensor {first[1]!r}"


def plan(held_by_rank: Sequence[Mapping[str, Mapping[str, Held]]], rank: int) -> tuple[dict, dict]:
    """From every rank's held ranges ({kind: {name: Held}} per rank): the index ({kind: {name:
    entry}}) and the names this rank writes ({kind: [name]}): each distinct non-empty range by the
    lowest rank holding it. ValueError naming the tensor when the ranks disagree on its shape or
    dtype, or their ranges overlap or leave a gap (a layout bug: nothing would restore those
    elements)."""
    index: dict[str, dict] = {}
    owned: dict[str, list[str]] = {}
    for kind in KINDS:
        meta, ranges = _ranges(kind, [held[kind] for held in held_by_rank])
        index[kind] = {
            name: _entry(kind, name, *meta[name], sorted(ranges.get(name, {}).items()))
            for name in sorted(meta)
        }
        owned[kind] = [n for n in index[kind] for (a, b), r in ranges.get(n, {}).items() if r == rank]
    return index, owned


def _ranges(
    kind: str, held_by_rank: Sequence[Mapping[str, Held]]
) -> tuple[dict[str, tuple[list[int], str]], dict[str, dict[tuple[int, int], int]]]:
    """The ranks' ranges of one kind: {name: (shape, dtype)} and {name: {(start, stop): lowest
    rank holding it}} (non-empty ranges only); ValueError when two ranks disagree on a tensor."""
    ranges: dict[str, dict[tuple[int, int], int]] = {}
    meta: dict[str, tuple[list[int], str]] = {}
    for r, held in enumerate(held_by_rank):
        for name, h in held.items():
            if meta.setdefault(name, (h.shape, h.dtype)) != (h.shape, h.dtype):
                raise ValueError(
                    f"checkpoint save: {kind} tensor {name!r} is {meta[name]} on one rank and "
                    f"{(h.shape, h.dtype)} on rank {r}"
                )
            if h.stop > h.start:
                ranges.setdefault(name, {}).setdefault((h.start, h.stop), r)
    return meta, ranges


def _entry(
    kind: str, name: str, shape: list[int], dtype: str, pieces: Sequence[tuple[tuple[int, int], int]]
) -> dict[str, Any]:
    """The index entry of one tensor from its sorted ((start, stop), rank) pieces; ValueError when
    they do not tile [0, numel) exactly."""
    at = 0
    for (start, stop), _ in pieces:
        if start != at:
            raise ValueError(
                f"checkpoint save: the ranks' pieces of {kind} tensor {name!r} "
                f"{'overlap' if start < at else 'leave a gap'} at element {min(start, at)}"
            )
        at = stop
    if at != math.prod(shape):
        raise ValueError(
            f"checkpoint save: the ranks' pieces of {kind} tensor {name!r} end at element {at} "
            f"of {math.prod(shape)}"
        )
    return {
        "shape": shape,
        "dtype": dtype,
        "pieces": [{"file": rank_file(kind, r), "start": a, "stop": b} for (a, b), r in pieces],
    }
