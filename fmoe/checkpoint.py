"""Checkpoints: safetensors keyed by global parameter names, written atomically, with trainer state.

A checkpoint directory holds one folder per saved step. A run writes it sharded, nothing gathered:

    <dir>/step_00001000/
        model.safetensors           rank 0's pieces of the parameters
        model-rank00003.safetensors rank 3's pieces (a rank that owns no piece writes no file)
        optim.safetensors           rank 0's pieces of the optimizer state (``fmoe.optim.state_to_flat`` keys)
        optim-rank00003.safetensors ...
        index.json                  {"format": 2, "model": {name: entry}, "optim": {key: entry}}
        trainer.json                {"step": N, ...trainer_state}: data cursor, RNG states, anything JSON
        manifest.json               {"format": 2, "files": {file name: {"bytes": n, "sha256": hex}}}

A piece is a flat range of a canonical tensor: ``entry = {"shape": [...], "dtype": "float32",
"pieces": [{"file": f, "start": a, "stop": b}, ...]}`` says that elements [a, b) of the tensor
flattened (row-major) are stored in file f under the tensor's global name (1-D, or with the
tensor's own shape when the piece is the whole tensor). The pieces of an entry tile [0, numel)
exactly; a range several ranks hold (replicas) is written once, by the lowest of them
(:func:`save_sharded`). Loading on any layout reads only the ranges a rank needs
(:meth:`Checkpoint.read`, through safetensors' lazy ``get_slice``), whatever layout wrote them.

:func:`save` writes the older, gathered form (format 1: whole tensors in ``model.safetensors`` and
``optim.safetensors``, no index): ``fmoe checkpoint import-hf`` writes it, and :func:`open_checkpoint`
reads it as a checkpoint with one file per kind whose pieces are whole tensors.

A folder is first written as ``<dir>/.tmp-step_<N>-<pid>-<id>`` (every rank writing its files into
it), every file and the folder fsynced, then renamed to ``step_<N>`` by rank 0: a ``step_*`` folder
is always complete, and a crash mid-write leaves the previous checkpoints as they were (and a
``.tmp-*`` folder that :func:`clean_temp` removes at the next start). Old checkpoints are dropped by
renaming them to ``.tmp-drop-*`` first, so a crash while deleting one leaves no half-deleted
``step_*`` folder. Non-finite tensors are never written (every rank checks its pieces, all agree
before anything is written).

One writer: a run holds :func:`lock_folder` (an OS ``flock`` plus its host and pid in
``fmoe.lock``) from before :func:`clean_temp` to its last save, so no process tidies or replaces
what another one is writing. Asynchronous saves: :func:`begin_save` with ``background=True`` copies
a rank's pieces to host memory and writes them on a thread; :meth:`PendingSave.finish` installs
the folder as above (the same bytes as a synchronous save).

Integrity: the manifest records each file's SHA-256 (each writer hashes its files from the bytes on
disk after the write), and :func:`verify` checks them: a flipped bit or a truncated file is a
:class:`CorruptCheckpointError` naming the file; :func:`newest_intact` picks the newest checkpoint
that verifies. A sharded folder without a manifest, and any file of JSON that does not parse
(a RecursionError of deeply nested brackets included), is corrupt. Nothing here knows the parallel layout: callers say which range of which canonical
tensor they hold (:class:`Shard`), so a run can resume on another layout.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import math
import os
import random
import re
import shutil
import socket
import struct
import threading
import time
import uuid
import warnings
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import Tensor

MODEL, OPTIM, TRAINER = "model.safetensors", "optim.safetensors", "trainer.json"
MANIFEST, INDEX = "manifest.json", "index.json"
LOCK = "fmoe.lock"  # lock_folder: one writer per checkpoint folder
MANIFEST_FORMAT = 1  # gathered: whole tensors in MODEL and OPTIM
SHARDED_FORMAT = 2  # sharded: pieces in per-rank files, described by INDEX
KINDS = ("model", "optim")
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_MOVED_ASIDE = re.compile(r"^\.tmp-old-(step_\d{8,})-[0-9a-f]+$")


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed; its partial folder was removed, earlier checkpoints are intact."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or that does not fit the model it is loaded for; the message
    names the file and the tensor (bad input: the CLI reports it as one line)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's file does not match its recorded checksum, or cannot be parsed; the message
    names the file. An older checkpoint may still be intact (:func:`newest_intact`)."""


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
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    old = root / f".tmp-old-{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        meta = {"fmoe_step": str(step)}
        _write_tensors(tmp / MODEL, model, {**meta, "fmoe_content": "model"})
        _write_tensors(tmp / OPTIM, optim, {**meta, "fmoe_content": "optim"})
        _write_text(tmp / TRAINER, text)
        files = {name: _digest(tmp / name) for name in (MODEL, OPTIM, TRAINER)}
        _install(tmp, final, old, MANIFEST_FORMAT, files)
    except BaseException as e:
        _undo(tmp, final, old, e)
        raise
    _after_install(root, old, keep)
    return final


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


