"""fmoe's AdamW kernel: bit for bit its reference, torch.optim.AdamW's numbers, grads of any float dtype.

Kernels run under the Triton interpreter on CPU tensors (fp32 arithmetic in numpy, correctly rounded,
with a true fma), so the kernel and the reference agree exactly here. On a GPU the kernel is compared
with torch._fused_adamw_ itself (bit for bit with torch 2.11 on an H200; the test allows 4 ulps, for
torch versions whose kernel computes in double).
"""

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from fmoe.kernels import adamw  # noqa: E402
from fmoe.kernels._triton import interpreting, use_triton  # noqa: E402

B1, B2, EPS = 0.9, 0.95, 1e-8
# odd sizes: one element, less than a block, one past a block, two blocks and a bit; and empties
SHAPES = [(1,), (3, 7), (adamw.BLOCK + 1,), (2 * adamw.BLOCK + 7,), (0,), (0, 4)]


def _state(shapes, grad_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [(3 * torch.randn(s, generator=g)).to(grad_dtype) for s in shapes]
    exp_avgs = [0.1 * torch.randn(s, generator=g) for s in shapes]
    exp_avg_sqs = [0.01 * torch.rand(s, generator=g) for s in shapes]
    return params, grads, exp_avgs, exp_avg_sqs


def _clone(lists):
    return [[t.clone() for t in ts] for ts in lists]


def _lr(s: int) -> torch.Tensor:
    """A tensor schedule: warmup then decay, a 0-d float32 tensor as fmoe's schedules give."""
    return torch.tensor(2e-2 * min(1.0, (s + 1) / 2) * 0.9**s, dtype=torch.float32)


def test_kernel_runs_in_the_interpreter_here():
    assert interpreting() and use_triton(torch.zeros(1))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_kernel_equals_reference_bitwise_over_steps(grad_dtype, scaled, wd):
    kernel = _state(SHAPES, grad_dtype)
    ref = _clone(kernel)
    grads_before = [g.clone() for g in kernel[1]]
    for s in range(3):
        kw = dict(
            step=torch.tensor(float(s + 1)),
            lr=_lr(s),
            beta1=B1,
            beta2=B2,
            eps=EPS,
            weight_decay=wd,
            grad_scale=torch.tensor(0.25 + 0.3 * s) if scaled else None,
        )
        adamw.adamw_(*kernel, **kw)
        adamw.adamw_(*ref, **kw, reference=True)
    for got_list, want_list in zip(kernel, ref):
        for got, want in zip(got_list, want_list):
            assert torch.equal(got, want)
    for g, before in zip(kernel[1], grads_before):  # grads are read, never written
        assert torch.equal(g, before)
    p0 = _state(SHAPES, grad_dtype)[0]
    assert not torch.equal(kernel[0][3], p0[3])  # the step moved the params


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaled", [False, True])
def test_kernel_matches_torch_optim_adamw_over_5_steps(grad_dtype, scaled):
    shapes = [(5, 7), (adamw.BLOCK + 3,), (2,)]
    wd = 0.1
    params, grads, exp_avgs, exp_avg_sqs = _state(shapes, grad_dtype, seed=1)
    for t in (*exp_avgs, *exp_avg_sqs):
        t.zero_()  # torch.optim.AdamW starts from zero moments
    leaves = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(leaves, lr=1.0, betas=(B1, B2), eps=EPS, weight_decay=wd, foreach=False)
    for s in range(5):
        scale = torch.tensor(0.5 + 0.1 * s) if scaled else None
        lr = _lr(s)
        for leaf, g in zip(leaves, grads):
            leaf.grad = g.float() * (scale if scaled else 1.0)
        opt.param_groups[0]["lr"] = float(lr)
        opt.step()
        adamw.adamw_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            step=torch.tensor(float(s + 1)),
            lr=lr,
            beta1=B1,
            beta2=B2,
            eps=EPS,
            weight_decay=wd,
            grad_scale=scale,
        )
    # Two float32 implementations of the same elementwise update (no sums), over 5 steps; u = float32
    # eps. Each step each rounds m and v once (u relative) and p once (u |p| / 2), and computes the
    # update lr * m_hat / (sqrt(v_hat) + eps) + lr * wd * p to a few u (8 u: bias corrections, sqrt,
    # division, products); |m_hat / sqrt(v_hat)| <= 1 / sqrt(1 - B2) bounds the update. Differences
    # add at most linearly over the steps; a stated safety factor of 2.
    u, steps = torch.finfo(torch.float32).eps, 5
    lr_max = max(float(_lr(s)) for s in range(steps))
    update_max = lr_max * (1 / math.sqrt(1 - B2) + wd * max(float(p.abs().max()) for p in params))
    for p, m, v, leaf in zip(params, exp_avgs, exp_avg_sqs, leaves):
        st = opt.state[leaf]
        p_atol = 2 * steps * u * (float(p.abs().max()) + 8 * update_max)
        torch.testing.assert_close(p, leaf.detach(), rtol=0, atol=p_atol)
        torch.testing.assert_close(
            m, st["exp_avg"], rtol=0, atol=2 * steps * u * float(st["exp_avg"].abs().max())
        )
        torch.testing.assert_close(v, st["exp_avg_sq"], rtol=2 * steps * u, atol=0)


def test_python_step_and_lr_give_the_same_bits_as_tensors():
    a = _state(SHAPES[:3], torch.bfloat16)
    b = _clone(a)
    common = dict(beta1=B1, beta2=B2, eps=EPS, weight_decay=0.05)
    adamw.adamw_(*a, step=4, lr=3e-3, **common)
    adamw.adamw_(*b, step=torch.tensor(4.0), lr=torch.tensor(3e-3, dtype=torch.float64), **common)
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)


