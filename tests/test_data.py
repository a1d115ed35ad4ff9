"""Claims about fmoe.data: builds are exact, parallel and resumable; reading is deterministic and resumable."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fmoe import data, data_tokenizer


def _corpus(tmp_path: Path) -> tuple[list[Path], list[str]]:
    """Inputs (.jsonl, .txt) and the documents they hold, in order."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "délta", "mixture", "of", "experts", "\N{GREEK SMALL LETTER PI}"]
    docs_a = [" ".join(rng.choice(words, size=rng.integers(5, 60))) for _ in range(120)]
    docs_b = [" ".join(rng.choice(words, size=rng.integers(5, 60))) for _ in range(80)]
    txt = "\n".join(" ".join(rng.choice(words, size=12)) for _ in range(300)) + "\n"
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.txt", tmp_path / "c.jsonl"
    a.write_text(
        "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs_a)), encoding="utf-8"
    )
    b.write_text(txt, encoding="utf-8")
    c.write_text(
        "".join(json.dumps({"text": d}) + "\n\n" for d in docs_b), encoding="utf-8"
    )  # blank lines skipped
    return [a, b, c], docs_a + [txt] + docs_b


def _expected_stream(docs: list[str]) -> np.ndarray:
    ids: list[int] = []
    for d in docs:
        ids.extend(d.encode("utf-8"))
        ids.append(data_tokenizer.BYTES_EOS)
    return np.array(ids)


def _stream(out: Path) -> np.ndarray:
    ds = data.TokenDataset(out)
    return ds.read(0, len(ds)).astype(np.int64)


def test_build_with_two_workers_packs_documents_in_order_separated_by_eos(tmp_path):
    inputs, docs = _corpus(tmp_path)
    index = data.build(inputs, tmp_path / "ds", "bytes", workers=2, shard_size=2048)
    assert len(index["shards"]) > 4  # several shards, so both workers and shard seams are exercised
    assert index["dtype"] == "uint16" and index["vocab_size"] == 257 and index["eos_id"] == 256
    assert index["tokenizer"]["kind"] == "bytes"
    np.testing.assert_array_equal(_stream(tmp_path / "ds"), _expected_stream(docs))
    assert index["total_tokens"] == len(_expected_stream(docs))


def test_killed_build_resumes_without_redoing_finished_shards(tmp_path):
    inputs, docs = _corpus(tmp_path)
    out = tmp_path / "ds"

    def crash(index, tokens):
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        data.build(inputs, out, "bytes", workers=2, shard_size=2048, on_shard=crash)
    assert not (out / "index.json").exists()
    finished = {p.name: p.stat().st_mtime_ns for p in out.glob("shard_*.bin")}
    assert finished  # the first shard was committed before the crash

    redone = []
    index = data.build(
        inputs, out, "bytes", workers=2, shard_size=2048, on_shard=lambda i, t: redone.append(i)
    )
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard_*.bin") if p.name in finished} == finished
    assert len(redone) == len(index["shards"]) - len(finished)
    assert not list(out.glob(".*tmp*"))
    np.testing.assert_array_equal(_stream(out), _expected_stream(docs))


def test_rebuild_into_a_directory_of_another_build_is_refused(tmp_path):
    inputs, _ = _corpus(tmp_path)
    data.build(inputs, tmp_path / "ds", shard_size=4096)
    with pytest.raises(ValueError, match="shard_size"):
        data.build(inputs, tmp_path / "ds", shard_size=8192)


def _dataset(tmp_path: Path) -> data.TokenDataset:
    inputs, _ = _corpus(tmp_path)
    data.build(inputs, tmp_path / "ds", shard_size=4096)
    return data.TokenDataset(tmp_path / "ds")


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_batches_are_deterministic_by_seed(tmp_path):
    ds = _dataset(tmp_path)
    kw = dict(seq=31, global_batch=8, micro_batch=2)
    a = _take(data.batches(ds, seed=7, **kw), 3)
    b = _take(data.batches(ds, seed=7, **kw), 3)
    c = _take(data.batches(ds, seed=8, **kw), 3)
    assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, b))
    assert not all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, c))


