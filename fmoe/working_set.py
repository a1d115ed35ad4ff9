"""The gathered working set of one ``parallel_step``, from shapes alone: what ``fmoe plan`` counts as
the ``gathered`` term of the per-unit policy.

The policy is not re-derived here: :func:`gathered_working_set_bytes` replays the step's own
``GatherPlan`` (``gather_plan.step_gather_plan``, the function the step runs) over the layout the
step would have (``sharding.planned_layout``), with the dtypes the step's reductions use
(``collectives.reduce_dtype``). Pure: no process group, no tensor.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from fmoe.collectives import reduce_dtype
from fmoe.gather_plan import GatherPlan, per_unit, step_gather_plan
from fmoe.mesh import Mesh
from fmoe.sharding import ShardInfo, planned_layout
from fmoe.stages.spec import Model

__all__ = ["gathered_working_set_bytes"]


@dataclass(frozen=True)
class _Sizes:
    """Bytes of one parameter's tensors in a step: infos its layout; dtype the compute dtype (None:
    the master dtype), but for ``uncast``; scale the gradients' 1 / data ranks."""

    infos: Mapping[str, ShardInfo]
    dtype: torch.dtype | None
    master_dtype: torch.dtype
    scale: float
    uncast: Collection[str]
    with_grad_shards: bool

    def _compute(self, n: str) -> torch.dtype:
        return self.master_dtype if self.dtype is None or n in self.uncast else self.dtype

    def _reduced(self, n: str) -> torch.dtype | None:
        return reduce_dtype(n, self.infos[n], self.dtype, self.scale, self.uncast)

    def param(self, n: str) -> int:
        """Its gathered copy: padded, in the compute dtype; none where the shard itself is used."""
        want, info = self._compute(n), self.infos[n]
        return 0 if info.size == 1 and want == self.master_dtype else info.padded_numel * want.itemsize

    def grad(self, n: str) -> int:
        """Its full gradient accumulator, in the compute dtype."""
        return self.infos[n].numel * self._compute(n).itemsize

    def buffer(self, n: str) -> int:
        """The flat tensor a reduction reads and writes (the accumulator itself when it needs no
        cast and no padding)."""
        info, to = self.infos[n], self._reduced(n)
        if to is None and info.padded_numel == info.numel:
            return self.grad(n)
        return info.padded_numel * (to or self._compute(n)).itemsize

    def reduce(self, n: str) -> int:
        """What a reduction holds beyond the accumulator."""
        return self.buffer(n) - self.grad(n) if self.buffer(n) != self.grad(n) else 0

    def shard(self, n: str) -> int:
        """The gradient shard a reduction leaves (counted only ``with_grad_shards``)."""
        if not self.with_grad_shards:
            return 0
        return self.infos[n].shard_numel * (self._reduced(n) or self._compute(n)).itemsize

    def copy(self, n: str) -> int:
        """The fp32 copy a whole-step reduction makes of a gradient it casts."""
        return self.infos[n].numel * 4 if self._reduced(n) is not None else 0


def _whole_step_bytes(s: _Sizes) -> int:
    """The "step" policy: every gathered copy and full gradient at once, then the reductions (the
    fp32 copies, the largest one reduction's buffer)."""
    names = list(s.infos)
    params = sum(s.param(n) for n in names)
    grads = sum(s.grad(n) for n in names)
    copies = sum(s.copy(n) for n in names)
    one = max((s.grad(n) + s.reduce(n) for n in names), default=0)
    return max(params + grads, grads + copies + one + sum(s.shard(n) for n in names))


