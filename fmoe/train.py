"""The training loop: a recipe in, a trained checkpoint out.

    recipe -> model stages + seeded fp32 master params -> data loader -> optimizer
    each step: cast params to the compute dtype, run the step (sequential runner, or the pipeline
    interpreter / expert-parallel step when the recipe's sizes ask for them), one optimizer step
    on the fp32 masters, log, checkpoint.

The loop (``_Loop.run``) reads top to bottom as numbered steps, each one call with one concern:
setup (``fmoe.train_setup``: family check, mesh, resume point, data, model, memory plan), the
starting state (``fmoe.train_state``), then per step: batch (``fmoe.train_data``), step and update,
agreement on a stop, the deferred host sync of losses and skip flags, the non-finite streak, the
log line (``fmoe.metrics_log``, throughput from ``fmoe.train_clock``), the checkpoint
(``train_state.Checkpointer``) and the stop.

Resuming is automatic: the newest intact checkpoint under ``checkpoint.dir`` restores params,
optimizer state, step, data cursor and RNG, so N steps + resume + N steps equals 2N straight,
bitwise, also after a SIGKILL at any point (checkpoint writes are atomic; what a killed writer left
is tidied at start). Before any step: checkpoint.dir and log.dir must be writable, rank 0 takes
checkpoint.dir's lock (``checkpoint.lock_folder``: a second run on it is refused) before it tidies
anything, a corrupt newest checkpoint (checksums, a missing manifest, a file that does not parse)
falls back to the newest intact one with a warning, and a checkpoint whose tensor shapes differ from
the recipe's model is refused with one line naming the tensor.

Stopping and saving: SIGTERM, SIGINT and ``checkpoint.signal`` stop the run after the step in flight
with a checkpoint (``fmoe.preemption``; the ranks agree on the step); saves are asynchronous by
default (``checkpoint.begin_save``: staged to host memory, written on a thread, installed once every
rank's write is done; the next save and the run's end wait for it). The process group a run made is
destroyed however it ends. Throughput (tokens/s, MFU) leaves out the first step and the saves.

Non-finite steps: a step whose loss or global gradient norm is NaN or infinite is skipped (no
parameter or optimizer state changes, decided on the device) and counted (``skipped_steps`` in the
metrics); ``train.max_nonfinite_steps`` skipped steps in a row stop the run with one line
(:class:`NonFiniteError`). So no checkpoint ever holds a non-finite tensor (``checkpoint.save``
refuses one too), and a transient bad batch does not end a run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from fmoe import collectives, cuda_graphs, optim, parallel, sharding
from fmoe.metrics_log import MetricsLog, Progress, warn
from fmoe.preemption import StopSignals
from fmoe.recipe import Recipe
from fmoe.train_clock import Clock, throughput
from fmoe.train_data import batch_stream, to_device
from fmoe.train_setup import Run, pick_device, setup
from fmoe.train_state import Checkpointer, initial_state

__all__ = ["NonFiniteError", "TrainResult", "cpu_threads", "make_optimizer", "train"]


class NonFiniteError(ValueError):
    """Too many steps in a row had a non-finite loss or gradient norm (a ValueError: the CLI reports
    it as one line); no update of those steps was applied and no checkpoint holds their values."""


@dataclass
class TrainResult:
    """losses: each step's loss (this run's steps only); params: final fp32 masters; step: steps done;
    skipped_steps: steps whose update was skipped for a non-finite loss or gradient norm (the whole
    run's, resumed runs included)."""

    losses: list[float] = field(default_factory=list)
    params: dict[str, Tensor] = field(default_factory=dict)
    step: int = 0
    # steady state: this run's tokens over its time, without its first step and the time saving held it up
    tokens_per_second: float = 0.0
    wall_seconds: float = 0.0
    checkpoint: str | None = None
    skipped_steps: int = 0
    stopped_by: str | None = None  # the signal that stopped the run early (a checkpoint was saved)
    mfu: float | None = None  # model FLOPs utilisation of tokens_per_second (on a known GPU)
    save_seconds: float = 0.0  # how long saving checkpoints held the training loop up


def cpu_threads(recipe: Recipe, device: torch.device) -> int:
    """The torch CPU thread count a run uses: ``train.threads``, or for 0 (automatic) 1 on a CPU
    run and torch's own default on CUDA (where the CPU only launches kernels).

    Why 1 on CPU: the CPU recipes' GEMMs are tiny, so a second thread buys little, while OpenMP
    threads that spin waiting for each other on a machine whose cores are busy with other work
    make every step several times slower (the embedded default on a busy 2-core machine: 10 steps
    took 21 s with 1 thread and 202 s with 2; benchmarks/default_run.py measures it).
    """
    if recipe.train.threads > 0:
        return recipe.train.threads
    return 1 if device.type == "cpu" else torch.get_num_threads()


def make_optimizer(recipe: Recipe, shapes: dict) -> tuple[optim.GradientTransformation, Callable]:
    """clip by global norm (over every rank's shards), then AdamW on the recipe's schedule, decaying
    matrices only (by their canonical shapes); also returns the schedule (step -> lr)."""
    o, steps = recipe.optim, recipe.train.steps
    if o.schedule == "cosine":
        lr = optim.warmup_cosine(o.lr, o.warmup, steps, final=o.min_lr)
    else:
        decay = max(1, int(steps * o.decay_fraction))
        lr = optim.warmup_stable_decay(o.lr, o.warmup, steps, decay, final=o.min_lr)
    tx = optim.chain(
        optim.clip_by_global_norm(o.clip, sq_norm_reduce=collectives.world_sq_norm),
        optim.adamw(lr, o.b1, o.b2, o.eps, o.weight_decay, mask={n: len(s) >= 2 for n, s in shapes.items()}),
        skip_nonfinite=True,  # a NaN / infinite gradient norm skips the step (train() counts it)
    )
    return tx, lr


def train(
    recipe: Recipe,
    stop_after: int | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Train ``recipe`` (resuming from its latest checkpoint), returning this run's losses.

    On several processes (torchrun, or a process group already set up) every rank calls it; the
    mesh comes from ``[parallel]``. Parameters and optimizer state are held as ZeRO-3 shards;
    checkpoints are canonical (layout-free), so a run may resume on another mesh.
    stop_after: stop (with a checkpoint) after this many steps of this run - kill-and-resume tests.
    Runs with ``cpu_threads(recipe, device)`` torch CPU threads (process-wide; restored on return).
    """
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cpu_threads(recipe, pick_device(recipe.train.device)))
    owns_group = not dist.is_initialized()  # the group a torchrun run makes here is ended here
    ended = False
    try:
        with contextlib.ExitStack() as stack:  # the checkpoint folder's lock, the signal handlers
            result = _train(recipe, stop_after, on_step, stack)
        ended = True
        return result
    finally:
        torch.set_num_threads(threads_before)
        if owns_group and dist.is_initialized():
            _end_group(ended)


def _end_group(ended: bool) -> None:
    """Destroy the process group this run made (a live group at interpreter exit aborts the process:
    "terminate called without an active exception"). After a failure the ranks may no longer talk
    (a peer gone, a transfer stuck on a thread): then only this rank's side is torn down, no barrier."""
    try:
        if ended:
            dist.barrier()  # no rank closes its sockets while a peer still reads from them
        dist.destroy_process_group()
    except Exception as e:  # the group is already broken: the process exits anyway
        warn(f"the process group did not end cleanly ({type(e).__name__}: {e})")


def _train(
    recipe: Recipe,
    stop_after: int | None,
    on_step: Callable[[int, float], None] | None,
    stack: contextlib.ExitStack,
) -> TrainResult:
    """train's body, run under the recipe's CPU thread count; ``stack`` holds what is released when
    it returns or raises (the checkpoint folder's lock, the stop-signal handlers)."""
    t0 = time.perf_counter()
    # 1. setup: the family checked, the mesh, the agreed resume point, the data, model and layout
    run = setup(recipe, stack)
    tx, lr_schedule = make_optimizer(recipe, run.shapes)
    # 2. this rank's starting state: fresh from the recipe's seed, or read from the resume point
    shards, state, counters = initial_state(
        recipe, run.model, tx, run.shapes, run.infos, run.mesh, run.device, run.resume_from
    )
    step = counters["step"]
    last_steps = recipe.train.steps if stop_after is None else min(recipe.train.steps, step + stop_after)
    result = TrainResult(step=step, skipped_steps=counters["skipped_steps"])
    # 3.-10. the steps (_Loop.run)
    loop = _Loop(recipe, run, tx, lr_schedule, counters, last_steps, stack)
    shards, state, step = loop.run(shards, state, step, result, on_step)
    # 11. the result: steady-state throughput, the final fp32 masters (canonical, from every rank)
    steps_done, seconds = loop.clock.steady()
    result.tokens_per_second = loop.rate.tokens_per_s(steps_done, seconds)
    result.mfu = loop.rate.mfu(steps_done, seconds)
    result.save_seconds = loop.clock.saved_total
    result.checkpoint = loop.saver.path
    result.params = sharding.canonical(shards, run.infos, run.mesh, list(run.shapes)) or {}
    result.step = step
    result.wall_seconds = time.perf_counter() - t0
    return result


class _Loop:
    """The step loop and its parts, each with one concern, made in this order before the first
    step: the metrics log (rank 0), the data stream from the run's cursor, the throughput, the
    progress bar, the clock, the deferred loss sync, the non-finite streak, the step (eager or
    CUDA-graphed), the stop-signal handlers (held by ``stack``) and the checkpointer."""

    def __init__(self, recipe: Recipe, run: Run, tx, lr_schedule, counters: dict[str, int], last_steps: int,
                 stack: contextlib.ExitStack):  # fmt: skip
        lead, c = run.mesh.rank == 0, recipe.checkpoint
        self.recipe, self.device, self.last_steps = recipe, run.device, last_steps
        self.lr_schedule = lr_schedule
        self.log = MetricsLog(Path(recipe.log.dir), counters["step"]) if lead else None
        self.stream = batch_stream(recipe, run.dataset, counters["data_cursor"])
        self.rate = throughput(recipe, run.family, run.device, run.mesh.world)
        self.progress = Progress(lead and recipe.log.progress, counters["step"], last_steps)
        self.clock = Clock(run.device)  # this run's time, apart from saving and its first (warm-up) step
        self.losses = _LossSync()
        self.streak = _NonFiniteStreak(
            counters["nonfinite_streak"], counters["skipped_steps"], recipe.train.max_nonfinite_steps
        )
        self.train_step = _step_function(recipe, run, tx)
        self.stops = stack.enter_context(
            StopSignals(["SIGTERM", "SIGINT", *([c.signal] if c.signal else [])])
        )
        self.saver = Checkpointer(recipe, run.mesh, run.device, run.infos, run.shapes, self.stops, self.clock)

    def run(
        self, shards, state, step: int, result: TrainResult, on_step: Callable[[int, float], None] | None
    ) -> tuple[dict, dict, int]:
        """Steps from ``step`` to ``last_steps`` or a stop: this run's losses, skipped-step count
        and stop go to ``result`` (its checkpoint is ``saver.path``). -> (shards, state, step)."""
        log_every, save_every = self.recipe.log.every, self.recipe.checkpoint.every
        try:
            while step < self.last_steps:
                # 3. batch: the next global batch of the stream, on the device
                tokens, labels, cursor = next(self.stream)
                batch = to_device(tokens, labels, self.device)
                # 4. step: forward, backward, update; its loss and skip flag stay on the device
                shards, state, loss, skipped = self.train_step(shards, state, batch, step)
                step += 1
                self.clock.stepped()
                self.losses.add(step, loss, skipped)
                # 5. the ranks agree on a stop request; a save every rank has written is installed
                stop = self.saver.agree(
                    step % log_every == 0 or step % save_every == 0 or step == self.last_steps
                )
                last = step == self.last_steps or stop
                log_now, save_now = step % log_every == 0 or last, step % save_every == 0 or last
                if log_now or save_now:
                    # 6. one host sync per log line or checkpoint: the steps' losses and skip flags
                    for s, value, skipped_s in self.losses.read():
                        result.losses.append(value)
                        if on_step is not None:
                            on_step(s, value)
                        self.streak.count(s, value, skipped_s)  # 7. too many in a row end the run
                    result.skipped_steps = self.streak.skipped_total
                if log_now:  # 8. the log line: metrics.jsonl (rank 0) and the progress bar
                    self.log_line(step, result.losses[-1], state)
                if save_now:  # 9. the checkpoint: asynchronous, but for the run's last
                    counters = {"data_cursor": cursor, "skipped_steps": self.streak.skipped_total,
                                "nonfinite_streak": self.streak.in_a_row}  # fmt: skip
                    self.saver.save(step, shards, state, counters, last)
                if stop:  # 10. stop: a signal reached this rank or another one
                    result.stopped_by = self.stops.requested or "a stop signal to another rank"
                    break
        except BaseException:
            self.saver.abort()  # an error or a second signal: the unfinished save is dropped
            raise
        finally:
            self.progress.close()
            if self.log is not None:
                self.log.close()
        return shards, state, step

    def log_line(self, step: int, loss: float, state) -> None:
        """The record of ``step`` (the window's steady throughput, ``Clock.window``) to the metrics
        log and the progress bar."""
        steps_done, seconds, saving = self.clock.window()
        tps = self.rate.tokens_per_s(steps_done, seconds)
        record = {
            "step": step,
            "loss": loss,
            "lr": self.lr_schedule(max(int(state["step"]) - 1, 0)),  # the last applied step's
            "grad_norm": None if self.streak.last_skipped else float(state["grad_norm"]),
            "skipped_steps": self.streak.skipped_total,
            "tokens_per_s": tps,  # steady state: saving and the run's first step left out
            "save_s": saving,  # what saving checkpoints held the loop up since the last line
        }
        mfu = self.rate.mfu(steps_done, seconds)
        if mfu is not None:
            record["mfu"] = mfu
        if self.log is not None:
            self.log.write(record)
        self.progress.update(step, loss, tps, mfu)


class _LossSync:
    """Each step's loss and skip flag stay device tensors (no host sync per step) until the loop
    syncs with the host anyway, at a log line or a checkpoint; then all are read in one transfer."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, Tensor, Tensor]] = []  # (step, loss, skipped) as device tensors

    def add(self, step: int, loss: Tensor, skipped: Tensor) -> None:
        """loss: [] float (the compute dtype or fp32); skipped: [] bool."""
        self.pending.append((step, loss, skipped))

    def read(self) -> list[tuple[int, float, bool]]:
        """[(step, loss, skipped)] of the pending steps, in step order; none is pending after."""
        pending = self.pending
        values = torch.stack([v.float() for _, v, _ in pending] + [k.float() for *_, k in pending]).tolist()
        losses, flags = values[: len(pending)], values[len(pending) :]
        self.pending = []
        return [(s, value, flag > 0) for (s, _, _), value, flag in zip(pending, losses, flags)]


class _NonFiniteStreak:
    """Skipped steps (a non-finite loss or gradient norm: no update applied) counted in a row and
    in all (the whole run's, resumed runs included); ``limit`` in a row raise NonFiniteError."""

    def __init__(self, in_a_row: int, skipped_total: int, limit: int):
        self.in_a_row, self.skipped_total, self.limit = in_a_row, skipped_total, limit
        self.last_skipped = False  # the last counted step's

    def count(self, step: int, loss: float, skipped: bool) -> None:
        self.last_skipped = skipped
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        self.skipped_total += int(skipped)
        if self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"step {step}: {self.in_a_row} steps in a row had a non-finite loss or gradient norm "
                f"(loss {loss}); their updates were skipped and none reached a checkpoint "
                f"(train.max_nonfinite_steps = {self.limit}): lower optim.lr or check the data"
            )


def _step_function(recipe: Recipe, run: Run, tx: optim.GradientTransformation) -> Callable:
    """``(shards, state, batch, step) -> (shards, state, loss, skipped)``, loss and skipped device
    tensors: ``parallel.parallel_step`` and the update (``_update``), run eagerly with the seed
    ``train.seed + step``, or replayed as one CUDA graph (``_graphed_step``)."""

    def train_step(shards, state, batch, seed: int):
        """One step and its update: (shards, state, loss, skipped), the last two device tensors."""
        loss, grads, statistics = parallel.parallel_step(
            run.model, shards, run.infos, batch, recipe.train.microbatches, run.mesh, schedule=run.table,
            dtype=None if run.dtype == torch.float32 else run.dtype, seed=seed,
            fp8=recipe.train.fp8, fp8_dense=recipe.train.fp8_dense, fp8_dense_wgrad=recipe.train.fp8_dense_wgrad,
            fp8_expert_wgrad=recipe.train.fp8_expert_wgrad,
            timeout_s=recipe.parallel.timeout_s,
            gather=recipe.parallel.gather, plan=run.gathers, memory=run.memory,
        )  # fmt: skip
        shards, state, skipped = _update(
            tx, run.model, loss, grads, statistics, state, shards, run.infos, run.mesh
        )
        return shards, state, loss, skipped

    graphed = _graphed_step(recipe, run.mesh, run.device, train_step)
    if graphed is None:
        return lambda shards, state, batch, step: train_step(shards, state, batch, recipe.train.seed + step)

    def replay(shards, state, batch, step: int):
        shards, state, loss, skipped = graphed(shards, state, batch)
        return shards, state, loss.clone(), skipped.clone()  # the next replay overwrites both

    return replay


def _update(tx, model, loss: Tensor, grads, statistics, state, shards, infos, mesh):
    """The optimizer step and the model's buffer updates -> (shards, state, skipped: bool tensor).

    A non-finite loss or gradient norm skips both on the device (no host sync); the state then
    keeps the last finite gradient norm, so a checkpoint never holds a non-finite tensor."""
    bad_loss = (~torch.isfinite(loss)).float()
    norm_before = state["grad_norm"]
    shards, state = optim.step(tx, grads, state, shards, found_inf=bad_loss)
    skipped = (bad_loss > 0) | ~torch.isfinite(state["grad_norm"])
    state = {**state, "grad_norm": torch.where(skipped, norm_before, state["grad_norm"])}
    if model.buffer_updates is not None:  # e.g. the aux-loss-free router bias, from the loads
        # a skipped step moves no buffer either (its loads came from non-finite activations)
        updates = {n: torch.where(skipped, 0, u) for n, u in model.buffer_updates(statistics).items()}
        shards = sharding.add_to_shards(shards, updates, infos, mesh)
    return shards, state, skipped


def _graphed_step(recipe: Recipe, mesh, device: torch.device, train_step: Callable):
    """``train.cuda_graphs``: the step and its update as one ``fmoe.cuda_graphs.GraphedStep`` of
    (shards, state, batch), or None (eager) where a step holds collectives (more than one process:
    pipeline sends, ZeRO gathers, expert all-to-alls with host-synced split sizes), said in one line.
    Replays run every step with the recipe's seed in its ``StageContext`` (fmoe's stages read none;
    a stage's randomness must come from torch's CUDA generator, which replays advance)."""
    if not recipe.train.cuda_graphs:
        return None
    if mesh.world > 1:
        if mesh.rank == 0:
            warn(
                f"train.cuda_graphs: a step over {mesh.world} processes holds collectives "
                f"(pp={mesh.pp}, dp={mesh.dp}, cp={mesh.cp}, ep={mesh.ep}); it runs eagerly"
            )
        return None
    return cuda_graphs.GraphedStep(
        lambda shards, state, batch: train_step(shards, state, batch, recipe.train.seed)
    )
