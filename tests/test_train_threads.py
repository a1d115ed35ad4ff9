"""fmoe train on a CPU: the thread count it runs with, and the throughput it reports."""

from __future__ import annotations

import json
import time

import pytest
import torch
from test_train import MODEL as TRAIN_MODEL

from fmoe import data
from fmoe import recipe as R
from fmoe.train import train

MODEL = {**TRAIN_MODEL, "num_hidden_layers": 1}  # the training tests' tiny model, one layer


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("data")
    text = root / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    data.build([text], root / "bytes", tokenizer="bytes", workers=1)
    return str(root / "bytes")


def tiny_recipe(tmp_path, dataset, **train_fields) -> R.Recipe:
    return R.from_dict(
        {
            "model": dict(MODEL),
            "data": {"path": dataset, "seq_len": 16},
            "train": {"steps": 4, "global_batch": 2, "microbatches": 1, "device": "cpu", **train_fields},
            "optim": {"warmup": 1},
            "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 100},
            "log": {"dir": str(tmp_path / "log"), "every": 2, "progress": False},
        }
    )


@pytest.mark.parametrize("threads, expected", [(0, 1), (2, 2)], ids=["automatic", "two"])
def test_a_cpu_run_uses_train_threads_and_restores_the_count_after(tmp_path, dataset, threads, expected):
    seen = []
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # not what the run should use, whatever OMP_NUM_THREADS says
    try:
        train(
            tiny_recipe(tmp_path, dataset, threads=threads),
            on_step=lambda s, loss: seen.append(torch.get_num_threads()),
        )
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    assert seen == [expected] * 4


def test_negative_threads_is_refused_naming_the_field(tmp_path, dataset):
    with pytest.raises(R.RecipeError, match=r"train\.threads must be >= 0"):
        tiny_recipe(tmp_path, dataset, threads=-1)


def test_reported_throughput_is_the_runs_steady_mean_not_the_last_windows(tmp_path, dataset):
    """Step 2 (the first log window, whose first step, the run's, is left out of every rate) is slowed
    by 0.6 s; steps 3-4 are not. The run's steady throughput is its steps after the first over at
    least the two windows' times, which is below the last window's throughput (what was reported
    before) whenever the first window took longer than the last."""
    slow = 0.6

    def on_step(step: int, loss: float) -> None:
        if step == 2:
            time.sleep(slow)

    result = train(tiny_recipe(tmp_path, dataset), on_step=on_step)
    tokens_per_step = 2 * 16  # global_batch x seq_len
    windows = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    window_steps = [1, 2]  # steps 1-2 less the run's first step; steps 3-4
    window_seconds = [n * tokens_per_step / w["tokens_per_s"] for n, w in zip(window_steps, windows)]
    assert len(windows) == 2 and window_seconds[0] > window_seconds[1] + slow / 2
    steady_tokens = sum(window_steps) * tokens_per_step
    assert result.tokens_per_second <= steady_tokens / sum(window_seconds) * (1 + 1e-9)
    assert result.tokens_per_second < windows[-1]["tokens_per_s"]
    assert steady_tokens / result.wall_seconds <= result.tokens_per_second
