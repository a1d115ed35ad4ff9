"""The sequential runner against plain autograd; user-defined stages; deferred W; bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_runner_matches_autograd, random_batch, tiny_config

from fmoe import runner
from fmoe import stage as S
from fmoe.stages import qwen3_moe
from fmoe.stages.primitives import ACCUMULATES_IN_PLACE, linear
from fmoe.stages.spec import CustomGrad, Stage, StageContext


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("tie", [False, True])
def test_tiny_model_runner_loss_bitwise_equals_autograd_and_grads_match(tie):
    cfg = tiny_config(num_hidden_layers=3, mlp_only_layers=(0,), tie_word_embeddings=tie)
    model = qwen3_moe.build(cfg)
    assert_runner_matches_autograd(model, model.init(seed=3), random_batch(cfg, 4, 8))


def test_aux_loss_gradient_reaches_the_router():
    cfg = tiny_config(router_aux_loss_coef=0.5)
    model = qwen3_moe.build(cfg)
    params = model.init(seed=0)
    batch = random_batch(cfg, 2, 8)
    with_aux = runner.run_sequential(model, params, batch).grads["model.layers.1.mlp.gate.weight"]
    model_off = qwen3_moe.build(tiny_config(router_aux_loss_coef=0.0))
    without = runner.run_sequential(model_off, params, batch).grads["model.layers.1.mlp.gate.weight"]
    assert relative_error(with_aux, without) > 1e-3


def gelu_mlp(p, inputs, ctx):
    """A stage written in a test with plain torch ops and no fmoe primitives."""
    (x,) = inputs
    return (F.gelu(x @ p["w1"].t() + p["b1"]) @ p["w2"].t(),)


def gelu_mlp_with_primitives(p, inputs, ctx):
    (x,) = inputs
    return (linear(F.gelu(linear(x, p["w1"]) + p["b1"]), p["w2"]),)


@pytest.mark.parametrize("fn", [gelu_mlp, gelu_mlp_with_primitives])
def test_a_stage_defined_in_a_test_gets_b_and_w_with_no_extra_code(fn):
    gen = torch.Generator().manual_seed(0)
    params = {
        "mlp.w1": torch.randn(16, 8, generator=gen, dtype=torch.float64),
        "mlp.b1": torch.randn(16, generator=gen, dtype=torch.float64),
        "mlp.w2": torch.randn(8, 16, generator=gen, dtype=torch.float64),
    }
    stage = Stage("gelu", fn, tuple(params), prefix="mlp.")
    x = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    dy = torch.randn(5, 8, generator=gen, dtype=torch.float64)

    (y,), fwd = S.forward(stage, params, (x,), StageContext())
    (dx,), work = S.backward_input(fwd, (dy,))
    grads = S.backward_weight(work)

    leaves = {n: t.clone().requires_grad_() for n, t in params.items()}
    xr = x.clone().requires_grad_()
    (yr,) = S.call(stage, leaves, (xr,), StageContext())
    torch.testing.assert_close(y, yr.detach(), rtol=0, atol=0)
    gx, *gp = torch.autograd.grad(yr, [xr, *leaves.values()], dy)
    torch.testing.assert_close(dx, gx, rtol=1e-12, atol=1e-12)
    for (name, _), g in zip(leaves.items(), gp):
        torch.testing.assert_close(grads[name], g, rtol=1e-12, atol=1e-12)
    # torch.func applies to the same pure stage function directly
    gfunc = torch.func.grad(lambda p: (fn(p, (x,), StageContext())[0] * dy).sum())(
        {k[4:]: v for k, v in params.items()}
    )
    torch.testing.assert_close(grads["mlp.w1"], gfunc["w1"], rtol=1e-12, atol=1e-12)


def test_deferred_w_in_any_order_gives_the_plain_gradients():
    cfg = tiny_config()
    model = qwen3_moe.build(cfg)
    params = model.init(seed=5)
    mb0, mb1 = runner.split_microbatches(random_batch(cfg, 4, 6), 2)

    plain = runner.run_sequential(
        model, params, {k: torch.cat([mb0[k], mb1[k]]) for k in ("tokens", "labels")}, 2
    )

    fwd0, loss0 = runner.forward_microbatch(model, params, mb0, StageContext(microbatch=0))
    fwd1, loss1 = runner.forward_microbatch(model, params, mb1, StageContext(microbatch=1))
    works1 = runner.backward_microbatch(fwd1, 0.5)
    works0 = runner.backward_microbatch(fwd0, 0.5)
    grads: dict[str, torch.Tensor] = {}
    runner.accumulate(grads, runner.weight_grads(works0))
    runner.accumulate(grads, runner.weight_grads(works1))
    grads = runner.zero_missing(grads, params, model.param_names())

    assert torch.equal(runner.mean_loss([loss0, loss1]), plain.loss)
    for name in params:
        torch.testing.assert_close(grads[name], plain.grads[name], rtol=1e-6, atol=1e-7)


def test_w_accumulates_dense_weight_gemms_in_place_into_the_callers_gradients():
    # W of the second microbatch adds its dense weight GEMMs (addmm_, beta = 1) and its embedding
    # (the rows looked up) into the accumulator the first one made: same tensors, same values as
    # a separate gradient and add
    cfg = tiny_config()
    model = qwen3_moe.build(cfg)
    params = model.init(seed=6)
    mb0, mb1 = runner.split_microbatches(random_batch(cfg, 4, 6), 2)
    works = [
        runner.backward_microbatch(
            runner.forward_microbatch(model, params, mb, StageContext(microbatch=i))[0], 0.5
        )
        for i, mb in enumerate((mb0, mb1))
    ]
    separate = runner.weight_grads(works[0])
    second = runner.weight_grads(works[1])
    want = {n: separate[n] + second[n] if n in second else separate[n] for n in separate}
    works = [
        runner.backward_microbatch(
            runner.forward_microbatch(model, params, mb, StageContext(microbatch=i))[0], 0.5
        )
        for i, mb in enumerate((mb0, mb1))
    ]
    acc: dict[str, torch.Tensor] = {}
    assert runner.weight_grads(works[0], into=acc) is acc
    first = dict(acc)
    taped = {
        n
        for w in works[1]
        for weight, c in w.tape.entries
        if isinstance(c, ACCUMULATES_IN_PLACE)
        for n in [w.names[id(weight)]]
    }
    assert "lm_head.weight" in taped and any(n.endswith("q_proj.weight") for n in taped)
    assert "model.embed_tokens.weight" in taped
    runner.weight_grads(works[1], into=acc)
    assert set(acc) == set(want)
    for n in taped:
        assert acc[n] is first[n], n  # added in place, no new tensor
    for n in want:
        torch.testing.assert_close(acc[n], want[n], rtol=1e-12, atol=1e-12)
    # the embedding's rows: summed as its whole gradient sums them, then added once
    assert torch.equal(acc["model.embed_tokens.weight"], want["model.embed_tokens.weight"])


def test_hand_written_b_and_w_agree_with_the_derived_ones():
    """A stage may register its own B/W (FP8 layers do); here a hand-written linear+tanh."""

    def fwd(p, inputs, ctx):
        (x,) = inputs
        return (torch.tanh(x @ p["w"].t()),)

    def custom_forward(p, inputs, ctx):
        (x,) = inputs
        y = torch.tanh(x @ p["w"].t())
        return (y,), (x, y)

    def custom_backward_input(p, saved, grad_outputs):
        x, y = saved
        (dy,) = grad_outputs
        dz = dy * (1 - y * y)
        return (dz @ p["w"],), (x, dz)

    def custom_backward_weight(p, saved):
        x, dz = saved
        return {"w": dz.t() @ x}

    custom = CustomGrad(custom_forward, custom_backward_input, custom_backward_weight)
    gen = torch.Generator().manual_seed(0)
    params = {"l.w": torch.randn(6, 4, generator=gen, dtype=torch.float64)}
    x = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    dy = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    results = []
    for stage in (Stage("derived", fwd, ("l.w",), "l."), Stage("hand", fwd, ("l.w",), "l.", custom=custom)):
        (y,), f = S.forward(stage, params, (x,), StageContext())
        (dx,), work = S.backward_input(f, (dy,))
        results.append((y, dx, S.backward_weight(work)["l.w"]))
    for derived, hand in zip(*results):
        torch.testing.assert_close(hand, derived, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# bad input


def test_a_stage_returning_a_non_tensor_is_named():
    stage = Stage("broken", lambda p, x, c: (x[0], "oops"))
    with pytest.raises(S.StageError, match=r"stage 'broken' returned str at output 1"):
        S.forward(stage, {}, (torch.ones(2),), StageContext())


def test_a_params_dict_missing_a_key_is_named():
    cfg = tiny_config()
    model = qwen3_moe.build(cfg)
    params = model.init()
    del params["model.layers.1.mlp.experts.down_proj"]
    with pytest.raises(S.StageError, match=r"layers\.1\.mlp.*model\.layers\.1\.mlp\.experts\.down_proj"):
        runner.run_sequential(model, params, random_batch(cfg, 2, 4))


def test_a_stage_reading_an_undeclared_param_is_named():
    stage = Stage("reader", lambda p, x, c: (x[0] * p["scale"],), ("blk.bias",), prefix="blk.")
    with pytest.raises(S.StageError, match=r"stage 'reader' reads params\['scale'\].*'blk\.scale'"):
        S.forward(stage, {"blk.bias": torch.ones(1)}, (torch.ones(2),), StageContext())


def test_heads_not_dividing_hidden_size_is_refused():
    with pytest.raises(ValueError, match=r"num_attention_heads \(5\) must divide hidden_size \(32\)"):
        tiny_config(num_attention_heads=5, num_key_value_heads=1, head_dim=None)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) must divide num_attention_heads \(4\)"):
        tiny_config(num_key_value_heads=3)


def test_top_k_larger_than_the_experts_is_refused():
    with pytest.raises(
        ValueError, match=r"num_experts_per_tok \(9\) must be between 1 and num_experts \(8\)"
    ):
        tiny_config(num_experts_per_tok=9)


def test_merged_grouped_weight_grads_equal_the_sum_of_the_parts():
    from fmoe.stages.primitives import GroupedWeightGrad, merge_grouped_weight_grads

    gen = torch.Generator().manual_seed(0)
    E, k, m = 5, 6, 4
    parts = []
    for rows, empty in [(13, (0,)), (0, ()), (9, (2, 4)), (21, ())]:
        probs = torch.ones(E)
        probs[list(empty)] = 0
        ids = torch.multinomial(probs, rows, replacement=True, generator=gen) if rows else torch.zeros(0)
        offs = torch.cumsum(torch.bincount(ids.long(), minlength=E), 0).to(torch.int32)
        x = torch.randn(rows, k, generator=gen, dtype=torch.float64)
        parts.append(GroupedWeightGrad(x, torch.randn(rows, m, generator=gen, dtype=torch.float64), offs, E))
    got = merge_grouped_weight_grads(parts)
    want = sum(p() for p in parts)
    assert got.shape == (E, m, k)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_step_merges_expert_weight_grads_over_microbatches(monkeypatch):
    from fmoe.stages import primitives

    cfg = tiny_config(num_hidden_layers=2, mlp_only_layers=(0,))
    model = qwen3_moe.build(cfg)
    params = model.init(seed=1, dtype=torch.float64)
    batch = random_batch(cfg, 6, 8, seed=2)
    calls = []
    real = primitives.grouped_mm_weight_grad
    monkeypatch.setattr(primitives, "grouped_mm_weight_grad", lambda *a: (calls.append(1), real(*a))[1])
    merged = runner.run_sequential(model, params, batch, num_microbatches=3)
    assert len(calls) == 2  # one MoE layer: gate_up and down, once for the whole step
    calls.clear()
    apart = runner.run_sequential(model, params, batch, num_microbatches=3, merge_expert_grads=False)
    assert len(calls) == 2 * 3
    assert torch.equal(merged.loss, apart.loss)
    for name, g in apart.grads.items():
        assert torch.allclose(merged.grads[name], g, rtol=1e-12, atol=1e-14), name
