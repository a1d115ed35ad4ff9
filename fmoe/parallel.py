"""One training step on the 4D mesh, with parameters sharded ZeRO-3 style.

Every parameter lives as a flat shard (``fmoe.sharding``: expert parameters, this ep rank's
experts, split over ``dp_cp``, all others over ``dp_cp_ep``, each padded to a multiple of its
group's size). A step runs
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
  reductions of the same full gradients. The plan is ``gather_plan.step_gather_plan``'s (a trainer
  makes it once and passes it: ``plan=``); ``working_set.gathered_working_set_bytes`` replays it
  for the peak of this policy's gathered parameters plus full gradients, from shapes alone (what
  ``fmoe plan`` uses).
"step": every parameter of the rank gathered (asynchronously) once before the step, freed after
it; every gradient reduced after the step's last W: the peak of plain data parallelism. FP8 steps
use it (their weight cache, keyed by storage address, must not see a re-gathered weight), and hand
the stages the expert weights a rank holds whole as the fp32 masters themselves, with no bf16 copy
(``collectives.uncast_params``: only their FP8 copies are read).

The optimizer then updates shards (``fmoe.optim`` over the shard dicts, the global norm summed
over the world, ``world_sq_norm``). Checkpoints hold the canonical, layout-free tensors
(``sharding.canonical``, ``sharding.shard_canonical``), so a run saved on one mesh resumes on another.

Modules, one concern each: ``fmoe.sharding`` (the layout, pad / slice, canonical tensors),
``fmoe.collectives`` (gathers, reductions, world sums), ``fmoe.gather_plan`` (the per-unit plan
and its runtime), ``fmoe.working_set`` (the plan's memory, for ``fmoe plan``), this one (the step).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from fmoe import dist as D
from fmoe import runner
from fmoe.collectives import gather_params, reduce_scatter_grads, scaled_grad, uncast_params, world_statistics
from fmoe.gather_plan import GatherPlan, UnitGathers, per_unit, step_gather_plan
from fmoe.memory_policy import MemoryPolicy
from fmoe.mesh import Mesh
from fmoe.sharding import ShardInfo
from fmoe.stages.context_parallel import split_batch
from fmoe.stages.primitives import fp8_training
from fmoe.stages.spec import Model, StageContext

__all__ = [
    "ShardedStep",
    "local_batch",
    "parallel_step",
]


class ShardedStep(NamedTuple):
    """What ``parallel_step`` returns. loss: the step's loss, identical on every rank; grad_shards:
    this rank's gradient shards; statistics: {Statistic.name: int64 count} of every stage of the
    model, summed over the step's microbatches and over the world (identical on every rank)."""

    loss: Tensor
    grad_shards: dict[str, Tensor]
    statistics: dict[str, Tensor]


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

    hooks: the per-layer gathers (``UnitGathers``); the returned grads then hold only the
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
    fp8_dense_wgrad: bool = True,
    fp8_expert_wgrad: bool = True,
    timeout_s: float = D.DEFAULT_TIMEOUT_S,
    gather: str = "chunk",
    plan: GatherPlan | None = None,
    memory: MemoryPolicy | None = None,
) -> ShardedStep:
    """One step on this rank: (the step's loss, identical on every rank; this rank's gradient shards;
    the step's statistics summed over the world, see ``ShardedStep``).

    shards/infos: this rank's parameter shards and their layout (``layout``); batch: the GLOBAL
    batch (every rank passes the same; each takes its share); schedule: a table for pp > 1; fp8:
    the step's GEMMs in FP8 (each weight quantized once here, reused by every microbatch; with
    fp8_dense=False only the expert GEMMs; fp8_dense_wgrad=False / fp8_expert_wgrad=False the dense /
    expert weight gradients in the compute dtype, see ``fp8_training``); timeout_s: how long a pipeline
    rank waits for a peer before it gives up (``fmoe.dist.wait``); gather: "chunk" (per layer /
    pipeline chunk, wherever a parameter is sharded and fp8 is off) or "step" (all at once), see
    the module docstring; both give bitwise the same results; plan: the "chunk" policy's plan,
    ``step_gather_plan(model, mesh, num_microbatches, schedule)`` (made here when None: a pass over
    every use of every parameter, which a trainer makes once); memory: recomputation, offloading and
    the expert W merge window (``fmoe.memory_policy``; None: the defaults). The gradient shards are fp32 where
    they were summed over ranks, else in the compute dtype.
    """
    scale = 1.0 / (mesh.dp * mesh.cp * mesh.ep)
    run = functools.partial(_run, model, batch=local_batch(batch, mesh), num_microbatches=num_microbatches,
                            mesh=mesh, schedule=schedule, seed=seed, timeout_s=timeout_s, memory=memory)  # fmt: skip
    if per_unit(gather, fp8, any(info.size > 1 for info in infos.values())):
        plan = plan if plan is not None else step_gather_plan(model, mesh, num_microbatches, schedule)
        gathers = UnitGathers(shards, infos, mesh, dtype, model.buffers, plan, scale)
        result = run(
            gathers.params, hooks=runner.StepHooks(gathers.before, gathers.after, plan.take_at, gathers.taken)
        )
        grad_shards = gathers.finish(result.grads)
    else:
        params = gather_params(shards, infos, mesh, dtype, uncast=uncast_params(model, infos, fp8))
        policy = memory or MemoryPolicy()  # its FP8 input caching (``memory.fp8_cache``)
        with fp8_training(
            fp8, dense=fp8_dense, dense_wgrad=fp8_dense_wgrad, expert_wgrad=fp8_expert_wgrad,
            cache_inputs=policy.fp8_cache,
            cache_expert_inputs=policy.fp8_cache_experts(mesh.pp, num_microbatches),
        ):  # fmt: skip
            result = run(params, hooks=None)
        del params
        # Sums over ranks and the 1/ranks scale run in fp32. A gradient that nothing reduces or
        # scales (one rank) goes to the optimizer in the compute dtype: its AdamW kernel reads it as
        # it is, so the step writes no fp32 copy of every gradient. The step owns these tensors.
        grads = {n: scaled_grad(g, n, infos[n], dtype, scale, model.buffers) for n, g in result.grads.items()}
        grad_shards = reduce_scatter_grads(grads, infos, mesh)
    loss = result.loss.detach().clone().float()
    data = mesh.group("dp_cp_ep")
    if data is not None:
        dist.all_reduce(loss, group=data)
    device = next(iter(shards.values())).device
    return ShardedStep(loss * scale, grad_shards, world_statistics(model, result.statistics, device))
