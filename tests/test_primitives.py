"""``linear``, ``grouped_linear`` and ``embedding`` against references that share none of their backward
code.

The references are plain ``torch.matmul`` and a per-expert loop of matmuls differentiated by torch's
own autograd (for ``embedding``, a one-hot matmul), and finite differences
(``torch.autograd.gradcheck``), all in float64. Each primitive
is checked both under plain autograd (its backward returns the weight gradient) and with W deferred
through ``fmoe.stage`` (its backward tapes the weight GEMM and ``backward_weight`` runs it), which
are different code paths for the weight gradient; so is the merge of several microbatches' expert
GEMMs into one (``merge_grouped_weight_grads``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import relative_error

from fmoe import stage as S
from fmoe.stages.primitives import (
    EmbeddingWeightGrad,
    embedding,
    grouped_linear,
    linear,
    merge_grouped_weight_grads,
)
from fmoe.stages.spec import Stage, StageContext

# float64 (eps 2^-53 = 1.1e-16) GEMMs whose every element sums at most ~20 products, computed in
# another order than the reference's: each result is within ~20 eps of |a| @ |b|; these random
# operands keep that well under 1e-13 of the result's norm (a 0.999 factor is 1e-3)
RTOL = 1e-13

# expert 0, 2 and 5 (the last) get no rows; 17 rows in all
OFFS = torch.tensor([0, 4, 4, 11, 17, 17], dtype=torch.int32)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def per_expert_loop(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The grouped GEMM by definition: rows offs[e-1]:offs[e] of x times w[e]^T, concatenated.
    x [n, k], w [E, m, k] -> [n, m]; plain torch ops, so autograd derives its backward."""
    starts = [0] + offs.tolist()[:-1]
    return torch.cat([x[s:e] @ w[i].T for i, (s, e) in enumerate(zip(starts, offs.tolist()))])


def autograd_grads(fn, inputs, dy):
    """d<fn(*inputs), dy>/d inputs by torch.autograd on fresh leaves."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    fn(*leaves).backward(dy)
    return [leaf.grad for leaf in leaves]


def deferred_grads(forward, x, w, dy):
    """(y, dx, dw) of a one-primitive stage run as F, B and a later W; asserts B left dw to W."""
    stage = Stage("s", lambda p, i, c: (forward(i[0], p["w"]),), ("s.w",), "s.")
    (y,), fwd = S.forward(stage, {"s.w": w}, (x,), StageContext())
    (dx,), work = S.backward_input(fwd, (dy,))
    assert work.partial == {} and len(work.tape.entries) == 1, "B must leave the weight GEMM to W"
    return y, dx, S.backward_weight(work)["s.w"]


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = relative_error(got, want)
    assert err <= RTOL, f"{what}: relative error {err}"


# ---------------------------------------------------------------------------------------------
# linear


def test_linear_forward_is_bitwise_the_matmul_and_its_gradients_equal_plain_autograd():
    x, w, dy = randn(2, 3, 8, seed=0), randn(6, 8, seed=1), randn(2, 3, 6, seed=2)
    assert torch.equal(linear(x, w), torch.matmul(x, w.T))
    want_dx, want_dw = autograd_grads(lambda a, b: torch.matmul(a, b.T), (x, w), dy)
    got_dx, got_dw = autograd_grads(linear, (x, w), dy)
    assert_close_rel(got_dx, want_dx, "dx")
    assert_close_rel(got_dw, want_dw, "dw")


def test_linear_with_w_deferred_through_fmoe_stage_equals_plain_autograd():
    x, w, dy = randn(2, 3, 8, seed=3), randn(6, 8, seed=4), randn(2, 3, 6, seed=5)
    want_dx, want_dw = autograd_grads(lambda a, b: torch.matmul(a, b.T), (x, w), dy)
    y, dx, dw = deferred_grads(linear, x, w, dy)
    assert torch.equal(y, torch.matmul(x, w.T))
    assert_close_rel(dx, want_dx, "dx")
    assert_close_rel(dw, want_dw, "dw")


def test_linear_passes_gradcheck_in_float64():
    x, w = randn(5, 4, seed=6).requires_grad_(), randn(3, 4, seed=7).requires_grad_()
    assert torch.autograd.gradcheck(linear, (x, w), eps=1e-6, atol=1e-9, rtol=1e-7)


# ---------------------------------------------------------------------------------------------
# embedding: rows 3 and 7 looked up several times, rows 2, 4, 5, 6 and 8 never

TOKENS = torch.tensor([[3, 0, 3, 7], [7, 3, 1, 3]])


def one_hot_lookup(tokens: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The lookup as a GEMM: one_hot(tokens) @ w, so autograd's gradient is one_hot^T @ dy."""
    return torch.nn.functional.one_hot(tokens, w.shape[0]).to(w.dtype) @ w


