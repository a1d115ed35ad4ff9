"""Fused elementwise kernels where fusion saves memory traffic: SwiGLU (+ FP8 quantization of its
output) and RMSNorm (+ FP8 quantization of its output), each beside its plain-torch reference.

SwiGLU takes ``h = [gate | up]`` (``[tokens, 2 * inter]``, the output of the fused gate/up
projection) and returns ``silu(gate) * up``. ``swiglu_quant`` writes that product straight to FP8
(1x128 groups, and if asked the token-transposed per-expert layout the weight-gradient GEMM reads)
without the bf16 round trip through memory; its bits equal ``quantize_act(swiglu(h))``.
``swiglu(h, quantize=True)`` writes both (the bf16 product a weight gradient reads, and its FP8
rows the next GEMM reads), and ``swiglu_backward(h, da, quantize=True)`` the gradient with its FP8
rows, so neither is read again just to be quantized.
RMSNorm's backward writes per-program partial sums of the weight gradient and adds them with torch,
so the result does not depend on atomics. ``moe_sum`` is the end of an MoE layer, the residual plus
the gate-weighted sum of each token's k expert outputs, in one pass (its backward in one more).
"""

import torch
from torch import Tensor

from fmoe.kernels._triton import interpreting, num_sms, tl, triton, use_triton
from fmoe.kernels.fp8_quant import (
    FP8_DTYPE,
    GROUP,
    Fp8Act,
    Fp8ActT,
    _checked_offs,
    _e4m3_bits,
    _empty_scale,
    _launch_rows,
    _launch_tiles,
    _scales,
    _silu_mul,
    cdiv,
    quantize_act_reference,
    quantize_act_t_reference,
)

# ----------------------------------------------------------------------------------------------
# SwiGLU

SWIGLU_BLOCK_R = 32  # rows per program of the SwiGLU kernels; columns: one 128-wide group


@triton.jit
def _gate_up_block(h_ptr, M, I, stride_hm, BLOCK_R: tl.constexpr):
    """This program's block of the SwiGLU kernels: rows [i*BLOCK_R, +BLOCK_R) x columns [j*128, +128)
    of each half of h = [gate | up], loaded as fp32 (g, u), with its indices and masks."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kb = tl.program_id(1)
    cols = kb * 128 + tl.arange(0, 128)
    rmask = rows < M
    mask = rmask[:, None] & (cols[None, :] < I)
    r64 = rows[:, None].to(tl.int64)
    hp = h_ptr + r64 * stride_hm + cols[None, :]
    g = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(hp + I, mask=mask, other=0.0).to(tl.float32)
    return rows, kb, cols, rmask, mask, r64, g, u


@triton.jit
def _swiglu_kernel(
    h_ptr,
    a_ptr,
    q_ptr,
    s_ptr,
    M,
    I,
    stride_hm,
    stride_am,
    QUANT: tl.constexpr,
    POW2: tl.constexpr,
    EMULATE: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Program (i, j): rows [i*BLOCK_R, +BLOCK_R) x columns [j*128, +128) of a = silu(gate) * up, one
    1x128 group of each row; QUANT also writes the group's FP8 bits and scale (of the rounded a, so
    the bits equal quantize_act(a))."""
    rows, kb, cols, rmask, mask, r64, g, u = _gate_up_block(h_ptr, M, I, stride_hm, BLOCK_R)
    a = _silu_mul(g, u).to(a_ptr.dtype.element_ty)
    tl.store(a_ptr + r64 * stride_am + cols[None, :], a, mask=mask)
    if QUANT:
        _store_row_groups(
            a.to(tl.float32),
            q_ptr + r64 * I + cols[None, :],
            s_ptr + kb * M + rows,
            mask,
            rmask,
            POW2,
            EMULATE,
        )


