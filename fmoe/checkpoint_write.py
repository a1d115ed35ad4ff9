"""Writing checkpoints: :func:`save` (gathered, format 1: whole tensors from one process),
:func:`save_sharded` and its two halves :func:`begin_save` / :meth:`PendingSave.finish` (sharded,
format 2: every rank writes its own pieces, nothing gathered).

Every save goes through the temp-folder protocol of :mod:`fmoe.checkpoint_install`, so a crash
mid-write leaves the previous checkpoints as they were. Non-finite tensors are never written (every
rank checks its pieces, all agree before anything is written). Asynchronous saves
(``begin_save(background=True)``) copy a rank's pieces to host memory and write them on a thread;
:meth:`PendingSave.finish` installs the folder (the same bytes as a synchronous save).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fmoe.checkpoint_format import (
    INDEX,
    MANIFEST_FORMAT,
    MODEL,
    OPTIM,
    SHARDED_FORMAT,
    TRAINER,
    CheckpointWriteError,
    StreamedSafetensors,
    rank_file,
)
from fmoe.checkpoint_install import (
    after_install,
    aside_folder,
    digest,
    install,
    temp_folder,
    undo,
    write_text,
)
from fmoe.checkpoint_plan import Shard, all_gather_objects, first_nonfinite, held_ranges, plan, rank_world

__all__ = ["PendingSave", "RankFile", "begin_save", "save", "save_sharded"]


def save(
    dir: str | os.PathLike,
    step: int,
    params: Mapping[str, torch.Tensor],
    opt_state_flat: Mapping[str, torch.Tensor],
    trainer_state: Mapping[str, Any],
    keep: int = 3,
) -> Path:
    """Write ``<dir>/step_<step:08d>/`` atomically, gathered (format 1: whole tensors from one
    process), and keep only the newest ``keep`` checkpoints. A training run writes sharded
    checkpoints instead (:func:`save_sharded`); this form is for whole dicts in one process
    (``fmoe checkpoint import-hf``, tools).

    params / opt_state_flat: flat ``{name: tensor}`` (any device; saved from CPU copies).
    trainer_state: JSON-able dict (data cursor, ``capture_rng()``, ...); "step" is added.
    Returns the checkpoint's path. ValueError for bad arguments or a non-finite floating tensor
    (before anything is written); CheckpointWriteError (chaining the cause) if writing fails, e.g.
    a full disk: the partial folder is removed and the earlier checkpoints are left as they were.
    """
    text = _trainer_text(step, keep, trainer_state)
    model = _saveable(params, "params")
    optim = _saveable(opt_state_flat, "opt_state_flat")

    root = Path(dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = temp_folder(final)
    old = aside_folder(final)
    try:
        tmp.mkdir()
        meta = {"fmoe_step": str(step)}
        _write_tensors(tmp / MODEL, model, {**meta, "fmoe_content": "model"})
        _write_tensors(tmp / OPTIM, optim, {**meta, "fmoe_content": "optim"})
        write_text(tmp / TRAINER, text)
        files = {name: digest(tmp / name) for name in (MODEL, OPTIM, TRAINER)}
        install(tmp, final, old, MANIFEST_FORMAT, files)
    except BaseException as e:
        undo(tmp, final, old, e)
        raise
    after_install(root, old, keep)
    return final


def save_sharded(
    dir: str | os.PathLike,
    step: int,
    model: Mapping[str, Shard],
    optim: Mapping[str, Shard],
    trainer_state: Mapping[str, Any],
    keep: int = 3,
) -> Path:
    """Every rank of the default process group calls it with its own pieces; writes
    ``<dir>/step_<step:08d>/`` atomically (format 2) and keeps only the newest ``keep`` checkpoints.

    model / optim: this rank's :class:`Shard` of each canonical tensor it holds (parameters; the
    optimizer state's flat keys). Ranks may hold the same range (replicas): the lowest of them
    writes it. trainer_state: rank 0's is written. Nothing is gathered: the ranks exchange only the
    ranges they hold, then each writes its pieces into the shared temp folder and hashes its files;
    rank 0 writes the index and manifest and renames the folder into place.

    Returns the checkpoint's path on every rank. Raises on every rank: ValueError naming the tensor
    when a piece holds a NaN or an infinity, or when the ranks' ranges do not tile a tensor exactly
    (nothing is written); CheckpointWriteError when a rank fails to write (the temp folder is
    removed, the earlier checkpoints are left as they were). ``begin_save`` + ``PendingSave.finish``.
    """
    return begin_save(dir, step, model, optim, trainer_state, keep).finish()


def begin_save(
    dir: str | os.PathLike,
    step: int,
    model: Mapping[str, Shard],
    optim: Mapping[str, Shard],
    trainer_state: Mapping[str, Any],
    keep: int = 3,
    *,
    background: bool = False,
    staging: dict[str, Tensor] | None = None,
) -> PendingSave:
    """The first half of :func:`save_sharded` (every rank calls it; the same errors, raised here):
    the ranks agree on the pieces and the temp folder, then this rank's pieces are written.

    background=False: written here, before it returns. background=True: the pieces are first
    copied to host memory (pinned when they live on a GPU; ``staging`` {key: tensor}, when given,
    keeps those buffers for the next save of the same shapes), then a thread writes and hashes the
    files while the caller trains on: the caller may change the shards' values as soon as this
    returns. Either way the checkpoint appears only at :meth:`PendingSave.finish`, which every rank
    calls at the same point of its program (it exchanges the ranks' reports).
    """
    rank, _ = rank_world()
    root = Path(dir)
    final = root / f"step_{step:08d}"
    agreed = _agree(rank, final, step, keep, trainer_state, model, optim)
    # every rank writes the pieces it owns; rank 0 always writes its two files
    files = {
        rank_file(kind, rank): RankFile(kind, {n: shards[n] for n in agreed.owned[kind]})
        for kind, shards in (("model", model), ("optim", optim))
        if agreed.owned[kind] or rank == 0
    }
    pending = PendingSave(root, final, agreed.tmp, step, keep, agreed.index, agreed.text)
    _start_writing(pending, files, background, staging if staging is not None else {})
    return pending


class _Agreed(NamedTuple):
    """What the ranks agreed on before anything is written (:func:`_agree`)."""

    tmp: Path  # the temp folder rank 0 named
    text: str  # the trainer state's JSON (rank 0's; "" on the others)
    index: dict  # {kind: {name: entry}} of every rank's pieces
    owned: dict[str, list[str]]  # {kind: [name]} this rank writes


def _agree(
    rank: int,
    final: Path,
    step: int,
    keep: int,
    trainer_state: Mapping[str, Any],
    model: Mapping[str, Shard],
    optim: Mapping[str, Shard],
) -> _Agreed:
    """begin_save's exchange: every rank checks its arguments and pieces, the ranks share what they
    hold and rank 0's temp folder name, then each plans the index. Raises the same ValueError on
    every rank when any rank's check failed (nothing is written)."""
    # checks that fail on some ranks only are exchanged first, so every rank raises (none waits)
    problem, text, held, bad = None, "", {}, None
    try:
        text = _trainer_text(step, keep, trainer_state) if rank == 0 else ""
        held = {"model": held_ranges(model, "model"), "optim": held_ranges(optim, "optim")}
        bad = first_nonfinite({("model", n): s.data for n, s in model.items()}
                              | {("optim", n): s.data for n, s in optim.items()})  # fmt: skip
    except ValueError as e:
        problem = f"rank {rank}: {e}"
    # rank 0 names the temp folder; it is created once every rank knows its pieces are finite
    tmp = temp_folder(final) if rank == 0 else None
    everyone = all_gather_objects(
        {"held": held, "bad": bad, "problem": problem, "tmp": None if tmp is None else str(tmp)}
    )
    problem = next((e["problem"] for e in everyone if e["problem"] is not None), None)
    if problem is not None:
        raise ValueError(problem)
    failed = next(((r, e["bad"]) for r, e in enumerate(everyone) if e["bad"] is not None), None)
    if failed is not None:
        raise ValueError(
            f"checkpoint save: {failed[1]} (rank {failed[0]}'s piece) holds non-finite values; nothing was written"
        )
    index, owned = plan([e["held"] for e in everyone], rank)
    return _Agreed(Path(everyone[0]["tmp"]), text, index, owned)


@dataclass(frozen=True)
class RankFile:
    """One file a rank writes: the kind it holds ("model" or "optim": the file's ``fmoe_content``
    metadata, carried here, never read off a name) and its pieces by canonical tensor name
    (:class:`Shard` as planned; the tensors to store once copied, :func:`_piece_tensor` / :func:`_stage`)."""

    kind: str
    pieces: Mapping[str, Shard | Tensor]


def _start_writing(pending: PendingSave, files: Mapping[str, RankFile], background: bool,
                   staging: dict[str, Tensor]) -> None:  # fmt: skip
    """Write this rank's files now (background False), or copy them to host memory and start the
    writer thread; the temp folder is removed when this is interrupted (a second stop signal)."""
    try:
        if not background:
            pending._write(
                {
                    name: RankFile(f.kind, {n: _piece_tensor(s) for n, s in f.pieces.items()})
                    for name, f in files.items()
                }  # fmt: skip
            )
            return
        staged = _stage(files, staging)
    except BaseException:  # interrupted (a second stop signal): no temp folder stays
        pending.abort()
        raise
    pending.thread = threading.Thread(
        target=pending._write, args=(staged,), name="fmoe-checkpoint", daemon=True
    )
    pending.thread.start()


class PendingSave:
    """A sharded checkpoint being written (:func:`begin_save`): this rank's files go into the temp
    folder, on a thread or already done; :meth:`finish` installs the checkpoint, :meth:`abort`
    drops it. A process killed meanwhile leaves the earlier checkpoints as they were and a
    ``.tmp-*`` folder that :func:`fmoe.checkpoint.clean_temp` removes."""

    def __init__(self, root: Path, final: Path, tmp: Path, step: int, keep: int, index: dict, text: str):
        self.root, self.final, self.tmp, self.step, self.keep = root, final, tmp, step, keep
        self.index, self.text = index, text
        self.thread: threading.Thread | None = None
        self.cancel = threading.Event()
        self.digests: dict[str, Any] = {}
        self.error: str | None = None

    def _write(self, files: Mapping[str, RankFile]) -> None:
        """Write and hash this rank's files (on the writer thread, or the caller's); the outcome
        goes to ``digests`` / ``error``, never raised (``finish`` reports it on every rank)."""
        try:
            self.tmp.mkdir(parents=True, exist_ok=True)  # every rank: whichever comes first creates it
            for name, file in files.items():
                if self.cancel.is_set():
                    raise CheckpointWriteError("cancelled")
                _write_tensors(self.tmp / name, _storage_disjoint(dict(file.pieces)),
                               {"fmoe_step": str(self.step), "fmoe_content": file.kind})  # fmt: skip
                self.digests[name] = digest(self.tmp / name)
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"

    def done(self) -> bool:
        """This rank's files are written (or failed): ``finish`` will not wait for them."""
        return self.thread is None or not self.thread.is_alive()

    def wait(self) -> None:
        """Wait for this rank's writer (``finish`` does too)."""
        if self.thread is not None:
            self.thread.join()

    def finish(self) -> Path:
        """Wait for this rank's writer, exchange the ranks' reports; rank 0 writes the index, the
        trainer state and the manifest, renames the folder into place and drops old checkpoints.
        Every rank calls it; returns the path, or raises as :func:`save_sharded` does."""
        self.wait()
        rank, _ = rank_world()
        reports = all_gather_objects({"files": self.digests, "error": self.error})
        raised: BaseException | None = None
        if rank == 0:
            old = aside_folder(self.final)
            try:
                failed = next(
                    ((r, e["error"]) for r, e in enumerate(reports) if e["error"] is not None), None
                )
                if failed is not None:
                    raise OSError(f"rank {failed[0]}: {failed[1]}")
                files = {name: d for e in reports for name, d in e["files"].items()}
                write_text(self.tmp / INDEX, json.dumps({"format": SHARDED_FORMAT, **self.index}, indent=1))
                write_text(self.tmp / TRAINER, self.text)
                files.update({name: digest(self.tmp / name) for name in (INDEX, TRAINER)})
                install(self.tmp, self.final, old, SHARDED_FORMAT, files)
            except BaseException as e:
                try:
                    undo(self.tmp, self.final, old, e)
                except CheckpointWriteError as written:
                    raised = written
                if not isinstance(e, Exception):
                    raise
            if raised is None:
                try:
                    after_install(self.root, old, self.keep)
                except Exception as e:  # the checkpoint is in place; the others must not wait for rank 0
                    raised = e
        outcome = all_gather_objects(None if raised is None else str(raised))[0]
        if raised is not None:
            raise raised
        if outcome is not None:
            raise CheckpointWriteError(f"rank 0 reports: {outcome}")
        return self.final

    def abort(self) -> None:
        """Stop this rank's writer (after the file it is writing) and remove the temp folder; no
        collective (for a process about to exit)."""
        self.cancel.set()
        if self.thread is not None:
            self.thread.join()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _stage(files: Mapping[str, RankFile], staging: dict[str, Tensor]) -> dict[str, RankFile]:
    """Host copies of the pieces to write ({file: RankFile of tensors}), in buffers of ``staging``
    (by file and name; made on first use, pinned when the piece is on a GPU): one copy per piece,
    then one wait for the device (no other host sync)."""
    out: dict[str, RankFile] = {}
    on_gpu = False
    for file, planned in files.items():
        copies: dict[str, Tensor] = {}
        for name, s in planned.pieces.items():
            data = s.data.detach()
            whole = s.start == 0 and data.numel() == math.prod(s.shape)
            shape = tuple(s.shape) if whole else (data.numel(),)
            key = f"{file}/{name}"
            buf = staging.get(key)
            if buf is None or buf.shape != shape or buf.dtype != data.dtype:
                buf = torch.empty(shape, dtype=data.dtype, pin_memory=data.is_cuda)
                staging[key] = buf
            buf.view(-1).copy_(data.reshape(-1), non_blocking=data.is_cuda)
            on_gpu |= data.is_cuda
            copies[name] = buf
        out[file] = RankFile(planned.kind, copies)
    if on_gpu:
        torch.cuda.synchronize()
    return out


def _trainer_text(step: int, keep: int, trainer_state: Mapping[str, Any]) -> str:
    if not (isinstance(step, int) and step >= 0):
        raise ValueError(f"checkpoint save: step must be an int >= 0, got {step!r}")
    if not (isinstance(keep, int) and keep >= 1):
        raise ValueError(f"checkpoint save: keep must be an int >= 1, got {keep!r}")
    if "step" in trainer_state and trainer_state["step"] != step:
        raise ValueError(
            f"checkpoint save: trainer_state['step'] = {trainer_state['step']!r} differs from step {step}"
        )
    return _to_json({**trainer_state, "step": step})


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write one safetensors file and fsync it (tests replace this to simulate a crash). Streamed
    tensor by tensor (:class:`StreamedSafetensors`): no second copy of the bytes, and the writes
    release the GIL, so a background writer does not hold up the training thread."""
    specs = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    with StreamedSafetensors(path, specs, metadata) as writer:
        for name, t in tensors.items():
            writer.write(name, t)


def _saveable(tensors: Mapping[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """CPU, contiguous, storage-disjoint copies (safetensors refuses tensors sharing memory);
    ValueError naming the first floating tensor holding a NaN or an infinity."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise ValueError(f"checkpoint save: {what} entry {name!r} is not a str -> Tensor pair")
        t = t.detach().to("cpu").contiguous()
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(
                f"checkpoint save: {what}[{name!r}] holds non-finite values; nothing was written"
            )
        if t.numel() and t.untyped_storage().data_ptr() in seen:
            t = t.clone()  # tied weights: saved twice, loaded as two tensors
        if t.numel():
            seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _to_json(state: Mapping[str, Any]) -> str:
    try:
        return json.dumps(state, indent=1, allow_nan=False)
    except (TypeError, ValueError):
        for key, value in state.items():
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ValueError(f"checkpoint save: trainer_state[{key!r}] is not JSON-able ({e})") from e
        raise


def _piece_tensor(s: Shard) -> Tensor:
    """The bytes to store of a shard: CPU, contiguous; with the tensor's shape when it is whole."""
    t = s.data.detach().to("cpu").contiguous()
    if s.start == 0 and t.numel() == math.prod(s.shape):
        t = t.view(s.shape)
    return t


def _storage_disjoint(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """safetensors refuses tensors that share memory (views of one buffer): copy all but the first
    of those (one tensor at a time)."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        if t.numel() and t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        if t.numel():
            seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out
