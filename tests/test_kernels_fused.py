"""Fused SwiGLU and RMSNorm kernels match their references and autograd; their fused FP8 outputs
are bit-for-bit the quantization of their unfused outputs.

Kernels run under the Triton interpreter on CPU tensors. The interpreter truncates fp32 -> bf16
where GPUs round to nearest, so bf16 outputs are compared to the FP32 reference within one bf16 ulp.
"""

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from fmoe.kernels import fp8_quant as fq  # noqa: E402
from fmoe.kernels import fused  # noqa: E402
from fmoe.kernels._triton import interpreting  # noqa: E402


def _randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _within_bf16_ulp(got: torch.Tensor, want: torch.Tensor) -> bool:
    want = want.float()
    return bool(torch.all((got.float() - want).abs() <= want.abs() * 2**-7 + 1e-6 * want.abs().max()))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def test_kernels_run_in_the_interpreter_here():
    assert interpreting()


def _swiglu_f32(h: torch.Tensor) -> torch.Tensor:
    g, u = h.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def test_swiglu_matches_reference():
    h = _randn(150, 640, seed=1, scale=3).bfloat16()
    a = fused.swiglu(h)
    assert a.shape == (150, 320) and a.dtype == torch.bfloat16
    assert _within_bf16_ulp(a, _swiglu_f32(h))


def test_swiglu_quant_equals_quantize_of_swiglu_bitwise():
    h = _randn(150, 2 * 320, seed=2, scale=3).bfloat16()
    a = fused.swiglu(h)
    got, want = fused.swiglu_quant(h, pow2_scales=True), fq.quantize_act(a, pow2_scales=True)
    assert _bits_equal(got.data, want.data) and _bits_equal(got.scale, want.scale)
    offs = torch.tensor([40, 40, 150], dtype=torch.int32)
    rows, cols = fused.swiglu_quant(h, offs, with_t=True)
    rows_want, cols_want = fq.quantize_act_t(a, offs, with_rows=True)
    for x, y in [(rows.data, rows_want.data), (rows.scale, rows_want.scale)]:
        assert _bits_equal(x, y)
    for x, y in [(cols.data, cols_want.data), (cols.scale, cols_want.scale)]:
        assert _bits_equal(x, y)


def test_swiglu_quant_reference_is_close():
    # kernel vs the all-torch path: same quantization of (nearly) the same bf16 values
    h = _randn(64, 512, seed=3).bfloat16()
    got, want = fused.swiglu_quant(h), fused.swiglu_quant_reference(h)
    deq, deq_want = fq.dequantize_act(got), fq.dequantize_act(want)
    assert float((deq - deq_want).norm() / deq_want.norm()) < 0.02


def test_swiglu_backward_matches_autograd():
    h = _randn(96, 2 * 256, seed=4, scale=2).bfloat16()
    da = _randn(96, 256, seed=5).bfloat16()
    dh = fused.swiglu_backward(h, da)
    h64 = h.double().requires_grad_()
    g, u = h64.chunk(2, dim=-1)
    (torch.nn.functional.silu(g) * u).backward(da.double())
    assert dh.shape == h.shape and _within_bf16_ulp(dh, h64.grad)


@pytest.mark.parametrize("inter", [320, 256])  # a partial last group; whole groups
@pytest.mark.parametrize("pow2", [False, True])
def test_swiglu_with_its_fp8_rows_is_swiglu_and_the_bits_of_quantizing_it(inter, pow2):
    h = _randn(70, 2 * inter, seed=11, scale=3).bfloat16()
    a, q = fused.swiglu(h, quantize=True, pow2_scales=pow2)
    assert torch.equal(a, fused.swiglu(h))  # the same bf16 output as without quantize
    want = fq.quantize_act(a, pow2_scales=pow2)
    assert _bits_equal(q.data, want.data) and _bits_equal(q.scale, want.scale)
    assert q.scale.stride() == want.scale.stride()


