"""FP8 quantization kernels write exactly the bits (values and scales) of their torch references.

Kernels run under the Triton interpreter on CPU tensors (TRITON_INTERPRET=1 must be set before
triton is imported; tests/conftest.py does, and so does this file when run on its own).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import compile_for_sm90  # noqa: E402

from fmoe.kernels import fp8_quant as fq  # noqa: E402
from fmoe.kernels._triton import interpreting, use_triton  # noqa: E402


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and torch.equal(a, b)


def _activations(rows: int, cols: int, seed: int) -> torch.Tensor:
    """bf16 activations whose columns span 1e-9 .. 1e3, so groups hit E4M3 subnormals and 448."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-9, 3, cols)[torch.randperm(cols, generator=g)]
    x[1, :] = 0.0  # an all-zero row: every group gets the floor scale
    return x.to(torch.bfloat16)


def test_kernels_run_in_the_interpreter_here():
    # guards the other tests: they must exercise the Triton kernels, not the torch fallback
    assert interpreting() and use_triton(torch.zeros(1))


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(100, 272), (33, 128)])
def test_quantize_act_equals_reference_bitwise(shape, pow2):
    x = _activations(*shape, seed=shape[0])
    got, want = fq.quantize_act(x, pow2_scales=pow2), fq.quantize_act_reference(x, pow2_scales=pow2)
    assert _bits_equal(got.data, want.data)
    assert _bits_equal(got.scale, want.scale)
    assert got.scale.shape == (shape[0], -(-shape[1] // 128)) and got.scale.stride(0) == 1


def test_e4m3_cast_rounds_ties_to_even_like_torch():
    # a group with amax 448 has scale 1, so the stored values are the inputs themselves: exact
    # midpoints between neighbouring E4M3 values (normal and subnormal) test the rounding
    codes = torch.arange(0, 126, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 416
    mid = (codes[:-1] + codes[1:]) / 2
    row = torch.cat([torch.tensor([448.0]), mid, -mid, codes[:5] * 1.0001])[:384]
    x = torch.nn.functional.pad(row, (0, 384 - row.numel()))[None].repeat(3, 1)
    got, want = fq.quantize_act(x), fq.quantize_act_reference(x)
    assert float(got.scale[0, 0]) == 1.0
    assert _bits_equal(got.data, want.data)


@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_act_t_grouped_equals_reference_bitwise(pow2):
    # unaligned expert boundaries, empty experts (first, middle, last)
    x = _activations(333, 200, seed=3)
    offs = torch.tensor([0, 50, 50, 300, 333, 333], dtype=torch.int32)
    rows, cols = fq.quantize_act_t(x, offs, pow2_scales=pow2, with_rows=True)
    rows_ref, cols_ref = fq.quantize_act_t_reference(x, offs, pow2_scales=pow2, with_rows=True)
    for got, want in [(rows.data, rows_ref.data), (rows.scale, rows_ref.scale)]:
        assert _bits_equal(got, want)
    for got, want in [(cols.data, cols_ref.data), (cols.scale, cols_ref.scale)]:
        assert _bits_equal(got, want)
    assert cols.group_start.tolist() == [0, 0, 128, 128, 384, 512]
    assert cols.group_len.tolist() == [0, 128, 0, 256, 128, 0]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_quantize_act_t_gathered_equals_quantize_act_t_of_the_gathered_rows(backend, monkeypatch):
    # three parts of different lengths (one empty), rows taken out of order and across parts, expert
    # boundaries unaligned, an empty expert: the bits of quantizing the written-out gathered rows
    monkeypatch.setenv("FMOE_KERNEL_BACKEND", backend)
    g = torch.Generator().manual_seed(11)
    parts = [
        _activations(90, 200, seed=20),
        torch.empty(0, 200, dtype=torch.bfloat16),
        _activations(150, 200, seed=21),
    ]
    n = 240
    perm = torch.randperm(n, generator=g)
    src_part = torch.where(perm < 90, 0, 2).to(torch.int32)
    src_row = torch.where(perm < 90, perm, perm - 90).to(torch.int32)
    offs = torch.tensor([70, 70, 200, 240], dtype=torch.int32)
    got = fq.quantize_act_t_gathered(parts, src_part, src_row, offs, pow2_scales=True)
    want = fq.quantize_act_t_reference(torch.cat(parts)[perm], offs, pow2_scales=True)
    assert _bits_equal(got.data, want.data) and _bits_equal(got.scale, want.scale)
    assert torch.equal(got.group_start, want.group_start) and torch.equal(got.group_len, want.group_len)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_quantize_act_gathered_equals_quantize_act_of_the_gathered_rows(backend, monkeypatch):
    # each token read k = 3 times in a shuffled order (the experts' rows from the tokens), a width
    # that is not a multiple of 128, a row count that is not a multiple of the program's rows
    monkeypatch.setenv("FMOE_KERNEL_BACKEND", backend)
    x = _activations(37, 200, seed=30)
    src_row = (torch.randperm(37 * 3, generator=torch.Generator().manual_seed(31)) // 3).to(torch.int32)
    got = fq.quantize_act_gathered(x, src_row, pow2_scales=True)
    want = fq.quantize_act_reference(x[src_row.long()], pow2_scales=True)
    assert _bits_equal(got.data, want.data) and _bits_equal(got.scale, want.scale)
    assert got.scale.stride() == want.scale.stride()
    with pytest.raises(ValueError, match="src_row: expected a"):
        fq.quantize_act_gathered(x, src_row.long())


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("offs", [None, [0, 50, 50, 300, 333, 333]])
def test_requantizing_fp8_rows_along_tokens_is_quantizing_their_values(offs, pow2):
    # DeepSeek-V3's 1x128 -> 128x1 requantization: the bits of quantize_act_t of the rows' values
    # (bits times scale in fp32), with subnormals, 448s, an all-zero row, a width past 128s, empty
    # experts; every E4M3 code is decoded (the interpreter decodes with integer arithmetic)
    x = _activations(333, 200, seed=40)
    x[7, :126] = torch.arange(0, 126, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    rows = fq.quantize_act(x, pow2_scales=pow2)
    offs_t = None if offs is None else torch.tensor(offs, dtype=torch.int32)
    got = fq.quantize_act_t(rows, offs_t, pow2_scales=pow2)
    want = fq.quantize_act_t_reference(fq.dequantize_act(rows), offs_t, pow2_scales=pow2)
    assert _bits_equal(got.data, want.data) and _bits_equal(got.scale, want.scale)
    assert torch.equal(got.group_start, want.group_start) and torch.equal(got.group_len, want.group_len)
    # the values are not those of the one quantization along tokens: each went through two roundings
    once = fq.quantize_act_t(x, offs_t, pow2_scales=pow2)
    assert not _bits_equal(got.data, once.data)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_requantizing_gathered_fp8_rows_is_quantizing_the_gathered_values(backend, monkeypatch):
    # the merged expert weight gradient's FP8 output gradients: parts of different lengths (one
    # empty), rows taken across parts out of order, each part's scales at its own row stride
    monkeypatch.setenv("FMOE_KERNEL_BACKEND", backend)
    g = torch.Generator().manual_seed(12)
    parts = [fq.quantize_act(_activations(90, 200, seed=50)), fq.quantize_act(torch.empty(0, 200))]
    parts.append(fq.quantize_act(_activations(150, 200, seed=51)))
    n = 240
    perm = torch.randperm(n, generator=g)
    src_part = torch.where(perm < 90, 0, 2).to(torch.int32)
    src_row = torch.where(perm < 90, perm, perm - 90).to(torch.int32)
    offs = torch.tensor([70, 70, 200, 240], dtype=torch.int32)
    got = fq.quantize_act_t_gathered(parts, src_part, src_row, offs)
    values = torch.cat([fq.dequantize_act(p) for p in parts])[perm]
    want = fq.quantize_act_t_reference(values, offs)
    assert _bits_equal(got.data, want.data) and _bits_equal(got.scale, want.scale)
    with pytest.raises(ValueError, match="a mix"):
        fq.quantize_act_t_gathered([parts[0], values], src_part, src_row, offs)
    with pytest.raises(ValueError, match=r"parts\[0\]: expected an Fp8Act"):
        fq.quantize_act_t_gathered(
            [fq.Fp8Act(parts[0].data, parts[0].scale.contiguous())], src_part, src_row, offs
        )
    with pytest.raises(ValueError, match="with_rows"):
        fq.quantize_act_t(parts[0], with_rows=True)


def test_quantize_act_t_gathered_names_the_bad_input():
    a, b = torch.randn(4, 128), torch.randn(4, 256)
    idx = torch.zeros(4, dtype=torch.int32)
    offs = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"parts\[1\]"):
        fq.quantize_act_t_gathered([a, b], idx, idx, offs)
    with pytest.raises(ValueError, match=r"parts\[0\]: expected a contiguous"):
        fq.quantize_act_t_gathered([torch.randn(128, 4).t()], idx, idx, offs)
    with pytest.raises(ValueError, match="src_part, src_row"):
        fq.quantize_act_t_gathered([a], idx.long(), idx, offs)
    with pytest.raises(ValueError, match="parts: expected 1 to"):
        fq.quantize_act_t_gathered([a] * (fq.GATHER_MAX_PARTS + 1), idx, idx, offs)
    with pytest.raises(ValueError, match="offs"):
        fq.quantize_act_t_gathered([a], idx, idx, torch.tensor([3], dtype=torch.int32))


def test_quantize_act_t_pads_each_expert_with_zeros():
    x = _activations(70, 128, seed=4)
    offs = torch.tensor([30, 70], dtype=torch.int32)
    cols = fq.quantize_act_t(x, offs)
    deq = fq.dequantize_act_t(cols)  # [128, cap]
    assert torch.equal(deq[:, 30:128], torch.zeros(128, 98))  # expert 0: 30 tokens, then padding
    assert torch.equal(deq[:, 168:], torch.zeros(128, deq.shape[1] - 168))  # expert 1 padding and tail
    # the stored values are x^T, quantized along tokens, in order
    err = (deq[:, 128:168] - x[30:].float().t()).abs()
    assert torch.all(err <= x[30:].float().t().abs() / 16 + cols.scale[:, 1:2] / 1024)


@pytest.mark.parametrize("tokens", [130, 256, 0])
def test_quantize_act_t_dense_is_one_group_with_no_tile_map(tokens, monkeypatch):
    # offs=None: the kernel finds its tiles itself and writes the group's start and length, so a
    # dense quantization launches no tile map (nor makes an offsets tensor); the bits are those of
    # one explicit group
    x = _activations(256, 256, seed=5)[:tokens]
    grouped_rows, grouped = fq.quantize_act_t(x, torch.tensor([tokens], dtype=torch.int32), with_rows=True)

    def no_tile_map(*args):
        raise AssertionError("a dense quantization built a tile map")

    monkeypatch.setattr(fq, "tile_map", no_tile_map)
    rows, cols = fq.quantize_act_t(x, with_rows=True)
    for got, want in [(cols, grouped), (rows, grouped_rows)]:
        assert _bits_equal(got.data, want.data) and _bits_equal(got.scale, want.scale)
    assert cols.data.shape == (256, max(-(-tokens // 128), 1) * 128)
    assert cols.group_start.tolist() == [0] and cols.group_len.tolist() == [-(-tokens // 128) * 128]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # fp32 master weights, bf16 copies
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(200, 300), (3, 256, 130)])
def test_quantize_weight_equals_reference_bitwise(shape, pow2, dtype):
    w = (torch.randn(*shape, generator=torch.Generator().manual_seed(7)) * 0.02).to(dtype)
    got, want = fq.quantize_weight(w, pow2_scales=pow2), fq.quantize_weight_reference(w, pow2_scales=pow2)
    for name in ("data", "scale", "data_t", "scale_t"):
        assert _bits_equal(getattr(got, name), getattr(want, name)), name
    assert _bits_equal(got.data_t, got.data.transpose(-1, -2).contiguous())
    assert torch.equal(got.scale_t, got.scale.transpose(-1, -2))


def test_dequantized_values_are_within_half_an_e4m3_step():
    # |q * s - x| <= 2^-4 |x| (3 mantissa bits) + s * 2^-10 (half the subnormal step)
    x = _activations(64, 384, seed=8).float()
    q = fq.quantize_act(x)
    s = q.scale.repeat_interleave(128, dim=1)
    err = (fq.dequantize_act(q) - x).abs()
    assert torch.all(err <= x.abs() / 16 + s / 1024)
    assert err.max() > 0  # the check is not vacuous


def test_pow2_scales_are_powers_of_two_and_cover_amax():
    x = _activations(16, 256, seed=9).float()
    q = fq.quantize_act(x, pow2_scales=True)
    mant, _ = torch.frexp(q.scale)
    assert torch.all(mant == 0.5)
    amax = x.abs().unflatten(1, (2, 128)).amax(-1).clamp_min(fq.AMAX_EPS)
    assert torch.all(amax <= q.scale * fq.FP8_MAX)


@pytest.mark.parametrize(
    "counts, tile",
    [
        ([5, 0, 300, 1, 0, 129], 128),  # empty experts, a tail tile, one spanning three tiles
        ([0, 0, 0], 128),  # no rows: one placeholder tile past every expert
        ([7] * 40, 16),  # more experts than the 16-wide minimum, small tiles, several programs
        ([0] * 200 + [3000], 64),  # all rows in the last of 200 experts
    ],
)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_tile_map_kernel_equals_torch_reference(counts, tile, dtype):
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(dtype)
    rows = int(offs[-1])
    got, want = fq.tile_map(offs, rows, tile), fq.tile_map_reference(offs, rows, tile)
    assert got.cap == want.cap
    for field in ("expert", "row", "group_end", "first_tile", "num_tiles"):
        g, w = getattr(got, field), getattr(want, field)
        assert g.dtype == torch.int32 and torch.equal(g, w), field


def test_bad_inputs_name_the_field():
    x = torch.randn(10, 128)
    with pytest.raises(ValueError, match="offs"):
        fq.quantize_act_t(x, torch.tensor([4, 9], dtype=torch.int32))  # does not cover the 10 rows
    with pytest.raises(ValueError, match="offs"):
        fq.quantize_act_t(x, torch.tensor([6, 4, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="x:"):
        fq.quantize_act(torch.randn(10))
    with pytest.raises(ValueError, match="w:"):
        fq.quantize_weight(torch.randn(10))


def test_cpu_without_interpreter_takes_the_reference(monkeypatch):
    monkeypatch.setenv("FMOE_KERNEL_BACKEND", "torch")
    assert not use_triton(torch.zeros(1))
    x = _activations(20, 128, seed=10)
    got, want = fq.quantize_act(x), fq.quantize_act_reference(x)
    assert _bits_equal(got.data, want.data) and _bits_equal(got.scale, want.scale)
    monkeypatch.setenv("FMOE_KERNEL_BACKEND", "auto")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not use_triton(torch.zeros(1))


# The FP8 step's quantization kernels in the forms training launches, compiled to an sm_90 cubin with
# the ptxas bundled in triton (no GPU needed): the interpreter runs their semantics above but lowers
# nothing. Pointers and the parts' row counts (passed times 16) are marked divisible by 16, as a
# launch on CUDA tensors specializes them.
_COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fmoe.kernels import fp8_quant as fq, fused

assert not fq.interpreting()
DIV16 = [["tt.divisibility", 16]]


def compile_(fn, signature, constexprs, num_warps):
    attrs = {}
    for i, ty in enumerate(signature.values()):  # every pointer, and each int of a tuple
        for j, t in enumerate(ty if isinstance(ty, tuple) else (ty,)):
            if t.startswith("*") or isinstance(ty, tuple):
                attrs[(i, j) if isinstance(ty, tuple) else (i,)] = DIV16
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    assert kernel.asm["cubin"], fn.__name__


def tiles(parts, **flags):
    sig = {"parts": ("*u8",) * parts if flags["DEQUANT"] else ("*bf16",) * parts,
           "sparts": ("*fp32",) * parts, "part_rows": ("i32",) * parts}
    sig.update({n: "*i32" for n in ("src_part_ptr", "src_row_ptr")})
    sig.update(q_ptr="*u8", s_ptr="*fp32", qt_ptr="*u8", st_ptr="*fp32")
    sig.update({n: "*i32" for n in ("tile_expert_ptr", "tile_row_ptr", "group_end_ptr", "group_ptr")})
    sig.update({n: "i32" for n in ("M", "K", "E", "stride_xm", "stride_qm", "stride_qtk", "half")})
    consts = dict(PROLOGUE=0, ROWS=False, GATHER=False, GROUPED=True, POW2=False, EMULATE=False)
    consts.update(flags)
    sig.update({n: "constexpr" for n in consts})
    compile_(fq._quant_tiles_kernel, sig, consts, fq.TILES_WARPS)


def rows(prologue, gather):
    sig = {"x_ptr": "*bf16", "src_row_ptr": "*i32", "q_ptr": "*u8", "s_ptr": "*fp32"}
    sig.update({n: "i32" for n in ("M", "K", "stride_xm", "stride_qm", "half")})
    consts = dict(PROLOGUE=prologue, GATHER=gather, POW2=False, EMULATE=False, BLOCK_R=fq.ROWS_BLOCK_R)
    sig.update({n: "constexpr" for n in consts})
    compile_(fq._quant_rows_kernel, sig, consts, fq.ROWS_WARPS)


tiles(3, DEQUANT=True, GATHER=True)  # a merged W's requantization of FP8 rows over micro-batches
tiles(3, DEQUANT=False, GATHER=True)  # ... of the tokens (up's x)
tiles(1, DEQUANT=True)  # one micro-batch's W on FP8 rows
tiles(1, DEQUANT=False, ROWS=True, GROUPED=False)  # a projection's dy: rows and token-wise form
rows(1, False)  # SwiGLU's output rows (swiglu_quant)
rows(0, True)  # the experts' rows from the tokens (quantize_act_gathered)
sig = {"h_ptr": "*bf16", "da_ptr": "*bf16", "dh_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32"}
sig.update({n: "i32" for n in ("M", "I", "stride_hm", "stride_dam", "stride_dhm")})
consts = dict(QUANT=True, STORE_DH=False, POW2=False, EMULATE=False, BLOCK_R=fused.SWIGLU_BLOCK_R)
sig.update({n: "constexpr" for n in consts})
compile_(fused._swiglu_bwd_kernel, sig, consts, 4)  # the gate/up gradient's rows alone
print("compiled 7")
"""


def test_the_steps_quantization_kernels_compile_for_sm90_without_a_gpu():
    compile_for_sm90(_COMPILE_SCRIPT, 7)
