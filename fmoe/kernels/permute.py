"""Stable expert sort (counting sort) for MoE dispatch, and the token permute / un-permute around it.

The router gives every token `topk` expert ids; flattened row-major they are `expert_ids: [n] int`
with `n = T * topk`, element `i = t * topk + k` (token `t`, choice `k`). Dispatch needs the tokens
grouped by expert, deterministically: `order = argsort(expert_ids, stable=True)`, plus how many land
on each expert. A general-purpose sort (torch's radix sort over 64-bit keys, 8 passes over the data)
is far more than this needs: the keys are small integers, so a counting sort does it in O(n), in
three Triton launches:

1. `_block_histogram_kernel`: every CTA counts the ids of its `BLOCK` elements -> `hist[b, e]`.
2. `_block_offsets_kernel`: an exclusive prefix sum down each expert's column of `hist` gives block
   `b`'s offset inside expert `e`'s segment (written in place) and the per-expert totals; one
   program per slab of experts, so the pass is parallel and reads each row segment once.
3. `_scatter_kernel`: every CTA sorts its packed keys `e << LOG_BLOCK | local` (unique, so the
   in-CTA bitonic sort is stable by construction); an element's slot is
   `expert_start[e] + block_offset[b, e] + (rank among equal ids inside the block)`, and since the
   sorted keys are grouped by expert that rank is `sorted position - first position of e`.

The result is bitwise `torch.argsort(expert_ids, stable=True)`, so dispatch is reproducible.

Dispatch between the kernel and the torch reference (`expert_sort`): the Triton path runs for CUDA
tensors; CPU tensors and environments without Triton take `expert_sort_reference`, so training on a
CPU never goes through the (slow) interpreter. Tests run the kernel itself on CPU by calling
`expert_sort_triton` with `TRITON_INTERPRET=1` set before triton is imported (tests/conftest.py does).
"""

from __future__ import annotations

import contextlib

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # e.g. macOS, where pyproject does not install triton
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = [
    "MAX_TRITON_EXPERTS",
    "expert_sort",
    "expert_sort_reference",
    "expert_sort_triton",
    "inverse_permutation",
    "permute_tokens",
    "scatter_rows",
    "scatter_rows_reference",
    "scatter_rows_triton",
    "sum_slot_rows",
    "sum_slot_rows_reference",
    "sum_slot_rows_triton",
    "unpermute_tokens",
]

# Bins of the in-CTA histogram and width of the (block, expert) table; beyond this the per-CTA
# vectors stop fitting registers comfortably and the torch reference is the better tool.
MAX_TRITON_EXPERTS = 1024
# Defaults for an H100/H200: 4096 ids per CTA keeps the (block, expert) table small (256 rows for
# 1M ids) while the in-CTA bitonic sort (78 compare-exchange steps) still fits one CTA's registers.
DEFAULT_BLOCK = 4096
DEFAULT_NUM_WARPS = 16  # best of the H200 sweep in benchmarks/results/permute_h200.json
# Elements per tile of the column prefix sum (rows x expert slab).
_OFFSETS_TILE = 8192


def _check_ids(expert_ids: torch.Tensor, num_experts: int) -> None:
    """Shape / dtype / argument checks that cost no device sync."""
    if not isinstance(expert_ids, torch.Tensor):
        raise TypeError(f"expert_ids must be a torch.Tensor, got {type(expert_ids).__name__}")
    if expert_ids.dim() != 1:
        raise ValueError(f"expert_ids must be 1-D [n], got shape {tuple(expert_ids.shape)}")
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_ids must be int32 or int64, got {expert_ids.dtype}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")


def _raise_out_of_range(expert_ids: torch.Tensor, num_experts: int) -> None:
    """Raise ValueError describing the ids outside [0, num_experts) (only called when some are)."""
    bad = (expert_ids < 0) | (expert_ids >= num_experts)
    where = bad.nonzero().flatten()
    first = where[:4].tolist()
    values = expert_ids[where[:4]].tolist()
    raise ValueError(
        f"expert_ids has {where.numel()} value(s) outside [0, num_experts={num_experts}): "
        f"e.g. expert_ids[{first}] = {values}"
    )