def test_labels_are_the_next_tokens_of_one_window(tmp_path):
    ds = _dataset(tmp_path)
    seq = 31
    batch = next(data.batches(ds, seq=seq, global_batch=4, micro_batch=2, seed=0))
    assert batch.tokens.shape == (2, 2, seq) and batch.tokens.dtype == torch.int64
    assert torch.equal(batch.labels[..., :-1], batch.tokens[..., 1:])
    w = int(data.window_order(np.array([0]), data.num_windows(ds, seq), seed=0)[0])
    window = torch.from_numpy(ds.read(w * (seq + 1), seq + 1).astype(np.int64))
    assert torch.equal(batch.tokens[0, 0], window[:-1]) and torch.equal(batch.labels[0, 0], window[1:])


def test_every_window_is_seen_once_per_epoch_in_a_new_order(tmp_path):
    ds = _dataset(tmp_path)
    n = data.num_windows(ds, 31)
    first, second = data.window_order(np.arange(n), n, 3), data.window_order(np.arange(n, 2 * n), n, 3)
    assert sorted(first) == list(range(n)) and sorted(second) == list(range(n))
    assert not np.array_equal(first, second) and not np.array_equal(first, np.arange(n))


def test_resume_from_cursor_gives_the_batches_of_an_uninterrupted_run(tmp_path):
    ds = _dataset(tmp_path)
    kw = dict(seq=31, global_batch=12, micro_batch=3, seed=5)
    n_steps = 2 * data.num_windows(ds, 31) // 12 + 2  # runs into the third epoch
    full = _take(data.batches(ds, **kw), n_steps)
    cut = n_steps // 2
    resumed = _take(data.batches(ds, cursor=full[cut - 1].cursor, **kw), n_steps - cut)
    for x, y in zip(full[cut:], resumed):
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.labels, y.labels) and x.cursor == y.cursor


def test_data_parallel_ranks_split_the_single_process_global_batch(tmp_path):
    ds = _dataset(tmp_path)
    kw = dict(seq=31, global_batch=12, seed=1)
    one = next(data.batches(ds, micro_batch=6, **kw)).tokens.reshape(12, 31)
    ranks = [
        next(data.batches(ds, micro_batch=2, dp_rank=r, dp_size=3, **kw)).tokens.reshape(4, 31)
        for r in range(3)
    ]
    assert torch.equal(one, torch.cat(ranks))


