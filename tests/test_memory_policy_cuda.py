"""The memory policy on a GPU: recomputation and offloading change no bit with the fused kernels, and an
offloaded tensor never comes back before its copy to the host has finished.

Marked ``cuda`` (``TRITON_INTERPRET=0 python3 -m pytest -m cuda tests/test_memory_policy_cuda.py``).
float32 and the math attention backend: every kernel of the step is then deterministic, so two runs
of one policy are bitwise equal and any difference between policies is the policy's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_batch, tiny_config

from fmoe import offload, runner
from fmoe.memory_policy import MemoryPolicy
from fmoe.stages import qwen3_moe

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

POLICIES = [
    MemoryPolicy(recompute="full"),
    MemoryPolicy(recompute="selective"),
    MemoryPolicy(offload=True),
    MemoryPolicy(merge_window=1, recompute="selective", recompute_roles=("mlp",), offload=True),
]


@pytest.fixture(autouse=True)
def offload_everything(monkeypatch):
    monkeypatch.setattr(offload, "MIN_BYTES", 0)  # the small tensors too: every copy is checked


def step(policy: MemoryPolicy | None = None) -> runner.StepResult:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = tiny_config(num_hidden_layers=3, mlp_only_layers=(0,), hidden_size=256, moe_intermediate_size=512,
                      intermediate_size=1024, num_attention_heads=4, head_dim=64)  # fmt: skip
    model = qwen3_moe.build(cfg)
    params = model.init(seed=1, device="cuda")
    batch = {k: v.cuda() for k, v in random_batch(cfg, 4, 512, seed=5).items()}
    with sdpa_kernel([SDPBackend.MATH]):
        return runner.run_sequential(model, params, batch, 4, memory=policy)


def unequal(a: runner.StepResult, b: runner.StepResult) -> list[str]:
    out = [] if torch.equal(a.loss, b.loss) else ["loss"]
    return out + [n for n in a.grads if not torch.equal(a.grads[n], b.grads[n])]


def test_every_policy_gives_bitwise_the_results_of_none_on_the_gpu():
    ref = step()
    assert not unequal(step(), ref), "the step itself is not deterministic here: no policy can be compared"
    for policy in POLICIES:
        window = MemoryPolicy(merge_window=policy.merge_window)
        base = ref if policy.merge_window == 0 else step(window)
        assert not unequal(step(policy), base), policy


def _restore_without_waiting(self):
    t = torch.empty_strided(self.host.shape, self.host.stride(), dtype=self.host.dtype, device=self.device)
    t.copy_(self.host, non_blocking=True)  # no wait for the copy's event: what the test must catch
    return t


def delayed(policy: MemoryPolicy) -> runner.StepResult:
    """The step with the copy stream held back ~1 s (a sleep queued before the step's copies), so
    every copy to the host is still pending when B asks for it: only the wait on its event gives
    B the values."""
    device = torch.device("cuda", torch.cuda.current_device())
    stream = offload._STREAMS.setdefault(device, torch.cuda.Stream(device))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000_000)
    return step(policy)


def test_an_offloaded_tensor_never_comes_back_before_its_copy_to_the_host():
    assert not unequal(delayed(MemoryPolicy(offload=True)), step())
    # The same step without the wait, in a process of its own: B then reads host memory the copy
    # has not written yet, which gives other results or, where it holds indices, a device-side
    # assert that ends the process's CUDA context (why it cannot run in this one).
    here = Path(__file__).resolve()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(here.parent), os.environ.get("PYTHONPATH")))),
    }
    child = subprocess.run([sys.executable, str(here), "--without-the-wait"], env=env, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    broken = child.returncode != 0 or "UNEQUAL" in child.stdout
    assert broken, (
        f"without the wait B still read the right values: the test proves nothing ({child.stdout!r})"
    )


GRAPHED_POLICIES = {
    "recompute_full": {"recompute": "full"},
    "recompute_selective": {"recompute": "selective"},
    "window1": {"merge_window": 1},
    "window1_selective_mlp": {"merge_window": 1, "recompute": "selective", "recompute_roles": ["mlp"]},
}


@pytest.mark.parametrize("memory", list(GRAPHED_POLICIES.values()), ids=list(GRAPHED_POLICIES))
def test_a_policy_under_cuda_graphs_is_bitwise_its_eager_run(tmp_path, dataset, memory):
    """`fmoe train` with train.cuda_graphs and a [memory] policy: the graph is captured with the
    policy's recomputation and merge windows, and its losses and parameters are bit for bit those
    of the eager run of the same recipe (the policy itself changes no bit: the test above)."""
    from fmoe import recipe as R
    from fmoe.train import train

    model = dict(
        family="qwen3_moe", vocab_size=384, hidden_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=128, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=128, intermediate_size=512, mlp_only_layers=[0], router_aux_loss_coef=0.01,
    )  # fmt: skip

    def run(folder: str, graphs: bool):
        recipe = {
            "model": model,
            "data": {"path": dataset, "seq_len": 256},
            "train": {"steps": 5, "global_batch": 4, "microbatches": 2, "device": "cuda", "dtype": "bfloat16",
                      "cuda_graphs": graphs},
            "optim": {"lr": 1e-3, "warmup": 2},
            "memory": memory,
            "checkpoint": {"dir": str(tmp_path / folder / "ckpt"), "every": 5, "keep": 1},
            "log": {"dir": str(tmp_path / folder / "log"), "every": 5, "progress": False},
        }  # fmt: skip
        return train(R.from_dict(recipe))

    eager, graphed = run("eager", False), run("graphed", True)
    assert graphed.losses == eager.losses
    for name, t in eager.params.items():
        assert torch.equal(graphed.params[name], t), name


if __name__ == "__main__" and sys.argv[1:] == ["--without-the-wait"]:
    offload.MIN_BYTES = 0
    reference = step()
    offload._Host.restore = _restore_without_waiting
    torch.cuda.synchronize()
    result = delayed(MemoryPolicy(offload=True))
    torch.cuda.synchronize()
    print("UNEQUAL" if unequal(result, reference) else "EQUAL", flush=True)
