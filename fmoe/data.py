"""Token data: build packed token files from text, read them through ``numpy.memmap``, batch them.

A built dataset is a directory:

    build.json          the build's plan (inputs, tokenizer, shard size), written first; a resumed
                        build checks that it is resuming the same build
    shard_00000.bin ... token ids, little-endian ``uint16`` (vocab_size <= 65536) or ``uint32``; each
                        document is followed by the EOS id, so the concatenated shards are one stream
                        ``doc EOS doc EOS ...``. Each shard is written to a temporary file and renamed,
                        so a shard file that exists is complete and a killed build redoes only the rest
    index.json          written last (its presence means the build is complete): format, dtype,
                        vocab_size, eos_id, tokenizer identity, shards with token counts, total tokens

Inputs: ``.txt`` (one file = one document), ``.jsonl`` (one document per line, its ``"text"``
field), ``.parquet`` (one document per row of its ``text`` column; needs ``pyarrow``). Directories
are searched for those. Tokenizers: ``"bytes"`` (the UTF-8 bytes: ids 0..255, EOS = 256, so
vocab_size = 257; needs nothing) or the path of a Hugging Face ``tokenizer.json``.

Training reads fixed windows of ``seq + 1`` tokens (window i = stream[i*(seq+1) : (i+1)*(seq+1)],
tokens = window[:-1], labels = window[1:]), in an order shuffled per epoch by a keyed Feistel
permutation of window indices: deterministic from (seed, epoch), the same on every machine and
numpy version, and computable for any position without materialising the permutation, so a loader
resumes at any sample ``cursor`` instantly and exactly.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import contextlib
import hashlib
import json
import multiprocessing
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:  # torch is imported lazily: tokenizer worker processes never need it
    import torch

FORMAT, VERSION = "fmoe-tokens", 1
BYTES_VOCAB, BYTES_EOS = 257, 256
SUFFIXES = (".txt", ".jsonl", ".parquet")
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")
# Memory bounds of a build, whatever the line lengths of its inputs. A tokenizer call gets at most
# _TEXT_CHUNK bytes (.txt) or characters (.jsonl) of a document: longer documents are cut at a safe
# boundary (after a newline, else before a whitespace, else between UTF-8 characters) into pieces
# tokenized one after another. A call to the tokenizer's batch encoder gets at most _BATCH_CHARS of
# text, and a shard's tokens go to its file as they come, so a worker holds O(_BATCH_CHARS) text and
# tokens (plus, for .jsonl, the one JSON line it is reading) - not O(shard) nor O(document).
_TEXT_CHUNK = 1 << 16
_BATCH_CHARS = 1 << 18


# --------------------------------------------------------------------------------------------------
# tokenizers


@dataclass(frozen=True)
class TokenizerSpec:
    """What a dataset was tokenized with; recorded in index.json as its tokenizer identity.

    kind: "bytes" or "hf"; path and sha256 (of the tokenizer.json file) for "hf".
    """

    kind: str
    vocab_size: int
    eos_id: int
    eos_token: str | None = None
    path: str | None = None
    sha256: str | None = None


def load_tokenizer(tokenizer: str | os.PathLike = "bytes", eos_token: str | None = None) -> TokenizerSpec:
    """Resolve ``"bytes"`` or a tokenizer.json path to a :class:`TokenizerSpec`.

    For a tokenizer.json the EOS id is that of ``eos_token``, or of the first of EOS_CANDIDATES the
    tokenizer knows; ValueError naming the file when there is none.
    """
    if str(tokenizer) == "bytes":
        if eos_token is not None:
            raise ValueError("eos_token: the bytes tokenizer has a fixed EOS id (256); do not pass eos_token")
        return TokenizerSpec("bytes", BYTES_VOCAB, BYTES_EOS)
    from tokenizers import Tokenizer

    path = Path(tokenizer)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer: {path} does not exist (give a tokenizer.json or 'bytes')")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise ValueError(f"tokenizer: {path} is not a readable Hugging Face tokenizer.json ({e})") from e
    candidates = (eos_token,) if eos_token is not None else EOS_CANDIDATES
    for cand in candidates:
        eos_id = tok.token_to_id(cand)
        if eos_id is not None:
            break
    else:
        raise ValueError(f"tokenizer: {path} has no end-of-document token {list(candidates)}; pass eos_token")
    return TokenizerSpec(
        "hf",
        tok.get_vocab_size(with_added_tokens=True),
        eos_id,
        cand,
        str(path.resolve()),
        hashlib.sha256(path.read_bytes()).hexdigest(),
    )


def train_tokenizer(
    text_files: Sequence[str | os.PathLike],
    vocab_size: int,
    out_path: str | os.PathLike,
    eos_token: str = "<|endoftext|>",
) -> Path:
    """Train a byte-level BPE tokenizer (GPT-2 style pre-tokenizer, all 256 bytes in its alphabet, so
    any text encodes) on .txt / .jsonl / .parquet files; save it as a tokenizer.json at out_path.

    vocab_size counts the 256 byte tokens and ``eos_token``; it must be >= 257.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not (isinstance(vocab_size, int) and vocab_size >= 257):
        raise ValueError(f"vocab_size must be an int >= 257 (256 bytes + EOS), got {vocab_size!r}")
    files = _expand_inputs(text_files)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts() -> Iterator[str]:
        for f in files:
            for piece, _ in _pieces(f, 1 << 62):
                for text, _ in _piece_texts(piece):
                    yield text if isinstance(text, str) else text.decode("utf-8", errors="replace")

    tok.train_from_iterator(texts(), trainer=trainer)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, out)
    return out


