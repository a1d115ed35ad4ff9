"""FP8 (E4M3) quantization with FP32 scales, DeepSeek-V3's recipe.

Three layouts, each a frozen container of tensors:
- ``Fp8Act``: activations / output gradients, 1x128 groups along the last (feature) dim. Feeds the
  forward and input-gradient GEMMs as their left operand.
- ``Fp8ActT``: the same tensor transposed, 1x128 groups along *tokens*, each expert's token range
  padded to a multiple of 128 tokens with zeros, so that no scale group straddles two experts.
  Feeds the weight-gradient GEMM (dW = dY^T X reduces over tokens). Written by a fused kernel that
  reads the input once and can also write the ``Fp8Act`` layout in the same pass.
- ``Fp8Weight``: 128x128 blocks, stored both as ``[out, in]`` (forward) and ``[in, out]`` (input
  gradient). A 128x128 block is the same block after transposition, so both copies share their
  values; the weight is quantized once per optimizer step and reused across microbatches.

A value ``v`` of a group with absolute maximum ``amax`` is stored as
``q = e4m3(clamp(v * (1 / s), -448, 448))`` with ``s = max(amax, 1e-12) / 448`` (``s`` rounded up to
a power of two when ``pow2_scales``), and read back as ``q * s``. Every kernel here writes exactly
the bits of its ``*_reference``: divisions are IEEE (``div_rn``), and under the interpreter, whose
float8 cast does not round to nearest-even, the cast is done with integer arithmetic instead.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fmoe.kernels._triton import interpreting, tl, triton, use_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128  # elements per scale group (1x128) and block side (128x128)
AMAX_EPS = 1e-12  # floor of a group's amax, so an all-zero group gets a finite scale

# Launch shapes of the memory-bound kernels (measured on one H200, benchmarks/bench_fp8.py)
ROWS_BLOCK_R, ROWS_WARPS = 32, 4  # _quant_rows_kernel: rows x 128 columns per program
TILES_WARPS = 4  # _quant_tiles_kernel: 128 x 128 per program
WEIGHT_WARPS = 8


@dataclass(frozen=True)
class Fp8Act:
    """Row-quantized activation (1x128 groups along the last dim).

    data:  [rows, cols] float8_e4m3fn
    scale: [rows, cdiv(cols, 128)] float32, column-major (stride (1, rows)) so a GEMM tile reads
           its rows' scales of one K-block contiguously
    """

    data: Tensor
    scale: Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


@dataclass(frozen=True)
class Fp8ActT:
    """Token-transposed activation (1x128 groups along tokens), per-expert padded to 128 tokens.

    data:        [cols, cap] float8_e4m3fn; expert e's tokens are columns
                 [group_start[e], group_start[e] + group_len[e]), the padding and the tail are zeros
    scale:       [cols, cap / 128] float32, column-major (stride (1, cols))
    group_start: [experts] int32, multiples of 128
    group_len:   [experts] int32, multiples of 128 (0 for an empty expert)
    """

    data: Tensor
    scale: Tensor
    group_start: Tensor
    group_len: Tensor


@dataclass(frozen=True)
class Fp8Weight:
    """A weight quantized in 128x128 blocks, in the two layouts the forward and input-gradient GEMMs read.

    data:    [out, in] or [experts, out, in] float8_e4m3fn
    scale:   [cdiv(out, 128), cdiv(in, 128)] (or with a leading experts dim) float32
    data_t:  [in, out] or [experts, in, out] float8_e4m3fn (the same values, transposed)
    scale_t: [cdiv(in, 128), cdiv(out, 128)] (or with a leading experts dim) float32
    """

    data: Tensor
    scale: Tensor
    data_t: Tensor
    scale_t: Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------
# Triton device helpers


@triton.jit
def _scales(amax, POW2: tl.constexpr):
    """Dequantization scale and its reciprocal for groups with absolute maximum ``amax`` (fp32)."""
    s = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)  # AMAX_EPS, FP8_MAX
    if POW2:
        # round up to a power of two on the bits: exact, and the same on every backend
        s = ((s.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    return s, tl.math.div_rn(1.0, s)


@triton.jit
def _e4m3_bits(v, EMULATE: tl.constexpr):
    """fp32 -> E4M3 (round to nearest even, saturating at 448), returned as uint8 bits.

    ``EMULATE`` does the rounding with integer arithmetic: Triton's interpreter truncates instead
    of rounding to nearest even, and the tests compare bits with torch's cast.
    """
    v = tl.clamp(v, -448.0, 448.0)
    if EMULATE:
        bits = v.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = bits & 0x7FFFFFFF
        # normal range (|v| >= 2^-6): keep 3 mantissa bits with a round-to-nearest-even carry,
        # rebias the exponent from 127 to 7
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
        # subnormals are multiples of 2^-9: round |v| * 2^9 to an integer (nearest even via 2^23)
        y = a.to(tl.float32, bitcast=True) * 512.0
        sub = ((y + 8388608.0) - 8388608.0).to(tl.int32)
        code = tl.where(a < 0x3C800000, sub, normal)
        return (code | sign).to(tl.uint8)
    else:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _silu_mul(g, u):
    """SwiGLU's elementwise product silu(g) * u, in fp32."""
    return g * tl.sigmoid(g) * u


