"""Weight-consuming primitives whose weight gradient can be deferred.

A stage author writes ``linear(x, w)`` and ``grouped_linear(x, w, offs)`` instead of ``x @ w.T``, and
``embedding(tokens, w)`` instead of ``F.embedding``. Under plain autograd they behave exactly like the
matmul (the lookup). When fmoe's stage machinery runs a stage's input
forward (F) inside :func:`defer_weight_grads`, their backward (B) computes only the input gradient
and records the ``(x, dy)`` pair of the weight GEMM on that call's tape; the weight-gradient step (W) later runs
those GEMMs. B + W thus do the work of one ordinary backward, no more. An embedding's entry is its
``(rows, dy)`` pair: W adds dy's rows into the rows of the gradient that a micro-batch looked up, not a
[vocab, hidden] gradient each micro-batch.

The tape is scoped: each F call makes its own, the primitives bind to it when they run forward (so
the backward finds it on whatever thread autograd runs it), and B hands it to W as a value.

Which weights are deferred: a parameter of the stage (a leaf of F's params dict) or a view of one
(``w_q, w_k = p["qk"].chunk(2)``, ``p["gate_up"][:, :inter]``, ``p["w"].t()``): W adds the GEMM into
the view's slice of the parameter's gradient. Any other weight (``p["w"] * 2``, ``p["w"].to(bf16)``,
an input of the stage) gets its gradient in B through autograd, as a plain matmul would.

FP8: inside ``fp8_training`` (defined in ``fmoe.stages.fp8_mode`` with the step's FP8 weights and
input cache, re-exported here, where its users import it) the same calls run as FP8 GEMMs.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from fmoe.stages import fp8_mode
from fmoe.stages.fp8_mode import CachedInput, cols_from_saved, cols_to_save, fp8_training
from fmoe.stages.recompute import is_recomputed, recomputing

if TYPE_CHECKING:
    from fmoe.kernels.fp8_quant import Fp8Act, Fp8ActT

__all__ = [
    "ACCUMULATES_IN_PLACE",
    "DenseWeightGrad",
    "EmbeddingWeightGrad",
    "GroupedWeightGrad",
    "WeightGrad",
    "WeightGradTape",
    "defer_weight_grads",
    "embedding",
    "grouped_linear",
    "grouped_mm",
    "grouped_mm_weight_grad",
    "active_tape",
    "fp8_swiglu_experts",
    "fp8_training",
    "fuses_fp8_swiglu_experts",
    "linear",
    "merge_grouped_weight_grads",
    "non_overlapping",
]


@dataclass
class WeightGradTape:
    """The weight GEMMs B left for W: one entry per primitive call, in backward order.

    Each entry is ``(weight, compute)``: ``weight`` is the tensor the stage passed to the primitive -
    a parameter leaf of its params dict or a view of one (``weight._base`` is then the leaf), so the
    machinery maps it back to the parameter's name and slice - and ``compute()`` returns its
    gradient, shaped like ``weight``. ``compute`` is data (``x``, ``dy`` fields), never a closure, so
    the machinery sees which tensors W will still read.

    param_ids: ``id`` of each parameter leaf whose GEMMs may be deferred (:meth:`defers`); the stage
    machinery fills it in F, while the leaves are alive. Empty: nothing is deferred.
    """

    entries: list[tuple[Tensor, WeightGrad]] = field(default_factory=list)
    param_ids: frozenset[int] = frozenset()

    def defers(self, weight: Tensor) -> bool:
        """Whether the weight GEMM of ``weight`` goes on this tape: ``weight`` is a parameter leaf, or a
        view of one with the leaf's dtype whose elements are distinct (so its gradient is a slice)."""
        if id(weight) in self.param_ids:
            return True
        base = weight._base
        return (
            base is not None
            and id(base) in self.param_ids
            and weight.dtype == base.dtype
            and non_overlapping(weight)
        )

    def record(self, weight: Tensor, compute: WeightGrad) -> None:
        self.entries.append((weight, compute))


def non_overlapping(t: Tensor) -> bool:
    """True only if no two elements of ``t`` share memory: False for an expanded tensor (the gradient
    autograd gives a ``sum``'s input), and for rare layouts that interleave without overlapping. A
    test on sizes and strides, free for contiguous tensors."""
    if t.is_contiguous():
        return True
    extent = 1  # elements spanned by the dims seen so far, smallest stride first
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride < extent:
            return False
        extent += (size - 1) * stride
    return True


_ACTIVE_TAPE: contextvars.ContextVar[WeightGradTape | None] = contextvars.ContextVar(
    "fmoe_weight_grad_tape", default=None
)


def active_tape() -> WeightGradTape | None:
    """The tape of the F step running now, or None under plain autograd."""
    return _ACTIVE_TAPE.get()


def _tape_for(weight: Tensor) -> WeightGradTape | None:
    """The tape that takes ``weight``'s GEMM, or None: autograd computes its gradient in B."""
    tape = _ACTIVE_TAPE.get()
    return tape if tape is not None and tape.defers(weight) else None


@contextlib.contextmanager
def defer_weight_grads(tape: WeightGradTape) -> Iterator[WeightGradTape]:
    """Primitives run forward while active record their weight GEMMs on ``tape`` in backward. One F:
    an input several FP8 linears read is quantized once when cached (``fp8_mode.input_scope``)."""
    token = _ACTIVE_TAPE.set(tape)
    try:
        with fp8_mode.input_scope():
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


