"""The three steps of an FP8 linear layer and of an FP8 expert-grouped linear layer, as plain functions.

For ``y = x @ w^T`` (x [tokens, in] bf16, w [out, in]):
- forward:       y  = fp8_linear_forward(x, w_fp8)
- input grad:    dx = fp8_linear_input_grad(dy, w_fp8)
- weight grad:   dw = fp8_linear_weight_grad(x, dy)
with ``w_fp8 = quantize_weight(w)`` computed once per optimizer step and reused by every microbatch.
The grouped versions take w [experts, out, in] and ``offs`` [experts] int32 cumulative end offsets
of the expert-grouped tokens (as torch._grouped_mm takes them); experts may be empty.

Activations may be passed already quantized, to share one read of a tensor between steps:
``quantize_act_t(x, offs, with_rows=True)`` gives both the Fp8Act the forward reads and the Fp8ActT
the weight gradient reads; ``swiglu_quant`` and ``rmsnorm(quantize=True)`` give an Fp8Act directly.
Numerics: E4M3 values with FP32 scales (1x128 groups for activations and gradients, 128x128 blocks
for weights), FP32 accumulation, ``out_dtype`` results (bf16 by default).
The dense GEMMs run on cuBLAS where it supports them (Hopper), else on Triton; ``backend`` (or
``FMOE_KERNEL_BACKEND``) forces one (``fmoe.kernels.fp8_gemm.choose_backend`` decides).
"""

import torch
from torch import Tensor

from fmoe.kernels.fp8_gemm import fp8_gemm_nt, fp8_gemm_wgrad, nt_tile_map
from fmoe.kernels.fp8_quant import (
    Fp8Act,
    Fp8ActT,
    Fp8Weight,
    TileMap,
    quantize_act,
    quantize_act_t,
    quantize_weight,
)

__all__ = [
    "nt_tile_map",
    "quantize_weight",
    "fp8_linear_forward",
    "fp8_linear_input_grad",
    "fp8_linear_weight_grad",
    "fp8_grouped_linear_forward",
    "fp8_grouped_linear_input_grad",
    "fp8_grouped_linear_weight_grad",
]


def _rows(x: Tensor | Fp8Act, pow2: bool) -> Fp8Act:
    return x if isinstance(x, Fp8Act) else quantize_act(x, pow2_scales=pow2)


def _cols(x: Tensor | Fp8ActT, offs: Tensor | None, pow2: bool) -> Fp8ActT:
    return x if isinstance(x, Fp8ActT) else quantize_act_t(x, offs, pow2_scales=pow2)


def _check_weight(w: Fp8Weight, grouped: bool) -> None:
    if not isinstance(w, Fp8Weight):
        raise TypeError(f"w_fp8: expected an Fp8Weight from quantize_weight, got {type(w).__name__}")
    if w.data.dim() != (3 if grouped else 2):
        want = "[experts, out, in]" if grouped else "[out, in]"
        raise ValueError(f"w_fp8: expected a {want} weight, got shape {tuple(w.data.shape)}")


def fp8_linear_forward(
    x: Tensor | Fp8Act,
    w_fp8: Fp8Weight,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    pow2_scales: bool = False,
    backend: str | None = None,
) -> Tensor:
    """y = x @ w^T. x: [tokens, in] (or its Fp8Act), w_fp8: Fp8Weight of [out, in] -> y [tokens, out]."""
    _check_weight(w_fp8, grouped=False)
    a = _rows(x, pow2_scales)
    return fp8_gemm_nt(a, w_fp8.data, w_fp8.scale, out_dtype=out_dtype, backend=backend)


def fp8_linear_input_grad(
    dy: Tensor | Fp8Act,
    w_fp8: Fp8Weight,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    pow2_scales: bool = False,
    backend: str | None = None,
) -> Tensor:
    """dx = dy @ w. dy: [tokens, out] (or its Fp8Act) -> dx [tokens, in]."""
    _check_weight(w_fp8, grouped=False)
    a = _rows(dy, pow2_scales)
    return fp8_gemm_nt(a, w_fp8.data_t, w_fp8.scale_t, out_dtype=out_dtype, backend=backend)


def fp8_linear_weight_grad(
    x: Tensor | Fp8ActT,
    dy: Tensor | Fp8ActT,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    pow2_scales: bool = False,
    backend: str | None = None,
) -> Tensor:
    """dw = dy^T @ x. x: [tokens, in], dy: [tokens, out] (or their Fp8ActT) -> dw [out, in]."""
    a, b = _cols(dy, None, pow2_scales), _cols(x, None, pow2_scales)
    return fp8_gemm_wgrad(a, b, grouped=False, out_dtype=out_dtype, backend=backend)


def fp8_grouped_linear_forward(
    x: Tensor | Fp8Act,
    w_fp8: Fp8Weight,
    offs: Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    pow2_scales: bool = False,
    tiles: TileMap | None = None,
    out_rows: Tensor | None = None,
) -> Tensor:
    """y[rows of e] = x[rows of e] @ w[e]^T. x: [tokens, in] expert-grouped, w_fp8 of [experts, out, in],
    offs: [experts] int32 cumulative end offsets -> y [tokens, out]. tiles: ``nt_tile_map(offs, tokens)``,
    to share one map between the GEMMs over the same rows (None: built here); out_rows: [tokens]
    int64 / int32, where each row of y goes (``fp8_gemm_nt``'s; None: in x's order)."""
    _check_weight(w_fp8, grouped=True)
    return fp8_gemm_nt(
        _rows(x, pow2_scales),
        w_fp8.data,
        w_fp8.scale,
        offs,
        out_dtype=out_dtype,
        tiles=tiles,
        out_rows=out_rows,
    )


def fp8_grouped_linear_input_grad(
    dy: Tensor | Fp8Act,
    w_fp8: Fp8Weight,
    offs: Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    pow2_scales: bool = False,
    tiles: TileMap | None = None,
) -> Tensor:
    """dx[rows of e] = dy[rows of e] @ w[e]. dy: [tokens, out] -> dx [tokens, in]; tiles as for the forward."""
    _check_weight(w_fp8, grouped=True)
    return fp8_gemm_nt(
        _rows(dy, pow2_scales), w_fp8.data_t, w_fp8.scale_t, offs, out_dtype=out_dtype, tiles=tiles
    )


def fp8_grouped_linear_weight_grad(
    x: Tensor | Fp8ActT,
    dy: Tensor | Fp8ActT,
    offs: Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    pow2_scales: bool = False,
) -> Tensor:
    """dw[e] = dy[rows of e]^T @ x[rows of e]. x: [tokens, in], dy: [tokens, out] (or their Fp8ActT
    built with the same offs) -> dw [experts, out, in]; an empty expert gets zeros."""
    a, b = _cols(dy, offs, pow2_scales), _cols(x, offs, pow2_scales)
    if a.group_len.numel() != offs.numel():
        raise ValueError(f"dy: quantized for {a.group_len.numel()} experts, offs has {offs.numel()}")
    return fp8_gemm_wgrad(a, b, grouped=True, out_dtype=out_dtype)
