"""The GPU tier of the FP8 GEMM dispatch: cuBLAS's block-scaled GEMMs (and the Triton ones beside
them) at every dense shape class of the Qwen3-30B-A3B and DeepSeek-V3-16B layers, forward, input
gradient and weight gradient, against the float32 GEMM of the dequantized operands; and the dispatch
taking Triton where cuBLAS does not apply.

    TRITON_INTERPRET=0 python3 -m pytest -m cuda tests/test_fp8_cublas_cuda.py

K = 768 and 1408 (6 and 11 blocks of 128: not multiples of 4, the case torch once got silently
wrong) are among the shapes. The operands' magnitudes change by up to 2^8 from one 128-block to the
next, so a scale applied to the wrong block, or a block left out, is an error of the order of the
result, far above the bound.

Bound, elementwise, from the formats. Both sides multiply the same E4M3 values (their quantization
error is in both), and E4M3 x E4M3 products are exact in float32, so only the sums differ:
- the FP8 tensor cores add the products of one 128-deep block keeping ~14 significant bits
  (DeepSeek-V3, section 3.3.2): in the worst case every one of the block's 128 products is cut to
  13 bits below the largest exponent it is added to, <= 2^-13 of the block's sum of |a b| each:
  <= 128 x 2^-13 = 2^-6 of it. (A tree of <= 8 roundings would give 2^-10, which the Triton grouped
  weight gradient exceeded on the H200 by 1.03-1.16x: the worst case is the bound.) Each block is
  then scaled and added in float32 (2 roundings of 2^-24 per block), so for the whole dot product
  |err| <= (2^-6 + 2 (K / 128) 2^-24) sum_k |a_k b_k|;
- the float32 reference sums K products: |err| <= K 2^-24 sum_k |a_k b_k| (the worst case);
- a bf16 result adds its own rounding, 2^-8 of |c|.
"""

from __future__ import annotations

import pytest
import torch

from fmoe.kernels import fp8_gemm as fg
from fmoe.kernels import fp8_linear as fl
from fmoe.kernels import fp8_quant as fq
from fmoe.kernels.fp8_cublas import cublas_available

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("compiled_kernels"),
]

F32, BF16 = torch.float32, torch.bfloat16
U32 = 2.0**-24
MMA_BLOCK_REL = 2.0**-6


def _hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


needs_cublas = pytest.mark.skipif(
    not (torch.cuda.is_available() and cublas_available(torch.device("cuda"))),
    reason="cuBLAS block-scaled FP8 needs a Hopper GPU and torch.nn.functional.scaled_mm",
)