@triton.jit
def _load_act(ptrs, mask, half, PROLOGUE: tl.constexpr):
    """A tile of the tensor being quantized, in fp32; ptrs: the tile's element pointers (any 2-D
    arrangement: a tile or its transpose).

    PROLOGUE 0: x itself. PROLOGUE 1: SwiGLU of x = [gate | up] (columns c and half + c).
    """
    if PROLOGUE == 1:
        g = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(ptrs + half, mask=mask, other=0.0).to(tl.float32)
        # rounded to x's dtype first, so that the fused kernel quantizes what swiglu() returns
        return _silu_mul(g, u).to(ptrs.dtype.element_ty).to(tl.float32)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _row_bases(parts, src_part_ptr, src_row_ptr, rows, rmask, stride_xm, GATHER: tl.constexpr):
    """Pointers to the first element of each of ``rows``: of ``parts[0]`` itself, or, GATHER, of row
    ``src_row[r]`` of ``parts[src_part[r]]`` (every part has row stride ``stride_xm``)."""
    if GATHER:
        part = tl.load(src_part_ptr + rows, mask=rmask, other=0)
        off = tl.load(src_row_ptr + rows, mask=rmask, other=0).to(tl.int64) * stride_xm
        base = parts[0] + off
        for j in tl.static_range(1, len(parts)):
            base = tl.where(part == j, parts[j] + off, base)
        return base
    else:
        return parts[0] + rows.to(tl.int64) * stride_xm


