"""The README's "Write your own model family" section, run as a user would run it.

The section's blocks are tagged with the file they are: ```python my_gpt.py (the family, a module
outside fmoe), ```toml my_gpt.toml (its recipe) and ```bash my_gpt (the commands). This test writes
the two files into an empty folder, puts it on PYTHONPATH and runs the commands there in order, as
printed: train on one process, on two pipeline ranks (torchrun, gloo), then export, which fmoe
refuses by name for a family without a Hugging Face mapping. It also runs the section's own test,
``test_my_gpt.py``: every stage's derived B and W against autograd in float64, chained through the
whole model (``fmoe.check.check_gradients``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import relative_error

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
SECTION = "## Write your own model family"


def section_block(tag: str) -> str:
    """The one code block of the section whose fence reads ```<tag> (e.g. "python my_gpt.py")."""
    assert SECTION in README, f"the README lacks its section {SECTION!r}"
    body = README.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(rf"```{re.escape(tag)}\n(.*?)```", body, flags=re.S)
    assert len(blocks) == 1, f"{SECTION}: expected one ```{tag} block, found {len(blocks)}"
    return blocks[0]


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """An empty folder holding the README's my_gpt.py and my_gpt.toml, importable from this process."""
    (tmp_path / "my_gpt.py").write_text(section_block("python my_gpt.py"))
    (tmp_path / "my_gpt.toml").write_text(section_block("toml my_gpt.toml"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_gpt", raising=False)
    return tmp_path


def test_the_readme_family_test_checks_every_stages_b_and_w_against_autograd_in_float64(
    user_folder, monkeypatch
):
    """The section's test file (``fmoe.check.check_gradients``, chained through the whole model) passes."""
    (user_folder / "test_my_gpt.py").write_text(section_block("python test_my_gpt.py"))
    monkeypatch.delitem(sys.modules, "test_my_gpt", raising=False)
    import my_gpt
    import test_my_gpt

    from fmoe.stages.family import lookup

    test_my_gpt.test_my_gpt_stages_b_and_w_equal_autograd_in_float64()
    family = lookup("my_gpt")
    cfg = family.config_class(n_layer=1, n_embd=16, n_head=2, n_expert=8, top_k=2, expert_hidden=24)
    model = family.build(cfg)
    assert set(family.init_params(cfg)) == set(family.param_shapes(cfg)) == set(model.param_names())
    assert [s.role for s in model.stages] == [
        "embed",
        "attn",
        "dispatch",
        "mlp",
        "combine",
        "aggregate",
        "head",
    ]
    assert my_gpt.FAMILY is family


def test_the_readme_family_checks_its_config_and_counts_the_weights_a_token_touches(user_folder):
    from fmoe.stages.family import lookup

    family = lookup("my_gpt")
    with pytest.raises(ValueError, match="n_embd"):
        family.config_class(n_embd=30, n_head=4)
    cfg = family.config_class(n_layer=3, n_embd=32, n_head=4, n_expert=8, top_k=2, expert_hidden=48)
    # 6 x the weights one token's GEMMs read (the embedding tables are lookups, norms are not GEMMs;
    # of each layer's experts a token reads top_k of n_expert), plus 6 x the causal score and value
    # GEMMs (2 x 2 x C x seq/2 per layer forward, x3 with the backward)
    touched = 0.0
    for name, shape in family.param_shapes(cfg).items():
        if len(shape) < 2 or name in ("model.wte.weight", "model.wpe.weight"):
            continue
        share = cfg.top_k / cfg.n_expert if ".mlp.experts." in name else 1.0
        touched += share * torch.Size(shape).numel()
    seq = 64
    expected = 6 * touched + 6 * cfg.n_layer * cfg.n_embd * seq
    assert family.train_flops_per_token(cfg, seq) == pytest.approx(expected, rel=1e-12)


def read_losses(log_dir: Path) -> list[float]:
    """The losses a run logged to its metrics.jsonl, in step order."""
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [r["loss"] for r in rows]


def this_pythons_torchrun(folder: Path) -> Path:
    """A folder whose ``torchrun`` is this interpreter's, ``python -m torch.distributed.run`` (what
    the torchrun script runs): a venv that reuses a system torch has no torchrun of its own, and the
    one further on PATH would start another Python, which imports another fmoe."""
    folder.mkdir()
    script = folder / "torchrun"
    script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m torch.distributed.run "$@"\n')
    script.chmod(0o755)
    return folder


def test_the_readme_family_trains_on_one_and_two_pipeline_ranks_and_export_is_refused_by_name(
    user_folder, tmp_path_factory
):
    from fmoe import checkpoint, recipe

    commands = [
        line.strip()
        for line in section_block("bash my_gpt").splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    bin_dir = this_pythons_torchrun(tmp_path_factory.mktemp("bin") / "bin")
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PYTHONPATH", None)  # the commands set it themselves, as printed
    ran = []
    for command in commands:
        child = subprocess.run(
            ["bash", "-c", command], cwd=user_folder, env=env, capture_output=True, text=True, timeout=300
        )
        ran.append((shlex.split(command), child))
    words = [w for w, _ in ran]
    assert [w[1] for w in words] == ["fmoe", "torchrun", "fmoe"], words
    assert words[0][2] == "train" and "parallel.pp=2" in words[1] and "export-hf" in words[2]
    for w, child in ran[:2]:
        assert child.returncode == 0, f"{shlex.join(w)}\n{child.stderr[-3000:]}"

    # the same steps on one process and on two pipeline ranks: float32 sums in another order (a few
    # ulps of 1.2e-7 per step), far inside 1e-5 over these ten steps; and the loss falls
    one, two = read_losses(user_folder / "runs" / "my_gpt"), read_losses(user_folder / "runs" / "pp2")
    assert len(one) == len(two) >= 2 and one[-1] < one[0] - 0.5, (one, two)
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(one, two)), (one, two)
    params_one, _, _ = checkpoint.load(checkpoint.latest(user_folder / "runs" / "my_gpt" / "checkpoints"))
    params_two, _, _ = checkpoint.load(checkpoint.latest(user_folder / "runs" / "pp2" / "checkpoints"))
    assert set(params_two) == set(params_one) and "model.wpe.weight" in params_one
    for name, p in params_one.items():
        assert relative_error(params_two[name], p) <= 1e-5, name
    # the checkpoint runs outside the trainer, as the README says
    from fmoe.stages.family import lookup

    cfg = recipe.load(user_folder / "my_gpt.toml").model
    tokens = torch.arange(16).view(1, 16)
    logits = lookup("my_gpt").logits(cfg, params_one, tokens)
    assert logits.shape == (1, 16, cfg.vocab_size) and torch.isfinite(logits).all()

    # export: refused with one line naming the family, exit 2, nothing written
    _, export = ran[2]
    assert export.returncode == 2, export.stderr[-2000:]
    last = export.stderr.strip().splitlines()[-1]
    assert last.startswith("fmoe: error: ") and "'my_gpt'" in last and "Hugging Face" in last, last
    assert not (user_folder / "hf").exists()