# --------------------------------------------------------------------------------------------------
# build


@dataclass(frozen=True)
class _Piece:
    """A part of one input file: bytes [start, stop) of a .txt/.jsonl (cut at line ends) or row
    groups [start, stop) of a .parquet. eos: a .txt piece that ends its file's document."""

    path: str
    start: int
    stop: int
    eos: bool


def build(
    inputs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    tokenizer: str | os.PathLike = "bytes",
    workers: int = 1,
    shard_size: int = 64 << 20,
    *,
    eos_token: str | None = None,
    on_shard: Callable[[int, int], None] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Tokenize ``inputs`` into packed shards in ``out_dir`` with ``workers`` processes; return the index.

    shard_size: bytes of input text per shard (small files are packed together). Files are cut at
    line ends; a .txt without one in the next _TEXT_CHUNK bytes is cut at a whitespace or between
    UTF-8 characters, so its shards stay within shard_size + _TEXT_CHUNK bytes whatever its line
    lengths; a .jsonl line is one document and is never cut. Memory is bounded likewise (see
    _TEXT_CHUNK), not by a shard's or a line's size (a .jsonl line is held whole while it is read). Resumable: run it again after a crash and finished shards are kept as they are
    (their files are not rewritten); a directory holding another build is refused. on_shard(index,
    tokens) is called in this process after each shard is committed (progress, tests).
    With workers > 1 the shards are tokenized in spawned processes: a script calling this must
    do so under ``if __name__ == "__main__":``.
    """
    if not (isinstance(workers, int) and workers >= 1):
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    if not (isinstance(shard_size, int) and shard_size >= 1):
        raise ValueError(f"shard_size must be an int >= 1 (bytes), got {shard_size!r}")
    files = _expand_inputs(inputs)
    spec = load_tokenizer(tokenizer, eos_token)
    dtype = "uint16" if spec.vocab_size <= 1 << 16 else "uint32"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    plan = {
        "format": FORMAT,
        "version": VERSION,
        "inputs": [
            {"path": str(f.resolve()), "bytes": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns}
            for f in files
        ],
        "tokenizer": asdict(spec),
        "shard_size": shard_size,
        "dtype": dtype,
    }
    build_json = out / "build.json"
    if build_json.exists():
        old = _read_json(build_json)
        if not isinstance(old, dict):
            raise ValueError(
                f"{build_json}: corrupt build plan (not a JSON object); delete {out} and rebuild"
            )
        diff = [k for k in plan if old.get(k) != plan[k]]
        if diff:
            raise ValueError(
                f"{out} holds another build (build.json differs in {diff}); use another --out or delete it"
            )
    else:
        _write_atomic(build_json, json.dumps(plan, indent=1).encode())
    if (out / "index.json").exists():
        return _read_json(out / "index.json")

    for stale in out.glob(".shard_*.tmp*"):  # left by a killed build
        stale.unlink()
    shards = _plan(files, shard_size)
    jobs = [
        (i, pieces, str(out), dtype, spec)
        for i, pieces in enumerate(shards)
        if not (out / _shard_name(i)).exists()
    ]
    done = len(shards) - len(jobs)

    def finished(index: int, tokens: int) -> None:
        nonlocal done
        done += 1
        if progress:
            print(f"shard {index} done ({tokens:,} tokens), {done}/{len(shards)}", file=sys.stderr)
        if on_shard is not None:
            on_shard(index, tokens)

    if workers == 1 or len(jobs) <= 1:
        for job in jobs:
            finished(*_build_shard(job))
    else:
        # spawn, not fork: the parent may hold torch / tokenizers thread pools that fork would break
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(min(workers, len(jobs)), initializer=_init_worker) as pool:
            for index, tokens in pool.imap_unordered(_build_shard, jobs):
                finished(index, tokens)  # an exception here leaves the pool via terminate()

    itemsize = np.dtype(dtype).itemsize
    entries = [
        {"file": _shard_name(i), "tokens": (out / _shard_name(i)).stat().st_size // itemsize}
        for i in range(len(shards))
    ]
    index = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype,
        "vocab_size": spec.vocab_size,
        "eos_id": spec.eos_id,
        "tokenizer": asdict(spec),
        "total_tokens": sum(e["tokens"] for e in entries),
        "shards": entries,
        "inputs": plan["inputs"],
    }
    _write_atomic(out / "index.json", json.dumps(index, indent=1).encode())
    return index


def _init_worker() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the pool is the parallelism


_TOKENIZERS: dict[str, Any] = {}  # per process: tokenizer.json path -> loaded tokenizer


def _build_shard(job: tuple[int, list[_Piece], str, str, TokenizerSpec]) -> tuple[int, int]:
    """Tokenize one shard's pieces into ``shard_<i>.bin`` (temp file written as tokens come, fsync,
    rename). Memory: O(_BATCH_CHARS), whatever the shard size (see _TEXT_CHUNK)."""
    index, pieces, out_dir, dtype, spec = job
    if spec.kind == "hf" and spec.path not in _TOKENIZERS:
        from tokenizers import Tokenizer

        _TOKENIZERS[spec.path] = Tokenizer.from_file(spec.path)
    stored = np.dtype(dtype).newbyteorder("<")
    eos = np.array([spec.eos_id], dtype=stored)
    batch: list[tuple[str | bytes, bool]] = []
    batch_chars = 0
    n_tokens = 0

    def flush(out: Any) -> None:
        nonlocal batch_chars, n_tokens
        if spec.kind == "bytes":
            encoded = [
                np.frombuffer(t if isinstance(t, bytes) else t.encode("utf-8"), np.uint8) for t, _ in batch
            ]
        else:
            texts = [t if isinstance(t, str) else t.decode("utf-8", errors="replace") for t, _ in batch]
            encoded = [
                np.asarray(e.ids)
                for e in _TOKENIZERS[spec.path].encode_batch(texts, add_special_tokens=False)
            ]
        for ids, (_, ends_doc) in zip(encoded, batch):
            if ids.size and int(ids.max()) >= spec.vocab_size:
                raise ValueError(
                    f"tokenizer {spec.path} produced id {int(ids.max())} >= its vocab_size {spec.vocab_size}"
                )
            out.write(ids.astype(stored).tobytes())
            n_tokens += int(ids.size)
            if ends_doc:
                out.write(eos.tobytes())
                n_tokens += 1
        batch.clear()
        batch_chars = 0

    with _atomic_file(Path(out_dir) / _shard_name(index)) as out:
        for piece in pieces:
            for item in _piece_texts(piece):
                batch.append(item)
                batch_chars += len(item[0])
                if len(batch) >= 512 or batch_chars >= _BATCH_CHARS:
                    flush(out)
        flush(out)
    return index, n_tokens


def _shard_name(index: int) -> str:
    return f"shard_{index:05d}.bin"


def _expand_inputs(inputs: Sequence[str | os.PathLike]) -> list[Path]:
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


def _pieces(path: Path, shard_size: int) -> Iterator[tuple[_Piece, int]]:
    """Cut one input file into (piece, bytes) of about shard_size bytes."""
    if path.suffix == ".parquet":
        pq = _pyarrow_parquet(path)
        meta = pq.ParquetFile(path).metadata
        start, size = 0, 0
        for g in range(meta.num_row_groups):
            size += meta.row_group(g).total_byte_size
            if size >= shard_size or g == meta.num_row_groups - 1:
                yield _Piece(str(path), start, g + 1, False), size
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
            yield _Piece(str(path), start, stop, path.suffix == ".txt" and stop == total), stop - start
            start = stop


def _cut_after(f: Any, path: Path, start: int, stop: int, total: int) -> int:
    """Where a piece that should end near byte ``stop`` of ``path`` (start < stop < total) ends.

    After the first line end at or after stop - 1 (a .jsonl line is one document and is never cut).
    A .txt piece looks for that line end in the next _TEXT_CHUNK bytes only; without one it is cut
    at or before stop (see _safe_cut), so a file without newlines still makes pieces of at most
    shard_size bytes. Reads at most _TEXT_CHUNK bytes at a time.
    """
    f.seek(stop - 1)
    scanned = 0
    while True:
        block = f.read(_TEXT_CHUNK)
        newline = block.find(b"\n")
        if newline >= 0:
            return stop - 1 + scanned + newline + 1
        scanned += len(block)
        if not block or stop - 1 + scanned >= total:
            return total
        if path.suffix == ".txt":
            break
    window = min(stop - start, _TEXT_CHUNK)
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
    """A document's text as (part, ends_doc) of at most _TEXT_CHUNK characters, cut before a
    whitespace where there is one (Python strings are never cut inside a character)."""
    start = 0
    while len(text) - start > _TEXT_CHUNK:
        stop = start + _TEXT_CHUNK
        space = max(text.rfind(c, start + 1, stop) for c in " \n\t\r")
        stop = space if space > start else stop
        yield text[start:stop], False
        start = stop
    yield text[start:], True


def _plan(files: list[Path], shard_size: int) -> list[list[_Piece]]:
    """Pack the pieces of all files, in order, into shards of at most ~shard_size input bytes."""
    shards: list[list[_Piece]] = []
    current: list[_Piece] = []
    size = 0
    for f in files:
        for piece, nbytes in _pieces(f, shard_size):
            if current and size + nbytes > shard_size:
                shards.append(current)
                current, size = [], 0
            current.append(piece)
            size += nbytes
    if current:
        shards.append(current)
    return shards


def _piece_texts(piece: _Piece) -> Iterator[tuple[str | bytes, bool]]:
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


def _txt_texts(f: Any, path: Path, piece: _Piece) -> Iterator[tuple[bytes, bool]]:
    """A .txt piece in parts of at most 2 * _TEXT_CHUNK bytes, each cut at a safe boundary."""
    remaining, carry = piece.stop - piece.start, b""
    while remaining > 0:
        block = f.read(min(_TEXT_CHUNK, remaining))
        if not block:
            raise ValueError(f"{path}: file shrank while it was read (ends before byte {piece.stop})")
        remaining -= len(block)
        buf = carry + block
        if remaining > 0 and len(buf) >= _TEXT_CHUNK:
            cut = _safe_cut(buf)
            text, carry = buf[:cut], buf[cut:]
        elif remaining > 0:
            text, carry = b"", buf
        else:
            text, carry = buf, b""
        if text:
            yield text, piece.eos and remaining == 0


def _jsonl_texts(f: Any, path: Path, piece: _Piece) -> Iterator[tuple[str, bool]]:
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
            block = f.read(min(offset, _TEXT_CHUNK))
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


# --------------------------------------------------------------------------------------------------
# reading


class TokenDataset:
    """A built dataset, memory-mapped: ``len(ds)`` tokens, ``ds.read(start, n)`` -> [n] numpy ids.

    Attributes: path, dtype (numpy), vocab_size, eos_id, tokenizer (dict), n_tokens.
    Raises FileNotFoundError / ValueError naming the file for a missing or corrupt index or shard.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        index_path = self.path / "index.json"
        if not index_path.is_file():
            hint = (
                " (build.json is there: the build did not finish; run it again)"
                if (self.path / "build.json").exists()
                else ""
            )
            raise FileNotFoundError(f"{index_path}: no dataset index; build one with `fmoe data build`{hint}")
        index = _read_json(index_path)
        try:
            if index["format"] != FORMAT:
                raise ValueError(f"{index_path}: format {index['format']!r} is not {FORMAT!r}")
            self.dtype = np.dtype(index["dtype"]).newbyteorder("<")
            self.vocab_size, self.eos_id = int(index["vocab_size"]), int(index["eos_id"])
            self.tokenizer: dict[str, Any] = index["tokenizer"]
            shards = [(self.path / s["file"], int(s["tokens"])) for s in index["shards"]]
        except (KeyError, TypeError) as e:
            raise ValueError(f"{index_path}: missing or malformed field {e}") from e
        self._index_path = index_path
        self._maps: list[np.memmap] = []
        self._files: list[tuple[Path, int]] = []  # (shard file, its size in bytes) beside each map
        self._starts: list[int] = []
        total = 0
        for file, tokens in shards:
            if not file.is_file():
                raise FileNotFoundError(f"{file}: shard listed in {index_path} is missing")
            want = tokens * self.dtype.itemsize
            self._check_size(file, want)
            if tokens:
                self._maps.append(np.memmap(file, dtype=self.dtype, mode="r", shape=(tokens,)))
                self._files.append((file, want))
                self._starts.append(total)
                total += tokens
        self.n_tokens = total

    def _check_size(self, file: Path, want: int) -> None:
        """Refuse a shard whose size is not the index's: reading a memory map past the end of a file
        truncated under it would kill the process with SIGBUS instead of raising."""
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise FileNotFoundError(f"{file}: shard listed in {self._index_path} is missing") from None
        if size != want:
            raise ValueError(
                f"{file}: {size} bytes, but {self._index_path} says {want // self.dtype.itemsize} tokens = "
                f"{want} bytes (truncated or corrupt)"
            )

    def __len__(self) -> int:
        return self.n_tokens

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the concatenated stream, as a [length] array of self.dtype."""
        if start < 0 or length < 0 or start + length > self.n_tokens:
            raise IndexError(
                f"read({start}, {length}) out of range for {self.n_tokens} tokens in {self.path}"
            )
        parts = []
        i = bisect.bisect_right(self._starts, start) - 1
        while length > 0:
            offset = start - self._starts[i]
            take = min(length, len(self._maps[i]) - offset)
            file, size = self._files[i]
            self._check_size(file, size)  # the file may have been truncated since it was opened
            part = np.array(self._maps[i][offset : offset + take])
            if take and int(part.max()) >= self.vocab_size:
                bad = int(np.argmax(part >= self.vocab_size))
                raise ValueError(
                    f"{file}: token {offset + bad} is id {int(part[bad])}, outside the vocab_size "
                    f"{self.vocab_size} of {self._index_path} (corrupt shard)"
                )
            parts.append(part)
            start, length, i = start + take, length - take, i + 1
        return np.concatenate(parts) if len(parts) != 1 else parts[0]


def num_windows(ds: TokenDataset, seq: int) -> int:
    """Number of training windows of seq + 1 tokens in the dataset."""
    return ds.n_tokens // (seq + 1)


def check_size(ds: TokenDataset, *, steps: int, global_batch: int, seq: int) -> None:
    """Refuse (ValueError with the numbers) a recipe that needs more windows than the dataset has,
    i.e. steps * global_batch * (seq + 1) tokens > the dataset's tokens in whole windows."""
    have, need = num_windows(ds, seq), steps * global_batch
    if need > have:
        raise ValueError(
            f"dataset {ds.path} is too small for the recipe: it has {ds.n_tokens:,} tokens = {have:,} windows "
            f"of seq+1 = {seq + 1} tokens, but steps {steps:,} x global_batch {global_batch:,} x (seq+1) "
            f"{seq + 1} needs {need * (seq + 1):,} tokens ({need:,} windows); build more data or lower steps"
        )


