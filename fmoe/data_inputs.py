"""Input text files -> pieces of about a shard's size -> bounded texts for the tokenizer.

Inputs: ``.txt`` (one file = one document), ``.jsonl`` (one document per line, its ``"text"``
field), ``.parquet`` (one document per row of its ``text`` column; needs ``pyarrow``). Directories
are searched for those.

Memory bounds of a build, whatever the line lengths of its inputs: a tokenizer call gets at most
TEXT_CHUNK bytes (.txt) or characters (.jsonl) of a document; longer documents are cut at a safe
boundary (after a newline, else before a whitespace, else between UTF-8 characters) into pieces
tokenized one after another (``fmoe.data_build`` batches them and writes tokens as they come).
Files are cut at line ends; a .txt without one in the next TEXT_CHUNK bytes is cut at a whitespace
or between UTF-8 characters, so its shards stay within shard_size + TEXT_CHUNK bytes whatever its
line lengths; a .jsonl line is one document, never cut (and held whole while it is read).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SUFFIXES", "TEXT_CHUNK", "Piece", "expand_inputs", "piece_texts", "file_pieces"]

SUFFIXES = (".txt", ".jsonl", ".parquet")
TEXT_CHUNK = 1 << 16


@dataclass(frozen=True)
class Piece:
    """A part of one input file: bytes [start, stop) of a .txt/.jsonl (cut at line ends) or row
    groups [start, stop) of a .parquet. eos: a .txt piece that ends its file's document."""

    path: str
    start: int
    stop: int
    eos: bool


def expand_inputs(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    if isinstance(inputs, str | os.PathLike):
        inputs = [inputs]
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.suffix in SUFFIXES and f.is_file())
            if not found:
                raise FileNotFoundError(f"input directory {p} holds no {'/'.join(SUFFIXES)} files")
            files.extend(found)
        elif p.is_file():
            if p.suffix not in SUFFIXES:
                raise ValueError(
                    f"input {p}: unsupported file type {p.suffix!r} (expected one of {SUFFIXES})"
                )
            files.append(p)
        else:
            raise FileNotFoundError(f"input {p} does not exist")
    if not files:
        raise ValueError("inputs: no input files given")
    return files


def file_pieces(path: Path, shard_size: int) -> Iterator[tuple[Piece, int]]:
    """Cut one input file into (piece, bytes) of about shard_size bytes."""
    if path.suffix == ".parquet":
        pq = _pyarrow_parquet(path)
        meta = pq.ParquetFile(path).metadata
        start, size = 0, 0
        for g in range(meta.num_row_groups):
            size += meta.row_group(g).total_byte_size
            if size >= shard_size or g == meta.num_row_groups - 1:
                yield Piece(str(path), start, g + 1, False), size
                start, size = g + 1, 0
        return
    total = path.stat().st_size
    start = 0
    with open(path, "rb") as f:
        while start < total:
            stop = start + shard_size
            if stop < total:
                stop = _cut_after(f, path, start, stop, total)
            stop = min(stop, total)
            yield Piece(str(path), start, stop, path.suffix == ".txt" and stop == total), stop - start
            start = stop


def _cut_after(f: Any, path: Path, start: int, stop: int, total: int) -> int:
    """Where a piece that should end near byte ``stop`` of ``path`` (start < stop < total) ends.

    After the first line end at or after stop - 1 (a .jsonl line is one document and is never cut).
    A .txt piece looks for that line end in the next TEXT_CHUNK bytes only; without one it is cut
    at or before stop (see _safe_cut), so a file without newlines still makes pieces of at most
    shard_size bytes. Reads at most TEXT_CHUNK bytes at a time.
    """
    f.seek(stop - 1)
    scanned = 0
    while True:
        block = f.read(TEXT_CHUNK)
        newline = block.find(b"\n")
        if newline >= 0:
            return stop - 1 + scanned + newline + 1
        scanned += len(block)
        if not block or stop - 1 + scanned >= total:
            return total
        if path.suffix == ".txt":
            break
    window = min(stop - start, TEXT_CHUNK)
    f.seek(stop - window)
    return stop - window + _safe_cut(f.read(window))