def test_embedding_forward_is_the_lookup_and_its_gradient_equals_a_one_hot_matmuls():
    w, dy = randn(9, 5, seed=40), randn(2, 4, 5, seed=41)
    assert torch.equal(embedding(TOKENS, w), w[TOKENS])
    (want,) = autograd_grads(lambda b: one_hot_lookup(TOKENS, b), (w,), dy)
    (got,) = autograd_grads(lambda b: embedding(TOKENS, b), (w,), dy)
    assert_close_rel(got, want, "dw")


def test_embedding_with_w_deferred_through_fmoe_stage_equals_a_one_hot_matmul():
    w, dy = randn(9, 5, seed=42), randn(2, 4, 5, seed=43)
    (want,) = autograd_grads(lambda b: one_hot_lookup(TOKENS, b), (w,), dy)
    y, dx, dw = deferred_grads(embedding, TOKENS.to(torch.int32), w, dy)
    assert torch.equal(y, w[TOKENS]) and dx is None  # integer tokens: no input gradient
    assert_close_rel(dw, want, "dw")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_an_embedding_gradient_added_in_place_has_the_bits_of_adding_the_whole_gradient(dtype, index_dtype):
    # 300 lookups of 4 of 11 rows: each row's sum of ~75 terms rounds differently if its terms are
    # added to the accumulator one at a time (a plain index_put_(accumulate=True) on bf16 does)
    gen = torch.Generator().manual_seed(44)
    rows = torch.tensor([9, 2, 5, 2], dtype=index_dtype)[torch.randint(0, 4, (300,), generator=gen)]
    dy = torch.randn(300, 6, generator=gen).to(dtype)
    grad = EmbeddingWeightGrad(rows, dy, 11)
    total = torch.randn(11, 6, generator=gen).to(dtype)
    looked_up, untouched = [2, 5, 9], [r for r in range(11) if r not in (2, 5, 9)]
    total[untouched[::2]] = -0.0  # an add of +0.0 would make these +0.0: only looked-up rows are written
    want = total.clone().add_(grad())
    got = total.clone()
    grad.accumulate_into(got)
    assert torch.equal(_bits(got[looked_up]), _bits(want[looked_up]))
    assert torch.equal(_bits(got[untouched]), _bits(total[untouched]))
    # a view laid out like the parameter inside a wider buffer (a parameter view's slice)
    wide = torch.randn(11, 9, generator=gen).to(dtype)
    region = wide[:, 2:8]
    region.copy_(total)
    grad.accumulate_into(region)
    assert torch.equal(_bits(region), _bits(got))
    EmbeddingWeightGrad(rows[:0], dy[:0], 11).accumulate_into(got)  # no lookups: nothing changes
    assert torch.equal(_bits(region), _bits(got))


# ---------------------------------------------------------------------------------------------
# grouped_linear, with empty expert groups (first, middle and last)


