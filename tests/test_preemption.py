"""What a shared cluster does to a run, on `fmoe train` processes forked as tests/test_faults.py forks
them (its fork server, its RNG-noise and fault hooks): stop signals at seeded steps and during a
save, on one and two ranks; a second signal; a second run on the same checkpoint folder; a
checkpoint without a manifest or with a nested-JSON one; a SIGKILL during an asynchronous write;
absurd model sizes; 50 two-rank runs that end through the interpreter's own exit.

Every resumed run ends bitwise where an unbroken run ends (parameters, optimizer state, trainer
counters), and nothing a stopped run wrote is lost: the checkpoint it saves is at the step it was
in when the signal came.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_faults import Server, argv_for, assert_all_intact, assert_bitwise, final_state, strict_json_lines

from fmoe import checkpoint
from fmoe import dist as D
from fmoe import recipe as R

STEPS = 12
RUN = {"train.steps": STEPS, "checkpoint.every": 4, "checkpoint.keep": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("server"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def straight(server, dataset, tmp_path_factory) -> tuple:
    """The unbroken one-rank run's final state."""
    root = tmp_path_factory.mktemp("straight")
    rc, out = server.run(argv_for(dataset, root, **RUN))
    assert rc == 0, out
    return final_state(root / "ckpt", STEPS)


def newest_step(ckpt: Path) -> int:
    return int(checkpoint.latest(ckpt).name.removeprefix("step_"))


def no_temp(ckpt: Path) -> list[str]:
    return [p.name for p in ckpt.iterdir() if p.name.startswith(".tmp-")]


def test_stop_signals_at_seeded_steps_and_during_a_save_keep_the_step_in_flight_and_resume_bitwise(
    server, dataset, straight, tmp_path
):
    rng = random.Random(29)
    root = tmp_path / "run"
    ckpt = root / "ckpt"
    argv = argv_for(dataset, root, **RUN, **{"checkpoint.signal": "SIGUSR2"})
    # (signal, where it arrives): inside the n-th step of this run, or inside a checkpoint write
    events = [(name, "step", rng.randint(1, 3)) for name in ("SIGTERM", "SIGINT", "SIGUSR2")]
    events.append((rng.choice(["SIGTERM", "SIGINT"]), "write", 1))
    rng.shuffle(events)
    done = 0
    for name, point, n in events:
        rc, out = server.run(argv, {"signal": [[point, n, name]]})
        assert rc == 0, f"{name} at {point} {n}: {out}"
        stopped = [line for line in out.splitlines() if line.startswith("stopped by")]
        assert len(stopped) == 1 and name in stopped[0] and "Traceback" not in out, out
        reached = newest_step(ckpt)
        if point == "step":  # the step in flight is finished and saved, no step after it runs
            assert reached == done + n, (name, n, done, out)
        else:  # a save's write (of step every): at most one more step, then its checkpoint
            assert reached in (done + RUN["checkpoint.every"], done + RUN["checkpoint.every"] + 1), out
        assert f"checkpoint {ckpt / f'step_{reached:08d}'}" in stopped[0], out
        assert no_temp(ckpt) == [] and not (ckpt / checkpoint.LOCK).exists(), out
        assert_all_intact(ckpt)
        done = reached
    rc, out = server.run(argv)
    assert rc == 0, out
    assert_bitwise(final_state(ckpt, STEPS), straight)
    steps = [r["step"] for r in strict_json_lines(root / "log" / "metrics.jsonl")]
    assert sorted(set(steps)) == list(range(1, STEPS + 1)), steps  # no step lost from the log either


def test_a_second_signal_stops_at_once_leaving_no_temp_folder_and_the_run_resumes_bitwise(
    server, dataset, straight, tmp_path
):
    root = tmp_path / "run"
    ckpt = root / "ckpt"
    argv = argv_for(dataset, root, **RUN)
    # both signals inside the second checkpoint's write (after its model file, after its optimizer
    # file): the first asks for a stop, the second aborts
    rc, out = server.run(argv, {"signal": [["write", 3, "SIGTERM"], ["write", 4, "SIGTERM"]]})
    assert rc == 128 + signal.SIGTERM, out
    assert "stopped at once" in out and "Traceback" not in out, out
    assert no_temp(ckpt) == [], no_temp(ckpt)
    assert_all_intact(ckpt)
    assert newest_step(ckpt) == RUN["checkpoint.every"], out  # the aborted save is not there
    rc, out = server.run(argv)
    assert rc == 0, out
    assert_bitwise(final_state(ckpt, STEPS), straight)