@dataclass(frozen=True)
class GroupedWeightGrad:
    """A deferred expert weight GEMM, ``dW[e] = dy_e^T @ x_e``, kept as data rather than a closure
    so that a step can merge the W of several microbatches into one GEMM
    (:func:`merge_grouped_weight_grads`). x [n, k] (FP8: or its cached Fp8ActT, ``fp8_mode``, or
    its Fp8Act, the rows F quantized for the forward: SwiGLU's output, ``grouped_linear``'s
    ``w_reads_rows``), dy [n, m] (FP8: or its Fp8Act, the rows B quantized for the input
    gradient); W requantizes FP8 rows along tokens (DeepSeek-V3's recipe). offs [E] int32 with
    offs[-1] = n. With ``x_rows`` ([n] int32), x is the tokens [T, k] the rows were gathered from
    and row i is ``x[x_rows[i]]``; with ``dy_rows`` ([n] int32), dy is the output gradient in
    token-slot order and row i is ``dy[dy_rows[i]]``. W then reads them where they lie (the experts
    of the local dispatch, :func:`fp8_swiglu_experts`): no gathered copy is kept for it."""

    x: Tensor | Fp8ActT | Fp8Act
    dy: Tensor | Fp8Act
    offs: Tensor
    num_groups: int
    fp8: bool = False  # the FP8 weight-gradient GEMM (both operands quantized along tokens)
    out_dtype: torch.dtype | None = None  # of the gradient; None: dy's
    x_rows: Tensor | None = None
    dy_rows: Tensor | None = None

    def __post_init__(self):
        if not isinstance(self.dy, Tensor) and not (
            self.fp8 and self.out_dtype is not None and self.dy_rows is None
        ):
            raise ValueError(
                "GroupedWeightGrad: a dy quantized in FP8 needs fp8=True, the gradient's out_dtype and no dy_rows"
            )
        if _is_fp8_rows(self.x) and not (self.fp8 and self.x_rows is None):
            raise ValueError("GroupedWeightGrad: an x of FP8 rows needs fp8=True and no x_rows")

    @property
    def grad_dtype(self) -> torch.dtype:
        """The gradient's dtype: ``out_dtype``, else dy's."""
        return self.out_dtype or self.dy.dtype

    def __call__(self) -> Tensor:
        x, dy = self._operand(self.x, self.x_rows), self._operand(self.dy, self.dy_rows)
        return _grouped_weight_grad(x, dy, self.offs, self.num_groups, self.fp8, self.grad_dtype)

    def _operand(self, t: Tensor | Fp8ActT, rows: Tensor | None) -> Tensor | Fp8ActT:
        """An operand's [n, *] rows as the GEMM reads them: t itself, or gathered by ``rows``
        (FP8: quantized along tokens straight from t; else the gathered copy, made now)."""
        if rows is not None and self.fp8:
            from fmoe.kernels.fp8_quant import quantize_act_t_gathered

            return quantize_act_t_gathered([t.contiguous()], torch.zeros_like(rows), rows, self.offs)
        return _rows_of(t, rows)

    def gathered_x(self) -> Tensor | Fp8ActT | Fp8Act:
        """x's [n, k] rows: x itself (a tensor, its cached Fp8ActT or its FP8 rows), or (``x_rows``)
        the gathered copy of the tokens' rows."""
        return _rows_of(self.x, self.x_rows)

    def gathered_dy(self) -> Tensor | Fp8Act:
        """dy's [n, m] rows: dy itself (a tensor or its Fp8Act), or (``dy_rows``) the gathered copy."""
        return _rows_of(self.dy, self.dy_rows)


def _is_fp8_rows(t: object) -> bool:
    """Whether t is an Fp8Act (FP8 rows, 1x128 groups along features)."""
    from fmoe.kernels.fp8_quant import Fp8Act

    return isinstance(t, Fp8Act)


def _rows_of(t: Tensor | Fp8ActT, rows: Tensor | None) -> Tensor | Fp8ActT:
    """t, or (``rows`` [n] int32) the copy of its rows ``t[rows]``."""
    return t if rows is None else t.index_select(0, rows)


def _grouped_weight_grad(
    x: Tensor | Fp8ActT,
    dy: Tensor | Fp8ActT,
    offs: Tensor,
    num_groups: int,
    fp8: bool,
    out_dtype: torch.dtype,
) -> Tensor:
    if fp8:
        from fmoe.kernels.fp8_linear import fp8_grouped_linear_weight_grad

        return fp8_grouped_linear_weight_grad(x, dy, offs, out_dtype=out_dtype)
    return grouped_mm_weight_grad(x, dy, offs, num_groups).to(out_dtype)


