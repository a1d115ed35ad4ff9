"""Per-unit gathers: when a step's parameters are gathered and freed and its gradients reduced
(:class:`GatherPlan`, pure), and the runtime that follows a plan (:class:`UnitGathers`).

:func:`step_gather_plan` is the one place the plan of a ``parallel_step`` is made: the step runs it,
and the memory model of ``fmoe plan`` (``fmoe.working_set``) replays it. The policies, the units
and the costs are ``fmoe.parallel``'s docstring.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

from fmoe import dist as D
from fmoe import pipeline, runner
from fmoe.collectives import PendingShard, scaled_grad, start_reduce
from fmoe.mesh import Mesh
from fmoe.sharding import ShardInfo
from fmoe.stages.spec import Model

__all__ = [
    "GATHER_POLICIES",
    "GatherPlan",
    "UnitGathers",
    "gather_plan",
    "per_unit",
    "step_gather_plan",
    "unit_uses",
]

GATHER_POLICIES = ("chunk", "step")


def per_unit(gather: str, fp8: bool, sharded: bool) -> bool:
    """Whether a step gathers per unit: the "chunk" policy, some parameter sharded (``sharded``),
    and no FP8 (its weight cache is keyed by storage address, which a freed and re-gathered weight
    could alias). ValueError for a policy not in ``GATHER_POLICIES``."""
    if gather not in GATHER_POLICIES:
        raise ValueError(f"parallel.gather must be one of {', '.join(GATHER_POLICIES)}, got {gather!r}")
    return gather == "chunk" and not fp8 and sharded


@dataclass(frozen=True)
class GatherPlan:
    """When each parameter's gathered copy exists and when its gradient is final, over the steps
    k = 0..num_steps-1 of a step's executor (``runner.microbatch_plan``'s steps for pp = 1, this
    rank's rows ``interpreter.rank_actions`` for pp > 1).

    fetch_at[k]: names whose all-gather is started just before step k (one gather point ahead of
    their use: the prefetch); ready_at[k]: names that must be gathered before step k runs;
    free_at[k]: names whose gathered copy is freed after step k; take_at[k]: names whose gradient is
    final after step k (reduce-scattered then); w_at[k]: names whose W step k runs (their gradient
    exists from the first). A name may be fetched and freed several times.
    """

    num_steps: int
    fetch_at: dict[int, tuple[str, ...]]
    ready_at: dict[int, tuple[str, ...]]
    free_at: dict[int, tuple[str, ...]]
    take_at: dict[int, tuple[str, ...]]
    w_at: dict[int, tuple[str, ...]]


def _spans(uses: Sequence[Collection[str]], regather: bool) -> tuple[list[tuple[int, int, str]], list[str]]:
    """((first step, last step, name) of every gathered copy, sorted; the names in first-use order)."""
    steps: dict[str, list[int]] = {}  # name -> the steps that read it, ascending
    for k, used in enumerate(uses):
        for name in sorted(used):
            steps.setdefault(name, []).append(k)
    spans: list[tuple[int, int, str]] = []
    for name, ks in steps.items():
        lo = ks[0]
        for prev, k in zip(ks, ks[1:]):
            if regather and k != prev + 1:
                spans.append((lo, prev, name))
                lo = k
        spans.append((lo, ks[-1], name))
    return sorted(spans), list(steps)


def _frozen(d: dict[int, list[str]]) -> dict[int, tuple[str, ...]]:
    return {k: tuple(v) for k, v in d.items()}


def gather_plan(
    uses: Sequence[Collection[str]],
    w_uses: Sequence[Collection[str]],
    *,
    regather: bool,
    keep: Collection[str] = (),
) -> GatherPlan:
    """The gather plan of a step whose step k reads the parameters ``uses[k]`` and runs the W of
    ``w_uses[k]``. regather: free a parameter after every run of consecutive steps that read it
    and gather it again for its next use (else it stays gathered from its first use to its last);
    keep: names whose gradients are not taken during the step (another rank adds to them first)."""
    spans, names = _spans(uses, regather)
    points = sorted({lo for lo, _, _ in spans})
    fetch_at: dict[int, list[str]] = {}
    ready_at: dict[int, list[str]] = {}
    free_at: dict[int, list[str]] = {}
    last_free: dict[str, int] = {}
    for lo, hi, name in spans:
        at = bisect.bisect_left(points, lo)
        fetch = points[at - 1] if at else lo  # prefetched at the gather point before its own
        if name in last_free:
            fetch = max(fetch, last_free[name] + 1)  # not before its previous copy is freed
        fetch_at.setdefault(fetch, []).append(name)
        ready_at.setdefault(lo, []).append(name)
        free_at.setdefault(hi, []).append(name)
        last_free[name] = hi
    last_w = {name: k for k, w in enumerate(w_uses) for name in w}
    take_at: dict[int, list[str]] = {}
    for name in names:
        if name not in keep and name in last_w:
            take_at.setdefault(last_w[name], []).append(name)
    w_at = {k: tuple(sorted(w)) for k, w in enumerate(w_uses) if w}
    return GatherPlan(
        len(uses), _frozen(fetch_at), _frozen(ready_at), _frozen(free_at), _frozen(take_at), w_at
    )


def unit_uses(
    model: Model, num_microbatches: int, schedule, pp_rank: int
) -> tuple[list[set[str]], list[set[str]], set[str]]:
    """(names each executor step reads, names whose W it runs, names not to take early) of a step:
    the executor's steps for ``schedule`` None (pp = 1), else pipeline rank ``pp_rank``'s rows."""
    if schedule is None:
        units = runner.execution_units(model)
        names = [{n for i in unit for n in model.stages[i].params} for unit in units]
        plan = runner.microbatch_plan(len(units), num_microbatches)
        uses = [names[s.unit] for s in plan]
        return uses, [names[s.unit] if s.phase == "BW" else set() for s in plan], set()
    from fmoe.interpreter import chunks_used, rank_actions

    smap = pipeline.schedule_stage_map(model, schedule)
    chunk_names = {
        c: {n for i in smap[(pp_rank, c)] for n in model.stages[i].params} for c in range(schedule.chunks)
    }
    uses, w_uses = [], []
    for action in rank_actions(schedule, pp_rank):
        read, w = chunks_used(action)
        uses.append(set().union(*(chunk_names[c] for c in read)))
        w_uses.append(set().union(*(chunk_names[c] for c in w)))
    holders = pipeline.param_holders(model, schedule)
    return uses, w_uses, {n for n, ranks in holders.items() if len(ranks) > 1}


def step_gather_plan(model: Model, mesh: Mesh, num_microbatches: int, schedule=None) -> GatherPlan:
    """The plan of one ``parallel_step`` of this rank under the "chunk" policy: re-gathered per use
    over the executor's steps for pp = 1 (``schedule`` ignored), kept gathered from first to last
    use over the rank's rows of ``schedule`` for pp > 1. mesh: its sizes and coordinates only.

    A pass over every use of every parameter: a trainer makes it once and passes it to each step."""
    table = schedule if mesh.pp > 1 else None
    uses, w_uses, keep = unit_uses(model, num_microbatches, table, mesh.coords["pp"])
    return gather_plan(uses, w_uses, regather=table is None, keep=keep)


class UnitGathers:
    """The runtime of a ``GatherPlan``: gathered parameters whose storage exists only while the plan
    says (``params``: one tensor object per name for the whole step, so the autograd graph of a
    microbatch's F reads the copy gathered again for its B), and the reduction of each gradient as
    soon as it is final (one reduction in flight at a time, so at most one unit's full gradients
    wait on the network). Names the plan has but ``shards`` lacks are skipped.

    shards/infos: this rank's flat shards and their layout; dtype: the compute dtype (None: the
    shards'), but for ``uncast``; scale: the gradients' 1 / data ranks."""

    def __init__(
        self, shards: Mapping[str, Tensor], infos: Mapping[str, ShardInfo], mesh: Mesh, dtype,
        uncast: Collection[str], plan: GatherPlan, scale: float,
    ) -> None:  # fmt: skip
        self.shards, self.infos, self.mesh, self.plan = shards, infos, mesh, plan
        self.dtype, self.uncast, self.scale = dtype, uncast, scale
        self.params: dict[str, Tensor] = {}
        self.flat: dict[str, Tensor] = {}  # names gathered per use: their padded flat buffers
        for name, shard in shards.items():
            info = infos[name]
            want = shard.dtype if dtype is None or name in uncast else dtype
            if info.size == 1 and want == shard.dtype:
                self.params[name] = info.unpad(shard)  # nothing to gather
                continue
            buf = shard.new_empty(info.padded_numel, dtype=want)
            self.flat[name] = buf
            self.params[name] = info.unpad(buf)  # a view made while in bounds
            buf.untyped_storage().resize_(0)  # no memory until the plan gathers it
        self.gathering: dict[str, object] = {}
        self.reducing: list[tuple[str, PendingShard]] = []  # the reduction in flight
        self.grad_shards: dict[str, Tensor] = {}

    def _fetch(self, names: Sequence[str]) -> None:
        for name in names:
            buf = self.flat.get(name)
            if buf is None:
                continue
            info = self.infos[name]
            storage = buf.untyped_storage()
            storage.resize_(buf.numel() * buf.element_size())
            # a new tensor on the storage: writing it leaves the version counter that the autograd
            # graph of an earlier F saved with this parameter untouched
            out = buf.new_empty(0).set_(storage, 0, (buf.numel(),))
            src = self.shards[name].to(buf.dtype)
            if info.size == 1:
                out.copy_(src)
                continue
            group = self.mesh.group(info.group)
            self.gathering[name] = D.all_gather_single(out, src.contiguous(), group=group, async_op=True)

    def before(self, k: int) -> None:
        """``runner.StepHooks.before``: start step k's prefetches, wait for what it reads."""
        self._fetch(self.plan.fetch_at.get(k, ()))
        for name in self.plan.ready_at.get(k, ()):
            work = self.gathering.pop(name, None)
            if work is not None:
                work.wait()

    def after(self, k: int) -> None:
        """``runner.StepHooks.after``: free the copies step k read last."""
        for name in self.plan.free_at.get(k, ()):
            buf = self.flat.get(name)
            if buf is not None:
                buf.untyped_storage().resize_(0)

    def _complete(self) -> None:
        for name, pending in self.reducing:
            self.grad_shards[name] = pending.wait()
        self.reducing = []

    def taken(self, grads: dict[str, Tensor]) -> None:
        """Reduce final full gradients (owned by us, ``runner.StepHooks``) over their shard groups."""
        self._complete()
        for name in list(grads):
            info = self.infos[name]
            flat = info.pad(
                scaled_grad(grads.pop(name), name, info, self.dtype, self.scale, self.uncast).reshape(-1)
            )
            group = self.mesh.group(info.group)
            self.reducing.append((name, start_reduce(flat, info, group, owned=True, async_op=True)))

    def finish(self, rest: dict[str, Tensor]) -> dict[str, Tensor]:
        """Reduce the gradients the step did not take (``rest``), wait for everything, free every
        gathered copy; this rank's gradient shards in ``infos`` order."""
        self.taken(rest)
        self._complete()
        for work in self.gathering.values():
            work.wait()
        for buf in self.flat.values():
            buf.untyped_storage().resize_(0)
        self.params.clear()
        return {n: self.grad_shards[n] for n in self.infos}
