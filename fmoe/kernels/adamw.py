"""AdamW on fp32 master weights that reads the gradient in any float dtype and folds in a scale.

``adamw_`` updates ``params``, ``exp_avgs`` and ``exp_avg_sqs`` (fp32) in place from ``grads`` of
any float dtype (bf16 straight out of a bf16 model, fp16, fp32), each gradient multiplied by an
optional 0-d fp32 device scalar ``grad_scale`` (the global-norm clip factor) as it is loaded. So an
optimizer step over bf16 gradients needs no fp32 copy of them and no separate scaling pass: per
element it reads p, g, m, v and writes p, m, v (26 bytes for a bf16 gradient, against 28 bytes plus
a 6-byte conversion pass and an 8-byte scaling pass on the copy-then-``torch._fused_adamw_`` route).

The math is ``torch.optim.AdamW``'s, in the order and precision of ``torch._fused_adamw_``'s CUDA
kernel as measured on an H200 with torch 2.11: everything in fp32, hyperparameters rounded to fp32,
and fused multiply-adds where that kernel has them. The result is bit for bit
``torch._fused_adamw_`` on the fp32 copy of the (scaled) gradient: 0 differing elements in p, m
and v over 5 steps of 18.7M elements (fp32, bf16 and fp16 grads, with and without a scale and
weight decay, python and tensor lr; benchmarks/results/adamw_bitwise_h200.json). Older torch sources do these steps in double; against those the
results agree to a few fp32 ulps. With t the 1-based step, b1, b2, eps, lr and wd rounded to fp32,
g = float(grad) * grad_scale, and fma rounding once:

    bc1 = 1 - b1^t;  step_size = lr / bc1;  bc2_sqrt = sqrt(1 - b2^t)            (0-d, fp32)
    p <- fma(-(lr * wd), p, p)                                                  (only if wd != 0)
    m <- fma(b1, m, (1 - b1) * g);  v <- fma(b2, v, (1 - b2) * (g * g))
    p <- p - (step_size * m) / (sqrt(v) / bc2_sqrt + eps)

``step`` and ``lr`` may be python numbers or 0-d tensors on the parameters' device (a scheduled
learning rate): the per-step scalars (lr * wd, step_size, bc2_sqrt) are made on the device by a few
0-d torch ops, so nothing syncs with the host. One launch per tensor (a launch costs ~30 us of host
time, so callers with many small tensors do better to batch those: fmoe.optim does); empty tensors
are skipped.

The kernel launches on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``; elsewhere (or
with ``FMOE_KERNEL_BACKEND=torch``, or ``reference=True``) the reference runs: the same math in
plain torch.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import torch
from torch import Tensor

from fmoe.kernels._triton import tl, triton, use_triton

__all__ = ["BLOCK", "NUM_WARPS", "adamw_"]

# Elements and warps per program: 1024 / (8 * 32) = 4 elements a thread, one 16-byte load of each
# fp32 tensor. A sweep on an H200 (BLOCK 1024..8192 x 4..16 warps, on a first version of the kernel)
# put 1024 with 8 or 16 warps best and 4096 and up slower; its numbers were not kept. What is
# recorded is the chosen launch: benchmarks/results/optim_h200.json (1.07B fp32 params, bf16 grads,
# clip folded in: 7.93 ms a step, against 15.64 ms for fp32 copies + torch._fused_adamw_).
BLOCK = 1024
NUM_WARPS = 8


@triton.jit
def _adamw_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    scale_ptr,
    scalars_ptr,
    n,
    BETA1: tl.constexpr,
    ONE_MINUS_BETA1: tl.constexpr,
    BETA2: tl.constexpr,
    ONE_MINUS_BETA2: tl.constexpr,
    EPS: tl.constexpr,
    DECAY: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # the step's scalars, [lr * wd, step_size, bc2_sqrt, skip] in fp32 (_step_scalars)
    decay = tl.load(scalars_ptr)
    step_size = tl.load(scalars_ptr + 1)
    bc2_sqrt = tl.load(scalars_ptr + 2)
    skip = tl.zeros([BLOCK], dtype=tl.float32) + tl.load(scalars_ptr + 3)  # 1: found_inf, write nothing
    write = mask & (skip == 0.0)

    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if HAS_SCALE:
        g = g * tl.load(scale_ptr)
    if DECAY:
        p = tl.fma(-decay, p, p)
    # BETA1, ONE_MINUS_BETA1, ... hold fp32 values: as python scalars they take the fp32 operand's type
    m = tl.fma(m, BETA1, ONE_MINUS_BETA1 * g)
    v = tl.fma(v, BETA2, ONE_MINUS_BETA2 * (g * g))
    denom = tl.math.div_rn(tl.sqrt_rn(v), bc2_sqrt) + EPS
    p = p - tl.math.div_rn(step_size * m, denom)
    tl.store(p_ptr + offs, p, mask=write)
    tl.store(m_ptr + offs, m, mask=write)
    tl.store(v_ptr + offs, v, mask=write)


def adamw_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    step: int | float | Tensor,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    reference: bool = False,
) -> None:
    """One AdamW step in place over lists of tensors (same length, all on one device).

    params, exp_avgs, exp_avg_sqs: contiguous float32, shaped like the matching gradient.
    grads:      contiguous, any float dtype; read, never written.
    step:       the 1-based step number (python number or 0-d tensor, e.g. float32 ``state["step"]``).
    lr:         python number or 0-d float tensor on the device (a schedule's output).
    grad_scale: None (1) or a 0-d float32 tensor on the device; every gradient is multiplied by it.
    found_inf:  None or a 0-d float tensor on the device; nonzero skips the step (nothing is written),
                decided on the device: no host sync, so a CUDA graph can hold the step.
    reference:  run the plain-torch reference (the same operations in the same precisions, see the
                module doc) instead of the kernel; it also runs wherever the kernel cannot.
    """
    _check(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay, grad_scale)
    if not params:
        return
    scalars = _step_scalars(step, lr, beta1, beta2, weight_decay, params[0].device, found_inf)
    hyper = _hyper(beta1, beta2, eps)
    if reference or not use_triton(params[0]):
        _adamw_torch(params, grads, exp_avgs, exp_avg_sqs, scalars, hyper, weight_decay != 0, grad_scale)
        return
    scale = scalars if grad_scale is None else grad_scale  # any pointer when HAS_SCALE is off
    b1, c1, b2, c2, eps32 = hyper
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        n = p.numel()
        if n == 0:
            continue
        _adamw_kernel[(-(-n // BLOCK),)](
            p,
            g,
            m,
            v,
            scale,
            scalars,
            n,
            BETA1=b1,
            ONE_MINUS_BETA1=c1,
            BETA2=b2,
            ONE_MINUS_BETA2=c2,
            EPS=eps32,
            DECAY=weight_decay != 0,
            HAS_SCALE=grad_scale is not None,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )


def _adamw_torch(params, grads, exp_avgs, exp_avg_sqs, scalars, hyper, decays, grad_scale) -> None:
    """The reference: ``_adamw_kernel``'s operations in plain torch, rounded alike."""
    decay, step_size, bc2_sqrt, skip = scalars[0], scalars[1], scalars[2], scalars[3] != 0
    b1, c1, b2, c2, eps32 = hyper
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        if p.numel() == 0:
            continue
        g32 = g.float()
        if grad_scale is not None:
            g32 = g32 * grad_scale
        p32 = _fma(-decay, p, p) if decays else p
        m32 = _fma(m, b1, c1 * g32)
        v32 = _fma(v, b2, c2 * (g32 * g32))
        denom = _div(_sqrt(v32), bc2_sqrt) + eps32
        p.copy_(torch.where(skip, p, p32 - _div(step_size * m32, denom)))
        m.copy_(torch.where(skip, m, m32))
        v.copy_(torch.where(skip, v, v32))


# Correctly rounded fp32 sqrt, division and fma in plain torch. torch's own fp32 sqrt on CPU is
# not correctly rounded, and it divides by a one-element tensor as a multiply by its reciprocal;
# float64 has more than 2 * 24 + 2 bits, so doing the operation there and rounding once more to
# fp32 gives the correctly rounded result. An fma needs more: its sum in float64 is rounded to odd
# (an inexact result with an even last bit moves one float64 step towards the exact value), which
# makes the second rounding, to fp32, exact as well.


def _sqrt(x: Tensor) -> Tensor:
    return x.double().sqrt().float()


def _div(a: Tensor, b: Tensor) -> Tensor:
    a, b = torch.broadcast_tensors(a.double(), b.double())
    return (a / b.contiguous()).float()


def _fma(a: Tensor, b: float | Tensor, c: Tensor) -> Tensor:
    """fp32 ``a * b + c`` rounded once."""
    prod = a.double() * (b.double() if isinstance(b, Tensor) else b)  # exact: 24 + 24 bits
    c = c.double()
    total = prod + c
    back = total - prod
    err = (prod - (total - back)) + (c - back)  # total + err == prod + c exactly (TwoSum)
    bits = total.view(torch.int64)
    even = (bits & 1) == 0
    toward = torch.where(err > 0, torch.full_like(total, math.inf), torch.full_like(total, -math.inf))
    total = torch.where((err != 0) & even, torch.nextafter(total, toward), total)
    return total.float()


def _step_scalars(
    step: int | float | Tensor,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    wd: float,
    device,
    found_inf: Tensor | None = None,
) -> Tensor:
    """``[lr * wd, step_size, bc2_sqrt, skip]`` as a float32 tensor on ``device``, all in fp32
    arithmetic (``bc1 = 1 - b1^t``, ``step_size = lr / bc1``, ``bc2_sqrt = sqrt(1 - b2^t)``; skip:
    1 where ``found_inf`` is nonzero, else 0) from 0-d device ops: a python step or lr becomes a fill
    kernel, never a host-to-device copy (which would sync)."""
    f32 = torch.float32
    t = step.to(device=device, dtype=f32) if isinstance(step, Tensor) else None
    if t is None:
        t = torch.full((), float(step), dtype=f32, device=device)
    lr32 = lr.to(device=device, dtype=f32).reshape(()) if isinstance(lr, Tensor) else None
    if lr32 is None:
        lr32 = torch.full((), float(lr), dtype=f32, device=device)
    b1, _, b2, _, _ = _hyper(beta1, beta2, 0.0)
    bc1 = 1.0 - torch.pow(torch.full_like(t, b1), t)
    bc2_sqrt = _sqrt(1.0 - torch.pow(torch.full_like(t, b2), t))
    skip = torch.zeros((), dtype=f32, device=device)
    if found_inf is not None:
        skip = (found_inf.to(device=device).reshape(()) != 0).to(f32)
    return torch.stack([lr32 * _f32(wd), _div(lr32, bc1), bc2_sqrt, skip])


def _hyper(beta1: float, beta2: float, eps: float) -> tuple[float, float, float, float, float]:
    """(b1, 1 - b1, b2, 1 - b2, eps) as the fp32 values torch's kernel computes with."""
    b1, b2 = _f32(beta1), _f32(beta2)
    return b1, _f32(1.0 - b1), b2, _f32(1.0 - b2), _f32(eps)


def _f32(x: float) -> float:
    """x rounded to the nearest float32, as a python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _check(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay, grad_scale):
    lists = {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    lengths = {k: len(v) for k, v in lists.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"adamw_: params, grads, exp_avgs, exp_avg_sqs must be as long, got {lengths}")
    for field, value in (("beta1", beta1), ("beta2", beta2)):
        if not (isinstance(value, int | float) and 0 <= value < 1):
            raise ValueError(f"adamw_: {field} must be in [0, 1), got {value!r}")
    for field, value in (("eps", eps), ("weight_decay", weight_decay)):
        if not (isinstance(value, int | float) and value >= 0 and math.isfinite(value)):
            raise ValueError(f"adamw_: {field} must be a finite number >= 0, got {value!r}")
    if not isinstance(step, Tensor) and not (isinstance(step, int | float) and step >= 1):
        raise ValueError(f"adamw_: step must be the 1-based step number or a 0-d tensor, got {step!r}")
    if not isinstance(lr, Tensor) and not (isinstance(lr, int | float) and math.isfinite(lr)):
        raise ValueError(f"adamw_: lr must be a number or a 0-d tensor, got {lr!r}")
    for field, value in (("step", step), ("lr", lr)):
        if isinstance(value, Tensor) and value.numel() != 1:
            raise ValueError(f"adamw_: {field} must be a 0-d tensor, got shape {tuple(value.shape)}")
    if not params:
        return
    device = params[0].device
    if grad_scale is not None and (
        not isinstance(grad_scale, Tensor)
        or grad_scale.numel() != 1
        or grad_scale.dtype != torch.float32
        or grad_scale.device != device
    ):
        raise ValueError(
            f"adamw_: grad_scale must be None or a 0-d float32 tensor on {device}, got "
            f"{grad_scale if not isinstance(grad_scale, Tensor) else (tuple(grad_scale.shape), grad_scale.dtype, grad_scale.device)}"
        )
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        for name, t in (("params", p), ("grads", g), ("exp_avgs", m), ("exp_avg_sqs", v)):
            if t.device != device:
                raise ValueError(f"adamw_: {name}[{i}] is on {t.device}, params[0] on {device}")
            if t.shape != p.shape:
                raise ValueError(
                    f"adamw_: {name}[{i}] has shape {tuple(t.shape)}, params[{i}] {tuple(p.shape)}"
                )
            if not t.is_contiguous():
                raise ValueError(f"adamw_: {name}[{i}] must be contiguous (shape {tuple(t.shape)})")
            if name == "grads":
                if not t.is_floating_point():
                    raise ValueError(f"adamw_: grads[{i}] has dtype {t.dtype}, expected a float dtype")
            elif t.dtype != torch.float32:
                raise ValueError(f"adamw_: {name}[{i}] has dtype {t.dtype}, expected torch.float32")