def rank_file(kind: str, rank: int) -> str:
    """The file ``rank`` writes its pieces of ``kind`` ("model" or "optim") into: rank 0's are the
    gathered form's names, so a checkpoint written by one process has the familiar two files."""
    base = {"model": MODEL, "optim": OPTIM}[kind]
    return base if rank == 0 else base.replace(".safetensors", f"-rank{rank:05d}.safetensors")


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
    rank, _ = _rank_world()
    root = Path(dir)
    final = root / f"step_{step:08d}"
    # checks that fail on some ranks only are exchanged first, so every rank raises (none waits)
    problem, text, held, bad = None, "", {}, None
    try:
        text = _trainer_text(step, keep, trainer_state) if rank == 0 else ""
        held = {"model": _held(model, "model"), "optim": _held(optim, "optim")}
        bad = _first_nonfinite({("model", n): s.data for n, s in model.items()}
                               | {("optim", n): s.data for n, s in optim.items()})  # fmt: skip
    except ValueError as e:
        problem = f"rank {rank}: {e}"
    # rank 0 names the temp folder; it is created once every rank knows its pieces are finite
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}" if rank == 0 else None
    everyone = _all_gather_objects(
        {"held": held, "bad": bad, "problem": problem, "tmp": None if tmp is None else str(tmp)}
    )
    tmp = Path(everyone[0]["tmp"])
    problem = next((e["problem"] for e in everyone if e["problem"] is not None), None)
    if problem is not None:
        raise ValueError(problem)
    failed = next(((r, e["bad"]) for r, e in enumerate(everyone) if e["bad"] is not None), None)
    if failed is not None:
        raise ValueError(
            f"checkpoint save: {failed[1]} (rank {failed[0]}'s piece) holds non-finite values; nothing was written"
        )
    index, owned = _plan([e["held"] for e in everyone], rank)
    # every rank writes the pieces it owns; rank 0 always writes its two files
    files = {
        rank_file(kind, rank): {n: shards[n] for n in owned[kind]}
        for kind, shards in (("model", model), ("optim", optim))
        if owned[kind] or rank == 0
    }
    pending = PendingSave(root, final, tmp, step, keep, index, text)
    if not background:
        try:
            pending._write(
                {name: {n: _piece_tensor(s) for n, s in shards.items()} for name, shards in files.items()}
            )
        except BaseException:  # interrupted (a second stop signal): no temp folder stays
            pending.abort()
            raise
        return pending
    try:
        staged = _stage(files, staging if staging is not None else {})
    except BaseException:
        pending.abort()
        raise
    pending.thread = threading.Thread(
        target=pending._write, args=(staged,), name="fmoe-checkpoint", daemon=True
    )
    pending.thread.start()
    return pending


class PendingSave:
    """A sharded checkpoint being written (:func:`begin_save`): this rank's files go into the temp
    folder, on a thread or already done; :meth:`finish` installs the checkpoint, :meth:`abort`
    drops it. A process killed meanwhile leaves the earlier checkpoints as they were and a
    ``.tmp-*`` folder that :func:`clean_temp` removes."""

    def __init__(self, root: Path, final: Path, tmp: Path, step: int, keep: int, index: dict, text: str):
        self.root, self.final, self.tmp, self.step, self.keep = root, final, tmp, step, keep
        self.index, self.text = index, text
        self.thread: threading.Thread | None = None
        self.cancel = threading.Event()
        self.digests: dict[str, Any] = {}
        self.error: str | None = None

    def _write(self, files: Mapping[str, Mapping[str, Tensor]]) -> None:
        """Write and hash this rank's files (on the writer thread, or the caller's); the outcome
        goes to ``digests`` / ``error``, never raised (``finish`` reports it on every rank)."""
        try:
            self.tmp.mkdir(parents=True, exist_ok=True)  # every rank: whichever comes first creates it
            for name, tensors in files.items():
                if self.cancel.is_set():
                    raise CheckpointWriteError("cancelled")
                kind = "model" if name.startswith("model") else "optim"
                _write_tensors(self.tmp / name, _storage_disjoint(dict(tensors)),
                               {"fmoe_step": str(self.step), "fmoe_content": kind})  # fmt: skip
                self.digests[name] = _digest(self.tmp / name)
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
        rank, _ = _rank_world()
        reports = _all_gather_objects({"files": self.digests, "error": self.error})
        raised: BaseException | None = None
        if rank == 0:
            old = self.root / f".tmp-old-{self.final.name}-{uuid.uuid4().hex[:8]}"
            try:
                failed = next(
                    ((r, e["error"]) for r, e in enumerate(reports) if e["error"] is not None), None
                )
                if failed is not None:
                    raise OSError(f"rank {failed[0]}: {failed[1]}")
                files = {name: d for e in reports for name, d in e["files"].items()}
                _write_text(self.tmp / INDEX, json.dumps({"format": SHARDED_FORMAT, **self.index}, indent=1))
                _write_text(self.tmp / TRAINER, self.text)
                files.update({name: _digest(self.tmp / name) for name in (INDEX, TRAINER)})
                _install(self.tmp, self.final, old, SHARDED_FORMAT, files)
            except BaseException as e:
                try:
                    _undo(self.tmp, self.final, old, e)
                except CheckpointWriteError as written:
                    raised = written
                if not isinstance(e, Exception):
                    raise
            if raised is None:
                try:
                    _after_install(self.root, old, self.keep)
                except Exception as e:  # the checkpoint is in place; the others must not wait for rank 0
                    raised = e
        outcome = _all_gather_objects(None if raised is None else str(raised))[0]
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


