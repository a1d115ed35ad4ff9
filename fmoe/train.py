"""The training loop: a recipe in, a trained checkpoint out.

    recipe -> model stages + seeded fp32 master params -> data loader -> optimizer
    each step: cast params to the compute dtype, run the step (sequential runner, or the pipeline
    interpreter / expert-parallel step when the recipe's sizes ask for them), one optimizer step
    on the fp32 masters, log, checkpoint.

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
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from fmoe import checkpoint, cuda_graphs, data, optim, parallel, pipeline
from fmoe import dist as D
from fmoe import plan as memory_plan
from fmoe.check import check_family
from fmoe.expert_parallel import expert_range, is_expert_param
from fmoe.hf import family as family_module
from fmoe.mesh import MeshError, build_mesh, check_sizes
from fmoe.preemption import StopSignals
from fmoe.recipe import Recipe, RecipeError
from fmoe.schedules.generators import generate
from fmoe.schedules.table import read_csv
from fmoe.schedules.verify import validate

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0}


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


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RecipeError("train.device is 'cuda' but no CUDA device is available")
    return torch.device(name)


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
        optim.clip_by_global_norm(o.clip, sq_norm_reduce=parallel.world_sq_norm),
        optim.adamw(lr, o.b1, o.b2, o.eps, o.weight_decay, mask={n: len(s) >= 2 for n, s in shapes.items()}),
        skip_nonfinite=True,  # a NaN / infinite gradient norm skips the step (train() counts it)
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
    try:
        data.build([source], path, tokenizer=recipe.data.tokenizer, workers=min(2, os.cpu_count() or 1))
    except ValueError as e:  # the file's contents (data's errors name it)
        raise RecipeError(f"{recipe.path}: data.build_from: {e}") from None
    return path


def check_dataset_tokenizer(recipe: Recipe) -> None:
    """An existing dataset must have been built with the recipe's ``data.tokenizer`` (its index.json
    records the tokenizer: kind, and the tokenizer.json's sha256); RecipeError naming both if not."""
    wanted = recipe.data.tokenizer
    if wanted != "bytes" and not Path(wanted).is_file():
        raise RecipeError(
            f"{recipe.path}: data.tokenizer {wanted!r}: file not found (give a tokenizer.json or 'bytes')"
        )
    path = Path(recipe.data.path)
    if not (path / "index.json").is_file():
        return  # built from data.build_from with data.tokenizer, so they agree
    try:
        recorded = data.TokenDataset(path).tokenizer
    except ValueError as e:
        raise RecipeError(f"{recipe.path}: data.path: {e}") from None
    built_with = recorded.get("path") or recorded.get("kind")
    if wanted == "bytes":
        same = recorded.get("kind") == "bytes"
    else:
        file = Path(wanted)
        same = (
            recorded.get("kind") == "hf"
            and recorded.get("sha256") == hashlib.sha256(file.read_bytes()).hexdigest()
        )
    if not same:
        raise RecipeError(
            f"{recipe.path}: data.tokenizer {wanted!r} is not the tokenizer dataset {str(path)!r} was built with "
            f"({built_with}): set data.tokenizer to it, or point data.path at a dataset built with {wanted!r}"
        )


class MetricsLog:
    """Metrics as JSON lines (strict JSON: a non-finite number is written as null), and to
    TensorBoard when it is installed. A partial last line (a run killed mid-write) is cut off when
    the file is opened again, so every line parses."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        _cut_partial_last_line(folder / "metrics.jsonl")
        self.file = open(folder / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(folder / "tensorboard"))
        except Exception:  # tensorboard not installed
            self.tb = None

    def write(self, record: dict) -> None:
        safe = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self.file.write(json.dumps(safe, allow_nan=False) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, int | float):
                    self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def _cut_partial_last_line(path: Path) -> None:
    """Truncate ``path`` after its last newline when it does not end with one."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        pos = end
        while pos > 0:  # scan back block by block for the last newline
            start = max(0, pos - (64 << 10))
            f.seek(start)
            cut = f.read(pos - start).rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                return
            pos = start
        f.truncate(0)