@triton.jit
def _e4m3_value(bits, EMULATE: tl.constexpr):
    """E4M3 bits (uint8) -> their fp32 value, exactly. ``EMULATE`` decodes with integer arithmetic
    (the interpreter's float8 casts are not exact); it reads the NaN code (written only for a
    non-finite input, whose group's scale is then non-finite too) as 480."""
    if EMULATE:
        b = bits.to(tl.int32)
        e = (b >> 3) & 0xF
        m = (b & 7).to(tl.float32)
        # normal: (1 + m/8) 2^(e-7) = (8 + m) 2^(e-10); subnormal (e = 0): m 2^-9
        mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
        return tl.where((b & 0x80) != 0, -mag, mag)
    else:
        return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _row_scales(sparts, part_rows, src_part_ptr, src_row_ptr, rows, rmask, kb, GATHER: tl.constexpr):
    """The 1x128 scales of group ``kb`` of each of ``rows`` of Fp8Act parts whose scales
    (column-major [rows_j, groups], stride (1, rows_j)) start at ``sparts[j]``, rows_j =
    ``part_rows[j] // 16`` (see :func:`_launch_tiles`). The rows are chosen as :func:`_row_bases`
    chooses them."""
    kb64 = kb.to(tl.int64)
    if GATHER:
        part = tl.load(src_part_ptr + rows, mask=rmask, other=0)
        r = tl.load(src_row_ptr + rows, mask=rmask, other=0).to(tl.int64)
        ptr = sparts[0] + kb64 * (part_rows[0] // 16) + r
        for j in tl.static_range(1, len(sparts)):
            ptr = tl.where(part == j, sparts[j] + kb64 * (part_rows[j] // 16) + r, ptr)
    else:
        ptr = sparts[0] + kb64 * (part_rows[0] // 16) + rows.to(tl.int64)
    return tl.load(ptr, mask=rmask, other=0.0)


# ----------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    src_row_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_qm,
    half,
    PROLOGUE: tl.constexpr,
    GATHER: tl.constexpr,
    POW2: tl.constexpr,
    EMULATE: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """1x128 groups: program (i, kb) quantizes rows [i*BLOCK_R, +BLOCK_R) x columns [kb*128, +128)
    of x, or, GATHER, of the rows ``x[src_row[r]]`` (written at r: the gathered copy is never made)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kb = tl.program_id(1)
    cols = kb * 128 + tl.arange(0, 128)
    rmask = rows < M
    mask = rmask[:, None] & (cols[None, :] < K)
    if GATHER:
        src = tl.load(src_row_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    v = _load_act((x_ptr + src * stride_xm)[:, None] + cols[None, :], mask, half, PROLOGUE)
    s, inv = _scales(tl.max(tl.abs(v), axis=1), POW2)
    bits = _e4m3_bits(v * inv[:, None], EMULATE)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], bits, mask=mask)
    tl.store(s_ptr + kb * M + rows, s, mask=rmask)


@triton.jit
def _quant_tiles_kernel(
    parts,
    sparts,
    part_rows,
    src_part_ptr,
    src_row_ptr,
    q_ptr,
    s_ptr,
    qt_ptr,
    st_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    group_end_ptr,
    group_ptr,
    M,
    K,
    E,
    stride_xm,
    stride_qm,
    stride_qtk,
    half,
    PROLOGUE: tl.constexpr,
    DEQUANT: tl.constexpr,
    ROWS: tl.constexpr,
    GATHER: tl.constexpr,
    GROUPED: tl.constexpr,
    POW2: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Token tiles of 128 rows within one expert x 128 columns: reads the tile once and writes its
    token-transposed quantization (columns [t*128, +128) of ``qt``) and, if ``ROWS``, its 1x128
    row quantization. Tiles past the last expert write zeros, so ``qt`` is defined everywhere.
    The rows are those of ``parts[0]``, or, GATHER, gathered from the parts (:func:`_row_bases`).
    GROUPED: the tiles are those of a ``TileMap``; else all M rows are one group, tile t is rows
    [t*128, +128), and program (0, 0) writes the group's start and length (0, cdiv(M, 128) * 128)
    to ``group_ptr`` [2] int32, so a dense tensor costs no tile map and no offsets tensor.
    DEQUANT: the parts are Fp8Act rows (their bits, scales at ``sparts``): each tile is their values
    (bits times scale, in fp32), quantized again along tokens."""
    t = tl.program_id(0)
    kb = tl.program_id(1)
    if GROUPED:
        e = tl.load(tile_expert_ptr + t)
        row0 = tl.load(tile_row_ptr + t)
        end = tl.where(e < E, tl.load(group_end_ptr + tl.minimum(e, E - 1)), row0)
    else:
        row0 = t * 128
        end = M
        if t == 0 and kb == 0:
            tl.store(group_ptr + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, 0, tl.cdiv(M, 128) * 128))
    r = tl.arange(0, 128)
    rows = row0 + r
    cols = kb * 128 + tl.arange(0, 128)
    rmask = rows < end
    cmask = cols < K
    mask = rmask[:, None] & cmask[None, :]
    base = _row_bases(parts, src_part_ptr, src_row_ptr, rows, rmask, stride_xm, GATHER)
    if DEQUANT:
        s_row = _row_scales(sparts, part_rows, src_part_ptr, src_row_ptr, rows, rmask, kb, GATHER)
        bits = tl.load(base[:, None] + cols[None, :], mask=mask, other=0)
        v = _e4m3_value(bits, EMULATE) * s_row[:, None]
    else:
        v = _load_act(base[:, None] + cols[None, :], mask, half, PROLOGUE)

    s_t, inv_t = _scales(tl.max(tl.abs(v), axis=0), POW2)
    if DEQUANT:
        # the bits loaded again through transposed pointers (from L2), as for a plain tensor below
        bits_t = tl.load(base[None, :] + cols[:, None], mask=rmask[None, :] & cmask[:, None], other=0)
        v_t = _e4m3_value(bits_t, EMULATE) * s_row[None, :]
    elif PROLOGUE == 0 and not ROWS:
        # the tile is loaded again through transposed pointers (from L2: HBM sees one read): 80% of
        # a copy's bandwidth on an H100 against 67% through tl.trans (issue26_quant_bandwidth_h100.json)
        v_t = _load_act(base[None, :] + cols[:, None], rmask[None, :] & cmask[:, None], half, PROLOGUE)
    else:
        # transposed in registers: with SwiGLU to recompute (49% vs 32%) or the rows to write too
        # (70% vs 67%) a second load does not pay
        v_t = tl.trans(v)
    bits_t = _e4m3_bits(v_t * inv_t[:, None], EMULATE)
    tok = t * 128 + r
    tl.store(qt_ptr + cols[:, None].to(tl.int64) * stride_qtk + tok[None, :], bits_t, mask=cmask[:, None])
    tl.store(st_ptr + t * K + cols, s_t, mask=cmask)

    if ROWS:
        s_r, inv_r = _scales(tl.max(tl.abs(v), axis=1), POW2)
        bits_r = _e4m3_bits(v * inv_r[:, None], EMULATE)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], bits_r, mask=mask)
        tl.store(s_ptr + kb * M + rows, s_r, mask=rmask)


@triton.jit
def _quant_weight_kernel(
    w_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, R, C, POW2: tl.constexpr, EMULATE: tl.constexpr
):
    """One 128x128 block of expert e's [R, C] weight -> its bits and scale in the [R, C] copy and
    in the [C, R] transposed copy, both written row-major.

    The block is loaded twice, as itself and through transposed pointers: the second load finds it
    in L2, so HBM sees one read of the weight (two launches, one a copy, read it twice). Both copies
    share the block's amax, so every bit of the transpose is that of the block untransposed. (No
    tl.trans of the tile and no store through transposed pointers: on an H200 with Triton 3.6 those
    lost bytes or corrupted the other copy; benchmarks/results/fp8_h200.json.)
    """
    rb = tl.program_id(0)
    cb = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    base = e * R * C
    rows = rb * 128 + tl.arange(0, 128)
    cols = cb * 128 + tl.arange(0, 128)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    v = tl.load(w_ptr + base + rows[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s, inv = _scales(tl.max(tl.max(tl.abs(v), axis=1), axis=0), POW2)
    tl.store(q_ptr + base + rows[:, None] * C + cols[None, :], _e4m3_bits(v * inv, EMULATE), mask=mask)
    tl.store(s_ptr + (e * tl.cdiv(R, 128) + rb) * tl.cdiv(C, 128) + cb, s)
    # the transpose: element (c, r) of the [C, R] copy is w[r, c]
    mask_t = (cols[:, None] < C) & (rows[None, :] < R)
    vt = tl.load(w_ptr + base + rows[None, :] * C + cols[:, None], mask=mask_t, other=0.0).to(tl.float32)
    tl.store(qt_ptr + base + cols[:, None] * R + rows[None, :], _e4m3_bits(vt * inv, EMULATE), mask=mask_t)
    tl.store(st_ptr + (e * tl.cdiv(C, 128) + cb) * tl.cdiv(R, 128) + rb, s)


# ----------------------------------------------------------------------------------------------
# Expert groups -> tiles


def check_offs(offs: Tensor, rows: int, name: str = "offs") -> Tensor:
    """Validate cumulative expert end offsets ([experts] int32, as torch._grouped_mm takes them)."""
    if offs.dim() != 1 or offs.numel() == 0:
        raise ValueError(
            f"{name}: expected a 1-D tensor of cumulative expert end offsets, got shape {tuple(offs.shape)}"
        )
    if offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected int32 offsets, got {offs.dtype}")
    if offs.device.type == "cpu":  # free to check here; on a GPU it would cost a sync
        if bool((offs[1:] < offs[:-1]).any()) or int(offs[0]) < 0:
            raise ValueError(f"{name}: offsets must be non-decreasing and non-negative, got {offs.tolist()}")
        if int(offs[-1]) != rows:
            raise ValueError(
                f"{name}: the last offset ({int(offs[-1])}) must equal the number of rows ({rows})"
            )
    return offs.to(torch.int32)


@dataclass(frozen=True)
class TileMap:
    """Tiles of ``tile`` rows that never straddle two experts, computed on the device (no sync).

    expert:      [cap] int32, the expert of each tile; ``experts`` for tiles past the last one
    row:         [cap] int32, the first row of each tile
    group_end:   [experts] int32, the end row of each expert (= offs)
    first_tile:  [experts] int32, index of each expert's first tile
    num_tiles:   [experts] int32, tiles per expert
    cap:         an upper bound of the number of tiles, cdiv(rows, tile) + experts - 1
    tile:        rows per tile
    """

    expert: Tensor
    row: Tensor
    group_end: Tensor
    first_tile: Tensor
    num_tiles: Tensor
    cap: int
    tile: int


# Tiles per program of _tile_map_kernel (at most), and the most experts it takes (their per-expert
# vectors live in registers; past this the torch reference builds the map).
TILE_MAP_BLOCK = 128
TILE_MAP_MAX_EXPERTS = 1024


@triton.jit
def _tile_map_kernel(offs_ptr, out_ptr, E, cap, tile, EP: tl.constexpr, BLOCK_T: tl.constexpr):
    # out (int32): expert [cap] | row [cap] | group_end [E] | first_tile [E] | num_tiles [E]. Every
    # program recomputes the per-expert prefix (E values, cheap) and maps its BLOCK_T tiles:
    # expert(t) = #experts whose tiles all end at or before t (a searchsorted, right side).
    e = tl.arange(0, EP)
    in_range = e < E
    ends = tl.load(offs_ptr + e, mask=in_range, other=0).to(tl.int32)
    starts = tl.load(offs_ptr + e - 1, mask=in_range & (e > 0), other=0).to(tl.int32)
    ntiles = tl.where(in_range, (tl.maximum(ends - starts, 0) + tile - 1) // tile, 0)
    cum = tl.cumsum(ntiles, 0)
    first = cum - ntiles
    if tl.program_id(0) == 0:
        tl.store(out_ptr + 2 * cap + e, ends, mask=in_range)
        tl.store(out_ptr + 2 * cap + E + e, first, mask=in_range)
        tl.store(out_ptr + 2 * cap + 2 * E + e, ntiles, mask=in_range)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    done = (cum[None, :] <= t[:, None]) & in_range[None, :]
    expert = tl.sum(done.to(tl.int32), 1)
    pick = e[None, :] == tl.minimum(expert, E - 1)[:, None]
    start = tl.sum(tl.where(pick, starts[None, :], 0), 1)
    first_of = tl.sum(tl.where(pick, first[None, :], 0), 1)
    t_ok = t < cap
    tl.store(out_ptr + t, expert, mask=t_ok)
    tl.store(out_ptr + cap + t, start + (t - first_of) * tile, mask=t_ok)


def tile_map_reference(offs: Tensor, rows: int, tile: int) -> TileMap:
    """:func:`tile_map` in plain torch ops."""
    ends = offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    ntiles = (ends - starts).clamp_min(0).add(tile - 1).div(tile, rounding_mode="floor")
    cum = torch.cumsum(ntiles, 0)
    first = cum - ntiles
    cap = _tile_cap(offs, rows, tile)
    t = torch.arange(cap, device=offs.device)
    expert = torch.searchsorted(cum, t, right=True)
    e = expert.clamp_max(offs.numel() - 1)
    row = starts[e] + (t - first[e]) * tile
    i32 = torch.int32
    return TileMap(expert.to(i32), row.to(i32), ends.to(i32), first.to(i32), ntiles.to(i32), cap, tile)


def _tile_cap(offs: Tensor, rows: int, tile: int) -> int:
    return max(cdiv(rows, tile) + offs.numel() - 1, 1)


def tile_map(offs: Tensor, rows: int, tile: int) -> TileMap:
    """The expert-aligned tiles of ``rows`` expert-grouped rows; offs [experts] int32/int64
    cumulative end rows. One Triton launch where kernels run (its ~12 torch ops cost more host
    time than the GEMM they feed at small shapes), else :func:`tile_map_reference`."""
    E = offs.numel()
    if not use_triton(offs) or E > TILE_MAP_MAX_EXPERTS:
        return tile_map_reference(offs, rows, tile)
    cap = _tile_cap(offs, rows, tile)
    out = torch.empty(2 * cap + 3 * E, dtype=torch.int32, device=offs.device)
    EP = max(triton.next_power_of_2(E), 16)
    block_t = max(16, min(TILE_MAP_BLOCK, 16384 // EP))  # the [tiles, experts] compare stays 16k
    _tile_map_kernel[(cdiv(cap, block_t),)](offs, out, E, cap, tile, EP=EP, BLOCK_T=block_t, num_warps=4)
    expert, row, group_end, first_tile, num_tiles = out.split([cap, cap, E, E, E])
    return TileMap(expert, row, group_end, first_tile, num_tiles, cap, tile)


# ----------------------------------------------------------------------------------------------
# Launchers


def _check_2d(x: Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D [tokens, features] tensor, got shape {tuple(x.shape)}")
    if x.stride(1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous, got strides {x.stride()}")


def _empty_scale(rows: int, cols: int, device) -> Tensor:
    """A [rows, cols] float32 tensor with column-major strides (1, rows)."""
    return torch.empty(cols, rows, dtype=torch.float32, device=device).t()


def quantize_act(x: Tensor, *, pow2_scales: bool = False) -> Fp8Act:
    """x: [tokens, features] bf16/fp32 -> Fp8Act with 1x128 groups along features."""
    _check_2d(x, "x")
    if not use_triton(x):
        return quantize_act_reference(x, pow2_scales=pow2_scales)
    return _launch_rows(x, x.shape[1], 0, 0, pow2_scales)


def _launch_rows(
    x: Tensor, K: int, half: int, prologue: int, pow2: bool, src_row: Tensor | None = None
) -> Fp8Act:
    """x's rows, or (``src_row`` [M] int32) the rows ``x[src_row]``, quantized in 1x128 groups."""
    M = x.shape[0] if src_row is None else src_row.shape[0]
    q = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    s = _empty_scale(M, cdiv(K, GROUP), x.device)
    block_r = ROWS_BLOCK_R
    grid = (cdiv(M, block_r), cdiv(K, GROUP))
    if M > 0 and K > 0:
        _quant_rows_kernel[grid](
            x, s if src_row is None else src_row, q.view(torch.uint8), s, M, K, x.stride(0), q.stride(0), half,
            PROLOGUE=prologue, GATHER=src_row is not None, POW2=pow2, EMULATE=interpreting(),
            BLOCK_R=block_r, num_warps=ROWS_WARPS,
        )  # fmt: skip
    return Fp8Act(q, s)


def quantize_act_gathered(x: Tensor, src_row: Tensor, *, pow2_scales: bool = False) -> Fp8Act:
    """``quantize_act(x[src_row])`` without writing the gathered rows: each program reads its rows
    where they lie. x: [tokens, features] bf16/fp32 (last dim contiguous); src_row: [n] int32, the
    row of x each output row quantizes (a row may be read many times: a token's k routing slots)
    -> Fp8Act [n, features]. How the FP8 experts quantize their input straight from the tokens."""
    _check_2d(x, "x")
    _check_src_row(src_row, x)
    if not use_triton(x):
        return quantize_act_reference(x.index_select(0, src_row), pow2_scales=pow2_scales)
    return _launch_rows(x, x.shape[1], 0, 0, pow2_scales, src_row)


def _check_src_row(src_row: Tensor, x: Tensor) -> None:
    if src_row.dim() != 1 or src_row.dtype != torch.int32 or src_row.device != x.device:
        raise ValueError(
            f"src_row: expected a [n] int32 tensor on {x.device}, got {tuple(src_row.shape)} "
            f"{src_row.dtype} on {src_row.device}"
        )


def quantize_act_t(
    x: Tensor | Fp8Act, offs: Tensor | None = None, *, pow2_scales: bool = False, with_rows: bool = False
) -> Fp8ActT | tuple[Fp8Act, Fp8ActT]:
    """x: [tokens, features] -> Fp8ActT (groups along tokens, per expert), reading x once.

    offs: [experts] int32 cumulative end offsets of expert-grouped tokens (None: one group).
    with_rows: also return the Fp8Act of x from the same pass, as ``(Fp8Act, Fp8ActT)``.
    x an Fp8Act (its rows, 1x128 groups): its values (bits times scale, in fp32) quantized again
    along tokens - DeepSeek-V3's 1x128 -> 128x1 requantization of an operand kept in FP8 for the
    weight gradient; the bits equal ``quantize_act_t(dequantize_act(x), offs)`` (no with_rows).
    """
    if isinstance(x, Fp8Act):
        if with_rows:
            raise ValueError("quantize_act_t: with_rows is for a tensor; an Fp8Act already is its rows")
        _check_fp8_rows(x, "x")
        if not use_triton(x.data):
            return quantize_act_t_reference(dequantize_act(x), offs, pow2_scales=pow2_scales)
        return _launch_tiles(x, x.shape[1], 0, 0, _checked_offs(x.data, offs), pow2_scales, False)
    _check_2d(x, "x")
    if not use_triton(x):
        return quantize_act_t_reference(x, offs, pow2_scales=pow2_scales, with_rows=with_rows)
    return _launch_tiles(x, x.shape[1], 0, 0, _checked_offs(x, offs), pow2_scales, with_rows)


def _check_fp8_rows(a: Fp8Act, name: str) -> None:
    """An Fp8Act as the quantization kernels write it: [rows, k] float8 data, rows of contiguous
    elements, and [rows, cdiv(k, 128)] float32 scales of strides (1, rows)."""
    rows, k = a.data.shape if a.data.dim() == 2 else (-1, -1)
    if (
        a.data.dim() != 2
        or a.data.dtype != FP8_DTYPE
        or (rows > 0 and a.data.stride(1) != 1)
        or a.scale.shape != (rows, cdiv(k, GROUP))
        or a.scale.dtype != torch.float32
        or (rows > 1 and a.scale.stride(0) != 1)
        or (rows > 0 and a.scale.shape[1] > 1 and a.scale.stride(1) != rows)
        or a.scale.device != a.data.device
    ):
        raise ValueError(
            f"{name}: expected an Fp8Act of [rows, k] {FP8_DTYPE} data (rows contiguous) and column-major "
            f"[rows, k / 128] float32 scales, got data {tuple(a.data.shape)} {a.data.dtype} and "
            f"scale {tuple(a.scale.shape)} {a.scale.dtype} strides {a.scale.stride()}"
        )


def _checked_offs(x: Tensor, offs: Tensor | None) -> Tensor | None:
    """offs validated against x's rows; None (one group) stays None: the kernels need no offsets."""
    return None if offs is None else _default_offs(x, offs)


def _default_offs(x: Tensor, offs: Tensor | None) -> Tensor:
    if offs is None:
        return torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)
    if offs.device != x.device:
        raise ValueError(f"offs: on {offs.device}, but the tokens are on {x.device}")
    return check_offs(offs, x.shape[0])


def _launch_tiles(
    x: Tensor | Fp8Act | tuple[Tensor, ...] | tuple[Fp8Act, ...],
    K: int,
    half: int,
    prologue: int,
    offs: Tensor | None,
    pow2: bool,
    rows: bool,
    src: tuple[Tensor, Tensor] | None = None,
):
    """x: the [M, *] tensor, or (with ``src`` = (src_part, src_row), [M] int32 each) the parts whose
    rows ``src`` gathers; every part has x's row stride. Fp8Act parts are requantized (their values
    quantized along tokens; not with ``rows``). offs: [E] int32 cumulative expert ends, or None: the
    M rows are one group (no tile map: the kernel knows its tiles and writes the group)."""
    parts = x if isinstance(x, tuple) else (x,)
    dequant = isinstance(parts[0], Fp8Act)
    if dequant:  # the kernel reads the bits and, per row, the scale of each 128-column group
        # each part's row count times 16: Triton specializes an int argument on its value (1, a
        # multiple of 16 or not), element by element in a tuple, so the counts themselves could
        # compile a kernel per pattern of P parts (the exchange's micro-batches differ); these are
        # all multiples of 16
        sparts, part_rows = tuple(p.scale for p in parts), tuple(16 * p.data.shape[0] for p in parts)
        parts = tuple(p.data.view(torch.uint8) for p in parts)
    else:
        sparts, part_rows = parts[:1], (0,)  # unused without DEQUANT
    first = parts[0]
    M = src[0].shape[0] if src is not None else first.shape[0]
    device = first.device
    if offs is None:
        tiles, E = max(cdiv(M, GROUP), 1), 1
        group = torch.empty(2, dtype=torch.int32, device=device)  # [start, len], written by the kernel
        maps = (group, group, group)  # unused pointers without GROUPED
    else:
        tm = tile_map(offs, M, GROUP)
        tiles, E = tm.cap, offs.numel()
        maps = (tm.expert, tm.row, tm.group_end)
    qt = torch.empty(K, tiles * GROUP, dtype=FP8_DTYPE, device=device)
    st = _empty_scale(K, tiles, device)
    q = torch.empty(M, K, dtype=FP8_DTYPE, device=device) if rows else qt
    s = _empty_scale(M, cdiv(K, GROUP), device) if rows else st
    src_part, src_row = src if src is not None else (maps[0], maps[0])  # unused pointers without GATHER
    if K > 0:
        _quant_tiles_kernel[(tiles, cdiv(K, GROUP))](
            parts, sparts, part_rows, src_part, src_row, q.view(torch.uint8), s, qt.view(torch.uint8), st,
            *maps, maps[0], M, K, E, first.stride(0), q.stride(0), qt.stride(0), half,
            PROLOGUE=prologue, DEQUANT=dequant, ROWS=rows, GATHER=src is not None, GROUPED=offs is not None,
            POW2=pow2, EMULATE=interpreting(), num_warps=TILES_WARPS,
        )  # fmt: skip
    elif offs is None:
        group = torch.tensor([0, cdiv(M, GROUP) * GROUP], dtype=torch.int32, device=device)
    if offs is None:
        out_t = Fp8ActT(qt, st, group[:1], group[1:])
    else:
        out_t = Fp8ActT(qt, st, tm.first_tile * GROUP, tm.num_tiles * GROUP)
    return (Fp8Act(q, s), out_t) if rows else out_t


# The most parts one gathered quantization reads (the kernel picks each row's part by a chain of
# selects, one per part, and is compiled once per number of parts)
GATHER_MAX_PARTS = 32


def quantize_act_t_gathered(
    parts: Sequence[Tensor] | Sequence[Fp8Act],
    src_part: Tensor,
    src_row: Tensor,
    offs: Tensor,
    *,
    pow2_scales: bool = False,
) -> Fp8ActT:
    """quantize_act_t of the rows ``parts[src_part[j]][src_row[j]]``, j = 0..n-1, in that order,
    without writing them out: each 128-token tile reads its rows where they lie.

    parts:             up to GATHER_MAX_PARTS contiguous [rows_i, k] tensors of one dtype and device,
                       or Fp8Acts of such rows (requantized, as ``quantize_act_t`` of an Fp8Act)
    src_part, src_row: [n] int32, the part and the row within it of each gathered row
    offs:              [experts] int32 cumulative expert end offsets of the n gathered rows
    The bits equal ``quantize_act_t(torch.cat(parts)[index], offs)`` (index: each gathered row's
    row in the concatenation); it is how a step's expert weight gradients, merged over micro-batches,
    are quantized without a copy of every micro-batch's rows.
    """
    parts = tuple(parts)
    if not 1 <= len(parts) <= GATHER_MAX_PARTS:
        raise ValueError(f"parts: expected 1 to {GATHER_MAX_PARTS} tensors, got {len(parts)}")
    fp8_rows = isinstance(parts[0], Fp8Act)
    if any(isinstance(p, Fp8Act) != fp8_rows for p in parts):
        raise ValueError("parts: expected all tensors or all Fp8Acts, got a mix")
    if fp8_rows:
        for i, part in enumerate(parts):
            _check_fp8_rows(part, f"parts[{i}]")
    first = parts[0].data if fp8_rows else parts[0]
    for i, part in enumerate(p.data if fp8_rows else p for p in parts):
        # one row stride for all (the kernel reads every part with parts[0]'s)
        rows_ok = (
            (part.stride(0) == first.stride(0) or part.shape[0] == 0) if fp8_rows else part.is_contiguous()
        )
        if part.dim() != 2 or not rows_ok:
            want = "data with parts[0]'s row stride" if fp8_rows else "a contiguous [rows, k] tensor"
            raise ValueError(
                f"parts[{i}]: expected {want}, got shape {tuple(part.shape)} strides {part.stride()}"
            )
        if (part.shape[1], part.dtype, part.device) != (first.shape[1], first.dtype, first.device):
            raise ValueError(
                f"parts[{i}]: {tuple(part.shape)} {part.dtype} on {part.device}, but parts[0] is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}"
            )
    n = src_part.shape[0]
    if (
        src_part.shape != (n,)
        or src_row.shape != (n,)
        or src_part.dtype != torch.int32
        or src_row.dtype != torch.int32
    ):
        raise ValueError(
            f"src_part, src_row: expected two [n] int32 tensors, got {tuple(src_part.shape)} "
            f"{src_part.dtype} and {tuple(src_row.shape)} {src_row.dtype}"
        )
    offs = check_offs(offs, n)
    if not use_triton(first):
        values = [dequantize_act(p) for p in parts] if fp8_rows else parts
        starts = torch.tensor([0] + [p.shape[0] for p in values[:-1]], device=first.device).cumsum(0)
        rows = torch.cat(values)[starts[src_part.long()] + src_row.long()]
        return quantize_act_t_reference(rows, offs, pow2_scales=pow2_scales)
    return _launch_tiles(parts, first.shape[1], 0, 0, offs, pow2_scales, False, (src_part, src_row))


def quantize_weight(w: Tensor, *, pow2_scales: bool = False) -> Fp8Weight:
    """w: [out, in] or [experts, out, in] (bf16/fp32) -> Fp8Weight with 128x128 block scales."""
    if w.dim() not in (2, 3):
        raise ValueError(f"w: expected [out, in] or [experts, out, in], got shape {tuple(w.shape)}")
    if not use_triton(w):
        return quantize_weight_reference(w, pow2_scales=pow2_scales)
    w3 = w.contiguous().view(-1, *w.shape[-2:])
    E, N, K = w3.shape
    NB, KB = cdiv(N, GROUP), cdiv(K, GROUP)
    q = torch.empty(E, N, K, dtype=FP8_DTYPE, device=w.device)
    s = torch.empty(E, NB, KB, dtype=torch.float32, device=w.device)
    qt = torch.empty(E, K, N, dtype=FP8_DTYPE, device=w.device)
    st = torch.empty(E, KB, NB, dtype=torch.float32, device=w.device)
    if w3.numel() > 0:  # [N, K] and its [K, N] transpose (the input gradient reads it), one launch
        _quant_weight_kernel[(NB, KB, E)](
            w3, q.view(torch.uint8), s, qt.view(torch.uint8), st, N, K,
            POW2=pow2_scales, EMULATE=interpreting(), num_warps=WEIGHT_WARPS,
        )  # fmt: skip
    if w.dim() == 2:
        q, qt, s, st = q[0], qt[0], s[0], st[0]
    return Fp8Weight(q, s, qt, st)


# ----------------------------------------------------------------------------------------------
# Plain-torch references (and the CPU path)


def _scales_reference(amax: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    # Divide by tensors, not Python scalars: on CUDA, torch turns ``t / scalar`` into ``t * (1 /
    # scalar)``, which is not the IEEE quotient the kernels compute (and rounds ~1 in 5 scales off).
    amax = amax.float().clamp_min(AMAX_EPS)
    s = torch.div(amax, torch.full_like(amax, FP8_MAX))
    if pow2:
        s = ((s.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)
    return s, torch.div(torch.ones_like(s), s)


def _cast_reference(v: Tensor) -> Tensor:
    return v.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _pad_to(x: Tensor, dim: int, multiple: int) -> Tensor:
    pad = (-x.shape[dim]) % multiple
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim)


def _quantize_groups_last(x: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    """x: [..., n] fp32 -> (q [..., n] fp8, s [..., cdiv(n, 128)]) with 1x128 groups along the last dim."""
    n = x.shape[-1]
    g = _pad_to(x, -1, GROUP).unflatten(-1, (-1, GROUP))
    s, inv = _scales_reference(g.abs().amax(-1), pow2)
    q = _cast_reference(g * inv[..., None]).flatten(-2)[..., :n]
    return q, s


def _col_major(s: Tensor) -> Tensor:
    return s.t().contiguous().t()


def quantize_act_reference(x: Tensor, *, pow2_scales: bool = False) -> Fp8Act:
    q, s = _quantize_groups_last(x.float(), pow2_scales)
    return Fp8Act(q, _col_major(s))


def quantize_act_t_reference(
    x: Tensor, offs: Tensor | None = None, *, pow2_scales: bool = False, with_rows: bool = False
) -> Fp8ActT | tuple[Fp8Act, Fp8ActT]:
    offs = _default_offs(x, offs)
    M, K = x.shape
    tm = tile_map(offs, M, GROUP)
    # token-major copy with each expert's rows moved to its padded slot; padding and tail are zero
    xp = x.new_zeros(tm.cap * GROUP, K, dtype=torch.float32)
    ends = offs.tolist()
    for e, (first, end) in enumerate(zip(tm.first_tile.tolist(), ends)):
        start = ends[e - 1] if e > 0 else 0
        xp[first * GROUP : first * GROUP + end - start] = x[start:end].float()
    qt, st = _quantize_groups_last(xp.t(), pow2_scales)
    out_t = Fp8ActT(qt.contiguous(), _col_major(st), tm.first_tile * GROUP, tm.num_tiles * GROUP)
    return (quantize_act_reference(x, pow2_scales=pow2_scales), out_t) if with_rows else out_t


def quantize_weight_reference(w: Tensor, *, pow2_scales: bool = False) -> Fp8Weight:
    w3 = w.float().reshape(-1, *w.shape[-2:])
    E, N, K = w3.shape
    blocks = _pad_to(_pad_to(w3, 1, GROUP), 2, GROUP)
    blocks = blocks.unflatten(2, (-1, GROUP)).unflatten(1, (-1, GROUP))  # [E, NB, 128, KB, 128]
    s, inv = _scales_reference(blocks.abs().amax(dim=(2, 4)), pow2_scales)  # [E, NB, KB]
    q = _cast_reference(blocks * inv[:, :, None, :, None]).flatten(3).flatten(1, 2)[:, :N, :K]
    qt, st = q.transpose(1, 2).contiguous(), s.transpose(1, 2).contiguous()
    if w.dim() == 2:
        q, s, qt, st = q[0], s[0], qt[0], st[0]
    return Fp8Weight(q.contiguous(), s.contiguous(), qt, st)


def dequantize_act(a: Fp8Act) -> Tensor:
    """Fp8Act -> [rows, cols] fp32."""
    n = a.data.shape[-1]
    return (a.data.float() * a.scale.repeat_interleave(GROUP, dim=-1)[..., :n]).contiguous()


def dequantize_act_t(a: Fp8ActT) -> Tensor:
    """Fp8ActT -> [cols, cap] fp32 (expert segments padded with zeros, as stored)."""
    return a.data.float() * a.scale.repeat_interleave(GROUP, dim=-1)


def dequantize_weight(w: Fp8Weight) -> Tensor:
    """Fp8Weight -> [out, in] or [experts, out, in] fp32."""
    N, K = w.data.shape[-2:]
    s = w.scale.repeat_interleave(GROUP, dim=-2).repeat_interleave(GROUP, dim=-1)
    return w.data.float() * s[..., :N, :K]
