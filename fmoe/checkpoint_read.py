"""Reading a checkpoint folder of either format: :func:`open_checkpoint` gives a :class:`Checkpoint`
that reads any range of any canonical tensor (:meth:`Checkpoint.read`, through safetensors' lazy
``get_slice``: only the pieces that overlap the range), whatever layout wrote it; :func:`load`
reads a whole checkpoint into one process.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from fmoe.checkpoint_format import (
    DTYPES,
    INDEX,
    KINDS,
    MANIFEST_FORMAT,
    MODEL,
    OPTIM,
    SAFETENSORS_DTYPES,
    SHARDED_FORMAT,
    TRAINER,
    CheckpointError,
    CorruptCheckpointError,
)
from fmoe.checkpoint_verify import verify

__all__ = ["Checkpoint", "Entry", "LazyTensors", "Piece", "load", "open_checkpoint"]


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
                if math.prod(shape) != piece.stop - piece.start or dtype != SAFETENSORS_DTYPES[entry.dtype]:
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
                    DTYPES[e["dtype"]],
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
    reverse = {v: k for k, v in SAFETENSORS_DTYPES.items()}
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
