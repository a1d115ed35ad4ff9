"""Fused cross-entropy for the LM head: mean token loss over [tokens, vocab] logits in any float dtype,
without the float32 copy of the logits that ``F.cross_entropy(logits.float(), ...)`` makes.

Forward: one program per token row streams the row in chunks of ``FWD_BLOCK_V`` and keeps a running
max and sum of exponentials in float32 (online logsumexp: one exp per logit), then
``loss_row = lse - x[label]``. It writes the per-row loss and ``lse`` (float32 [T]); torch sums the
rows and divides by the number of counted tokens. Backward: one program per (row, chunk of
``BWD_BLOCK_V``) reads the logits once more and writes ``(softmax - onehot) * grad / n_valid`` in the
logits' dtype. So the logits are read twice in all and the gradient written once, against several
float32 passes for the upcast, log-softmax and their backwards.

Semantics are those of :func:`cross_entropy_reference`: rows whose label is ``ignore_index`` add 0 and
are not counted (their gradient rows are 0); all rows ignored gives a NaN loss (0 / 0) and a zero
gradient, as torch does. Labels outside ``[0, vocab)`` raise a ValueError when ``labels`` is on the CPU;
on CUDA they are not checked (that would cost a host sync): such a row's loss is NaN, so the mean is NaN.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from fmoe.kernels._triton import tl, triton, use_triton

# H200 launch shapes for V ~ 152k, T ~ 4096 (benchmarks/bench_cross_entropy.py --sweep times them;
# [4096, 151936] bf16, medians of 5 interleaved rounds). 32 logits per thread is the sweet spot for both.
# Forward: one program per row, streaming the row 8192 logits at a time; each step has two block
# reductions (max, sum), so that every logit costs a single exp. 8192 x 8 warps 0.36 ms (3.4 TB/s of
# logits read), as 4096 x 4; 4096 x 8 0.39 ms, 8192 x 16 0.44 ms.
FWD_BLOCK_V = 8192
FWD_NUM_WARPS = 8
# Backward: no reduction, so one program per (row, 8192-chunk). 8192 x 8 warps 0.63 ms (4.0 TB/s
# read + written), as 4096 x 4 and 8192 x 4; 4096 x 8 and 8192 x 16 0.66-0.67 ms.
BWD_BLOCK_V = 8192
BWD_NUM_WARPS = 8


@triton.jit
def _ce_fwd_kernel(x_ptr, labels_ptr, loss_ptr, lse_ptr, V, stride_xt, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    # int64: row * stride passes 2^31 elements beyond ~14k tokens at V = 152k (and 2^31 bytes of
    # float32 logits already at 3.6k)
    x_row = x_ptr + row.to(tl.int64) * stride_xt
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    hi = tl.where(valid, V, 0)  # ignored rows read nothing
    for start in range(0, hi, BLOCK_V):
        offs = start + cols
        x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # a chunk of -inf logits before any finite one must not give exp(-inf - -inf) = nan
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = m_new
    lse = m + tl.log(tl.where(valid, s, 1.0))  # ignored rows: s = 0, stored as 0 below
    # an out-of-range label (unchecked on CUDA) reads nothing and gives a nan loss
    in_range = (label >= 0) & (label < V)
    x_label = tl.load(x_row + label, mask=valid & in_range, other=float("nan")).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - x_label, 0.0))
    tl.store(lse_ptr + row, tl.where(valid, lse, 0.0))


@triton.jit
def _ce_bwd_kernel(
    x_ptr,
    labels_ptr,
    lse_ptr,
    grad_ptr,
    n_valid_ptr,
    dx_ptr,
    V,
    stride_xt,
    stride_dxt,
    ignore_index,
    chunks,
    BLOCK_V: tl.constexpr,
):
    """Program p takes row p // chunks, columns [(p % chunks) * BLOCK_V, ...)."""
    pid = tl.program_id(0)
    row = pid // chunks
    offs = (pid % chunks) * BLOCK_V + tl.arange(0, BLOCK_V)
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    # grad / n_valid from device memory: no host sync. n_valid = 0 only when every row is ignored,
    # and then every row is written as 0 whatever the scale.
    scale = tl.load(grad_ptr) / tl.maximum(tl.load(n_valid_ptr), 1.0)
    lse = tl.load(lse_ptr + row)
    cmask = offs < V
    # ignored rows read nothing: one comparison (also sidesteps the interpreter's int32 result for
    # a vector mask & a scalar one)
    x = tl.load(
        x_ptr + row.to(tl.int64) * stride_xt + offs, mask=offs < tl.where(valid, V, 0), other=float("-inf")
    )
    p = tl.exp(x.to(tl.float32) - lse)
    dx = (p - tl.where(offs == label, 1.0, 0.0)) * scale
    dx = tl.where(valid, dx, 0.0)
    tl.store(dx_ptr + row.to(tl.int64) * stride_dxt + offs, dx.to(dx_ptr.dtype.element_ty), mask=cmask)


def _check_block(block_v: int) -> None:
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v: expected a power of two >= 16, got {block_v}")


