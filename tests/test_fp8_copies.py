"""The expert masters' FP8 copies, kept from one step to the next: AdamW's fused step writes them in
its pass over the masters (bit for bit ``adamw_`` then ``quantize_weight``), ``fmoe.optim.step``
leaves them equal to ``quantize_weight`` of the new params whatever the transformation, an FP8 step's
GEMMs read them instead of quantizing the masters, and ``fmoe train`` with them is bitwise the run
that quantizes each master at its first use in every step, resumed runs included.

Kernels run under the Triton interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
from test_train import recipe_dict

from fmoe import optim, optim_composed
from fmoe import recipe as R
from fmoe import train as trainer
from fmoe.kernels import adamw, fp8_quant
from fmoe.kernels._triton import interpreting
from fmoe.kernels.fp8_quant import Fp8Weight, empty_weight, quantize_weight
from fmoe.stages import fp8_mode
from fmoe.stages.primitives import fp8_training, linear

B1, B2, EPS = 0.9, 0.95, 1e-8


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == fp8_quant.FP8_DTYPE else t


def assert_same_weight(a: Fp8Weight, b: Fp8Weight) -> None:
    for field in ("data", "scale", "data_t", "scale_t"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.shape == y.shape and torch.equal(_bits(x), _bits(y)), field


def _state(shape, grad_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, generator=g)
    grad = (3 * torch.randn(shape, generator=g)).to(grad_dtype)
    return p, grad, 0.1 * torch.randn(shape, generator=g), 0.01 * torch.rand(shape, generator=g)


# ------------------------------------------------------------------------------------------------
# the fused kernel


# a stacked expert weight of whole blocks; one of partial blocks on both dims (200 = 128 + 72 rows,
# 136 = 128 + 8 columns); several experts with a partial block. Each feature (bf16 and fp32
# gradients, the clip factor, weight decay, a skipped step) in some case, none in all: the
# interpreter takes seconds a case
@pytest.mark.parametrize(
    "shape, grad_dtype, scaled, wd, skip",
    [
        ((2, 256, 256), torch.bfloat16, True, 0.1, False),
        ((200, 136), torch.float32, False, 0.0, False),
        ((3, 130, 256), torch.bfloat16, True, 0.1, True),
        ((200, 136), torch.bfloat16, False, 0.1, False),
    ],
)
def test_fused_step_is_adamw_then_quantize_weight_bit_for_bit(shape, grad_dtype, scaled, wd, skip):
    assert interpreting(), "tests/conftest.py sets TRITON_INTERPRET=1: the kernel itself runs here"
    p, g, m, v = _state(shape, grad_dtype, seed=len(shape) + int(skip))
    ref, fused = [t.clone() for t in (p, m, v)], [t.clone() for t in (p, m, v)]
    out = empty_weight(shape, "cpu")
    for step in (1, 2):  # the second step reads the moments the first wrote
        kw = dict(
            step=torch.tensor(float(step)), lr=torch.tensor(3e-2), beta1=B1, beta2=B2, eps=EPS,
            weight_decay=wd, grad_scale=torch.tensor(0.7) if scaled else None,
            found_inf=torch.tensor(1.0 if skip else 0.0),
        )  # fmt: skip
        adamw.adamw_([ref[0]], [g], [ref[1]], [ref[2]], **kw)
        adamw.adamw_fp8_([fused[0]], [g], [fused[1]], [fused[2]], [out], **kw)
        for name, a, b in zip(("p", "m", "v"), ref, fused):
            assert torch.equal(a, b), name
        assert_same_weight(out, quantize_weight(ref[0]))
    assert torch.equal(fused[0], p) == skip  # a skipped step keeps p, and its copy is p's


def test_the_fused_kernel_quantizes_each_block_of_the_value_it_wrote():
    """Broken on purpose: quantizing the pre-step value (the copy made before the update) is caught."""
    p, g, m, v = _state((2, 256, 256), torch.bfloat16, seed=7)
    before = quantize_weight(p)
    out = empty_weight(p.shape, "cpu")
    kw = dict(step=1, lr=1e-2, beta1=B1, beta2=B2, eps=EPS, weight_decay=0.0)
    adamw.adamw_fp8_([p], [g], [m], [v], [out], **kw)
    assert_same_weight(out, quantize_weight(p))
    with pytest.raises(AssertionError):
        assert_same_weight(out, before)


def test_copies_of_the_wrong_shape_or_dtype_are_refused_naming_the_field():
    p, g, m, v = _state((2, 256, 128), torch.bfloat16, seed=1)
    kw = dict(step=1, lr=1e-2, beta1=B1, beta2=B2, eps=EPS, weight_decay=0.0)
    wrong = empty_weight((2, 128, 256), "cpu")
    with pytest.raises(ValueError, match=r"copies\[0\]\.data: expected a contiguous \(2, 256, 128\)"):
        adamw.adamw_fp8_([p], [g], [m], [v], [wrong], **kw)
    half = empty_weight((2, 256, 128), "cpu")
    half = Fp8Weight(half.data, half.scale.half(), half.data_t, half.scale_t)
    with pytest.raises(ValueError, match=r"copies\[0\]\.scale: .*torch.float32"):
        adamw.adamw_fp8_([p], [g], [m], [v], [half], **kw)
    with pytest.raises(ValueError, match="1 params but 0 copies"):
        adamw.adamw_fp8_([p], [g], [m], [v], [], **kw)


# ------------------------------------------------------------------------------------------------
# fmoe.optim.step(fp8_copies=)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "experts": torch.randn(2 * 256 * 128, generator=g),  # a flat shard, as the trainer holds it
        "proj": torch.randn(128, 256, generator=g),
        "norm": torch.randn(256, generator=g),
    }


@pytest.mark.parametrize("composed", [False, True], ids=["fused_adamw", "composed_adamw"])
def test_optim_step_leaves_each_copy_the_quantization_of_its_new_param(composed, monkeypatch):
    """AdamW's fused step takes the copies in its own kernel; a transformation without a fused step
    (optax's composed AdamW: update + apply) has them quantized after. Either way the params and
    state are those of the same step without copies, bit for bit."""
    from fmoe import optim_fused

    monkeypatch.setattr(optim_fused, "KERNEL_MIN_NUMEL", 0)  # the step without copies: fmoe's kernel too
    fused_calls = []
    real = adamw.adamw_fp8_
    monkeypatch.setattr(adamw, "adamw_fp8_", lambda *a, **k: fused_calls.append(len(a[0])) or real(*a, **k))
    inner = optim_composed.adamw(1e-2, B1, B2, EPS, 0.1) if composed else optim.adamw(1e-2, B1, B2, EPS, 0.1)
    tx = optim.chain(optim.clip_by_global_norm(1.0), inner)
    params, plain = _params(), _params()
    grads = {n: (2 * torch.randn(t.shape, generator=torch.Generator().manual_seed(9))).bfloat16()
             for n, t in params.items()}  # fmt: skip
    state, plain_state = tx.init(params), tx.init(plain)
    copies = {"experts": empty_weight((2, 256, 128), "cpu"), "proj": empty_weight((128, 256), "cpu")}
    for _ in range(2):
        params, state = optim.step(
            tx, {n: g.clone() for n, g in grads.items()}, state, params, fp8_copies=copies
        )
        plain, plain_state = optim.step(tx, {n: g.clone() for n, g in grads.items()}, plain_state, plain)
        for n in params:
            assert torch.equal(params[n], plain[n]), n
        for k in state:
            assert torch.equal(state[k], plain_state[k]), k
        assert_same_weight(copies["experts"], quantize_weight(params["experts"].view(2, 256, 128)))
        assert_same_weight(copies["proj"], quantize_weight(params["proj"]))
    assert fused_calls == ([] if composed else [2, 2])  # both copied params, in one call a step


def test_optim_step_refuses_copies_that_are_not_of_a_param_naming_it():
    tx = optim.adamw(1e-2)
    params = _params()
    grads = {n: torch.zeros_like(t) for n, t in params.items()}
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"fp8_copies\['nope'\]: no such parameter"):
        optim.step(tx, grads, state, params, fp8_copies={"nope": empty_weight((128, 256), "cpu")})
    with pytest.raises(ValueError, match=r"fp8_copies\['proj'\]: a copy of shape \(256, 256\)"):
        optim.step(tx, grads, state, params, fp8_copies={"proj": empty_weight((256, 256), "cpu")})


# ------------------------------------------------------------------------------------------------
# fp8_training(weights=)


def test_an_fp8_gemm_reads_the_given_copy_and_quantizes_again_after_a_write(monkeypatch):
    quantized = []
    real = fp8_mode._quantize_weight
    monkeypatch.setattr(fp8_mode, "_quantize_weight", lambda w: quantized.append(w.shape) or real(w))
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 128, generator=g).bfloat16(), torch.randn(256, 128, generator=g)
    with fp8_training():
        lazy = linear(x, w)
    assert quantized == [w.shape]
    with fp8_training(weights=[(w, quantize_weight(w))]):
        given = linear(x, w)
    assert quantized == [w.shape] and torch.equal(given, lazy)  # the copy, nothing quantized
    with fp8_training(weights=[(w, quantize_weight(-w))]):  # a copy of other values: it is what is read
        assert torch.equal(linear(x, w), -lazy)
        w.mul_(-1)  # a write to the weight (its version moves): the copy is not of it any more
        assert torch.equal(linear(x, w), -lazy) and quantized == [w.shape, w.shape]


# ------------------------------------------------------------------------------------------------
# fmoe train


def _fp8_recipe(tmp_path, dataset, name: str, **train):
    d = recipe_dict(
        tmp_path / name, dataset,
        train={"steps": 4, "fp8": True, "dtype": "bfloat16", "microbatches": 2, **train},
        checkpoint={"every": 2}, log={"every": 2},
    )  # fmt: skip
    d["model"].update(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                      moe_intermediate_size=128, intermediate_size=256)  # fmt: skip
    return R.from_dict(d)


@pytest.fixture
def torch_kernels(monkeypatch):
    # the FP8 GEMMs' plain-torch references: a training run through the Triton interpreter would
    # take an hour (the fused kernel itself is tested above; on the GPU, tests/test_fp8_copies_cuda.py)
    monkeypatch.setenv("FMOE_KERNEL_BACKEND", "torch")


def test_an_fp8_run_on_kept_copies_is_bitwise_the_run_that_quantizes_every_step(
    tmp_path, dataset, monkeypatch, torch_kernels
):
    """4 steps with the optimizer's copies (and 2 + a resume + 2), against 4 steps that quantize each
    master at its first use in every step: the same losses and final masters, bit for bit. With
    the copies no expert weight is quantized inside a step."""
    expert_shapes = {(4, 256, 128), (4, 128, 128)}  # gate_up and down, stacked over the 4 experts
    quantized = []
    real = fp8_mode._quantize_weight
    monkeypatch.setattr(fp8_mode, "_quantize_weight", lambda w: quantized.append(tuple(w.shape)) or real(w))

    kept = trainer.train(_fp8_recipe(tmp_path, dataset, "kept"))
    in_steps = [s for s in quantized if s in expert_shapes]
    assert in_steps == [], in_steps  # read from the copies
    assert quantized, "the dense projections are still quantized in each step"

    quantized.clear()
    trainer.train(_fp8_recipe(tmp_path, dataset, "resumed"), stop_after=2)
    resumed = trainer.train(
        _fp8_recipe(tmp_path, dataset, "resumed")
    )  # copies made again from the checkpoint

    monkeypatch.setattr(trainer, "fp8_copies", lambda recipe, run, shards: {})
    quantized.clear()
    lazy = trainer.train(_fp8_recipe(tmp_path, dataset, "lazy"))
    assert sum(s in expert_shapes for s in quantized) == 2 * 2 * 4  # two weights, two layers, four steps

    assert kept.losses == lazy.losses and kept.losses[2:] == resumed.losses, (kept.losses, lazy.losses)
    for n in lazy.params:
        assert torch.equal(kept.params[n], lazy.params[n]), n
        assert torch.equal(resumed.params[n], lazy.params[n]), n


def test_a_copy_of_a_weight_the_step_does_not_hand_over_as_its_master_is_refused(
    tmp_path, dataset, monkeypatch, torch_kernels
):
    monkeypatch.setattr(
        trainer, "fp8_copies", lambda recipe, run, shards: {"embed": empty_weight((264, 128), "cpu")}
    )
    with pytest.raises(
        ValueError, match=r"fp8_copies\['embed'\]: not an expert weight this rank holds whole"
    ):
        trainer.train(_fp8_recipe(tmp_path, dataset, "bad"))
