"""Does overlapping the FP32 promotion with the tensor cores make fmoe's grouped FP8 GEMMs faster?
(issue 26: Gluon kernels against fmoe's Triton kernels and BF16, at the experts' shapes)

fmoe's Triton kernels (``fmoe.kernels.fp8_gemm``) wait on each K-block's wgmma before scaling its
product into the accumulator - Triton 3.6 gives any ``tl.dot`` whose result is not its next dot's
accumulator a ``wgmma.wait_group 0`` - and rely on three resident programs per SM to keep the tensor
cores fed. DeepGEMM (1.19-1.28x these kernels, results/issue26_deepgemm_grouped_h100.json) overlaps
the promotion with other wgmma instead. Gluon, Triton's lower-level dialect, issues wgmma
asynchronously and waits explicitly, so the same recipe can be written both ways:

- ``overlap``: one warpgroup per program issues block k's wgmma, then waits for block k-1's
  (``warpgroup_mma_wait(1)``) and promotes it while block k runs; ``overlap=False`` is the Triton
  kernel's order, for a like-for-like baseline. The same kernel for the weight gradient (``wgrad``).
- ``ws``: warp-specialized - a loader warp issues the TMA loads into rings of stages, and either two
  math warpgroups take alternate 64x128 tiles (``rings=2``, CUTLASS's ping-pong) or one 8-warp
  partition takes 128x128 tiles (``rings=1``), each with the overlapped promotion; ``setmaxnreg``
  gives the math warps up to 232-240 registers, the loader 24.

Each kernel is checked before it is timed: against the float32 reference on the ragged checks
(empty experts, K = 768 / 1408 / 2048), its scattered rows (``out_rows``) against its plain ones,
and bitwise against the Triton kernel (recorded: the same products summed in the same order). Then both
families' four forward / input-gradient grouped GEMMs of one micro-batch (and the two merged weight
gradients of a step) are timed beside BF16 ``torch._grouped_mm`` and the Triton kernels, in one
process. CUDA (sm_90) only; written for Triton 3.6's Gluon (3.9 renamed
``tma.async_copy_global_to_shared`` to ``tma.async_load``).

    python3 -m benchmarks.bench_gluon_fp8 --out results.json [--variants ws_s4,...]   # repo root

Measured on an H100 (results/issue26_gluon_overlap_2026-12-07_h100.json): every forward / input-
gradient variant was bitwise equal to the Triton kernel (the overlapped weight gradients within FP32
rounding, their scales multiplied in another order) and every one was slower than it: the Triton-order
Gluon kernel 0.92x, the overlapped ones 0.45-0.86x (Qwen3); see the README's "How far FP8 can go".
"""

from __future__ import annotations

import argparse

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from benchmarks.bench_fp8_grouped import (
    BF16_REL,
    FAMILIES,
    NT_CHECKS,
    WGRAD_CHECKS,
    _gemms,
    _wgrads,
    ms,
    nt_case,
    rel,
    wgrad_case,
)
from benchmarks.common import write_result
from fmoe.kernels import fp8_gemm as fg
from fmoe.kernels.fp8_quant import GROUP, Fp8Act, Fp8ActT, TileMap, tile_map

# ----------------------------------------------------------------------------------------------
# 0. The tile walk, shared by the forward / input-gradient kernels


