"""Which checkpoints a folder holds, and whether they are intact: :func:`list_checkpoints`,
:func:`latest`, :func:`verify` against the manifest's sizes and SHA-256, :func:`newest_intact`.

The manifest (``manifest.json``, written last) records each file's bytes and SHA-256: a flipped bit
or a truncated file is a :class:`CorruptCheckpointError` naming the file. A sharded folder without a
manifest, and any file of JSON that does not parse (a RecursionError of deeply nested brackets
included), is corrupt.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection
from pathlib import Path

from fmoe.checkpoint_format import (
    INDEX,
    MANIFEST,
    MANIFEST_FORMAT,
    MODEL,
    OPTIM,
    STEP_DIR,
    TRAINER,
    CorruptCheckpointError,
)

__all__ = ["file_sha256", "latest", "list_checkpoints", "manifest_files", "newest_intact", "verify"]


def list_checkpoints(dir: str | os.PathLike, *, damaged: bool = False) -> list[Path]:
    """Complete checkpoint folders under ``dir``, oldest step first; temp folders are ignored.

    damaged: also the ``step_<N>`` folders that hold some of a checkpoint's files but not all three
    (one deleted or lost since the folder was installed whole): a resume lists them, rejects them as
    corrupt and sets them aside, so a run neither skips one silently nor overwrites what is left."""
    root = Path(dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if not (m and p.is_dir()):
            continue
        present = [(p / f).is_file() for f in (MODEL, OPTIM, TRAINER)]
        if all(present) or (damaged and (any(present) or (p / MANIFEST).is_file())):
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


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read through one small reused buffer (``hashlib.file_digest``):
    hashing a checkpoint file costs no memory to speak of, whatever its size."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
