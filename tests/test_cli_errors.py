"""The CLI's error contract: bad input ends with ONE stderr line ``fmoe: error: ...`` naming the field
or file, and exit status 2; recipes that can never run are refused before any data build or step;
anything else (a bug, fmoe's or in a family's own code) keeps its traceback."""

from __future__ import annotations

import pytest
from test_train import recipe_dict, toml_text

from fmoe import cli, hf, parallel
from fmoe import recipe as R
from fmoe.train import train


def run_cli(args, capsys) -> tuple[int, str]:
    code = cli.main(args)
    return code, capsys.readouterr().err


def assert_one_line_error(code: int, err: str, *names: str) -> None:
    """Exit 2, exactly one stderr line starting 'fmoe: error: ', naming each of ``names``."""
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("fmoe: error: "), err
    for name in names:
        assert name in err, (name, err)


def train_cli(tmp_path, dataset, capsys, **sections) -> tuple[int, str, str]:
    """``fmoe train`` on the test recipe with ``sections`` merged in (a [model] naming another family
    replaces the test's Qwen model); (code, stderr, recipe path)."""
    d = recipe_dict(tmp_path, dataset, **sections)
    if "family" in sections.get("model", {}):
        d["model"] = sections["model"]
    path = tmp_path / "bad.toml"
    path.write_text(toml_text(d))
    code, err = run_cli(["train", str(path)], capsys)
    return code, err, str(path)


@pytest.mark.parametrize(
    "sections, field",
    [
        ({"model": {"head_dim": 0}}, "model.head_dim must be > 0"),
        ({"model": {"hidden_size": -96}}, "model.hidden_size must be > 0, got -96"),
        ({"model": {"num_hidden_layers": 0}}, "model.num_hidden_layers must be > 0"),
        ({"model": {"moe_intermediate_size": 0}}, "model.moe_intermediate_size must be > 0"),
        ({"model": {"family": "deepseek_v2", "vocab_size": 264, "rope_theta": 0.0}}, "model.rope_theta must be > 0"),
        ({"model": {"family": "gpt_oss", "vocab_size": 264, "max_position_embeddings": 0}},
         "model.max_position_embeddings must be > 0"),
        ({"model": {"max_position_embeddings": 16}}, "model.max_position_embeddings (16) must be >= data.seq_len (32)"),
        ({"optim": {"lr": 1e-3, "min_lr": 1e-2}}, "optim.min_lr (0.01) must be <= optim.lr (0.001)"),
        ({"optim": {"lr": -1.0}}, "optim.lr must be a finite number > 0"),
        ({"optim": {"b2": 1.0}}, "optim.b2 must be in [0, 1)"),
        ({"optim": {"schedule": "wsd", "decay_fraction": 0.9, "warmup": 2}}, "optim.decay_fraction"),
        ({"parallel": {"schedule": "no-such-schedule"}}, "parallel.schedule: unknown schedule 'no-such-schedule'"),
        ({"parallel": {"schedule": "missing.csv"}}, "parallel.schedule: 'missing.csv': file not found"),
        ({"parallel": {"timeout_s": 0}}, "parallel.timeout_s must be a finite number of seconds > 0"),
        ({"train": {"cuda_graphs": True}}, "train.cuda_graphs needs a CUDA device; train.device is 'cpu'"),
        ({"parallel": {"gather": "layer"}}, "parallel.gather must be 'chunk' or 'step', got 'layer'"),
        # 4 pipeline stages for a 1-layer model: ranks 2 and 3 would hold nothing and wait forever
        ({"model": {"num_hidden_layers": 1}, "parallel": {"pp": 4}, "train": {"global_batch": 8, "microbatches": 4}},
         "pipeline rank 2 would run no stage"),
    ],
)  # fmt: skip
def test_recipes_that_can_never_run_are_refused_up_front_naming_the_field(
    tmp_path, dataset, capsys, monkeypatch, sections, field
):
    def no_data(*args, **kwargs):
        raise AssertionError("the recipe reached the data pipeline")

    monkeypatch.setattr("fmoe.train_data.ensure_dataset", no_data)
    code, err, path = train_cli(tmp_path, dataset, capsys, **sections)
    assert_one_line_error(code, err, path, field)


