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
``step_*`` folder. A corrupt checkpoint a run skips is renamed ``corrupt-step_<N>`` (:func:`set_aside`):
kept for the user, no longer resumed from or counted by the rotation. Non-finite tensors are never written (every rank checks its pieces, all agree
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
(a RecursionError of deeply nested brackets included), is corrupt. Nothing here knows the parallel
layout: callers say which range of which canonical tensor they hold (:class:`Shard`), so a run can
resume on another layout.

This module is the public home of the checkpoint API: import every name from here. It defines
nothing; it re-exports the names of the modules that hold each concern. Each of them imports only
modules listed above it (no cycles):

    checkpoint_format   file names, formats, errors, dtypes, rank_file, StreamedSafetensors
    checkpoint_lock     lock_folder, FolderLock: one writer per folder
    checkpoint_verify   list_checkpoints, latest, verify, manifest_files, newest_intact, file_sha256
    checkpoint_read     open_checkpoint, Checkpoint, Entry, Piece, LazyTensors, load
    checkpoint_plan     Shard, whole; the ranks' agreement on who writes which range
    checkpoint_install  the temp-folder protocol (atomic rename, undo, keep-N), clean_temp
    checkpoint_write    save, save_sharded, begin_save, PendingSave
    checkpoint_rng      capture_rng, restore_rng

A test that replaces an internal function patches the module that defines and calls it
(``checkpoint_write._write_tensors``, ``checkpoint_install._fsync_dir``): replacing a name here
changes only what callers of ``fmoe.checkpoint.<name>`` see.
"""

from fmoe.checkpoint_format import (
    INDEX,
    KINDS,
    LOCK,
    MANIFEST,
    MANIFEST_FORMAT,
    MODEL,
    OPTIM,
    SHARDED_FORMAT,
    TRAINER,
    CheckpointError,
    CheckpointInUseError,
    CheckpointWriteError,
    CorruptCheckpointError,
    StreamedSafetensors,
    rank_file,
)
from fmoe.checkpoint_install import clean_temp, set_aside
from fmoe.checkpoint_lock import FolderLock, lock_folder
from fmoe.checkpoint_plan import Shard, whole
from fmoe.checkpoint_read import Checkpoint, Entry, LazyTensors, Piece, load, open_checkpoint
from fmoe.checkpoint_rng import capture_rng, restore_rng
from fmoe.checkpoint_verify import (
    file_sha256,
    latest,
    list_checkpoints,
    manifest_files,
    newest_intact,
    verify,
)
from fmoe.checkpoint_write import PendingSave, begin_save, save, save_sharded

__all__ = [
    "INDEX", "KINDS", "LOCK", "MANIFEST", "MANIFEST_FORMAT", "MODEL", "OPTIM", "SHARDED_FORMAT", "TRAINER",
    "Checkpoint", "CheckpointError", "CheckpointInUseError", "CheckpointWriteError", "CorruptCheckpointError",
    "Entry", "FolderLock", "LazyTensors", "PendingSave", "Piece", "Shard", "StreamedSafetensors", "begin_save",
    "capture_rng", "clean_temp", "file_sha256", "latest", "list_checkpoints", "load", "lock_folder",
    "manifest_files", "newest_intact", "open_checkpoint", "rank_file", "restore_rng", "save", "save_sharded",
    "set_aside", "verify", "whole",
]  # fmt: skip