def check_vocab(ds: TokenDataset, model_vocab_size: int) -> None:
    """Raise a one-line ValueError if the dataset's token ids may not fit the model's embedding."""
    if ds.vocab_size > model_vocab_size:
        tok = ds.tokenizer.get("path") or ds.tokenizer.get("kind")
        raise ValueError(
            f"tokenizer/vocab mismatch: dataset {ds.path} has vocab_size {ds.vocab_size} (tokenizer {tok}), "
            f"but the model's vocab_size is {model_vocab_size}"
        )


class Batch(NamedTuple):
    """One optimizer step's data on one data-parallel rank.

    tokens: [n_micro, micro_batch, seq] int64; labels: [n_micro, micro_batch, seq] int64, the next
    token of each position. cursor: samples consumed by all ranks after this step; pass it back as
    ``batches(..., cursor=...)`` to resume exactly after this step (store it in the checkpoint).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    cursor: int


def batches(
    ds: TokenDataset,
    *,
    seq: int,
    global_batch: int,
    micro_batch: int,
    seed: int,
    cursor: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> Iterator[Batch]:
    """Endless per-step batches: each step takes the next ``global_batch`` samples of the shuffled
    window sequence; rank r gets the r-th contiguous slice of global_batch / dp_size of them, cut in
    micro-batches of ``micro_batch``. Sample k is window perm_e[k mod W] of epoch e = k // W (W windows).
    The stream depends only on (dataset, seq, seed, cursor): not on dp_size or micro_batch.
    """
    import torch

    for field, value, lo in (("seq", seq, 1), ("global_batch", global_batch, 1), ("micro_batch", micro_batch, 1),
                             ("dp_size", dp_size, 1), ("seed", seed, 0), ("cursor", cursor, 0), ("dp_rank", dp_rank, 0)):  # fmt: skip
        if not (isinstance(value, int) and value >= lo):
            raise ValueError(f"batches: {field} must be an int >= {lo}, got {value!r}")
    if dp_rank >= dp_size:
        raise ValueError(f"batches: dp_rank {dp_rank} must be < dp_size {dp_size}")
    if global_batch % (dp_size * micro_batch):
        raise ValueError(
            f"batches: global_batch {global_batch} must be a multiple of dp_size {dp_size} x micro_batch {micro_batch}"
        )
    n_windows = num_windows(ds, seq)
    if n_windows == 0:
        raise ValueError(
            f"dataset {ds.path} has {ds.n_tokens} tokens, fewer than one window of seq+1 = {seq + 1}"
        )
    per_rank = global_batch // dp_size
    while True:
        first = cursor + dp_rank * per_rank
        windows = window_order(np.arange(first, first + per_rank, dtype=np.int64), n_windows, seed)
        rows = np.stack([ds.read(int(w) * (seq + 1), seq + 1) for w in windows]).astype(np.int64)
        rows = torch.from_numpy(rows).view(per_rank // micro_batch, micro_batch, seq + 1)
        cursor += global_batch
        yield Batch(rows[..., :-1].contiguous(), rows[..., 1:].contiguous(), cursor)


def window_order(samples: np.ndarray, n_windows: int, seed: int) -> np.ndarray:
    """Window index of each global sample index: a fresh permutation of [0, n_windows) per epoch."""
    samples = np.asarray(samples, dtype=np.int64)
    epochs, pos = samples // n_windows, samples % n_windows
    out = np.empty_like(samples)
    for e in np.unique(epochs):
        sel = epochs == e
        out[sel] = _permute(pos[sel], n_windows, seed, int(e))
    return out


_M64 = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _permute(pos: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """pos -> perm(pos) for a keyed pseudorandom permutation of [0, n): a 6-round Feistel network on
    the smallest even bit width covering n, with cycle walking back into [0, n)."""
    bits = max(2, (n - 1).bit_length())
    half = (bits + 1) // 2
    mask = np.uint64((1 << half) - 1)
    base = _mix(np.array([(seed * 0x9E3779B97F4A7C15 + epoch) & _M64], dtype=np.uint64))
    keys = [_mix(base + np.uint64(r + 1))[0] for r in range(6)]

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << np.uint64(half)) | right

    y = feistel(pos.astype(np.uint64))
    out_of_range = y >= np.uint64(n)
    while out_of_range.any():  # a cycle through [0, 2**(2*half)) always comes back into [0, n)
        y[out_of_range] = feistel(y[out_of_range])
        out_of_range = y >= np.uint64(n)
    return y.astype(np.int64)


# --------------------------------------------------------------------------------------------------
# a corpus that ships with Python


def builtin_corpus(out_path: str | os.PathLike, max_bytes: int = 4 << 20) -> Path:
    """Write up to ``max_bytes`` of English prose that ships with Python, as JSONL, to ``out_path``.

    Documents: the Python reference manual's topics (``pydoc_data.topics``, what ``help()`` shows)
    first, then one per stdlib module: its module, class and function docstrings (via ``ast``), in
    sorted file order, tests left out. No download; deterministic for a given Python installation
    (the text differs between Python versions). About 2 MB exist on CPython 3.11.
    """
    if not (isinstance(max_bytes, int) and max_bytes > 0):
        raise ValueError(f"max_bytes must be an int > 0, got {max_bytes!r}")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines, size = [], 0
    for text in _builtin_documents():
        line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
        n = len(text.encode("utf-8"))
        if size + n > max_bytes:
            break
        lines.append(line)
        size += n
    _write_atomic(out, "".join(lines).encode("utf-8"))
    return out


def _builtin_documents() -> Iterator[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions split pydoc_data out
        topics = {}
    for key in sorted(topics):
        yield topics[key].strip()
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if skip & set(path.relative_to(stdlib).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        docs = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 40:
                    docs.append(doc)
        if docs:
            yield "\n\n".join(docs)


# --------------------------------------------------------------------------------------------------
# files and CLI


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable or corrupt JSON ({e})") from e


@contextlib.contextmanager
def _atomic_file(path: Path, tmp_prefix: str = ".") -> Iterator[Any]:
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


def _write_atomic(path: Path, data: bytes, tmp_prefix: str = ".") -> None:
    """Write data to path via a temporary file in the same directory, fsync, rename."""
    with _atomic_file(path, tmp_prefix) as f:
        f.write(data)


def main(argv: Sequence[str] | None = None) -> int:
    """``fmoe data``: build | info | corpus | tokenizer. Returns a process exit code: 0, or 2 after
    one line ``fmoe: error: ...`` naming the file (bad input, as every fmoe command)."""
    ap = argparse.ArgumentParser(prog="fmoe data", description="build and inspect packed token datasets")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="tokenize text files into a packed token dataset (resumable)")
    b.add_argument("inputs", nargs="+", help=".txt / .jsonl / .parquet files or directories")
    b.add_argument("--out", required=True, help="dataset directory")
    b.add_argument("--tokenizer", default="bytes", help="tokenizer.json path, or 'bytes' (default)")
    b.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)))
    b.add_argument("--shard-size", type=int, default=64 << 20, help="input bytes per shard")
    b.add_argument("--eos-token", default=None, help="end-of-document token of the tokenizer")
    i = sub.add_parser("info", help="print a dataset's index summary")
    i.add_argument("dir")
    c = sub.add_parser("corpus", help="write the builtin corpus (Python's own docs) as JSONL")
    c.add_argument("out")
    c.add_argument("--max-bytes", type=int, default=4 << 20)
    t = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer.json")
    t.add_argument("inputs", nargs="+")
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            index = build(args.inputs, args.out, args.tokenizer, args.workers, args.shard_size,
                          eos_token=args.eos_token, progress=True)  # fmt: skip
            print(
                f"{args.out}: {index['total_tokens']:,} tokens in {len(index['shards'])} shards ({index['dtype']})"
            )
        elif args.cmd == "info":
            ds = TokenDataset(args.dir)
            tok = ds.tokenizer.get("path") or ds.tokenizer["kind"]
            print(
                f"{ds.path}: {ds.n_tokens:,} tokens, {ds.dtype.name}, vocab_size {ds.vocab_size}, eos {ds.eos_id}, tokenizer {tok}"
            )
        elif args.cmd == "corpus":
            out = builtin_corpus(args.out, args.max_bytes)
            print(f"{out}: {out.stat().st_size:,} bytes")
        else:
            print(train_tokenizer(args.inputs, args.vocab_size, args.out))
    except (ValueError, OSError) as e:  # bad input: one line naming the file, as the rest of the CLI
        print(f"fmoe: error: {e}", file=sys.stderr)
        return 2
    return 0
