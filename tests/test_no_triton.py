"""fmoe on a CPU machine without Triton (pyproject installs it only with the test extra; a CUDA build
of torch brings its own): importing and training work, and the kernels take their torch references.

Triton's absence is simulated in a child process by a ``sys.meta_path`` finder that refuses
``triton`` and its submodules, installed before anything is imported, so the test holds on a
machine where Triton is installed (as in CI, which runs the kernels under its interpreter).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

WITHOUT_TRITON = r"""
import importlib.abc, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoTriton())

import importlib, pkgutil
import torch
import fmoe.kernels, fmoe.stages
for package in (fmoe.kernels, fmoe.stages):
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
from fmoe import data, recipe, train
from fmoe.kernels import _triton, cross_entropy, fused, permute

assert not _triton.HAS_TRITON and not permute.HAS_TRITON
logits = torch.randn(5, 300, requires_grad=True)
labels = torch.randint(0, 300, (5,))
loss = cross_entropy.cross_entropy(logits, labels)
assert torch.equal(loss, cross_entropy.cross_entropy_reference(logits, labels))
loss.backward()
h = torch.randn(4, 16)
assert torch.equal(fused.swiglu(h), fused.swiglu_reference(h))

root = sys.argv[1]
text = f"{root}/corpus.txt"
open(text, "w").write("the quick brown fox jumps over the lazy dog. " * 200)
data.build([text], f"{root}/ds", workers=1)
result = train.train(recipe.from_dict({
    "model": {"family": "qwen3_moe", "vocab_size": 264, "hidden_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 16, "intermediate_size": 32},
    "data": {"path": f"{root}/ds", "seq_len": 16},
    "train": {"steps": 2, "global_batch": 2, "microbatches": 1, "device": "cpu"},
    "optim": {"warmup": 1},
    "checkpoint": {"dir": f"{root}/ckpt"},
    "log": {"dir": f"{root}/log", "progress": False},
}))
assert len(result.losses) == 2 and all(l == l for l in result.losses)
assert not any(name == "triton" or name.startswith("triton.") for name in sys.modules)
print("trained without triton")
"""


def test_fmoe_imports_and_trains_on_cpu_without_triton(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a user's CPU machine
    env["OMP_NUM_THREADS"] = "1"
    child = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON, str(tmp_path)], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    assert "trained without triton" in child.stdout


def test_triton_is_a_test_dependency_not_a_runtime_one():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any(d.split(";")[0].strip().startswith("triton") for d in project["dependencies"])
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["test"])