def sum_slot_rows(grad: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """The gradient of the tokens from that of their expert-grouped rows (row i was token
    ``order[i] // top_k``): grad [n = T*top_k, H] -> [T, H], each token's top_k rows summed in
    slot order in float32, rounded once (deterministic: no atomics). CUDA tensors of 16- and 32-bit
    floats take one Triton pass that reads each row where it lies (:func:`sum_slot_rows_triton`);
    the rest (float64 sums in float64) the gather and sum of :func:`sum_slot_rows_reference`."""
    from fmoe.kernels._triton import use_triton

    if grad.is_cuda and use_triton(grad) and grad.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return sum_slot_rows_triton(grad.contiguous(), order, top_k)
    return sum_slot_rows_reference(grad, order, top_k)


def sum_slot_rows_reference(grad: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """:func:`sum_slot_rows` in plain torch: the rows gathered into slot order, then summed."""
    return grad.index_select(0, inverse_permutation(order)).view(-1, top_k, grad.shape[-1]).sum(1)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """`slot_of` with `slot_of[order[j]] = j`: where element i went.

    order: [n] int64, a permutation of 0..n-1. Returns [n] int64 on order's device.
    """
    slot_of = torch.empty_like(order)
    slot_of[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return slot_of


def expert_sort_reference(
    expert_ids: torch.Tensor, num_experts: int, *, return_inverse: bool = False
) -> tuple[torch.Tensor, ...]:
    """Plain-torch stable expert sort: `argsort(stable=True)` + `bincount`.

    expert_ids: [n] int32/int64 in [0, num_experts).
    Returns (order [n] int64, counts [num_experts] int64), plus slot_of [n] int64 (the inverse
    permutation) when return_inverse. Always validates the ids (a device sync on CUDA).
    Raises ValueError when an id is outside [0, num_experts).
    """
    _check_ids(expert_ids, num_experts)
    if expert_ids.numel() and bool(((expert_ids < 0) | (expert_ids >= num_experts)).any()):
        _raise_out_of_range(expert_ids, num_experts)
    order = torch.argsort(expert_ids, stable=True)
    counts = torch.bincount(expert_ids, minlength=num_experts).to(torch.int64)
    if return_inverse:
        return order, counts, inverse_permutation(order)
    return order, counts


if HAS_TRITON:

    @triton.jit
    def _block_histogram_kernel(ids_ptr, hist_ptr, n, num_experts, BLOCK: tl.constexpr, EP: tl.constexpr):
        # hist[b, :EP] (int32) = how many of block b's ids equal each expert. Out-of-range ids and the
        # tail past n are masked out, so they never alias a real bin (the GPU histogram uses only the
        # low log2(EP) bits of a value).
        b = tl.program_id(0)
        offs = b * BLOCK + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
        valid = (offs < n) & (e >= 0) & (e < num_experts)
        hist = tl.histogram(tl.where(valid, e, 0).to(tl.int32), EP, mask=valid)
        tl.store(hist_ptr + b * EP + tl.arange(0, EP), hist)

    @triton.jit
    def _block_offsets_kernel(
        hist_ptr,
        totals_ptr,
        counts_ptr,
        num_blocks,
        num_experts,
        EP: tl.constexpr,
        EB: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        # One program per slab of EB experts walks down the blocks: hist[b, e] is replaced in place by
        # sum_{b' < b} hist[b', e] (block b's offset inside expert e's segment); the column totals go
        # to totals (int32, padded to EP) and counts (int64, real experts only).
        cols = tl.program_id(0) * EB + tl.arange(0, EB)
        carry = tl.zeros([EB], dtype=tl.int32)
        # A while loop, not range(num_blocks): the interpreter cannot take a runtime scalar as a
        # range bound under numpy >= 2.4 (int() of a 1-element array), and the compiled code is the same.
        r0 = 0
        while r0 < num_blocks:
            rows = r0 + tl.arange(0, ROWS)
            ptrs = hist_ptr + rows[:, None] * EP + cols[None, :]
            inb = rows[:, None] < num_blocks
            tile = tl.load(ptrs, mask=inb, other=0)
            tl.store(ptrs, tl.cumsum(tile, axis=0) - tile + carry[None, :], mask=inb)
            carry += tl.sum(tile, axis=0)
            r0 += ROWS
        tl.store(totals_ptr + cols, carry)
        tl.store(counts_ptr + cols, carry.to(tl.int64), mask=cols < num_experts)

    @triton.jit
    def _scatter_kernel(
        ids_ptr,
        offsets_ptr,
        totals_ptr,
        order_ptr,
        slot_of_ptr,
        n,
        num_experts,
        BLOCK: tl.constexpr,
        LOG_BLOCK: tl.constexpr,
        EP: tl.constexpr,
        WRITE_INVERSE: tl.constexpr,
    ):
        b = tl.program_id(0)
        local = tl.arange(0, BLOCK)
        offs = b * BLOCK + local
        e = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
        valid = (offs < n) & (e >= 0) & (e < num_experts)
        e32 = tl.where(valid, e, EP).to(tl.int32)  # EP = sentinel: invalid elements sort last

        # Per-expert base of this block's run, as an [EP] vector:
        #   slot = expert_start[e] + block_offset[b, e] + (p - local_start[e])
        # with p the element's position in the block's sorted order and local_start[e] the first
        # such position holding expert e (an exclusive prefix sum of this block's histogram).
        experts = tl.arange(0, EP)
        hist = tl.histogram(tl.where(valid, e32, 0), EP, mask=valid)
        totals = tl.load(totals_ptr + experts)
        block_offset = tl.load(offsets_ptr + b * EP + experts)
        base = (tl.cumsum(totals, axis=0) - totals) + block_offset - (tl.cumsum(hist, axis=0) - hist)

        # Keys are unique (the low bits are the local index), so sorting them is a stable sort by
        # expert; EP <= 1024 and BLOCK <= 8192 keep them below 2**24.
        keys = tl.sort((e32 << LOG_BLOCK) | local)
        sorted_e = keys >> LOG_BLOCK
        sorted_src = b * BLOCK + (keys & (BLOCK - 1))
        sorted_valid = sorted_e < EP
        slot = tl.gather(base, tl.minimum(sorted_e, EP - 1), 0) + local
        tl.store(order_ptr + slot, sorted_src.to(tl.int64), mask=sorted_valid)
        if WRITE_INVERSE:
            # Invalid ids (only possible with check=False) get slot -1.
            tl.store(
                slot_of_ptr + sorted_src,
                tl.where(sorted_valid, slot, -1).to(tl.int64),
                mask=sorted_src < n,
            )

    INTERPRETED = type(_scatter_kernel).__name__ == "InterpretedFunction"
else:
    INTERPRETED = False


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def expert_sort_triton(
    expert_ids: torch.Tensor,
    num_experts: int,
    *,
    check: bool | None = None,
    return_inverse: bool = False,
    block: int = DEFAULT_BLOCK,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> tuple[torch.Tensor, ...]:
    """Stable expert sort with the three Triton kernels (see the module docstring).

    expert_ids: [n] int32/int64 in [0, num_experts), on CUDA (or CPU under TRITON_INTERPRET=1).
    num_experts: 1..MAX_TRITON_EXPERTS; padded internally to a power of two >= 32.
    check: verify every id is in range, raising ValueError otherwise. It costs one device sync
        (`counts.sum()` against n: the kernels count only in-range ids), so the default is True on
        CPU and False on CUDA. With check=False and a bad id, `order[counts.sum():]` is left
        unwritten (garbage) and that element's `slot_of` is -1; nothing is written out of bounds.
    block: ids per CTA, a power of two in [16, 8192] (capped at next_pow2(n)); num_warps: warps per
        CTA of kernels 1 and 3 (capped at block // 32). The result does not depend on either.
    Returns (order [n] int64, counts [num_experts] int64), plus slot_of [n] int64 with
    `order[slot_of[i]] == i` when return_inverse.
    """
    if not HAS_TRITON:
        raise RuntimeError("expert_sort_triton needs triton; use expert_sort_reference")
    _check_ids(expert_ids, num_experts)
    if num_experts > MAX_TRITON_EXPERTS:
        raise ValueError(
            f"num_experts must be <= {MAX_TRITON_EXPERTS} for the Triton path, got {num_experts}"
        )
    if block < 16 or block > 8192 or block & (block - 1):
        raise ValueError(f"block must be a power of two in [16, 8192], got {block}")
    if num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two in [1, 32], got {num_warps}")
    n = expert_ids.numel()
    if n >= 2**31:
        raise ValueError(f"expert_ids has {n} elements; the Triton path indexes with int32 (< 2**31)")
    if check is None:
        check = expert_ids.device.type == "cpu"
    device = expert_ids.device
    order = torch.empty(n, dtype=torch.int64, device=device)
    slot_of = torch.empty(n, dtype=torch.int64, device=device) if return_inverse else None
    if n == 0:
        counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
        return (order, counts, slot_of) if return_inverse else (order, counts)

    ids = expert_ids.contiguous()
    # No wider than the input needs: the in-CTA sort costs the same for padding as for ids.
    block = min(block, max(16, _next_pow2(n)))
    num_warps = min(num_warps, max(1, block // 32))  # at least one id per thread
    ep = max(32, _next_pow2(num_experts))
    eb = min(ep, 32)  # a 128-byte int32 row segment per slab: coalesced, and EP / 32 programs
    num_blocks = triton.cdiv(n, block)
    rows = min(_OFFSETS_TILE // eb, _next_pow2(num_blocks))
    # One int32 workspace (fewer allocator calls on the launch path): the (block, expert) table,
    # then the padded per-expert totals.
    work = torch.empty((num_blocks + 1) * ep, dtype=torch.int32, device=device)
    hist, totals = work[: num_blocks * ep], work[num_blocks * ep :]
    counts = torch.empty(num_experts, dtype=torch.int64, device=device)

    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _block_histogram_kernel[(num_blocks,)](
            ids, hist, n, num_experts, BLOCK=block, EP=ep, num_warps=num_warps
        )
        _block_offsets_kernel[(ep // eb,)](
            hist, totals, counts, num_blocks, num_experts, EP=ep, EB=eb, ROWS=rows, num_warps=8
        )
        _scatter_kernel[(num_blocks,)](
            ids,
            hist,
            totals,
            order,
            order if slot_of is None else slot_of,  # unused pointer when not WRITE_INVERSE
            n,
            num_experts,
            BLOCK=block,
            LOG_BLOCK=block.bit_length() - 1,
            EP=ep,
            WRITE_INVERSE=return_inverse,
            num_warps=num_warps,
        )
    if check and int(counts.sum()) != n:
        _raise_out_of_range(ids, num_experts)
    return (order, counts, slot_of) if return_inverse else (order, counts)


def uses_triton(expert_ids: torch.Tensor, num_experts: int) -> bool:
    """Whether `expert_sort` takes the Triton path for these arguments."""
    if not HAS_TRITON or num_experts > MAX_TRITON_EXPERTS:
        return False
    # CPU tensors always take the reference here, even under TRITON_INTERPRET=1: the interpreter is
    # for testing the kernel (call expert_sort_triton), far too slow for training on a CPU
    return expert_ids.is_cuda


def expert_sort(
    expert_ids: torch.Tensor,
    num_experts: int,
    *,
    check: bool | None = None,
    return_inverse: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Stable sort of token slots by expert: exactly `torch.argsort(expert_ids, stable=True)`.

    expert_ids: [n] int32/int64 in [0, num_experts), flattened row-major from [T, topk].
    Returns (order [n] int64, counts [num_experts] int64): `expert_ids[order]` is non-decreasing,
    ties keep their original order, `counts[e]` is the number of ids equal to e. With
    return_inverse also slot_of [n] int64, `slot_of[order[j]] == j` (where element i went; combine
    gathers with it).
    Runs the Triton counting sort on CUDA, else `expert_sort_reference`. Out-of-range ids raise ValueError on the torch path
    always, and on the Triton path when `check` (default: True on CPU, False on CUDA, where the
    check would cost a device sync).
    """
    _check_ids(expert_ids, num_experts)
    if uses_triton(expert_ids, num_experts):
        return expert_sort_triton(expert_ids, num_experts, check=check, return_inverse=return_inverse)
    return expert_sort_reference(expert_ids, num_experts, return_inverse=return_inverse)


class _PermuteTokens(torch.autograd.Function):
    """x[order // topk] with a deterministic backward.

    Autograd's own backward of a row gather is an index_add whose topk float adds per token run in
    atomic (arbitrary) order on CUDA; here the gradient is scattered back into the unique slots
    (index_copy) and the topk copies of each token are summed by a plain reduction, so it is
    bitwise reproducible. setup_context (not ctx in forward) keeps it usable under torch.func.
    """

    @staticmethod
    def forward(x: torch.Tensor, order: torch.Tensor, topk: int) -> torch.Tensor:
        return x.index_select(0, torch.div(order, topk, rounding_mode="floor"))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, order, topk = inputs
        ctx.save_for_backward(order)
        ctx.topk = topk
        ctx.num_tokens = x.shape[0]

    @staticmethod
    def backward(ctx, grad_perm: torch.Tensor):
        (order,) = ctx.saved_tensors
        grad_slots = grad_perm.new_empty(grad_perm.shape).index_copy(0, order, grad_perm)
        return grad_slots.view(ctx.num_tokens, ctx.topk, -1).sum(1), None, None


def _check_permute_args(
    rows: torch.Tensor, name: str, order: torch.Tensor, num_tokens: int, topk: int
) -> None:
    if rows.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, hidden], got shape {tuple(rows.shape)}")
    if order.dim() != 1 or order.dtype != torch.int64:
        raise ValueError(f"order must be 1-D int64, got shape {tuple(order.shape)} {order.dtype}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be an int >= 1, got {topk!r}")
    if order.numel() != num_tokens * topk:
        raise ValueError(f"order has {order.numel()} entries, expected tokens * topk = {num_tokens} * {topk}")


def permute_tokens(x: torch.Tensor, order: torch.Tensor, topk: int) -> torch.Tensor:
    """Copy each token's row once per routed expert, grouped by expert.

    x: [T, h] (any float dtype); order: [n = T * topk] int64 from expert_sort.
    Returns x_perm: [n, h], `x_perm[j] = x[order[j] // topk]`. Differentiable in x with a
    deterministic backward (see _PermuteTokens).
    """
    _check_permute_args(x, "x", order, x.shape[0] if x.dim() == 2 else -1, topk)
    return _PermuteTokens.apply(x, order, topk)


def unpermute_tokens(
    y_perm: torch.Tensor,
    order: torch.Tensor,
    num_tokens: int,
    topk: int,
    *,
    slot_of: torch.Tensor | None = None,
) -> torch.Tensor:
    """Put expert outputs back in (token, choice) order: the inverse of permute_tokens.

    y_perm: [n = T * topk, h] rows in expert-sorted order; order: [n] int64 from expert_sort.
    Returns y: [T, topk, h], `y[t, k] = y_perm[j]` where `order[j] = t * topk + k`. With slot_of
    ([n] int64, the inverse of order) it is a row gather, else a scatter (index_copy); both are
    differentiable in y_perm and touch each slot exactly once, so gradients are deterministic.
    """
    _check_permute_args(y_perm, "y_perm", order, num_tokens, topk)
    if slot_of is not None:
        if slot_of.shape != order.shape or slot_of.dtype != torch.int64:
            raise ValueError(
                f"slot_of must be [n] int64 like order, got {tuple(slot_of.shape)} {slot_of.dtype}"
            )
        y = y_perm.index_select(0, slot_of)
    else:
        y = y_perm.new_empty(y_perm.shape).index_copy(0, order, y_perm)
    return y.view(num_tokens, topk, y_perm.shape[1])


# Row scatter: ``out[dest[i]] = src[i]``. torch's ``index_copy_`` does this one element at a time
# (2-byte elements for bf16, ~1.3 TB/s on an H200); the kernel moves whole row tiles with one index
# load per row, at close to copy bandwidth. Rows per program x columns per program:
_SCATTER_ROWS = 32
_SCATTER_COLS = 256

if HAS_TRITON:

    @triton.jit
    def _scatter_rows_kernel(
        src_ptr, dest_ptr, out_ptr, n, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        row_ok = rows < n
        dest = tl.load(dest_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        mask = row_ok[:, None] & (cols[None, :] < width)
        tile = tl.load(src_ptr + rows.to(tl.int64)[:, None] * width + cols[None, :], mask=mask)
        tl.store(out_ptr + dest[:, None] * width + cols[None, :], tile, mask=mask)

    @triton.jit
    def _sum_slot_rows_kernel(
        grad_ptr,
        row_of_ptr,
        out_ptr,
        T,
        width,
        TOPK: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        tok_ok = toks < T
        mask = tok_ok[:, None] & (cols[None, :] < width)
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(TOPK):  # slot order: the reference's summation order
            row = tl.load(row_of_ptr + toks.to(tl.int64) * TOPK + j, mask=tok_ok, other=0).to(tl.int64)
            acc += tl.load(grad_ptr + row[:, None] * width + cols[None, :], mask=mask, other=0.0).to(
                tl.float32
            )
        tl.store(
            out_ptr + toks.to(tl.int64)[:, None] * width + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=mask,
        )


# Tokens per program x columns per program of the slot-row sum
_SUM_TOKENS = 16
_SUM_COLS = 256


def sum_slot_rows_triton(grad: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """The Triton kernel of :func:`sum_slot_rows` (CUDA, or CPU under ``TRITON_INTERPRET=1``): each
    program sums its tokens' top_k rows, read where they lie, in float32 in slot order. grad: [n, w]
    contiguous, order: [n] int64 permutation, n a multiple of top_k."""
    n, width = grad.shape
    if not grad.is_contiguous() or order.shape != (n,) or n % top_k:
        raise ValueError(
            f"sum_slot_rows: grad {tuple(grad.shape)} (contiguous: {grad.is_contiguous()}) and order "
            f"{tuple(order.shape)} must have n = tokens * top_k ({top_k}) rows"
        )
    T = n // top_k
    out = grad.new_empty(T, width)
    if T and width:
        grid = (triton.cdiv(T, _SUM_TOKENS), triton.cdiv(width, _SUM_COLS))
        _sum_slot_rows_kernel[grid](
            grad, inverse_permutation(order), out, T, width, top_k, _SUM_TOKENS, _SUM_COLS
        )
    return out


def scatter_rows_reference(src: torch.Tensor, dest: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[dest[i]] = src[i]`` in place with plain torch; returns out."""
    return out.index_copy_(0, dest, src)


def _check_scatter_args(src: torch.Tensor, dest: torch.Tensor, out: torch.Tensor) -> None:
    if src.dim() != 2 or out.dim() != 2 or src.shape[1] != out.shape[1]:
        raise ValueError(
            f"src [n, w] and out [N, w] must share w, got {tuple(src.shape)} and {tuple(out.shape)}"
        )
    if dest.shape != (src.shape[0],) or dest.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"dest must be [{src.shape[0]}] int32/int64, got {tuple(dest.shape)} {dest.dtype}")
    if src.dtype != out.dtype or not (src.is_contiguous() and out.is_contiguous()):
        raise ValueError(f"src and out must be contiguous and of one dtype, got {src.dtype} and {out.dtype}")


def scatter_rows_triton(src: torch.Tensor, dest: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The Triton kernel of :func:`scatter_rows` (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
    _check_scatter_args(src, dest, out)
    n, width = src.shape
    if n and width:
        grid = (triton.cdiv(n, _SCATTER_ROWS), triton.cdiv(width, _SCATTER_COLS))
        _scatter_rows_kernel[grid](src, dest.contiguous(), out, n, width, _SCATTER_ROWS, _SCATTER_COLS)
    return out


def scatter_rows(src: torch.Tensor, dest: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy row i of src to row dest[i] of out, in place; returns out.

    src: [n, w] contiguous; dest: [n] int32/int64, distinct and in [0, out.shape[0]) (unchecked on
    the kernel path: the check would cost a device sync); out: [N, w] contiguous, src's dtype.
    CUDA tensors take the Triton kernel, the rest ``scatter_rows_reference`` (as in expert_sort,
    CPU training never goes through the interpreter).
    """
    from fmoe.kernels._triton import use_triton

    if src.is_cuda and use_triton(src):
        return scatter_rows_triton(src, dest, out)
    _check_scatter_args(src, dest, out)
    return scatter_rows_reference(src, dest, out)