@pytest.mark.parametrize("pow2", [False, True])
def test_swiglu_backward_with_its_fp8_rows_is_the_gradient_and_the_bits_of_quantizing_it(pow2):
    h = _randn(70, 2 * 256, seed=12, scale=2).bfloat16()
    da = _randn(70, 256, seed=13).bfloat16()
    dh, q = fused.swiglu_backward(h, da, quantize=True, pow2_scales=pow2)
    assert torch.equal(dh, fused.swiglu_backward(h, da))
    want = fq.quantize_act(dh, pow2_scales=pow2)
    # groups 0-1 are the gate half's, 2-3 the up half's: a swap of the halves' scales fails here
    assert _bits_equal(q.data, want.data) and _bits_equal(q.scale, want.scale)
    with pytest.raises(ValueError, match="inter must be a multiple of 128"):
        fused.swiglu_backward(h[:, :320], da[:, :160], quantize=True)
    only = fused.swiglu_backward_quant(h, da, pow2_scales=pow2)  # the rows alone, no dh written
    assert _bits_equal(only.data, q.data) and _bits_equal(only.scale, q.scale)
    assert only.scale.stride() == q.scale.stride()


def test_the_references_of_the_quantizing_swiglus_are_their_quantizations(monkeypatch):
    h = _randn(40, 2 * 128, seed=14, scale=2).bfloat16()
    da = _randn(40, 128, seed=15).bfloat16()
    a, q = fused.swiglu_reference(h), fq.quantize_act_reference(fused.swiglu_reference(h))
    dh = fused.swiglu_backward_reference(h, da)
    monkeypatch.setenv("FMOE_KERNEL_BACKEND", "torch")
    a2, q2 = fused.swiglu(h, quantize=True)
    dh2, dq2 = fused.swiglu_backward(h, da, quantize=True)
    assert torch.equal(a2, a) and _bits_equal(q2.data, q.data) and torch.equal(q2.scale, q.scale)
    want = fq.quantize_act_reference(dh)
    assert torch.equal(dh2, dh) and _bits_equal(dq2.data, want.data) and torch.equal(dq2.scale, want.scale)
    dq3 = fused.swiglu_backward_quant(h, da)
    assert _bits_equal(dq3.data, want.data) and torch.equal(dq3.scale, want.scale)


@pytest.mark.parametrize("hidden", [384, 256])
def test_rmsnorm_matches_reference_and_quant_is_bitwise(hidden):
    x = _randn(77, hidden, seed=6, scale=4).bfloat16()
    w = (1 + _randn(hidden, seed=7, scale=0.1)).bfloat16()
    y, rstd, q = fused.rmsnorm(x, w, 1e-6, quantize=True)
    xf = x.double()
    rstd_want = (xf.square().mean(-1) + 1e-6).rsqrt()
    # float32 rstd against float64: the mean of H squares is within about u * sqrt(H) relative (rounding
    # errors of random sign, any summation order or SIMD width), rsqrt halves that and adds ~u; a
    # stated factor of 2 on both: rtol = u * (sqrt(H) + 2), u = float32 eps (2.6e-6 for H = 384).
    rstd_rtol = torch.finfo(torch.float32).eps * (math.sqrt(hidden) + 2)
    assert torch.allclose(rstd.double(), rstd_want, rtol=rstd_rtol, atol=0)
    assert _within_bf16_ulp(y, xf * rstd_want[:, None] * w.double())
    want = fq.quantize_act(y)
    assert _bits_equal(q.data, want.data) and _bits_equal(q.scale, want.scale)
    y2, rstd2 = fused.rmsnorm(x, w, 1e-6)
    assert torch.equal(y2, y) and torch.equal(rstd2, rstd)


def test_rmsnorm_backward_matches_autograd():
    x = _randn(70, 256, seed=8, scale=2).bfloat16()
    w = (1 + _randn(256, seed=9, scale=0.1)).float()
    dy = _randn(70, 256, seed=10).bfloat16()
    _, rstd = fused.rmsnorm(x, w)
    dx, dw = fused.rmsnorm_backward(dy, x, w, rstd)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    (x64 * (x64.square().mean(-1, keepdim=True) + 1e-6).rsqrt() * w64).backward(dy.double())
    assert _within_bf16_ulp(dx, x64.grad)
    assert dw.dtype == torch.float32 and torch.allclose(dw.double(), w64.grad, rtol=1e-4, atol=1e-4)


