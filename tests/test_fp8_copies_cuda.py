"""The expert masters' FP8 copies on the GPU: AdamW's fused step compiled, bit for bit ``adamw_`` then
``quantize_weight`` at a Qwen3-30B-A3B layer's expert shapes, and ``fmoe train`` (eager and under
CUDA graphs) on the optimizer's copies bitwise the run that quantizes each master in every step."""

from __future__ import annotations

import pytest
import torch
from test_cuda import GRAPHED_MODELS

from fmoe.kernels import adamw
from fmoe.kernels.fp8_quant import empty_weight, quantize_weight

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("compiled_kernels"),
]


def _same(a, b) -> bool:
    return (
        all(
            torch.equal(getattr(a, f).view(torch.uint8), getattr(b, f).view(torch.uint8))
            for f in ("data", "data_t")
        )
        and torch.equal(a.scale, b.scale)
        and torch.equal(a.scale_t, b.scale_t)
    )


# Qwen3-30B-A3B's gate_up and down (a slice of the 128 experts), and partial blocks on both dims
@pytest.mark.parametrize("shape", [(16, 1536, 2048), (16, 2048, 768), (3, 200, 136)])
@pytest.mark.parametrize("skip", [False, True])
def test_compiled_fused_step_is_adamw_then_quantize_weight_bit_for_bit(shape, skip):
    g = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(shape, device="cuda", generator=g)
    grad = torch.randn(shape, device="cuda", generator=g).bfloat16()
    m, v = (
        0.1 * torch.randn(shape, device="cuda", generator=g),
        0.01 * torch.rand(shape, device="cuda", generator=g),
    )
    ref, fused = [t.clone() for t in (p, m, v)], [t.clone() for t in (p, m, v)]
    out = empty_weight(shape, "cuda")
    for step in (1, 2):
        kw = dict(step=torch.tensor(float(step), device="cuda"), lr=torch.tensor(1e-2, device="cuda"),
                  beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                  grad_scale=torch.tensor(0.6, device="cuda"),
                  found_inf=torch.tensor(float(skip), device="cuda"))  # fmt: skip
        adamw.adamw_([ref[0]], [grad], [ref[1]], [ref[2]], **kw)
        adamw.adamw_fp8_([fused[0]], [grad], [fused[1]], [fused[2]], [out], **kw)
        for name, a, b in zip("pmv", ref, fused):
            assert torch.equal(a, b), name
        assert _same(out, quantize_weight(ref[0]))
    assert torch.equal(fused[0], p) == skip


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graphs"])
def test_fmoe_train_on_kept_copies_is_bitwise_the_run_that_quantizes_every_step(
    tmp_path, dataset, monkeypatch, graphs
):
    from fmoe import optim_fused
    from fmoe import recipe as R
    from fmoe import train as trainer
    from fmoe.stages import fp8_mode

    # the small test model's masters: fmoe's AdamW kernel in both runs (the fused one writes copies)
    monkeypatch.setattr(optim_fused, "KERNEL_MIN_NUMEL", 0)
    fused_calls, quantized = [], []
    real_fused, real_quant = adamw.adamw_fp8_, fp8_mode._quantize_weight
    monkeypatch.setattr(adamw, "adamw_fp8_", lambda *a, **k: fused_calls.append(1) or real_fused(*a, **k))
    monkeypatch.setattr(fp8_mode, "_quantize_weight", lambda w: quantized.append(w.dim()) or real_quant(w))

    def run(folder):
        recipe = {
            "model": GRAPHED_MODELS["qwen3"],
            "data": {"path": dataset, "seq_len": 256},
            "train": {"steps": 6, "global_batch": 4, "microbatches": 2, "device": "cuda", "dtype": "bfloat16",
                      "fp8": True, "cuda_graphs": graphs},
            "optim": {"lr": 1e-3, "warmup": 2},
            "checkpoint": {"dir": str(tmp_path / folder / "ckpt"), "every": 3, "keep": 1},
            "log": {"dir": str(tmp_path / folder / "log"), "every": 2, "progress": False},
        }  # fmt: skip
        return trainer.train(R.from_dict(recipe))

    kept = run("kept")
    assert (
        fused_calls and 3 not in quantized
    )  # the fused kernel ran; no stacked expert weight quantized in a step
    monkeypatch.setattr(trainer, "fp8_copies", lambda recipe, run, shards: {})
    fused_calls.clear()
    lazy = run("lazy")
    assert not fused_calls and 3 in quantized
    assert kept.losses == lazy.losses
    for name, t in lazy.params.items():
        assert torch.equal(kept.params[name], t), name