def test_a_sigkill_during_an_asynchronous_write_resumes_from_the_previous_checkpoint(
    server, dataset, straight, tmp_path
):
    root = tmp_path / "run"
    ckpt = root / "ckpt"
    argv = argv_for(dataset, root, **RUN, **{"checkpoint.asynchronous": True})
    rc, out = server.run(argv, {"kill": ["write", 3]})  # the second save's model file is written
    assert rc == -signal.SIGKILL, out
    assert [p.name for p in checkpoint.list_checkpoints(ckpt)] == ["step_00000004"]
    assert_all_intact(ckpt)
    rc, out = server.run(argv)
    assert rc == 0, out
    assert "has ended; this run takes it over" in out, out  # the killed run's lock was recognised
    assert_bitwise(final_state(ckpt, STEPS), straight)


def test_asynchronous_and_synchronous_saves_write_the_same_bytes(server, dataset, tmp_path):
    manifests = {}
    for mode in (True, False):
        root = tmp_path / str(mode)
        # asynchronous: the writer pauses between the two files of the save of step 8 while training goes
        # on (its in-place optimizer steps must not reach the file written after the pause)
        hooks = {"sleep": ["write", 3, 1.0]} if mode else {}
        rc, out = server.run(argv_for(dataset, root, **RUN, **{"checkpoint.asynchronous": mode}), hooks)
        assert rc == 0, out
        found = checkpoint.list_checkpoints(root / "ckpt")
        assert [p.name for p in found] == ["step_00000008", "step_00000012"]
        manifests[mode] = []
        for p in found:
            files = json.loads((p / checkpoint.MANIFEST).read_text())["files"]
            trainer = json.loads((p / checkpoint.TRAINER).read_text())
            # a forked child's Python and numpy generators are reseeded from the OS at the fork;
            # torch's (which the runs draw from) is seeded by the recipe
            trainer["rng"] = trainer["rng"]["torch"]
            manifests[mode].append(({n: files[n] for n in files if n != checkpoint.TRAINER}, trainer))
    assert manifests[True] == manifests[False]  # every tensor file's size and SHA-256, the index


def test_a_second_run_on_the_same_folder_is_refused_and_the_first_loses_nothing(
    server, dataset, straight, tmp_path
):
    root = tmp_path / "run"
    ckpt = root / "ckpt"
    argv = argv_for(dataset, root, **RUN)
    first, first_log = server.launch(argv, {"sleep": ["step", 6, 5.0]})
    deadline = time.monotonic() + 60
    while not (ckpt / "step_00000004").is_dir():  # the first run holds the folder and has saved
        assert time.monotonic() < deadline, first_log.read_text()
        time.sleep(0.05)
    before = {p.name for p in ckpt.iterdir()}
    second = argv_for(dataset, root, **RUN, **{"optim.lr": 1e-3})
    rc, out = server.run(second)
    lines = out.strip().splitlines()
    assert rc == 2 and len(lines) == 1, out
    assert f"pid {first} on host" in lines[0] and "in use by another run" in lines[0], out
    assert {p.name for p in ckpt.iterdir()} >= before - {p for p in before if p.startswith(".tmp-")}
    assert server.wait(first) == 0, first_log.read_text()
    assert_bitwise(final_state(ckpt, STEPS), straight)
    assert len(strict_json_lines(root / "log" / "metrics.jsonl")) == STEPS  # only the first run's lines