@dataclass(frozen=True)
class DenseWeightGrad:
    """A deferred dense weight GEMM, ``dW = dy^T @ x``, kept as data so that W can add it to a
    gradient accumulated over microbatches inside the GEMM (``accumulate_into``), with no
    weight-sized temporary and no separate add. x [n, k] (FP8: or its cached Fp8ActT), dy [n, m]
    (FP8: or its Fp8ActT, which B quantized with dy's rows) -> dW [m, k]."""

    x: Tensor | Fp8ActT
    dy: Tensor | Fp8ActT
    fp8: bool = False  # the FP8 weight-gradient GEMM (both operands quantized along tokens)
    out_dtype: torch.dtype | None = None  # of the gradient (FP8 only); None: dy's

    def __post_init__(self):
        if not isinstance(self.dy, Tensor) and not (self.fp8 and self.out_dtype is not None):
            raise ValueError(
                "DenseWeightGrad: a dy quantized in FP8 needs fp8=True and the gradient's out_dtype"
            )

    @property
    def grad_dtype(self) -> torch.dtype:
        """The gradient's dtype: ``out_dtype``, else dy's (a tensor then)."""
        return self.out_dtype or self.dy.dtype

    def __call__(self) -> Tensor:
        if self.fp8:
            from fmoe.kernels.fp8_linear import fp8_linear_weight_grad

            return fp8_linear_weight_grad(self.x, self.dy, out_dtype=self.grad_dtype)
        return self.dy.t() @ self.x

    def accumulate_into(self, total: Tensor) -> None:
        """total += dy^T @ x in place; total [m, k] (or a slice of a larger gradient) of dy's dtype.

        One GEMM with beta = 1, unless the GEMM is FP8 or ``total`` shares memory with x or dy (a
        GEMM must not write what it reads): then the product is formed first and added."""
        if self.fp8 or _same_storage(total, self.x) or _same_storage(total, self.dy):
            total.add_(self())
        else:
            total.addmm_(self.dy.t(), self.x)


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@dataclass(frozen=True)
class EmbeddingWeightGrad:
    """A deferred embedding gradient, ``dW[rows[i]] += dy[i]``, kept as data so that W can add it to
    a gradient accumulated over microbatches in place, touching only the rows a microbatch looked up.
    rows [n] int (token ids, repeats allowed), dy [n, hidden] -> dW [num_rows, hidden], dy's dtype."""

    rows: Tensor
    dy: Tensor
    num_rows: int

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.dy.dtype

    def __call__(self) -> Tensor:
        """The whole [num_rows, hidden] gradient, as autograd gives ``F.embedding``'s weight."""
        return torch.ops.aten.embedding_dense_backward(self.dy, self.rows, self.num_rows, -1, False)

    def accumulate_into(self, total: Tensor) -> None:
        """total += self() in place, reading and writing only the rows looked up: each of those gets
        the bits of that add; the others are left as they are (where the add of self()'s zeros would
        turn a -0.0 into +0.0). total: [num_rows, hidden] (or a view laid out so) of dy's dtype.

        Each distinct row's sum is formed first as ``self()`` forms it (the same summation over the
        same repeats in the same order: rows are relabelled 0..distinct-1 in sorted order, which
        keeps the order the sum follows), then added to ``total`` once. No host sync (CUDA graphs):
        the n-row buffer's slots past the distinct rows hold zeros and point at row ``rows.min()``,
        so their adds change nothing."""
        rows = self.rows.reshape(-1).to(torch.int64)
        n = rows.numel()
        if n == 0:
            return
        ordered, perm = torch.sort(rows, stable=True)
        first = torch.ones_like(ordered, dtype=torch.bool)
        first[1:] = ordered[1:] != ordered[:-1]
        slot = torch.empty_like(ordered).scatter_(0, perm, first.cumsum(0) - 1)  # each lookup's slot
        sums = torch.ops.aten.embedding_dense_backward(self.dy, slot, n, -1, False)  # [n, hidden]
        target = ordered[:1].expand(n).clone().scatter_(0, slot, rows)  # each slot's row
        # accumulate=True: the slots aimed at one row (one of sums, zeros beside it) are summed, then
        # added once (deterministic, sort-based on CUDA)
        total.index_put_((target,), sums, accumulate=True)


WeightGrad = DenseWeightGrad | GroupedWeightGrad | EmbeddingWeightGrad  # what a tape entry computes
ACCUMULATES_IN_PLACE = (DenseWeightGrad, EmbeddingWeightGrad)  # entries W adds into its accumulator


@torch.no_grad()
def merge_grouped_weight_grads(parts: list[GroupedWeightGrad]) -> Tensor:
    """``sum(part() for part in parts)`` as one grouped GEMM over the rows of every part, regrouped
    by expert, with no host sync: in BF16 each x and dy is copied once into the merged order; in
    FP8 nothing is copied, the token-wise quantization reads each row where it lies.

    With 128 experts and a few thousand tokens per microbatch, each microbatch's expert gradient is
    a thin GEMM (a few hundred rows per expert) whose [E, m, k] output is as large as the weight;
    writing and adding it once per microbatch costs more than the GEMM. Merged, the gradient is
    written once per step and each expert's GEMM is as deep as all its rows of the step.
    """
    if len(parts) == 1:
        return parts[0]()
    if any(not isinstance(p.x, Tensor) and not _is_fp8_rows(p.x) for p in parts):
        # a cached Fp8ActT: tiles of the merged rows would straddle parts
        raise ValueError(
            "merge_grouped_weight_grads: an input cached in FP8 cannot be merged bitwise with another "
            "micro-batch's (cache expert inputs only where W is not merged: MemoryPolicy.fp8_cache_experts)"
        )
    first = parts[0]
    if any(
        (p.fp8, p.out_dtype, p.num_groups, _is_fp8_rows(p.x))
        != (first.fp8, first.out_dtype, first.num_groups, _is_fp8_rows(first.x))
        for p in parts
    ):
        raise ValueError(
            "merge_grouped_weight_grads: parts differ in fp8, out_dtype, num_groups "
            "or x's form (FP8 rows or not)"
        )
    E, device = first.num_groups, first.offs.device
    counts = torch.stack([torch.diff(p.offs.to(torch.int64), prepend=p.offs.new_zeros(1)) for p in parts])
    per_expert = counts.sum(0)  # [E] rows of each expert over all parts
    expert_start = torch.cumsum(per_expert, 0) - per_expert
    earlier = torch.cumsum(counts, 0) - counts  # [parts, E] rows of expert e in the parts before
    experts = torch.arange(E, device=device)
    dests = []  # [rows_i] int64: where each row of part i goes among the merged rows
    for i, p in enumerate(parts):
        rows = p.dy.shape[0]
        e = torch.repeat_interleave(experts, counts[i], output_size=rows)
        within = torch.arange(rows, device=device) - (p.offs.to(torch.int64) - counts[i])[e]
        dests.append(expert_start[e] + earlier[i, e] + within)
    n = sum(p.dy.shape[0] for p in parts)
    offs = torch.cumsum(per_expert, 0).to(torch.int32)

    if first.fp8:
        from fmoe.kernels.fp8_quant import GATHER_MAX_PARTS

        if len(parts) <= GATHER_MAX_PARTS:
            return _fp8_weight_grad_gathered(parts, dests, offs, n)
    x = _merged_rows([p.gathered_x() for p in parts], dests, n)
    dy = _merged_rows([p.gathered_dy() for p in parts], dests, n)
    return _grouped_weight_grad(x, dy, offs, E, first.fp8, first.grad_dtype)


