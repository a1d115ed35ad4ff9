"""A user's family with a mistake in it is refused before any data or step (``fmoe.check``).

Each test writes the README's family (``my_gpt.py``, tests/test_user_family.py) with one mistake
into an empty folder and runs ``fmoe train`` on the README's recipe there: a broken contract ends
in one line naming the family, the stage, its layer and the parameter or output, exit 2, before the
data folder is built; a bug in the family's own code keeps its traceback, which ends in its file.
``check_gradients`` checks every stage's B and W in float64 on every shipped family (the README's:
tests/test_user_family.py runs the README's own test of it) and names a stage whose B or W is wrong.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from test_user_family import section_block

from fmoe import cli
from fmoe.check import FamilyError, GradientMismatch, check_family, check_gradients
from fmoe.stages.family import lookup
from fmoe.stages.spec import CustomGrad

FAMILY_TEXT = section_block("python my_gpt.py")
RECIPE_TEXT = section_block("toml my_gpt.toml")
ROUTER_RETURN = "    return probs, weights.to(x.dtype), ids\n"
# the stage after a layer's aggregate carries one output too many
AGGREGATE_TWICE = """
from fmoe.stages.decoder_stages import moe_aggregate_stage


def aggregate_twice(p, inputs, ctx):
    (h,) = moe_aggregate_stage(p, inputs, ctx)
    return h, h


def build(cfg):
    model = DECODER.build(cfg)
    stages = [dataclasses.replace(s, forward=aggregate_twice) if s.role == "aggregate" else s for s in model.stages]
    return dataclasses.replace(model, stages=tuple(stages))


FAMILY = dataclasses.replace(FAMILY, build=build)
"""


def line_of(text: str) -> str:
    """``my_gpt.py:<line>`` of the README family's line that starts (after its indent) with ``text``."""
    lines = [i for i, line in enumerate(FAMILY_TEXT.splitlines(), 1) if line.strip().startswith(text)]
    assert len(lines) == 1, text
    return f"my_gpt.py:{lines[0]} `{text}"


def family_with(old: str, new: str) -> str:
    """The README's family with ``old`` (which it holds once) replaced by ``new``."""
    assert FAMILY_TEXT.count(old) == 1, old
    return FAMILY_TEXT.replace(old, new)


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """An empty working folder on sys.path holding the README's recipe; ``my_gpt`` not yet imported."""
    (tmp_path / "my_gpt.toml").write_text(RECIPE_TEXT)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_gpt", raising=False)
    return tmp_path


