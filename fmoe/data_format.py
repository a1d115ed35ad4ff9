"""The on-disk format of a built token dataset, and the file writes every data module uses.

A built dataset is a directory:

    build.json          the build's plan (inputs, tokenizer, shard size), written first; a resumed
                        build checks that it is resuming the same build
    shard_00000.bin ... token ids, little-endian ``uint16`` (vocab_size <= 65536) or ``uint32``; each
                        document is followed by the EOS id, so the concatenated shards are one stream
                        ``doc EOS doc EOS ...``. Each shard is written to a temporary file and renamed,
                        so a shard file that exists is complete and a killed build redoes only the rest
    index.json          written last (its presence means the build is complete): format, dtype,
                        vocab_size, eos_id, tokenizer identity, shards with token counts, total tokens

``fmoe.data_build`` writes it, ``fmoe.data.TokenDataset`` reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["FORMAT", "VERSION", "atomic_file", "read_json", "shard_name", "write_atomic"]

FORMAT, VERSION = "fmoe-tokens", 1


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.bin"


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable or corrupt JSON ({e})") from e


@contextlib.contextmanager
def atomic_file(path: Path, tmp_prefix: str = ".") -> Iterator[Any]:
    """A binary file to write ``path`` through: a temporary file in the same directory, fsynced and
    renamed onto path when the block ends without an exception (removed when it raises)."""
    tmp = path.with_name(f"{tmp_prefix}{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_atomic(path: Path, data: bytes, tmp_prefix: str = ".") -> None:
    """Write data to path via a temporary file in the same directory, fsync, rename."""
    with atomic_file(path, tmp_prefix) as f:
        f.write(data)
