"""The fused blocks of ``fmoe.stages.layers`` (RMSNorm, SwiGLU, the MoE output sum and the expert
permutation's gather-only backward) against the plain torch ops they replace.

On CUDA the blocks run ``fmoe.kernels.fused``; here the switch is forced on so the same autograd
Functions run their kernels under the Triton interpreter. Kernels compute in float32, so float32
inputs are compared to float64 autograd of the plain ops.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from fmoe.kernels import fused  # noqa: E402
from fmoe.kernels._triton import use_triton  # noqa: E402
from fmoe.stages import layers  # noqa: E402


def _randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.setattr(layers, "_fused", use_triton)


def _grads(fn, *inputs, upstream):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out.backward(upstream.to(out.dtype))
    return out.detach(), [t.grad for t in leaves if t.requires_grad]


# float32 kernels against float64: the largest float32 sum in these blocks has H = 200 terms (the
# MoE output's weight gradient; RMSNorm sums 128, its weight gradient 30 rows). A float32 sum of n
# terms in any order (any CPU, SIMD width, thread count) is within (n - 1) u of the sum of its
# terms' magnitudes (Higham's worst case, u = float32 eps), and the terms here are of the size of
# the outputs, so the tolerance is 200 u relative to (1 + the largest output): 2.4e-5.
SUM_TOL = 200 * torch.finfo(torch.float32).eps


def _close(got, want, tol=SUM_TOL):
    got, want = got.double(), want.double()
    assert (got - want).abs().max() <= tol * (1 + want.abs().max()), (got - want).abs().max()


def _compare(fn, inputs, kernels_on_fixture, monkeypatch, tol=SUM_TOL):
    """fn on float32 inputs with the kernels vs the plain ops on float64."""
    out_shape = fn(*[t.double() if t.is_floating_point() else t for t in inputs]).shape
    up = _randn(*out_shape, seed=99)
    got, got_g = _grads(fn, *inputs, upstream=up)
    monkeypatch.setattr(layers, "_fused", lambda t: False)
    want, want_g = _grads(fn, *[t.double() if t.is_floating_point() else t for t in inputs], upstream=up)
    _close(got, want, tol)
    assert len(got_g) == len(want_g)
    for g, w in zip(got_g, want_g):
        _close(g, w, tol)


def test_fused_rms_norm_matches_plain_ops(kernels_on, monkeypatch):
    x, w = _randn(2, 5, 3, 128, seed=0, scale=3.0), 1 + 0.1 * _randn(128, seed=1)
    _compare(lambda x, w: layers.rms_norm(x, w, 1e-6), (x, w), kernels_on, monkeypatch)


def test_fused_swiglu_matches_plain_ops(kernels_on, monkeypatch):
    h = _randn(37, 2 * 96, seed=2, scale=2.0)
    _compare(layers.swiglu, (h,), kernels_on, monkeypatch)


def test_fused_moe_output_matches_plain_ops(kernels_on, monkeypatch):
    T, k, H = 23, 4, 200  # H not a power of two: masked columns
    h1, y, w = _randn(1, T, H, seed=3), _randn(T, k, H, seed=4), _randn(T, k, seed=5).softmax(-1)
    _compare(layers.moe_output, (h1, y, w), kernels_on, monkeypatch)


def test_moe_sum_kernel_rounds_once_in_bf16():
    T, k, H = 9, 8, 64
    r, y = _randn(T, H, seed=6).bfloat16(), _randn(T, k, H, seed=7).bfloat16()
    w = _randn(T, k, seed=8).softmax(-1).bfloat16()
    want = (r.double() + torch.einsum("tkh,tk->th", y.double(), w.double())).float()
    got = fused.moe_sum(r, y, w)
    assert got.dtype == torch.bfloat16
    # one rounding of an fp32 sum: within a bf16 ulp (the interpreter truncates, GPUs round)
    assert torch.all((got.float() - want).abs() <= want.abs() * 2**-7 + 1e-6)


def test_moe_sum_shape_errors_name_the_arguments():
    with pytest.raises(ValueError, match="r, y, w"):
        fused.moe_sum(torch.zeros(3, 8), torch.zeros(3, 2, 8), torch.zeros(3, 3))


@pytest.mark.parametrize("top_k", [1, 3])
def test_permutation_backward_is_the_gather_of_the_plain_backward(top_k):
    T, H = 11, 6
    x = _randn(T, H, seed=9).double()
    ids = torch.randint(0, 4, (T, top_k), generator=torch.Generator().manual_seed(10))
    order = torch.argsort(ids.reshape(-1), stable=True)
    fn = lambda x: layers.unpermute_rows(layers.permute_rows(x, order, top_k) * 2.0, order, top_k)  # noqa: E731
    up = _randn(T, top_k, H, seed=11).double()
    got, (gx,) = _grads(fn, x, upstream=up)
    plain = lambda x: (x.index_select(0, order // top_k) * 2.0)[torch.argsort(order)].view(T, top_k, H)  # noqa: E731
    want, (wx,) = _grads(plain, x, upstream=up)
    assert torch.equal(got, want)
    assert torch.allclose(gx, wx, rtol=0, atol=1e-12)
    assert torch.allclose(gx, 2.0 * up.sum(1), rtol=0, atol=1e-12)


def test_fused_cross_entropy_matches_plain_ops(kernels_on, monkeypatch):
    logits = _randn(19, 300, seed=12, scale=4.0)
    labels = torch.randint(0, 300, (19,), generator=torch.Generator().manual_seed(13))
    labels[3] = -100
    fn = lambda x: layers.cross_entropy(x, labels)  # noqa: E731
    got, (g,) = _grads(fn, logits, upstream=torch.tensor(2.0))
    monkeypatch.setattr(layers, "_fused", lambda t: False)
    want, (w,) = _grads(fn, logits.double(), upstream=torch.tensor(2.0))
    _close(got, want)
    _close(g, w)
    assert torch.all(g[3] == 0)


@pytest.mark.parametrize("per_token", [False, True])
def test_fused_rotary_matches_plain_ops(kernels_on, monkeypatch, per_token):
    b, s, heads, d = 2, 7, 3, 32
    positions = torch.randint(0, 50, (b, s)) if per_token else torch.arange(3, 3 + s)
    cos, sin = layers.rotary_cos_sin(positions, d, 10_000.0, torch.float32)
    x = _randn(b, s, heads, d, seed=9, scale=2.0)

    def fn(x):
        # the tables follow x's dtype, as gqa_attention builds them
        return layers.rotate_heads(x, cos.to(x.dtype), sin.to(x.dtype))

    _compare(fn, (x,), kernels_on, monkeypatch)