def test_cuda_graphs_on_a_cpu_chosen_by_auto_is_refused_before_anything_is_written(tmp_path, dataset, capsys):
    # train.device = "auto" resolves to the CPU here: refused with the recipe's one line before
    # the checkpoint folder is locked and before any log or plan is written
    code, err, path = train_cli(tmp_path, dataset, capsys, train={"cuda_graphs": True, "device": "auto"})
    assert_one_line_error(code, err, path, "train.cuda_graphs needs a CUDA device; this run is on cpu")
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "log").exists()


def test_data_path_is_built_only_where_nothing_else_lies_and_leaves_nothing_beside(tmp_path, dataset, capsys):
    # build_from builds into a missing or empty folder; a file, or a folder of other files, is the
    # user's and is refused untouched; an unbuildable place is one line naming data.path
    built = {"build_from": "builtin", "builtin_bytes": 20_000}
    user = tmp_path / "user"
    user.mkdir()
    user_file = user / "notes.txt"
    user_file.write_text("mine\n")
    user_dir = user / "mine"
    user_dir.mkdir()
    (user_dir / "a.txt").write_text("mine too\n")
    blocked = user_file / "data"  # under a file: no folder can be made there
    for path, message in [
        (user_file, f"data.path '{user_file}' is a file, not a dataset folder"),
        (user_dir, f"data.path '{user_dir}' holds other files but no dataset"),
        (blocked, f"data.path '{blocked}': cannot build the dataset there"),
    ]:
        code, err, recipe_path = train_cli(tmp_path, dataset, capsys, data={"path": str(path), **built})
        assert_one_line_error(code, err, recipe_path, message)
        assert sorted(p.name for p in user.iterdir()) == ["mine", "notes.txt"], "nothing written beside it"
    assert user_file.read_text() == "mine\n" and [p.name for p in user_dir.iterdir()] == ["a.txt"]
    fresh = user / "fresh" / "data"
    code, err, _ = train_cli(tmp_path, dataset, capsys, data={"path": str(fresh), **built})
    assert code == 0, err
    assert (fresh / "index.json").is_file() and [p.name for p in fresh.parent.iterdir()] == ["data"]
    # built once, it is used as it is: too small for a longer run, the error says how to rebuild
    more = {"path": str(fresh), **built, "builtin_bytes": 2_000_000}
    code, err, recipe_path = train_cli(tmp_path, dataset, capsys, data=more, train={"steps": 100_000})
    assert_one_line_error(code, err, recipe_path, "is too small", f"move {fresh} away to rebuild it")


def test_a_tokenizer_other_than_the_datasets_is_refused_naming_both(tmp_path, dataset, capsys):
    tokenizer = tmp_path / "tokenizer.json"  # same ids as bytes, but another tokenizer identity
    tokenizer.write_text(hf.byte_level_tokenizer_json())
    code, err, path = train_cli(tmp_path, dataset, capsys, data={"tokenizer": str(tokenizer)})
    assert_one_line_error(code, err, path, f"data.tokenizer '{tokenizer}'", dataset, "bytes")


def test_a_missing_tokenizer_file_names_the_field(tmp_path, dataset, capsys):
    code, err, path = train_cli(tmp_path, dataset, capsys, data={"tokenizer": str(tmp_path / "nope.json")})
    assert_one_line_error(code, err, path, f"data.tokenizer '{tmp_path / 'nope.json'}': file not found")


def test_a_binary_recipe_file_is_named(tmp_path, capsys):
    path = tmp_path / "weights.toml"
    path.write_bytes(bytes(range(256)) * 4)
    code, err = run_cli(["train", str(path)], capsys)
    assert_one_line_error(code, err, str(path), "not a TOML text file")