@triton.constexpr_function
def _mma_layout(block_m, block_n, num_warps):
    """The wgmma accumulator layout of a [block_m, block_n] tile over num_warps warps (16-row atoms
    down M first, m16 n k32 instructions)."""
    warps_m = min(block_m // 16, num_warps)
    return gl.NVMMADistributedLayout(
        version=[3, 0],
        warps_per_cta=[warps_m, num_warps // warps_m],
        instr_shape=[16, block_n * warps_m // num_warps, 32],
    )


@gluon.jit
def _load(a_desc, b_desc, a_row, b_row, k, bar, a_buf, b_buf, pred):
    """One K-block of both operands (A's rows from a_row, B's from b_row, columns from k) into a stage,
    signalling ``bar`` when both have landed; nothing when ``pred`` is false."""
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [a_row, k], bar, a_buf, pred=pred)
    tma.async_copy_global_to_shared(b_desc, [b_row, k], bar, b_buf, pred=pred)


@gluon.jit
def _ring(
    a_desc, b_desc, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr
):
    """STAGES stages of both operands' K-blocks and a ready barrier each (TMA signals it)."""
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
    return a_smem, b_smem, ready


@gluon.jit
def _tile(
    tile_id, num_m, num_n, E, k_tiles, tile_expert_ptr, tile_row_ptr, group_end_ptr, GROUP_M: gl.constexpr
):
    """Tile id -> (expert, first row, end row of the expert, K-blocks to run, n tile), GROUP_M m tiles
    side by side; a tile past the last expert runs no K-block (fmoe.kernels.fp8_gemm's order)."""
    per_group = GROUP_M * num_n
    first_m = (tile_id // per_group) * GROUP_M
    group_rows = gl.minimum(num_m - first_m, GROUP_M)
    mt = first_m + (tile_id % per_group) % group_rows
    nt = (tile_id % per_group) // group_rows
    e = gl.load(tile_expert_ptr + mt)
    row0 = gl.load(tile_row_ptr + mt)
    valid = e < E
    e = gl.minimum(e, E - 1)
    row_end = gl.where(valid, gl.load(group_end_ptr + e), row0)
    k_iters = gl.where(valid, k_tiles, 0)
    return e, row0, row_end, k_iters, nt


# ----------------------------------------------------------------------------------------------
# 1. One warpgroup a program, promotion of block k-1 overlapped with block k's wgmma (or not)


@gluon.jit
def _gl_nt_kernel(
    a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, tile_expert_ptr, tile_row_ptr, group_end_ptr, out_row_ptr,
    M, N, E, num_m, num_n, k_tiles, stride_cm, stride_sam, stride_sak, stride_sbe, stride_sbn, stride_sbk,
    SCATTER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    a_smem, b_smem, ready = _ring(a_desc, b_desc, STAGES, BLOCK_M, BLOCK_N, BLOCK_K)
    zero = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    counter = 0  # K-blocks this program has loaded (= consumed at each tile's end): slot and phase
    for tile_id in range(gl.program_id(0), num_m * num_n, NUM_PROGRAMS):
        e, row0, row_end, k_iters, nt = _tile(
            tile_id, num_m, num_n, E, k_tiles, tile_expert_ptr, tile_row_ptr, group_end_ptr, GROUP_M
        )
        n0 = nt * BLOCK_N
        b_row = e * N + n0

        for i in gl.static_range(STAGES - 1):  # prologue: the first STAGES - 1 blocks
            slot = (counter + i) % STAGES
            bar = ready.index(slot)
            _load(a_desc, b_desc, row0, b_row, i * BLOCK_K, bar, a_smem.index(slot), b_smem.index(slot), i < k_iters)  # fmt: skip

        rows = row0 + gl.arange(0, BLOCK_M, layout=row_layout)
        sa_ptrs = sa_ptr + gl.minimum(rows, M - 1) * stride_sam
        sb_base = sb_ptr + e * stride_sbe + (n0 // 128) * stride_sbn
        acc = zero
        s_prev = gl.zeros((BLOCK_M,), dtype=gl.float32, layout=row_layout)
        prev = warpgroup_mma_init(zero)
        for ki in range(k_iters):
            c = counter + ki
            slot = c % STAGES
            mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
            tok = warpgroup_mma(
                a_smem.index(slot), b_smem.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True
            )
            scale = gl.load(sa_ptrs + ki * stride_sak) * gl.load(sb_base + ki * stride_sbk)
            if OVERLAP:
                done = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))  # block ki-1's product
                acc = acc + done * gl.expand_dims(s_prev, 1)
                prev = tok
                s_prev = scale
            else:
                done = warpgroup_mma_wait(num_outstanding=0, deps=(tok,))
                acc = acc + done * gl.expand_dims(scale, 1)
            # block ki-1's slot is free (its wgmma is complete): load block ki + STAGES - 1 there
            nxt = ki + STAGES - 1
            pred = nxt < k_iters
            pslot = (counter + nxt) % STAGES
            bar = ready.index(pslot)
            _load(a_desc, b_desc, row0, b_row, nxt * BLOCK_K, bar, a_smem.index(pslot), b_smem.index(pslot), pred)  # fmt: skip
        if OVERLAP:
            done = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
            acc = acc + done * gl.expand_dims(s_prev, 1)
        counter += k_iters

        cols = n0 + gl.arange(0, BLOCK_N, layout=col_layout)
        in_rows = rows < row_end
        if SCATTER:
            dest = gl.load(out_row_ptr + rows, mask=in_rows, other=0).to(gl.int64)
        else:
            dest = rows.to(gl.int64)
        mask = gl.expand_dims(in_rows, 1) & gl.expand_dims(cols < N, 0)
        c_ptrs = c_ptr + gl.expand_dims(dest * stride_cm, 1) + gl.expand_dims(cols, 0)
        gl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)

    for st in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(st))


# ----------------------------------------------------------------------------------------------
# 2. The weight gradient (K = tokens, both operands scaled 1x128 along tokens), the same two orders


@gluon.jit
def _gl_wgrad_kernel(
    a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, group_start_ptr, group_len_ptr,
    M, N, E, num_m, num_n, stride_ce, stride_cm, stride_sat, stride_sam, stride_sbt, stride_sbn,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """C[e] = A[:, tokens of e] @ B[:, tokens of e]^T, both scaled 1x128 along tokens."""
    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    flat: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])  # one scale a thread, loaded once
    a_smem, b_smem, ready = _ring(a_desc, b_desc, STAGES, BLOCK_M, BLOCK_N, BLOCK_K)
    zero = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    counter = 0
    per_expert = num_m * num_n
    for tile_id in range(gl.program_id(0), E * per_expert, NUM_PROGRAMS):
        e = tile_id // per_expert
        t = tile_id % per_expert
        per_group = GROUP_M * num_n
        first_m = (t // per_group) * GROUP_M
        group_rows = gl.minimum(num_m - first_m, GROUP_M)
        mt = first_m + (t % per_group) % group_rows
        nt = (t % per_group) // group_rows
        t0 = gl.load(group_start_ptr + e)
        k_iters = gl.load(group_len_ptr + e) // BLOCK_K
        m0 = mt * BLOCK_M
        n0 = nt * BLOCK_N
        for i in gl.static_range(STAGES - 1):
            slot = (counter + i) % STAGES
            bar = ready.index(slot)
            _load(a_desc, b_desc, m0, n0, t0 + i * BLOCK_K, bar, a_smem.index(slot), b_smem.index(slot), i < k_iters)  # fmt: skip
        rows = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
        cols = n0 + gl.arange(0, BLOCK_N, layout=col_layout)
        sa_ptrs = (
            sa_ptr
            + gl.minimum(m0 + gl.arange(0, BLOCK_M, layout=flat), M - 1) * stride_sam
            + (t0 // BLOCK_K) * stride_sat
        )
        sb_ptrs = (
            sb_ptr
            + gl.minimum(n0 + gl.arange(0, BLOCK_N, layout=flat), N - 1) * stride_sbn
            + (t0 // BLOCK_K) * stride_sbt
        )
        acc = zero
        prev = warpgroup_mma_init(zero)
        for ki in range(k_iters):
            c = counter + ki
            slot = c % STAGES
            mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
            tok = warpgroup_mma(
                a_smem.index(slot), b_smem.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True
            )
            if OVERLAP:
                # block ki-1's scales (zero before the first block: prev is the zero tile)
                kp = gl.maximum(ki - 1, 0)
                sa = gl.convert_layout(gl.load(sa_ptrs + kp * stride_sat), row_layout)
                sb = gl.convert_layout(gl.load(sb_ptrs + kp * stride_sbt), col_layout)
                done = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
                acc = acc + done * gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)
                prev = tok
            else:
                sa = gl.convert_layout(gl.load(sa_ptrs + ki * stride_sat), row_layout)
                sb = gl.convert_layout(gl.load(sb_ptrs + ki * stride_sbt), col_layout)
                done = warpgroup_mma_wait(num_outstanding=0, deps=(tok,))
                acc = acc + done * (gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0))
            nxt = ki + STAGES - 1
            pred = nxt < k_iters
            pslot = (counter + nxt) % STAGES
            bar = ready.index(pslot)
            _load(a_desc, b_desc, m0, n0, t0 + nxt * BLOCK_K, bar, a_smem.index(pslot), b_smem.index(pslot), pred)  # fmt: skip
        if OVERLAP:
            kp = gl.maximum(k_iters - 1, 0)
            # an empty expert reads no scales (its group_start may be the end of them)
            live_m = gl.full((BLOCK_M,), 0, gl.int32, layout=flat) < k_iters
            live_n = gl.full((BLOCK_N,), 0, gl.int32, layout=flat) < k_iters
            sa = gl.convert_layout(gl.load(sa_ptrs + kp * stride_sat, mask=live_m, other=0.0), row_layout)
            sb = gl.convert_layout(gl.load(sb_ptrs + kp * stride_sbt, mask=live_n, other=0.0), col_layout)
            done = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
            acc = acc + done * gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)
        counter += k_iters
        mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
        c_ptrs = (
            c_ptr
            + e.to(gl.int64) * stride_ce
            + gl.expand_dims(rows.to(gl.int64) * stride_cm, 1)
            + gl.expand_dims(cols, 0)
        )
        gl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(st))


