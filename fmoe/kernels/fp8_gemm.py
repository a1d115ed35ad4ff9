"""Block-scaled FP8 GEMMs (DeepSeek-V3's recipe) in Triton, dense and expert-grouped, for Hopper.

Two kernels cover the three GEMMs of a linear layer and of an expert-grouped linear layer; every
operand is K-major (the layout FP8 wgmma reads), loaded by TMA descriptors:

- ``fp8_gemm_nt``: ``C[M, N] = A[M, K] @ B[N, K]^T``, A with 1x128 scales (``Fp8Act``), B with
  128x128 block scales (``Fp8Weight``). Forward (A = x, B = w) and input gradient (A = dy,
  B = w^T). With ``offs`` it is the grouped GEMM over expert-grouped rows (contiguous layout):
  B is ``[experts, N, K]`` and rows ``[offs[e-1], offs[e])`` use ``B[e]``; tiles never straddle two
  experts, empty experts cost nothing.
- ``fp8_gemm_wgrad``: ``C[e] = A_e @ B_e^T`` reducing over each expert's tokens, both operands
  token-transposed with 1x128 scales along tokens (``Fp8ActT``). Weight gradient
  (A = dy^T, B = x^T); dense is the one-expert case. An empty expert gets a zero gradient.

Both are persistent (``programs_per_sm`` programs per SM walk the tiles), accumulate in FP32 and promote each
128-deep partial product with its scales (``acc += dot(a, b) * sa * sb``), so the tensor cores'
reduced-precision FP8 accumulation never spans more than 128 products, and write BF16 (or FP32).
``GemmConfig`` sets the tiles; ``warp_specialize=True`` asks Triton for its Hopper producer /
two-consumer split (slower where it ran: see GemmConfig); ``prefetch_scales`` loads the next K-block's
scales a block ahead, on by default where the compiling Triton release makes it faster
(``PREFETCH_SCALES_BY_TRITON``).
Status: checked against the references on an H200 (every check of benchmarks/results/
fp8_checks_h200.json passes) and under the interpreter; the tile defaults are the sweep's best.

Backends: ``triton`` (these kernels; on CPU tensors under ``TRITON_INTERPRET=1``), ``torch`` (the
references below: dequantize, then an FP32 matmul), ``cublas`` (``fp8_cublas``: torch's
``scaled_mm`` on Hopper, for the dense forward / input-gradient / weight-gradient GEMMs of the
shapes ``cublas_supports`` lists) and ``deep_gemm`` when it is importable. ``auto`` takes deep_gemm,
then cuBLAS, where they apply, else Triton (:func:`choose_backend`, the one place that decides);
``FMOE_KERNEL_BACKEND`` or the ``backend`` argument forces one. deep_gemm could not be installed
where this was written, so its adapter is untested; the grouped GEMMs always run on Triton here
(deep_gemm's contiguous grouped GEMM needs each expert's rows padded to 128, which fmoe's dispatch
does not do).
"""

