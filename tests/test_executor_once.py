"""The per-stage F, B and W sequence, the StepHooks loop and the loss bookkeeping exist once, in
``fmoe.runner``: every other module of the runtime runs stages through them (issue 28). A second
copy is how a new kind of stage output ends up handled in one executor and not in the other."""

from __future__ import annotations

import ast
from pathlib import Path

FMOE = Path(__file__).resolve().parents[1] / "fmoe"
# the calls that make up the sequence, and the one function of fmoe.runner allowed to make each
ONLY_IN = {
    "forward": "forward_stage",  # fmoe.stage.forward: F
    "backward_input": "backward_stage",  # B
    "backward_weight": "weight_grads",  # W
    "stage_inputs": "forward_stage",  # a stage's inputs from the carry and the batch
    "split_outputs": "forward_stage",  # carried outputs and loss terms
    "add_statistics": "forward_stage",
    "hooks.before": "run_steps",  # the StepHooks loop
    "hooks.taken": "run_steps",
}
# the references the executor's pieces are checked against call the stages themselves, on purpose:
# model_loss (the step as one plain autograd function), check_family (each stage once, under a
# watch that names what broke) and check_gradients (each stage's F/B/W alone against autograd)
REFERENCE = {
    ("runner.py", "model_loss"),
    ("check.py", "check_family"),
    ("check.py", "check_gradients"),
    ("check.py", "_autograd_gradients"),
}


def calls_outside_their_place() -> list[str]:
    found = []
    for path in sorted(p for p in FMOE.glob("*.py") if not p.is_symlink()):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef) or (path.name, func.name) in REFERENCE:
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                    if isinstance(f, ast.Attribute) and getattr(f.value, "id", None) == "hooks":
                        name = f"hooks.{f.attr}"
                    if name in ONLY_IN and not (path.name == "runner.py" and func.name == ONLY_IN[name]):
                        if path.name == "stage.py" and name in (
                            "forward",
                            "backward_input",
                            "backward_weight",
                        ):
                            continue  # fmoe.stage defines them (and calls its own helpers)
                        found.append(f"{path.name}:{node.lineno} {func.name}() calls {name}()")
    return found


def test_the_per_stage_sequence_and_the_hooks_loop_exist_once():
    assert calls_outside_their_place() == []


def test_the_check_sees_a_second_copy(tmp_path, monkeypatch):
    """The scan would catch the interpreter running a stage's F itself."""
    copy = tmp_path / "fmoe"
    copy.mkdir()
    for p in FMOE.glob("*.py"):
        if not p.is_symlink():
            (copy / p.name).write_text(p.read_text())
    (copy / "interpreter.py").write_text(
        (copy / "interpreter.py").read_text()
        + "\n\ndef _second_copy(stage, params, inputs, ctx):\n    return S.forward(stage, params, inputs, ctx)\n"
    )
    monkeypatch.setattr(__import__(__name__), "FMOE", copy)
    assert calls_outside_their_place() == [
        "interpreter.py:"
        + str(len((copy / "interpreter.py").read_text().splitlines()))
        + " _second_copy() calls forward()"
    ]
