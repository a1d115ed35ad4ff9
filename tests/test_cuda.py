"""The GPU tier: compiled Triton kernels against their plain-torch references at real shapes and
ragged edges, bf16 and FP8 training steps against float32, and the SDPA attention backends.

Marked ``cuda`` and skipped without a GPU (the CPU suite runs the same kernels under Triton's
interpreter). On a GPU machine:

    TRITON_INTERPRET=0 python3 -m pytest -m cuda

Tolerances, from the formats: bf16 keeps 8 significant bits (a rounding is off by <= 2^-9
relative), float32 24 (2^-24); E4M3 keeps 4 (2^-4 per quantized operand). Where a kernel and its
reference do the same float32 operations in another order, results differ by a few float32 ulps
before the final rounding, so a 16-bit result is within one ulp of the reference's (2^-8 relative).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("compiled_kernels"),
]

BF16_ULP = 2.0**-8  # one unit in the last place of bf16, relative
F32_EPS = 2.0**-24


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _randn(*shape: int, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed), device="cuda") * scale).to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _within_ulps(
    got: torch.Tensor, want: torch.Tensor, ulps: float = 1.0, terms: torch.Tensor | None = None
) -> bool:
    """|got - want| <= ulps x one ulp of got's dtype at |want|, plus ``terms`` (a bound of the
    float32 error before the final rounding, for elements where the summed terms cancel), plus the
    dtype's smallest normal."""
    eps = torch.finfo(got.dtype).eps
    tiny = torch.finfo(got.dtype).tiny
    diff = (got.double() - want.double()).abs()
    bound = ulps * eps * want.double().abs() + tiny
    if terms is not None:
        bound = bound + terms.double()
    return bool(torch.all(diff <= bound))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and torch.equal(a, b)