def _check_inputs(logits: Tensor, labels: Tensor, ignore_index: int) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"logits: expected a [tokens, vocab] floating-point tensor, got shape {tuple(logits.shape)} "
            f"{logits.dtype}"
        )
    if labels.dim() != 1 or labels.shape[0] != logits.shape[0] or labels.dtype != torch.int64:
        raise ValueError(
            f"labels: expected [{logits.shape[0]}] int64 (one per logits row), got shape "
            f"{tuple(labels.shape)} {labels.dtype}"
        )
    if labels.device != logits.device:
        raise ValueError(f"labels: on {labels.device}, logits on {logits.device}")
    if labels.device.type == "cpu":  # free to check here; on CUDA it would sync with the host
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= logits.shape[1]))
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"labels: {int(labels[row])} at row {row} is outside [0, {logits.shape[1]}) and is not "
                f"ignore_index ({ignore_index})"
            )


def cross_entropy_forward(
    logits: Tensor,
    labels: Tensor,
    ignore_index: int = -100,
    *,
    block_v: int = FWD_BLOCK_V,
    num_warps: int = FWD_NUM_WARPS,
) -> tuple[Tensor, Tensor, Tensor]:
    """The forward kernel on checked inputs.

    logits: [T, V] float (any row stride, unit last one), labels: [T] int64 (any stride)
    -> loss_rows [T] float32 (0 where ignored), lse [T] float32 (0 where ignored),
       n_valid 0-d float32 (rows not ignored, on the device).
    """
    _check_block(block_v)
    T, V = logits.shape
    loss_rows = torch.empty(T, dtype=torch.float32, device=logits.device)
    lse = torch.empty(T, dtype=torch.float32, device=logits.device)
    if T:
        _ce_fwd_kernel[(T,)](
            logits, labels.contiguous(), loss_rows, lse, V, logits.stride(0), ignore_index, BLOCK_V=block_v,
            num_warps=num_warps,
        )  # fmt: skip
    n_valid = (labels != ignore_index).sum(dtype=torch.float32)
    return loss_rows, lse, n_valid


def cross_entropy_backward(
    grad: Tensor,
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    n_valid: Tensor,
    ignore_index: int = -100,
    *,
    block_v: int = BWD_BLOCK_V,
    num_warps: int = BWD_NUM_WARPS,
) -> Tensor:
    """Gradient of the mean loss: grad 0-d (d loss), logits [T, V], labels [T] int64, lse [T] float32,
    n_valid 0-d float32 -> dlogits [T, V] contiguous, logits' dtype."""
    _check_block(block_v)
    T, V = logits.shape
    dlogits = torch.empty(T, V, dtype=logits.dtype, device=logits.device)
    chunks = triton.cdiv(V, block_v)
    if dlogits.numel():
        _ce_bwd_kernel[(T * chunks,)](
            logits, labels.contiguous(), lse, grad.detach().float().reshape(()), n_valid, dlogits, V,
            logits.stride(0), dlogits.stride(0), ignore_index, chunks, BLOCK_V=block_v, num_warps=num_warps,
        )  # fmt: skip
    return dlogits


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(logits: Tensor, labels: Tensor, ignore_index: int, fwd_block: int, bwd_block: int):
        loss_rows, lse, n_valid = cross_entropy_forward(logits, labels, ignore_index, block_v=fwd_block)
        return loss_rows.sum() / n_valid, lse, n_valid

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        logits, labels, ignore_index, _, bwd_block = inputs
        _, lse, n_valid = output
        ctx.mark_non_differentiable(lse, n_valid)
        # the logits themselves (no float32 copy, no probabilities) and per-row float32 / scalars
        ctx.save_for_backward(logits, labels, lse, n_valid)
        ctx.ignore_index, ctx.bwd_block = ignore_index, bwd_block

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor, _grad_lse, _grad_n):
        logits, labels, lse, n_valid = ctx.saved_tensors
        dlogits = cross_entropy_backward(
            grad_loss, logits, labels, lse, n_valid, ctx.ignore_index, block_v=ctx.bwd_block
        )
        return dlogits, None, None, None, None


def cross_entropy(
    logits: Tensor, labels: Tensor, ignore_index: int = -100, *, block_v: int | None = None
) -> Tensor:
    """Mean cross-entropy over the tokens whose label is not ``ignore_index``: 0-d float32.

    logits: [T, V] bf16 / fp16 / fp32, labels: [T] int64. Equals
    ``F.cross_entropy(logits.float(), labels, ignore_index=ignore_index)`` to float32 rounding, its
    gradient (in the logits' dtype) to that dtype's rounding. ``block_v`` (tests) replaces both
    kernels' chunk of the vocab; None takes FWD_BLOCK_V / BWD_BLOCK_V. Without Triton for these
    tensors (see ``use_triton``) it returns :func:`cross_entropy_reference`.
    """
    _check_inputs(logits, labels, ignore_index)
    if not use_triton(logits):
        return cross_entropy_reference(logits, labels, ignore_index)
    if logits.stride(1) != 1:
        logits = logits.contiguous()  # the kernels step along a row one element at a time
    fwd_block, bwd_block = (FWD_BLOCK_V, BWD_BLOCK_V) if block_v is None else (block_v, block_v)
    loss, _, _ = _CrossEntropy.apply(logits, labels, ignore_index, fwd_block, bwd_block)
    return loss


def cross_entropy_reference(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """What :func:`cross_entropy` replaces: torch's upcast cross-entropy (float32 copy of the logits)."""
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index)