@triton.jit
def _store_row_groups(v, q_ptrs, s_ptrs, mask, rmask, POW2: tl.constexpr, EMULATE: tl.constexpr):
    """The 1x128 quantization of v [rows, 128] (fp32, one group a row): bits to q_ptrs, scales to s_ptrs."""
    s, inv = _scales(tl.max(tl.abs(v), axis=1), POW2)
    tl.store(q_ptrs, _e4m3_bits(v * inv[:, None], EMULATE), mask=mask)
    tl.store(s_ptrs, s, mask=rmask)


@triton.jit
def _swiglu_bwd_kernel(
    h_ptr,
    da_ptr,
    dh_ptr,
    q_ptr,
    s_ptr,
    M,
    I,
    stride_hm,
    stride_dam,
    stride_dhm,
    QUANT: tl.constexpr,
    STORE_DH: tl.constexpr,
    POW2: tl.constexpr,
    EMULATE: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Program (i, j): rows [i*BLOCK_R, +BLOCK_R) x columns [j*128, +128) of both halves of dh =
    [dgate | dup]; QUANT (I a multiple of 128, so each half's columns are one 1x128 group of dh) also
    writes both groups' FP8 bits and scales, of the rounded dh (the bits of quantize_act(dh)).
    Without STORE_DH only those (dh_ptr then gives dh's dtype, nothing is written there)."""
    rows, kb, cols, rmask, mask, r64, g, u = _gate_up_block(h_ptr, M, I, stride_hm, BLOCK_R)
    da = tl.load(da_ptr + r64 * stride_dam + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    dg = (da * u * sig * (1.0 + g * (1.0 - sig))).to(dh_ptr.dtype.element_ty)
    du = (da * g * sig).to(dh_ptr.dtype.element_ty)
    if STORE_DH:
        dp = dh_ptr + r64 * stride_dhm + cols[None, :]
        tl.store(dp, dg, mask=mask)
        tl.store(dp + I, du, mask=mask)
    if QUANT:
        qp = q_ptr + r64 * (2 * I) + cols[None, :]
        sp = s_ptr + kb * M + rows
        groups = I // 128
        _store_row_groups(dg.to(tl.float32), qp, sp, mask, rmask, POW2, EMULATE)
        _store_row_groups(du.to(tl.float32), qp + I, sp + groups * M, mask, rmask, POW2, EMULATE)


def _check_h(h: Tensor) -> int:
    if h.dim() != 2 or h.shape[1] % 2 or h.stride(1) != 1:
        raise ValueError(
            f"h: expected a [tokens, 2 * inter] tensor with a contiguous last dim, got {tuple(h.shape)}"
        )
    return h.shape[1] // 2


def swiglu(h: Tensor, *, quantize: bool = False, pow2_scales: bool = False) -> Tensor | tuple[Tensor, Fp8Act]:
    """h: [tokens, 2 * inter] = [gate | up] -> a = silu(gate) * up: [tokens, inter], h's dtype, and
    with ``quantize`` also Fp8Act(a) (1x128 groups) from the same pass: the bits of quantize_act(a)."""
    inter = _check_h(h)
    if not use_triton(h):
        a = swiglu_reference(h)
        return (a, quantize_act_reference(a, pow2_scales=pow2_scales)) if quantize else a
    M = h.shape[0]
    a = torch.empty(M, inter, dtype=h.dtype, device=h.device)
    q, s = _quant_outputs(M, inter, h.device, quantize)
    if a.numel():
        _swiglu_kernel[(cdiv(M, SWIGLU_BLOCK_R), cdiv(inter, GROUP))](
            h, a, q.view(torch.uint8) if quantize else a, s if quantize else a, M, inter, h.stride(0), a.stride(0),
            QUANT=quantize, POW2=pow2_scales, EMULATE=interpreting(), BLOCK_R=SWIGLU_BLOCK_R, num_warps=4,
        )  # fmt: skip
    return (a, Fp8Act(q, s)) if quantize else a


def swiglu_backward(
    h: Tensor, da: Tensor, *, quantize: bool = False, pow2_scales: bool = False
) -> Tensor | tuple[Tensor, Fp8Act]:
    """Input gradient of swiglu: h [tokens, 2 * inter], da [tokens, inter] -> dh [tokens, 2 * inter],
    and with ``quantize`` (inter a multiple of 128) also Fp8Act(dh) from the same pass: the bits of
    quantize_act(dh), the FP8 input-gradient GEMM's operand."""
    inter = _check_h(h)
    if da.shape != (h.shape[0], inter) or da.stride(1) != 1:
        raise ValueError(
            f"da: expected shape {(h.shape[0], inter)} with a contiguous last dim, got {tuple(da.shape)}"
        )
    if quantize and inter % GROUP:
        raise ValueError(f"swiglu_backward(quantize=True): inter must be a multiple of {GROUP}, got {inter}")
    if not use_triton(h):
        dh = swiglu_backward_reference(h, da)
        return (dh, quantize_act_reference(dh, pow2_scales=pow2_scales)) if quantize else dh
    M = h.shape[0]
    dh = torch.empty_like(h, memory_format=torch.contiguous_format)
    q, s = _quant_outputs(M, 2 * inter, h.device, quantize)
    if dh.numel():
        _swiglu_bwd_kernel[(cdiv(M, SWIGLU_BLOCK_R), cdiv(inter, GROUP))](
            h, da, dh, q.view(torch.uint8) if quantize else dh, s if quantize else dh, M, inter,
            h.stride(0), da.stride(0), dh.stride(0),
            QUANT=quantize, STORE_DH=True, POW2=pow2_scales, EMULATE=interpreting(), BLOCK_R=SWIGLU_BLOCK_R,
            num_warps=4,
        )  # fmt: skip
    return (dh, Fp8Act(q, s)) if quantize else dh


def swiglu_backward_quant(h: Tensor, da: Tensor, *, pow2_scales: bool = False) -> Fp8Act:
    """swiglu's input gradient straight to FP8 rows (1x128 groups), no [tokens, 2 * inter] dh
    written: the bits of ``swiglu_backward(h, da, quantize=True)[1]``. For where the FP8 rows are all
    that is read of dh (the input-gradient GEMM, and the weight gradient requantizing them)."""
    inter = _check_h(h)
    if da.shape != (h.shape[0], inter) or da.stride(1) != 1:
        raise ValueError(
            f"da: expected shape {(h.shape[0], inter)} with a contiguous last dim, got {tuple(da.shape)}"
        )
    if inter % GROUP:
        raise ValueError(f"swiglu_backward_quant: inter must be a multiple of {GROUP}, got {inter}")
    if not use_triton(h):
        return quantize_act_reference(swiglu_backward_reference(h, da), pow2_scales=pow2_scales)
    M = h.shape[0]
    q, s = _quant_outputs(M, 2 * inter, h.device, True)
    if M and inter:
        _swiglu_bwd_kernel[(cdiv(M, SWIGLU_BLOCK_R), cdiv(inter, GROUP))](
            h, da, h, q.view(torch.uint8), s, M, inter, h.stride(0), da.stride(0), 0,
            QUANT=True, STORE_DH=False, POW2=pow2_scales, EMULATE=interpreting(), BLOCK_R=SWIGLU_BLOCK_R,
            num_warps=4,
        )  # fmt: skip
    return Fp8Act(q, s)


def _quant_outputs(rows: int, cols: int, device, quantize: bool) -> tuple[Tensor | None, Tensor | None]:
    """The FP8 bits [rows, cols] and column-major scales of a fused kernel's quantized output, or Nones."""
    if not quantize:
        return None, None
    bits = torch.empty(rows, cols, dtype=FP8_DTYPE, device=device)
    return bits, _empty_scale(rows, cdiv(cols, GROUP), device)


def swiglu_quant(
    h: Tensor, offs: Tensor | None = None, *, with_t: bool = False, pow2_scales: bool = False
) -> Fp8Act | tuple[Fp8Act, Fp8ActT]:
    """swiglu(h) straight to FP8, reading h once.

    h:      [tokens, 2 * inter] = [gate | up]
    offs:   [experts] int32 cumulative expert end offsets (for ``with_t``; None: one group)
    with_t: also write the token-transposed per-expert layout -> ``(Fp8Act, Fp8ActT)``
    The bits equal ``quantize_act(swiglu(h))`` (and ``quantize_act_t`` of it).
    """
    inter = _check_h(h)
    if not use_triton(h):
        return swiglu_quant_reference(h, offs, with_t=with_t, pow2_scales=pow2_scales)
    if with_t:
        return _launch_tiles(h, inter, inter, 1, _checked_offs(h, offs), pow2_scales, True)
    return _launch_rows(h, inter, inter, 1, pow2_scales)


def swiglu_reference(h: Tensor) -> Tensor:
    g, u = h.float().chunk(2, dim=-1)
    return (g * torch.sigmoid(g) * u).to(h.dtype)


def swiglu_backward_reference(h: Tensor, da: Tensor) -> Tensor:
    g, u = h.float().chunk(2, dim=-1)
    sig = torch.sigmoid(g)
    da = da.float()
    return torch.cat([da * u * sig * (1 + g * (1 - sig)), da * g * sig], dim=-1).to(h.dtype)


def swiglu_quant_reference(
    h: Tensor, offs: Tensor | None = None, *, with_t: bool = False, pow2_scales: bool = False
) -> Fp8Act | tuple[Fp8Act, Fp8ActT]:
    a = swiglu_reference(h)
    if with_t:
        return quantize_act_t_reference(a, offs, pow2_scales=pow2_scales, with_rows=True)
    return quantize_act_reference(a, pow2_scales=pow2_scales)


# ----------------------------------------------------------------------------------------------
# RMSNorm


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    q_ptr,
    s_ptr,
    M,
    H,
    eps,
    stride_xm,
    stride_ym,
    QUANT: tl.constexpr,
    POW2: tl.constexpr,
    EMULATE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    rmask = rows < M
    mask = rmask[:, None] & (cols[None, :] < H)
    r64 = rows[:, None].to(tl.int64)
    x = tl.load(x_ptr + r64 * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=1) / H + eps))
    y = (x * rstd[:, None] * w[None, :]).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + r64 * stride_ym + cols[None, :], y, mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    if QUANT:
        # 1x128 groups of the rounded output, so the bits equal quantize_act(y)
        G: tl.constexpr = BLOCK_H // 128
        y3 = tl.reshape(y.to(tl.float32), (BLOCK_R, G, 128))
        s, inv = _scales(tl.max(tl.abs(y3), axis=2), POW2)
        bits = tl.reshape(_e4m3_bits(y3 * inv[:, :, None], EMULATE), (BLOCK_R, BLOCK_H))
        tl.store(q_ptr + r64 * H + cols[None, :], bits, mask=mask)
        g = tl.arange(0, G)
        tl.store(s_ptr + g[None, :] * M + rows[:, None], s, mask=rmask[:, None] & (g[None, :] * 128 < H))


@triton.jit
def _rmsnorm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_ptr,
    M,
    H,
    stride_dym,
    stride_xm,
    stride_dxm,
    iters,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Program p takes row blocks p, p + NUM_PROGRAMS, ...; writes its partial dw row."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for i in range(iters):
        rows = (i * NUM_PROGRAMS + pid) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        r64 = rows[:, None].to(tl.int64)
        dy = tl.load(dy_ptr + r64 * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + r64 * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]
        wdy = w[None, :] * dy
        c = tl.sum(xhat * wdy, axis=1) / H
        dx = (wdy - xhat * c[:, None]) * rstd[:, None]
        tl.store(dx_ptr + r64 * stride_dxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
    tl.store(dw_ptr + pid * H + cols, dw, mask=cmask)


def _check_norm(x: Tensor, w: Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x: expected [tokens, hidden] with a contiguous last dim, got {tuple(x.shape)}")
    if w.shape != (x.shape[1],):
        raise ValueError(f"w: expected shape ({x.shape[1]},), got {tuple(w.shape)}")


def rmsnorm(
    x: Tensor, w: Tensor, eps: float = 1e-6, *, quantize: bool = False, pow2_scales: bool = False
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Fp8Act]:
    """RMSNorm: y = x / sqrt(mean(x^2) + eps) * w.

    x: [tokens, hidden], w: [hidden] -> y [tokens, hidden] (x's dtype), rstd [tokens] float32,
    and with ``quantize`` also Fp8Act(y) (1x128 groups) from the same pass.
    """
    _check_norm(x, w)
    if not use_triton(x):
        return rmsnorm_reference(x, w, eps, quantize=quantize, pow2_scales=pow2_scales)
    M, H = x.shape
    w = w.contiguous()
    y = torch.empty(M, H, dtype=x.dtype, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    q = torch.empty(M, H, dtype=torch.float8_e4m3fn, device=x.device) if quantize else y
    s = _empty_scale(M, cdiv(H, GROUP), x.device) if quantize else rstd
    block_h = max(triton.next_power_of_2(H), GROUP)
    block_r = max(1, min(16, 4096 // block_h))
    if M:
        _rmsnorm_kernel[(cdiv(M, block_r),)](
            x, w, y, rstd, q.view(torch.uint8) if quantize else q, s, M, H, eps, x.stride(0), y.stride(0),
            QUANT=quantize, POW2=pow2_scales, EMULATE=interpreting(), BLOCK_R=block_r, BLOCK_H=block_h,
            num_warps=8 if block_h >= 4096 else 4,
        )  # fmt: skip
    return (y, rstd, Fp8Act(q, s)) if quantize else (y, rstd)


def rmsnorm_backward(dy: Tensor, x: Tensor, w: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients of rmsnorm: dy, x [tokens, hidden], w [hidden], rstd [tokens] float32
    -> dx [tokens, hidden] (x's dtype), dw [hidden] (w's dtype)."""
    _check_norm(x, w)
    if dy.shape != x.shape or dy.stride(1) != 1:
        raise ValueError(
            f"dy: expected shape {tuple(x.shape)} with a contiguous last dim, got {tuple(dy.shape)}"
        )
    if rstd.shape != (x.shape[0],) or rstd.dtype != torch.float32:
        raise ValueError(f"rstd: expected [{x.shape[0]}] float32, got {tuple(rstd.shape)} {rstd.dtype}")
    if not use_triton(x):
        return rmsnorm_backward_reference(dy, x, w, rstd)
    M, H = x.shape
    block_h = triton.next_power_of_2(H)
    block_r = max(1, min(16, 4096 // block_h))
    programs = max(1, min(cdiv(M, block_r), 4 * num_sms(x.device)))
    dx = torch.empty(M, H, dtype=x.dtype, device=x.device)
    partial = torch.empty(programs, H, dtype=torch.float32, device=x.device)
    _rmsnorm_bwd_kernel[(programs,)](
        dy, x, w.contiguous(), rstd, dx, partial, M, H, dy.stride(0), x.stride(0), dx.stride(0),
        cdiv(cdiv(M, block_r), programs), NUM_PROGRAMS=programs, BLOCK_R=block_r, BLOCK_H=block_h,
        num_warps=8 if block_h >= 4096 else 4,
    )  # fmt: skip
    return dx, partial.sum(0).to(w.dtype)


def rmsnorm_reference(
    x: Tensor, w: Tensor, eps: float = 1e-6, *, quantize: bool = False, pow2_scales: bool = False
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Fp8Act]:
    xf = x.float()
    rstd = 1.0 / torch.sqrt(xf.square().mean(-1) + eps)
    y = (xf * rstd[:, None] * w.float()).to(x.dtype)
    if quantize:
        return y, rstd, quantize_act_reference(y, pow2_scales=pow2_scales)
    return y, rstd


def rmsnorm_backward_reference(dy: Tensor, x: Tensor, w: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    xhat = x.float() * rstd[:, None]
    wdy = w.float() * dy.float()
    dx = (wdy - xhat * (xhat * wdy).mean(-1, keepdim=True)) * rstd[:, None]
    return dx.to(x.dtype), (dy.float() * xhat).sum(0).to(w.dtype)


# ----------------------------------------------------------------------------------------------
# MoE output: residual + gate-weighted sum of the k expert outputs


@triton.jit
def _moe_sum_kernel(r_ptr, y_ptr, w_ptr, out_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """Row t: out[t] = r[t] + sum_j w[t, j] * y[t, j] (fp32 accumulation, one rounding)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.load(r_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(K):
        wj = tl.load(w_ptr + t * K + j).to(tl.float32)
        acc += tl.load(y_ptr + (t * K + j) * H + cols, mask=mask, other=0.0).to(tl.float32) * wj
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _moe_sum_bwd_kernel(g_ptr, y_ptr, w_ptr, dy_ptr, dw_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """Row t: dy[t, j] = g[t] * w[t, j], dw[t, j] = <g[t], y[t, j]> (fp32)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    g = tl.load(g_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(K):
        wj = tl.load(w_ptr + t * K + j).to(tl.float32)
        y = tl.load(y_ptr + (t * K + j) * H + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dy_ptr + (t * K + j) * H + cols, (g * wj).to(dy_ptr.dtype.element_ty), mask=mask)
        tl.store(dw_ptr + t * K + j, tl.sum(g * y, axis=0).to(dw_ptr.dtype.element_ty))


def _check_moe_sum(r: Tensor, y: Tensor, w: Tensor) -> None:
    if y.dim() != 3 or w.shape != y.shape[:2] or r.shape != (y.shape[0], y.shape[2]):
        raise ValueError(
            f"r, y, w: expected [T, H], [T, k, H], [T, k], got {tuple(r.shape)}, {tuple(y.shape)}, "
            f"{tuple(w.shape)}"
        )


def _moe_sum_launch(y: Tensor) -> tuple[int, int]:
    block_h = triton.next_power_of_2(y.shape[2])
    return block_h, 8 if block_h >= 4096 else 4


def moe_sum(r: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """r + sum_j w[:, j] * y[:, j]: r [T, H] residual, y [T, k, H] expert outputs, w [T, k] gate
    weights -> [T, H] in r's dtype, accumulated in float32 and rounded once."""
    _check_moe_sum(r, y, w)
    if not use_triton(y):
        return moe_sum_reference(r, y, w)
    r, y, w = r.contiguous(), y.contiguous(), w.contiguous()
    T, K, H = y.shape
    out = torch.empty_like(r)
    block_h, warps = _moe_sum_launch(y)
    if T:
        _moe_sum_kernel[(T,)](r, y, w, out, H, K=K, BLOCK_H=block_h, num_warps=warps)
    return out


def moe_sum_backward(g: Tensor, y: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients of moe_sum for its output gradient g [T, H]: (dy [T, k, H] in y's dtype, dw [T, k]
    in w's dtype); the residual's gradient is g itself."""
    _check_moe_sum(g, y, w)
    if not use_triton(y):
        return moe_sum_backward_reference(g, y, w)
    g, y, w = g.contiguous(), y.contiguous(), w.contiguous()
    T, K, H = y.shape
    dy, dw = torch.empty_like(y), torch.empty_like(w)
    block_h, warps = _moe_sum_launch(y)
    if T:
        _moe_sum_bwd_kernel[(T,)](g, y, w, dy, dw, H, K=K, BLOCK_H=block_h, num_warps=warps)
    return dy, dw


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def moe_sum_reference(r: Tensor, y: Tensor, w: Tensor) -> Tensor:
    acc = _acc_dtype(r)
    return (r.to(acc) + torch.einsum("tkh,tk->th", y.to(acc), w.to(acc))).to(r.dtype)


def moe_sum_backward_reference(g: Tensor, y: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    acc = _acc_dtype(g)
    gf = g.to(acc)
    dy = gf[:, None, :] * w.to(acc)[:, :, None]
    return dy.to(y.dtype), torch.einsum("th,tkh->tk", gf, y.to(acc)).to(w.dtype)


# ----------------------------------------------------------------------------------------------
# Rotary position embedding (half-rotation layout)


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, T, NH, cos_rows, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
    BACKWARD: tl.constexpr,
):  # fmt: skip
    """Tokens [BLOCK_T] of x [T, NH, 2*HALF], every head. With x = [x1 | x2] and cos = [c1 | c2],
    sin = [s1 | s2] (the token's row ``t % cos_rows`` of the tables), forward:
    out = [x1*c1 - x2*s1 | x2*c2 + x1*s2]; backward (x the output gradient), the transpose:
    dx = [x1*c1 + x2*s2 | x2*c2 - x1*s1]. fp32 arithmetic, one rounding."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, HALF)
    mask = (t < T)[:, None]
    crow = (t % cos_rows).to(tl.int64)[:, None] * (2 * HALF) + cols[None, :]
    c1 = tl.load(cos_ptr + crow, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + crow + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + crow, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + crow + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        p, q = s2, -s1
    else:
        p, q = -s1, s2
    base = t.to(tl.int64)[:, None] * NH * (2 * HALF) + cols[None, :]
    for h in range(NH):
        offs = base + h * (2 * HALF)
        x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (x1 * c1 + x2 * p).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + offs + HALF, (x2 * c2 + x1 * q).to(out_ptr.dtype.element_ty), mask=mask)


def _check_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    if x.dim() != 3 or x.shape[2] % 2 or not x.is_contiguous():
        raise ValueError(
            f"x: expected a contiguous [tokens, heads, d] tensor with d even, got {tuple(x.shape)}"
        )
    d = x.shape[2]
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != d or x.shape[0] % max(cos.shape[0], 1):
        raise ValueError(
            f"cos, sin: expected equal [rows, {d}] tables whose rows divide the {x.shape[0]} tokens, got "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}"
        )


def rotary(x: Tensor, cos: Tensor, sin: Tensor, *, backward: bool = False) -> Tensor:
    """Rotate x [T, heads, d] by the half-rotation RoPE: out = x * cos + cat(-x2, x1) * sin.

    cos, sin: [rows, d] tables, token t using row ``t % rows`` (rows = s for [b*s] tokens sharing
    positions, rows = T for per-token positions). ``backward=True`` applies the transpose (the input
    gradient of the forward for an output gradient x). Output in x's dtype, computed in float32.
    """
    _check_rotary(x, cos, sin)
    if not use_triton(x):
        return rotary_reference(x, cos, sin, backward=backward)
    cos, sin = cos.contiguous(), sin.contiguous()
    T, NH, d = x.shape
    out = torch.empty_like(x)
    block_t = 16
    if x.numel():
        _rotary_kernel[(cdiv(T, block_t),)](
            x, cos, sin, out, T, NH, cos.shape[0], HALF=d // 2, BLOCK_T=block_t, BACKWARD=backward, num_warps=4
        )  # fmt: skip
    return out


def rotary_reference(x: Tensor, cos: Tensor, sin: Tensor, *, backward: bool = False) -> Tensor:
    acc = _acc_dtype(x)
    T, half = x.shape[0], x.shape[2] // 2
    c = cos.to(acc).repeat(T // cos.shape[0], 1)[:, None, :]
    s = sin.to(acc).repeat(T // cos.shape[0], 1)[:, None, :]
    x1, x2 = x.to(acc).split(half, dim=-1)
    c1, c2, s1, s2 = c[..., :half], c[..., half:], s[..., :half], s[..., half:]
    if backward:
        out = torch.cat((x1 * c1 + x2 * s2, x2 * c2 - x1 * s1), dim=-1)
    else:
        out = torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)
    return out.to(x.dtype)
