"""Dense block-scaled FP8 GEMMs through cuBLAS (``torch.nn.functional.scaled_mm``), on fmoe's formats.

cuBLAS (12.9+) implements DeepSeek-V3's recipe on Hopper: 1x128 scales on one operand and 128x128 or
1x128 on the other, each 128-deep partial product promoted to FP32 with its scales. It reaches the
hardware's FP8 rate where fmoe's Triton kernels run at BF16 speed (issue 26: 1148 vs 769 TFLOP/s at
32768 x 1536 x 2048), so the dense GEMMs take it where it applies; ``fmoe.kernels.fp8_gemm`` decides
(``_backend``), this module only states what cuBLAS takes and calls it.

Layouts (what torch's ``scaled_mm`` checks, in its ``ScaledBlas.cpp``):
- A row-major [M, K], its 1x128 scales [M, K/128] with strides (1, M): an ``Fp8Act`` or ``Fp8ActT``
  as stored, no copy.
- B column-major [K, N] (``b.t()`` of our [N, K] row-major operand).
  1x128 (weight gradient, ``Fp8ActT``): scales [N, K/128] strides (1, N): as stored.
  128x128 (weight, ``Fp8Weight``): scales [L4, N/128] with strides (1, L4), L4 = K/128 rounded up to
  a multiple of 4 (cuBLAS reads scale rows 16-byte aligned). Our [N/128, K/128] row-major scales are
  that transposed when K/128 % 4 == 0 (a view); else they are zero-padded to L4 columns, one copy of
  N/128 x L4 floats (64 floats for a 2048 x 768 weight: a ~5 us launch against a GEMM of
  hundreds of us, and free under CUDA graphs' replay apart from the launch).
Without the padding ``scaled_mm`` refuses K = 768 ("scale_b must have shape 8 x 16"); older torch
computed wrong results for such K through ``torch._scaled_mm`` - hence no use of that entry point,
and tests/test_fp8_cublas_cuda.py checks these K against the float32 reference.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from fmoe.kernels.fp8_quant import FP8_DTYPE, GROUP, Fp8Act, Fp8ActT, cdiv

__all__ = [
    "CUBLAS_OUT_DTYPES",
    "cublas_available",
    "cublas_supports",
    "cublas_gemm_nt",
    "cublas_gemm_wgrad",
    "cublas_weight_scale",
]

CUBLAS_OUT_DTYPES = (torch.bfloat16, torch.float32)
SCALE_ROW_ALIGN = 4  # cuBLAS reads 128x128 scale rows 16-byte aligned: 4 float32


def cublas_supports(M: int, N: int, K: int, *, wgrad: bool, grouped: bool, out_dtype: torch.dtype) -> bool:
    """Whether a GEMM of this shape runs on cuBLAS here: a pure function of the shape.

    M x N x K: C [M, N] = A [M, K] @ B [N, K]^T; ``wgrad``: both operands 1x128-scaled along K (the
    weight gradient, K = padded tokens), else B is a 128x128-block-scaled weight. Dense only (the
    grouped GEMMs stay on Triton). K and the weight's N whole 128-blocks, M and N multiples of 16
    (cuBLAS's FP8 alignment): the shapes the GPU tests check; the rest runs on Triton.
    """
    if grouped or out_dtype not in CUBLAS_OUT_DTYPES or min(M, N, K) <= 0:
        return False
    if K % GROUP or M % 16 or N % 16:
        return False
    return wgrad or N % GROUP == 0


@functools.cache
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)  # DeepSeek-style scaling: SM90 only


def cublas_available(device: torch.device) -> bool:
    """cuBLAS block-scaled FP8 on ``device``: a Hopper GPU and a torch with ``F.scaled_mm``."""
    if device.type != "cuda" or not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return False
    return _device_ok(device.index if device.index is not None else torch.cuda.current_device())


def cublas_weight_scale(b_scale: Tensor) -> Tensor:
    """A weight's 128x128 scales [(E,) N/128, K/128] -> the [(E,) L4, N/128] (strides (.., 1, L4))
    cuBLAS reads: zero-padded to L4 K-blocks (a copy) when K/128 is not a multiple of 4, else a view."""
    pad = (-b_scale.shape[-1]) % SCALE_ROW_ALIGN
    s = F.pad(b_scale, (0, pad)) if pad else b_scale.contiguous()
    return s.transpose(-2, -1)


def _outer_major(s: Tensor) -> Tensor:
    """1x128 scales [rows, blocks] with strides (1, rows), as cuBLAS reads them (our layouts are)."""
    return s if s.shape[1] == 1 or s.stride() == (1, s.shape[0]) else s.t().contiguous().t()


def _scaled_mm(a: Tensor, b_col: Tensor, sa: Tensor, ra, sb: Tensor, rb, out_dtype: torch.dtype) -> Tensor:
    none = F.SwizzleType.NO_SWIZZLE
    return F.scaled_mm(a, b_col, sa, ra, sb, rb, swizzle_a=none, swizzle_b=none, output_dtype=out_dtype)


def cublas_gemm_nt(a: Fp8Act, b: Tensor, b_scale: Tensor, *, out_dtype: torch.dtype) -> Tensor:
    """C = A @ B^T. a: Fp8Act [M, K]; b: [N, K] float8_e4m3fn with b_scale [N/128, K/128] -> [M, N]."""
    if a.data.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE or b.dim() != 2:
        raise ValueError(f"a, b: expected 2-D {FP8_DTYPE}, got {a.data.dtype} and {b.dtype} {tuple(b.shape)}")
    blocks = F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128
    return _scaled_mm(
        a.data, b.t(), _outer_major(a.scale), blocks[0], cublas_weight_scale(b_scale), blocks[1], out_dtype
    )


def cublas_gemm_wgrad(a: Fp8ActT, b: Fp8ActT, *, out_dtype: torch.dtype) -> Tensor:
    """C = A @ B^T over the (padded) tokens. a: Fp8ActT data [M, cap], b: Fp8ActT data [N, cap],
    one token group each -> [M, N]."""
    if a.group_len.numel() != 1 or b.group_len.numel() != 1:
        raise ValueError(f"a, b: the dense weight gradient takes one token group, got {a.group_len.numel()}")
    if tuple(a.scale.shape) != (a.data.shape[0], cdiv(a.data.shape[1], GROUP)):
        raise ValueError(f"a.scale: expected [M, cap/128], got {tuple(a.scale.shape)}")
    row = F.ScalingType.BlockWise1x128
    return _scaled_mm(a.data, b.data.t(), _outer_major(a.scale), row, _outer_major(b.scale), row, out_dtype)