def _merged_rows(parts: list[Tensor] | list[Fp8Act], dests: list[Tensor], n: int) -> Tensor | Fp8Act:
    """The n rows whose row dests[i][j] is row j of parts[i]: tensors' rows scattered into one, or
    FP8 rows' bits and scales copied into one Fp8Act."""
    from fmoe.kernels.permute import scatter_rows

    first = parts[0]
    if not isinstance(first, Tensor):
        return _merged_fp8_rows(parts, dests, n)
    out = first.new_empty(n, first.shape[1])
    for p, dest in zip(parts, dests):
        scatter_rows(p.contiguous(), dest, out)
    return out


def _merged_fp8_rows(parts: list[Fp8Act], dests: list[Tensor], n: int) -> Fp8Act:
    """The Fp8Act of n rows whose row dests[i][j] is row j of parts[i] (bits and scales copied)."""
    from fmoe.kernels.fp8_quant import Fp8Act, _empty_scale

    first = parts[0]
    data = first.data.new_empty(n, first.data.shape[1])
    scale = _empty_scale(n, first.scale.shape[1], first.data.device)
    for p, dest in zip(parts, dests):
        data.view(torch.uint8).index_copy_(0, dest, p.data.view(torch.uint8))
        scale.index_copy_(0, dest, p.scale)
    return Fp8Act(data, scale)


def _fp8_weight_grad_gathered(
    parts: list[GroupedWeightGrad], dests: list[Tensor], offs: Tensor, n: int
) -> Tensor:
    """The merged FP8 expert weight gradient with no copy of the rows: the token-wise quantization
    the GEMM needs reads each merged row where it lies (the bits equal quantizing the copy); a
    part's x kept as tokens (``x_rows``) is read from its tokens.
    dests[i]: [rows_i] int64, the merged row of each row of parts[i]; offs: [E] int32 merged ends;
    n: the merged rows."""
    from fmoe.kernels.fp8_linear import fp8_grouped_linear_weight_grad
    from fmoe.kernels.fp8_quant import quantize_act_t_gathered

    device = offs.device
    src_part = torch.empty(n, dtype=torch.int32, device=device)
    x_src_row = torch.empty(n, dtype=torch.int32, device=device)
    dy_src_row = torch.empty(n, dtype=torch.int32, device=device)
    for i, (p, dest) in enumerate(zip(parts, dests)):
        own = torch.arange(dest.shape[0], dtype=torch.int32, device=device)
        src_part.index_fill_(0, dest, i)
        x_src_row.index_copy_(0, dest, own if p.x_rows is None else p.x_rows)
        dy_src_row.index_copy_(0, dest, own if p.dy_rows is None else p.dy_rows)
    x_t = quantize_act_t_gathered([_contiguous_rows(p.x) for p in parts], src_part, x_src_row, offs)
    dy_t = quantize_act_t_gathered([_contiguous_rows(p.dy) for p in parts], src_part, dy_src_row, offs)
    first = parts[0]
    return fp8_grouped_linear_weight_grad(x_t, dy_t, offs, out_dtype=first.grad_dtype)


def _contiguous_rows(t: Tensor | Fp8Act) -> Tensor | Fp8Act:
    """t made contiguous; an Fp8Act as it is (the quantization kernels wrote it so)."""
    return t.contiguous() if isinstance(t, Tensor) else t


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(tokens: Tensor, w: Tensor) -> Tensor:
        return torch.nn.functional.embedding(tokens, w)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        tokens, w = inputs
        ctx.save_for_backward(tokens)
        ctx.weight, ctx.num_rows = w, w.shape[0]
        ctx.tape = _tape_for(w)

    @staticmethod
    def backward(ctx, dy: Tensor):
        (tokens,) = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None
        grad = EmbeddingWeightGrad(tokens.reshape(-1), dy.reshape(-1, dy.shape[-1]), ctx.num_rows)
        if ctx.tape is not None:
            ctx.tape.record(ctx.weight, grad)
            return None, None
        return None, grad()


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
        ctx.tape = _tape_for(w)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w = ctx.saved_tensors
        dx = dy @ w if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dx, None
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        tape = ctx.tape
        if tape is not None:
            tape.record(ctx.weight, DenseWeightGrad(x2, dy2))
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
        ctx.tape = _tape_for(w)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w, offs = ctx.saved_tensors
        dx = grouped_mm(dy, w, offs) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dx, None, None
        num_groups = w.shape[0]
        tape = ctx.tape
        if tape is not None:
            tape.record(ctx.weight, GroupedWeightGrad(x, dy, offs, num_groups))
            return dx, None, None
        return dx, grouped_mm_weight_grad(x, dy, offs, num_groups), None