# ----------------------------------------------------------------------------------------------
# 3. Warp-specialized: a loader warp feeds the math warps' rings of stages through mbarriers;
#    with two rings, two math warpgroups take alternate tiles (ping-pong)


@gluon.jit
def _ws_loader(p, RING: gl.constexpr, SCATTER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
        GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, STAGES: gl.constexpr, NRINGS: gl.constexpr, MATH_WARPS: gl.constexpr):  # fmt: skip
    (a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, tile_expert_ptr, tile_row_ptr, group_end_ptr, out_row_ptr,
     M, N, E, num_m, num_n, k_tiles, stride_cm, stride_sam, stride_sak, stride_sbe, stride_sbn, stride_sbk,
     a_bufs, b_bufs, ready, empty) = p  # fmt: skip
    """The loader warp: each tile's K-blocks into its math partition's ring (tile j to ring j % NRINGS),
    each slot once that partition has released it."""
    c0 = 0
    c1 = 0
    j = 0
    for tile_id in range(gl.program_id(0), num_m * num_n, NUM_PROGRAMS):
        e, row0, row_end, k_iters, nt = _tile(
            tile_id, num_m, num_n, E, k_tiles, tile_expert_ptr, tile_row_ptr, group_end_ptr, GROUP_M
        )
        r = j % NRINGS
        base = gl.where(r == 0, c0, c1)
        for ki in range(k_iters):
            c = base + ki
            idx = r * STAGES + c % STAGES
            mbarrier.wait(empty.index(idx), ((c // STAGES) & 1) ^ 1)
            b_row = e * N + nt * BLOCK_N
            _load(a_desc, b_desc, row0, b_row, ki * BLOCK_K, ready.index(idx), a_bufs.index(idx), b_bufs.index(idx), True)  # fmt: skip
        c0 = gl.where(r == 0, c0 + k_iters, c0)
        c1 = gl.where(r == 0, c1, c1 + k_iters)
        j += 1  # noqa: SIM113 - a Gluon loop takes no enumerate


@gluon.jit
def _ws_math(p, RING: gl.constexpr, SCATTER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
        GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, STAGES: gl.constexpr, NRINGS: gl.constexpr, MATH_WARPS: gl.constexpr):  # fmt: skip
    (a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, tile_expert_ptr, tile_row_ptr, group_end_ptr, out_row_ptr,
     M, N, E, num_m, num_n, k_tiles, stride_cm, stride_sam, stride_sak, stride_sbe, stride_sbn, stride_sbk,
     a_bufs, b_bufs, ready, empty) = p  # fmt: skip
    """A math partition: ring RING's tiles, block k-1 promoted while block k's wgmma runs, each slot
    released to the loader once its wgmma is complete."""
    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, MATH_WARPS)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    zero = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    c = 0
    for tile_id in range(gl.program_id(0) + RING * NUM_PROGRAMS, num_m * num_n, NRINGS * NUM_PROGRAMS):
        e, row0, row_end, k_iters, nt = _tile(
            tile_id, num_m, num_n, E, k_tiles, tile_expert_ptr, tile_row_ptr, group_end_ptr, GROUP_M
        )
        n0 = nt * BLOCK_N
        rows = row0 + gl.arange(0, BLOCK_M, layout=row_layout)
        sa_ptrs = sa_ptr + gl.minimum(rows, M - 1) * stride_sam
        sb_base = sb_ptr + e * stride_sbe + (n0 // 128) * stride_sbn
        acc = zero
        prev = warpgroup_mma_init(zero)
        for ki in range(k_iters):
            cc = c + ki
            idx = RING * STAGES + cc % STAGES
            mbarrier.wait(ready.index(idx), (cc // STAGES) & 1)
            tok = warpgroup_mma(
                a_bufs.index(idx), b_bufs.index(idx).permute((1, 0)), zero, use_acc=False, is_async=True
            )
            kp = gl.maximum(ki - 1, 0)  # block ki-1's scales (block 0's before it: prev is then zero)
            scale = gl.load(sa_ptrs + kp * stride_sak) * gl.load(sb_base + kp * stride_sbk)
            done = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
            acc = acc + done * gl.expand_dims(scale, 1)
            mbarrier.arrive(empty.index(RING * STAGES + (cc + STAGES - 1) % STAGES), pred=ki > 0)
            prev = tok
        kp = gl.maximum(k_iters - 1, 0)
        in_rows = rows < row_end
        scale = gl.load(sa_ptrs + kp * stride_sak, mask=in_rows, other=0.0) * gl.load(
            sb_base + kp * stride_sbk
        )
        done = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
        acc = acc + done * gl.expand_dims(scale, 1)
        mbarrier.arrive(empty.index(RING * STAGES + (c + k_iters + STAGES - 1) % STAGES), pred=k_iters > 0)
        c += k_iters
        cols = n0 + gl.arange(0, BLOCK_N, layout=col_layout)
        if SCATTER:
            dest = gl.load(out_row_ptr + rows, mask=in_rows, other=0).to(gl.int64)
        else:
            dest = rows.to(gl.int64)
        mask = gl.expand_dims(in_rows, 1) & gl.expand_dims(cols < N, 0)
        c_ptrs = c_ptr + gl.expand_dims(dest * stride_cm, 1) + gl.expand_dims(cols, 0)
        gl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _ws_nt_kernel(
    a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, tile_expert_ptr, tile_row_ptr, group_end_ptr, out_row_ptr,
    M, N, E, num_m, num_n, k_tiles, stride_cm, stride_sam, stride_sak, stride_sbe, stride_sbn, stride_sbk,
    SCATTER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, STAGES: gl.constexpr, MATH_REGS: gl.constexpr,
    NRINGS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NRINGS * STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NRINGS * STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NRINGS * STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NRINGS * STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(NRINGS * STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=1)
    p = (a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, tile_expert_ptr, tile_row_ptr, group_end_ptr, out_row_ptr,
         M, N, E, num_m, num_n, k_tiles, stride_cm, stride_sam, stride_sak, stride_sbe, stride_sbn, stride_sbk,
         a_bufs, b_bufs, ready, empty)  # fmt: skip
    # (constexpr arguments spelled out: a tuple built with + would lose their constexpr-ness)
    if NRINGS == 2:  # two 4-warp math partitions taking alternate tiles, and the loader
        gl.warp_specialize([
            (_ws_math, (p, 0, SCATTER, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, STAGES, NRINGS, 4)),
            (_ws_math, (p, 1, SCATTER, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, STAGES, NRINGS, 4)),
            (_ws_loader, (p, 0, SCATTER, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, STAGES, NRINGS, 4)),
        ], [4, 1], [MATH_REGS, 24])  # fmt: skip
    else:  # one math partition of num_warps warps, and the loader
        gl.warp_specialize([
            (_ws_math, (p, 0, SCATTER, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, STAGES, NRINGS, num_warps)),
            (_ws_loader, (p, 0, SCATTER, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, STAGES, NRINGS, num_warps)),
        ], [1], [24])  # fmt: skip


# ----------------------------------------------------------------------------------------------
# 4. Launchers: the same arguments as fmoe's Triton launches


def _descs(a: Tensor, b: Tensor, block_m: int, block_n: int):
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, GROUP], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([block_n, GROUP], gl.float8e4nv)
    return (
        TensorDescriptor.from_tensor(a, [block_m, GROUP], a_layout),
        TensorDescriptor.from_tensor(b, [block_n, GROUP], b_layout),
    )


def gluon_gemm_nt(
    a: Fp8Act,
    b: Tensor,
    b_scale: Tensor,
    offs: Tensor,
    *,
    out_rows: Tensor | None = None,
    tiles: TileMap | None = None,
    ws: bool = False,
    rings: int = 2,
    block_m: int = 64,
    stages: int = 4,
    programs_per_sm: int = 2,
    overlap: bool = True,
    group_m: int = 8,
    maxnreg: int | None = None,
) -> Tensor:
    """fp8_gemm_nt(a, b, b_scale, offs, out_rows=..., tiles=...) on a Gluon kernel: a Fp8Act [M, K],
    b [experts, N, K] float8_e4m3fn with b_scale [experts, N/128, K/128] -> [M, N] bf16.
    ws: the warp-specialized kernel (rings 2: 64-row tiles, two math warpgroups; rings 1: block_m
    128, one 8-warp math partition; one program per SM); else the one-warpgroup kernel."""
    M, K = a.data.shape
    E, N, _ = b.shape
    out = torch.empty(M, N, dtype=torch.bfloat16, device=a.data.device)
    if M == 0 or N == 0:
        return out
    block_n = 128
    if ws:
        block_m, programs_per_sm = (64, 1) if rings == 2 else (128, 1)
    a_desc, b_desc = _descs(a.data, b.view(-1, K), block_m, block_n)
    tm = tiles if tiles is not None and tiles.tile == block_m else tile_map(offs, M, block_m)
    num_n = triton.cdiv(N, block_n)
    work = triton.cdiv(tm.cap * num_n, rings if ws else 1)
    programs = max(1, min(work, programs_per_sm * fg.num_sms(a.data.device)))
    args = (
        a_desc, b_desc, out, a.scale, b_scale, tm.expert, tm.row, tm.group_end,
        tm.expert if out_rows is None else out_rows,
        M, N, E, tm.cap, num_n, triton.cdiv(K, GROUP), out.stride(0), a.scale.stride(0), a.scale.stride(1),
        b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
    )  # fmt: skip
    common = dict(SCATTER=out_rows is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP,
                  GROUP_M=group_m, NUM_PROGRAMS=programs, STAGES=stages)  # fmt: skip
    if ws:
        # registers: maxnreg 168 over 12 warps (math 8 + the loader's warpgroup) fills the SM's 64K;
        # setmaxnreg moves the loader's to the math warps (232 a thread for the second warpgroup)
        warps = 4 if rings == 2 else 8
        _ws_nt_kernel[(programs,)](*args, **common, MATH_REGS=232, NRINGS=rings, num_warps=warps, maxnreg=168)
    else:
        opts = {"maxnreg": maxnreg} if maxnreg else {}
        _gl_nt_kernel[(programs,)](*args, **common, OVERLAP=overlap, num_warps=block_m // 16, **opts)
    return out


def gluon_gemm_wgrad(
    a: Fp8ActT,
    b: Fp8ActT,
    *,
    block_n: int = 128,
    stages: int = 4,
    programs_per_sm: int = 2,
    overlap: bool = True,
) -> Tensor:
    """fp8_gemm_wgrad(a, b, grouped=True) on the Gluon kernel: a, b Fp8ActT of dy [M, cap] and x
    [N, cap] -> [experts, M, N] bf16."""
    E = a.group_len.numel()
    M, N = a.data.shape[0], b.data.shape[0]
    out = torch.empty(E, M, N, dtype=torch.bfloat16, device=a.data.device)
    block_m = 64
    a_desc, b_desc = _descs(a.data, b.data, block_m, block_n)
    num_m, num_n = triton.cdiv(M, block_m), triton.cdiv(N, block_n)
    programs = max(1, min(E * num_m * num_n, programs_per_sm * fg.num_sms(a.data.device)))
    _gl_wgrad_kernel[(programs,)](
        a_desc, b_desc, out, a.scale, b.scale, a.group_start, a.group_len, M, N, E, num_m, num_n,
        out.stride(0), out.stride(1), a.scale.stride(1), a.scale.stride(0), b.scale.stride(1), b.scale.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP, GROUP_M=8, NUM_PROGRAMS=programs, STAGES=stages,
        OVERLAP=overlap, num_warps=4,
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------
# 5. Checks, then timings

NT_VARIANTS = {
    # the Triton kernel's order and residency (3 programs of 4 warps, registers capped at 168)
    "noov_s3_x3": dict(stages=3, programs_per_sm=3, overlap=False, maxnreg=168),
    # overlapped promotion: ~227 registers, so two programs a SM
    "ov_s4_x2": dict(stages=4, programs_per_sm=2),
    "ov_s3_x2": dict(stages=3, programs_per_sm=2),
    "ov_s2_x2": dict(stages=2, programs_per_sm=2),
    # one program of two warpgroups (128-row tiles) a SM, not warp-specialized
    "ov_m128w8_s4_x1": dict(block_m=128, stages=4, programs_per_sm=1),
    # warp-specialized ping-pong (stages per math warpgroup's ring)
    "ws_s2": dict(ws=True, stages=2),
    "ws_s3": dict(ws=True, stages=3),
    "ws_s4": dict(ws=True, stages=4),
    "ws_s4_g4": dict(ws=True, stages=4, group_m=4),
    # warp-specialized, one 8-warp math partition on 128x128 tiles
    "ws128_s4": dict(ws=True, rings=1, stages=4),
    "ws128_s6": dict(ws=True, rings=1, stages=6),
    "ws128_s5_g4": dict(ws=True, rings=1, stages=5, group_m=4),
}
WGRAD_VARIANTS = {
    "noov_s3_x2": dict(stages=3, overlap=False),
    "ov_s4_x2": dict(stages=4),
    "ov_n64_s4_x3": dict(block_n=64, stages=4, programs_per_sm=3),
}


def check(nt_variants: list[str], wgrad_variants: list[str]) -> dict:
    """Each variant on the ragged checks: relative error to the float32 reference, scattered rows,
    bitwise equality with the Triton kernel."""
    out = {}
    for name, counts, n, k in NT_CHECKS:
        offs, x, _, xq, wq = nt_case(counts, n, k, seed=0)
        want = fg.fp8_gemm_nt_reference(xq, wq.data, wq.scale, offs, out_dtype=torch.float32)
        triton_out = fg.fp8_gemm_nt(xq, wq.data, wq.scale, offs)
        perm = torch.randperm(x.shape[0], device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        for v in nt_variants:
            got = gluon_gemm_nt(xq, wq.data, wq.scale, offs, **NT_VARIANTS[v])
            scattered = gluon_gemm_nt(xq, wq.data, wq.scale, offs, out_rows=perm, **NT_VARIANTS[v])
            out[f"{name}/{v}"] = {
                "rel": rel(got, want),
                "scatter_equal": bool(torch.equal(scattered[perm], got)),
                "bitwise_triton": bool(torch.equal(got, triton_out)),
            }
    for name, counts, m, n in WGRAD_CHECKS:
        offs, _, _, dyt, xt = wgrad_case(counts, m, n, seed=0)
        want = fg.fp8_gemm_wgrad_reference(dyt, xt, out_dtype=torch.float32)
        triton_out = fg.fp8_gemm_wgrad(dyt, xt, grouped=True)
        for v in wgrad_variants:
            got = gluon_gemm_wgrad(dyt, xt, **WGRAD_VARIANTS[v])
            out[f"{name}/wgrad_{v}"] = {
                "rel": rel(got, want),
                "scatter_equal": True,
                "bitwise_triton": bool(torch.equal(got, triton_out)),
            }
    return out


def timings(family: str, nt_variants: list[str], wgrad_variants: list[str]) -> dict:
    """ms of each GEMM: BF16, Triton, each variant; and the sums over the four forward / input-gradient
    GEMMs (``nt``) and the two weight gradients (``wgrad``)."""
    r = {}
    for n, g in _gemms(*FAMILIES[family]).items():  # (offs, Fp8Act, fp8 w, w scales, bf16 x, bf16 w^T, flop)
        row = {"bf16": ms(lambda g=g: torch._grouped_mm(g[4], g[5], offs=g[0]))}
        row["triton"] = ms(lambda g=g: fg.fp8_gemm_nt(g[1], g[2], g[3], g[0]))
        for v in nt_variants:
            row[v] = ms(lambda g=g, v=v: gluon_gemm_nt(g[1], g[2], g[3], g[0], **NT_VARIANTS[v]))
        r[n] = row
    for n, w in _wgrads(*FAMILIES[family]).items():  # (dy^T, x^T: Fp8ActT, bf16 dy^T, bf16 x, offs, flop)
        row = {"bf16": ms(lambda w=w: torch._grouped_mm(w[2], w[3], offs=w[4]))}
        row["triton"] = ms(lambda w=w: fg.fp8_gemm_wgrad(w[0], w[1], grouped=True))
        for v in wgrad_variants:
            row["wgrad_" + v] = ms(lambda w=w, v=v: gluon_gemm_wgrad(w[0], w[1], **WGRAD_VARIANTS[v]))
        r[n] = row
    nt = [n for n in r if not n.endswith("wgrad")]
    wg = [n for n in r if n.endswith("wgrad")]
    r["nt_sum_ms"] = {k: sum(r[n][k] for n in nt) for k in r[nt[0]]}
    r["wgrad_sum_ms"] = {k: sum(r[n][k] for n in wg) for k in r[wg[0]]}
    return r


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=",".join(NT_VARIANTS), help="forward / input-gradient kernels")
    ap.add_argument("--wgrad-variants", default=",".join(WGRAD_VARIANTS), help="weight-gradient kernels")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    nt_variants = [v for v in args.variants.split(",") if v]
    wgrad_variants = [v for v in args.wgrad_variants.split(",") if v]
    unknown = [v for v in nt_variants if v not in NT_VARIANTS] + [
        v for v in wgrad_variants if v not in WGRAD_VARIANTS
    ]
    if unknown:
        ap.error(f"--variants / --wgrad-variants: unknown {unknown}; known: {', '.join(NT_VARIANTS)} / "
                 f"{', '.join(WGRAD_VARIANTS)}")  # fmt: skip
    if not torch.cuda.is_available():
        ap.error("a CUDA (sm_90) GPU is needed: the kernels are Gluon's Hopper ones")
    checks = check(nt_variants, wgrad_variants)
    ok = all(c["rel"] <= BF16_REL and c["scatter_equal"] for c in checks.values())
    result = {
        "benchmark": "issue 26: grouped FP8 GEMMs with the promotion overlapped (Gluon) against fmoe's Triton kernels and BF16",
        "command": "python3 -m benchmarks.bench_gluon_fp8 " + " ".join(argv or []),
        "checks_ok": ok,
        "checks": checks,
    }
    if ok:
        for family in FAMILIES:
            result[family] = timings(family, nt_variants, wgrad_variants)
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
