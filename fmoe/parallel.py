"""One training step on the 4D mesh, with parameters sharded ZeRO-3 style.

Every parameter lives as a flat shard: expert parameters (this ep rank's experts) split over
``dp_cp``, all others over ``dp_cp_ep``, each padded to a multiple of its group's size. A step runs
the microbatches - the pipeline interpreter when pp > 1, else the micro-batch executor
(``runner.execute``) - with the ep and cp groups in every StageContext, losses seeded
1 / microbatches; each gradient is scaled by 1 / (dp x cp x ep) (the step's loss is the mean over
data ranks) and reduce-scattered over its shard group. When the parameters are gathered is the
``gather`` policy (recipe field ``parallel.gather``):

"chunk" (the default wherever a parameter is sharded): per unit, just before its use, prefetched
one gather point ahead (asynchronous all-gathers), freed after its use; each gradient reduced as
soon as its last W of the step has run (asynchronously, one unit's reduction in flight while the
step goes on). A rank's step is a list of executor steps (``GatherPlan``):
  - pp = 1: the units are the transformer layers (plus the stages before the first and after the
    last, ``runner.execution_units``), and every microbatch's F and B + W of a layer is a step.
    Policy: RE-GATHER PER USE. A layer is gathered for each microbatch's F, freed, gathered again
    for its B + W, freed (consecutive uses share one copy: the last layer's F and B, the first
    layer's B and the next microbatch's F). Autograd's saved weights keep pointing at the same
    tensor objects; only their storage is released and re-filled, so a microbatch's graph holds no
    parameter memory between its F and B. Memory: about two layers' gathered parameters (the one
    in use and the prefetched one) instead of all; the full gradients still accumulate over the
    microbatches (the non-expert ones from the first microbatch's W, the expert ones only when
    their merged GEMM runs at the last), and each layer's is reduced during the last microbatch's
    backward. Communication: about 2 x microbatches all-gathers of each layer per step (against
    one), one reduce-scatter (as before). Keeping a layer gathered across microbatches would save
    nothing: the first microbatch's F would leave every layer gathered until the last B. Reducing
    every microbatch's gradients would also cut the full gradients to a layer, for microbatches x
    the reduce-scatter traffic and another summation order; not done.
  - pp > 1: the units are the rank's pipeline chunks and a step is a row of the table
    (``interpreter.rank_actions``): a chunk is gathered before its first F and freed after its
    last use (KEEP GATHERED: its F and B interleave over the whole schedule); its gradients are
    reduced after its last W, except those of parameters several pipeline ranks hold (DualPipe's
    copies, tied embeddings), which are summed over the pipeline first at the step's end.
  The results are bitwise those of "step": the same arithmetic in the same order, the same
  reductions of the same full gradients. ``gathered_working_set_bytes`` is the peak of this
  policy's gathered parameters plus full gradients, from shapes alone (what ``fmoe plan`` uses).
"step": every parameter of the rank gathered (asynchronously) once before the step, freed after
it; every gradient reduced after the step's last W: the peak of plain data parallelism. FP8 steps
use it (their weight cache, keyed by storage address, must not see a re-gathered weight).

The optimizer then updates shards (``fmoe.optim`` over the shard dicts, the global norm summed
over the world). Checkpoints hold the canonical, layout-free tensors (:func:`canonical`,
:func:`shard_canonical`), so a run saved on one mesh resumes on another.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from fmoe import dist as D
from fmoe import pipeline, runner
from fmoe.expert_parallel import expert_range, is_expert_param
from fmoe.memory_policy import MemoryPolicy
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
    model: Model,
    params: Mapping[str, Tensor],
    batch: runner.Batch,
    num_microbatches: int,
    mesh: Mesh,
    seed: int,
    hooks: runner.StepHooks | None = None,
    memory: MemoryPolicy | None = None,
) -> runner.StepResult:
    """pp = 1: every stage on this rank, through the micro-batch executor (``runner.execute``).

    hooks: the per-layer gathers (``_UnitGathers``); the returned grads then hold only the
    parameters the hooks did not take."""
    statistics: dict[str, Tensor] = {}
    microbatches = runner.split_microbatches(batch, num_microbatches)
    groups = mesh.stage_groups()
    contexts = [
        StageContext(microbatch=mesh.data_rank * num_microbatches + i, seed=seed, groups=groups)
        for i in range(num_microbatches)
    ]
    losses, grads = runner.execute(
        model, params, microbatches, contexts, 1.0 / num_microbatches, statistics=statistics, hooks=hooks,
        memory=memory,
    )  # fmt: skip
    return runner.StepResult(runner.mean_loss(losses), grads, losses, statistics)


# ------------------------------------------------------------------------------------------------
# per-unit gathers: a unit's parameters gathered just before its use, its gradients reduced at once

GATHER_POLICIES = ("chunk", "step")


@dataclass(frozen=True)
class GatherPlan:
    """When each parameter's gathered copy exists and when its gradient is final, over the steps
    k = 0..num_steps-1 of a step's executor (``runner.microbatch_plan``'s steps for pp = 1, this
    rank's rows ``interpreter.rank_actions`` for pp > 1).

    fetch_at[k]: names whose all-gather is started just before step k (one gather point ahead of
    their use: the prefetch); ready_at[k]: names that must be gathered before step k runs;
    free_at[k]: names whose gathered copy is freed after step k; take_at[k]: names whose gradient is
    final after step k (reduce-scattered then). A name may be fetched and freed several times.
    """

    num_steps: int
    fetch_at: dict[int, tuple[str, ...]]
    ready_at: dict[int, tuple[str, ...]]
    free_at: dict[int, tuple[str, ...]]
    take_at: dict[int, tuple[str, ...]]


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
    steps: dict[str, list[int]] = {}  # name -> the steps that read it, ascending
    last_w: dict[str, int] = {}
    for k, used in enumerate(uses):
        for name in sorted(used):
            steps.setdefault(name, []).append(k)
        for name in w_uses[k]:
            last_w[name] = k
    spans: list[tuple[int, int, str]] = []  # (first step, last step, name) a gathered copy covers
    for name, ks in steps.items():
        lo = ks[0]
        for prev, k in zip(ks, ks[1:]):
            if regather and k != prev + 1:
                spans.append((lo, prev, name))
                lo = k
        spans.append((lo, ks[-1], name))
    points = sorted({lo for lo, _, _ in spans})
    fetch_at: dict[int, list[str]] = {}
    ready_at: dict[int, list[str]] = {}
    free_at: dict[int, list[str]] = {}
    last_free: dict[str, int] = {}
    for lo, hi, name in sorted(spans):
        at = bisect.bisect_left(points, lo)
        fetch = points[at - 1] if at else lo  # prefetched at the gather point before its own
        if name in last_free:
            fetch = max(fetch, last_free[name] + 1)  # not before its previous copy is freed
        fetch_at.setdefault(fetch, []).append(name)
        ready_at.setdefault(lo, []).append(name)
        free_at.setdefault(hi, []).append(name)
        last_free[name] = hi
    take_at: dict[int, list[str]] = {}
    for name in steps:
        if name not in keep and name in last_w:
            take_at.setdefault(last_w[name], []).append(name)

    def frozen(d: dict[int, list[str]]) -> dict[int, tuple[str, ...]]:
        return {k: tuple(v) for k, v in d.items()}

    return GatherPlan(len(uses), frozen(fetch_at), frozen(ready_at), frozen(free_at), frozen(take_at))


def _unit_uses(
    model: Model, num_microbatches: int, schedule, pp_rank: int
) -> tuple[list[set[str]], list[set[str]], set[str]]:
    """(names each executor step reads, names whose W it runs, names not to take early) of a step."""
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


_PLANS: dict[tuple, tuple[Model, object, GatherPlan]] = {}


def _step_plan(model: Model, num_microbatches: int, schedule, pp_rank: int) -> GatherPlan:
    """The gather plan of a step, built once per (model, microbatches, table, rank) object: a trainer
    runs the same step every time, and a plan costs a pass over every use of every parameter."""
    key = (id(model), num_microbatches, id(schedule), pp_rank)
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is model and hit[1] is schedule:
        return hit[2]
    uses, w_uses, keep = _unit_uses(model, num_microbatches, schedule, pp_rank)
    plan = gather_plan(uses, w_uses, regather=schedule is None, keep=keep)
    if len(_PLANS) > 16:
        _PLANS.clear()
    _PLANS[key] = (model, schedule, plan)  # holding the objects keeps their ids from being reused
    return plan


def _per_unit(gather: str, fp8: bool, infos: Mapping[str, ShardInfo]) -> bool:
    """Whether a step gathers per unit: the "chunk" policy, sharded parameters, and no FP8 (its
    weight cache is keyed by storage address, which a freed and re-gathered weight could alias)."""
    if gather not in GATHER_POLICIES:
        raise ValueError(f"parallel.gather must be one of {', '.join(GATHER_POLICIES)}, got {gather!r}")
    return gather == "chunk" and not fp8 and any(info.size > 1 for info in infos.values())


def _grad_dtype(name: str, info: ShardInfo, dtype, scale: float, uncast: Collection[str]):
    """The dtype a gradient is reduced in: fp32 where it is summed over ranks or scaled."""
    if dtype is None or name in uncast:
        return None
    return torch.float32 if scale != 1.0 or info.size > 1 else None


class _UnitGathers:
    """The runtime of a ``GatherPlan``: gathered parameters whose storage exists only while the plan
    says (``params``: one tensor object per name for the whole step, so the autograd graph of a
    microbatch's F reads the copy gathered again for its B), and the reduction of each gradient as
    soon as it is final (one reduction in flight at a time, so at most one unit's full gradients
    wait on the network)."""

    def __init__(self, shards, infos, mesh: Mesh, dtype, uncast, plan: GatherPlan, scale: float):
        self.shards, self.infos, self.mesh, self.plan = shards, infos, mesh, plan
        self.dtype, self.uncast, self.scale = dtype, uncast, scale
        self.params: dict[str, Tensor] = {}
        self.flat: dict[str, Tensor] = {}  # names gathered per use: their padded flat buffers
        for name, shard in shards.items():
            info = infos[name]
            want = shard.dtype if dtype is None or name in uncast else dtype
            if info.size == 1 and want == shard.dtype:
                self.params[name] = shard[: info.numel].view(info.full_shape)  # nothing to gather
                continue
            buf = torch.empty(info.shard_numel * info.size, dtype=want, device=shard.device)
            self.flat[name] = buf
            self.params[name] = buf[: info.numel].view(info.full_shape)  # a view made while in bounds
            buf.untyped_storage().resize_(0)  # no memory until the plan gathers it
        self.gathering: dict[str, object] = {}
        self.reducing: list = []  # (name, work, flat) of the reduction in flight
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
            self.gathering[name] = dist.all_gather_into_tensor(
                out, src.contiguous(), group=group, async_op=True
            )

    def before(self, k: int) -> None:
        self._fetch(self.plan.fetch_at.get(k, ()))
        for name in self.plan.ready_at.get(k, ()):
            work = self.gathering.pop(name, None)
            if work is not None:
                work.wait()

    def after(self, k: int) -> None:
        for name in self.plan.free_at.get(k, ()):
            buf = self.flat.get(name)
            if buf is not None:
                buf.untyped_storage().resize_(0)

    def _complete(self) -> None:
        for name, work, flat in self.reducing:
            info = self.infos[name]
            if work is not None:
                work.wait()
            if flat is not None:  # gloo: all-reduced in place; keep this rank's slice
                self.grad_shards[name] = flat[
                    info.index * info.shard_numel : (info.index + 1) * info.shard_numel
                ].clone()
        self.reducing = []

    def taken(self, grads: dict[str, Tensor]) -> None:
        """Reduce final full gradients (owned by us, ``runner.StepHooks``) over their shard groups."""
        self._complete()
        for name in list(grads):
            g = grads.pop(name)
            info = self.infos[name]
            to = _grad_dtype(name, info, self.dtype, self.scale, self.uncast)
            if to is not None:
                g = g.to(to)
            if self.scale != 1.0:
                g = g.mul_(self.scale)
            flat = g.reshape(-1)
            pad = info.shard_numel * info.size - flat.numel()
            if pad:
                flat = torch.cat([flat, flat.new_zeros(pad)])
            del g
            group = self.mesh.group(info.group)
            if info.size == 1:
                self.grad_shards[name] = flat
            elif dist.get_backend(group) == "nccl":
                shard = flat.new_empty(info.shard_numel)
                work = dist.reduce_scatter_tensor(shard, flat.contiguous(), group=group, async_op=True)
                self.grad_shards[name] = shard
                self.reducing.append((name, work, None))
            else:  # gloo has no reduce-scatter; the gradient is ours, so reduce it in place
                flat = flat.contiguous()
                self.reducing.append((name, dist.all_reduce(flat, group=group, async_op=True), flat))

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


def planned_layout(
    model: Model, mesh: Mesh, shapes: Mapping[str, Sequence[int]], names: Sequence[str]
) -> dict[str, ShardInfo]:
    """``layout`` from the mesh's sizes and coordinates alone (no process group): what a rank of a
    mesh not built yet would hold (``Mesh(pp, dp, cp, ep, rank, coords)``)."""
    c = mesh.coords
    sizes = {"dp_cp": (mesh.dp * mesh.cp, c["dp"] * mesh.cp + c["cp"]),
             "dp_cp_ep": (mesh.dp * mesh.cp * mesh.ep, (c["dp"] * mesh.cp + c["cp"]) * mesh.ep + c["ep"])}  # fmt: skip
    out = {}
    for name in names:
        shape = tuple(shapes[name])
        group = "dp_cp" if is_expert_param(name) else "dp_cp_ep"
        if is_expert_param(name) and mesh.ep > 1:
            shape = (model.num_experts // mesh.ep, *shape[1:])
        out[name] = ShardInfo(shape, group, *sizes[group])
    return out


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
    uncast = model.buffers

    def size_of(d) -> int:
        return d.itemsize

    def param_bytes(n: str) -> int:
        want = master_dtype if dtype is None or n in uncast else dtype
        info = infos[n]
        return 0 if info.size == 1 and want == master_dtype else info.shard_numel * info.size * size_of(want)

    def grad_bytes(n: str) -> int:
        want = master_dtype if dtype is None or n in uncast else dtype
        return infos[n].numel * size_of(want)

    def buffer_bytes(n: str) -> int:  # the flat tensor a reduction reads and writes
        info = infos[n]
        to = _grad_dtype(n, info, dtype, scale, uncast)
        padded = info.shard_numel * info.size
        if to is None and padded == info.numel:
            return grad_bytes(n)  # the accumulator itself
        return padded * size_of(to or (master_dtype if dtype is None or n in uncast else dtype))

    def reduce_bytes(n: str) -> int:  # what a reduction holds beyond the accumulator
        return buffer_bytes(n) - grad_bytes(n) if buffer_bytes(n) != grad_bytes(n) else 0

    def shard_bytes(n: str) -> int:
        if not with_grad_shards:
            return 0
        to = _grad_dtype(n, infos[n], dtype, scale, uncast)
        return infos[n].shard_numel * size_of(to or (master_dtype if dtype is None or n in uncast else dtype))

    if not _per_unit(gather, fp8, infos):
        params = sum(param_bytes(n) for n in infos)
        grads = sum(grad_bytes(n) for n in infos)
        copies = sum(
            infos[n].numel * 4 for n in infos if _grad_dtype(n, infos[n], dtype, scale, uncast) is not None
        )
        one = max((grad_bytes(n) + reduce_bytes(n) for n in infos), default=0)
        return max(params + grads, grads + copies + one + sum(shard_bytes(n) for n in infos))
    schedule = schedule if mesh.pp > 1 else None
    uses, w_uses, keep = _unit_uses(model, num_microbatches, schedule, mesh.coords["pp"])
    known = set(infos)  # once, not per step: the plan stays linear in the layer count
    uses = [u & known for u in uses]
    w_uses = [u & known for u in w_uses]
    plan = gather_plan(uses, w_uses, regather=schedule is None, keep=keep & known)
    resident: set[str] = set()
    grads: set[str] = set()
    # pp = 1 merges the expert weight GEMMs of all microbatches into one, run when the gradient is
    # taken (``runner.execute``): until then an expert gradient is its GEMM's activations only
    merged = {n for n in infos if is_expert_param(n)} if schedule is None else set()
    # the bytes of resident and grads are kept as running sums (summing the sets at every
    # measurement would make the plan quadratic in the layer count)
    state = {"in_flight": 0, "done": 0, "peak": 0, "held": 0}  # + the reduction in flight; shards made

    def add(names, into: set[str], size) -> None:
        for n in set(names) - into:
            into.add(n)
            state["held"] += size(n)

    def drop(names, out_of: set[str], size) -> None:
        for n in set(names) & out_of:
            out_of.discard(n)
            state["held"] -= size(n)

    def measure(extra: int = 0) -> None:
        state["peak"] = max(state["peak"], state["held"] + state["in_flight"] + state["done"] + extra)

    def take(names: Sequence[str]) -> None:
        state["in_flight"] = 0  # the previous reduction completes first
        for n in names:  # one gradient at a time: its accumulator and its buffer, then the buffer
            measure(reduce_bytes(n))
            drop((n,), grads, grad_bytes)
            state["in_flight"] += buffer_bytes(n)
            state["done"] += shard_bytes(n)
        measure()

    for k in range(plan.num_steps):
        add(plan.fetch_at.get(k, ()), resident, param_bytes)
        add(set(w_uses[k]) - merged, grads, grad_bytes)
        measure()
        drop(plan.free_at.get(k, ()), resident, param_bytes)  # freed before the gradients are taken
        add(
            set(plan.take_at.get(k, ())) & merged, grads, grad_bytes
        )  # the merged expert GEMMs run at the take
        take(plan.take_at.get(k, ()))
    take(sorted(grads))  # those summed over the pipeline first, at the step's end
    return state["peak"]


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


def _run(
    model, params, batch, num_microbatches, mesh, schedule, seed, timeout_s, hooks, memory=None
) -> runner.StepResult:
    """This rank's share of a step: the pipeline interpreter for pp > 1, else the executor."""
    if mesh.pp == 1:
        return _local_step(model, params, batch, num_microbatches, mesh, seed, hooks, memory)
    from fmoe.interpreter import run_schedule

    return run_schedule(
        schedule, model, params, batch, mesh.group("pp"), seed=seed, stage_groups=mesh.stage_groups(),
        timeout_s=timeout_s, hooks=hooks, memory=memory,
    )  # fmt: skip


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
    gather: str = "chunk",
    memory: MemoryPolicy | None = None,
) -> ShardedStep:
    """One step on this rank: (the step's loss, identical on every rank; this rank's gradient shards;
    the step's statistics summed over the world, see ``ShardedStep``).

    shards/infos: this rank's parameter shards and their layout (``layout``); batch: the GLOBAL
    batch (every rank passes the same; each takes its share); schedule: a table for pp > 1; fp8:
    the step's GEMMs in FP8 (each weight quantized once here, reused by every microbatch; with
    fp8_dense=False only the expert GEMMs, see ``fp8_training``); timeout_s: how long a pipeline
    rank waits for a peer before it gives up (``fmoe.dist.wait``); gather: "chunk" (per layer /
    pipeline chunk, wherever a parameter is sharded and fp8 is off) or "step" (all at once), see
    the module docstring; both give bitwise the same results; memory: the merge window and each
    stage's recomputation (``fmoe.memory_policy``; None: the defaults). The gradient shards are fp32 where
    they were summed over ranks, else in the compute dtype.
    """
    mine = local_batch(batch, mesh)
    scale = 1.0 / (mesh.dp * mesh.cp * mesh.ep)
    if _per_unit(gather, fp8, infos):
        plan = _step_plan(model, num_microbatches, schedule if mesh.pp > 1 else None, mesh.coords["pp"])
        gathers = _UnitGathers(shards, infos, mesh, dtype, model.buffers, plan, scale)
        hooks = runner.StepHooks(gathers.before, gathers.after, plan.take_at, gathers.taken)
        result = _run(
            model, gathers.params, mine, num_microbatches, mesh, schedule, seed, timeout_s, hooks, memory
        )
        grad_shards = gathers.finish(result.grads)
    else:
        params = gather_params(shards, infos, mesh, dtype, uncast=model.buffers)
        with fp8_training(fp8, dense=fp8_dense):
            result = _run(
                model, params, mine, num_microbatches, mesh, schedule, seed, timeout_s, None, memory
            )
        del params
        grads = result.grads
        if dtype is not None:
            # Sums over ranks and the 1/ranks scale run in fp32. A gradient that nothing reduces or
            # scales (one rank) goes to the optimizer in the compute dtype: its AdamW kernel reads it
            # as it is, so the step writes no fp32 copy of every gradient.
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
