"""A rank's training state in checkpoints: the resume point every rank agrees on, this rank's
shards of the parameters and optimizer state as ``checkpoint.Shard`` pieces (to save) and read
back from a checkpoint of any layout (to resume), the state a run starts from, and the loop's
saves (:class:`Checkpointer`).

Checkpoints are canonical (layout-free): each rank writes and reads only the flat ranges of the
canonical tensors its ZeRO-3 shards hold (``sharding.shard_range``), so a run resumes on another mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fmoe import checkpoint, optim, sharding
from fmoe.metrics_log import warn
from fmoe.preemption import StopSignals
from fmoe.recipe import Recipe, RecipeError
from fmoe.sharding import shard_range
from fmoe.train_clock import Clock

__all__ = [
    "Checkpointer",
    "agree_on_resume_point",
    "checkpoint_shards",
    "initial_state",
    "opt_canonical",
    "read_shard",
    "run_fields",
    "verify_share",
]

# train's fields that change what a step computes (train.steps may grow: that extends a run)
_TRAIN_RUN_FIELDS = (
    "global_batch",
    "seed",
    "dtype",
    "fp8",
    "fp8_dense",
    "fp8_dense_wgrad",
    "fp8_expert_wgrad",
)
_DATA_RUN_FIELDS = ("path", "tokenizer", "seq_len", "shuffle_seed")


def run_fields(recipe: Recipe) -> dict[str, Any]:
    """{"section.field": value} of what the steps compute - the model, the data stream, the
    optimizer, the step's batch, seed and numerics - as JSON values. A checkpoint records them (its
    trainer state's "recipe") and a resume names those that changed. Left out: train.steps (a run
    is extended by raising it), the device, the layout and the output folders, which a resumed run
    may change freely."""
    # a family's config is a frozen dataclass (``fmoe.stages.family.Family.config_class``)
    out = {f"model.{k}": v for k, v in dataclasses.asdict(recipe.model).items()}
    out |= {f"data.{k}": getattr(recipe.data, k) for k in _DATA_RUN_FIELDS}
    out |= {f"train.{k}": getattr(recipe.train, k) for k in _TRAIN_RUN_FIELDS}
    out |= {f"optim.{k}": v for k, v in dataclasses.asdict(recipe.optim).items()}
    return json.loads(json.dumps(out, default=str))


def _say_resumed(recipe: Recipe, resume_from: Path, step: int, recorded: Any) -> None:
    """Rank 0's line on a resume, and a warning naming each field that differs from the recipe
    that wrote the checkpoint (when it recorded one: ``run_fields``)."""
    print(f"fmoe: resuming from {resume_from} at step {step}", flush=True)
    if not isinstance(recorded, dict):
        return
    now = run_fields(recipe)
    # a field added since the checkpoint was written, left at its default, computes what it did
    sections = {name: type(getattr(recipe, name))() for name in ("data", "train", "optim")}
    default = run_fields(dataclasses.replace(recipe, **sections))
    changed = [
        f"{k} {json.dumps(recorded.get(k))} -> {json.dumps(now.get(k))}"
        for k in sorted(set(now) | set(recorded))
        if recorded.get(k) != now.get(k) and not (k not in recorded and k in default and now[k] == default[k])
    ]
    if changed:
        more = f" and {len(changed) - 8} more" if len(changed) > 8 else ""
        warn(f"{recipe.path or 'the recipe'} differs from the recipe that wrote {resume_from}: "
             f"{', '.join(changed[:8])}{more}")  # fmt: skip


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
        warn(f"{lock.path}: the run that held it ({lock.taken_over}) has ended; this run takes it over")
    for line in checkpoint.clean_temp(ckpt_dir):
        warn(f"an interrupted run's leftovers: {line}")
    if not recipe.checkpoint.resume:
        return []
    return list(reversed(checkpoint.list_checkpoints(ckpt_dir, damaged=True)))


def verify_share(path: Path, rank: int, world: int) -> str | None:
    """Check this rank's share of a checkpoint's files (every world-th of the manifest's, from the
    rank's own): None when they verify, else the reason."""
    missing = [
        f for f in (checkpoint.MODEL, checkpoint.OPTIM, checkpoint.TRAINER) if not (path / f).is_file()
    ]
    if missing:  # every checkpoint has the three (a sharded one's rank-0 files under these names)
        return f"{path / missing[0]}: missing"
    try:
        checkpoint.verify(path, checkpoint.manifest_files(path)[rank::world])
        # the small files parse too (their bytes may match a manifest that was written so)
        checkpoint.open_checkpoint(path, check_integrity=False).trainer_state()
    except (checkpoint.CorruptCheckpointError, FileNotFoundError) as e:
        return str(e)
    return None


def agree_on_resume_point(recipe: Recipe, mesh, stack: contextlib.ExitStack) -> Path | None:
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
        reason = verify_share(path, mesh.rank, mesh.world)
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
            aside = checkpoint.set_aside(bad_path)
            warn(
                f"checkpoint {bad_path} is corrupt ({reason}); resuming from {chosen}, the newest intact one; "
                f"the corrupt one is kept as {aside}, out of the checkpoints kept and rotated"
            )
    return chosen


def checkpoint_shards(tensors, infos, mesh, shapes) -> dict[str, checkpoint.Shard]:
    """{name: Shard} of this rank's flat shards (params, or one optimizer moment keyed by param name)."""
    out = {}
    for name, t in tensors.items():
        start, stop = shard_range(name, infos[name], mesh, shapes[name])
        out[name] = checkpoint.Shard(t.detach()[: stop - start], start, tuple(shapes[name]))
    return out


def opt_canonical(state, infos, mesh, shapes) -> dict[str, checkpoint.Shard]:
    """This rank's pieces of the optimizer state under its flat keys: ``<kind>/<param>`` tensors as
    the param's shard, the rest (step count, last gradient norm: the same on every rank) whole."""
    out = {}
    for key, value in optim.state_to_flat(state).items():
        name = key.partition("/")[2]
        if name in infos:
            out[key] = checkpoint_shards({name: value}, infos, mesh, shapes)[name]
        else:
            out[key] = checkpoint.whole(value)
    return out


def read_shard(
    ck: checkpoint.Checkpoint, kind: str, key: str, name: str, info, mesh, shape, device
) -> Tensor:
    """This rank's flat shard (padded with zeros) of ``key`` read from ``ck``: only its own range."""
    start, stop = shard_range(name, info, mesh, shape)
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
            flat[key] = read_shard(ck, "optim", key, name, infos[name], mesh, shapes[name], device)
        elif name not in shapes:
            flat[key] = ck.read_whole("optim", key).to(device)
    return flat


def initial_state(recipe: Recipe, model, tx, shapes, infos, mesh, device, resume_from: Path | None):
    """This rank's parameter shards, optimizer state and trainer counters (step, data_cursor,
    skipped_steps, nonfinite_streak): fresh from the recipe's seed, or from ``resume_from`` (its
    shapes checked against the recipe's from the index; only this rank's ranges read; the RNG
    restored)."""
    counters = {"step": 0, "data_cursor": 0, "skipped_steps": 0, "nonfinite_streak": 0}
    if resume_from is None:
        full = model.init(seed=recipe.train.seed, dtype=torch.float32)
        shards = {n: t.to(device) for n, t in sharding.shard_canonical(full, infos, mesh).items()}
        return shards, tx.init(shards), counters
    moments = {f"{kind}/{n}": s for n, s in shapes.items() for kind in ("exp_avg", "exp_avg_sq")}
    # every rank verified a share of the files' checksums in agree_on_resume_point
    ck = checkpoint.open_checkpoint(resume_from, check_integrity=False)
    ck.check("model", list(shapes), shapes)
    ck.check("optim", shapes=moments, exact=False)
    shards = {n: read_shard(ck, "model", n, n, infos[n], mesh, shapes[n], device) for n in infos}
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
    if mesh.rank == 0:
        _say_resumed(recipe, resume_from, counters["step"], trainer_state.get("recipe"))
    return shards, state, counters


class Checkpointer:
    """The loop's saves, on every rank, at most one in flight: ``checkpoint.begin_save`` (every rank
    writes its own shards, nothing is gathered; an asynchronous save is staged to host memory and
    written on a thread), installed by ``PendingSave.finish`` once every rank's write is done; the
    next save and the run's last one wait for it. path: the newest checkpoint this run installed.
    The time saving holds the loop up is ``clock``'s (``Clock.saving``)."""

    def __init__(
        self, recipe: Recipe, mesh, device: torch.device, infos, shapes, stops: StopSignals, clock: Clock
    ):
        c = recipe.checkpoint
        self.dir, self.keep, self.asynchronous = Path(c.dir), c.keep, c.asynchronous
        self.mesh, self.device, self.infos, self.shapes = mesh, device, infos, shapes
        self.stops, self.clock = stops, clock
        self.run_fields = run_fields(recipe)  # recorded in every save, compared by a resume
        self.writing: checkpoint.PendingSave | None = None  # a save whose files are still being written
        self.staging: dict[str, Tensor] = {}  # host buffers of asynchronous saves, reused save after save
        self.path: str | None = None

    def agree(self, at_interval: bool) -> bool:
        """Whether any rank was asked to stop (``stops``); a background save every rank has written
        is installed. The ranks agree on both here: one process every step; several at each log or
        checkpoint step (``at_interval``), where the loop syncs with the device anyway (every step on
        CPU, where agreeing costs no device sync); elsewhere False."""
        if not (self.mesh.world == 1 or at_interval or self.device.type == "cpu"):
            return False
        stop, written = _agree(self.stops.requested is not None, self.writing, self.mesh, self.device)
        if written and self.writing is not None:
            with self.clock.saving():
                self.path = self._finish(self.writing)
            self.writing = None
        return stop

    def save(self, step: int, shards, state, counters: dict[str, int], last: bool) -> None:
        """Save ``step``'s shards and optimizer state with the trainer's ``counters`` (data_cursor,
        skipped_steps, nonfinite_streak), once the pending save is installed: asynchronously
        (``checkpoint.asynchronous``) unless it is the run's ``last``, which is installed here."""
        with self.clock.saving():
            if self.writing is not None:  # the next save waits for the pending one
                self.path = self._finish(self.writing)
                self.writing = None
            if last:
                self.path = self._finish(self._begin(step, shards, state, counters, background=False))
            else:
                self.writing = self._begin(step, shards, state, counters, background=self.asynchronous)

    def abort(self) -> None:
        """An error or a second signal: the unfinished save is dropped (no collective)."""
        if self.writing is not None:
            self.writing.abort()

    def _begin(
        self, at: int, shards, state, counters: dict[str, int], background: bool
    ) -> checkpoint.PendingSave:
        """Every rank writes its own shards (``checkpoint.begin_save``): nothing is gathered."""
        trainer_state = {"step": at, "data_cursor": counters["data_cursor"], "rng": checkpoint.capture_rng(),
                         "skipped_steps": counters["skipped_steps"],
                         "nonfinite_streak": counters["nonfinite_streak"], "recipe": self.run_fields}  # fmt: skip
        return checkpoint.begin_save(
            self.dir, at, checkpoint_shards(shards, self.infos, self.mesh, self.shapes),
            opt_canonical(state, self.infos, self.mesh, self.shapes), trainer_state, keep=self.keep,
            background=background, staging=self.staging,
        )  # fmt: skip

    def _finish(self, save: checkpoint.PendingSave) -> str:
        save.wait()  # a second signal may cut the wait short; not the rename and rotation below
        with self.stops.deferred():
            return str(save.finish())


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