def _warn(message: str) -> None:
    print(f"fmoe: warning: {message}", file=sys.stderr, flush=True)


def _check_writable(folder: str, field_name: str, where: str) -> None:
    """Create ``folder`` and a probe file in it, so a read-only folder is an error before any compute
    rather than at the first save (os.access does not tell for root or every filesystem)."""
    path = Path(folder)
    probe = path / f".tmp-write-probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"fmoe")
        probe.unlink()
    except OSError as e:
        raise RecipeError(
            f"{where}: {field_name} {str(folder)!r} is not writable ({type(e).__name__}: {e.strerror or e})"
        ) from None


def _resume_candidates(recipe: Recipe, stack: contextlib.ExitStack) -> list[Path]:
    """Rank 0, before any compute: check the output folders, take the checkpoint folder's lock
    (held until ``stack`` closes: one run writes a folder), tidy what a killed run left, and list
    the checkpoints to resume from, newest first ([] when checkpoint.resume is off)."""
    where = recipe.path or "recipe"
    _check_writable(recipe.checkpoint.dir, "checkpoint.dir", where)
    _check_writable(recipe.log.dir, "log.dir", where)
    ckpt_dir = Path(recipe.checkpoint.dir)
    lock = stack.enter_context(checkpoint.lock_folder(ckpt_dir))
    if lock.taken_over is not None:
        _warn(f"{lock.path}: the run that held it ({lock.taken_over}) has ended; this run takes it over")
    for line in checkpoint.clean_temp(ckpt_dir):
        _warn(f"an interrupted run's leftovers: {line}")
    if not recipe.checkpoint.resume:
        return []
    return list(reversed(checkpoint.list_checkpoints(ckpt_dir)))


def _verify_share(path: Path, rank: int, world: int) -> str | None:
    """Check this rank's share of a checkpoint's files (every world-th of the manifest's, from the
    rank's own): None when they verify, else the reason."""
    try:
        checkpoint.verify(path, checkpoint.manifest_files(path)[rank::world])
        # the small files parse too (their bytes may match a manifest that was written so)
        checkpoint.open_checkpoint(path, check_integrity=False).trainer_state()
    except (checkpoint.CorruptCheckpointError, FileNotFoundError) as e:
        return str(e)
    return None


def _agree_on_resume_point(recipe: Recipe, mesh, stack: contextlib.ExitStack) -> Path | None:
    """The newest checkpoint whose checksums verify, the same on every rank (a warning names a
    corrupt newer one). Rank 0 prepares the folders and lists the candidates; every rank hashes a
    share of each candidate's files, so no one process reads the whole checkpoint."""
    candidates, error = [], None
    if mesh.rank == 0:
        try:
            candidates = _resume_candidates(recipe, stack)
        except (ValueError, OSError) as e:
            error = e
    if mesh.world > 1:
        box = [[str(c) for c in candidates], None if error is None else str(error)]
        dist.broadcast_object_list(box, src=0)
        candidates = [Path(c) for c in box[0]]
        if error is None and box[1] is not None:  # rank 0's folders or checkpoints are the recipe's
            raise RecipeError(box[1])
    if error is not None:
        raise error
    chosen, rejected = None, []
    for path in candidates:
        reason = _verify_share(path, mesh.rank, mesh.world)
        reasons = [reason] if mesh.world == 1 else [None] * mesh.world
        if mesh.world > 1:
            dist.all_gather_object(reasons, reason)
        bad = next((r for r in reasons if r is not None), None)
        if bad is None:
            chosen = path
            break
        rejected.append((path, bad))
    if rejected and chosen is None:
        raise checkpoint.CorruptCheckpointError(
            f"no intact checkpoint under {recipe.checkpoint.dir} (newest: {rejected[0][1]}); "
            f"move the folder away to start afresh"
        )
    if mesh.rank == 0:
        for bad_path, reason in rejected:
            _warn(
                f"checkpoint {bad_path} is corrupt ({reason}); resuming from {chosen}, the newest intact one"
            )
    return chosen