class _Replay:
    """The running bytes of a replayed plan: the gathered copies alive (``resident``), the full
    gradients (``grads``), the reduction in flight and the shards made. Sums are kept as they
    change (summing the sets at every measurement would make the replay quadratic in the layers)."""

    def __init__(self, sizes: _Sizes) -> None:
        self.s = sizes
        self.resident: set[str] = set()
        self.grads: set[str] = set()
        self.held = self.in_flight = self.done = self.peak = 0

    def add(self, names: Iterable[str], into: set[str], size) -> None:
        for n in set(names) - into:
            into.add(n)
            self.held += size(n)

    def drop(self, names: Iterable[str], out_of: set[str], size) -> None:
        for n in set(names) & out_of:
            out_of.discard(n)
            self.held -= size(n)

    def measure(self, extra: int = 0) -> None:
        self.peak = max(self.peak, self.held + self.in_flight + self.done + extra)

    def take(self, names: Sequence[str]) -> None:
        """Reductions of ``names`` started: the previous one completes first; one gradient at a
        time, its accumulator and its buffer, then the buffer alone."""
        self.in_flight = 0
        for n in names:
            self.measure(self.s.reduce(n))
            self.drop((n,), self.grads, self.s.grad)
            self.in_flight += self.s.buffer(n)
            self.done += self.s.shard(n)
        self.measure()


def _replay(plan: GatherPlan, s: _Sizes, merged: set[str]) -> int:
    """The peak bytes of the "chunk" policy: ``plan`` step by step. merged: the expert gradients
    whose weight GEMMs run merged at their take (pp = 1) instead of at each W."""
    known = s.infos.keys()  # the runtime skips names it holds no shard of; so does the replay

    def at(d: Mapping[int, tuple[str, ...]], k: int) -> list[str]:
        return [n for n in d.get(k, ()) if n in known]

    r = _Replay(s)
    for k in range(plan.num_steps):
        r.add(at(plan.fetch_at, k), r.resident, s.param)
        r.add(set(at(plan.w_at, k)) - merged, r.grads, s.grad)
        r.measure()
        r.drop(at(plan.free_at, k), r.resident, s.param)  # freed before the gradients are taken
        taken = at(plan.take_at, k)
        r.add(set(taken) & merged, r.grads, s.grad)  # the merged expert GEMMs run at the take
        r.take(taken)
    r.take(sorted(r.grads))  # those summed over the pipeline first, at the step's end
    return r.peak


def gathered_working_set_bytes(
    model: Model,
    mesh: Mesh,
    shapes: Mapping[str, Sequence[int]],
    local_names: Sequence[str],
    dtype: torch.dtype | None,
    *,
    num_microbatches: int,
    schedule=None,
    gather: str = "chunk",
    fp8: bool = False,
    master_dtype: torch.dtype = torch.float32,
    with_grad_shards: bool = False,
) -> int:
    """The most bytes of gathered parameters plus full (not yet reduce-scattered) gradients that one
    ``parallel_step`` on this rank holds at once, from shapes alone (pure, no process group).

    mesh: the sizes and this rank's coordinates (no groups needed); shapes: every parameter's
    canonical shape; local_names: this rank's parameters (``pipeline.local_param_names``); dtype:
    the step's compute dtype (None: the master dtype); schedule: the table for pp > 1; gather/fp8:
    as ``parallel_step``. Counted, per step of the executor: the gathered copies alive (fetched
    one gather point ahead, padded, in the compute dtype but for ``model.buffers``), the full
    gradient accumulators (compute dtype, from a parameter's first W to its reduction), the fp32
    copies a reduction makes and the one reduction in flight. Not counted: the shards at rest
    (parameters, gradient shards, optimizer state) and activations; with_grad_shards: count the
    gradient shards the step has produced so far too (what a measured peak of the step sees).
    """
    infos = planned_layout(model, mesh, shapes, local_names)
    scale = 1.0 / (mesh.dp * mesh.cp * mesh.ep)
    sizes = _Sizes(infos, dtype, master_dtype, scale, model.buffers, with_grad_shards)
    if not per_unit(gather, fp8, any(info.size > 1 for info in infos.values())):
        return _whole_step_bytes(sizes)
    plan = step_gather_plan(model, mesh, num_microbatches, schedule)
    # pp = 1 merges the expert weight GEMMs of all microbatches into one, run when the gradient is
    # taken (``runner.execute``): until then an expert gradient is its GEMM's activations only
    merged = {n for n in infos if infos[n].expert} if mesh.pp == 1 else set()
    return _replay(plan, sizes, merged)
