"""Resuming safely: changed model sizes refused, non-finite steps skipped and never saved, leftovers
tidied, corrupt checkpoints skipped for the newest intact one, output folders checked up front, and a
resume that needs the RNG state restored."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from test_train import recipe_dict, toml_text

from fmoe import checkpoint, checkpoint_write, cli, parallel
from fmoe import recipe as R
from fmoe.train import train


def run_cli(tmp_path, d: dict, capsys) -> tuple[int, str]:
    path = tmp_path / "recipe.toml"
    path.write_text(toml_text(d))
    code = cli.main(["train", str(path)])
    return code, capsys.readouterr().err.strip()


def folder_bytes(folder) -> dict:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def strict_json_lines(path) -> list[dict]:
    def refuse(name):
        raise ValueError(f"bare {name} in {path}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def all_finite(path) -> bool:
    params, opt, _ = checkpoint.load(path)
    return all(
        bool(torch.isfinite(t).all()) for t in (*params.values(), *opt.values()) if t.is_floating_point()
    )


# ------------------------------------------------------------------------------------------------
# defect 1: a checkpoint of other model sizes


@pytest.mark.parametrize("field, value, dim", [("hidden_size", 64, None), ("num_experts", 8, 0)])
def test_resuming_with_changed_model_sizes_is_refused_before_any_step(
    tmp_path, dataset, capsys, monkeypatch, field, value, dim
):
    d = recipe_dict(tmp_path, dataset)
    train(R.from_dict(d), stop_after=3)
    before = folder_bytes(tmp_path / "ckpt")
    d["model"][field] = value
    steps = []
    real = parallel.parallel_step
    monkeypatch.setattr(parallel, "parallel_step", lambda *a, **k: steps.append(1) or real(*a, **k))
    code, err = run_cli(tmp_path, d, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("fmoe: error: "), err
    m = re.search(
        r"tensor '([^']+)' has shape (\([\d, ]+\)) in the checkpoint, the recipe needs (\([\d, ]+\))", err
    )
    assert m, err
    got, want = eval(m.group(2)), eval(m.group(3))
    old = {"hidden_size": 32, "num_experts": 4}[field]
    assert old in got and value in want and got != want, err
    assert steps == [], "a step ran before the refusal"
    assert folder_bytes(tmp_path / "ckpt") == before  # keep-N rotated nothing out


# ------------------------------------------------------------------------------------------------
# defect 2: non-finite values


def test_a_diverging_run_never_saves_non_finite_values_and_its_metrics_stay_json(tmp_path, dataset, capsys):
    d = recipe_dict(tmp_path, dataset, optim={"lr": 1e8}, checkpoint={"every": 1, "keep": 2})
    code, err = run_cli(tmp_path, d, capsys)
    assert code in (0, 2) and len(err.splitlines()) <= 1, err
    kept = checkpoint.list_checkpoints(tmp_path / "ckpt")
    assert kept and all(all_finite(p) for p in kept)
    records = strict_json_lines(tmp_path / "log" / "metrics.jsonl")
    assert records[-1]["skipped_steps"] >= 1  # the case this test is about did happen


def nan_from(first_bad: int, last_bad: int | None = None):
    """A parallel_step whose loss and gradients are NaN for calls first_bad..last_bad (1-based)."""
    real = parallel.parallel_step
    calls = {"n": 0}

    def step(*args, **kwargs):
        calls["n"] += 1
        out = real(*args, **kwargs)
        if calls["n"] >= first_bad and (last_bad is None or calls["n"] <= last_bad):
            grads = {n: g * math.nan for n, g in out.grad_shards.items()}
            out = out._replace(loss=out.loss * math.nan, grad_shards=grads)
        return out

    return step


def test_a_nan_loss_is_skipped_and_counted_and_training_goes_on(tmp_path, dataset, monkeypatch):
    d = recipe_dict(tmp_path, dataset, checkpoint={"every": 1, "keep": 6})
    monkeypatch.setattr(parallel, "parallel_step", nan_from(3, 3))
    result = train(R.from_dict(d))
    assert result.step == 6 and result.skipped_steps == 1
    assert math.isnan(result.losses[2]) and all(
        math.isfinite(v) for i, v in enumerate(result.losses) if i != 2
    )
    ckpts = checkpoint.list_checkpoints(tmp_path / "ckpt")
    p2, o2, _ = checkpoint.load(ckpts[1])
    p3, o3, t3 = checkpoint.load(ckpts[2])
    assert all(torch.equal(p3[n], p2[n]) for n in p2)  # the skipped step changed no parameter
    assert all(torch.equal(o3[k], o2[k]) for k in o2)  # ... and no optimizer state (nor its count)
    assert t3["skipped_steps"] == 1 and all(all_finite(p) for p in ckpts)
    records = strict_json_lines(tmp_path / "log" / "metrics.jsonl")
    assert records[2]["loss"] is None and records[2]["grad_norm"] is None and records[2]["skipped_steps"] == 1
    assert records[-1]["skipped_steps"] == 1


def test_non_finite_steps_in_a_row_stop_with_one_line_and_the_good_checkpoint_survives(
    tmp_path, dataset, monkeypatch, capsys
):
    d = recipe_dict(tmp_path, dataset, train={"steps": 10, "max_nonfinite_steps": 3}, checkpoint={"every": 1})
    monkeypatch.setattr(parallel, "parallel_step", nan_from(4))
    code, err = run_cli(tmp_path, d, capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert (
        "3 steps in a row had a non-finite loss or gradient norm" in err
        and "train.max_nonfinite_steps" in err
    )
    kept = checkpoint.list_checkpoints(tmp_path / "ckpt")
    assert all(all_finite(p) for p in kept)
    good = checkpoint.load(kept[-1])[0]
    monkeypatch.undo()
    straight = train(R.from_dict(recipe_dict(tmp_path / "ref", dataset, train={"steps": 10})), stop_after=3)
    assert all(torch.equal(good[n], t) for n, t in straight.params.items())  # step 3's, untouched


# ------------------------------------------------------------------------------------------------
# defect 4: leftovers, checksums, read-only folders


def test_leftover_temp_folders_are_removed_at_start(tmp_path, dataset):
    d = recipe_dict(tmp_path, dataset)
    train(R.from_dict(d), stop_after=3)
    ckpt = tmp_path / "ckpt"
    for name in (".tmp-step_00000004-123-abcdef12", ".tmp-drop-step_00000001-0badcafe"):
        (ckpt / name).mkdir()
        (ckpt / name / checkpoint.MODEL).write_bytes(b"\0" * 4096)
    train(R.from_dict(d), stop_after=1)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000003", "step_00000004"]


def test_a_flipped_bit_falls_back_to_the_newest_intact_checkpoint_with_a_warning(tmp_path, dataset, capsys):
    d = recipe_dict(tmp_path, dataset, checkpoint={"every": 2, "keep": 2})
    straight = train(R.from_dict(recipe_dict(tmp_path / "ref", dataset)))
    train(R.from_dict(d), stop_after=4)
    older, newest = checkpoint.list_checkpoints(tmp_path / "ckpt")
    model = newest / checkpoint.MODEL
    raw = bytearray(model.read_bytes())
    raw[-5] ^= 0x10  # one bit of the last tensor's data
    model.write_bytes(bytes(raw))
    capsys.readouterr()
    code, err = run_cli(tmp_path, d, capsys)
    assert code == 0, err
    warning = next(line for line in err.splitlines() if "is corrupt" in line)
    assert str(newest) in warning and str(older) in warning and checkpoint.MODEL in warning
    final, _, trainer = checkpoint.load(checkpoint.latest(tmp_path / "ckpt"))
    assert trainer["step"] == 6
    assert all(torch.equal(final[n], t) for n, t in straight.params.items())


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_corrupt_checkpoint_is_set_aside_so_keeping_n_never_drops_the_intact_one(
    tmp_path, dataset, capsys, damage
):
    # keep = 2, saves at 3 and 6; step 6 corrupt (a file truncated, or deleted): the run resumes
    # from 3 and saves at 4. Counted among the kept two, the corrupt 6 would make rotation delete 3,
    # the one intact fallback (and a silently skipped 6 would be overwritten when the run saves 6
    # again); it is moved aside instead, its bytes as they were, and the warning says where
    d = recipe_dict(tmp_path, dataset, train={"steps": 8}, checkpoint={"every": 3, "keep": 2})
    train(R.from_dict(d), stop_after=6)
    ckpt = tmp_path / "ckpt"
    older, newest = checkpoint.list_checkpoints(ckpt)
    model = newest / checkpoint.MODEL
    if damage == "truncated":
        model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    else:
        model.unlink()
    corrupt = folder_bytes(newest)
    capsys.readouterr()
    train(R.from_dict(d), stop_after=1)
    err = capsys.readouterr().err
    aside = ckpt / f"corrupt-{newest.name}"
    assert [p.name for p in checkpoint.list_checkpoints(ckpt)] == [older.name, "step_00000004"]
    assert folder_bytes(aside) == corrupt
    warning = next(line for line in err.splitlines() if "is corrupt" in line)
    assert str(aside) in warning and str(older) in warning
    train(R.from_dict(d))  # a later run leaves it where it is
    assert folder_bytes(aside) == corrupt


def test_a_resume_says_so_and_names_the_recipe_fields_that_changed(tmp_path, dataset, capsys):
    d = recipe_dict(tmp_path, dataset)
    train(R.from_dict(d), stop_after=3)
    capsys.readouterr()
    train(R.from_dict(d), stop_after=1)  # the same recipe: said, no warning
    out, err = capsys.readouterr()
    assert f"fmoe: resuming from {tmp_path / 'ckpt' / 'step_00000003'} at step 3" in out
    assert "differs" not in err
    changed = recipe_dict(tmp_path, dataset, optim={"lr": 5e-3}, train={"steps": 9, "global_batch": 8})
    train(R.from_dict(changed), stop_after=1)
    warning = next(line for line in capsys.readouterr().err.splitlines() if "differs" in line)
    assert "optim.lr 0.01 -> 0.005" in warning and "train.global_batch 4 -> 8" in warning
    assert "train.steps" not in warning  # extending a run is not a change of what it computes


def test_a_field_added_since_the_checkpoint_is_no_change_at_its_default(tmp_path, dataset, capsys):
    # a checkpoint written before train.fp8_expert_wgrad existed records no value for it: resumed
    # with the field at its default, nothing differs; set otherwise, it is named
    from fmoe.train_state import _say_resumed, run_fields

    recorded = run_fields(R.from_dict(recipe_dict(tmp_path, dataset)))
    del recorded["train.fp8_expert_wgrad"]
    _say_resumed(R.from_dict(recipe_dict(tmp_path, dataset)), tmp_path, 3, recorded)
    assert "differs" not in capsys.readouterr().err
    _say_resumed(
        R.from_dict(recipe_dict(tmp_path, dataset, train={"fp8_expert_wgrad": False})), tmp_path, 3, recorded
    )
    assert "train.fp8_expert_wgrad null -> false" in capsys.readouterr().err


def test_a_resume_moves_the_metrics_of_the_steps_it_repeats_aside(tmp_path, dataset):
    # killed after step 5 but before its save: the resumed run repeats 4 and 5 from the checkpoint
    # at 3; metrics.jsonl holds each step once, the first run's 4 and 5 move to metrics.rewound.jsonl
    d = recipe_dict(tmp_path, dataset)
    train(R.from_dict(d), stop_after=5)
    shutil.rmtree(tmp_path / "ckpt" / "step_00000005")
    first = strict_json_lines(tmp_path / "log" / "metrics.jsonl")
    train(R.from_dict(d))
    steps = [r["step"] for r in strict_json_lines(tmp_path / "log" / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert strict_json_lines(tmp_path / "log" / "metrics.rewound.jsonl") == first[3:]


@pytest.mark.parametrize("field", ["checkpoint.dir", "log.dir"])
def test_a_read_only_output_folder_is_refused_before_any_step(tmp_path, dataset, capsys, monkeypatch, field):
    """Made read-only by replacing the folder with a file: no write can succeed in it, for root too
    (chmod does not bind root; tests/test_faults.py uses a real read-only mount where it may)."""
    d = recipe_dict(tmp_path, dataset)
    section, key = field.split(".")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file, not a folder")
    d[section][key] = str(blocked / "sub")
    steps = []
    real = parallel.parallel_step
    monkeypatch.setattr(parallel, "parallel_step", lambda *a, **k: steps.append(1) or real(*a, **k))
    code, err = run_cli(tmp_path, d, capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{field} '{blocked / 'sub'}' is not writable" in err and steps == []


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoints(
    tmp_path, dataset, capsys, monkeypatch
):
    d = recipe_dict(tmp_path, dataset, checkpoint={"every": 1, "keep": 2})
    train(R.from_dict(d), stop_after=3)
    before = folder_bytes(tmp_path / "ckpt")
    real = checkpoint_write._write_tensors

    def full(path, tensors, metadata):
        if path.name == checkpoint.OPTIM:
            path.write_bytes(b"\0" * 100)
            raise OSError(28, "No space left on device", str(path))
        real(path, tensors, metadata)

    monkeypatch.setattr(checkpoint_write, "_write_tensors", full)
    code, err = run_cli(tmp_path, d, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "No space left on device" in err, err
    assert folder_bytes(tmp_path / "ckpt") == before
    assert all(checkpoint.verify(p) for p in checkpoint.list_checkpoints(tmp_path / "ckpt"))


# ------------------------------------------------------------------------------------------------
# issue 17: a resume where the RNG state matters


def noisy_step():
    """parallel_step plus gradient noise drawn from torch's global RNG: a seeded op whose result
    depends on the RNG state, as dropout or random routing would."""
    real = parallel.parallel_step

    def step(*args, **kwargs):
        out = real(*args, **kwargs)
        for g in out.grad_shards.values():
            g.add_(torch.randn_like(g), alpha=1e-3)
        return out

    return step


def test_a_resume_restores_the_rng_so_a_random_op_continues_bitwise(tmp_path, dataset, monkeypatch):
    monkeypatch.setattr(parallel, "parallel_step", noisy_step())
    straight = train(R.from_dict(recipe_dict(tmp_path / "a", dataset)))
    d = recipe_dict(tmp_path / "b", dataset)
    first = train(R.from_dict(d), stop_after=3)
    second = train(R.from_dict(d))
    assert first.losses + second.losses == straight.losses
    assert all(torch.equal(second.params[n], t) for n, t in straight.params.items())
    # the same resume without restoring the RNG state draws other noise: the test can tell
    monkeypatch.setattr(checkpoint, "restore_rng", lambda state: None)
    d = recipe_dict(tmp_path / "c", dataset)
    train(R.from_dict(d), stop_after=3)
    unrestored = train(R.from_dict(d))
    assert not all(torch.equal(unrestored.params[n], t) for n, t in straight.params.items())