def _stage(
    files: Mapping[str, Mapping[str, Shard]], staging: dict[str, Tensor]
) -> dict[str, dict[str, Tensor]]:
    """Host copies of the pieces to write ({file: {name: tensor}}), in buffers of ``staging`` (by
    file and name; made on first use, pinned when the piece is on a GPU): one copy per piece, then
    one wait for the device (no other host sync)."""
    out: dict[str, dict[str, Tensor]] = {}
    on_gpu = False
    for file, shards in files.items():
        out[file] = {}
        for name, s in shards.items():
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
            out[file][name] = buf
    if on_gpu:
        torch.cuda.synchronize()
    return out


def clean_temp(dir: str | os.PathLike) -> list[str]:
    """Tidy what a killed writer left under ``dir``; returns one line per action, for a log.

    A ``.tmp-old-step_N-*`` folder whose ``step_N`` is missing is the checkpoint a crashed save was
    replacing: it is renamed back. Every other ``.tmp-*`` folder (a partial write, a half-deleted
    old checkpoint) is removed. Call it before a run writes, from one process only.
    """
    root = Path(dir)
    if not root.is_dir():
        return []
    done = []
    for p in sorted(root.iterdir()):
        moved = _MOVED_ASIDE.match(p.name)
        if moved and p.is_dir() and not (root / moved.group(1)).exists():
            os.rename(p, root / moved.group(1))
            done.append(f"restored {root / moved.group(1)} from {p.name}")
        elif p.name.startswith(".tmp-"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            done.append(f"removed {p}")
    if done:
        _fsync_dir(root)
    return done


class CheckpointInUseError(CheckpointError):
    """Another live process holds a checkpoint folder's lock (:func:`lock_folder`); the message
    names its host and pid."""


class FolderLock:
    """A held :func:`lock_folder` lock: ``release()`` (or leaving a ``with`` block) frees it;
    ``taken_over``: the record of an earlier owner that ended without releasing it, else None."""

    def __init__(self, fd: int, path: Path, taken_over: str | None):
        self.fd, self.path, self.taken_over = fd, path, taken_over

    def release(self) -> None:
        """Remove the lock file (still holding the lock: a process that opened it meanwhile sees
        it gone once it gets the lock, and starts over), then free the lock."""
        if self.fd < 0:
            return
        try:
            self.path.unlink(missing_ok=True)  # a cleanly ended run leaves nothing behind
        finally:
            os.close(self.fd)  # closing the descriptor frees the flock
            self.fd = -1

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_folder(dir: str | os.PathLike) -> FolderLock:
    """Make this process the one writer of checkpoint folder ``dir``: an exclusive ``flock`` on
    ``<dir>/fmoe.lock`` (the kernel frees it when the process ends, however it ends), and the
    owner's host, pid and start time written into the file, for messages.

    CheckpointInUseError naming the owner when another process holds it. On a filesystem without
    flock the record decides: an owner on this host whose pid is alive holds the folder; an owner
    on another host cannot be checked and is taken over (``taken_over`` says so). Call it before
    any tidy-up or write of ``dir`` and keep it until the run's last save."""
    root = Path(dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        held = _lock_file(fd, root)
        try:  # locked the file that is still at the path? (a releasing owner removes it first)
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return held
        except FileNotFoundError:
            pass
        os.close(fd)


def _lock_file(fd: int, root: Path) -> FolderLock:
    """lock_folder's flock and owner record on an open lock file (closed on an error)."""
    path = root / LOCK
    try:
        record = _lock_record(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointInUseError(
                f"checkpoint.dir {str(root)!r} is in use by another run ({_owner_text(record)}); "
                f"wait for it to end or give this run another checkpoint.dir"
            ) from None
        except OSError:  # no flock on this filesystem: the record decides
            if record.get("host") == socket.gethostname() and _alive(record.get("pid")):
                raise CheckpointInUseError(
                    f"checkpoint.dir {str(root)!r} is in use by another run ({_owner_text(record)})"
                ) from None
        record = _lock_record(fd)  # read again under the lock: what an ended owner left
        taken_over = _owner_text(record) if record else None
        mine = {"host": socket.gethostname(), "pid": os.getpid(),
                "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(mine).encode(), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    return FolderLock(fd, path, taken_over)


def _lock_record(fd: int) -> dict:
    """The owner record of a lock file ({} when empty or unreadable: it is only for messages)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except Exception:
        return {}
    return record if isinstance(record, dict) else {}


def _owner_text(record: Mapping) -> str:
    return f"pid {record.get('pid', '?')} on host {record.get('host', '?')}, since {record.get('since', '?')}"


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_checkpoints(dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoint folders under ``dir``, oldest step first; temp folders are ignored."""
    root = Path(dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and all((p / f).is_file() for f in (MODEL, OPTIM, TRAINER)):
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest(dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint folder under ``dir``, or None."""
    found = list_checkpoints(dir)
    return found[-1] if found else None


def verify(path: str | os.PathLike, files: Collection[str] | None = None) -> bool:
    """Check the files of a checkpoint folder against its manifest's sizes and SHA-256.

    files: the file names to check (default: every file the manifest lists; ``manifest_files``
    gives them, so several processes may each check a share). Returns True when verified, False
    for a gathered folder without a manifest (written before checksums existed: nothing to verify
    against). FileNotFoundError naming a missing file; CorruptCheckpointError naming the first file
    that differs, a corrupt manifest, or a sharded folder without one (every sharded checkpoint is
    written with its manifest last: a folder that lacks it was not written whole by fmoe).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint {folder} does not exist")
    expected = _manifest(folder)
    if expected is None:
        if (folder / INDEX).exists():
            raise CorruptCheckpointError(f"{folder / MANIFEST}: missing (a sharded checkpoint has one)")
        return False
    for name in expected if files is None else files:
        file = folder / name
        if name not in expected:
            raise CorruptCheckpointError(f"{file}: not in the manifest")
        size, digest = expected[name]
        if not file.is_file():
            raise FileNotFoundError(f"{file}: missing")
        got = file.stat().st_size
        if got != size:
            raise CorruptCheckpointError(
                f"{file}: {got} bytes, the manifest records {size} (truncated or corrupt)"
            )
        if file_sha256(file) != digest:
            raise CorruptCheckpointError(f"{file}: SHA-256 differs from the manifest's (corrupt)")
    return True


def manifest_files(path: str | os.PathLike) -> list[str]:
    """The file names a checkpoint's manifest lists, sorted ([] without a manifest);
    CorruptCheckpointError for a corrupt manifest."""
    expected = _manifest(Path(path))
    return [] if expected is None else sorted(expected)


def _manifest(folder: Path) -> dict[str, tuple[int, str]] | None:
    """{file name: (bytes, sha256)} of the manifest; None without one. A format-1 manifest must
    list the three gathered files, a format-2 one the index and trainer state."""
    manifest_file = folder / MANIFEST
    if not manifest_file.is_file():
        return None
    try:
        manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
        files = manifest["files"]
        required = (
            (MODEL, OPTIM, TRAINER)
            if manifest["format"] == MANIFEST_FORMAT
            else (MODEL, OPTIM, INDEX, TRAINER)
        )
        expected = {
            name: (int(files[name]["bytes"]), str(files[name]["sha256"])) for name in (*required, *files)
        }
        if any("/" in name or name.startswith(".") for name in expected):
            raise ValueError("a file name outside the folder")
    except Exception as e:  # any parse error (a RecursionError of nested JSON too) is corruption
        raise CorruptCheckpointError(f"{manifest_file}: corrupt manifest ({type(e).__name__}: {e})") from e
    return expected


def newest_intact(dir: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under ``dir`` that verifies (:func:`verify`), and the newer ones that
    did not, each with the reason (newest first). (None, [...]) when none is intact."""
    rejected: list[tuple[Path, str]] = []
    for path in reversed(list_checkpoints(dir)):
        try:
            verify(path)
            return path, rejected
        except (CorruptCheckpointError, FileNotFoundError) as e:
            rejected.append((path, str(e)))
    return None, rejected


def load(
    path: str | os.PathLike,
    *,
    expected_keys: Collection[str] | None = None,
    expected_optim_keys: Collection[str] | None = None,
    expected_shapes: Mapping[str, Sequence[int]] | None = None,
    expected_optim_shapes: Mapping[str, Sequence[int]] | None = None,
    device: str | torch.device = "cpu",
    check_integrity: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """Read a whole checkpoint folder (either format) into one process: ``(params, opt_state_flat,
    trainer_state)``, every tensor whole. For small models and tools; a training run reads only its
    own ranges (:func:`open_checkpoint`, :meth:`Checkpoint.read`).

    expected_keys / expected_optim_keys: when given, the checkpoint must hold exactly those names.
    expected_shapes: {name: shape}: the model must hold exactly those names, with those shapes.
    expected_optim_shapes: {key: shape}: those optimizer keys, where present, must have those shapes.
    check_integrity: verify the files against the manifest first (False: the caller just did).
    Errors are one line naming the file: FileNotFoundError when missing, CorruptCheckpointError
    (a ValueError) when a checksum differs or a file does not parse, ValueError naming the tensor,
    the checkpoint's shape and the expected one for a shape mismatch, ValueError for other keys.
    """
    ck = open_checkpoint(path, check_integrity)
    if expected_shapes is not None:
        expected_keys = list(expected_shapes)
    ck.check("model", expected_keys, expected_shapes)
    ck.check("optim", expected_optim_keys, expected_optim_shapes, exact=False)
    params = {n: ck.read_whole("model", n).to(device) for n in ck.model}
    optim = {n: ck.read_whole("optim", n).to(device) for n in ck.optim}
    return params, optim, ck.trainer_state()


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read through one small reused buffer (``hashlib.file_digest``):
    hashing a checkpoint file costs no memory to speak of, whatever its size."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# --------------------------------------------------------------------------------------------------
# writing: shared steps of save and save_sharded


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


def _digest(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def _install(tmp: Path, final: Path, old: Path, format: int, files: Mapping[str, Any]) -> None:
    """Write the manifest, fsync the temp folder and rename it to ``final`` (an existing ``final``,
    a step saved again after a resume, is first moved to ``old``)."""
    _write_text(tmp / MANIFEST, json.dumps({"format": format, "files": dict(files)}, indent=1))
    _fsync_dir(tmp)
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)


def _undo(tmp: Path, final: Path, old: Path, e: BaseException) -> None:
    """After a failed write: remove the temp folder, put back a checkpoint moved aside, and raise
    CheckpointWriteError (chaining ``e``) when ``e`` is an Exception."""
    shutil.rmtree(tmp, ignore_errors=True)
    if old.exists() and not final.exists():
        os.rename(old, final)  # put back the checkpoint we were replacing
    if isinstance(e, Exception):
        root = final.parent
        raise CheckpointWriteError(
            f"writing checkpoint {final} failed ({type(e).__name__}: {e}); the partial folder was removed"
            + (f", {latest(root)} is intact" if latest(root) else "")
        ) from e


def _after_install(root: Path, old: Path, keep: int) -> None:
    _fsync_dir(root)  # make the rename durable
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
    for stale in list_checkpoints(root)[:-keep]:
        _drop(stale)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (small, picklable), in rank order; [obj] without a process group."""
    rank, world = _rank_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _held(shards: Mapping[str, Shard], what: str) -> dict[str, tuple[int, int, list[int], str]]:
    """{name: (start, stop, canonical shape, dtype name)} of this rank's shards (ValueError naming a
    malformed one)."""
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
        out[name] = (s.start, stop, list(s.shape), _dtype_name(s.data.dtype))
    return out


def _first_nonfinite(tensors: Mapping[tuple[str, str], Tensor]) -> str | None:
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


def _plan(held_by_rank: Sequence[Mapping[str, Mapping[str, tuple]]], rank: int) -> tuple[dict, dict]:
    """From every rank's held ranges: the index ({kind: {name: entry}}) and the names this rank
    writes ({kind: [name]}): each distinct non-empty range by the lowest rank holding it.
    ValueError naming the tensor when the ranks disagree on its shape or dtype, or their ranges
    overlap or leave a gap (a layout bug: nothing would restore those elements)."""
    index: dict[str, dict] = {}
    owned: dict[str, list[str]] = {}
    for kind in KINDS:
        ranges: dict[str, dict[tuple[int, int], int]] = {}
        meta: dict[str, tuple[list[int], str]] = {}
        for r, held in enumerate(held_by_rank):
            for name, (start, stop, shape, dtype) in held[kind].items():
                if meta.setdefault(name, (shape, dtype)) != (shape, dtype):
                    raise ValueError(
                        f"checkpoint save: {kind} tensor {name!r} is {meta[name]} on one rank and "
                        f"{(shape, dtype)} on rank {r}"
                    )
                if stop > start:
                    ranges.setdefault(name, {}).setdefault((start, stop), r)
        entries = {}
        for name in sorted(meta):
            shape, dtype = meta[name]
            pieces = sorted(ranges.get(name, {}).items())
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
            entries[name] = {
                "shape": shape,
                "dtype": dtype,
                "pieces": [{"file": rank_file(kind, r), "start": a, "stop": b} for (a, b), r in pieces],
            }
        index[kind] = entries
        owned[kind] = [n for n in entries for (a, b), r in ranges.get(n, {}).items() if r == rank]
    return index, owned


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


_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
              torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
}  # fmt: skip
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"checkpoint: dtype {dtype} cannot be stored")
    return name


# --------------------------------------------------------------------------------------------------
# reading: any range of any canonical tensor, from either format


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of a canonical tensor flattened, stored in ``file`` under its name."""

    file: str
    start: int
    stop: int


@dataclass(frozen=True)
class Entry:
    """One canonical tensor of a checkpoint: its shape, dtype and the pieces tiling it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Checkpoint:
    """An opened checkpoint folder (:func:`open_checkpoint`): what it holds, read range by range.

    model / optim: {name: Entry}. ``where[kind]``: the file that lists the kind's names (for
    messages). Nothing is read until asked, and each read opens the files it needs and closes them
    again (no mapping of a whole file stays resident)."""

    def __init__(self, folder: Path, format: int, model: dict[str, Entry], optim: dict[str, Entry],
                 where: dict[str, Path]):  # fmt: skip
        self.folder, self.format, self.where = folder, format, where
        self.entries = {"model": model, "optim": optim}

    @property
    def model(self) -> dict[str, Entry]:
        return self.entries["model"]

    @property
    def optim(self) -> dict[str, Entry]:
        return self.entries["optim"]

    def read(
        self, kind: str, name: str, start: int = 0, stop: int | None = None, out: Tensor | None = None
    ) -> Tensor:
        """Elements [start, stop) of canonical tensor ``name`` flattened (1-D, the stored dtype),
        read from the pieces that overlap them and nothing else; written into ``out`` (1-D, at
        least stop - start elements: the first stop - start are set) when given."""
        entry = self.entries[kind][name]
        stop = entry.numel if stop is None else stop
        if not 0 <= start <= stop <= entry.numel:
            raise CheckpointError(
                f"{self.folder}: range [{start}, {stop}) of {kind} tensor {name!r} of {entry.numel}"
            )
        if out is None:
            out = torch.empty(stop - start, dtype=entry.dtype)
        for piece in entry.pieces:
            lo, hi = max(start, piece.start), min(stop, piece.stop)
            if lo >= hi:
                continue
            part = self._read_piece(piece, name, entry, lo - piece.start, hi - piece.start)
            out[lo - start : hi - start].copy_(part)
            del part
        return out[: stop - start]

    def read_whole(self, kind: str, name: str) -> Tensor:
        """Canonical tensor ``name`` (its shape and stored dtype)."""
        entry = self.entries[kind][name]
        return self.read(kind, name).view(entry.shape)

    def tensors(self, kind: str = "model") -> LazyTensors:
        """The kind's tensors as a read-on-access mapping (each access assembles one whole tensor)."""
        return LazyTensors(self, kind)

    def trainer_state(self) -> dict[str, Any]:
        file = self.folder / TRAINER
        if not file.is_file():
            raise FileNotFoundError(f"{file}: missing")
        try:
            trainer = json.loads(file.read_text(encoding="utf-8"))
        except Exception as e:  # any parse error (a RecursionError of nested JSON too) is corruption
            raise CorruptCheckpointError(f"{file}: corrupt JSON ({type(e).__name__}: {e})") from e
        if not isinstance(trainer, dict) or not isinstance(trainer.get("step"), int):
            raise CorruptCheckpointError(f"{file}: expected a JSON object with an int 'step'")
        return trainer

    def check(
        self,
        kind: str,
        keys: Collection[str] | None = None,
        shapes: Mapping[str, Sequence[int]] | None = None,
        exact: bool = True,
    ) -> None:
        """CheckpointError (one line naming the file) when the kind's names are not exactly ``keys``
        (when given), or a tensor's shape differs from ``shapes`` (those present when not exact)."""
        have = self.entries[kind]
        where = self.where[kind]
        if keys is not None:
            want = set(keys)
            missing, unexpected = sorted(want - have.keys()), sorted(have.keys() - want)
            if missing or unexpected:
                raise CheckpointError(
                    f"{where}: keys do not match: {len(missing)} missing {missing[:5]}, "
                    f"{len(unexpected)} unexpected {unexpected[:5]}"
                )
        for name, want_shape in (shapes or {}).items():
            if name not in have:
                if exact:
                    raise CheckpointError(f"{where}: tensor {name!r} missing")
                continue
            got = have[name].shape
            if got != tuple(want_shape):
                raise CheckpointError(
                    f"{where}: tensor {name!r} has shape {got} in the checkpoint, the recipe needs "
                    f"{tuple(want_shape)} (a checkpoint of another model: point checkpoint.dir elsewhere "
                    f"or restore the model sizes)"
                )

    def _read_piece(self, piece: Piece, name: str, entry: Entry, a: int, b: int) -> Tensor:
        """Elements [a, b) of one piece (1-D), through safetensors' lazy slicing: whole rows of a
        piece stored with more than one dimension (the gathered form), cut to the range."""
        file = self.folder / piece.file
        if not file.is_file():
            raise FileNotFoundError(f"{file}: missing")
        try:
            with safe_open(str(file), framework="pt") as f:
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                dtype = sl.get_dtype()
                if math.prod(shape) != piece.stop - piece.start or dtype != _SAFETENSORS_DTYPES[entry.dtype]:
                    raise CorruptCheckpointError(
                        f"{file}: tensor {name!r} is {dtype} {list(shape)}, the index records "
                        f"{piece.stop - piece.start} elements of {entry.dtype}"
                    )
                if len(shape) == 0:
                    return f.get_tensor(name).reshape(-1)[a:b]
                if len(shape) == 1:
                    return sl[a:b]
                inner = math.prod(shape[1:])
                if inner == 0:
                    return torch.empty(0, dtype=entry.dtype)
                first, last = a // inner, -(-b // inner)
                rows = sl[first:last].reshape(-1)
                return rows[a - first * inner : b - first * inner]
        except (CorruptCheckpointError, FileNotFoundError):
            raise
        except Exception as e:  # safetensors raises its own SafetensorError for a bad header or length
            raise CorruptCheckpointError(
                f"{file}: truncated or corrupt safetensors file ({type(e).__name__}: {e})"
            ) from e


class LazyTensors(Mapping):
    """A checkpoint kind's canonical tensors as a mapping; ``tensors[name]`` reads that one whole
    tensor (nothing is cached). ``meta``: {name: (shape, dtype)} without reading anything."""

    def __init__(self, checkpoint: Checkpoint, kind: str):
        self.checkpoint, self.kind = checkpoint, kind
        self.meta = {n: (e.shape, e.dtype) for n, e in checkpoint.entries[kind].items()}

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.meta:
            raise KeyError(name)
        return self.checkpoint.read_whole(self.kind, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.meta)

    def __len__(self) -> int:
        return len(self.meta)


def open_checkpoint(path: str | os.PathLike, check_integrity: bool = True) -> Checkpoint:
    """Open a checkpoint folder of either format (reads its index, or the gathered files' headers).

    check_integrity: verify every file against the manifest first (False: the caller did, e.g.
    every rank a share of the files). FileNotFoundError / CorruptCheckpointError name the file."""
    folder = Path(path)
    if check_integrity:
        verify(folder)
    elif not folder.is_dir():
        raise FileNotFoundError(f"checkpoint {folder} does not exist")
    index_file = folder / INDEX
    if not index_file.is_file():  # the gathered form: whole tensors in MODEL and OPTIM
        entries = {kind: _whole_entries(folder / file) for kind, file in (("model", MODEL), ("optim", OPTIM))}
        return Checkpoint(folder, MANIFEST_FORMAT, entries["model"], entries["optim"],
                          {"model": folder / MODEL, "optim": folder / OPTIM})  # fmt: skip
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
        if index.get("format") != SHARDED_FORMAT:
            raise ValueError(f"format {index.get('format')!r}, expected {SHARDED_FORMAT}")
        entries = {
            kind: {
                name: Entry(
                    tuple(int(d) for d in e["shape"]),
                    _DTYPES[e["dtype"]],
                    tuple(Piece(str(p["file"]), int(p["start"]), int(p["stop"])) for p in e["pieces"]),
                )
                for name, e in index[kind].items()
            }
            for kind in KINDS
        }
    except Exception as e:  # any parse error (a RecursionError of nested JSON too) is corruption
        raise CorruptCheckpointError(f"{index_file}: corrupt index ({type(e).__name__}: {e})") from e
    for kind in KINDS:
        for name, entry in entries[kind].items():
            at = 0
            for piece in entry.pieces:
                if piece.start != at or piece.stop <= piece.start or "/" in piece.file:
                    break
                at = piece.stop
            if at != entry.numel:
                raise CorruptCheckpointError(
                    f"{index_file}: the pieces of {kind} tensor {name!r} do not tile its {entry.numel} elements"
                )
    where = {kind: Path(f"{index_file} ({kind})") for kind in KINDS}
    return Checkpoint(folder, SHARDED_FORMAT, entries["model"], entries["optim"], where)


def _whole_entries(file: Path) -> dict[str, Entry]:
    """The gathered form: every tensor of ``file`` as one whole piece (read from its header only)."""
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing")
    reverse = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
    try:
        with safe_open(str(file), framework="pt") as f:
            out = {}
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                out[name] = Entry(shape, reverse[sl.get_dtype()], (Piece(file.name, 0, math.prod(shape)),))
            return out
    except Exception as e:
        raise CorruptCheckpointError(
            f"{file}: truncated or corrupt safetensors file ({type(e).__name__}: {e})"
        ) from e


# --------------------------------------------------------------------------------------------------
# a safetensors file written tensor by tensor


class StreamedSafetensors:
    """Write one safetensors file whose header (names, dtypes, shapes, in order) is known up front,
    then each tensor's bytes as it comes: the writer holds one tensor at a time, never the file's.

        with StreamedSafetensors(path, [(name, dtype, shape), ...], metadata) as w:
            for name, t in ...: w.write(name, t)
    """

    def __init__(self, path: str | os.PathLike, specs: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                 metadata: Mapping[str, str] | None = None):  # fmt: skip
        header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        self.order: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for name, dtype, shape in specs:
            if name in header or name == "__metadata__":
                raise ValueError(f"{path}: tensor {name!r} twice")
            size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}  # fmt: skip
            offset += size
            self.order.append((name, dtype, tuple(shape)))
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.path = Path(path)
        self.file = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self.file.write(struct.pack("<Q", len(text)) + text)
        self.next = 0

    def write(self, name: str, t: Tensor) -> None:
        want = self.order[self.next] if self.next < len(self.order) else None
        if want is None or (name, t.dtype, tuple(t.shape)) != want:
            raise ValueError(
                f"{self.path}: got tensor {name!r} {t.dtype} {tuple(t.shape)}, the header's next is {want}"
            )
        data = t.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            self.file.write(memoryview(data.view(torch.uint8).numpy()))
        self.next += 1

    def close(self) -> None:
        try:
            if self.next != len(self.order):
                raise ValueError(
                    f"{self.path}: {len(self.order) - self.next} tensors of the header not written"
                )
            self.file.flush()
            os.fsync(self.file.fileno())
        finally:
            self.file.close()

    def __enter__(self) -> StreamedSafetensors:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.file.close()


# --------------------------------------------------------------------------------------------------
# RNG states as JSON


def capture_rng() -> dict[str, Any]:
    """Python, numpy (global) and torch CPU RNG states, plus the current CUDA device's when CUDA is
    initialized, as a JSON-able dict (torch states base64-encoded)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Restore what :func:`capture_rng` captured (the CUDA state onto the current device; warns and
    skips it without CUDA). ValueError naming the field for a malformed state."""
    try:
        field = "python"
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
        field = "numpy"
        n = state["numpy"]
        np.random.set_state(
            (n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached"])
        )
        field = "torch"
        torch.set_rng_state(_unb64(state["torch"]))
        field = "cuda"
        if "cuda" in state:
            if torch.cuda.is_available():
                torch.cuda.set_rng_state(_unb64(state["cuda"]))
            else:
                warnings.warn(
                    "RNG state holds a CUDA state but CUDA is not available: not restored", stacklevel=2
                )
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"RNG state field {field!r} is malformed ({type(e).__name__}: {e})") from e


# --------------------------------------------------------------------------------------------------
# helpers


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _drop(folder: Path) -> None:
    """Delete a checkpoint folder: renamed to ``.tmp-drop-*`` first (atomic), so a crash midway
    leaves a temp folder for :func:`clean_temp`, never a half-deleted ``step_*``."""
    doomed = folder.with_name(f".tmp-drop-{folder.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(folder, doomed)
    except OSError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
