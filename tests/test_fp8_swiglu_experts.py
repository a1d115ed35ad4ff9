"""The fused FP8 SwiGLU experts (``primitives.fp8_swiglu_experts``): one Function for
``grouped_linear(swiglu(grouped_linear(x, gate_up_w)), down_w)`` that hands FP8 operands from the
kernel that makes the values to the GEMM that reads them. Its output, input gradient and both weight
gradients are bitwise those of the composition with the fused SwiGLU (deferred or not, inputs cached
or not, W in FP8 or bf16), it quantizes two activations along rows where the composition quantizes
four, and its four GEMMs walk one tile map where the composition builds four.

Run on CPU tensors through the kernels' plain-torch references and through the Triton kernels under
the interpreter; tests/test_cuda.py runs them compiled, at the Qwen3 expert shape.
"""

from __future__ import annotations

import pytest
import torch

from fmoe import stage as S
from fmoe.kernels import _triton, fp8_gemm, fp8_linear, fp8_quant
from fmoe.stages import layers, primitives
from fmoe.stages.primitives import GroupedWeightGrad, fp8_training, grouped_linear
from fmoe.stages.recompute import recompute_outputs
from fmoe.stages.spec import Stage, StageContext

COUNTS = [300, 0, 190, 278]  # an empty expert; ragged ones; 768 rows (few enough padded tiles to cache)


def _use(backend: str, monkeypatch) -> None:
    """The FP8 kernels' plain-torch references, or the Triton kernels interpreted on the CPU."""
    if backend == "triton":
        assert _triton.HAS_TRITON and _triton.interpreting(), (
            "the test extra installs triton; conftest interprets"
        )
    monkeypatch.setenv("FMOE_KERNEL_BACKEND", backend)


@pytest.fixture
def calls(monkeypatch):
    """Row quantizations (their widths) and tile maps (their tile sizes) while a test runs."""
    seen = {"rows": [], "maps": []}
    real_rows, real_map = fp8_linear.quantize_act, fp8_gemm.tile_map

    def rows(x, **kw):
        seen["rows"].append(x.shape[1])
        return real_rows(x, **kw)

    def maps(offs, rows, tile):
        seen["maps"].append(tile)
        return real_map(offs, rows, tile)

    monkeypatch.setattr(fp8_linear, "quantize_act", rows)  # the GEMMs' own quantization of an operand
    monkeypatch.setattr(fp8_quant, "quantize_act", rows)  # the Functions' (dy's rows, which W also reads)
    monkeypatch.setattr(fp8_gemm, "tile_map", maps)
    return seen


def _composed(x, w1, w2, offs):
    # the composition with the fused SwiGLU (the kernel CUDA runs; on the CPU layers.swiglu is torch's),
    # the down GEMM's W on the FP8 rows of SwiGLU's output, as layers.expert_mlp composes it
    return grouped_linear(layers._FusedSwiGLU.apply(grouped_linear(x, w1, offs)), w2, offs, w_reads_rows=True)