def _blocky(rows: int, cols: int, seed: int, block_rows: int) -> torch.Tensor:
    """randn [rows, cols] bf16 whose (block_rows x 128) blocks are scaled by 2^-4 .. 2^4."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen, device="cuda")
    e = torch.randint(-4, 5, (-(-rows // block_rows), -(-cols // 128)), generator=gen, device="cuda")
    f = torch.exp2(e.float()).repeat_interleave(block_rows, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return (x * f).to(BF16)


def _check(got: torch.Tensor, want: torch.Tensor, abs_product: torch.Tensor, K: int, what: str) -> None:
    bound = (MMA_BLOCK_REL + (K + 2 * K / 128) * U32) * abs_product
    if got.dtype == BF16:  # rounded to 8 significant bits: <= 2^-8 of |c| <= |want| + bound
        bound = bound + 2.0**-8 * (want.abs() + bound)
    err = (got.float() - want.float()).abs()
    worst = float((err / bound.clamp_min(1e-30)).max())
    assert worst <= 1.0, f"{what}: error {worst:.3g} x the bound"


# (M tokens, N, K) of the weight [N, K]: the dense projections of Qwen3-30B-A3B (q 4096 = 32 x 128,
# k / v 512, o) and DeepSeek-V3-16B (q 3072, kv_b from kv_lora 512, shared experts 2 x 1408), the
# dense MLPs (intermediate 6144; 10944 is not whole 128-blocks: Triton, below) and the expert widths
# 768 / 1408 as a dense K.
SHAPES = {
    "qwen3 q_proj": (4096, 4096, 2048),
    "qwen3 k/v_proj": (4096, 512, 2048),
    "qwen3 o_proj 32k tokens": (32768, 2048, 4096),
    "qwen3 mlp up 6144": (4096, 12288, 2048),
    "qwen3 mlp down 6144": (4096, 2048, 6144),
    "K = 768 (6 blocks)": (8192, 2048, 768),
    "qwen3 expert up as dense": (8192, 1536, 2048),
    "K = 1408 (11 blocks)": (8192, 2048, 1408),
    "deepseek q_proj": (4096, 3072, 2048),
    "deepseek kv_b_proj": (4096, 4096, 512),
    "deepseek shared down (22 blocks)": (4096, 2048, 2816),
}


def _operands(M: int, N: int, K: int, seed: int):
    x = _blocky(M, K, seed, block_rows=1)
    dy = _blocky(M, N, seed + 1, block_rows=1)
    w = fq.quantize_weight(_blocky(N, K, seed + 2, block_rows=128).float() * 0.02)
    return x, dy, w


def _gemms(x, dy, w, backend: str, out_dtype):
    """The three dense GEMMs of a linear layer on one backend, with what each is checked against:
    (name, result, reference, |A| @ |B|, K)."""
    xq, dyq = fq.quantize_act(x), fq.quantize_act(dy)
    xt, dyt = fq.quantize_act_t(x), fq.quantize_act_t(dy)
    wd = fq.dequantize_weight(w)
    ad, gd = fq.dequantize_act(xq), fq.dequantize_act(dyq)
    at, gt = fq.dequantize_act_t(xt), fq.dequantize_act_t(dyt)
    N, K = w.data.shape
    return [
        ("forward", fl.fp8_linear_forward(xq, w, out_dtype=out_dtype, backend=backend),
         fg.fp8_gemm_nt_reference(xq, w.data, w.scale, out_dtype=F32), ad.abs() @ wd.abs().t(), K),
        ("input gradient", fl.fp8_linear_input_grad(dyq, w, out_dtype=out_dtype, backend=backend),
         fg.fp8_gemm_nt_reference(dyq, w.data_t, w.scale_t, out_dtype=F32), gd.abs() @ wd.abs(), N),
        ("weight gradient", fl.fp8_linear_weight_grad(xt, dyt, out_dtype=out_dtype, backend=backend),
         fg.fp8_gemm_wgrad_reference(dyt, xt, out_dtype=F32)[0], gt.abs() @ at.abs().t(), xt.data.shape[1]),
    ]  # fmt: skip


def test_cublas_is_there_on_a_hopper_gpu():
    if not _hopper():
        pytest.skip(f"not a Hopper GPU: {torch.cuda.get_device_name()}")
    assert cublas_available(torch.device("cuda")), f"torch {torch.__version__} has no F.scaled_mm"


@needs_cublas
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_cublas_dense_gemms_within_the_fp8_bound_of_the_float32_reference(shape):
    M, N, K = SHAPES[shape]
    x, dy, w = _operands(M, N, K, seed=sum(map(ord, shape)))
    for out_dtype in (F32, BF16):
        for name, got, want, abs_product, k in _gemms(x, dy, w, "cublas", out_dtype):
            _check(got, want, abs_product, k, f"{shape} {name} {out_dtype}")


@pytest.mark.parametrize("shape", ["K = 768 (6 blocks)", "K = 1408 (11 blocks)", "qwen3 q_proj"])
def test_triton_dense_gemms_within_the_same_bound(shape):
    M, N, K = SHAPES[shape]
    x, dy, w = _operands(M, N, K, seed=7)
    for name, got, want, abs_product, k in _gemms(x, dy, w, "triton", F32):
        _check(got, want, abs_product, k, f"{shape} {name} triton")


@needs_cublas
def test_auto_takes_cublas_for_the_dense_gemms_and_triton_for_the_rest():
    x, dy, w = _operands(4096, 2048, 768, seed=3)
    xq, dyq, xt, dyt = fq.quantize_act(x), fq.quantize_act(dy), fq.quantize_act_t(x), fq.quantize_act_t(dy)
    assert fg._backend(None, xq.data, w.data, BF16, grouped=False) == "cublas"  # forward, K = 768
    assert fg._backend(None, dyq.data, w.data_t, BF16, grouped=False) == "cublas"  # input gradient
    assert fg._backend(None, dyt.data, xt.data, BF16, grouped=False, wgrad=True) == "cublas"
    # the grouped expert GEMMs, fp16 results, and weights not in whole 128-blocks: Triton
    E = 8
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (4096 // E)
    we = fq.quantize_weight(_blocky(E * 256, 768, 4, 128).view(E, 256, 768).float())
    assert fg._backend(None, xq.data, we.data, BF16, grouped=True) == "triton"
    assert fg._backend(None, xt.data, xt.data, BF16, grouped=True, wgrad=True) == "triton"
    assert fg._backend(None, xq.data, w.data, torch.float16, grouped=False) == "triton"
    w_odd = fq.quantize_weight(_blocky(10944, 768, 5, 128).float() * 0.02)  # DeepSeek's dense MLP width
    assert fg._backend(None, xq.data, w_odd.data, BF16, grouped=False) == "triton"
    got = fl.fp8_linear_forward(xq, w_odd, out_dtype=F32)
    want = fg.fp8_gemm_nt_reference(xq, w_odd.data, w_odd.scale, out_dtype=F32)
    _check(got, want, fq.dequantize_act(xq).abs() @ fq.dequantize_weight(w_odd).abs().t(), 768, "N = 10944")
    got = fl.fp8_grouped_linear_forward(xq, we, offs, out_dtype=F32)
    want = fg.fp8_gemm_nt_reference(xq, we.data, we.scale, offs, out_dtype=F32)
    assert float((got - want).norm() / want.norm()) < MMA_BLOCK_REL


@pytest.mark.parametrize("E,N,K", [(128, 2048, 768), (64, 2048, 1408)], ids=["qwen3 down", "deepseek down"])
def test_triton_grouped_expert_gemms_at_k_768_and_1408_within_the_bound(E, N, K):
    """The experts' down projections (K = moe_intermediate), forward / input gradient / weight
    gradient over ragged expert groups, some empty."""
    T = 8192
    gen = torch.Generator(device="cuda").manual_seed(E)
    counts = torch.bincount(torch.randint(0, E - 3, (T,), generator=gen, device="cuda"), minlength=E)
    offs = counts.cumsum(0).to(torch.int32)
    x, dy = _blocky(T, K, E + 1, 1), _blocky(T, N, E + 2, 1)
    w = fq.quantize_weight(_blocky(E * N, K, E + 3, 128).view(E, N, K).float() * 0.02)
    xq, dyq = fq.quantize_act(x), fq.quantize_act(dy)
    dyt, xt = fq.quantize_act_t(dy, offs), fq.quantize_act_t(x, offs)
    wd = fq.dequantize_weight(w)
    ad, gd = fq.dequantize_act(xq).abs(), fq.dequantize_act(dyq).abs()
    starts = torch.cat([offs.new_zeros(1), offs[:-1]]).tolist()
    fwd_ref = fg.fp8_gemm_nt_reference(xq, w.data, w.scale, offs, out_dtype=F32)
    dx_ref = fg.fp8_gemm_nt_reference(dyq, w.data_t, w.scale_t, offs, out_dtype=F32)
    fwd_abs, dx_abs = torch.zeros_like(fwd_ref), torch.zeros_like(dx_ref)
    for e, (s, t) in enumerate(zip(starts, offs.tolist())):
        fwd_abs[s:t] = ad[s:t] @ wd[e].abs().t()
        dx_abs[s:t] = gd[s:t] @ wd[e].abs()
    _check(fl.fp8_grouped_linear_forward(xq, w, offs, out_dtype=F32), fwd_ref, fwd_abs, K, "grouped forward")
    _check(fl.fp8_grouped_linear_input_grad(dyq, w, offs, out_dtype=F32), dx_ref, dx_abs, N, "grouped dgrad")
    dw = fl.fp8_grouped_linear_weight_grad(xt, dyt, offs, out_dtype=F32)
    dw_ref = fg.fp8_gemm_wgrad_reference(dyt, xt, out_dtype=F32)
    at, gt = fq.dequantize_act_t(xt).abs(), fq.dequantize_act_t(dyt).abs()
    for e, (s, n) in enumerate(zip(dyt.group_start.tolist(), dyt.group_len.tolist())):
        _check(dw[e], dw_ref[e], gt[:, s : s + n] @ at[:, s : s + n].t(), max(n, 1), f"grouped wgrad {e}")
