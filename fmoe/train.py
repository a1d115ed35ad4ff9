"""The training loop: a recipe in, a trained checkpoint out.

    recipe -> model stages + seeded fp32 master params -> data loader -> optimizer
    each step: cast params to the compute dtype, run the step (sequential runner, or the pipeline
    interpreter / expert-parallel step when the recipe's sizes ask for them), one optimizer step
    on the fp32 masters, log, checkpoint.

Resuming is automatic: the latest checkpoint under ``checkpoint.dir`` restores params, optimizer
state, step, data cursor and RNG, so N steps + resume + N steps equals 2N straight, bitwise.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from fmoe import checkpoint, data, optim, parallel, pipeline, schedules
from fmoe import dist as D
from fmoe.hf import family as family_module
from fmoe.mesh import MeshError, build_mesh, check_sizes
from fmoe.recipe import Recipe, RecipeError

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0}


@dataclass
class TrainResult:
    """losses: each step's loss (this run's steps only); params: final fp32 masters; step: steps done."""

    losses: list[float] = field(default_factory=list)
    params: dict[str, Tensor] = field(default_factory=dict)
    step: int = 0
    tokens_per_second: float = 0.0
    wall_seconds: float = 0.0
    checkpoint: str | None = None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RecipeError("train.device is 'cuda' but no CUDA device is available")
    return torch.device(name)


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
        optim.clip_by_global_norm(o.clip, sq_norm_reduce=parallel.world_sq_norm),
        optim.adamw(lr, o.b1, o.b2, o.eps, o.weight_decay, mask={n: len(s) >= 2 for n, s in shapes.items()}),
    )
    return tx, lr


def ensure_dataset(recipe: Recipe) -> Path:
    """The recipe's dataset folder, built first from ``data.build_from`` if it is missing."""
    path = Path(recipe.data.path)
    if (path / "index.json").is_file():
        return path
    source = recipe.data.build_from
    if not source:
        raise RecipeError(
            f"{recipe.path}: data.path {str(path)!r} holds no dataset and data.build_from is empty"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    if source == "builtin":
        text = path.with_name(path.name + "-corpus.txt")
        if not text.is_file():
            data.builtin_corpus(text, recipe.data.builtin_bytes)
        source = str(text)
    elif not Path(source).is_file():
        raise RecipeError(f"{recipe.path}: data.build_from file {source!r} not found")
    data.build([source], path, tokenizer=recipe.data.tokenizer, workers=min(2, os.cpu_count() or 1))
    return path


class MetricsLog:
    """Metrics as JSON lines, and to TensorBoard when it is installed."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.file = open(folder / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(folder / "tensorboard"))
        except Exception:  # tensorboard not installed
            self.tb = None

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, int | float):
                    self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def _setup_mesh(recipe: Recipe):
    """Process group (torchrun's environment) and mesh; sizes checked before anything is built."""
    p, t = recipe.parallel, recipe.train
    if p.cp > 1 and not getattr(family_module(recipe.model_family), "SUPPORTS_CONTEXT_PARALLEL", False):
        raise RecipeError(
            f"{recipe.path}: parallel.cp = {p.cp}, but model family {recipe.model_family!r} has no "
            f"context-parallel attention yet: set parallel.cp = 1"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dist.is_initialized():
        world = dist.get_world_size()
    try:
        check_sizes(p.pp, p.dp, p.cp, p.ep, world, microbatches=t.microbatches, schedule=p.schedule,
                    num_experts=getattr(recipe.model, "num_experts", None), seq_len=recipe.data.seq_len,
                    global_batch=t.global_batch)  # fmt: skip
    except MeshError as e:
        raise RecipeError(f"{recipe.path}: {e}") from None
    if world > 1 and not dist.is_initialized():
        D.init_from_env()
    return build_mesh(p.pp, p.dp, p.cp, p.ep)


def _schedule(recipe: Recipe, mesh):
    """The pipeline table for pp > 1: a generator name or a CSV file."""
    if mesh.pp == 1:
        return None
    p = recipe.parallel
    try:
        if p.schedule.endswith(".csv"):
            table = schedules.read_csv(p.schedule)
        else:
            options = {"chunks": p.chunks} if p.schedule == "interleaved-1f1b" else {}
            table = schedules.generate(p.schedule, mesh.pp, recipe.train.microbatches, **options)
        schedules.validate(table)
    except (ValueError, FileNotFoundError) as e:
        raise RecipeError(f"{recipe.path}: parallel.schedule {p.schedule!r}: {e}") from None
    if table.pp != mesh.pp or table.microbatches != recipe.train.microbatches:
        raise RecipeError(
            f"{recipe.path}: parallel.schedule {p.schedule!r} is for pp={table.pp}, microbatches="
            f"{table.microbatches}; the recipe has parallel.pp={mesh.pp}, train.microbatches={recipe.train.microbatches}"
        )
    return table


def _opt_canonical(state, infos, mesh, names) -> dict[str, Tensor] | None:
    """The optimizer state keyed by global names, layout-free (rank 0; None elsewhere)."""
    flat: dict[str, Tensor] = {}
    for prefix in ("exp_avg/", "exp_avg_sq/"):
        full = parallel.canonical({n: state[prefix + n] for n in infos}, infos, mesh, names)
        if full is not None:
            flat.update({prefix + n: t for n, t in full.items()})
    if mesh.rank != 0:
        return None
    flat.update({k: v.detach().cpu() for k, v in state.items() if "/" not in k})
    return flat


def _opt_shard(flat, infos, mesh, device) -> dict[str, Tensor]:
    state = {k: v.to(device) for k, v in flat.items() if "/" not in k}
    for prefix in ("exp_avg/", "exp_avg_sq/"):
        full = {n: flat[prefix + n] for n in infos}
        state.update(
            {prefix + n: t.to(device) for n, t in parallel.shard_canonical(full, infos, mesh).items()}
        )
    return state


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
    """
    t0 = time.perf_counter()
    fam = family_module(recipe.model_family)
    cfg = recipe.model
    mesh = _setup_mesh(recipe)
    lead = mesh.rank == 0
    device = pick_device(recipe.train.device)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[recipe.train.dtype]
    torch.manual_seed(recipe.train.seed)

    if lead:
        ensure_dataset(recipe)
    if mesh.world > 1:
        dist.barrier()
    dataset = data.TokenDataset(ensure_dataset(recipe))
    seq, global_batch = recipe.data.seq_len, recipe.train.global_batch
    try:
        data.check_vocab(dataset, cfg.vocab_size)
        data.check_size(dataset, steps=recipe.train.steps, global_batch=global_batch, seq=seq)
    except ValueError as e:
        raise RecipeError(f"{recipe.path}: {e}") from None

    model = fam.build(cfg)
    table = _schedule(recipe, mesh)
    shapes = fam.param_shapes(cfg)
    names = list(shapes)
    local = pipeline.local_param_names(model, table, rank=mesh.coords["pp"]) if table is not None else names
    infos = parallel.layout(model, mesh, shapes, local)
    tx, lr_schedule = make_optimizer(recipe, shapes)
    step, cursor = 0, 0
    ckpt_dir = Path(recipe.checkpoint.dir)
    latest = checkpoint.latest(ckpt_dir) if recipe.checkpoint.resume else None
    if latest is None:
        full = model.init(seed=recipe.train.seed, dtype=torch.float32)
        shards = {n: t.to(device) for n, t in parallel.shard_canonical(full, infos, mesh).items()}
        state = tx.init(shards)
    else:
        full, opt_flat, trainer_state = checkpoint.load(latest, expected_keys=names)
        shards = {n: t.to(device) for n, t in parallel.shard_canonical(full, infos, mesh).items()}
        if not opt_flat:  # weights only (``fmoe checkpoint import-hf``): a fresh optimizer
            state = tx.init(shards)
        else:
            try:
                state = optim.state_from_flat(tx, _opt_shard(opt_flat, infos, mesh, device), shards)
            except (KeyError, ValueError) as e:
                raise ValueError(f"{latest}: optimizer state does not fit the model ({e})") from None
        step = int(trainer_state["step"])
        cursor = int(trainer_state.get("data_cursor", 0))
        if "rng" in trainer_state:
            checkpoint.restore_rng(trainer_state["rng"])
    del full

    result = TrainResult(step=step)
    log = MetricsLog(Path(recipe.log.dir)) if lead else None
    tokens_per_step = global_batch * seq
    stream = data.batches(
        dataset,
        seq=seq,
        global_batch=global_batch,
        micro_batch=global_batch // recipe.train.microbatches,
        seed=recipe.data.shuffle_seed,
        cursor=cursor,
    )
    flops_per_step = tokens_per_step * fam.train_flops_per_token(cfg, seq)  # the family's own count
    peak = next(
        (
            v
            for k, v in PEAK_BF16_TFLOPS.items()
            if device.type == "cuda" and k in torch.cuda.get_device_name()
        ),
        None,
    )
    if peak:
        peak *= mesh.world
    last_steps = recipe.train.steps if stop_after is None else min(recipe.train.steps, step + stop_after)
    progress = _progress(recipe if lead else None, step, last_steps)
    pending: list[tuple[int, Tensor]] = []
    window_t, window_steps = time.perf_counter(), 0

    def save(at: int) -> str | None:
        params_full = parallel.canonical(shards, infos, mesh, names)
        opt_full = _opt_canonical(state, infos, mesh, names)
        path, error = None, None
        if lead:
            trainer_state = {"step": at, "data_cursor": cursor, "rng": checkpoint.capture_rng()}
            try:
                path = str(
                    checkpoint.save(
                        ckpt_dir, at, params_full, opt_full, trainer_state, keep=recipe.checkpoint.keep
                    )
                )
            except Exception as e:  # every rank stops with the writer's message
                error = e
        if mesh.world > 1:
            box = [None if error is None else f"{type(error).__name__}: {error}"]
            dist.broadcast_object_list(box, src=0)
            if error is None and box[0] is not None:
                raise checkpoint.CheckpointWriteError(f"rank 0 failed to write the checkpoint: {box[0]}")
        if error is not None:
            raise error
        return path

    try:
        while step < last_steps:
            tokens, labels, cursor = next(stream)
            batch = {"tokens": tokens.flatten(0, 1).to(device), "labels": labels.flatten(0, 1).to(device)}
            loss, grads, statistics = parallel.parallel_step(
                model, shards, infos, batch, recipe.train.microbatches, mesh, schedule=table,
                dtype=None if dtype == torch.float32 else dtype, seed=recipe.train.seed + step,
                fp8=recipe.train.fp8, fp8_dense=recipe.train.fp8_dense,
            )  # fmt: skip
            shards, state = optim.step(tx, grads, state, shards)
            if model.buffer_updates is not None:  # e.g. the aux-loss-free router bias, from the loads
                shards = parallel.add_to_shards(shards, model.buffer_updates(statistics), infos, mesh)
            step += 1
            window_steps += 1
            pending.append((step, loss))
            if step % recipe.log.every == 0 or step == last_steps:
                losses = torch.stack([v for _, v in pending]).tolist()  # one host sync per log interval
                for (s, _), value in zip(pending, losses):
                    result.losses.append(value)
                    if on_step is not None:
                        on_step(s, value)
                    if not math.isfinite(value):
                        raise FloatingPointError(
                            f"step {s}: loss is {value}; stopping before it reaches a checkpoint"
                        )
                pending.clear()
                elapsed = time.perf_counter() - window_t
                tps = window_steps * tokens_per_step / max(elapsed, 1e-9)
                record = {
                    "step": step,
                    "loss": losses[-1],
                    "lr": lr_schedule(step - 1),
                    "grad_norm": float(state["grad_norm"]) if "grad_norm" in state else None,
                    "tokens_per_s": tps,
                }
                if peak:
                    record["mfu"] = flops_per_step * window_steps / max(elapsed, 1e-9) / (peak * 1e12)
                if log is not None:
                    log.write(record)
                progress.update(step, losses[-1], tps, record.get("mfu"))
                result.tokens_per_second = tps
                window_t, window_steps = time.perf_counter(), 0
            if step % recipe.checkpoint.every == 0 or step == last_steps:
                result.checkpoint = save(step)
    finally:
        progress.close()
        if log is not None:
            log.close()
    result.params = parallel.canonical(shards, infos, mesh, names) or {}
    result.step = step
    result.wall_seconds = time.perf_counter() - t0
    return result


class _progress:
    """A tqdm bar with step, loss, tokens/s and ETA (MFU on GPU); silent when log.progress is off."""

    def __init__(self, recipe: Recipe | None, start: int, total: int):
        self.bar = None
        if recipe is not None and recipe.log.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)
        self.last = start

    def update(self, step: int, loss: float, tps: float, mfu: float | None) -> None:
        if self.bar is None:
            return
        post = {"loss": f"{loss:.4f}", "tok/s": f"{tps:,.0f}"}
        if mfu is not None:
            post["mfu"] = f"{100 * mfu:.1f}%"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(step - self.last)
        self.last = step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