def test_grouped_linear_forward_and_gradients_equal_a_per_expert_loop_under_autograd():
    x, w, dy = randn(17, 8, seed=10), randn(6, 5, 8, seed=11), randn(17, 5, seed=12)
    assert_close_rel(grouped_linear(x, w, OFFS), per_expert_loop(x, w, OFFS), "y")
    want_dx, want_dw = autograd_grads(lambda a, b: per_expert_loop(a, b, OFFS), (x, w), dy)
    got_dx, got_dw = autograd_grads(lambda a, b: grouped_linear(a, b, OFFS), (x, w), dy)
    assert_close_rel(got_dx, want_dx, "dx")
    assert_close_rel(got_dw, want_dw, "dw")
    for e in (0, 2, 5):
        assert torch.equal(got_dw[e], torch.zeros_like(w[e])), f"expert {e} got no rows, so no gradient"


def test_grouped_linear_with_w_deferred_through_fmoe_stage_equals_a_per_expert_loop():
    x, w, dy = randn(17, 8, seed=13), randn(6, 5, 8, seed=14), randn(17, 5, seed=15)
    want_dx, want_dw = autograd_grads(lambda a, b: per_expert_loop(a, b, OFFS), (x, w), dy)
    y, dx, dw = deferred_grads(lambda a, b: grouped_linear(a, b, OFFS), x, w, dy)
    assert_close_rel(y, per_expert_loop(x, w, OFFS), "y")
    assert_close_rel(dx, want_dx, "dx")
    assert_close_rel(dw, want_dw, "dw")
    for e in (0, 2, 5):
        assert torch.equal(dw[e], torch.zeros_like(w[e])), f"expert {e} got no rows, so no gradient"


def test_merged_expert_weight_gradients_of_two_microbatches_equal_the_sum_of_per_expert_loops():
    """The runner's merge of a step's deferred expert GEMMs into one, against plain autograd."""
    w = randn(6, 5, 8, seed=16)
    offs_b = torch.tensor([3, 3, 9, 9, 12, 12], dtype=torch.int32)  # other experts empty than OFFS
    parts, want = [], torch.zeros_like(w)
    for i, offs in enumerate((OFFS, offs_b)):
        n = int(offs[-1])
        x, dy = randn(n, 8, seed=17 + 2 * i), randn(n, 5, seed=18 + 2 * i)
        want += autograd_grads(lambda a, b, o=offs: per_expert_loop(a, b, o), (x, w), dy)[1]
        stage = Stage("s", lambda p, inp, c, o=offs: (grouped_linear(inp[0], p["w"], o),), ("s.w",), "s.")
        _, fwd = S.forward(stage, {"s.w": w}, (x,), StageContext())
        _, work = S.backward_input(fwd, (dy,))
        later: dict = {}
        assert S.backward_weight(work, merge_later=later) == {}
        parts += later["s.w"]
    assert len(parts) == 2
    merged = merge_grouped_weight_grads(parts)
    assert_close_rel(merged, want, "merged dW")
    assert torch.equal(merged[5], torch.zeros_like(w[5])), "expert 5 got no rows in either microbatch"


def test_grouped_linear_with_no_rows_at_all_gives_zero_gradients():
    x, w = randn(0, 8, seed=20), randn(3, 5, 8, seed=21)
    offs = torch.zeros(3, dtype=torch.int32)
    dx, dw = autograd_grads(
        lambda a, b: grouped_linear(a, b, offs), (x, w), torch.zeros(0, 5, dtype=torch.float64)
    )
    assert dx.shape == (0, 8) and torch.equal(dw, torch.zeros_like(w))


@pytest.mark.parametrize(
    "offs", [OFFS, torch.tensor([0, 17, 17, 17, 17, 17], dtype=torch.int32)], ids=["mixed", "one_expert"]
)
def test_grouped_linear_passes_gradcheck_in_float64(offs):
    x, w = randn(17, 4, seed=22).requires_grad_(), randn(6, 3, 4, seed=23).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b: grouped_linear(a, b, offs), (x, w), eps=1e-6, atol=1e-9, rtol=1e-7
    )