def test_empty_tensors_are_skipped_and_an_empty_list_is_fine():
    params, grads, exp_avgs, exp_avg_sqs = _state([(0,), (0, 3)], torch.bfloat16)
    adamw.adamw_(
        params, grads, exp_avgs, exp_avg_sqs, step=1, lr=1e-3, beta1=B1, beta2=B2, eps=EPS, weight_decay=0.1
    )
    assert [p.shape for p in params] == [(0,), (0, 3)]
    adamw.adamw_([], [], [], [], step=1, lr=1e-3, beta1=B1, beta2=B2, eps=EPS, weight_decay=0.1)


def test_zero_grads_only_decay_the_params():
    p, m, v = torch.ones(10), torch.zeros(10), torch.zeros(10)
    g = torch.zeros(10, dtype=torch.bfloat16)
    adamw.adamw_([p], [g], [m], [v], step=1, lr=0.1, beta1=B1, beta2=B2, eps=EPS, weight_decay=0.5)
    torch.testing.assert_close(p, torch.full((10,), 1 - 0.1 * 0.5))
    assert torch.equal(m, torch.zeros(10)) and torch.equal(v, torch.zeros(10))


def test_bad_inputs_are_refused_naming_the_argument():
    p, g, m, v = (torch.zeros(4) for _ in range(4))
    common = dict(step=1, lr=1e-3, beta1=B1, beta2=B2, eps=EPS, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"params\[0\].*float32"):
        adamw.adamw_([p.bfloat16()], [g], [m], [v], **common)
    with pytest.raises(ValueError, match=r"grads\[0\].*shape"):
        adamw.adamw_([p], [torch.zeros(5)], [m], [v], **common)
    with pytest.raises(ValueError, match=r"grads\[0\].*contiguous"):
        adamw.adamw_(
            [torch.zeros(2, 3)], [torch.zeros(3, 2).t()], [torch.zeros(2, 3)], [torch.zeros(2, 3)], **common
        )
    with pytest.raises(ValueError, match=r"grads\[0\].*float"):
        adamw.adamw_([p], [torch.zeros(4, dtype=torch.int32)], [m], [v], **common)
    with pytest.raises(ValueError, match="as long"):
        adamw.adamw_([p], [], [m], [v], **common)
    with pytest.raises(ValueError, match="grad_scale"):
        adamw.adamw_([p], [g], [m], [v], grad_scale=torch.tensor(1.0, dtype=torch.float64), **common)
    with pytest.raises(ValueError, match="step"):
        adamw.adamw_([p], [g], [m], [v], **{**common, "step": 0})
    with pytest.raises(ValueError, match="beta2"):
        adamw.adamw_([p], [g], [m], [v], **{**common, "beta2": 1.0})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_cuda_agrees_with_torch_fused_adamw_to_fp32_rounding(grad_dtype):
    """Against torch._fused_adamw_ on the fp32 copy of the (scaled) grads, over 3 steps."""
    dev = "cuda"
    shapes = [(1 << 16,), (999,), (3, 5)]
    params, grads, exp_avgs, exp_avg_sqs = (
        [t.to(dev) for t in ts] for ts in _state(shapes, grad_dtype, seed=2)
    )
    ref = [[t.clone() for t in ts] for ts in (params, exp_avgs, exp_avg_sqs)]
    for s in range(3):
        step, lr, scale = (
            torch.tensor(float(s + 1), device=dev),
            _lr(s).to(dev),
            torch.tensor(0.7, device=dev),
        )
        adamw.adamw_(
            params, grads, exp_avgs, exp_avg_sqs, step=step, lr=lr, beta1=B1, beta2=B2, eps=EPS,
            weight_decay=0.1, grad_scale=scale,
        )  # fmt: skip
        g32 = [g.float() * scale for g in grads]
        torch._fused_adamw_(
            ref[0], g32, ref[1], ref[2], [], [step] * len(shapes), lr=lr, beta1=B1, beta2=B2,
            weight_decay=0.1, eps=EPS, amsgrad=False, maximize=False,
        )  # fmt: skip
    for got_list, want_list in zip((params, exp_avgs, exp_avg_sqs), ref):
        for got, want in zip(got_list, want_list):
            torch.testing.assert_close(got, want, rtol=4 * 2**-24, atol=1e-12)


@pytest.mark.parametrize("reference", [False, True])
def test_found_inf_skips_the_step_on_the_device_and_a_zero_flag_does_not(reference):
    """A nonzero found_inf leaves p, m and v bit for bit as they were (the skip is a device flag,
    so no host sync); a zero one gives the ordinary step."""
    state = _state(SHAPES, torch.bfloat16)
    before = _clone(state)
    kw = dict(step=2, lr=1e-2, beta1=B1, beta2=B2, eps=EPS, weight_decay=0.1, reference=reference)
    adamw.adamw_(*state, **kw, found_inf=torch.tensor(1.0))
    for got_list, want_list in zip(state, before):
        for got, want in zip(got_list, want_list):
            assert torch.equal(got, want)
    plain = _clone(state)
    adamw.adamw_(*state, **kw, found_inf=torch.tensor(0.0))
    adamw.adamw_(*plain, **kw)
    for got_list, want_list in zip(state, plain):
        for got, want in zip(got_list, want_list):
            assert torch.equal(got, want)
    assert not torch.equal(state[0][0], before[0][0])  # the unskipped step moved the params
