"""``build``: tokenize text files into a packed token dataset (``fmoe.data_format``), in parallel, resumably.

The inputs are cut into shards of about ``shard_size`` input bytes (``fmoe.data_inputs``); each
shard is tokenized by one worker into its own file, written as the tokens come and renamed when
complete, so a killed build keeps its finished shards and redoes only the rest. A call to the
tokenizer's batch encoder gets at most _BATCH_CHARS of text, so a worker holds O(_BATCH_CHARS) text
and tokens (plus, for .jsonl, the one JSON line it is reading) - not O(shard) nor O(document).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from fmoe.data_format import FORMAT, VERSION, atomic_file, read_json, shard_name, write_atomic
from fmoe.data_inputs import Piece, expand_inputs, file_pieces, piece_texts
from fmoe.data_tokenizer import TokenizerSpec, load_tokenizer

__all__ = ["build"]

_BATCH_CHARS = 1 << 18


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

    shard_size: bytes of input text per shard (small files are packed together; how files are cut,
    and the memory bound that holds whatever the line lengths: ``fmoe.data_inputs``). Resumable:
    run it again after a crash and finished shards are kept as they are (their files are not
    rewritten); a directory holding another build is refused. on_shard(index, tokens) is called in
    this process after each shard is committed (progress, tests). With workers > 1 the shards are
    tokenized in spawned processes: a script calling this must do so under ``if __name__ ==
    "__main__":``.
    """
    # Step 1: check the arguments; resolve the input files and the tokenizer
    if not (isinstance(workers, int) and workers >= 1):
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    if not (isinstance(shard_size, int) and shard_size >= 1):
        raise ValueError(f"shard_size must be an int >= 1 (bytes), got {shard_size!r}")
    files = expand_inputs(inputs)
    spec = load_tokenizer(tokenizer, eos_token)
    dtype = "uint16" if spec.vocab_size <= 1 << 16 else "uint32"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    # Step 2: write the build's plan first, or check that a resumed build is the same build
    plan = _build_plan(files, spec, shard_size, dtype)
    _write_or_check_plan(out, plan)
    if (out / "index.json").exists():
        return read_json(out / "index.json")

    # Step 3: cut the inputs into shards; the shard files a killed build finished are kept
    for stale in out.glob(".shard_*.tmp*"):  # left by a killed build
        stale.unlink()
    shards = _plan(files, shard_size)
    jobs = [
        (i, part, str(out), dtype, spec)
        for i, part in enumerate(shards)
        if not (out / shard_name(i)).exists()
    ]

    # Step 4: tokenize the missing shards, in this process or in spawned ones
    _tokenize(jobs, workers, len(shards), on_shard, progress)

    # Step 5: write the index last: its presence means the build is complete
    index = _index(out, len(shards), spec, dtype, plan["inputs"])
    write_atomic(out / "index.json", json.dumps(index, indent=1).encode())
    return index


def _build_plan(files: list[Path], spec: TokenizerSpec, shard_size: int, dtype: str) -> dict[str, Any]:
    """build.json's content: what makes two builds the same build."""
    return {
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


def _write_or_check_plan(out: Path, plan: dict[str, Any]) -> None:
    """Write ``out/build.json``, or refuse (ValueError naming it) a directory holding another build."""
    build_json = out / "build.json"
    if not build_json.exists():
        write_atomic(build_json, json.dumps(plan, indent=1).encode())
        return
    old = read_json(build_json)
    if not isinstance(old, dict):
        raise ValueError(f"{build_json}: corrupt build plan (not a JSON object); delete {out} and rebuild")
    diff = [k for k in plan if old.get(k) != plan[k]]
    if diff:
        raise ValueError(
            f"{out} holds another build (build.json differs in {diff}); use another --out or delete it"
        )


def _tokenize(
    jobs: list[tuple[int, list[Piece], str, str, TokenizerSpec]],
    workers: int,
    n_shards: int,
    on_shard: Callable[[int, int], None] | None,
    progress: bool,
) -> None:
    """Run the jobs (``_run``), reporting each committed shard to ``on_shard`` and, with
    ``progress``, on stderr (the count includes the shards an earlier build finished)."""
    done = n_shards - len(jobs)
    with contextlib.closing(_run(jobs, workers)) as committed:  # closing: an exception stops the pool
        for index, tokens in committed:
            done += 1
            if progress:
                print(f"shard {index} done ({tokens:,} tokens), {done}/{n_shards}", file=sys.stderr)
            if on_shard is not None:
                on_shard(index, tokens)


def _run(
    jobs: list[tuple[int, list[Piece], str, str, TokenizerSpec]], workers: int
) -> Iterator[tuple[int, int]]:
    """(shard index, tokens) of each job as it is committed: in this process, or in a pool of
    ``workers`` spawned processes (in the order they finish)."""
    if workers == 1 or len(jobs) <= 1:
        for job in jobs:
            yield _build_shard(job)
        return
    # spawn, not fork: the parent may hold torch / tokenizers thread pools that fork would break
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(workers, len(jobs)), initializer=_init_worker) as pool:
        yield from pool.imap_unordered(_build_shard, jobs)  # closed early: the with terminates the pool


def _index(out: Path, n_shards: int, spec: TokenizerSpec, dtype: str, inputs: list[dict]) -> dict[str, Any]:
    """index.json's content, the token counts read from the committed shard files' sizes."""
    itemsize = np.dtype(dtype).itemsize
    entries = [
        {"file": shard_name(i), "tokens": (out / shard_name(i)).stat().st_size // itemsize}
        for i in range(n_shards)
    ]
    return {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype,
        "vocab_size": spec.vocab_size,
        "eos_id": spec.eos_id,
        "tokenizer": asdict(spec),
        "total_tokens": sum(e["tokens"] for e in entries),
        "shards": entries,
        "inputs": inputs,
    }


def _init_worker() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the pool is the parallelism


_TOKENIZERS: dict[str, Any] = {}  # per process: tokenizer.json path -> loaded tokenizer


def _build_shard(job: tuple[int, list[Piece], str, str, TokenizerSpec]) -> tuple[int, int]:
    """Tokenize one shard's pieces into ``shard_<i>.bin`` (temp file written as tokens come, fsync,
    rename). Memory: O(_BATCH_CHARS), whatever the shard size (see TEXT_CHUNK)."""
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

    with atomic_file(Path(out_dir) / shard_name(index)) as out:
        for piece in pieces:
            for item in piece_texts(piece):
                batch.append(item)
                batch_chars += len(item[0])
                if len(batch) >= 512 or batch_chars >= _BATCH_CHARS:
                    flush(out)
        flush(out)
    return index, n_tokens


def _plan(files: list[Path], shard_size: int) -> list[list[Piece]]:
    """Pack the pieces of all files, in order, into shards of at most ~shard_size input bytes."""
    shards: list[list[Piece]] = []
    current: list[Piece] = []
    size = 0
    for f in files:
        for piece, nbytes in file_pieces(f, shard_size):
            if current and size + nbytes > shard_size:
                shards.append(current)
                current, size = [], 0
            current.append(piece)
            size += nbytes
    if current:
        shards.append(current)
    return shards