def _ragged_offs(rows: int, experts: int, seed: int) -> torch.Tensor:
    """Cumulative end offsets of ``experts`` groups over ``rows`` rows, with empty experts first,
    in the middle and last, and boundaries that are not multiples of 128."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(experts, generator=g)
    weights[[0, experts // 2, experts - 1]] = 0.0
    counts = torch.floor(weights / weights.sum() * rows).long()
    counts[1] += rows - counts.sum()
    return torch.cumsum(counts, 0).to(torch.int32).cuda()


def _activations(rows: int, cols: int, seed: int) -> torch.Tensor:
    """bf16 activations whose columns span 1e-6 .. 1e3, with an all-zero row."""
    x = (
        _randn(rows, cols, seed=seed)
        * torch.logspace(-6, 3, cols, device="cuda")[
            torch.randperm(cols, generator=_gen(seed + 1), device="cuda")
        ]
    )
    x[1] = 0.0
    return x.to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# FP8 quantization: bitwise equal to the references


@pytest.mark.parametrize("shape", [(4096, 2048), (4113, 1600)], ids=["aligned", "ragged"])
def test_quantize_act_compiled_equals_reference_bitwise(shape):
    from fmoe.kernels import fp8_quant as fq

    x = _activations(*shape, seed=1)
    for pow2 in (False, True):
        got, want = fq.quantize_act(x, pow2_scales=pow2), fq.quantize_act_reference(x, pow2_scales=pow2)
        assert _bits_equal(got.data, want.data) and _bits_equal(got.scale, want.scale)


def test_quantize_act_t_grouped_compiled_equals_reference_bitwise():
    from fmoe.kernels import fp8_quant as fq

    x = _activations(32768 + 77, 768, seed=2)
    offs = _ragged_offs(x.shape[0], 128, seed=3)
    torch.empty(4 * x.numel(), dtype=torch.uint8, device=x.device).fill_(0xFF)  # unwritten bytes show
    rows, cols = fq.quantize_act_t(x, offs, with_rows=True)
    want_rows, want_cols = fq.quantize_act_t_reference(x, offs, with_rows=True)
    assert _bits_equal(rows.data, want_rows.data) and _bits_equal(rows.scale, want_rows.scale)
    for field in ("data", "scale", "group_start", "group_len"):
        assert _bits_equal(getattr(cols, field), getattr(want_cols, field)), field


def test_merged_fp8_wgrad_gathers_its_rows_bitwise_as_the_copied_rows(monkeypatch):
    # a step's merged expert wgrad at Qwen3 shapes (8 microbatches x 4096 tokens x top-8, 128
    # experts, hidden 2048, expert width 768): quantizing the rows where they lie gives the bits of
    # quantizing them copied into one tensor, and so does the GEMM that follows
    from fmoe.kernels import fp8_quant as fq
    from fmoe.stages import primitives

    parts = []
    for i in range(8):
        n = 32768 + 5 * i
        offs = _ragged_offs(n, 128, seed=40 + i)
        x, dy = _activations(n, 768, seed=50 + i), _activations(n, 2048, seed=60 + i)
        parts.append(primitives.GroupedWeightGrad(x, dy, offs, 128, fp8=True))
    gathered = primitives.merge_grouped_weight_grads(parts)
    monkeypatch.setattr(fq, "GATHER_MAX_PARTS", 1)  # the copy: scatter the rows, then quantize
    copied = primitives.merge_grouped_weight_grads(parts)
    assert _bits_equal(gathered, copied)


def test_requantized_fp8_rows_compiled_equal_reference_bitwise():
    # the merged expert wgrad's output gradients, kept as the FP8 rows B quantized: 8 micro-batches'
    # rows at Qwen3's down width, requantized along tokens where they lie, and one micro-batch's
    # alone (W unmerged): the bits of quantizing their values (bits times scale) along tokens
    from fmoe.kernels import fp8_quant as fq

    parts, n = [], 0
    for i in range(8):
        rows = 32768 + 5 * i
        parts.append(fq.quantize_act(_activations(rows, 2048, seed=70 + i)))
        n += rows
    offs = _ragged_offs(n, 128, seed=80)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(81)).cuda()
    sizes = torch.tensor([p.data.shape[0] for p in parts], device="cuda")
    starts = torch.cumsum(sizes, 0) - sizes
    src_part = (torch.searchsorted(torch.cumsum(sizes, 0), perm, right=True)).to(torch.int32)
    src_row = (perm - starts[src_part.long()]).to(torch.int32)
    got = fq.quantize_act_t_gathered(parts, src_part, src_row, offs)
    values = torch.cat([fq.dequantize_act(p) for p in parts])[perm]
    want = fq.quantize_act_t_reference(values, offs)
    for field in ("data", "scale", "group_start", "group_len"):
        assert _bits_equal(getattr(got, field), getattr(want, field)), field
    one_offs = _ragged_offs(parts[0].data.shape[0], 128, seed=82)
    got = fq.quantize_act_t(parts[0], one_offs)
    want = fq.quantize_act_t_reference(fq.dequantize_act(parts[0]), one_offs)
    assert _bits_equal(got.data, want.data) and _bits_equal(got.scale, want.scale)


@pytest.mark.parametrize(
    "shape", [(1536, 2048), (8, 1536, 2048), (4, 300, 520)], ids=["dense", "experts", "ragged"]
)
def test_quantize_weight_compiled_equals_reference_bitwise(shape):
    from fmoe.kernels import fp8_quant as fq

    w = _randn(*shape, seed=4, scale=0.02)
    # both copies come from one launch: poison the memory they will take, so no byte left unwritten
    # can match the reference by chance
    torch.empty(2 * w.numel() + (1 << 20), dtype=torch.uint8, device=w.device).fill_(0xFF)
    got, want = fq.quantize_weight(w), fq.quantize_weight_reference(w)
    for field in ("data", "scale", "data_t", "scale_t"):
        assert _bits_equal(getattr(got, field), getattr(want, field)), field


def test_tile_map_compiled_equals_reference():
    from fmoe.kernels import fp8_quant as fq

    rows = 32768 + 77
    offs = _ragged_offs(rows, 128, seed=5)
    got, want = fq.tile_map(offs, rows, 128), fq.tile_map_reference(offs, rows, 128)
    assert got.cap == want.cap
    for field in ("expert", "row", "group_end", "first_tile", "num_tiles"):
        assert torch.equal(getattr(got, field).long(), getattr(want, field).long()), field


# ---------------------------------------------------------------------------------------------
# FP8 GEMMs: against the float32 GEMM of the dequantized operands.
# The products of E4M3 values are exact in float32; Hopper's FP8 tensor cores accumulate each
# 128-deep block with about 14 significant bits before the kernel adds it in float32 (DeepSeek-V3,
# section 3.3.2), so the relative error is bounded by ~2^-13, well under 2^-10.

FP8_GEMM_REL = 2.0**-10


def test_fp8_gemm_nt_dense_compiled_equals_dequantized_reference():
    from fmoe.kernels import fp8_gemm as fg
    from fmoe.kernels import fp8_quant as fq

    for M, N, K in ((4096, 1536, 2048), (4113, 520, 1600)):
        a = fq.quantize_act(_randn(M, K, seed=6, dtype=torch.bfloat16))
        w = fq.quantize_weight(_randn(N, K, seed=7, scale=0.02))
        got = fg.fp8_gemm_nt(a, w.data, w.scale, out_dtype=torch.float32)
        want = fg.fp8_gemm_nt_reference(a, w.data, w.scale, out_dtype=torch.float32)
        assert _rel(got, want) < FP8_GEMM_REL, (M, N, K)


def test_fp8_grouped_gemm_forward_and_wgrad_compiled_equal_references():
    from fmoe.kernels import fp8_gemm as fg
    from fmoe.kernels import fp8_quant as fq

    T, E, N, K = 32768 + 77, 128, 1536, 2048
    offs = _ragged_offs(T, E, seed=8)
    a = fq.quantize_act(_randn(T, K, seed=9, dtype=torch.bfloat16))
    w = fq.quantize_weight(_randn(E, N, K, seed=10, scale=0.02))
    got = fg.fp8_gemm_nt(a, w.data, w.scale, offs, out_dtype=torch.float32)
    want = fg.fp8_gemm_nt_reference(a, w.data, w.scale, offs, out_dtype=torch.float32)
    assert _rel(got, want) < FP8_GEMM_REL

    dy = _randn(T, N, seed=11, dtype=torch.bfloat16)
    x = _randn(T, K, seed=12, dtype=torch.bfloat16)
    dyt, xt = fq.quantize_act_t(dy, offs), fq.quantize_act_t(x, offs)
    got_w = fg.fp8_gemm_wgrad(dyt, xt, grouped=True, out_dtype=torch.float32)
    want_w = fg.fp8_gemm_wgrad_reference(dyt, xt, out_dtype=torch.float32)
    assert _rel(got_w, want_w) < FP8_GEMM_REL
    empty = (torch.diff(offs, prepend=offs.new_zeros(1)) == 0).nonzero().flatten()
    assert len(empty) >= 3 and torch.count_nonzero(got_w[empty]) == 0  # empty experts: zero gradients
    # the scale prefetch (on or off by Triton release: PREFETCH_SCALES_BY_TRITON) moves the scales'
    # loads, not the arithmetic: the other setting gives the same bits (the last expert is empty:
    # a prefetching kernel masks its first load; compute-sanitizer memcheck runs this test clean)
    other_wgrad = fg.fp8_gemm_wgrad(
        dyt, xt, grouped=True, out_dtype=torch.float32, config=_other_prefetch(fg.WGRAD_CONFIG)
    )
    assert _bits_equal(other_wgrad, got_w)
    other_nt = fg.fp8_gemm_nt(
        a, w.data, w.scale, offs, out_dtype=torch.float32, config=_other_prefetch(fg.DEFAULT_CONFIG)
    )
    assert _bits_equal(other_nt, got)


def _other_prefetch(config):
    return dataclasses.replace(config, prefetch_scales=not config.prefetch_scales)


def test_bf16_grouped_mm_gives_zero_weight_gradients_to_empty_experts():
    from fmoe.stages.primitives import grouped_mm_weight_grad

    T, E = 4096 + 3, 16
    offs = _ragged_offs(T, E, seed=13)
    x = _randn(T, 256, seed=14, dtype=torch.bfloat16)
    dy = _randn(T, 128, seed=15, dtype=torch.bfloat16)
    got = grouped_mm_weight_grad(x, dy, offs, E)
    want = torch.zeros(E, 128, 256, dtype=torch.float32, device="cuda")
    start = 0
    for e, end in enumerate(offs.tolist()):
        want[e] = dy[start:end].float().t() @ x[start:end].float()
        start = end
    assert _within_ulps(got, want.to(got.dtype), ulps=2) or _rel(got, want) < BF16_ULP
    empty = (torch.diff(offs, prepend=offs.new_zeros(1)) == 0).nonzero().flatten()
    assert torch.count_nonzero(got[empty]) == 0


# ---------------------------------------------------------------------------------------------
# fused elementwise kernels: one bf16 ulp of the float32 reference


def test_swiglu_forward_backward_and_quant_compiled_equal_references():
    from fmoe.kernels import fp8_quant as fq
    from fmoe.kernels import fused

    h = _randn(32768 + 5, 2 * 768, seed=16, dtype=torch.bfloat16, scale=3.0)
    da = _randn(h.shape[0], 768, seed=17, dtype=torch.bfloat16)
    assert _within_ulps(fused.swiglu(h), fused.swiglu_reference(h).float())
    assert _within_ulps(fused.swiglu_backward(h, da), fused.swiglu_backward_reference(h, da).float())
    a = fused.swiglu(h)
    q, want = fused.swiglu_quant(h), fq.quantize_act(a)
    assert _bits_equal(q.data, want.data) and _bits_equal(q.scale, want.scale)
    # with the token-transposed copy (SwiGLU recomputed from the transposed load of h)
    offs = _ragged_offs(h.shape[0], 128, seed=18)
    (q, q_t), want_t = fused.swiglu_quant(h, offs, with_t=True), fq.quantize_act_t_reference(a, offs)
    assert _bits_equal(q.data, want.data) and _bits_equal(q.scale, want.scale)
    for field in ("data", "scale", "group_start", "group_len"):
        assert _bits_equal(getattr(q_t, field), getattr(want_t, field)), field
    # the bf16 output / gradient with their FP8 rows from the same pass (the fused FP8 experts)
    a2, q = fused.swiglu(h, quantize=True)
    assert torch.equal(a2, a) and _bits_equal(q.data, want.data) and _bits_equal(q.scale, want.scale)
    dh = fused.swiglu_backward(h, da)
    dh2, dq = fused.swiglu_backward(h, da, quantize=True)
    dwant = fq.quantize_act(dh)
    assert torch.equal(dh2, dh) and _bits_equal(dq.data, dwant.data) and _bits_equal(dq.scale, dwant.scale)
    dq2 = fused.swiglu_backward_quant(h, da)  # the rows alone, no dh written
    assert _bits_equal(dq2.data, dwant.data) and _bits_equal(dq2.scale, dwant.scale)


def test_rmsnorm_forward_backward_compiled_equal_references():
    from fmoe.kernels import fused

    T, H = 8192 + 3, 2048
    x = _randn(T, H, seed=18, dtype=torch.bfloat16, scale=4.0)
    w = (1 + 0.1 * _randn(H, seed=19)).to(torch.bfloat16)
    y, rstd = fused.rmsnorm(x, w, 1e-6)
    y_ref, rstd_ref = fused.rmsnorm_reference(x, w, 1e-6)
    assert _within_ulps(y, y_ref.float())
    # rstd: a float32 sum of H squares in another order, then rsqrt: a few float32 ulps x log2(H)
    assert _rel(rstd, rstd_ref) < 8 * F32_EPS * math.log2(H)
    dy = _randn(T, H, seed=20, dtype=torch.bfloat16)
    dx, dw = fused.rmsnorm_backward(dy, x, w, rstd)
    dx_ref, dw_ref = fused.rmsnorm_backward_reference(dy, x, w, rstd)
    # dx = rstd (w dy - xhat mean(w dy xhat)): where the two terms cancel, the float32 error of
    # their difference (a few eps32 of the terms' size) exceeds one bf16 ulp of the small result
    xhat, wdy = x.double() * rstd.double()[:, None], w.double() * dy.double()
    cancel = (
        8
        * F32_EPS
        * rstd.double()[:, None]
        * (wdy.abs() + xhat.abs() * (wdy * xhat).abs().mean(1, keepdim=True))
    )
    assert _within_ulps(dx, dx_ref.float(), terms=cancel)
    # dw: a float32 sum over T tokens (partials per program), rounded once to bf16
    assert _within_ulps(dw, dw_ref.float(), ulps=1 + T * F32_EPS / BF16_ULP)


def test_moe_sum_and_rotary_compiled_equal_references():
    from fmoe.kernels import fused

    T, k, H = 4096, 8, 2048
    r = _randn(T, H, seed=21, dtype=torch.bfloat16)
    y = _randn(T, k, H, seed=22, dtype=torch.bfloat16)
    w = torch.softmax(_randn(T, k, seed=23), -1)
    # a float32 sum of k + 1 terms in another order: (k + 1) eps32 x the terms' magnitudes
    terms = (k + 1) * F32_EPS * (r.double().abs() + (y.double().abs() * w.double()[:, :, None]).sum(1))
    assert _within_ulps(fused.moe_sum(r, y, w), fused.moe_sum_reference(r, y, w).float(), terms=terms)
    dy, dw = fused.moe_sum_backward(r, y, w)
    dy_ref, dw_ref = fused.moe_sum_backward_reference(r, y, w)
    assert _within_ulps(dy, dy_ref.float())
    assert _rel(dw, dw_ref) < 4 * F32_EPS * math.sqrt(H)  # float32 dot products of H terms

    x = _randn(2 * 4096, 32, 128, seed=24, dtype=torch.bfloat16)
    angles = torch.arange(4096, device="cuda")[:, None] * 10000.0 ** (-torch.arange(64, device="cuda") / 64)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    # each output is x_i c +- x_j s, two float32 products and a sum: 2 eps32 (|x_i| + |x_j|)
    terms = 2 * F32_EPS * (x.double().abs() + x.double().roll(64, dims=-1).abs())
    for backward in (False, True):
        got = fused.rotary(x, cos, sin, backward=backward)
        want = fused.rotary_reference(x, cos, sin, backward=backward)
        assert _within_ulps(got, want.float(), terms=terms)


def test_cross_entropy_compiled_equals_reference_at_the_qwen3_vocab():
    from fmoe.kernels import cross_entropy as ce

    T, V = 4096, 151936
    logits = _randn(T, V, seed=25, dtype=torch.bfloat16, scale=4.0).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=_gen(26), device="cuda")
    labels[::7] = -100
    loss = ce.cross_entropy(logits, labels)
    (grad,) = torch.autograd.grad(loss, logits)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = ce.cross_entropy_reference(ref_logits, labels)
    (ref_grad,) = torch.autograd.grad(ref, ref_logits)
    # a float32 log-sum-exp over V terms, then a mean over T rows: ~eps32 x (log2 V + log2 T)
    assert abs(loss.item() - ref.item()) <= 4 * F32_EPS * (math.log2(V) + math.log2(T)) * abs(ref.item())
    assert _within_ulps(grad, ref_grad.float(), ulps=1)


def test_adamw_compiled_equals_reference_bitwise():
    from fmoe.kernels.adamw import adamw_

    shapes = [(2048, 2048), (151936, 128), (128, 1536, 16), (7,)]
    params = [_randn(*s, seed=30 + i) for i, s in enumerate(shapes)]
    grads = [_randn(*s, seed=40 + i, dtype=torch.bfloat16) for i, s in enumerate(shapes)]
    states = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    runs = []
    for reference in (False, True):
        ps = [p.clone() for p in params]
        m, v = [s.clone() for s in states[0]], [s.clone() for s in states[1]]
        scale = torch.tensor(0.5, device="cuda")
        for step in (1, 2, 3):
            adamw_(ps, grads, m, v, step=step, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                   weight_decay=0.1, grad_scale=scale, reference=reference)  # fmt: skip
        runs.append((ps, m, v))
    for got, want in zip(runs[0], runs[1]):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


# ---------------------------------------------------------------------------------------------
# permutation


def test_expert_sort_permute_scatter_and_slot_sum_compiled_equal_references():
    from fmoe.kernels import permute as pm

    T, k, E, H = 32768, 8, 128, 2048
    ids = torch.randint(0, E, (T * k,), generator=_gen(50), device="cuda")
    ids[ids == 5] = 6  # an empty expert
    order, counts, slot_of = pm.expert_sort(ids, E, return_inverse=True)
    want_order, want_counts, want_slot = pm.expert_sort_reference(ids, E, return_inverse=True)
    assert torch.equal(order, want_order) and torch.equal(counts, want_counts)
    assert torch.equal(slot_of, want_slot)
    x = _randn(T, H, seed=51, dtype=torch.bfloat16)
    x_perm = pm.permute_tokens(x, order, k)
    assert torch.equal(x_perm, x[order // k])
    back = pm.unpermute_tokens(x_perm, order, T, k, slot_of=slot_of)
    assert torch.equal(back.view(T, k, H), x[:, None, :].expand(T, k, H))
    dest = torch.randperm(T, generator=_gen(52), device="cuda")
    out = torch.empty_like(x)
    assert torch.equal(pm.scatter_rows(x, dest, out), pm.scatter_rows_reference(x, dest, torch.empty_like(x)))
    # the permutation's backward in one pass: each token's 8 rows added in float32 in slot order,
    # rounded to nearest once - bitwise that sum done in torch
    g = _randn(T * k, H, seed=53, dtype=torch.bfloat16)
    slots = g.float()[slot_of].view(T, k, H)
    want = slots[:, 0]
    for j in range(1, k):
        want = want + slots[:, j]
    assert torch.equal(pm.sum_slot_rows(g, order, k), want.bfloat16())


# ---------------------------------------------------------------------------------------------
# attention backends


@pytest.mark.parametrize("backend", ["CUDNN_ATTENTION", "FLASH_ATTENTION"])  # the ones with GQA
def test_sdpa_backends_match_float32_math_attention(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fmoe.stages.layers import causal_attention

    b, hq, hkv, s, d = 1, 32, 4, 4096, 128
    q = _randn(b, hq, s, d, seed=60, dtype=torch.bfloat16).requires_grad_()
    kv = [_randn(b, hkv, s, d, seed=61 + i, dtype=torch.bfloat16).requires_grad_() for i in range(2)]
    k, v = kv
    dout = _randn(b, hq, s, d, seed=63, dtype=torch.bfloat16)

    def run(fn):
        out = fn(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    with sdpa_kernel([getattr(SDPBackend, backend)]):
        got = run(lambda q, k, v: causal_attention(q, k, v, d**-0.5))
    with sdpa_kernel([SDPBackend.MATH]):
        want = run(
            lambda q, k, v: F.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), is_causal=True, scale=d**-0.5, enable_gqa=True
            )
        )
    # bf16 inputs, float32 softmax statistics: outputs within a few bf16 roundings of float32
    # math; the backward adds one rounding of P and dS per element: 2^-6 relative in norm
    for name, g, w, tol in zip(("out", "dq", "dk", "dv"), got, want, (2**-7, 2**-6, 2**-6, 2**-6)):
        assert _rel(g, w) < tol, (backend, name, _rel(g, w))


# ---------------------------------------------------------------------------------------------
# training steps


def _gpu_model():
    """A Qwen3-MoE small enough to step quickly, with every dim a multiple of 128 (FP8 eligible)."""
    from fmoe.stages import qwen3_moe

    cfg = qwen3_moe.Qwen3MoeConfig(
        vocab_size=4096, hidden_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=128, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
        intermediate_size=1024, mlp_only_layers=(0,), router_aux_loss_coef=0.01,
    )  # fmt: skip
    model = qwen3_moe.build(cfg)
    gen = torch.Generator().manual_seed(0)
    batch = {
        "tokens": torch.randint(0, cfg.vocab_size, (4, 1024), generator=gen).cuda(),
        "labels": torch.randint(0, cfg.vocab_size, (4, 1024), generator=gen).cuda(),
    }
    return cfg, model, batch


def _global_rel(got: dict, want: dict) -> float:
    num = sum(float((got[n].double() - want[n].double()).norm() ** 2) for n in want)
    den = sum(float(want[n].double().norm() ** 2) for n in want)
    return math.sqrt(num / den)


def test_bf16_training_step_matches_float32_and_is_bitwise_reproducible():
    from fmoe import runner

    cfg, model, batch = _gpu_model()
    p32 = model.init(seed=0, dtype=torch.float32, device="cuda")
    p16 = {n: t.to(torch.bfloat16) for n, t in p32.items()}
    ref = runner.run_sequential(model, {n: t.float() for n, t in p16.items()}, batch, num_microbatches=2)
    got = runner.run_sequential(model, p16, batch, num_microbatches=2)
    again = runner.run_sequential(model, p16, batch, num_microbatches=2)
    assert torch.equal(got.loss, again.loss)
    assert all(torch.equal(got.grads[n], again.grads[n]) for n in got.grads)
    # bf16 activations: each of the ~10 roundings a value passes through per layer adds <= 2^-9;
    # near-tied router scores may pick another expert for a few tokens. 2^-7 on the loss, 2^-4 on
    # the gradients (as one vector) leaves room for both and still catches a wrong kernel.
    assert abs(got.loss.item() - ref.loss.item()) < 2**-7 * ref.loss.item()
    assert _global_rel(got.grads, ref.grads) < 2**-4


@pytest.mark.parametrize("masters", [False, True], ids=["bf16_weights", "fp32_expert_masters"])
def test_fp8_training_step_runs_the_triton_kernels_and_stays_near_bf16(monkeypatch, masters):
    # masters: the expert weights handed over as fp32, as the trainer does (quantized_from_master)
    from fmoe import runner
    from fmoe.kernels import fp8_linear
    from fmoe.stages.fp8_mode import quantized_from_master
    from fmoe.stages.primitives import fp8_training

    cfg, model, batch = _gpu_model()
    p32 = model.init(seed=0, dtype=torch.float32, device="cuda")
    p16 = {n: t.to(torch.bfloat16) for n, t in p32.items()}
    fp32 = quantized_from_master({n: t.shape for n, t in p32.items()}, model.expert_params) if masters else ()
    p_fp8 = {**p16, **{n: p32[n] for n in fp32}}
    bf16 = runner.run_sequential(model, p16, batch, num_microbatches=2)
    launches = []
    real = fp8_linear.fp8_gemm_nt

    def counting(a, *args, **kwargs):
        launches.append(a.data.is_cuda)
        return real(a, *args, **kwargs)

    monkeypatch.setattr(fp8_linear, "fp8_gemm_nt", counting)
    with fp8_training():
        fp8 = runner.run_sequential(model, p_fp8, batch, num_microbatches=2)
    assert launches and all(launches), "no FP8 GEMM ran on the GPU"
    assert not masters or (fp32 and all(fp8.grads[n].dtype == torch.bfloat16 for n in fp32))
    # E4M3 operands are off by <= 2^-4 relative each; over sums of hundreds of terms the errors
    # average (random signs), and the loss moves by far less than one rounding: 2^-6 on the loss,
    # 2^-2 on the gradients as one vector.
    assert abs(fp8.loss.item() - bf16.loss.item()) < 2**-6 * bf16.loss.item()
    assert _global_rel(fp8.grads, bf16.grads) < 2**-2


def test_fp8_experts_take_the_fused_function_with_the_bits_of_the_composition(monkeypatch):
    # Qwen3-30B-A3B's expert shape (H 2048, I 768: K = 768 is 6 blocks), ragged routing with an
    # empty expert, deferred W in FP8: layers.expert_mlp runs primitives.fp8_swiglu_experts on CUDA
    from fmoe import stage as S
    from fmoe.stages import layers, primitives
    from fmoe.stages.primitives import fp8_training, grouped_linear
    from fmoe.stages.spec import Stage, StageContext

    E, H, inter = 128, 2048, 768
    offs = _ragged_offs(16384 + 37, E, seed=40)
    x = _randn(int(offs[-1]), H, seed=41, dtype=torch.bfloat16)
    w1 = _randn(E, 2 * inter, H, seed=42, dtype=torch.bfloat16, scale=0.02)
    w2 = _randn(E, H, inter, seed=43, dtype=torch.bfloat16, scale=0.02)
    dy = _randn(x.shape[0], H, seed=44, dtype=torch.bfloat16)
    fused_calls = []
    real = primitives.fp8_swiglu_experts
    monkeypatch.setattr(layers, "fp8_swiglu_experts", lambda *a: fused_calls.append(1) or real(*a))

    def composed(x, w1, w2, offs):  # down's W on the FP8 rows of SwiGLU's output, as expert_mlp composes it
        return grouped_linear(
            layers._FusedSwiGLU.apply(grouped_linear(x, w1, offs)), w2, offs, w_reads_rows=True
        )

    out = {}
    for name, fn in (("fused", layers.expert_mlp), ("composed", composed)):
        stage = Stage(
            "ex", lambda p, i, c, fn=fn: (fn(i[0], p["w1"], p["w2"], offs),), ("e.w1", "e.w2"), "e."
        )
        with fp8_training(True):
            (y,), fwd = S.forward(stage, {"e.w1": w1, "e.w2": w2}, (x,), StageContext())
            (dx,), work = S.backward_input(fwd, (dy,))
            grads = S.backward_weight(work)
        out[name] = (y, dx, grads["e.w1"], grads["e.w2"])
    assert fused_calls == [1]
    for got, want, what in zip(out["fused"], out["composed"], ("y", "dx", "dw_gate_up", "dw_down")):
        assert torch.equal(got, want), what


def test_gathered_fp8_experts_give_the_bits_of_the_experts_on_the_permuted_rows():
    # Qwen3-30B-A3B's experts (128, top-8, H 2048, I 768) over 4096 tokens: layers.gathered_expert_mlp
    # (the local dispatch's mlp) reads the rows from the tokens (the compiled gathered quantization)
    # and stores its outputs in slot order (the compiled GEMM's scattered stores); its output, the
    # tokens' gradient and both weight gradients - W alone and merged with a second micro-batch's -
    # are bitwise those of the same experts on permute_rows' copy, put back by unpermute_rows
    from fmoe import stage as S
    from fmoe.kernels import fp8_quant as fq
    from fmoe.stages import layers, primitives
    from fmoe.stages.primitives import fp8_training
    from fmoe.stages.spec import Stage, StageContext

    E, H, inter, T, k = 128, 2048, 768, 4096, 8
    tokens = _randn(T, H, seed=45, dtype=torch.bfloat16)
    ids = torch.randint(0, E, (T, k), generator=torch.Generator().manual_seed(46)).cuda()
    order, offs = layers.expert_order(ids, E)
    src = (order // k).to(torch.int32)
    got, want = fq.quantize_act_gathered(tokens, src), fq.quantize_act_reference(tokens[src.long()])
    assert _bits_equal(got.data, want.data) and _bits_equal(got.scale, want.scale)
    w1 = _randn(E, 2 * inter, H, seed=47, dtype=torch.bfloat16, scale=0.02)
    w2 = _randn(E, H, inter, seed=48, dtype=torch.bfloat16, scale=0.02)
    dy = _randn(T * k, H, seed=49, dtype=torch.bfloat16)

    def permuted(x, a, b):
        rows = layers.expert_mlp(layers.permute_rows(x, order, k), a, b, offs)
        return layers.unpermute_rows(rows, order, k).flatten(0, 1)

    def gathered(x, a, b):
        return layers.gathered_expert_mlp(x, order, k, a, b, offs)

    out = {}
    for name, fn in (("gathered", gathered), ("permuted", permuted)):
        stage = Stage("ex", lambda p, i, c, fn=fn: (fn(i[0], p["w1"], p["w2"]),), ("e.w1", "e.w2"), "e.")
        with fp8_training(True):
            (y,), fwd = S.forward(stage, {"e.w1": w1, "e.w2": w2}, (tokens,), StageContext())
            (dx,), work = S.backward_input(fwd, (dy,))
            computes = [c for _, c in work.tape.entries]
            alone = [c() for c in computes]
            merged = [primitives.merge_grouped_weight_grads([c, c]) for c in computes]
        out[name] = (y, dx, *alone, *merged)
        if name == "gathered":
            # up's W reads the tokens where they lie, down's the FP8 rows of SwiGLU's output; both
            # keep their output gradient's FP8 rows
            assert computes[1].x_rows is not None and isinstance(computes[0].x, fq.Fp8Act)
            assert all(isinstance(c.dy, fq.Fp8Act) and c.dy_rows is None for c in computes)
    names = ("y", "dx", "dw_down", "dw_gate_up", "merged dw_down", "merged dw_gate_up")
    for a, b, what in zip(out["gathered"], out["permuted"], names):
        assert torch.equal(a, b), what


# ------------------------------------------------------------------------------------------------
# CUDA graphs: a step captured once and replayed is bitwise the eager step


def test_graphed_step_replays_bitwise_copies_new_inputs_and_keeps_in_place_state():
    from fmoe.cuda_graphs import GraphedStep

    def fn(state, x):  # state updated in place and handed back; a fresh output besides
        y = torch.relu(x @ state["w"])
        state["w"].add_(y.t() @ x * 1e-3)
        return state, y.sum(0)

    w0 = _randn(256, 256, seed=1)
    eager_state, graph_state = {"w": w0.clone()}, {"w": w0.clone()}
    graphed = GraphedStep(fn, warmup=2)
    for step in range(6):
        x = _randn(512, 256, seed=10 + step)  # a new tensor every call: copied into the graph's input
        _, want = fn(eager_state, x)
        state, got = graphed(graph_state, x)
        assert state["w"] is graph_state["w"]
        assert torch.equal(got, want), step
        assert torch.equal(graph_state["w"], eager_state["w"]), step
    assert graphed.replays == 4  # calls 3..6: captured once, then replayed


@pytest.mark.parametrize(
    "lookups", [1000, 8192]
)  # CUDA's embedding backward: a direct kernel up to 3072, sorted past it
def test_an_embedding_gradient_added_in_place_has_the_bits_of_the_whole_gradients_add_and_captures(lookups):
    from fmoe.cuda_graphs import GraphedStep
    from fmoe.stages.primitives import EmbeddingWeightGrad

    vocab, hidden = 151936, 256
    rows = torch.randint(0, 300, (lookups,), generator=_gen(60), device="cuda")  # many repeats
    rows[::7] = torch.randint(0, vocab, (len(rows[::7]),), generator=_gen(61), device="cuda")
    dy = _randn(lookups, hidden, seed=62, dtype=torch.bfloat16)
    grad = EmbeddingWeightGrad(rows, dy, vocab)
    total = _randn(vocab, hidden, seed=63, dtype=torch.bfloat16)
    want = total.clone().add_(grad())
    got = total.clone()
    grad.accumulate_into(got)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))

    def fn(acc, dy):  # W's accumulation in a captured step: no host sync, the same bits
        EmbeddingWeightGrad(rows, dy, vocab).accumulate_into(acc["w"])
        return acc

    eager, graphed_acc, graphed = {"w": total.clone()}, {"w": total.clone()}, GraphedStep(fn, warmup=1)
    for step in range(3):
        dy_step = _randn(lookups, hidden, seed=70 + step, dtype=torch.bfloat16)
        fn(eager, dy_step)
        graphed(graphed_acc, dy_step)
        assert torch.equal(graphed_acc["w"].view(torch.int16), eager["w"].view(torch.int16)), step
    assert graphed.replays == 2


def test_graphed_step_names_a_host_sync_it_cannot_capture():
    from fmoe.cuda_graphs import CaptureError, GraphedStep

    graphed = GraphedStep(lambda x: x * float(x.sum().item()), warmup=1)
    x = _randn(8, seed=3)
    graphed(x)  # eager
    with pytest.raises(CaptureError, match="train.cuda_graphs = false"):
        graphed(x)


GRAPHED_MODELS = {
    "qwen3": dict(
        family="qwen3_moe", vocab_size=384, hidden_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=128, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=128, intermediate_size=512, mlp_only_layers=[0], router_aux_loss_coef=0.01,
    ),
    # MLA, YaRN (its frequencies once came from the host: a copy no graph may capture), group-limited
    # routing with the bias update, shared experts; every GEMM dimension a multiple of 128 (FP8)
    "deepseek_v3": dict(
        family="deepseek_v3", vocab_size=384, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        first_k_dense_replace=1, moe_router_bias_update_rate=0.001, max_position_embeddings=16384,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                      "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", list(GRAPHED_MODELS))
@pytest.mark.parametrize(
    "fp8",
    [False, True, "bf16_dense_wgrad", "bf16_expert_wgrad"],
    ids=["bf16", "fp8", "fp8_bf16_dense_wgrad", "fp8_bf16_expert_wgrad"],
)
def test_fmoe_train_with_cuda_graphs_is_bitwise_the_eager_run(tmp_path, dataset, monkeypatch, fp8, family):
    """`fmoe train` with train.cuda_graphs: the same losses and parameters, bit for bit, as the eager
    run of the same recipe, and the graph served the steps after its warm-up; for each family whose
    stages differ (Qwen3; DeepSeek-V3's MLA, YaRN and router)."""
    from fmoe import cuda_graphs
    from fmoe import recipe as R
    from fmoe.train import train

    made = []

    class Counting(cuda_graphs.GraphedStep):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(cuda_graphs, "GraphedStep", Counting)
    model = GRAPHED_MODELS[family]

    def run(folder, graphs: bool):
        recipe = {
            "model": model,
            "data": {"path": dataset, "seq_len": 256},
            "train": {"steps": 6, "global_batch": 4, "microbatches": 2, "device": "cuda", "dtype": "bfloat16",
                      "fp8": bool(fp8), "fp8_dense_wgrad": fp8 != "bf16_dense_wgrad",
                      "fp8_expert_wgrad": fp8 != "bf16_expert_wgrad", "cuda_graphs": graphs},
            "optim": {"lr": 1e-3, "warmup": 2},
            "checkpoint": {"dir": str(tmp_path / folder / "ckpt"), "every": 3, "keep": 1},
            "log": {"dir": str(tmp_path / folder / "log"), "every": 2, "progress": False},
        }  # fmt: skip
        return train(R.from_dict(recipe))

    eager = run("eager", False)
    assert not made
    graphed = run("graphed", True)
    assert len(made) == 1 and made[0].replays == 6 - made[0].warmup
    assert graphed.losses == eager.losses
    for name, t in eager.params.items():
        assert torch.equal(graphed.params[name], t), name
