"""The temp-folder protocol that makes a checkpoint appear whole or not at all.

A folder is first written as ``<dir>/.tmp-step_<N>-<pid>-<id>`` (:func:`temp_folder`), every file
and the folder fsynced, then renamed to ``step_<N>`` (:func:`install`): a ``step_*`` folder is
always complete. A step saved again (after a resume) first moves the old copy to
``.tmp-old-step_<N>-<id>`` (:func:`aside_folder`), put back if the save fails (:func:`undo`). Old
checkpoints are dropped by renaming them to ``.tmp-drop-*`` first (:func:`after_install`), so a
crash while deleting one leaves no half-deleted ``step_*`` folder. :func:`clean_temp` tidies what a
killed writer left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fmoe.checkpoint_format import MANIFEST, CheckpointWriteError
from fmoe.checkpoint_verify import file_sha256, latest, list_checkpoints

__all__ = [
    "after_install", "aside_folder", "clean_temp", "digest", "install", "set_aside", "temp_folder", "undo",
    "write_text",
]  # fmt: skip

_MOVED_ASIDE = re.compile(r"^\.tmp-old-(step_\d{8,})-[0-9a-f]+$")  # aside_folder's names


def temp_folder(final: Path) -> Path:
    """The temp folder ``final`` (``<dir>/step_<N>``) is written in before :func:`install`; this
    process's id and a random tag keep two writers apart."""
    return final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def aside_folder(final: Path) -> Path:
    """Where :func:`install` moves an existing ``final`` while the new one takes its place."""
    return final.parent / f".tmp-old-{final.name}-{uuid.uuid4().hex[:8]}"


def write_text(path: Path, text: str) -> None:
    """Write a UTF-8 text file and fsync it."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def digest(path: Path) -> dict[str, Any]:
    """A file's manifest record: {"bytes": size, "sha256": hex}, from the bytes on disk."""
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def install(tmp: Path, final: Path, old: Path, format: int, files: Mapping[str, Any]) -> None:
    """Write the manifest, fsync the temp folder and rename it to ``final`` (an existing ``final``,
    a step saved again after a resume, is first moved to ``old``)."""
    write_text(tmp / MANIFEST, json.dumps({"format": format, "files": dict(files)}, indent=1))
    _fsync_dir(tmp)
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)


def undo(tmp: Path, final: Path, old: Path, e: BaseException) -> None:
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


def after_install(root: Path, old: Path, keep: int) -> None:
    """Once ``step_<N>`` is in place: make the rename durable, remove the copy it replaced, and
    drop all but the newest ``keep`` checkpoints."""
    _fsync_dir(root)  # make the rename durable
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
    for stale in list_checkpoints(root)[:-keep]:
        _drop(stale)


def set_aside(folder: Path) -> Path:
    """Rename a corrupt checkpoint ``<dir>/step_<N>`` to ``<dir>/corrupt-step_<N>`` (``-2``, ``-3``,
    ... when taken): no longer a checkpoint, so neither resumed from nor counted by the keep-N
    rotation (which would otherwise drop an intact older one for it), and its bytes stay for the
    user to inspect or delete. Returns the new path."""
    target = folder.with_name(f"corrupt-{folder.name}")
    n = 1
    while target.exists():
        n += 1
        target = folder.with_name(f"corrupt-{folder.name}-{n}")
    os.rename(folder, target)
    _fsync_dir(folder.parent)
    return target


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


def _drop(folder: Path) -> None:
    """Delete a checkpoint folder: renamed to ``.tmp-drop-*`` first (atomic), so a crash midway
    leaves a temp folder for :func:`clean_temp`, never a half-deleted ``step_*``."""
    doomed = folder.with_name(f".tmp-drop-{folder.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(folder, doomed)
    except OSError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    """fsync a folder: the renames and new files in it become durable (tests wrap it to crash here)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