class _Fp8Linear(torch.autograd.Function):
    """FP8 forward, FP8 input gradient (the weight's transposed quantization), and the weight
    gradient in FP8 (the input's and output gradient's token-wise quantization) or, with
    ``fp8_wgrad`` False, in the compute dtype on the saved input - the hand-written B and W."""

    @staticmethod
    def forward(x: Tensor, w: Tensor, w_fp8, cached: CachedInput | None, fp8_wgrad: bool) -> Tensor:
        from fmoe.kernels.fp8_linear import fp8_linear_forward

        a = x.reshape(-1, x.shape[-1]) if cached is None else cached.rows
        return fp8_linear_forward(a, w_fp8, out_dtype=x.dtype).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, w, w_fp8, cached, fp8_wgrad = inputs
        # cached: only W's form is saved (``cached`` itself is not kept: its rows die after F)
        ctx.save_for_backward(*((x,) if cached is None else cols_to_save(cached.cols)))
        ctx.cached, ctx.x_shape, ctx.fp8_wgrad = cached is not None, x.shape, fp8_wgrad
        ctx.weight, ctx.w_fp8, ctx.tape = w, w_fp8, _tape_for(w)

    @staticmethod
    def backward(ctx, dy: Tensor):
        from fmoe.kernels.fp8_linear import fp8_linear_input_grad

        saved = ctx.saved_tensors
        x2 = cols_from_saved(saved) if ctx.cached else saved[0].reshape(-1, saved[0].shape[-1])
        # the gradient autograd hands over may be a transposed view (attention's q/k/v after the
        # math backend's head transpose): the quantization kernels read rows of contiguous memory
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        fp8_w = ctx.fp8_wgrad and ctx.needs_input_grad[1]
        dy_rows = dy_cols = dy2
        if fp8_w:  # both of dy's forms in one read of it: rows for dx now, token-wise for W
            from fmoe.kernels.fp8_quant import quantize_act_t

            if ctx.needs_input_grad[0]:
                dy_rows, dy_cols = quantize_act_t(dy2, None, with_rows=True)
            else:
                dy_cols = quantize_act_t(dy2, None)
        dx = (
            fp8_linear_input_grad(dy_rows, ctx.w_fp8, out_dtype=dy.dtype).view(ctx.x_shape)
            if ctx.needs_input_grad[0]
            else None
        )
        if not ctx.needs_input_grad[1]:
            return dx, None, None, None, None
        if fp8_w:
            compute = DenseWeightGrad(x2, dy_cols, fp8=True, out_dtype=ctx.weight.dtype)
        else:
            compute = DenseWeightGrad(x2, dy2)
        if ctx.tape is not None:
            ctx.tape.record(ctx.weight, compute)
            return dx, None, None, None, None
        return dx, compute(), None, None, None