def test_too_small_dataset_is_refused_with_the_numbers(tmp_path):
    ds = _dataset(tmp_path)
    windows = data.num_windows(ds, 127)
    data.check_size(ds, steps=windows // 4, global_batch=4, seq=127)  # fits: no error
    steps = windows // 4 + 1
    with pytest.raises(ValueError) as err:
        data.check_size(ds, steps=steps, global_batch=4, seq=127)
    msg = str(err.value)
    assert (
        f"{ds.n_tokens:,} tokens" in msg
        and f"{steps * 4 * 128:,} tokens" in msg
        and f"{windows:,} windows" in msg
    )


def test_vocab_mismatch_is_one_line_naming_both_sizes(tmp_path):
    ds = _dataset(tmp_path)
    data.check_vocab(ds, 257)
    with pytest.raises(ValueError) as err:
        data.check_vocab(ds, 256)
    assert "\n" not in str(err.value) and "257" in str(err.value) and "256" in str(err.value)


def test_missing_truncated_or_corrupt_files_are_named(tmp_path):
    ds = _dataset(tmp_path)
    shard = ds.path / "shard_00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match="shard_00001.bin"):
        data.TokenDataset(ds.path)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="shard_00001.bin"):
        data.TokenDataset(ds.path)
    (ds.path / "index.json").write_text("{ not json")
    with pytest.raises(ValueError, match="index.json"):
        data.TokenDataset(ds.path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        data.build([bad], tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        data.build([tmp_path / "nope.txt"], tmp_path / "x")


def _word_level_tokenizer(path: Path, n_words: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(n_words)} | {"<unk>": n_words, "<|endoftext|>": n_words + 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def test_large_vocab_is_stored_as_uint32(tmp_path):
    tok = _word_level_tokenizer(tmp_path / "tokenizer.json", 70_000)
    (tmp_path / "a.txt").write_text("w69999 w3 w65536\nw12\n")
    index = data.build([tmp_path / "a.txt"], tmp_path / "ds", tok)
    ds = data.TokenDataset(tmp_path / "ds")
    assert index["dtype"] == "uint32" and ds.vocab_size == 70_002 and ds.tokenizer["sha256"]
    assert ds.read(0, len(ds)).tolist() == [69999, 3, 65536, 12, 70_001]


def test_trained_bpe_tokenizer_builds_a_dataset_that_decodes_to_the_text(tmp_path):
    from tokenizers import Tokenizer

    inputs, docs = _corpus(tmp_path)
    path = data_tokenizer.train_tokenizer(inputs, 300, tmp_path / "tok.json")
    index = data.build(inputs, tmp_path / "ds", path, shard_size=4096)
    tok = Tokenizer.from_file(str(path))
    assert (
        index["vocab_size"] == tok.get_vocab_size() and 257 < index["vocab_size"] <= 300
    )  # merges may run out
    ids = _stream(tmp_path / "ds").tolist()
    assert ids.count(index["eos_id"]) == len(docs)
    assert len(ids) < sum(len(d.encode()) for d in docs) / 2  # BPE merges: far fewer tokens than bytes
    first = ids[: ids.index(index["eos_id"])]
    assert tok.decode(first) == docs[0]


def test_builtin_corpus_is_english_prose_shipped_with_python(tmp_path):
    out = data.builtin_corpus(tmp_path / "corpus.jsonl", max_bytes=300_000)
    docs = [json.loads(line)["text"] for line in out.read_text(encoding="utf-8").splitlines()]
    text = " ".join(docs)
    assert len(docs) > 10 and 200_000 < len(text.encode()) <= 300_000
    words = text.lower().split()
    assert words.count("the") > 0.02 * len(words)  # English: "the" is ~5% of words
    assert data.builtin_corpus(tmp_path / "again.jsonl", max_bytes=300_000).read_bytes() == out.read_bytes()


def test_cli_build_then_info(tmp_path, capsys):
    inputs, _ = _corpus(tmp_path)
    assert data.main(["build", *map(str, inputs), "--out", str(tmp_path / "ds"), "--workers", "1"]) == 0
    assert data.main(["info", str(tmp_path / "ds")]) == 0
    assert "vocab_size 257" in capsys.readouterr().out
    assert data.main(["info", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fmoe: error: ") and "index.json" in err and err.count("\n") == 1


def test_parquet_input_reads_the_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed: .parquet input is optional")
    import pyarrow.parquet as pq

    docs = [f"document number {i}" for i in range(50)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "d.parquet", row_group_size=7)
    data.build([tmp_path / "d.parquet"], tmp_path / "ds", shard_size=100)
    np.testing.assert_array_equal(_stream(tmp_path / "ds"), _expected_stream(docs))


def test_cli_data_errors_are_one_line_with_exit_status_2(tmp_path, capsys):
    from fmoe import cli

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": 1}\n')
    assert cli.main(["data", "build", str(bad), "--out", str(tmp_path / "ds"), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fmoe: error: ") and "bad.jsonl:2" in err and err.count("\n") == 1


def test_invalid_utf8_in_jsonl_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid UTF-8") as err:
        data.build([bad], tmp_path / "ds")
    assert "\n" not in str(err.value)


def test_out_of_vocab_token_in_a_shard_names_the_shard(tmp_path):
    ds = _dataset(tmp_path)
    shard = ds.path / "shard_00001.bin"
    ids = np.fromfile(shard, dtype="<u2")
    ids[5] = 300  # >= vocab_size 257: would index past the embedding
    ids.tofile(shard)
    ds = data.TokenDataset(ds.path)
    start = int(data.TokenDataset(ds.path)._starts[1])
    ds.read(0, start)  # the shards before it read fine
    with pytest.raises(ValueError, match=r"shard_00001.bin: token 5 is id 300, outside the vocab_size 257"):
        ds.read(start, 10)
    with pytest.raises(ValueError, match="shard_00001.bin"):  # every window, in some epoch
        for _ in data.batches(ds, seq=31, global_batch=8, micro_batch=8, seed=0):
            pass


def test_shard_truncated_after_open_is_refused_naming_it_not_a_sigbus(tmp_path):
    """A memory-mapped shard truncated under a running job: reading it must raise, naming the file.
    Run in a child process: reading the map past the file's new end would kill it with SIGBUS."""
    _dataset(tmp_path)
    code = (
        "import os, sys\n"
        "from fmoe import data\n"
        f"ds = data.TokenDataset({str(tmp_path / 'ds')!r})\n"
        "os.truncate(ds.path / 'shard_00000.bin', 0)\n"
        "try:\n"
        "    ds.read(0, 100)\n"
        "except ValueError as e:\n"
        "    print(e)\n"
        "    sys.exit(3)\n"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == 3, (child.returncode, child.stderr[-2000:])  # -7 is SIGBUS
    assert "shard_00000.bin: 0 bytes" in child.stdout and "truncated" in child.stdout


MEASURE_BUILD = """
import resource, sys
from tokenizers import Tokenizer
from fmoe import data
text, tok, out, shard_size = sys.argv[1:5]
Tokenizer.from_file(tok).encode("warm up the tokenizer " * 100)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
data.build([text], out, tok, workers=1, shard_size=int(shard_size))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)  # Linux: KiB
"""


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_a_long_single_line_builds_in_bounded_memory_in_shards_of_shard_size(tmp_path, suffix):
    """Defect 6: a 5.8 MB text without a newline went to the tokenizer in one call (~65 bytes of
    memory per input byte: its peak grew by 384 MB here) into one shard, whatever --shard-size. Now the text is
    cut into bounded parts: the build's peak memory grows by a bounded amount (the bound is set by
    data_inputs.TEXT_CHUNK / data_build._BATCH_CHARS, not by the input), and a .txt's shards follow shard_size. A .jsonl
    line is one JSON document, read whole (a few times its size) but tokenized in bounded parts;
    it stays in one shard."""
    from tokenizers import Tokenizer

    inputs, _ = _corpus(tmp_path)
    tok = data_tokenizer.train_tokenizer(inputs, 300, tmp_path / "tok.json")
    rng = np.random.default_rng(1)
    words = ["alpha", "beta", "gamma", "délta", "mixture", "of", "experts", "\N{GREEK SMALL LETTER PI}"]
    line = " ".join(rng.choice(words, size=1_000_000))  # 5.8 MB, no newline
    source = tmp_path / f"line{suffix}"
    if suffix == ".txt":
        source.write_text(line, encoding="utf-8")
    else:
        source.write_text(json.dumps({"text": line}, ensure_ascii=False) + "\n", encoding="utf-8")
    shard_size = 1 << 20
    child = subprocess.run(
        [sys.executable, "-c", MEASURE_BUILD, str(source), str(tok), str(tmp_path / "ds"), str(shard_size)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    peak_growth = int(child.stdout.split()[-1])
    assert peak_growth < 64 << 20, f"peak memory grew by {peak_growth / 2**20:.0f} MiB"
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    n_bytes = len(line.encode("utf-8"))
    expected_shards = -(-n_bytes // shard_size) if suffix == ".txt" else 1  # .txt: cut at shard_size
    assert len(index["shards"]) == expected_shards
    ids = _stream(tmp_path / "ds")
    assert ids[-1] == index["eos_id"] and (ids == index["eos_id"]).sum() == 1  # still one document
    assert Tokenizer.from_file(str(tok)).decode(ids[:-1].tolist()) == line  # no character was split
