"""Shared fixtures: tiny configs and batches made on the spot (no downloads)."""

from __future__ import annotations

import os

# Triton picks interpreter or compiler when a kernel is defined: set the flag before anything
# imports triton, so every kernel test in the session runs interpreted on the CPU. Under it the FP8
# kernels (quantization, GEMMs) take Triton on CPU tensors too, unless FMOE_KERNEL_BACKEND=torch;
# the layers' fused kernels (norms, SwiGLU, cross-entropy) take Triton on CUDA tensors only.
os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from fmoe.stages import qwen3_moe  # noqa: E402

# The environment of a process that measures its resident peak (``fmoe.memory`` on a CPU): a fixed
# mmap threshold, so every block above 64 KiB is a mapping of its own, returned when freed, and the
# resident peak follows the tensors'. glibc's default threshold is adaptive: a freed block raises it
# and later blocks stay resident when freed (a checkpoint save measured 7 MiB in some runs and
# 21-35 MiB in others). It is read when a process starts: set it for the processes a test spawns.
MEASURING_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}


@contextlib.contextmanager
def measuring_env() -> Iterator[None]:
    """Processes spawned inside this block start with ``MEASURING_ENV``."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in MEASURING_ENV.items():
            mp.setenv(name, value)
        yield


def tiny_config(**overrides) -> qwen3_moe.Qwen3MoeConfig:
    """A tiny Qwen3-MoE: 2 layers (one dense, one MoE unless overridden), 8 experts, top-2."""
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        intermediate_size=48,
        router_aux_loss_coef=0.01,
    )
    fields.update(overrides)
    return qwen3_moe.Qwen3MoeConfig(**fields)


@pytest.fixture
def compiled_kernels(monkeypatch):
    """The GPU tier's tests run the compiled kernels: not the interpreter, not the torch backend
    (``pytestmark = [..., pytest.mark.usefixtures("compiled_kernels")]``)."""
    from fmoe.kernels._triton import interpreting, use_triton

    monkeypatch.delenv("FMOE_KERNEL_BACKEND", raising=False)
    if interpreting():
        pytest.fail("TRITON_INTERPRET=1: run the cuda tier as `TRITON_INTERPRET=0 python3 -m pytest -m cuda`")
    assert use_triton(torch.empty(1, device="cuda"))
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 references are float32, not tf32


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> str:
    """A byte-tokenized dataset of 200 kB of the standard library's docstrings, built once; tests
    read it and never write to it."""
    from fmoe import data

    root = tmp_path_factory.mktemp("data")
    corpus = data.builtin_corpus(root / "corpus.txt", 200_000)
    data.build([corpus], root / "bytes", tokenizer="bytes", workers=1)
    return str(root / "bytes")


def random_batch(cfg, batch: int, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    return {"tokens": tokens, "labels": labels}


def compile_for_sm90(script: str, compiled: int, timeout: int = 600) -> None:
    """Run ``script`` (Triton kernels compiled to an sm_90 cubin with the ptxas bundled in triton, no
    GPU needed) in a process of its own without the interpreter, which lowers nothing; it must print
    ``compiled N`` for the ``compiled`` kernels it builds."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"compiled {compiled}" in proc.stdout, proc.stdout[-2000:]


def relative_error(g: torch.Tensor, ref: torch.Tensor) -> float:
    """``||g - ref|| / ||ref||`` in float64: blind to nothing (scale, sign, a missing term), unlike a
    cosine. A zero reference gives 0 for a zero ``g`` and inf otherwise; shapes must agree."""
    assert g.shape == ref.shape, (tuple(g.shape), tuple(ref.shape))
    g, ref = g.double(), ref.double()
    den = ref.norm().item()
    num = (g - ref).norm().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def assert_runner_matches_autograd(model, params, batch, num_microbatches: int = 2) -> None:
    """The sequential runner's loss is bitwise the plain autograd loss; gradients to 1e-6 relative."""
    from fmoe import runner

    result = runner.run_sequential(model, params, batch, num_microbatches=num_microbatches)
    leaves = {n: t.clone().requires_grad_() for n, t in params.items()}
    reference = runner.model_loss(model, leaves, batch, num_microbatches=num_microbatches)
    reference.backward()
    assert torch.equal(result.loss, reference.detach())
    assert set(result.grads) == set(params)
    for name, g in result.grads.items():
        assert relative_error(g, leaves[name].grad) <= 1e-6, name


def _pipeline_worker(rank, world, group, schedule_name, model, params, batch, microbatches):
    from fmoe import interpreter, pipeline, runner
    from fmoe.schedules.generators import generate

    ref = runner.run_sequential(model, params, batch, microbatches)
    schedule = generate(schedule_name, world, microbatches)
    names = pipeline.local_param_names(model, schedule, rank=rank)
    result = interpreter.pipeline_step(schedule, model, {n: params[n] for n in names}, batch, group)
    worst = max(relative_error(g, ref.grads[n]) for n, g in result.grads.items())
    return {"loss_equal": torch.equal(result.loss, ref.loss), "same_names": sorted(result.grads) == sorted(names),
            "worst_rel": worst}  # fmt: skip


def assert_pipeline_matches_sequential(
    schedule_name, model, params, batch, pp: int = 2, microbatches: int = 4
):
    """``schedule_name`` at ``pp`` on gloo: loss torch.equal to the sequential runner's, each rank's
    gradients exactly its own parameters' and within 1e-6 relative."""
    from fmoe import dist

    results = dist.spawn(
        _pipeline_worker, pp, (schedule_name, model, params, batch, microbatches), timeout_s=170
    )
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}"
        assert r.value["loss_equal"], f"rank {r.rank}: pipelined loss differs from the sequential one"
        assert r.value["same_names"], f"rank {r.rank} returned gradients for other parameters than it holds"
        assert r.value["worst_rel"] < 1e-6, f"rank {r.rank}: gradient relative error {r.value['worst_rel']}"