def _inputs(hidden=256, inter=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    n, E = sum(COUNTS), len(COUNTS)
    x = torch.randn(n, hidden, generator=gen).bfloat16()
    w1 = (torch.randn(E, 2 * inter, hidden, generator=gen) * 0.05).bfloat16()
    w2 = (torch.randn(E, hidden, inter, generator=gen) * 0.05).bfloat16()
    dy = torch.randn(n, hidden, generator=gen).bfloat16()
    return x, w1, w2, offs, dy


def _run(fn, x, w1, w2, offs, dy, deferred: bool):
    """(y, dx, dw1, dw2, the W entries' (weight name, kind of x)) of ``fn`` as a stage, or under autograd."""
    if deferred:
        stage = Stage(
            "ex", lambda p, i, c, fn=fn: (fn(i[0] * 1, p["w1"], p["w2"], offs),), ("e.w1", "e.w2"), "e."
        )
        params = {"e.w1": w1, "e.w2": w2}
        (y,), fwd = S.forward(stage, params, (x,), StageContext())
        (dx,), work = S.backward_input(fwd, (dy,))
        names = {tuple(w.shape): n for n, w in params.items()}  # F's leaves are its own tensors
        entries = [(names[tuple(w.shape)], type(c.x).__name__, c.fp8) for w, c in work.tape.entries]
        assert all(isinstance(c, GroupedWeightGrad) for _, c in work.tape.entries)
        grads = S.backward_weight(work)
        return y, dx, grads["e.w1"], grads["e.w2"], entries
    xl, w1l, w2l = (t.clone().requires_grad_() for t in (x, w1, w2))
    y = fn(xl * 1, w1l, w2l, offs)  # made in F, as in the stage: cacheable
    y.backward(dy)
    return y, xl.grad, w1l.grad, w2l.grad, None


# (backend, deferred, cache, fp8_wgrad): every case on the references, two interpreted (slow)
CASES = [("torch", d, c, f) for d in (True, False) for c in (False, True) for f in (True, False)] + [
    ("triton", True, False, True),
    ("triton", True, True, True),
]


@pytest.mark.parametrize("backend,deferred,cache,fp8_wgrad", CASES)
def test_fused_experts_give_the_bits_of_the_composition(
    calls, monkeypatch, backend, deferred, cache, fp8_wgrad
):
    _use(backend, monkeypatch)
    x, w1, w2, offs, dy = _inputs()
    out, counted = {}, {}
    for name, fn in (("composed", _composed), ("fused", primitives.fp8_swiglu_experts)):
        calls["rows"].clear(), calls["maps"].clear()
        with fp8_training(True, expert_wgrad=fp8_wgrad, cache_expert_inputs=cache):
            out[name] = _run(fn, x, w1, w2, offs, dy, deferred)
        counted[name] = (list(calls["rows"]), list(calls["maps"]))
    for got, want, what in zip(out["fused"], out["composed"], ("y", "dx", "dw_gate_up", "dw_down", "W")):
        assert got == want if what == "W" else torch.equal(got, want), what
    if deferred:  # B runs down's then up's: W gets them in that order; x cached where caching is on,
        # a's FP8 rows with FP8 weight gradients (cached or not: its rows are smaller), else a
        x_kind = "Fp8ActT" if cache and fp8_wgrad else "Tensor"
        a_kind = "Fp8Act" if fp8_wgrad else "Tensor"
        assert out["fused"][4] == [("e.w2", a_kind, fp8_wgrad), ("e.w1", x_kind, fp8_wgrad)]
    # rows quantized by a kernel of their own: dy's (256 wide) and, not cached, x's; SwiGLU and its
    # backward write a's and the gate/up gradient's FP8 rows themselves, where the composition
    # quantizes them (a: 128 wide; the gate/up gradient: 256)
    cached = cache and fp8_wgrad
    assert sorted(counted["fused"][0]) == ([256] if cached else [256, 256])
    assert sorted(counted["composed"][0]) == ([128, 256, 256] if cached else [128, 256, 256, 256])
    if backend == "triton":  # the forward / input-gradient GEMMs share one map (the W GEMMs are not these)
        tile = fp8_gemm.INTERPRET_CONFIG.block_m
        assert counted["fused"][1].count(tile) == 1 and counted["composed"][1].count(tile) == 4


@pytest.mark.parametrize("backend,fp8_wgrad", [("torch", True), ("torch", False), ("triton", True)])
def test_fused_experts_on_fp32_master_weights_give_the_compositions_bits_and_bf16_gradients(
    monkeypatch, backend, fp8_wgrad
):
    # what an FP8 trainer step hands over (fp8_mode.quantized_from_master): the experts' fp32 masters,
    # quantized from fp32; W's gradients still come out in the compute dtype (dy's), as the cast
    # weights' do, and differ from theirs (one rounding of the weights, not two)
    _use(backend, monkeypatch)
    x, w1, w2, offs, dy = _inputs()
    g = torch.Generator().manual_seed(5)
    w1, w2 = (w.float() + torch.randn(w.shape, generator=g) * 1e-4 for w in (w1, w2))  # not bf16 values
    out = {}
    for name, fn, weights in (
        ("composed", _composed, (w1, w2)),
        ("fused", primitives.fp8_swiglu_experts, (w1, w2)),
        ("fused_bf16", primitives.fp8_swiglu_experts, (w1.bfloat16(), w2.bfloat16())),
    ):
        with fp8_training(True, expert_wgrad=fp8_wgrad):
            out[name] = _run(fn, x, *weights, offs, dy, deferred=True)
    for got, want, what in zip(out["fused"], out["composed"], ("y", "dx", "dw_gate_up", "dw_down", "W")):
        assert got == want if what == "W" else torch.equal(got, want), what
    y, dx, dw1, dw2, _ = out["fused"]
    assert y.dtype == dx.dtype == dw1.dtype == dw2.dtype == torch.bfloat16
    assert not torch.equal(y, out["fused_bf16"][0]), "the weights must be quantized from fp32 itself"


def _gathered_inputs(top_k=2, seed=3, counts=COUNTS):
    """Tokens [T, H] and a routing whose slots, grouped by expert (dispatch's stable order), give
    ``counts``' ragged experts (COUNTS: an empty one included): (tokens, order [T*k] int64, offs
    [E] int32)."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(counts)
    ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    ids = ids[torch.randperm(n, generator=gen)]  # each slot's expert, slots in token order
    order, offs = layers.expert_order(ids.view(-1, top_k), len(counts))
    tokens = torch.randn(n // top_k, 256, generator=gen).bfloat16()
    return tokens, order, offs


# (backend, deferred, fp8_wgrad, merged): the references everywhere, the interpreted kernels once
GATHERED_CASES = [("torch", d, f, m) for d in (True, False) for f in (True, False) for m in (False, True)]
GATHERED_CASES += [("triton", True, True, True)]


@pytest.mark.parametrize("backend,deferred,fp8_wgrad,merged", GATHERED_CASES)
def test_gathered_experts_give_the_bits_of_the_experts_on_the_permuted_rows(
    monkeypatch, backend, deferred, fp8_wgrad, merged
):
    # fp8_swiglu_experts(tokens, order=...) against the same Function on permute_rows(tokens), its
    # output put back by unpermute_rows: the slot-ordered output, the tokens' gradient and both
    # weight gradients bitwise, W run alone or merged with another micro-batch's (the merged
    # quantization reads the tokens and dy where they lie); its W entries keep the tokens and the
    # slot-ordered output gradient with row indices, not gathered copies
    _use(backend, monkeypatch)
    tokens, order, offs = _gathered_inputs()
    _, w1, w2, _, dy = _inputs()
    k = order.shape[0] // tokens.shape[0]

    def permuted(x, a, b, o):
        rows = primitives.fp8_swiglu_experts(layers.permute_rows(x, order, k), a, b, o)
        return layers.unpermute_rows(rows, order, k).flatten(0, 1)

    def gathered(x, a, b, o):
        return primitives.fp8_swiglu_experts(x, a, b, o, order=order, top_k=k)

    out = {}
    for name, fn in (("permuted", permuted), ("gathered", gathered)):
        with fp8_training(True, expert_wgrad=fp8_wgrad):
            if not deferred:
                out[name] = _run(fn, tokens, w1, w2, offs, dy, False)[:4]
                continue
            stage = Stage(
                "ex", lambda p, i, c, fn=fn: (fn(i[0] * 1, p["w1"], p["w2"], offs),), ("e.w1", "e.w2"), "e."
            )
            params = {"e.w1": w1, "e.w2": w2}
            (y,), fwd = S.forward(stage, params, (tokens,), StageContext())
            (dx,), work = S.backward_input(fwd, (dy,))
            (_, down), (_, up) = work.tape.entries
            if name == "gathered":  # W keeps the tokens with row indices, and of dy: in FP8, the rows
                # its input gradient read (in expert order), else the slot-ordered dy with row indices
                assert up.x.shape == tokens.shape and torch.equal(up.x_rows.long(), order // k)
                if fp8_wgrad:
                    assert isinstance(down.dy, fp8_quant.Fp8Act) and down.dy_rows is None
                    assert isinstance(up.dy, fp8_quant.Fp8Act)
                else:
                    assert down.dy.data_ptr() == dy.data_ptr() and torch.equal(down.dy_rows.long(), order)
            if merged:  # this micro-batch's W with another's (the same entries twice): one GEMM
                grads = [primitives.merge_grouped_weight_grads([c, c]) for _, c in work.tape.entries]
            else:
                grads = [c() for _, c in work.tape.entries]
            out[name] = (y, dx, grads[1], grads[0])
    for got, want, what in zip(out["gathered"], out["permuted"], ("y", "dx", "dw_gate_up", "dw_down")):
        assert torch.equal(got, want), what
    assert out["gathered"][1].shape == tokens.shape


@pytest.mark.parametrize("backend,fp8_wgrad", [("torch", True), ("torch", False), ("triton", True)])
def test_gathered_experts_merged_over_unlike_micro_batches_give_the_bits_of_the_permuted_ones(
    monkeypatch, backend, fp8_wgrad
):
    # two micro-batches of other token counts and routings (a part's row indices must not be read
    # against another part's tokens, which a merge of one micro-batch with itself cannot show):
    # their W entries merged give bitwise the merge of the permuted experts' entries
    _use(backend, monkeypatch)
    _, w1, w2, _, _ = _inputs()
    batches = [_gathered_inputs(seed=3), _gathered_inputs(seed=4, counts=[64, 250, 0, 200])]
    gen = torch.Generator().manual_seed(5)
    grads_out = [torch.randn(o.shape[0], 256, generator=gen).bfloat16() for _, o, _ in batches]
    merged = {}
    for name in ("permuted", "gathered"):
        entries = []
        for (tokens, order, offs), dy in zip(batches, grads_out):
            k = order.shape[0] // tokens.shape[0]

            def experts(x, a, b, o, order=order, k=k, gathered=name == "gathered"):
                if gathered:
                    return primitives.fp8_swiglu_experts(x, a, b, o, order=order, top_k=k)
                rows = primitives.fp8_swiglu_experts(layers.permute_rows(x, order, k), a, b, o)
                return layers.unpermute_rows(rows, order, k).flatten(0, 1)

            stage = Stage(
                "ex",
                lambda p, i, c, f=experts, o=offs: (f(i[0] * 1, p["w1"], p["w2"], o),),
                ("e.w1", "e.w2"),
                "e.",
            )
            with fp8_training(True, expert_wgrad=fp8_wgrad):
                _, fwd = S.forward(stage, {"e.w1": w1, "e.w2": w2}, (tokens,), StageContext())
                _, work = S.backward_input(fwd, (dy,))
            entries.append([c for _, c in work.tape.entries])  # down's, then up's
        if name == "gathered":
            assert all(e[1].x_rows is not None and (fp8_wgrad or e[0].dy_rows is not None) for e in entries)
        merged[name] = [primitives.merge_grouped_weight_grads([e[j] for e in entries]) for j in (0, 1)]
    for got, want, what in zip(merged["gathered"], merged["permuted"], ("dw_down", "dw_gate_up")):
        assert torch.equal(got, want), what


def test_gathered_experts_refuse_an_order_of_another_length():
    tokens, order, offs = _gathered_inputs()
    _, w1, w2, _, _ = _inputs()
    with fp8_training(True), pytest.raises(ValueError, match=r"order \(767,\) is not \[tokens \* top_k\]"):
        primitives.fp8_swiglu_experts(tokens, w1, w2, offs, order=order[:-1], top_k=2)


def test_a_map_of_other_tiles_or_rows_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("FMOE_KERNEL_BACKEND", "triton")
    x, w1, _, offs, _ = _inputs()
    w_fp8 = fp8_quant.quantize_weight(w1)
    rows = fp8_quant.quantize_act(x)
    good = fp8_gemm.nt_tile_map(offs, x.shape[0])
    want = fp8_gemm.fp8_gemm_nt(rows, w_fp8.data, w_fp8.scale, offs)
    assert torch.equal(fp8_gemm.fp8_gemm_nt(rows, w_fp8.data, w_fp8.scale, offs, tiles=good), want)
    for bad in (fp8_quant.tile_map(offs, x.shape[0], 128), fp8_gemm.nt_tile_map(offs, 2 * x.shape[0])):
        with pytest.raises(ValueError, match="tiles: a map of"):
            fp8_gemm.fp8_gemm_nt(rows, w_fp8.data, w_fp8.scale, offs, tiles=bad)


def test_the_fused_experts_apply_only_where_both_gemms_are_fp8_and_nothing_recomputes():
    x, w1, w2, _, _ = _inputs()
    assert not primitives.fuses_fp8_swiglu_experts(x, w1, w2)  # outside fp8_training
    with fp8_training(True):
        assert primitives.fuses_fp8_swiglu_experts(x, w1, w2)
        # inter 64: the down GEMM's K is not a multiple of 128, it stays bf16
        assert not primitives.fuses_fp8_swiglu_experts(x, w1[:, :128], w2[:, :, :64])
        with recompute_outputs():  # selective recomputation remakes SwiGLU's output: the composition
            assert not primitives.fuses_fp8_swiglu_experts(x, w1, w2)
            with pytest.raises(ValueError, match="fp8_swiglu_experts: needs both GEMMs in FP8"):
                primitives.fp8_swiglu_experts(x, w1, w2, torch.tensor([768] * 4, dtype=torch.int32))


@pytest.mark.parametrize("fp8_wgrad", [True, False])
def test_the_plan_counts_what_w_keeps_of_the_gathered_experts(monkeypatch, fp8_wgrad):
    # plan_activations.expert_weight_grad_bytes (the tokens, SwiGLU's output, and the output gradients:
    # their FP8 rows with FP8 weight gradients, else bf16) against the bytes the W entries of one
    # micro-batch hold; the bf16 dy given to B is W's own only in bf16 (FP8: B's rows of it)
    from types import SimpleNamespace

    from fmoe.plan_activations import MicroBatch, expert_weight_grad_bytes

    _use("torch", monkeypatch)
    tokens, order, offs = _gathered_inputs()
    _, w1, w2, _, dy = _inputs()
    k = order.shape[0] // tokens.shape[0]
    stage = Stage(
        "ex",
        lambda p, i, c: (
            primitives.fp8_swiglu_experts(i[0] * 1, p["w1"], p["w2"], offs, order=order, top_k=k),
        ),
        ("e.w1", "e.w2"),
        "e.",
    )
    with fp8_training(True, expert_wgrad=fp8_wgrad):
        _, fwd = S.forward(stage, {"e.w1": w1, "e.w2": w2}, (tokens,), StageContext())
        _, work = S.backward_input(fwd, (dy,))
    held = {}
    for _, c in work.tape.entries:
        for t in (c.x, c.dy):
            for part in (t.data, t.scale) if isinstance(t, fp8_quant.Fp8Act) else (t,):
                held[part.data_ptr()] = part.numel() * part.element_size()
    cfg = SimpleNamespace(num_experts_per_tok=k, hidden_size=256, moe_intermediate_size=128)
    mb = MicroBatch(1, tokens.shape[0], tokens.shape[0], 2, "cuda")
    assert sum(held.values()) == expert_weight_grad_bytes("qwen3_moe", cfg, mb, False, fp8_wgrad)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_merging_past_the_gathered_parts_copies_the_fp8_rows_with_the_same_bits(monkeypatch, backend):
    # more micro-batches than one gathered quantization reads (GATHER_MAX_PARTS, here 1): the W
    # entries' FP8 output-gradient rows are copied, bits and scales, into one Fp8Act, then
    # requantized: the bits of the gathered merge
    _use(backend, monkeypatch)
    _, w1, w2, _, _ = _inputs()
    gen = torch.Generator().manual_seed(7)
    entries = []
    for seed, counts in ((3, COUNTS), (4, [64, 250, 0, 200]), (6, [10, 0, 300, 90])):
        tokens, order, offs = _gathered_inputs(seed=seed, counts=counts)
        dy = torch.randn(order.shape[0], 256, generator=gen).bfloat16()
        stage = Stage(
            "ex",
            lambda p, i, c, o=offs, r=order: (
                primitives.fp8_swiglu_experts(i[0] * 1, p["w1"], p["w2"], o, order=r, top_k=2),
            ),
            ("e.w1", "e.w2"),
            "e.",
        )
        with fp8_training(True):
            _, fwd = S.forward(stage, {"e.w1": w1, "e.w2": w2}, (tokens,), StageContext())
            _, work = S.backward_input(fwd, (dy,))
        entries.append([c for _, c in work.tape.entries])
    assert all(isinstance(c.dy, fp8_quant.Fp8Act) for e in entries for c in e)
    gathered = [primitives.merge_grouped_weight_grads([e[j] for e in entries]) for j in (0, 1)]
    monkeypatch.setattr(fp8_quant, "GATHER_MAX_PARTS", 1)
    copied = [primitives.merge_grouped_weight_grads([e[j] for e in entries]) for j in (0, 1)]
    for got, want, what in zip(copied, gathered, ("dw_down", "dw_gate_up")):
        assert torch.equal(got, want), what


@pytest.mark.parametrize("need", ["x", "weights", "down", "up"])
@pytest.mark.parametrize("fp8_wgrad", [True, False])
def test_fused_experts_give_the_composition_bits_for_each_gradient_asked(monkeypatch, need, fp8_wgrad):
    # under plain autograd, only some inputs asking for gradients: B quantizes dy's rows for down's
    # W even when no input gradient is asked, and skips what nobody reads
    _use("torch", monkeypatch)
    x, w1, w2, offs, dy = _inputs()
    asks = {"x": (True, False, False), "weights": (False, True, True), "down": (False, False, True),
            "up": (False, True, False)}[need]  # fmt: skip
    out = {}
    for name, fn in (("composed", _composed), ("fused", primitives.fp8_swiglu_experts)):
        xl, w1l, w2l = (t.clone().requires_grad_(a) for t, a in zip((x, w1, w2), asks))
        with fp8_training(True, expert_wgrad=fp8_wgrad):
            y = fn(xl * 1 if asks[0] else xl, w1l, w2l, offs)
            y.backward(dy)
        out[name] = [t.grad for t in (xl, w1l, w2l)]
    for got, want, asked in zip(out["fused"], out["composed"], asks):
        assert (got is None) == (not asked) and (got is None or torch.equal(got, want))


def test_an_fp8_output_gradient_needs_fp8_its_dtype_and_no_row_indices():
    x, _, _, offs, dy = _inputs()
    rows = fp8_quant.quantize_act(dy)
    with pytest.raises(ValueError, match="GroupedWeightGrad: a dy quantized in FP8"):
        GroupedWeightGrad(x, rows, offs, len(COUNTS), fp8=True)  # no out_dtype
    with pytest.raises(ValueError, match="GroupedWeightGrad: a dy quantized in FP8"):
        GroupedWeightGrad(x, rows, offs, len(COUNTS), out_dtype=torch.bfloat16)  # not fp8
    with pytest.raises(ValueError, match="GroupedWeightGrad: a dy quantized in FP8"):
        GroupedWeightGrad(x, rows, offs, len(COUNTS), fp8=True, out_dtype=torch.bfloat16, dy_rows=offs)


def test_an_x_of_fp8_rows_needs_fp8_and_no_row_indices_and_merges_only_with_its_kind():
    x, _, _, offs, dy = _inputs()
    rows = fp8_quant.quantize_act(x)
    with pytest.raises(ValueError, match="GroupedWeightGrad: an x of FP8 rows"):
        GroupedWeightGrad(rows, dy, offs, len(COUNTS), out_dtype=torch.bfloat16)  # not fp8
    with pytest.raises(ValueError, match="GroupedWeightGrad: an x of FP8 rows"):
        GroupedWeightGrad(rows, dy, offs, len(COUNTS), fp8=True, x_rows=offs)
    as_rows = GroupedWeightGrad(rows, dy, offs, len(COUNTS), fp8=True)
    as_bf16 = GroupedWeightGrad(x, dy, offs, len(COUNTS), fp8=True)
    with pytest.raises(ValueError, match="parts differ in .* x's form"):
        primitives.merge_grouped_weight_grads([as_rows, as_bf16])


def test_the_plan_counts_fp8_rows_only_for_the_expert_gemms_that_run_in_fp8(monkeypatch):
    # an expert width of 192: gate/up ([E, 384, 256]) runs in FP8 and keeps its output gradient's FP8
    # rows for W, down ([E, 256, 192]) does not (192 is no multiple of 128) and keeps dy in bf16; the
    # composition (no fused experts then) copies the rows, so W keeps them, not the tokens
    from types import SimpleNamespace

    from fmoe.plan_activations import MicroBatch, expert_weight_grad_bytes

    _use("torch", monkeypatch)
    x, _, _, offs, dy = _inputs()
    gen = torch.Generator().manual_seed(9)
    w1 = (torch.randn(len(COUNTS), 384, 256, generator=gen) * 0.05).bfloat16()
    w2 = (torch.randn(len(COUNTS), 256, 192, generator=gen) * 0.05).bfloat16()
    stage = Stage(
        "ex", lambda p, i, c: (_composed(i[0] * 1, p["w1"], p["w2"], offs),), ("e.w1", "e.w2"), "e."
    )
    with fp8_training(True):
        assert not primitives.fuses_fp8_swiglu_experts(x, w1, w2)
        _, fwd = S.forward(stage, {"e.w1": w1, "e.w2": w2}, (x,), StageContext())
        _, work = S.backward_input(fwd, (dy,))
    (_, down), (_, up) = work.tape.entries
    assert isinstance(up.dy, fp8_quant.Fp8Act) and isinstance(down.dy, torch.Tensor)
    held = {}
    for _, c in work.tape.entries:
        for t in (c.x, c.dy):
            for part in (t.data, t.scale) if isinstance(t, fp8_quant.Fp8Act) else (t,):
                held[part.data_ptr()] = part.numel() * part.element_size()
    k = 2  # the rows are k T: T = rows / k
    cfg = SimpleNamespace(num_experts_per_tok=k, hidden_size=256, moe_intermediate_size=192)
    mb = MicroBatch(1, x.shape[0] // k, x.shape[0] // k, 2, "cpu")
    assert sum(held.values()) == expert_weight_grad_bytes("qwen3_moe", cfg, mb, True, True)
