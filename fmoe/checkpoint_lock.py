"""One writer per checkpoint folder: :func:`lock_folder` (an OS ``flock`` on ``<dir>/fmoe.lock`` plus
its owner's host and pid in the file, for messages). A run holds it from before ``clean_temp`` to
its last save, so no process tidies or replaces what another one is writing.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fmoe.checkpoint_format import LOCK, CheckpointInUseError

__all__ = ["FolderLock", "lock_folder"]


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
