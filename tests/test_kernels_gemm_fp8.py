"""Block-scaled FP8 GEMMs equal their references on dequantized inputs, and the three-step FP8
linear layers stay within E4M3's rounding bound of float64 math.

Kernels run under the Triton interpreter on CPU tensors (TRITON_INTERPRET=1 set before triton is
imported). The interpreter's dot is exact FP32 math, so "FP32-accumulation tolerance" is tight here;
on a GPU (benchmarks/bench_fp8.py) the same comparisons are made at 1e-3.
"""

import dataclasses
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from fmoe.kernels import fp8_gemm as fg  # noqa: E402
from fmoe.kernels import fp8_linear as fl  # noqa: E402
from fmoe.kernels import fp8_quant as fq  # noqa: E402
from fmoe.kernels._triton import interpreting  # noqa: E402

WIDE = fg.GemmConfig(block_m=64, block_n=256, num_warps=4, num_stages=2)  # B scales as a vector
FLAT = fg.GemmConfig(block_m=32, block_n=64, num_warps=4, num_stages=2, warp_specialize=False, flatten=True)
PREFETCH = fg.GemmConfig(
    block_m=32, block_n=64, num_warps=4, num_stages=2, flatten=True, prefetch_scales=True
)
CAPPED = fg.GemmConfig(
    block_m=32, block_n=64, num_warps=4, num_stages=2, programs_per_sm=3, max_registers=168
)