def test_fused_shape_errors_name_the_field():
    with pytest.raises(ValueError, match="h:"):
        fused.swiglu(torch.randn(4, 7))
    with pytest.raises(ValueError, match="da:"):
        fused.swiglu_backward(torch.randn(4, 8), torch.randn(4, 3))
    with pytest.raises(ValueError, match="w:"):
        fused.rmsnorm(torch.randn(4, 8), torch.randn(7))
    with pytest.raises(ValueError, match="rstd"):
        fused.rmsnorm_backward(torch.randn(4, 8), torch.randn(4, 8), torch.randn(8), torch.randn(3))


def _rotary_plain(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rows = cos.repeat(x.shape[0] // cos.shape[0], 1)[:, None].double()
    srows = sin.repeat(x.shape[0] // sin.shape[0], 1)[:, None].double()
    xd = x.double()
    return xd * rows + torch.cat((-xd[..., half:], xd[..., :half]), dim=-1) * srows


@pytest.mark.parametrize("rows", [5, 20])  # tables shared by 4 sequences, or one row per token
def test_rotary_matches_plain_rope_and_its_transpose(rows):
    T, heads, d = 20, 3, 64
    x = _randn(T, heads, d, seed=11, scale=2)
    # arbitrary tables (halves differ), so each half of cos and sin is read where it belongs
    cos, sin = _randn(rows, d, seed=12), _randn(rows, d, seed=13)
    out = fused.rotary(x, cos, sin)
    # float32 x*cos + rot(x)*sin: two products and a sum, each rounded once (u/2 relative, u = float32
    # eps), so |out - exact| <= u * (|x||cos| + |rot x||sin|) elementwise, whatever the CPU (1.01: the
    # second-order u^2 terms; an FMA only lowers the error)
    half = d // 2
    magnitude = (
        x.abs().double() * cos.abs().repeat(T // rows, 1)[:, None].double()
        + torch.cat((x[..., half:], x[..., :half]), dim=-1).abs().double()
        * sin.abs().repeat(T // rows, 1)[:, None].double()
    )
    assert torch.all(
        (out.double() - _rotary_plain(x, cos, sin)).abs() <= 1.01 * torch.finfo(torch.float32).eps * magnitude
    )
    assert torch.equal(out, fused.rotary_reference(x, cos, sin))
    # backward=True is the transpose: <rotary(x), g> == <x, rotary(g, backward=True)>
    g = _randn(T, heads, d, seed=14)
    lhs = (_rotary_plain(x, cos, sin) * g.double()).sum()
    rhs = (x.double() * fused.rotary(g, cos, sin, backward=True).double()).sum()
    assert torch.allclose(lhs, rhs, rtol=1e-5)
    assert torch.equal(
        fused.rotary(g, cos, sin, backward=True), fused.rotary_reference(g, cos, sin, backward=True)
    )


def test_rotary_bf16_rounds_once():
    x = _randn(64, 4, 128, seed=15, scale=3).bfloat16()
    cos, sin = _randn(16, 128, seed=16).bfloat16(), _randn(16, 128, seed=17).bfloat16()
    got = fused.rotary(x, cos, sin)
    assert got.dtype == torch.bfloat16
    assert _within_bf16_ulp(got, _rotary_plain(x, cos, sin))


def test_rotary_shape_errors_name_the_tensor():
    x, table = torch.zeros(6, 2, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="cos, sin"):
        fused.rotary(x, table, table)  # 4 rows do not divide 6 tokens
    with pytest.raises(ValueError, match="x: expected"):
        fused.rotary(x[:, :, :7], torch.zeros(6, 7), torch.zeros(6, 7))