@pytest.mark.parametrize("damage", ["no manifest", "nested JSON"])
def test_a_checkpoint_without_a_manifest_or_with_nested_json_is_skipped_with_a_warning(
    server, dataset, straight, tmp_path, damage
):
    root = tmp_path / "run"
    ckpt = root / "ckpt"
    argv = argv_for(dataset, root, **RUN)
    rc, out = server.run(argv, {"kill": ["step", 10]})  # checkpoints 4 and 8, then killed
    assert rc == -signal.SIGKILL, out
    older, newest = checkpoint.list_checkpoints(ckpt)
    if damage == "no manifest":
        (newest / checkpoint.MANIFEST).unlink()
    else:
        (newest / checkpoint.MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    rc, out = server.run(argv)
    assert rc == 0, out
    warning = next(line for line in out.splitlines() if "is corrupt" in line)
    assert str(newest) in warning and str(older) in warning, out
    assert_bitwise(final_state(ckpt, STEPS), straight)


def test_absurd_layer_and_expert_counts_are_refused_naming_the_size(tmp_path):
    recipe = Path(__file__).parents[1] / "recipes" / "qwen3_30b_a3b.toml"
    cmd = [sys.executable, "-m", "fmoe", "plan", str(recipe), "--nproc", "8",
           "--set", "model.num_hidden_layers=1000000"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "1,000,000 layers" in lines[0] and "more than any device could hold" in lines[0], lines
    with pytest.raises(R.RecipeError, match=r"1,000,000 routed experts per layer"):
        R.load(recipe, {"model.num_experts": 1_000_000})


@pytest.mark.parametrize("config", ["a million layers", "nested JSON"])
def test_an_hf_folder_with_a_million_layers_or_nested_json_is_refused_in_one_line(tmp_path, capsys, config):
    from conftest import tiny_config

    from fmoe import cli
    from fmoe.stages import qwen3_moe

    folder = tmp_path / "hf"
    folder.mkdir()
    text = json.dumps({**qwen3_moe.FAMILY.hf_config(tiny_config()), "num_hidden_layers": 1_000_000})
    (folder / "config.json").write_text(text if config != "nested JSON" else "[" * 100_000 + "]" * 100_000)
    (folder / "model.safetensors").write_bytes(b"")
    assert cli.main(["checkpoint", "import-hf", str(folder), "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(folder / "config.json") in lines[0], lines
    assert ("1,000,000 layers" if config != "nested JSON" else "RecursionError") in lines[0], lines


def run_two(server, argv: list[str], hooks_by_rank: dict, teardown: bool = False) -> list:
    port = str(D.free_port())
    pids = []
    for rank in range(2):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
        pids.append(server.launch(argv, hooks_by_rank.get(rank), env, teardown=teardown))
    return [(server.wait(pid, timeout=90), log.read_text()) for pid, log in pids]


def test_two_ranks_stop_after_the_same_step_on_a_signal_to_one_and_resume_bitwise(server, dataset, tmp_path):
    rng = random.Random(2029)
    extra = {**RUN, "parallel.dp": 2, "train.steps": 8}
    results = run_two(server, argv_for(dataset, tmp_path / "straight", **extra), {})
    assert all(rc == 0 for rc, _ in results), results
    want = final_state(tmp_path / "straight" / "ckpt", 8)

    root = tmp_path / "run"
    argv = argv_for(dataset, root, **extra)
    n = rng.randint(1, 3)
    results = run_two(server, argv, {1: {"signal": [["step", n, "SIGTERM"]]}})  # rank 1 only
    assert all(rc == 0 for rc, _ in results), results
    assert f"stopped by SIGTERM after step {n}:" in results[1][1], results
    assert f"stopped by a stop signal to another rank after step {n}:" in results[0][1], results
    assert newest_step(root / "ckpt") == n
    results = run_two(server, argv, {0: {"signal": [["write", 1, "SIGINT"]]}})  # rank 0, in a save
    assert all(rc == 0 for rc, _ in results), results
    reached = newest_step(root / "ckpt")
    assert reached in (4, 5), results  # the save of step 4, at most one step after it
    assert f"stopped by SIGINT after step {reached}:" in results[0][1], results
    assert f"stopped by a stop signal to another rank after step {reached}:" in results[1][1], results
    assert no_temp(root / "ckpt") == []
    results = run_two(server, argv, {})
    assert all(rc == 0 for rc, _ in results), results
    assert_bitwise(final_state(root / "ckpt", 8), want)


def test_fifty_two_rank_runs_end_through_the_interpreter_exit_with_status_0(server, dataset, tmp_path):
    root = tmp_path / "run"
    base = {"parallel.dp": 2, "optim.warmup": 0, "checkpoint.every": 1, "checkpoint.keep": 1}
    for i in range(1, 51):  # each run resumes the last one's checkpoint and trains one more step
        results = run_two(server, argv_for(dataset, root, **base, **{"train.steps": i}), {}, teardown=True)
        assert [rc for rc, _ in results] == [0, 0], (i, results)
        assert not any(re.search(r"terminate called|Traceback", out) for _, out in results), results
    assert newest_step(root / "ckpt") == 50
