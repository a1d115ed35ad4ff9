"""The on-disk layout of a checkpoint folder (described in :mod:`fmoe.checkpoint`): its file names and
formats, the errors every checkpoint module raises, the dtypes a file may hold, and a safetensors
file written tensor by tensor (:class:`StreamedSafetensors`, which ``fmoe.hf`` writes exports with).

The bottom of the checkpoint modules: it imports none of them.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "DTYPES", "INDEX", "KINDS", "LOCK", "MANIFEST", "MANIFEST_FORMAT", "MODEL", "OPTIM", "SAFETENSORS_DTYPES",
    "SHARDED_FORMAT", "STEP_DIR", "TRAINER", "CheckpointError", "CheckpointInUseError", "CheckpointWriteError",
    "CorruptCheckpointError", "StreamedSafetensors", "dtype_name", "rank_file",
]  # fmt: skip

MODEL, OPTIM, TRAINER = "model.safetensors", "optim.safetensors", "trainer.json"
MANIFEST, INDEX = "manifest.json", "index.json"
LOCK = "fmoe.lock"  # lock_folder: one writer per checkpoint folder
MANIFEST_FORMAT = 1  # gathered: whole tensors in MODEL and OPTIM
SHARDED_FORMAT = 2  # sharded: pieces in per-rank files, described by INDEX
KINDS = ("model", "optim")
STEP_DIR = re.compile(r"^step_(\d{8,})$")  # a complete checkpoint's folder: step_<N:08d>


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed; its partial folder was removed, earlier checkpoints are intact."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or that does not fit the model it is loaded for; the message
    names the file and the tensor (bad input: the CLI reports it as one line)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's file does not match its recorded checksum, or cannot be parsed; the message
    names the file. An older checkpoint may still be intact (:func:`fmoe.checkpoint.newest_intact`)."""


class CheckpointInUseError(CheckpointError):
    """Another live process holds a checkpoint folder's lock (:func:`fmoe.checkpoint.lock_folder`); the
    message names its host and pid."""


def rank_file(kind: str, rank: int) -> str:
    """The file ``rank`` writes its pieces of ``kind`` ("model" or "optim") into: rank 0's are the
    gathered form's names, so a checkpoint written by one process has the familiar two files."""
    base = {"model": MODEL, "optim": OPTIM}[kind]
    return base if rank == 0 else base.replace(".safetensors", f"-rank{rank:05d}.safetensors")


# the dtypes a checkpoint stores: the index's names (torch's, without "torch.") and safetensors' codes
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
              torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
}  # fmt: skip
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    """The index's name of ``dtype`` ("float32", ...); ValueError for a dtype a checkpoint cannot hold."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"checkpoint: dtype {dtype} cannot be stored")
    return name


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
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
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