import functools
import importlib
import re
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from fmoe.kernels._triton import (
    BACKENDS,
    HAS_TRITON,
    TensorDescriptor,
    interpreting,
    kernel_backend,
    num_sms,
    tl,
    triton,
    use_triton,
)
from fmoe.kernels.fp8_cublas import cublas_available, cublas_gemm_nt, cublas_gemm_wgrad, cublas_supports
from fmoe.kernels.fp8_quant import (
    FP8_DTYPE,
    GROUP,
    Fp8Act,
    Fp8ActT,
    TileMap,
    _tile_cap,
    cdiv,
    dequantize_act,
    dequantize_act_t,
    tile_map,
)


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch of the Triton GEMMs (the K block is always 128, one scale group)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 4
    group_m: int = 8  # tiles of this many M-blocks run side by side, for L2 reuse of B
    programs_per_sm: int = 1
    flatten: bool = False  # flatten the tile and K loops so loads of the next tile overlap the epilogue
    # Triton's Hopper warp specialization: a producer warpgroup issues the TMA loads and two consumer
    # warpgroups (num_warps each) take half the tile rows each, so one's FP32 promotion can overlap
    # the other's wgmma. Measured on GPUs: slower than the default tiles or hung under Triton 3.6
    # (H100), 128x128 / 8 warps 1.23x BF16 against the default's 1.24-1.36x under Triton 3.9 (H200,
    # results/issue26_prefetch_h200.json): opt-in.
    warp_specialize: bool = False
    # Load K-block k+1's scales during block k (a register double buffer; both kernels, _nt_kernel
    # with block_n <= 128): without it the sm_90a PTX loads each block's scales after the barrier
    # wait, beside the block's own wgmma. Which kernel it speeds up depends on the Triton release:
    # PREFETCH_SCALES_BY_TRITON.
    prefetch_scales: bool = False
    # A cap on the registers per thread (ptxas's maxnreg; None: the compiler's choice), so that
    # programs_per_sm programs fit one SM's 64K registers at once: uncapped, the 64x128 tiles take 176
    # (forward / input gradient) and 182 (weight gradient) under Triton 3.6, room for two 4-warp
    # programs, not three.
    max_registers: int | None = None

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            if getattr(self, name) not in (16, 32, 64, 128, 256):
                raise ValueError(
                    f"GemmConfig.{name}: must be one of 16, 32, 64, 128, 256, got {getattr(self, name)}"
                )
        if self.num_warps not in (4, 8, 16):
            raise ValueError(f"GemmConfig.num_warps: must be 4, 8 or 16, got {self.num_warps}")
        if self.warp_specialize and self.flatten:
            raise ValueError("GemmConfig.flatten: must be False with warp_specialize")
        cap = self.max_registers
        if cap is not None and not (isinstance(cap, int) and 24 <= cap <= 248 and cap % 8 == 0):
            raise ValueError(
                f"GemmConfig.max_registers: must be None or a multiple of 8 in [24, 248], got {cap!r}"
            )
        if cap is not None and self.warp_specialize:
            # Triton sizes each warp-specialized partition's registers itself (setmaxnreg)
            raise ValueError("GemmConfig.max_registers: must be None with warp_specialize")
        for name in ("num_stages", "group_m", "programs_per_sm"):
            if getattr(self, name) < 1:
                raise ValueError(f"GemmConfig.{name}: must be >= 1, got {getattr(self, name)}")


# Tiles: 64x128, one warpgroup, flattened loops (the fastest of benchmarks/bench_fp8.py's sweep on one
# H200, results/fp8_h200.json; against 128x128 / 8 warps it took the Qwen3 expert GEMMs from 1.17 to
# 1.09 ms forward, 1.97 to 1.38 ms weight gradient). Each program waits on its wgmma before promoting
# every K-block, so other resident programs are what keep the tensor cores fed: three per SM, each
# with 3 stages (72 KiB of shared memory) and its registers capped at 168, so that all three fit
# (uncapped, ptxas takes 176 and 182 and only two fit: the third ran after them, 1.00x BF16 against
# 1.40x in issue26_grouped_sweep_h100.json). On one H100 (results/issue26_regcap_h100.json, x BF16
# torch._grouped_mm in the same process; forward / input gradient at one micro-batch's routed rows,
# weight gradients over a step's 8 micro-batches merged), against the previous tiles (two programs per
# SM of 4 stages, uncapped): Qwen3 expert forward + input gradient 1.40 -> 1.42x, weight gradients 1.01
# (1.08 prefetching, the previous Triton 3.6 default) -> 1.11x; DeepSeek-V3-16B 1.29 -> 1.35x and 1.03
# (1.05) -> 1.07x. In a training step (Qwen3, 2 layers, 8 micro-batches, H100) the grouped GEMMs took
# 16.8 -> 16.1 ms and the weight gradients 7.8 -> 7.1 ms a step. Against production kernels at these
# shapes, each checked against the float32 reference: CUTLASS 4.2's Hopper ptr-array grouped kernels with
# the same block scales ran at 0.92-1.17x these tiles (forward / input gradient) and 0.86-1.09x (weight
# gradient) on an H200 (benchmarks/bench_cutlass_fp8.py, results/issue26_cutlass_grouped_h200.json);
# DeepGEMM's forward / input gradients at 1.19-1.28x on an H100, Qwen3 shapes, with each expert's rows
# padded to 128 (bench_deepgemm_fp8.py, results/issue26_deepgemm_grouped_h100.json). Promoting block
# k-1 while block k's wgmma runs, inside one program or warp-specialized (Gluon kernels of the same
# bits, bench_gluon_fp8.py), ran at 0.45-0.86x these tiles on an H100 (Qwen3, forward / input
# gradient; results/issue26_gluon_overlap_2026-12-07_h100.json): its second product in flight leaves
# room for two programs a SM, not three, and that costs more than the overlap saves.
BASE_CONFIG = GemmConfig(
    block_m=64, block_n=128, num_warps=4, num_stages=3, flatten=True, programs_per_sm=3, max_registers=168
)