class _Fp8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        x: Tensor,
        w: Tensor,
        offs: Tensor,
        w_fp8,
        cached: CachedInput | None,
        x_rows: Fp8Act | None,
        fp8_wgrad: bool,
        w_reads_rows: bool,
    ) -> Tensor:
        from fmoe.kernels.fp8_linear import fp8_grouped_linear_forward

        rows = cached.rows if cached is not None else x_rows
        return fp8_grouped_linear_forward(x if rows is None else rows, w_fp8, offs, out_dtype=x.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, w, offs, w_fp8, cached, x_rows, fp8_wgrad, w_reads_rows = inputs
        # what W reads of x: its cached form (``cached`` itself is not kept: its rows die after F),
        # the FP8 rows the forward read (x_rows: requantized along tokens), or x (with w_reads_rows,
        # an x selective recomputation remakes: B quantizes the remade x's rows for W)
        if cached is not None:
            ctx.x_kept, kept = "cached", cols_to_save(cached.cols)
        elif x_rows is not None:
            ctx.x_kept, kept = "rows", (x_rows.data, x_rows.scale)
        else:
            ctx.x_kept, kept = "x", (x,)
        ctx.save_for_backward(offs, *kept)
        ctx.fp8_wgrad, ctx.w_reads_rows = fp8_wgrad, w_reads_rows
        ctx.weight, ctx.w_fp8, ctx.tape = w, w_fp8, _tape_for(w)

    @staticmethod
    def backward(ctx, dy: Tensor):
        from fmoe.kernels.fp8_linear import fp8_grouped_linear_input_grad
        from fmoe.kernels.fp8_quant import Fp8Act, quantize_act

        offs, *saved = ctx.saved_tensors
        if ctx.x_kept == "cached":
            x = cols_from_saved(tuple(saved))
        elif ctx.x_kept == "rows":
            x = Fp8Act(*saved)
        else:
            (x,) = saved
        dtype = dy.dtype
        if ctx.fp8_wgrad and ctx.needs_input_grad[1]:  # dy's FP8 rows: the input gradient's and W's
            dy = quantize_act(dy)
            if ctx.w_reads_rows and ctx.x_kept == "x":  # x dropped and remade by selective recomputation
                x = quantize_act(x)  # the rows F read: the bits W reads without recomputation
        dx = (
            fp8_grouped_linear_input_grad(dy, ctx.w_fp8, offs, out_dtype=dtype)
            if ctx.needs_input_grad[0]
            else None
        )
        if not ctx.needs_input_grad[1]:
            return dx, None, None, None, None, None, None, None
        # as data, so that W can merge the GEMMs of a step's microbatches (merge_grouped_weight_grads);
        # in the compute dtype (dy's), also for a weight given as its fp32 master (quantized_from_master)
        compute = GroupedWeightGrad(x, dy, offs, ctx.weight.shape[0], fp8=ctx.fp8_wgrad, out_dtype=dtype)
        if ctx.tape is not None:
            ctx.tape.record(ctx.weight, compute)
            return dx, None, None, None, None, None, None, None
        return dx, compute(), None, None, None, None, None, None


def embedding(tokens: Tensor, w: Tensor) -> Tensor:
    """``F.embedding(tokens, w)`` with a deferrable weight gradient. tokens: [...] int64 / int32,
    w: [vocab, hidden] -> [..., hidden]. Deferred, W adds a microbatch's gradient into the step's
    accumulator in place (``EmbeddingWeightGrad.accumulate_into``), where autograd would write a
    [vocab, hidden] gradient each microbatch, to be added."""
    return _Embedding.apply(tokens, w)


def linear(x: Tensor, w: Tensor, fp8: bool = True, cache: bool = True) -> Tensor:
    """``x @ w.T`` with a deferrable weight gradient. x: [..., in], w: [out, in] -> [..., out].

    Inside :func:`fp8_training` it runs as FP8 GEMMs unless ``fp8=False`` (keep the router and the
    LM head in the compute dtype, as DeepSeek-V3 does), the block was opened with ``dense=False``,
    or the dims are not multiples of 128; opened with ``dense_wgrad=False``, its weight gradient
    runs in the compute dtype. ``cache=False``: keep ``x`` for W in the compute dtype even
    where ``fp8_training`` caches inputs in FP8 - for an ``x`` another operation saves anyway (a
    non-FP8 linear on it), whose cached form would only add bytes (``fmoe.stages.fp8_mode``).
    """
    w_fp8 = fp8_mode.fp8_weight(x, w, dense=True) if fp8 else None
    if w_fp8 is not None:
        fp8_wgrad = fp8_mode.fp8_dense_wgrad()  # else W reads x itself: nothing to cache
        cached = (
            fp8_mode.cached_input("linear", x, x.reshape(-1, x.shape[-1]), None)
            if cache and fp8_wgrad
            else None
        )
        return _Fp8Linear.apply(x, w, w_fp8, cached, fp8_wgrad)
    return _Linear.apply(x, w)


def grouped_linear(x: Tensor, w: Tensor, offs: Tensor, *, w_reads_rows: bool = False) -> Tensor:
    """Expert-grouped ``x_e @ w[e].T`` with a deferrable weight gradient.

    x: [n, in] rows grouped by expert, w: [E, out, in], offs: [E] int32 cumulative end offsets
    (an expert may get no rows) -> [n, out]. FP8 inside :func:`fp8_training`, as for ``linear``;
    opened with ``expert_wgrad=False``, its weight gradient runs in the compute dtype.

    ``w_reads_rows``: with FP8 weight gradients, W reads the FP8 rows the forward GEMM read,
    requantized along tokens (DeepSeek-V3's recipe; one rounding more), and x itself is not kept,
    nor cached (its rows are smaller than the cached form, which pads each expert): for an x nothing
    else keeps (SwiGLU's output, the down projection's input), about half the bytes held until W and
    one read of x fewer, the same bits at any merge window. An x selective recomputation remakes is
    dropped as before and B quantizes the remade x's rows for W (the same bits). The fused experts do
    the same (:func:`fp8_swiglu_experts`).
    """
    w_fp8 = fp8_mode.fp8_weight(x, w, dense=False)
    if w_fp8 is not None:
        fp8_wgrad = fp8_mode.fp8_expert_wgrad()  # else W reads x itself: nothing to cache
        x_rows = cached = None
        w_reads_rows = w_reads_rows and fp8_wgrad
        # not for an x selective recomputation remakes: it is dropped (B quantizes the remade rows)
        if w_reads_rows and not is_recomputed(x):
            from fmoe.kernels.fp8_quant import quantize_act

            x_rows = quantize_act(x.detach())  # [n, in] FP8: the forward's operand and W's
        elif fp8_wgrad and not w_reads_rows:  # never a cached form W would read otherwise than rows
            cached = fp8_mode.cached_input("grouped_linear", x, x, offs)
        return _Fp8GroupedLinear.apply(x, w, offs, w_fp8, cached, x_rows, fp8_wgrad, w_reads_rows)
    return _GroupedLinear.apply(x, w, offs)


class _Fp8SwiGLUExperts(torch.autograd.Function):
    """``grouped_linear(swiglu(grouped_linear(x, gate_up_w, offs)), down_w, offs)`` in FP8 as one
    Function, so that each FP8 operand is written by the kernel that makes its values: SwiGLU writes
    its output's FP8 rows (the down GEMM's input), its backward the FP8 rows of the gate/up gradient
    (the up GEMM's input-gradient operand), and with FP8 weight gradients nothing else: W reads
    those rows too, requantized along tokens (as it reads dy's rows, which B quantized for the down
    GEMM's input gradient; DeepSeek-V3's recipe), so no bf16 copy of SwiGLU's output or of an output
    gradient is written for W or kept (bf16 weight gradients: SwiGLU also writes its bf16 output, W's
    operand); the four GEMMs of F and B walk one tile map. The bits are those of the composition
    (each FP8 operand is the quantization of the same bf16 values; the down GEMM as
    ``grouped_linear(..., w_reads_rows=True)``), the saved tensors the same, and
    W gets the same two entries (down's, then up's, as B runs them), their gradients in the compute
    dtype (dy's) whatever dtype the weights come in (an fp32 master: ``fp8_mode.quantized_from_master``).

    With ``order`` (gathered), x is the tokens [T, H], the experts' rows are ``x[order // top_k]``
    and the output is in token-slot order, y[order[i]] = row i (``layers.unpermute_rows``' layout,
    flat): F quantizes the rows from the tokens in one pass and the down GEMM stores each output row
    at its slot (no gathered copy either way); B quantizes dy's rows from the slot-ordered gradient
    and returns the tokens' gradient (each token's k rows summed, as ``layers.permute_rows``'s
    backward does); the W entries keep the tokens as they are, with row indices
    (``GroupedWeightGrad.x_rows``), and dy's FP8 rows (in bf16 weight gradients: dy as it is, with
    ``dy_rows``)."""

    @staticmethod
    def forward(ctx, x, gate_up_w, down_w, offs, up_fp8, down_fp8, x_cached, fp8_wgrad, order, top_k):
        from fmoe.kernels import fused
        from fmoe.kernels.fp8_linear import fp8_grouped_linear_forward, nt_tile_map
        from fmoe.kernels.fp8_quant import quantize_act_gathered

        x_rows = None if order is None else _token_rows(order, top_k)
        n = x.shape[0] if order is None else order.shape[0]
        tiles = nt_tile_map(offs, n)
        if x_rows is not None:
            rows = quantize_act_gathered(x, x_rows)
        else:
            rows = x if x_cached is None else x_cached.rows
        gate_up = fp8_grouped_linear_forward(rows, up_fp8, offs, out_dtype=x.dtype, tiles=tiles)
        if fp8_wgrad:  # W requantizes the rows the down GEMM reads, cached or not: no bf16 a at all
            a_rows = fused.swiglu_quant(gate_up)
            a_saved = (a_rows.data, a_rows.scale)
        else:
            a, a_rows = fused.swiglu(gate_up, quantize=True)
            a_saved = (a,)
        y = fp8_grouped_linear_forward(a_rows, down_fp8, offs, out_dtype=x.dtype, tiles=tiles, out_rows=order)
        x_saved = (x,) if x_cached is None else cols_to_save(x_cached.cols)
        if x_rows is not None:  # the int32 indices are remade in B from order: 8 bytes a slot kept
            x_saved = (x, order)
        tile_tensors = (tiles.expert, tiles.row, tiles.group_end, tiles.first_tile, tiles.num_tiles)
        ctx.save_for_backward(offs, gate_up, *tile_tensors, *x_saved, *a_saved)
        ctx.tile_sizes = (tiles.cap, tiles.tile)
        ctx.x_parts, ctx.x_cached = len(x_saved), x_cached is not None
        ctx.gathered, ctx.top_k = x_rows is not None, top_k
        ctx.fp8_wgrad = fp8_wgrad
        ctx.weights, ctx.fp8 = (gate_up_w, down_w), (up_fp8, down_fp8)
        ctx.tapes = (_tape_for(gate_up_w), _tape_for(down_w))  # read in F's thread, as the others do
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        from fmoe.kernels import fused
        from fmoe.kernels.fp8_linear import fp8_grouped_linear_input_grad
        from fmoe.kernels.fp8_quant import Fp8Act, TileMap

        offs, gate_up, *rest = ctx.saved_tensors
        tiles = TileMap(*rest[:5], *ctx.tile_sizes)
        x_saved, a_saved = rest[5 : 5 + ctx.x_parts], rest[5 + ctx.x_parts :]
        x = cols_from_saved(tuple(x_saved)) if ctx.x_cached else x_saved[0]
        order = x_saved[1] if ctx.gathered else None
        x_rows = None if order is None else _token_rows(order, ctx.top_k)  # row i is x[x_rows[i]]
        slot_rows = None if order is None else order.to(torch.int32)  # row i is dy[slot_rows[i]]
        fp8_w = ctx.fp8_wgrad  # W reads FP8 rows of a and of the output gradients (requantized along tokens)
        a = Fp8Act(*a_saved) if fp8_w else a_saved[0]
        (up_w, down_w), (up_fp8, down_fp8) = ctx.weights, ctx.fp8
        need_x, need_up, need_down = ctx.needs_input_grad[:3]
        E = up_w.shape[0]
        grads = [None, None]  # gate_up_w's, down_w's
        dy_q = None
        if need_x or need_up or (need_down and fp8_w):
            from fmoe.kernels.fp8_quant import quantize_act, quantize_act_gathered

            # dy's rows in expert order, quantized from the slots (or as they are)
            dy_q = (
                quantize_act(dy) if slot_rows is None else quantize_act_gathered(dy.contiguous(), slot_rows)
            )
        if need_down:
            compute = (
                GroupedWeightGrad(a, dy_q, offs, E, fp8=True, out_dtype=dy.dtype)
                if fp8_w
                else GroupedWeightGrad(a, dy, offs, E, out_dtype=dy.dtype, dy_rows=slot_rows)
            )
            grads[1] = _record_or_compute(ctx.tapes[1], down_w, compute)
        dx = None
        if need_x or need_up:
            da = fp8_grouped_linear_input_grad(dy_q, down_fp8, offs, out_dtype=dy.dtype, tiles=tiles)
            del dy_q
            if fp8_w:  # the FP8 rows are all that is read of dgate_up: no bf16 copy is written
                dgate_up = dgate_up_rows = fused.swiglu_backward_quant(gate_up, da)
            else:
                dgate_up, dgate_up_rows = fused.swiglu_backward(gate_up, da, quantize=True)
            del da
            if need_x:
                dx = fp8_grouped_linear_input_grad(
                    dgate_up_rows, up_fp8, offs, out_dtype=dy.dtype, tiles=tiles
                )
                if order is not None:  # the tokens' gradient: each token's k rows summed
                    from fmoe.kernels.permute import sum_slot_rows

                    dx = sum_slot_rows(dx, order, ctx.top_k)
            if need_up:
                compute = GroupedWeightGrad(
                    x, dgate_up, offs, E, fp8=fp8_w, out_dtype=dy.dtype, x_rows=x_rows
                )
                grads[0] = _record_or_compute(ctx.tapes[0], up_w, compute)
        return dx, grads[0], grads[1], None, None, None, None, None, None, None, None


def _token_rows(order: Tensor, top_k: int) -> Tensor:
    """[n] int32: the token of each expert-grouped row, ``order // top_k`` (n < 2^31)."""
    return (order // top_k).to(torch.int32)


def _record_or_compute(
    tape: WeightGradTape | None, weight: Tensor, compute: GroupedWeightGrad
) -> Tensor | None:
    """W's GEMM of ``weight``: on ``tape`` (None returned: W runs it), or run now (its gradient)."""
    if tape is not None:
        tape.record(weight, compute)
        return None
    return compute()


def fuses_fp8_swiglu_experts(x: Tensor, gate_up_w: Tensor, down_w: Tensor) -> bool:
    """Whether :func:`fp8_swiglu_experts` applies now: inside ``fp8_training``, with both GEMMs of
    the expert MLP in FP8 (dims multiples of 128) and no selective recomputation (which recomputes
    SwiGLU's output rather than keep it: the composition does that)."""
    return (
        fp8_mode.fp8_swiglu_expert_weights(x, gate_up_w, down_w) is not None
        and not recomputing()
        and x.dim() == 2
        and x.stride(-1) == 1
    )


def fp8_swiglu_experts(
    x: Tensor,
    gate_up_w: Tensor,
    down_w: Tensor,
    offs: Tensor,
    *,
    order: Tensor | None = None,
    top_k: int = 1,
) -> Tensor:
    """SwiGLU experts, ``grouped_linear(swiglu(grouped_linear(x, gate_up_w, offs)), down_w, offs)``,
    as one FP8 Function (:class:`_Fp8SwiGLUExperts`) where :func:`fuses_fp8_swiglu_experts` holds.

    x: [n, H] expert-grouped rows (last dim contiguous), gate_up_w: [E, 2I, H] (gate rows first),
    down_w: [E, H, I], offs: [E] int32 cumulative end rows -> [n, H] in x's dtype. The weight
    gradients are deferred and FP8 as ``grouped_linear``'s are; x is cached in FP8 as there, and
    SwiGLU's output kept as its FP8 rows (``w_reads_rows``), cached or not.

    order: [n] int64, then x is the tokens [T, H] (n = T * top_k), the rows are
    ``layers.permute_rows(x, order, top_k)``, read from the tokens, never copied, and the result is
    in token-slot order, ``layers.unpermute_rows(rows' result, order, top_k)`` flat to [n, H]: its
    bits and every gradient's (x's is the tokens') are those of that composition. Up's W keeps the
    tokens (no FP8 cache of them: the [T, H] tokens are smaller than the cached form of their k T
    rows), down's the FP8 rows of SwiGLU's output and of the output gradient (bf16 weight gradients:
    SwiGLU's bf16 output and the slot-ordered gradient)."""
    weights = fp8_mode.fp8_swiglu_expert_weights(x, gate_up_w, down_w)
    if weights is None or recomputing():
        raise ValueError(
            "fp8_swiglu_experts: needs both GEMMs in FP8 and no selective recomputation "
            "(fuses_fp8_swiglu_experts says when)"
        )
    fp8_wgrad = fp8_mode.fp8_expert_wgrad()  # else W reads x and a in the compute dtype: no caching
    if order is None:
        x_cached = fp8_mode.cached_input("grouped_linear", x, x, offs) if fp8_wgrad else None
    else:
        if order.dim() != 1 or order.shape[0] != x.shape[0] * top_k:
            raise ValueError(
                f"fp8_swiglu_experts: order {tuple(order.shape)} is not [tokens * top_k] = "
                f"[{x.shape[0]} * {top_k}]"
            )
        x_cached = None
    return _Fp8SwiGLUExperts.apply(x, gate_up_w, down_w, offs, *weights, x_cached, fp8_wgrad, order, top_k)
