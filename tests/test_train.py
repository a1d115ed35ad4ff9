"""fmoe train: kill and resume, crash-safe checkpoints, the embedded default, one-line errors."""

from __future__ import annotations

import pytest
import torch

from fmoe import checkpoint, checkpoint_write, cli
from fmoe import recipe as R
from fmoe.train import train

MODEL = dict(
    family="qwen3_moe",
    vocab_size=264,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    intermediate_size=32,
    router_aux_loss_coef=0.01,
)


def recipe_dict(tmp_path, dataset, **sections) -> dict:
    base = {
        "model": dict(MODEL),
        "data": {"path": dataset, "seq_len": 32},
        "train": {"steps": 6, "global_batch": 4, "microbatches": 2, "device": "cpu"},
        "optim": {"lr": 1e-2, "warmup": 2},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 3, "keep": 2},
        "log": {"dir": str(tmp_path / "log"), "every": 1, "progress": False},
    }
    for name, fields in sections.items():
        base[name] = {**base.get(name, {}), **fields}
    return base


def toml_text(d: dict) -> str:
    lines = []
    for section, fields in d.items():
        lines.append(f"[{section}]")
        for k, v in fields.items():
            lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\") + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def test_kill_and_resume_equals_straight_run_bitwise(tmp_path, dataset):
    straight = train(R.from_dict(recipe_dict(tmp_path / "a", dataset)))
    first = train(R.from_dict(recipe_dict(tmp_path / "b", dataset)), stop_after=3)
    assert first.step == 3
    second = train(R.from_dict(recipe_dict(tmp_path / "b", dataset)))
    assert second.step == 6
    assert first.losses + second.losses == straight.losses
    assert len(straight.losses) == 6
    for name, t in straight.params.items():
        assert torch.equal(second.params[name], t), name


def test_a_crash_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, dataset, monkeypatch):
    recipe = R.from_dict(recipe_dict(tmp_path, dataset))
    train(recipe, stop_after=3)
    good = checkpoint.latest(recipe.checkpoint.dir)
    assert good is not None

    real_write = checkpoint_write._write_tensors

    def failing_write(path, tensors, metadata):
        real_write(path, dict(list(tensors.items())[:1]), metadata)  # a partial file ...
        raise OSError("disk full")  # ... then the writer dies

    monkeypatch.setattr(checkpoint_write, "_write_tensors", failing_write)
    with pytest.raises(Exception, match="disk full"):
        train(recipe)
    monkeypatch.undo()
    assert checkpoint.latest(recipe.checkpoint.dir) == good
    params, _, state = checkpoint.load(good)
    assert state["step"] == 3 and len(params) > 0


def test_the_embedded_default_loss_falls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = R.load(
        cli.default_recipe(), {"train.steps": 40, "log.progress": False, "data.builtin_bytes": 300_000}
    )
    result = train(recipe)
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < first - 1.0, (first, last)
    assert (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().count("\n") == 4


# ------------------------------------------------------------------------------------------------
# bad input: one line naming the field or file, exit status 2


def run_cli(args, capsys) -> tuple[int, str]:
    code = cli.main(args)
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize(
    "section, fields, message",
    [
        ("train", {"stepz": 3}, r"train: unknown key 'stepz'"),
        ("train", {"steps": "many"}, r"train\.steps must be int, got str 'many'"),
        (
            "model",
            {"num_experts_per_tok": 9},
            r"num_experts_per_tok \(9\) must be between 1 and num_experts \(4\)",
        ),
        ("data", {"path": "/nonexistent/data"}, r"data\.path '/nonexistent/data' holds no dataset"),
    ],
)
def test_bad_recipes_fail_with_one_line_naming_the_field(tmp_path, dataset, capsys, section, fields, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml_text(recipe_dict(tmp_path, dataset, **{section: fields})))
    code, err = run_cli(["train", str(path)], capsys)
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("fmoe: error: ")
    assert str(path) in err
    import re

    assert re.search(message, err), err


def test_a_missing_recipe_file_is_named(tmp_path, capsys):
    code, err = run_cli(["train", str(tmp_path / "nope.toml")], capsys)
    assert code == 2 and "nope.toml: recipe file not found" in err


def test_a_truncated_checkpoint_file_is_named(tmp_path, dataset, capsys):
    d = recipe_dict(tmp_path, dataset)
    train(R.from_dict(d), stop_after=3)
    ckpt = checkpoint.latest(d["checkpoint"]["dir"])
    model_file = next(
        p for p in (ckpt.iterdir() if hasattr(ckpt, "iterdir") else []) if p.name == "model.safetensors"
    )
    model_file.write_bytes(model_file.read_bytes()[:100])
    path = tmp_path / "r.toml"
    path.write_text(toml_text(d))
    code, err = run_cli(["train", str(path)], capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert "model.safetensors" in err, err


def test_a_tokenizer_vocab_mismatch_is_named(tmp_path, dataset, capsys):
    path = tmp_path / "r.toml"
    path.write_text(toml_text(recipe_dict(tmp_path, dataset, model={"vocab_size": 100})))
    code, err = run_cli(["train", str(path)], capsys)
    assert code == 2 and "tokenizer/vocab mismatch" in err and "vocab_size is 100" in err, err


def test_training_starts_from_an_imported_hugging_face_checkpoint(tmp_path, dataset, capsys):
    from fmoe import hf
    from fmoe.stages import qwen3_moe

    d = recipe_dict(tmp_path, dataset)
    cfg = R.from_dict(d).model
    weights = qwen3_moe.init_params(cfg, seed=42)
    hf.export_hf("qwen3_moe", cfg, weights, tmp_path / "hf")
    code, err = run_cli(
        ["checkpoint", "import-hf", str(tmp_path / "hf"), "--out", d["checkpoint"]["dir"]], capsys
    )
    assert code == 0, err
    result = train(R.from_dict(d), stop_after=1)
    assert result.step == 1
    # the first step started from the imported weights: its loss is that of the imported model
    first = train(R.from_dict(recipe_dict(tmp_path / "fresh", dataset)), stop_after=1)
    assert result.losses[0] != first.losses[0]


def test_context_parallel_on_a_family_without_it_is_refused_up_front(tmp_path, dataset):
    d = recipe_dict(tmp_path, dataset, parallel={"cp": 2})
    d["model"] = {"family": "gpt_oss", "vocab_size": 264}
    with pytest.raises(R.RecipeError, match=r"model family 'gpt_oss' has no context-parallel attention"):
        train(R.from_dict(d))
