"""Which backend each FP8 GEMM takes (``fp8_gemm.choose_backend``, a pure function of the call's shape
and of what the machine offers), the scale layout handed to cuBLAS, and that on a CPU the dense FP8
linear steps still run the Triton kernels under the interpreter.

The cuBLAS GEMMs themselves need a Hopper GPU: tests/test_fp8_cublas_cuda.py checks them there.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from fmoe.kernels import fp8_cublas as fc  # noqa: E402
from fmoe.kernels import fp8_gemm as fg  # noqa: E402
from fmoe.kernels import fp8_linear as fl  # noqa: E402
from fmoe.kernels import fp8_quant as fq  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32
HOPPER = dict(triton_runs=True, cublas_here=True, deep_gemm_here=False)


def _choose(requested="auto", *, M=4096, N=2048, K=2048, wgrad=False, grouped=False, out=BF16, explicit=False,
            **machine):  # fmt: skip
    where = {**HOPPER, **machine}
    return fg.choose_backend(requested, explicit=explicit, M=M, N=N, K=K, wgrad=wgrad, grouped=grouped,
                             out_dtype=out, **where)  # fmt: skip


# The dense GEMMs of the Qwen3-30B-A3B and DeepSeek-V3-16B layers (M = tokens, N x K of the weight;
# the input gradient swaps N and K, the weight gradient reduces over the tokens), K = 768 and 1408
# (6 and 11 blocks of 128, not multiples of 4) included: all whole 128-blocks, so cuBLAS takes them.
DENSE = [(4096, 4096, 2048), (4096, 512, 2048), (32768, 2048, 4096), (8192, 2048, 768), (8192, 2048, 1408),
         (8192, 6144, 2048), (8192, 2048, 2816), (4096, 4096, 512)]  # fmt: skip


@pytest.mark.parametrize("M,N,K", DENSE)
def test_dense_gemms_of_the_layers_take_cublas_on_hopper(M, N, K):
    assert _choose(M=M, N=N, K=K) == "cublas"  # forward
    assert _choose(M=M, N=K, K=N) == "cublas"  # input gradient
    assert _choose(M=N, N=K, K=M, wgrad=True) == "cublas"  # weight gradient over M tokens
    assert _choose(M=M, N=N, K=K, out=F32) == "cublas"


def test_what_cublas_does_not_take_runs_on_triton():
    assert _choose(grouped=True) == "triton"  # the experts' grouped GEMMs
    assert _choose(grouped=True, wgrad=True) == "triton"
    assert _choose(K=10944) == "triton"  # a partial 128-block of K (10944 = 85.5 x 128)
    assert _choose(N=10944) == "triton"  # a partial 128-block of the weight's rows
    assert _choose(N=10944, wgrad=True) == "cublas"  # 1x128 scales on both: rows need 16 only
    assert _choose(M=4100) == "triton"  # M not a multiple of 16
    assert _choose(out=torch.float16) == "triton"
    assert _choose(M=0) == "triton"


def test_no_cublas_here_means_triton_and_no_triton_means_the_reference():
    assert _choose(cublas_here=False) == "triton"
    assert _choose(cublas_here=False, triton_runs=False) == "torch"
    assert _choose("cublas", cublas_here=False) == "triton"  # from the environment it falls back
    assert _choose("cublas", grouped=True) == "triton"


def test_forced_backends_are_taken_or_refused_by_name():
    assert _choose("triton") == "triton"  # FMOE_KERNEL_BACKEND=triton / backend="triton" on Hopper
    assert _choose("torch") == "torch"
    assert _choose("cublas") == "cublas"
    with pytest.raises(ValueError, match="backend: 'cublas' was asked for, but cublas is not available"):
        _choose("cublas", explicit=True, cublas_here=False)
    with pytest.raises(ValueError, match="does not support this call \\(grouped 4096 x 2048 x 2048"):
        _choose("cublas", explicit=True, grouped=True)
    with pytest.raises(ValueError, match="'triton' needs CUDA tensors"):
        _choose("triton", triton_runs=False)
    with pytest.raises(ValueError, match="backend: must be one of"):
        _choose("cutlass")


def test_deep_gemm_when_installed_comes_first_for_the_forward_only():
    assert _choose(deep_gemm_here=True) == "deep_gemm"
    assert _choose(deep_gemm_here=True, wgrad=True) == "cublas"
    assert _choose("deep_gemm", deep_gemm_here=False) == "cublas"  # environment: falls back to auto


@pytest.mark.parametrize("blocks", [(16, 6), (16, 11), (32, 16), (4, 22), (1, 1)])
def test_weight_scales_for_cublas_are_the_transpose_padded_to_four_k_blocks(blocks):
    NB, KB = blocks
    s = torch.rand(NB, KB) + 0.5
    got = fc.cublas_weight_scale(s)
    L4 = -(-KB // 4) * 4
    assert got.shape == (L4, NB) and (got.stride() == (1, L4) or NB == 1)  # what scaled_mm checks
    assert torch.equal(got[:KB], s.t()) and not got[KB:].any()
    if KB % 4 == 0:
        assert got.data_ptr() == s.data_ptr()  # a view: no copy


def test_cpu_tensors_take_triton_in_the_interpreter_and_the_dense_steps_match_the_references():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    M, N, K = 64, 256, 384
    gen = torch.Generator().manual_seed(0)
    x, dy = torch.randn(M, K, generator=gen), torch.randn(M, N, generator=gen)
    w = fq.quantize_weight(torch.randn(N, K, generator=gen))
    assert fc.cublas_available(x.device) is False
    assert fg._backend(None, x, w.data, F32, grouped=False) == "triton"
    xq, dyq = fq.quantize_act(x), fq.quantize_act(dy)
    xt, dyt = fq.quantize_act_t(x), fq.quantize_act_t(dy)
    assert fg._backend(None, dyt.data, xt.data, F32, grouped=False, wgrad=True) == "triton"
    steps = [
        (fl.fp8_linear_forward(xq, w, out_dtype=F32), fg.fp8_gemm_nt_reference(xq, w.data, w.scale, out_dtype=F32)),
        (fl.fp8_linear_input_grad(dyq, w, out_dtype=F32),
         fg.fp8_gemm_nt_reference(dyq, w.data_t, w.scale_t, out_dtype=F32)),
        (fl.fp8_linear_weight_grad(xt, dyt, out_dtype=F32), fg.fp8_gemm_wgrad_reference(dyt, xt, out_dtype=F32)[0]),
    ]  # fmt: skip
    for got, want in steps:
        # both sum at most 384 exact products in float32, in different orders: u * sqrt(K) each
        tol = 8 * torch.finfo(F32).eps * (K**0.5 + 2)
        assert float((got - want).norm() / want.norm()) < tol


def test_forcing_cublas_on_a_cpu_tensor_names_the_backend(monkeypatch):
    a = fq.quantize_act(torch.randn(16, 128))
    w = fq.quantize_weight(torch.randn(128, 128))
    with pytest.raises(ValueError, match="'cublas' was asked for"):
        fl.fp8_linear_forward(a, w, backend="cublas")
    monkeypatch.setenv("FMOE_KERNEL_BACKEND", "cublas")  # from the environment: Triton here
    assert fg._backend(None, a.data, w.data, BF16, grouped=False) == "triton"
    assert fl.fp8_linear_forward(a, w).shape == (16, 128)


def test_a_cublas_refusal_at_run_time_is_raised_not_hidden(monkeypatch):
    """Where the shape rule (``cublas_supports``) sends a GEMM to cuBLAS, a refusal by torch is an
    error the user sees (FMOE_KERNEL_BACKEND=triton runs without cuBLAS), not a silent switch."""

    def refusing(*args, **kwargs):
        raise NotImplementedError("no 1x128 x 128x128 here")

    monkeypatch.setattr(fg, "cublas_available", lambda device: True)
    monkeypatch.setattr(fg, "cublas_gemm_nt", refusing)
    a = fq.quantize_act(torch.randn(32, 256, generator=torch.Generator().manual_seed(1)))
    w = fq.quantize_weight(torch.randn(128, 256, generator=torch.Generator().manual_seed(2)))
    assert fg._backend(None, a.data, w.data, F32, grouped=False) == "cublas"
    for backend in (None, "cublas"):
        with pytest.raises(NotImplementedError, match="no 1x128"):
            fl.fp8_linear_forward(a, w, out_dtype=F32, backend=backend)
