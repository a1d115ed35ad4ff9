"""Token data: build packed token files from text, read them through ``numpy.memmap``, batch them.

The user's entry points: :func:`build` (``fmoe data build``; in ``fmoe.data_build``, with the
inputs read by ``fmoe.data_inputs`` and tokenized by ``fmoe.data_tokenizer``), :class:`TokenDataset`
(the on-disk format is ``fmoe.data_format``'s), :func:`batches`, :func:`builtin_corpus`
(``fmoe.data_corpus``) and :func:`main`, the ``fmoe data`` command.

Training reads fixed windows of ``seq + 1`` tokens (window i = stream[i*(seq+1) : (i+1)*(seq+1)],
tokens = window[:-1], labels = window[1:]), in an order shuffled per epoch by a keyed Feistel
permutation of window indices: deterministic from (seed, epoch), the same on every machine and
numpy version, and computable for any position without materialising the permutation, so a loader
resumes at any sample ``cursor`` instantly and exactly.
"""

from __future__ import annotations

import argparse
import bisect
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from fmoe.data_build import build
from fmoe.data_corpus import builtin_corpus
from fmoe.data_format import FORMAT, read_json
from fmoe.data_tokenizer import train_tokenizer

if TYPE_CHECKING:  # torch is imported lazily: tokenizer worker processes never need it
    import torch

__all__ = [
    "Batch",
    "TokenDataset",
    "batches",
    "build",
    "builtin_corpus",
    "check_size",
    "check_vocab",
    "main",
    "num_windows",
    "window_order",
]


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
        index = read_json(index_path)
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
    except BrokenPipeError:
        raise  # the reader went away: not bad input (fmoe.cli ends quietly)
    except (ValueError, OSError) as e:  # bad input: one line naming the file, as the rest of the CLI
        print(f"fmoe: error: {e}", file=sys.stderr)
        return 2
    return 0