MISTAKES = {
    "a wrong shape in attention_shapes": (
        family_with('"attn.c_attn.weight": (3 * cfg.n_embd,', '"attn.c_attn.weight": (2 * cfg.n_embd,'),
        ["stage 'layers.0.attn' (layer 0)", "operands computed from model.layers.0.attn.c_attn.weight "
         "(declared (128, 64))\n", line_of("q, k, v = linear(")],
    ),
    "a wrong shape in expert_shapes": (
        family_with('"mlp.experts.c_proj": (E, C, hidden)', '"mlp.experts.c_proj": (E, C, hidden // 2)'),
        ["stage 'layers.0.mlp' (layer 0)", "model.layers.0.mlp.experts.c_proj (declared (4, 64, 64))",
         "model.layers.0.mlp.experts.c_fc (declared (4, 128, 64))", "called from ", line_of("return grouped_linear(")],
    ),
    "a router returning two values": (
        family_with(ROUTER_RETURN, "    return weights.to(x.dtype), ids\n"),
        ["stage 'layers.0.attn' (layer 0)", "not enough values to unpack (expected 3, got 2)", "dec.router"],
    ),
    "int32 expert ids": (
        family_with(ROUTER_RETURN, "    return probs, weights.to(x.dtype), ids.int()\n"),
        ["stage 'layers.0.attn' (layer 0)", "expert_ids (output 2) is torch.int32",
         "(computed from model.layers.0.mlp.router.weight)", "int64"],
    ),
    "float64 router weights": (
        family_with(ROUTER_RETURN, "    return probs, weights.double(), ids\n"),
        ["stage 'layers.0.attn' (layer 0)", "weights (output 3) is torch.float64",
         "(computed from model.layers.0.mlp.router.weight)", "torch.float32 (the tokens' dtype)"],
    ),
    "expert ids out of range": (
        family_with(ROUTER_RETURN, "    return probs, weights.to(x.dtype), ids + cfg.n_expert\n"),
        ["stage 'layers.0.attn' (layer 0)", "expert_ids (output 2) hold", "ids must be in [0, 4)"],
    ),
    "a stage carrying one output too many": (
        FAMILY_TEXT + AGGREGATE_TWICE,
        ["stage 'layers.1.attn' (layer 1)", "too many values to unpack (expected 2)",
         "given 3 inputs (2 carried from stage 'layers.0.aggregate', batch field 'positions')"],
    ),
    "a parameter read but not declared": (
        family_with('p["attn.c_proj.weight"])', 'p["attn.proj.weight"])'),
        ["stage 'layers.0.attn' (layer 0)", "params['attn.proj.weight']", "model.layers.0.attn.proj.weight"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_family_mistake_is_refused_before_the_data_build_with_one_line_naming_the_place(
    user_folder, capsys, mistake
):
    text, names = MISTAKES[mistake]
    (user_folder / "my_gpt.py").write_text(text)
    code = cli.main(["train", "my_gpt.toml"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("fmoe: error: model family 'my_gpt', "), err
    for name in names:
        assert name in err, (name, err)
    assert not (user_folder / "data").exists() and not (user_folder / "runs").exists()


def test_the_readmes_example_line_is_what_fmoe_prints(user_folder, capsys):
    from test_user_family import README

    (user_folder / "my_gpt.py").write_text(MISTAKES["int32 expert ids"][0])
    assert cli.main(["train", "my_gpt.toml"]) == 2
    err = capsys.readouterr().err
    assert f"```text\n{err}```" in README, err


def test_fmoe_plan_refuses_a_broken_family_too(user_folder, capsys):
    (user_folder / "my_gpt.py").write_text(MISTAKES["int32 expert ids"][0])
    code = cli.main(["plan", "my_gpt.toml", "--nproc", "2"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "expert_ids (output 2) is torch.int32" in err, err


# the user's attention unpacks three chunks into two names: a ValueError raised by their own line
USER_BUG = family_with("    q, k, v = linear(", "    q, k = linear(")


def test_a_bug_in_the_familys_own_code_keeps_its_traceback_into_the_users_file(user_folder, capsys):
    (user_folder / "my_gpt.py").write_text(USER_BUG)
    with pytest.raises(ValueError, match=r"too many values to unpack \(expected 2\)") as caught:
        cli.main(["train", "my_gpt.toml"])
    last = traceback.extract_tb(caught.value.__traceback__)[-1]
    assert Path(last.filename) == user_folder / "my_gpt.py" and last.name == "attention", last
    assert "q, k = linear(" in last.line
    assert capsys.readouterr().err == ""
    assert not (user_folder / "data").exists()


def test_the_command_exits_1_with_the_traceback_of_a_bug_in_the_familys_code(user_folder):
    (user_folder / "my_gpt.py").write_text(USER_BUG)
    env = {**os.environ, "PYTHONPATH": str(user_folder), "OMP_NUM_THREADS": "1"}
    child = subprocess.run(
        [sys.executable, "-m", "fmoe", "train", "my_gpt.toml"],
        cwd=user_folder, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert child.returncode == 1, child.stderr[-3000:]
    lines = child.stderr.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):" and "fmoe: error:" not in child.stderr
    assert lines[-1] == "ValueError: too many values to unpack (expected 2)", lines[-4:]
    assert f'File "{user_folder / "my_gpt.py"}"' in lines[-4] and "in attention" in lines[-4], lines[-4:]


def test_shipped_recipes_pass_the_family_check():
    from fmoe import recipe as R

    recipes = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.toml"))
    assert len(recipes) >= 5
    for path in recipes:
        r = R.load(path)
        check_family(R.model_family(r.model_family), r.model)


# --------------------------------------------------------------------------------------------------
# check_gradients


def shipped_tiny_configs():
    import test_deepseek_v2
    import test_deepseek_v3
    import test_gpt_oss

    return {
        "qwen3_moe": tiny_config(router_aux_loss_coef=0.1),
        "deepseek_v2": test_deepseek_v2.tiny(),
        "deepseek_v3": test_deepseek_v3.tiny(),
        "gpt_oss": test_gpt_oss.tiny(),
    }


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"])
def test_every_shipped_familys_stages_pass_the_chained_float64_gradient_check(name):
    family, cfg = lookup(name), shipped_tiny_configs()[name]
    errors = check_gradients(family, cfg)
    model = family.build(cfg)
    # every stage's every trained parameter was compared (a buffer, the router bias, gets no gradient)
    for stage in model.stages:
        for param in set(stage.params) - set(model.buffers):
            assert f"{stage.name}: {param}" in errors, (stage.name, param)
    assert any(k.startswith("head: input") for k in errors)


def with_custom_aggregate(family, backward_scale: float):
    """``family`` whose aggregate stages carry a hand-written F/B/W whose B scales the residual's
    gradient by ``backward_scale`` (1: right)."""
    from fmoe.stages.decoder_stages import moe_aggregate_stage

    def forward(p, inputs, ctx):
        return moe_aggregate_stage(p, inputs, ctx), inputs

    def backward_input(p, saved, grad_outputs):
        h1, y, w = (t.detach().requires_grad_() for t in saved)
        (out,) = moe_aggregate_stage(p, (h1, y, w), None)
        grads = torch.autograd.grad(out, (h1, y, w), grad_outputs[0])
        return (grads[0] * backward_scale, grads[1], grads[2]), None

    custom = CustomGrad(forward, backward_input, lambda p, saved: {})

    def build(cfg):
        model = family.build(cfg)
        stages = [dataclasses.replace(s, custom=custom) if s.role == "aggregate" else s for s in model.stages]
        return dataclasses.replace(model, stages=tuple(stages))

    return dataclasses.replace(family, build=build)


def test_a_wrong_hand_written_b_fails_the_gradient_check_naming_the_stage_and_input():
    cfg = tiny_config()
    right = with_custom_aggregate(lookup("qwen3_moe"), 1.0)
    assert check_gradients(right, cfg)["layers.1.aggregate: input 0"] <= 1e-12
    with pytest.raises(
        GradientMismatch, match=r"stage 'layers.0.aggregate' \(layer 0\): B's gradient of input 0"
    ):
        check_gradients(with_custom_aggregate(lookup("qwen3_moe"), 1.5), cfg)


def test_a_w_that_misses_a_parameter_fails_the_gradient_check_naming_it():
    cfg = tiny_config(num_hidden_layers=1)
    family = lookup("qwen3_moe")

    def build(cfg):
        model = family.build(cfg)
        stage = model.stages[-1]  # the head: its W is hand-written and forgets the LM head's gradient

        def forward(p, inputs, ctx):
            return stage.forward(p, inputs, ctx), (p, inputs)

        def backward_input(p, saved, grad_outputs):
            params, (h, labels) = saved
            h = h.detach().requires_grad_()
            (loss,) = stage.forward(params, (h, labels), None)
            return (torch.autograd.grad(loss, h, grad_outputs[0])[0], None), None

        custom = CustomGrad(forward, backward_input, lambda p, saved: {})
        return dataclasses.replace(
            model, stages=(*model.stages[:-1], dataclasses.replace(stage, custom=custom))
        )

    broken = dataclasses.replace(family, build=build)
    with pytest.raises(GradientMismatch, match=r"stage 'head': W gives no gradient of model.norm.weight"):
        check_gradients(broken, cfg)


def test_the_family_check_names_a_family_error_as_bad_input():
    assert issubclass(FamilyError, ValueError) and cli.is_bad_input(FamilyError("x"), "train")
    assert not cli.is_bad_input(ValueError("x"), "train") and not cli.is_bad_input(KeyError("x"), "plan")


def test_fmoes_own_families_code_counts_as_family_code_not_as_fmoes_builders():
    """An exception raised in a family module (fmoe's or a user's) is that family's bug, a traceback;
    one raised by the runtime or the decoder builder reports what a family gave it, one line."""
    from fmoe import check, stage
    from fmoe.stages import decoder, qwen3_moe

    assert check._in_fmoe(decoder.__file__) and check._in_fmoe(stage.__file__)
    assert not check._in_fmoe(qwen3_moe.__file__) and not check._in_fmoe(__file__)