def _setup_mesh(recipe: Recipe):
    """Process group (torchrun's environment) and mesh; sizes checked before anything is built."""
    p, t = recipe.parallel, recipe.train
    fam = family_module(recipe.model_family)
    if p.cp > 1 and not fam.supports_context_parallel:
        raise RecipeError(
            f"{recipe.path}: parallel.cp = {p.cp}, but model family {recipe.model_family!r} has no "
            f"context-parallel attention yet: set parallel.cp = 1"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dist.is_initialized():
        world = dist.get_world_size()
    try:
        check_sizes(p.pp, p.dp, p.cp, p.ep, world, microbatches=t.microbatches, schedule=p.schedule,
                    num_experts=fam.sizes(recipe.model).num_experts, seq_len=recipe.data.seq_len,
                    global_batch=t.global_batch)  # fmt: skip
    except MeshError as e:
        raise RecipeError(f"{recipe.path}: {e}") from None
    if world > 1 and not dist.is_initialized():
        D.init_from_env(timeout_s=p.timeout_s)
    return build_mesh(p.pp, p.dp, p.cp, p.ep)


def _schedule(recipe: Recipe, mesh):
    """The pipeline table for pp > 1: a generator name or a CSV file."""
    if mesh.pp == 1:
        return None
    p = recipe.parallel
    try:
        if p.schedule.endswith(".csv"):
            table = read_csv(p.schedule)
        else:
            options = {"chunks": p.chunks} if p.schedule == "interleaved-1f1b" else {}
            table = generate(p.schedule, mesh.pp, recipe.train.microbatches, **options)
        validate(table)
    except (ValueError, FileNotFoundError) as e:
        raise RecipeError(f"{recipe.path}: parallel.schedule {p.schedule!r}: {e}") from None
    if table.pp != mesh.pp or table.microbatches != recipe.train.microbatches:
        raise RecipeError(
            f"{recipe.path}: parallel.schedule {p.schedule!r} is for pp={table.pp}, microbatches="
            f"{table.microbatches}; the recipe has parallel.pp={mesh.pp}, train.microbatches={recipe.train.microbatches}"
        )
    return table


def _shard_range(name: str, info: parallel.ShardInfo, mesh, shape) -> tuple[int, int]:
    """[start, stop): the elements of canonical tensor ``name`` (flattened) that this rank's flat
    shard holds, its padding excluded. Experts: this ep rank's experts are rows [lo, hi) of the
    canonical tensor, so its ep-local tensor is the flat range from lo x (elements per expert)."""
    base = 0
    if is_expert_param(name) and mesh.ep > 1:
        lo, _ = expert_range(shape[0], mesh.ep, mesh.coords["ep"])
        base = lo * math.prod(shape[1:])
    first = min(info.index * info.shard_numel, info.numel)
    return base + first, base + min(first + info.shard_numel, info.numel)


def _checkpoint_shards(tensors, infos, mesh, shapes) -> dict[str, checkpoint.Shard]:
    """{name: Shard} of this rank's flat shards (params, or one optimizer moment keyed by param name)."""
    out = {}
    for name, t in tensors.items():
        start, stop = _shard_range(name, infos[name], mesh, shapes[name])
        out[name] = checkpoint.Shard(t.detach()[: stop - start], start, tuple(shapes[name]))
    return out


def _opt_canonical(state, infos, mesh, shapes) -> dict[str, checkpoint.Shard]:
    """This rank's pieces of the optimizer state under its flat keys: ``<kind>/<param>`` tensors as
    the param's shard, the rest (step count, last gradient norm: the same on every rank) whole."""
    out = {}
    for key, value in optim.state_to_flat(state).items():
        name = key.partition("/")[2]
        if name in infos:
            out[key] = _checkpoint_shards({name: value}, infos, mesh, shapes)[name]
        else:
            out[key] = checkpoint.whole(value)
    return out


def _read_shard(
    ck: checkpoint.Checkpoint, kind: str, key: str, name: str, info, mesh, shape, device
) -> Tensor:
    """This rank's flat shard (padded with zeros) of ``key`` read from ``ck``: only its own range."""
    start, stop = _shard_range(name, info, mesh, shape)
    flat = torch.zeros(info.shard_numel, dtype=ck.entries[kind][key].dtype)
    ck.read(kind, key, start, stop, out=flat)
    return flat.to(device)


def _opt_shard(ck: checkpoint.Checkpoint, infos, mesh, shapes, device) -> dict[str, Tensor]:
    """This rank's optimizer state flat dict from ``ck``: its shards of the per-parameter keys of
    its parameters (other ranks' parameters skipped), the other keys whole."""
    flat = {}
    for key in ck.optim:
        kind, _, name = key.partition("/")
        if name in infos:
            flat[key] = _read_shard(ck, "optim", key, name, infos[name], mesh, shapes[name], device)
        elif name not in shapes:
            flat[key] = ck.read_whole("optim", key).to(device)
    return flat


def _initial_state(recipe: Recipe, model, tx, shapes, infos, mesh, device, resume_from: Path | None):
    """This rank's parameter shards, optimizer state and trainer counters (step, data_cursor,
    skipped_steps, nonfinite_streak): fresh from the recipe's seed, or from ``resume_from`` (its
    shapes checked against the recipe's from the index; only this rank's ranges read; the RNG
    restored)."""
    counters = {"step": 0, "data_cursor": 0, "skipped_steps": 0, "nonfinite_streak": 0}
    if resume_from is None:
        full = model.init(seed=recipe.train.seed, dtype=torch.float32)
        shards = {n: t.to(device) for n, t in parallel.shard_canonical(full, infos, mesh).items()}
        return shards, tx.init(shards), counters
    moments = {f"{kind}/{n}": s for n, s in shapes.items() for kind in ("exp_avg", "exp_avg_sq")}
    # every rank verified a share of the files' checksums in _agree_on_resume_point
    ck = checkpoint.open_checkpoint(resume_from, check_integrity=False)
    ck.check("model", list(shapes), shapes)
    ck.check("optim", shapes=moments, exact=False)
    shards = {n: _read_shard(ck, "model", n, n, infos[n], mesh, shapes[n], device) for n in infos}
    if not ck.optim:  # weights only (``fmoe checkpoint import-hf``): a fresh optimizer
        state = tx.init(shards)
    else:
        try:
            state = optim.state_from_flat(tx, _opt_shard(ck, infos, mesh, shapes, device), shards)
        except (KeyError, ValueError) as e:
            raise checkpoint.CheckpointError(
                f"{resume_from}: optimizer state does not fit the model ({e})"
            ) from None
    trainer_state = ck.trainer_state()
    counters = {k: int(trainer_state.get(k, 0)) for k in counters}
    if "rng" in trainer_state:
        checkpoint.restore_rng(trainer_state["rng"])
    return shards, state, counters


def _check_memory_plan(recipe: Recipe, model, shapes, table, mesh, device: torch.device) -> None:
    """The memory plan of this layout (``fmoe.plan``), before any parameter exists: RecipeError
    naming the rank and its largest term when a rank's planned peak exceeds the device's memory
    (``train.device_memory_gib``, else the CUDA device's total); else rank 0 writes it to
    ``<log.dir>/memory_plan.txt`` and, with ``log.progress``, prints it."""
    cuda_total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    limit = memory_plan.device_limit_bytes(recipe, device.type, cuda_total)
    sizes = (mesh.pp, mesh.dp, mesh.cp, mesh.ep)
    the_plan = memory_plan.plan_layout(recipe, model, shapes, sizes, table=table, device=device.type)
    refused = None if limit is None else memory_plan.refusal(the_plan, limit)
    if refused is not None:
        raise RecipeError(f"{recipe.path}: {refused} (train.device_memory_gib sets the limit)")
    if mesh.rank == 0:  # the log folder keeps it; the console shows it beside the progress bar
        text = memory_plan.summary(the_plan, limit)
        (Path(recipe.log.dir) / "memory_plan.txt").write_text(text + "\n")
        if recipe.log.progress:
            print(text, flush=True)


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
        shards = parallel.add_to_shards(shards, updates, infos, mesh)
    return shards, state, skipped


def _graphed_step(recipe: Recipe, mesh, device: torch.device, train_step: Callable):
    """``train.cuda_graphs``: the step and its update as one ``fmoe.cuda_graphs.GraphedStep`` of
    (shards, state, batch), or None (eager) where a step holds collectives (more than one process:
    pipeline sends, ZeRO gathers, expert all-to-alls with host-synced split sizes), said in one line.
    Replays run every step with the recipe's seed in its ``StageContext`` (fmoe's stages read none;
    a stage's randomness must come from torch's CUDA generator, which replays advance)."""
    if not recipe.train.cuda_graphs:
        return None
    if device.type != "cuda":
        raise RecipeError(f"{recipe.path}: train.cuda_graphs needs a CUDA device; this run is on {device}")
    if mesh.world > 1:
        if mesh.rank == 0:
            _warn(
                f"train.cuda_graphs: a step over {mesh.world} processes holds collectives "
                f"(pp={mesh.pp}, dp={mesh.dp}, cp={mesh.cp}, ep={mesh.ep}); it runs eagerly"
            )
        return None
    return cuda_graphs.GraphedStep(
        lambda shards, state, batch: train_step(shards, state, batch, recipe.train.seed)
    )


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
        _warn(f"the process group did not end cleanly ({type(e).__name__}: {e})")


def _train(
    recipe: Recipe,
    stop_after: int | None,
    on_step: Callable[[int, float], None] | None,
    stack: contextlib.ExitStack,
) -> TrainResult:
    """train's body, run under the recipe's CPU thread count; ``stack`` holds what is released when
    it returns or raises (the checkpoint folder's lock, the stop-signal handlers)."""
    t0 = time.perf_counter()
    fam = family_module(recipe.model_family)
    cfg = recipe.model
    check_family(fam, cfg)  # every stage once on a tiny batch: a broken family named before any data
    check_dataset_tokenizer(recipe)
    mesh = _setup_mesh(recipe)
    lead = mesh.rank == 0
    device = pick_device(recipe.train.device)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[recipe.train.dtype]
    torch.manual_seed(recipe.train.seed)
    resume_from = _agree_on_resume_point(recipe, mesh, stack)

    if lead:
        ensure_dataset(recipe)
    if mesh.world > 1:
        dist.barrier()
    dataset = data.TokenDataset(ensure_dataset(recipe))
    seq, global_batch = recipe.data.seq_len, recipe.train.global_batch
    try:
        data.check_vocab(dataset, fam.sizes(cfg).vocab_size)
        data.check_size(dataset, steps=recipe.train.steps, global_batch=global_batch, seq=seq)
    except ValueError as e:
        raise RecipeError(f"{recipe.path}: {e}") from None

    model = fam.build(cfg)
    table = _schedule(recipe, mesh)
    shapes = fam.param_shapes(cfg)
    names = list(shapes)
    local = pipeline.local_param_names(model, table, rank=mesh.coords["pp"]) if table is not None else names
    infos = parallel.layout(model, mesh, shapes, local)
    _check_memory_plan(recipe, model, shapes, table, mesh, device)
    tx, lr_schedule = make_optimizer(recipe, shapes)
    ckpt_dir = Path(recipe.checkpoint.dir)
    shards, state, counters = _initial_state(recipe, model, tx, shapes, infos, mesh, device, resume_from)
    step, cursor, skipped_total, streak = (
        counters[k] for k in ("step", "data_cursor", "skipped_steps", "nonfinite_streak")
    )

    result = TrainResult(step=step, skipped_steps=skipped_total)
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
    pending: list[tuple[int, Tensor, Tensor]] = []  # (step, loss, skipped) as device tensors
    last_skipped = False
    clock = _Clock(device)  # this run's time, apart from saving and its first (warm-up) step

    def train_step(shards, state, batch, seed: int):
        """One step and its update: (shards, state, loss, skipped), the last two device tensors."""
        loss, grads, statistics = parallel.parallel_step(
            model, shards, infos, batch, recipe.train.microbatches, mesh, schedule=table,
            dtype=None if dtype == torch.float32 else dtype, seed=seed,
            fp8=recipe.train.fp8, fp8_dense=recipe.train.fp8_dense, timeout_s=recipe.parallel.timeout_s,
            gather=recipe.parallel.gather, memory=recipe.memory,
        )  # fmt: skip
        shards, state, skipped = _update(tx, model, loss, grads, statistics, state, shards, infos, mesh)
        return shards, state, loss, skipped

    graphed = _graphed_step(recipe, mesh, device, train_step)
    c = recipe.checkpoint
    stops = stack.enter_context(StopSignals(["SIGTERM", "SIGINT", *([c.signal] if c.signal else [])]))
    writing: checkpoint.PendingSave | None = None  # a save whose files are still being written
    staging: dict[str, Tensor] = {}  # host buffers of asynchronous saves, reused save after save

    def begin_save(at: int, background: bool) -> checkpoint.PendingSave:
        """Every rank writes its own shards (``checkpoint.begin_save``): nothing is gathered."""
        trainer_state = {"step": at, "data_cursor": cursor, "rng": checkpoint.capture_rng(),
                         "skipped_steps": skipped_total, "nonfinite_streak": streak}  # fmt: skip
        return checkpoint.begin_save(
            ckpt_dir, at, _checkpoint_shards(shards, infos, mesh, shapes),
            _opt_canonical(state, infos, mesh, shapes), trainer_state, keep=c.keep,
            background=background, staging=staging,
        )  # fmt: skip

    def finish(save: checkpoint.PendingSave) -> str:
        save.wait()  # a second signal may cut the wait short; not the rename and rotation below
        with stops.deferred():
            return str(save.finish())

    try:
        while step < last_steps:
            tokens, labels, cursor = next(stream)
            batch = {"tokens": tokens.flatten(0, 1).to(device), "labels": labels.flatten(0, 1).to(device)}
            if graphed is not None:  # its loss and skip flag are overwritten by the next replay
                shards, state, loss, skipped = graphed(shards, state, batch)
                loss, skipped = loss.clone(), skipped.clone()
            else:
                shards, state, loss, skipped = train_step(shards, state, batch, recipe.train.seed + step)
            step += 1
            clock.stepped()
            pending.append((step, loss, skipped))
            at_interval = step % recipe.log.every == 0 or step % c.every == 0 or step == last_steps
            # the ranks agree on a stop request (and on their background writes being done) here:
            # one process every step; several at each log or checkpoint step, where the loop syncs
            # with the device anyway (every step on CPU, where agreeing costs no device sync)
            stop, written = False, False
            if mesh.world == 1 or at_interval or device.type == "cpu":
                stop, written = _agree(stops.requested is not None, writing, mesh, device)
            if written and writing is not None:
                with clock.saving():
                    result.checkpoint = finish(writing)
                writing = None
            last = step == last_steps or stop
            log_now = step % recipe.log.every == 0 or last
            if log_now or step % c.every == 0 or last:
                # one host sync per log interval or checkpoint: losses and skip flags together
                values = torch.stack([v.float() for _, v, _ in pending] + [k.float() for *_, k in pending])
                values = values.tolist()
                losses, flags = values[: len(pending)], values[len(pending) :]
                for (s, _, _), value, flag in zip(pending, losses, flags):
                    result.losses.append(value)
                    if on_step is not None:
                        on_step(s, value)
                    last_skipped = flag > 0
                    streak = streak + 1 if last_skipped else 0
                    skipped_total += int(last_skipped)
                    if streak >= recipe.train.max_nonfinite_steps:
                        raise NonFiniteError(
                            f"step {s}: {streak} steps in a row had a non-finite loss or gradient norm "
                            f"(loss {value}); their updates were skipped and none reached a checkpoint "
                            f"(train.max_nonfinite_steps = {recipe.train.max_nonfinite_steps}): lower "
                            f"optim.lr or check the data"
                        )
                pending.clear()
                result.skipped_steps = skipped_total
            if log_now:
                steps_done, seconds, saving = clock.window()
                tps = steps_done * tokens_per_step / max(seconds, 1e-9)
                record = {
                    "step": step,
                    "loss": losses[-1],
                    "lr": lr_schedule(max(int(state["step"]) - 1, 0)),  # the last applied step's
                    "grad_norm": None if last_skipped else float(state["grad_norm"]),
                    "skipped_steps": skipped_total,
                    "tokens_per_s": tps,  # steady state: saving and the run's first step left out
                    "save_s": saving,  # what saving checkpoints held the loop up since the last line
                }
                if peak:
                    record["mfu"] = flops_per_step * steps_done / max(seconds, 1e-9) / (peak * 1e12)
                if log is not None:
                    log.write(record)
                progress.update(step, losses[-1], tps, record.get("mfu"))
            if step % c.every == 0 or last:
                with clock.saving():
                    if writing is not None:  # the next save waits for the pending one
                        result.checkpoint = finish(writing)
                        writing = None
                    if last:
                        result.checkpoint = finish(begin_save(step, background=False))
                    else:
                        writing = begin_save(step, background=c.asynchronous)
            if stop:
                result.stopped_by = stops.requested or "a stop signal to another rank"
                break
    except BaseException:
        if writing is not None:  # an error or a second signal: the unfinished save is dropped
            writing.abort()
        raise
    finally:
        progress.close()
        if log is not None:
            log.close()
    steps_done, seconds = clock.steady()
    result.tokens_per_second = steps_done * tokens_per_step / max(seconds, 1e-9)
    if peak:
        result.mfu = flops_per_step * steps_done / max(seconds, 1e-9) / (peak * 1e12)
    result.save_seconds = clock.saved_total
    result.params = parallel.canonical(shards, infos, mesh, names) or {}
    result.step = step
    result.wall_seconds = time.perf_counter() - t0
    return result


def _agree(
    requested: bool, writing: checkpoint.PendingSave | None, mesh, device: torch.device
) -> tuple[bool, bool]:
    """(stop, written): whether any rank was asked to stop, and whether every rank's background
    checkpoint write is done (False when none is pending). One all-reduce on several processes."""
    busy = writing is not None and not writing.done()
    if mesh.world == 1:
        return requested, writing is not None and not busy
    flags = torch.tensor([float(requested), float(busy)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    stop, any_busy = flags.tolist()
    return stop > 0, writing is not None and any_busy == 0


class _Clock:
    """This run's time for its throughput: steps and seconds apart from the time saving held the
    loop up and apart from the run's first step (compilation, CUDA graph capture, allocator warm-up;
    the data was built before the loop). On CUDA the first step is waited for once, so its time is
    its own; the other boundaries fall at the loop's host syncs (a log line, a save)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.steps = 0
        self.start = time.perf_counter()
        self.first_step_s = 0.0
        self.saved_total = 0.0
        self.window_start, self.window_steps, self.window_saved = self.start, 0, 0.0

    def stepped(self) -> None:
        self.steps += 1
        self.window_steps += 1
        if self.steps == 1:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.first_step_s = time.perf_counter() - self.start

    @contextlib.contextmanager
    def saving(self):
        if self.device.type == "cuda":  # the steps queued before belong to the steps' time
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - t
            self.saved_total += spent
            self.window_saved += spent

    def window(self) -> tuple[int, float, float]:
        """(steps, seconds, seconds saving) since the last call, without the run's first step
        (unless it is the window's only one); starts the next window."""
        now = time.perf_counter()
        steps, seconds, saved = (
            self.window_steps,
            now - self.window_start - self.window_saved,
            self.window_saved,
        )
        if self.steps == steps and steps > 1:  # this window holds the run's first step
            steps, seconds = steps - 1, seconds - self.first_step_s
        self.window_start, self.window_steps, self.window_saved = now, 0, 0.0
        return steps, seconds, saved

    def steady(self) -> tuple[int, float]:
        """(steps, seconds) of the whole run, saving and the first step left out (unless it was
        the only step)."""
        seconds = time.perf_counter() - self.start - self.saved_total
        if self.steps > 1:
            return self.steps - 1, seconds - self.first_step_s
        return self.steps, seconds


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
