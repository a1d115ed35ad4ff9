"""Weight-consuming primitives whose weight gradient can be deferred.

A stage author writes ``linear(x, w)`` and ``grouped_linear(x, w, offs)`` instead of ``x @ w.T``. Under
plain autograd they behave exactly like the matmul. When fmoe's stage machinery runs a stage's input
forward (F) inside :func:`defer_weight_grads`, their backward (B) computes only the input gradient
and records the ``(x, dy)`` pair of the weight GEMM on that call's tape; the weight-gradient step (W) later runs
those GEMMs. B + W thus do the work of one ordinary backward, no more.

The tape is scoped: each F call makes its own, the primitives bind to it when they run forward (so
the backward finds it on whatever thread autograd runs it), and B hands it to W as a value.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "WeightGradTape",
    "defer_weight_grads",
    "grouped_linear",
    "grouped_mm",
    "grouped_mm_weight_grad",
    "active_tape",
    "linear",
]


@dataclass
class WeightGradTape:
    """The weight GEMMs B left for W: one entry per primitive call, in backward order.

    Each entry is ``(weight, compute)``: ``weight`` is the leaf tensor the stage read from its params
    dict (so the machinery maps it back to the parameter's name) and ``compute()`` returns its
    gradient, shaped like ``weight``. A primitive with a hand-written backward (FP8) records its own.
    """

    entries: list[tuple[Tensor, Callable[[], Tensor]]] = field(default_factory=list)

    def record(self, weight: Tensor, compute: Callable[[], Tensor]) -> None:
        self.entries.append((weight, compute))


_ACTIVE_TAPE: contextvars.ContextVar[WeightGradTape | None] = contextvars.ContextVar(
    "fmoe_weight_grad_tape", default=None
)


def active_tape() -> WeightGradTape | None:
    """The tape of the F step running now, or None under plain autograd."""
    return _ACTIVE_TAPE.get()


@contextlib.contextmanager
def defer_weight_grads(tape: WeightGradTape) -> Iterator[WeightGradTape]:
    """Primitives run forward while active record their weight GEMMs on ``tape`` in backward."""
    token = _ACTIVE_TAPE.set(tape)
    try:
        yield tape
    finally:
        _ACTIVE_TAPE.reset(token)


def grouped_mm(x: Tensor, w_t: Tensor, offs: Tensor) -> Tensor:
    """Expert-grouped GEMM: rows ``offs[e-1]:offs[e]`` of ``x`` times ``w_t[e]``.

    x: [n, k], w_t: [E, k, m], offs: [E] int32 cumulative end offsets -> [n, m].
    CUDA uses ``torch._grouped_mm``; elsewhere an exact loop of matmuls (any dtype, float64 included),
    which also defines what the CPU reference computes.
    """
    if x.is_cuda:
        return torch._grouped_mm(x, w_t, offs=offs)
    out = x.new_empty(x.shape[0], w_t.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w_t[e]
        start = end
    return out


def grouped_mm_weight_grad(x: Tensor, dy: Tensor, offs: Tensor, num_groups: int) -> Tensor:
    """Per-expert ``dy_e^T @ x_e``: x [n, k], dy [n, m] -> [E, m, k]; empty groups give zeros."""
    if x.is_cuda:
        return torch._grouped_mm(dy.t(), x, offs=offs)
    out = x.new_zeros(num_groups, dy.shape[1], x.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[e] = dy[start:end].t() @ x[start:end]
        start = end
    return out


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, w: Tensor) -> Tensor:
        return x @ w.t()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, w = inputs
        ctx.save_for_backward(x, w)
        ctx.weight = w  # the caller's tensor itself, so the tape can name it
        # read the tape here, in the forward's thread: CUDA backward runs on autograd's own threads
        ctx.tape = _ACTIVE_TAPE.get()

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w = ctx.saved_tensors
        dx = dy @ w if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dx, None
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        tape = ctx.tape
        if tape is not None:
            tape.record(ctx.weight, lambda: dy2.t() @ x2)
            return dx, None
        return dx, dy2.t() @ x2


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        return grouped_mm(x, w.transpose(-2, -1), offs)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, w, offs = inputs
        ctx.save_for_backward(x, w, offs)
        ctx.weight = w
        ctx.tape = _ACTIVE_TAPE.get()

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w, offs = ctx.saved_tensors
        dx = grouped_mm(dy, w, offs) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dx, None, None
        num_groups = w.shape[0]
        tape = ctx.tape
        if tape is not None:
            tape.record(ctx.weight, lambda: grouped_mm_weight_grad(x, dy, offs, num_groups))
            return dx, None, None
        return dx, grouped_mm_weight_grad(x, dy, offs, num_groups), None


def linear(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w.T`` with a deferrable weight gradient. x: [..., in], w: [out, in] -> [..., out]."""
    return _Linear.apply(x, w)


def grouped_linear(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """Expert-grouped ``x_e @ w[e].T`` with a deferrable weight gradient.

    x: [n, in] rows grouped by expert, w: [E, out, in], offs: [E] int32 cumulative end offsets
    (an expert may get no rows) -> [n, out].
    """
    return _GroupedLinear.apply(x, w, offs)