def _safe_cut(buf: bytes) -> int:
    """An index 0 < i <= len(buf) to cut ``buf`` at without splitting a UTF-8 character: after its
    last newline, else before its last whitespace (the next word keeps its leading space, as a
    tokenizer's pre-tokenizer would group it), else before its last UTF-8 lead byte; len(buf) when
    there is no such place after index 0."""
    newline = buf.rfind(b"\n")
    if newline >= 0:
        return newline + 1
    space = max(buf.rfind(c) for c in (b" ", b"\t", b"\r", b"\f", b"\v"))
    if space > 0:
        return space
    for i in range(len(buf) - 1, max(0, len(buf) - 4), -1):  # a UTF-8 character is at most 4 bytes
        if buf[i] & 0xC0 != 0x80:  # not a continuation byte: a character starts here
            return i
    return len(buf)


def _split_text(text: str) -> Iterator[tuple[str, bool]]:
    """A document's text as (part, ends_doc) of at most TEXT_CHUNK characters, cut before a
    whitespace where there is one (Python strings are never cut inside a character)."""
    start = 0
    while len(text) - start > TEXT_CHUNK:
        stop = start + TEXT_CHUNK
        space = max(text.rfind(c, start + 1, stop) for c in " \n\t\r")
        stop = space if space > start else stop
        yield text[start:stop], False
        start = stop
    yield text[start:], True


def piece_texts(piece: Piece) -> Iterator[tuple[str | bytes, bool]]:
    """The texts of a piece, each with "a document ends after it"."""
    path = Path(piece.path)
    if path.suffix == ".parquet":
        pq = _pyarrow_parquet(path)
        pf = pq.ParquetFile(path)
        if "text" not in pf.schema_arrow.names:
            raise ValueError(f"{path}: no 'text' column (columns: {pf.schema_arrow.names})")
        for g in range(piece.start, piece.stop):
            for i, text in enumerate(pf.read_row_group(g, columns=["text"]).column("text").to_pylist()):
                if not isinstance(text, str):
                    raise ValueError(
                        f"{path}: row group {g} row {i}: 'text' is {type(text).__name__}, not a string"
                    )
                yield text, True
        return
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below (the generator may stop early)
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e})") from e
    with f:
        f.seek(piece.start)
        if path.suffix == ".txt":
            yield from _txt_texts(f, path, piece)
        else:
            yield from _jsonl_texts(f, path, piece)


def _txt_texts(f: Any, path: Path, piece: Piece) -> Iterator[tuple[bytes, bool]]:
    """A .txt piece in parts of at most 2 * TEXT_CHUNK bytes, each cut at a safe boundary."""
    remaining, carry = piece.stop - piece.start, b""
    while remaining > 0:
        block = f.read(min(TEXT_CHUNK, remaining))
        if not block:
            raise ValueError(f"{path}: file shrank while it was read (ends before byte {piece.stop})")
        remaining -= len(block)
        buf = carry + block
        if remaining > 0 and len(buf) >= TEXT_CHUNK:
            cut = _safe_cut(buf)
            text, carry = buf[:cut], buf[cut:]
        elif remaining > 0:
            text, carry = b"", buf
        else:
            text, carry = buf, b""
        if text:
            yield text, piece.eos and remaining == 0


def _jsonl_texts(f: Any, path: Path, piece: Piece) -> Iterator[tuple[str, bool]]:
    """The documents of a .jsonl piece, one line at a time, each split by _split_text."""
    offset = piece.start
    while offset < piece.stop:
        line = f.readline()  # one document: the only thing held whole
        if not line:
            raise ValueError(f"{path}: file shrank while it was read (ends before byte {piece.stop})")
        if line.strip():
            try:
                record = json.loads(line)
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{_line_number(path, offset)}: invalid UTF-8 at byte {e.start} of the line ({e.reason})"
                ) from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{_line_number(path, offset)}: invalid JSON ({e.msg})") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{_line_number(path, offset)}: no string 'text' field")
            yield from _split_text(text)
        offset += len(line)


def _line_number(path: Path, offset: int) -> int:
    """The 1-based line number of byte ``offset`` of ``path`` (read in bounded blocks)."""
    lines = 1
    with open(path, "rb") as f:
        while offset > 0:
            block = f.read(min(offset, TEXT_CHUNK))
            if not block:
                break
            lines += block.count(b"\n")
            offset -= len(block)
    return lines


def _pyarrow_parquet(path: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ValueError(f"input {path}: reading .parquet needs pyarrow (pip install pyarrow)") from e
    return pq