# The FP8 GEMM kernels against their float32 references of the same dequantized products: both sum
# at most K_MAX = 300 products in float32 (K, or T rows for the weight gradient), in different orders
# and 128-groups. Each is within about u * sqrt(K) of the exact result in relative norm (rounding
# errors of random sign, any CPU or order; u = float32 eps); the two add, and a stated factor of 4
# covers the per-group rescaling (one more rounding per 128 terms): 8 u (sqrt(300) + 2) = 1.8e-5.
SAME_PRODUCTS_REL = 8 * torch.finfo(torch.float32).eps * (math.sqrt(300) + 2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _bf16_ulp_close(got: torch.Tensor, want_fp32: torch.Tensor) -> bool:
    # bf16 results are the FP32 results rounded (to nearest on GPUs; the interpreter truncates),
    # up to the FP32 summation-order difference from the reference
    tol = want_fp32.abs() * 2**-7 + 1e-5 * want_fp32.abs().max()
    return bool(torch.all((got.float() - want_fp32).abs() <= tol))


def test_kernels_run_in_the_interpreter_here():
    assert interpreting()


@pytest.mark.parametrize("config", [None, WIDE, FLAT, PREFETCH], ids=["default", "wide", "flat", "prefetch"])
def test_fp8_gemm_nt_equals_dequantized_reference(config):
    M, N, K = 200, 320, 272  # partial tiles in M and N, a partial 128-group in K
    a = fq.quantize_act(_randn(M, K, seed=1).bfloat16())
    w = fq.quantize_weight(_randn(N, K, seed=2))
    got = fg.fp8_gemm_nt(a, w.data, w.scale, out_dtype=torch.float32, config=config)
    want = fg.fp8_gemm_nt_reference(a, w.data, w.scale, out_dtype=torch.float32)
    assert _rel(got, want) < SAME_PRODUCTS_REL
    got16 = fg.fp8_gemm_nt(a, w.data, w.scale, config=config)
    assert got16.dtype == torch.bfloat16 and _bf16_ulp_close(got16, want)


@pytest.mark.parametrize("config", [None, WIDE, PREFETCH], ids=["default", "wide", "prefetch"])
def test_fp8_grouped_gemm_equals_reference_with_empty_and_unaligned_groups(config):
    M, N, K, E = 300, 192, 256, 5
    offs = torch.tensor([0, 70, 70, 233, 300], dtype=torch.int32)  # experts 0 and 2 are empty
    a = fq.quantize_act(_randn(M, K, seed=3).bfloat16())
    w = fq.quantize_weight(_randn(E, N, K, seed=4))
    got = fg.fp8_gemm_nt(a, w.data, w.scale, offs, out_dtype=torch.float32, config=config)
    want = fg.fp8_gemm_nt_reference(a, w.data, w.scale, offs, out_dtype=torch.float32)
    assert _rel(got, want) < SAME_PRODUCTS_REL
    # each row used its own expert's weight: compare one row of each non-empty expert by hand
    x, wd = fq.dequantize_act(a), fq.dequantize_weight(w)
    for e, row in [(1, 0), (3, 70), (3, 232), (4, 233)]:
        assert _rel(got[row], x[row] @ wd[e].t()) < SAME_PRODUCTS_REL


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fp8_grouped_gemm_scatters_its_rows_where_out_rows_says(backend, monkeypatch):
    # out_rows (the experts' outputs put back in token order by the GEMM's stores): row r of the
    # product lands at out_rows[r], bitwise the product in order then moved; a bad index is named
    monkeypatch.setenv("FMOE_KERNEL_BACKEND", backend)
    M, N, K, E = 300, 192, 256, 5
    offs = torch.tensor([0, 70, 70, 233, 300], dtype=torch.int32)
    a = fq.quantize_act(_randn(M, K, seed=5).bfloat16())
    w = fq.quantize_weight(_randn(E, N, K, seed=6))
    out_rows = torch.randperm(M, generator=torch.Generator().manual_seed(7))
    in_order = fg.fp8_gemm_nt(a, w.data, w.scale, offs)
    for rows in (out_rows, out_rows.to(torch.int32)):
        got = fg.fp8_gemm_nt(a, w.data, w.scale, offs, out_rows=rows)
        assert torch.equal(got[out_rows], in_order)
    with pytest.raises(ValueError, match="out_rows: expected a"):
        fg.fp8_gemm_nt(a, w.data, w.scale, offs, out_rows=out_rows[:-1])
    with pytest.raises(ValueError, match="out_rows: only the grouped GEMM"):
        fg.fp8_gemm_nt(a, w.data[0], w.scale[0], out_rows=out_rows)


def test_fp8_wgrad_gemm_equals_reference_and_empty_expert_is_zero():
    T, N_out, K_in = 300, 192, 160
    offs = torch.tensor([0, 120, 128, 300, 300], dtype=torch.int32)
    dyt = fq.quantize_act_t(_randn(T, N_out, seed=5).bfloat16(), offs)
    xt = fq.quantize_act_t(_randn(T, K_in, seed=6).bfloat16(), offs)
    got = fg.fp8_gemm_wgrad(dyt, xt, grouped=True, out_dtype=torch.float32)
    want = fg.fp8_gemm_wgrad_reference(dyt, xt, out_dtype=torch.float32)
    assert got.shape == (5, N_out, K_in)
    assert _rel(got, want) < SAME_PRODUCTS_REL
    assert torch.equal(got[0], torch.zeros(N_out, K_in)) and torch.equal(got[4], torch.zeros(N_out, K_in))
    for config in (FLAT, PREFETCH):
        got_config = fg.fp8_gemm_wgrad(dyt, xt, grouped=True, out_dtype=torch.float32, config=config)
        assert _rel(got_config, want) < SAME_PRODUCTS_REL
        assert torch.equal(got_config[0], torch.zeros(N_out, K_in))
        assert torch.equal(got_config[4], torch.zeros(N_out, K_in))
    # the layouts cut to the tiles in use: empty expert 4 now starts at the end of the scales (the
    # prefetching kernel masks that first load; the interpreter would not flag an out-of-bounds read,
    # so this shows the results, not the mask)
    tight = [
        fq.Fp8ActT(t.data[:, : int(t.group_start[-1])], t.scale[:, : int(t.group_start[-1]) // 128],
                   t.group_start, t.group_len)
        for t in (dyt, xt)
    ]  # fmt: skip
    assert int(tight[0].group_start[-1]) == tight[0].data.shape[1]
    for config in (None, PREFETCH):
        got_tight = fg.fp8_gemm_wgrad(*tight, grouped=True, out_dtype=torch.float32, config=config)
        untrimmed = fg.fp8_gemm_wgrad(dyt, xt, grouped=True, out_dtype=torch.float32, config=config)
        assert torch.equal(got_tight, untrimmed)


def _e4m3_bound(x: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """Elementwise bound of |fp8 GEMM - exact| for y = x @ w^T (x [M, K], w [N, K] in float64).

    Each quantized value is off by at most d = |v|/16 + s/1024 (half an E4M3 step, or half the
    subnormal step); x'w' - xw = (x' - x) w' + x (w' - w), so |err| <= d_x |w'| + |x| d_w, summed
    over K; plus FP32 accumulation (K * 2^-23 of sum |x'w'|) and the bf16 rounding of the result.
    """
    dx = x.abs() / 16 + sx / 1024
    dw = w.abs() / 16 + sw / 1024
    wq = w.abs() + dw
    bound = dx @ wq.t() + x.abs() @ dw.t()
    return bound + (x.abs() + dx) @ wq.t() * (x.shape[1] * 2.0**-23)


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().t()


def test_fp8_linear_three_steps_within_e4m3_bound_of_float64():
    T, d_in, d_out = 192, 256, 384
    x = _randn(T, d_in, seed=7).bfloat16()
    w = _randn(d_out, d_in, seed=8, scale=0.05)
    dy = _randn(T, d_out, seed=9, scale=1e-3).bfloat16()
    w8 = fl.quantize_weight(w)
    sw = w8.scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:d_out, :d_in]

    y = fl.fp8_linear_forward(x, w8, out_dtype=torch.float32)
    sx = fq.quantize_act(x).scale.double().repeat_interleave(128, 1)[:, :d_in]
    exact = _exact(x, w)
    assert torch.all((y.double() - exact).abs() <= _e4m3_bound(x.double(), sx, w.double(), sw))
    assert 0.005 < _rel(y, exact) < 0.06  # E4M3's error, not bf16's (~0.003) and not a bug

    dx = fl.fp8_linear_input_grad(dy, w8, out_dtype=torch.float32)
    sdy = fq.quantize_act(dy).scale.double().repeat_interleave(128, 1)[:, :d_out]
    exact = dy.double() @ w.double()
    bound = _e4m3_bound(dy.double(), sdy, w.double().t(), sw.t())
    assert torch.all((dx.double() - exact).abs() <= bound)

    dw = fl.fp8_linear_weight_grad(x, dy, out_dtype=torch.float32)
    dyt, xt = fq.quantize_act_t(dy), fq.quantize_act_t(x)
    s_dy = dyt.scale.double().repeat_interleave(128, 1)[:, :T]
    s_x = xt.scale.double().repeat_interleave(128, 1)[:, :T]
    exact = _exact(dy.t(), x.t())
    bound = _e4m3_bound(dy.double().t(), s_dy, x.double().t(), s_x)
    assert torch.all((dw.double() - exact).abs() <= bound)
    assert _rel(dw, exact) < 0.06


def test_fp8_grouped_linear_three_steps_match_float64_per_expert():
    T, d_in, d_out, E = 260, 128, 256, 4
    offs = torch.tensor([100, 100, 129, 260], dtype=torch.int32)
    x = _randn(T, d_in, seed=10).bfloat16()
    w = _randn(E, d_out, d_in, seed=11, scale=0.05)
    dy = _randn(T, d_out, seed=12).bfloat16()
    w8 = fl.quantize_weight(w)
    y = fl.fp8_grouped_linear_forward(x, w8, offs)
    dx = fl.fp8_grouped_linear_input_grad(dy, w8, offs)
    dw = fl.fp8_grouped_linear_weight_grad(x, dy, offs)
    assert y.shape == (T, d_out) and dx.shape == (T, d_in) and dw.shape == (E, d_out, d_in)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            xs, dys = x[start:end].double(), dy[start:end].double()
            assert _rel(y[start:end], xs @ w[e].double().t()) < 0.06
            assert _rel(dx[start:end], dys @ w[e].double()) < 0.06
            assert _rel(dw[e], dys.t() @ xs) < 0.06
        else:
            assert torch.equal(dw[e], torch.zeros(d_out, d_in, dtype=dw.dtype))
        start = end


def test_prequantized_inputs_give_the_same_result():
    T, d_in, d_out = 128, 256, 128
    x = _randn(T, d_in, seed=13).bfloat16()
    dy = _randn(T, d_out, seed=14).bfloat16()
    w8 = fl.quantize_weight(_randn(d_out, d_in, seed=15))
    x_rows, x_cols = fq.quantize_act_t(x, with_rows=True)
    assert torch.equal(fl.fp8_linear_forward(x_rows, w8), fl.fp8_linear_forward(x, w8))
    dy_cols = fq.quantize_act_t(dy)
    assert torch.equal(fl.fp8_linear_weight_grad(x_cols, dy_cols), fl.fp8_linear_weight_grad(x, dy))


def test_torch_backend_matches_triton():
    a = fq.quantize_act(_randn(130, 256, seed=16).bfloat16())
    w = fq.quantize_weight(_randn(3, 128, 256, seed=17))
    offs = torch.tensor([64, 64, 130], dtype=torch.int32)
    tri = fg.fp8_gemm_nt(a, w.data, w.scale, offs, out_dtype=torch.float32, backend="triton")
    ref = fg.fp8_gemm_nt(a, w.data, w.scale, offs, out_dtype=torch.float32, backend="torch")
    assert _rel(tri, ref) < SAME_PRODUCTS_REL


def test_backend_and_shape_errors_name_the_field(monkeypatch):
    a = fq.quantize_act(torch.randn(16, 128))
    w = fq.quantize_weight(torch.randn(128, 128))
    with pytest.raises(ValueError, match="backend"):
        fg.fp8_gemm_nt(a, w.data, w.scale, backend="cublas")
    if fg._deep_gemm() is None:
        with pytest.raises(ValueError, match="deep_gemm"):
            fg.fp8_gemm_nt(a, w.data, w.scale, backend="deep_gemm")
    monkeypatch.setenv("FMOE_KERNEL_BACKEND", "deep_gemm")  # from the environment it falls back
    assert fg._backend(None, a.data, w.data, torch.bfloat16, grouped=False) in ("deep_gemm", "triton")
    with pytest.raises(ValueError, match="b_scale"):
        fg.fp8_gemm_nt(a, w.data, w.scale[:, :0])
    with pytest.raises(ValueError, match="offs"):
        fg.fp8_gemm_nt(a, w.data, w.scale, torch.tensor([16], dtype=torch.int32))
    with pytest.raises(ValueError, match="w_fp8"):
        fl.fp8_grouped_linear_forward(torch.randn(16, 128), w, torch.tensor([16], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_m"):
        fg.GemmConfig(block_m=96)
    for bad in (170, 16, 256, 168.0):
        with pytest.raises(ValueError, match="max_registers"):
            fg.GemmConfig(max_registers=bad)
    with pytest.raises(ValueError, match="max_registers: must be None with warp_specialize"):
        fg.GemmConfig(warp_specialize=True, max_registers=168)


def test_the_launchers_compile_with_the_config_s_options(monkeypatch):
    # the interpreter takes compile options and ignores them: what each launch passes is checked here
    # (what ptxas made of them was read from the compiled kernels on a GPU: issue26_regcap_h100.json)
    seen = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append({k: kw.get(k) for k in ("num_warps", "num_stages", "maxnreg")})
                return self.kernel[grid](*args, **kw)

            return launch

    monkeypatch.setattr(fg, "_nt_kernel", Spy(fg._nt_kernel))
    monkeypatch.setattr(fg, "_wgrad_kernel", Spy(fg._wgrad_kernel))
    a = fq.quantize_act(_randn(64, 128, seed=7).bfloat16())
    w = fq.quantize_weight(_randn(64, 128, seed=8))
    offs = torch.tensor([64], dtype=torch.int32)
    at = fq.quantize_act_t(_randn(64, 128, seed=9).bfloat16(), offs)
    fg.fp8_gemm_nt(a, w.data, w.scale, config=CAPPED)
    fg.fp8_gemm_wgrad(at, at, grouped=False, config=CAPPED)
    fg.fp8_gemm_nt(a, w.data, w.scale, config=FLAT)
    capped = {"num_warps": 4, "num_stages": 2, "maxnreg": 168}
    assert seen == [capped, capped, {"num_warps": 4, "num_stages": 2, "maxnreg": None}]


@pytest.mark.parametrize(
    "version, want",
    [
        ("3.6.0", (False, False)),
        ("3.9.0", (False, True)),
        ("3.9.1+git1a2b3c4", (False, True)),  # a build of a listed release
        ("3.7.0", (False, False)),  # between listed releases: the newest one below
        ("3.10.0", (False, True)),  # 3.10 is after 3.9, not before it
        ("3.5.1", (False, False)),  # older than any listed: the oldest listed
    ],
)
def test_prefetch_scales_follow_the_triton_release(version, want):
    assert fg.prefetch_scales_for(version) == want


def test_default_configs_are_the_base_tiles_with_this_triton_s_prefetch():
    import triton

    nt, wgrad = fg.prefetch_scales_for(triton.__version__)
    default, wgrad_default = fg.DEFAULT_CONFIG, fg.WGRAD_CONFIG
    assert default == dataclasses.replace(fg.BASE_CONFIG, prefetch_scales=nt)
    assert wgrad_default == dataclasses.replace(fg.BASE_CONFIG, prefetch_scales=wgrad)
    with pytest.raises(ValueError, match="not a Triton version: 'nightly'"):
        fg.prefetch_scales_for("nightly")