# Whether the kernels prefetch their scales (GemmConfig.prefetch_scales) depends on the Triton release
# that compiles the same source. With these tiles, twice on an H100 (issue26_regcap_h100.json; ms of the
# four forward / input-gradient grouped GEMMs at one micro-batch's routed rows, then of the two weight
# gradients over a step's 8 micro-batches merged; without -> with it): Triton 3.6, Qwen3 1.03 -> 1.01 and
# 1.03 -> 1.05, DeepSeek-V3-16B 1.28 -> 1.32 and 1.31 -> 1.34; weight gradients 3.51 -> 3.65, 3.59 ->
# 3.64, 4.94 -> 5.11, 4.93 -> 5.11: off for both. Triton 3.9 (Qwen3 only): 1.18 -> 1.15 and 1.04 -> 1.10
# (2.22 -> 2.25 summed: off; the run-to-run spread is larger than the difference); weight gradients
# 3.50 -> 3.47 and 3.59 -> 3.48: on.
# (forward / input gradient, weight gradient) by release; see prefetch_scales_for.
PREFETCH_SCALES_BY_TRITON: dict[tuple[int, int], tuple[bool, bool]] = {
    (3, 6): (False, False),
    (3, 9): (False, True),
}


def prefetch_scales_for(version: str) -> tuple[bool, bool]:
    """(forward / input gradient, weight gradient) ``prefetch_scales`` for Triton ``version`` (such
    as "3.6.0" or "3.9.0+git1a2b"): its release's entry of PREFETCH_SCALES_BY_TRITON, else the newest
    release listed below it, else the oldest listed."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"prefetch_scales_for: not a Triton version: {version!r}")
    release = (int(found[1]), int(found[2]))
    known = sorted(PREFETCH_SCALES_BY_TRITON)
    below = [r for r in known if r <= release]
    return PREFETCH_SCALES_BY_TRITON[below[-1] if below else known[0]]


_NT_PREFETCH, _WGRAD_PREFETCH = prefetch_scales_for(triton.__version__ if HAS_TRITON else "0.0")
DEFAULT_CONFIG = replace(BASE_CONFIG, prefetch_scales=_NT_PREFETCH)  # forward and input gradient
WGRAD_CONFIG = replace(BASE_CONFIG, prefetch_scales=_WGRAD_PREFETCH)  # weight gradient (K = tokens)
INTERPRET_CONFIG = GemmConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


def _default_config(t: Tensor, wgrad: bool) -> GemmConfig:
    if not t.is_cuda:
        return INTERPRET_CONFIG
    return WGRAD_CONFIG if wgrad else DEFAULT_CONFIG


# ----------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _tile_coords(tile_id, num_m, num_n, GROUP_M: tl.constexpr):
    """Tile id -> (m tile, n tile), GROUP_M m tiles at a time so neighbours share B tiles in L2."""
    per_group = GROUP_M * num_n
    first_m = (tile_id // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile_id % per_group) % rows, (tile_id % per_group) // rows


@triton.jit
def _nt_kernel(
    a_desc,
    b_desc,
    c_ptr,
    sa_ptr,
    sb_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    group_end_ptr,
    out_row_ptr,
    M,
    N,
    K,
    E,
    num_m,
    num_n,
    k_tiles,
    stride_cm,
    stride_sam,
    stride_sak,
    stride_sbe,
    stride_sbn,
    stride_sbk,
    GROUPED: tl.constexpr,
    SCATTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
    WS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """C = A @ B^T with A row-scaled (1x128) and B block-scaled (128x128); grouped over rows.
    SCATTER: row r of the product is stored at row ``out_row[r]`` of C (the experts' outputs put
    back in token order by the GEMM's own stores: no gathered copy)."""
    for tile_id in tl.range(
        tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WS
    ):
        mt, nt = _tile_coords(tile_id, num_m, num_n, GROUP_M)
        if GROUPED:
            e = tl.load(tile_expert_ptr + mt)
            row0 = tl.load(tile_row_ptr + mt)
            valid = e < E
            e = tl.minimum(e, E - 1)
            row_end = tl.where(valid, tl.load(group_end_ptr + e), row0)
            k_iters = tl.where(valid, k_tiles, 0)  # a tile past the last expert does nothing
        else:
            e = 0
            row0 = mt * BLOCK_M
            row_end = M
            k_iters = k_tiles
        n0 = nt * BLOCK_N
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        sa_ptrs = sa_ptr + tl.minimum(rows, M - 1) * stride_sam
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if BLOCK_N <= 128 and PREFETCH:
            sb_ptrs = sb_ptr + e * stride_sbe + (n0 // 128) * stride_sbn
            s_next = tl.load(sa_ptrs) * tl.load(sb_ptrs)
            for ki in range(k_iters):
                s = s_next
                nxt = tl.minimum(ki + 1, k_tiles - 1)  # in bounds; the last one is not used
                s_next = tl.load(sa_ptrs + nxt * stride_sak) * tl.load(sb_ptrs + nxt * stride_sbk)
                a = a_desc.load([row0, ki * BLOCK_K])
                b = b_desc.load([e * N + n0, ki * BLOCK_K])
                acc += tl.dot(a, b.T) * s[:, None]
        elif BLOCK_N <= 128:
            # the whole tile lies in one 128-row block of B: one scale per K-block
            sb_ptrs = sb_ptr + e * stride_sbe + (n0 // 128) * stride_sbn
            for ki in range(k_iters):
                a = a_desc.load([row0, ki * BLOCK_K])
                b = b_desc.load([e * N + n0, ki * BLOCK_K])
                s = tl.load(sa_ptrs + ki * stride_sak) * tl.load(sb_ptrs + ki * stride_sbk)
                acc += tl.dot(a, b.T) * s[:, None]
        else:
            sb_ptrs = sb_ptr + e * stride_sbe + (tl.minimum(cols, N - 1) // 128) * stride_sbn
            for ki in range(k_iters):
                a = a_desc.load([row0, ki * BLOCK_K])
                b = b_desc.load([e * N + n0, ki * BLOCK_K])
                sa = tl.load(sa_ptrs + ki * stride_sak)
                sb = tl.load(sb_ptrs + ki * stride_sbk)
                acc += tl.dot(a, b.T) * (sa[:, None] * sb[None, :])
        mask = (rows[:, None] < row_end) & (cols[None, :] < N)
        if SCATTER:
            dest = tl.load(out_row_ptr + rows, mask=rows < row_end, other=0).to(tl.int64)
        else:
            dest = rows.to(tl.int64)
        c_ptrs = c_ptr + dest[:, None] * stride_cm + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _wgrad_kernel(
    a_desc,
    b_desc,
    c_ptr,
    sa_ptr,
    sb_ptr,
    group_start_ptr,
    group_len_ptr,
    M,
    N,
    E,
    num_m,
    num_n,
    stride_ce,
    stride_cm,
    stride_sat,
    stride_sam,
    stride_sbt,
    stride_sbn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
    WS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """C[e] = A[:, tokens of e] @ B[:, tokens of e]^T, both scaled 1x128 along tokens."""
    per_expert = num_m * num_n
    for tile_id in tl.range(
        tl.program_id(0), E * per_expert, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WS
    ):
        e = tile_id // per_expert
        mt, nt = _tile_coords(tile_id % per_expert, num_m, num_n, GROUP_M)
        t0 = tl.load(group_start_ptr + e)
        k_iters = tl.load(group_len_ptr + e) // BLOCK_K
        rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        sa_ptrs = sa_ptr + tl.minimum(rows, M - 1) * stride_sam + (t0 // BLOCK_K) * stride_sat
        sb_ptrs = sb_ptr + tl.minimum(cols, N - 1) * stride_sbn + (t0 // BLOCK_K) * stride_sbt
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if PREFETCH:
            # an empty expert reads nothing (its group_start may be the end of the scales)
            sa_next = tl.load(sa_ptrs, mask=tl.zeros((BLOCK_M,), tl.int32) < k_iters, other=0.0)
            sb_next = tl.load(sb_ptrs, mask=tl.zeros((BLOCK_N,), tl.int32) < k_iters, other=0.0)
            last = tl.maximum(k_iters - 1, 0)
            for ki in range(k_iters):
                sa = sa_next
                sb = sb_next
                nxt = tl.minimum(ki + 1, last)  # within the expert's tokens; the last one is not used
                sa_next = tl.load(sa_ptrs + nxt * stride_sat)
                sb_next = tl.load(sb_ptrs + nxt * stride_sbt)
                a = a_desc.load([mt * BLOCK_M, t0 + ki * BLOCK_K])
                b = b_desc.load([nt * BLOCK_N, t0 + ki * BLOCK_K])
                acc += tl.dot(a, b.T) * (sa[:, None] * sb[None, :])
        else:
            for ki in range(k_iters):
                a = a_desc.load([mt * BLOCK_M, t0 + ki * BLOCK_K])
                b = b_desc.load([nt * BLOCK_N, t0 + ki * BLOCK_K])
                sa = tl.load(sa_ptrs + ki * stride_sat)
                sb = tl.load(sb_ptrs + ki * stride_sbt)
                acc += tl.dot(a, b.T) * (sa[:, None] * sb[None, :])
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Backend choice


@functools.cache
def _deep_gemm():
    """The deep_gemm module, or None when it is not installed."""
    try:
        return importlib.import_module("deep_gemm")
    except ImportError:
        return None


def _deep_gemm_supports(
    M: int, N: int, K: int, *, wgrad: bool, grouped: bool, out_dtype: torch.dtype
) -> bool:
    return not (wgrad or grouped) and out_dtype == torch.bfloat16 and K % 128 == 0 and N % 64 == 0 and M > 0


def choose_backend(
    requested: str,
    *,
    explicit: bool,
    M: int,
    N: int,
    K: int,
    wgrad: bool,
    grouped: bool,
    out_dtype: torch.dtype,
    triton_runs: bool,
    cublas_here: bool,
    deep_gemm_here: bool,
) -> str:
    """The backend a GEMM runs on: the one place that decides, a pure function of the call's shape
    and of what the machine offers.

    requested:   ``auto``, ``triton``, ``torch``, ``cublas`` or ``deep_gemm``; ``explicit`` when it
                 is the ``backend`` argument (then it must run, or ValueError), else it is the
                 environment's choice and falls back (deep_gemm / cublas -> Triton -> torch)
    M, N, K:     C [M, N] = A [M, K] @ B^T; ``wgrad``: the weight gradient (K = padded tokens)
    triton_runs: the Triton kernels can launch (CUDA tensors, or CPU ones under the interpreter)
    cublas_here: cuBLAS block-scaled FP8 exists for these tensors (``cublas_available``)
    auto takes deep_gemm, then cuBLAS, where they support the shape (``cublas_supports``: the dense
    GEMMs), else Triton, else the torch reference.
    """
    if requested not in BACKENDS:
        raise ValueError(f"backend: must be one of {BACKENDS}, got {requested!r}")
    if requested == "torch":
        return requested
    shape = dict(wgrad=wgrad, grouped=grouped, out_dtype=out_dtype)
    ok = {
        "deep_gemm": deep_gemm_here and _deep_gemm_supports(M, N, K, **shape),
        "cublas": cublas_here and cublas_supports(M, N, K, **shape),
    }
    if requested in ok:
        if ok[requested]:
            return requested
        if explicit:
            here = cublas_here if requested == "cublas" else deep_gemm_here
            call = (
                f"{'grouped' if grouped else 'dense'}{' wgrad' if wgrad else ''} {M} x {N} x {K} {out_dtype}"
            )
            why = f"does not support this call ({call})" if here else "is not available here"
            raise ValueError(f"backend: {requested!r} was asked for, but {requested} {why}")
        requested = "auto"
    if requested == "auto":
        return next((name for name in ok if ok[name]), "triton" if triton_runs else "torch")
    if not triton_runs:
        raise ValueError("backend: 'triton' needs CUDA tensors or TRITON_INTERPRET=1")
    return requested


def _backend(
    backend: str | None, a: Tensor, b: Tensor, out_dtype: torch.dtype, grouped: bool, wgrad: bool = False
) -> str:
    """The backend a call on these operands runs on (:func:`choose_backend`, given the machine).
    a: [M, K] (wgrad: [M, cap]); b: [(experts,) N, K] (wgrad: [N, cap])."""
    requested = backend or kernel_backend()
    others = requested in ("auto", "cublas", "deep_gemm")  # may take cuBLAS or deep_gemm
    return choose_backend(
        requested,
        explicit=backend is not None,
        M=a.shape[0],
        N=b.shape[0] if wgrad else b.shape[-2],
        K=a.shape[-1],
        wgrad=wgrad,
        grouped=grouped,
        out_dtype=out_dtype,
        triton_runs=HAS_TRITON and (a.is_cuda or interpreting()) and (requested == "triton" or use_triton(a)),
        cublas_here=others and cublas_available(a.device),
        deep_gemm_here=others and a.is_cuda and _deep_gemm() is not None,
    )


def _deep_gemm_nt(a: Fp8Act, b: Tensor, b_scale: Tensor, out: Tensor) -> Tensor:
    dg = _deep_gemm()
    if hasattr(dg, "fp8_gemm_nt"):  # deep_gemm >= 2 lays the scales out itself
        dg.fp8_gemm_nt((a.data, a.scale), (b, b_scale), out)
    else:
        dg.gemm_fp8_fp8_bf16_nt((a.data, dg.get_col_major_tma_aligned_tensor(a.scale)), (b, b_scale), out)
    return out


# ----------------------------------------------------------------------------------------------
# Launchers


def _launch_options(cfg: GemmConfig) -> dict:
    """The compile options of a launch with ``cfg`` (maxnreg only where it is capped)."""
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.max_registers is not None:
        options["maxnreg"] = cfg.max_registers
    return options


def _check_nt(a: Fp8Act, b: Tensor, b_scale: Tensor, offs: Tensor | None) -> None:
    if a.data.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
        raise ValueError(f"a, b: expected {FP8_DTYPE}, got {a.data.dtype} and {b.dtype}")
    if a.data.dim() != 2:
        raise ValueError(f"a: expected [M, K], got shape {tuple(a.data.shape)}")
    M, K = a.data.shape
    if b.shape[-1] != K:
        raise ValueError(f"b: expected K = {K} in its last dim, got shape {tuple(b.shape)}")
    if (b.dim() == 3) != (offs is not None):
        raise ValueError(
            f"offs: a grouped GEMM takes b [experts, N, K] and offs; got b {tuple(b.shape)}, offs {offs}"
        )
    if b.dim() not in (2, 3) or not b.is_contiguous() or not a.data.is_contiguous():
        raise ValueError(f"a, b: expected contiguous [M, K] and [(experts,) N, K], got {tuple(b.shape)}")
    if offs is not None and offs.numel() != b.shape[0]:
        raise ValueError(f"offs: {offs.numel()} experts, but b has {b.shape[0]}")
    want = (*b.shape[:-2], cdiv(b.shape[-2], GROUP), cdiv(K, GROUP))
    if tuple(b_scale.shape) != want:
        raise ValueError(f"b_scale: expected shape {want}, got {tuple(b_scale.shape)}")
    if tuple(a.scale.shape) != (M, cdiv(K, GROUP)):
        raise ValueError(f"a.scale: expected shape {(M, cdiv(K, GROUP))}, got {tuple(a.scale.shape)}")
    if K % 16:
        raise ValueError(f"K: must be a multiple of 16 (TMA rows are 16-byte aligned), got {K}")


def fp8_gemm_nt(
    a: Fp8Act,
    b: Tensor,
    b_scale: Tensor,
    offs: Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | None = None,
    config: GemmConfig | None = None,
    tiles: TileMap | None = None,
    out_rows: Tensor | None = None,
) -> Tensor:
    """C = A @ B^T, block-scaled FP8 in, FP32 accumulation, ``out_dtype`` out.

    a:       Fp8Act [M, K] (1x128 scales)
    b:       [N, K] or, grouped, [experts, N, K] float8_e4m3fn; b_scale [(experts,) cdiv(N,128), cdiv(K,128)]
    offs:    [experts] int32 cumulative end rows of each expert's tokens in ``a`` (grouped only);
             rows at or past offs[-1] are not written
    tiles:   grouped only, the map of ``offs`` the Triton kernel walks, from :func:`nt_tile_map`
             (built here when None): GEMMs over the same rows - an expert MLP's forward and input
             gradient, up and down - share one
    out_rows: grouped only, [M] int64 / int32, a permutation of 0..M-1 (offs[-1] = M): row r of the
             product is returned at row ``out_rows[r]`` (the experts' outputs back in token order,
             written there by the GEMM itself)
    returns: [M, N] ``out_dtype``
    """
    from fmoe.kernels.fp8_quant import check_offs

    if offs is not None:
        offs = check_offs(offs, a.data.shape[0])
    _check_nt(a, b, b_scale, offs)
    M, K = a.data.shape
    N = b.shape[-2]
    grouped = offs is not None
    if out_rows is not None:
        _check_out_rows(out_rows, offs, M, a.data.device)
    which = _backend(backend, a.data, b, out_dtype, grouped)
    if which == "torch":
        out = fp8_gemm_nt_reference(a, b, b_scale, offs, out_dtype=out_dtype)
        return out if out_rows is None else torch.empty_like(out).index_copy_(0, out_rows.long(), out)
    if which == "cublas":  # M, N, K > 0 (cublas_supports)
        return cublas_gemm_nt(a, b, b_scale, out_dtype=out_dtype)
    out = torch.empty(M, N, dtype=out_dtype, device=a.data.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    if which == "deep_gemm":
        return _deep_gemm_nt(a, b, b_scale, out)
    cfg = config or _default_config(a.data, wgrad=False)
    E = b.shape[0] if grouped else 1
    b2 = b.view(-1, K)
    a_desc = TensorDescriptor.from_tensor(a.data, [cfg.block_m, GROUP])
    b_desc = TensorDescriptor.from_tensor(b2, [cfg.block_n, GROUP])
    sb = b_scale if grouped else b_scale[None]
    if grouped:
        tm = tile_map(offs, M, cfg.block_m) if tiles is None else _checked_tiles(tiles, offs, M, cfg.block_m)
        walk = (tm.expert, tm.row, tm.group_end, tm.cap)
    else:
        walk = (a.scale, a.scale, a.scale, cdiv(M, cfg.block_m))  # unused pointers
    num_tiles = walk[3] * cdiv(N, cfg.block_n)
    programs = max(1, min(num_tiles, cfg.programs_per_sm * num_sms(a.data.device)))
    _nt_kernel[(programs,)](
        a_desc, b_desc, out, a.scale, sb, walk[0], walk[1], walk[2], walk[0] if out_rows is None else out_rows,
        M, N, K, E, walk[3], cdiv(N, cfg.block_n), cdiv(K, GROUP), out.stride(0), a.scale.stride(0), a.scale.stride(1),
        sb.stride(0), sb.stride(1), sb.stride(2),
        GROUPED=grouped, SCATTER=out_rows is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=GROUP, GROUP_M=cfg.group_m,
        NUM_PROGRAMS=programs, FLATTEN=cfg.flatten, WS=cfg.warp_specialize, PREFETCH=cfg.prefetch_scales, **_launch_options(cfg),
    )  # fmt: skip
    return out


def _check_out_rows(out_rows: Tensor, offs: Tensor | None, M: int, device: torch.device) -> None:
    if offs is None:
        raise ValueError("out_rows: only the grouped GEMM (offs given) scatters its rows")
    if (
        out_rows.shape != (M,)
        or out_rows.dtype not in (torch.int32, torch.int64)
        or out_rows.device != device
    ):
        raise ValueError(
            f"out_rows: expected a [{M}] int32 / int64 tensor on {device}, got {tuple(out_rows.shape)} "
            f"{out_rows.dtype} on {out_rows.device}"
        )


def nt_tile_map(offs: Tensor, rows: int, config: GemmConfig | None = None) -> TileMap:
    """The map of ``rows`` expert-grouped rows (offs [experts] int32 cumulative ends) that the grouped
    :func:`fp8_gemm_nt` walks with ``config`` (None: its default), to be built once and passed as
    its ``tiles`` by every GEMM over those rows."""
    return tile_map(offs, rows, (config or _default_config(offs, wgrad=False)).block_m)


def _checked_tiles(tiles: TileMap, offs: Tensor, rows: int, block_m: int) -> TileMap:
    if (
        tiles.tile != block_m
        or tiles.cap != _tile_cap(offs, rows, block_m)
        or tiles.group_end.numel() != offs.numel()
    ):
        raise ValueError(
            f"tiles: a map of {tiles.group_end.numel()} experts in {tiles.tile}-row tiles (cap {tiles.cap}); this GEMM "
            f"walks {offs.numel()} experts' {rows} rows in {block_m}-row tiles (nt_tile_map builds its map)"
        )
    return tiles


def fp8_gemm_wgrad(
    a: Fp8ActT,
    b: Fp8ActT,
    *,
    grouped: bool,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | None = None,
    config: GemmConfig | None = None,
) -> Tensor:
    """C[e] = A_e @ B_e^T over each expert's tokens (the weight-gradient GEMM, dW = dY^T X).

    a:       Fp8ActT of dy: data [M, cap] (M = out features), b: Fp8ActT of x: data [N, cap]
             (N = in features), quantized with the same expert offsets
    grouped: return [experts, M, N]; else there must be one expert and the result is [M, N]
    """
    if a.data.dtype != FP8_DTYPE or b.data.dtype != FP8_DTYPE:
        raise ValueError(f"a, b: expected {FP8_DTYPE}, got {a.data.dtype} and {b.data.dtype}")
    if a.data.shape[1] != b.data.shape[1] or a.group_len.shape != b.group_len.shape:
        raise ValueError(
            f"a, b: token-transposed operands of different groupings: {tuple(a.data.shape)} with "
            f"{a.group_len.numel()} experts vs {tuple(b.data.shape)} with {b.group_len.numel()}"
        )
    E = a.group_len.numel()
    if not grouped and E != 1:
        raise ValueError(f"grouped: False needs one token group, got {E}")
    M, N = a.data.shape[0], b.data.shape[0]
    which = _backend(backend, a.data, b.data, out_dtype, grouped=grouped, wgrad=True)
    if which == "torch":
        out = fp8_gemm_wgrad_reference(a, b, out_dtype=out_dtype)
    elif which == "cublas":
        return cublas_gemm_wgrad(a, b, out_dtype=out_dtype)
    else:
        out = torch.empty(E, M, N, dtype=out_dtype, device=a.data.device)
        if out.numel() > 0:
            cfg = config or _default_config(a.data, wgrad=True)
            a_desc = TensorDescriptor.from_tensor(a.data, [cfg.block_m, GROUP])
            b_desc = TensorDescriptor.from_tensor(b.data, [cfg.block_n, GROUP])
            num_tiles = E * cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
            programs = max(1, min(num_tiles, cfg.programs_per_sm * num_sms(a.data.device)))
            _wgrad_kernel[(programs,)](
                a_desc, b_desc, out, a.scale, b.scale, a.group_start, a.group_len, M, N, E,
                cdiv(M, cfg.block_m), cdiv(N, cfg.block_n),
                out.stride(0), out.stride(1), a.scale.stride(1), a.scale.stride(0),
                b.scale.stride(1), b.scale.stride(0),
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=GROUP, GROUP_M=cfg.group_m,
                NUM_PROGRAMS=programs, FLATTEN=cfg.flatten, WS=cfg.warp_specialize, PREFETCH=cfg.prefetch_scales, **_launch_options(cfg),
            )  # fmt: skip
    return out if grouped else out[0]


# ----------------------------------------------------------------------------------------------
# References: the same products on dequantized inputs, in FP32


def _dequantize_blocks(b: Tensor, b_scale: Tensor) -> Tensor:
    N, K = b.shape[-2:]
    s = b_scale.repeat_interleave(GROUP, dim=-2).repeat_interleave(GROUP, dim=-1)
    return b.float() * s[..., :N, :K]


def fp8_gemm_nt_reference(
    a: Fp8Act,
    b: Tensor,
    b_scale: Tensor,
    offs: Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """fp8_gemm_nt on dequantized inputs; rows past offs[-1] are zero."""
    x = dequantize_act(a)
    w = _dequantize_blocks(b, b_scale)
    if offs is None:
        return (x @ w.t()).to(out_dtype)
    out = x.new_zeros(x.shape[0], w.shape[-2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[e].t()
        start = end
    return out.to(out_dtype)


def fp8_gemm_wgrad_reference(a: Fp8ActT, b: Fp8ActT, *, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """fp8_gemm_wgrad on dequantized inputs: [experts, M, N]."""
    x, y = dequantize_act_t(a), dequantize_act_t(b)
    out = x.new_zeros(a.group_len.numel(), x.shape[0], y.shape[0])
    for e, (start, length) in enumerate(zip(a.group_start.tolist(), a.group_len.tolist())):
        out[e] = x[:, start : start + length] @ y[:, start : start + length].t()
    return out.to(out_dtype)