def test_a_multi_line_error_message_prints_as_one_line(tmp_path, capsys, monkeypatch):
    def import_hf(folder, family_name=None):
        raise hf.HFError(f"{folder}: tensor 'model.embed_tokens.weight' has shape [3, 4]\nexpected [264, 32]")

    monkeypatch.setattr(hf, "import_hf", import_hf)
    code, err = run_cli(
        ["checkpoint", "import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c")], capsys
    )
    assert_one_line_error(code, err, "model.embed_tokens.weight", "expected [264, 32]")


def test_an_unreadable_file_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    def import_hf(folder, family_name=None):
        raise PermissionError(13, "Permission denied", f"{folder}/config.json")

    monkeypatch.setattr(hf, "import_hf", import_hf)
    code, err = run_cli(
        ["checkpoint", "import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c")], capsys
    )
    assert_one_line_error(code, err, str(tmp_path / "hf" / "config.json"), "Permission denied")


def test_a_missing_hf_folder_is_named_as_the_folder(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for folder, says in (
        (tmp_path / "nothere", "no such Hugging Face folder"),
        (tmp_path / "empty", "no config.json"),
    ):
        code, err = run_cli(["checkpoint", "import-hf", str(folder), "--out", str(tmp_path / "c")], capsys)
        assert_one_line_error(code, err, str(folder), says)
    assert not (tmp_path / "c").exists()


def test_the_recipes_timeout_reaches_the_step(tmp_path, dataset, monkeypatch):
    seen: list[float] = []
    step = parallel.parallel_step

    def recording_step(*args, timeout_s, **kwargs):
        seen.append(timeout_s)
        return step(*args, timeout_s=timeout_s, **kwargs)

    monkeypatch.setattr(parallel, "parallel_step", recording_step)
    d = recipe_dict(tmp_path, dataset, train={"steps": 3}, parallel={"timeout_s": 42.5})
    train(R.from_dict(d))
    assert seen == [42.5, 42.5, 42.5]
    assert R.from_dict(recipe_dict(tmp_path, dataset)).parallel.timeout_s == 600.0


def test_a_malformed_build_from_file_is_one_line_naming_it(tmp_path, dataset, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": 1}\n')
    data = {"path": str(tmp_path / "new-data"), "build_from": str(bad)}
    code, err, path = train_cli(tmp_path, dataset, capsys, data=data)
    assert_one_line_error(code, err, path, "data.build_from", "bad.jsonl:2")


def test_a_bug_is_a_traceback_not_a_line(tmp_path, dataset, capsys, monkeypatch):
    """Exit 2 is for bad input; a ValueError or KeyError from code (here, the step) propagates."""

    def buggy_step(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(parallel, "parallel_step", buggy_step)
    path = tmp_path / "r.toml"
    path.write_text(toml_text(recipe_dict(tmp_path, dataset)))
    with pytest.raises(KeyError, match="a bug"):
        cli.main(["train", str(path)])
    assert capsys.readouterr().err == ""


def test_a_reader_that_goes_away_ends_the_output_quietly():
    """`fmoe plan ... | head`: the pipe's reader is gone before fmoe writes - no error line, no
    traceback, the status of a writer killed by SIGPIPE (not bad input's 2)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "fmoe", "plan", str(root / "recipes" / "tiny.toml"), "--nproc", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=root)
    proc.stdout.close()  # before the child has imported torch, let alone planned: its write must fail
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == "", err


def test_the_plans_header_says_fp8_steps_gather_once_a_step(capsys):
    from pathlib import Path

    tiny = str(Path(__file__).resolve().parents[1] / "recipes" / "tiny.toml")
    for fp8, says in (("false", "gathers per parallel.gather"), ("true", "gathers once a step (train.fp8")):
        assert cli.main(["plan", tiny, "--nproc", "1", "--set", f"train.fp8={fp8}"]) == 0
        header = capsys.readouterr().out.splitlines()[0]
        assert header.startswith("memory plan of") and says in header, header
        assert "qwen3_moe, 1.05M parameters," in header, header  # not "0.00105B"
        assert ", 1 process," in header, header  # not "1 processes"
