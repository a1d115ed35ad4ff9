"""``torch.func`` on every real stage of the three model families, against fmoe's derived B and W.

A stage is a pure function of (params, inputs), so ``torch.func.grad`` and ``torch.func.vjp`` apply
to it as written (``fmoe.stage.call``). Their gradients, in float64, must equal what
``fmoe.stage.forward / backward_input / backward_weight`` derive with W deferred: the two share the
stage's forward and torch's per-op derivatives, but not the machinery (leaves, loss seeding, the
tape of deferred weight GEMMs, unused inputs and parameters). Forward-mode and batching transforms
(``jvp``, ``vmap``) do not go through ``linear`` / ``grouped_linear``; the last tests pin that down,
so the README's statement of it stays true.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_batch, relative_error, tiny_config
from test_deepseek_v2 import stage_cases
from test_deepseek_v2 import tiny as tiny_deepseek_v2
from test_deepseek_v3 import tiny as tiny_deepseek_v3
from test_gpt_oss import tiny as tiny_gpt_oss
from test_gpt_oss import with_random_biases

from fmoe import stage as S
from fmoe.stages import deepseek_v2, deepseek_v3, gpt_oss, qwen3_moe
from fmoe.stages.primitives import grouped_linear, linear
from fmoe.stages.spec import StageContext

# float64: both sides run the same per-op derivatives, in possibly another order of accumulation
# (a deferred weight GEMM, a gradient summed over several uses); each element is then within a few
# tens of eps = 1.1e-16 of the sum of its terms' magnitudes; 1e-12 leaves a margin for cancellation
RTOL = 1e-12
LOSS_SCALE = 0.5


def family_cases(family: str):
    """(params, [(stage, inputs)]) of a tiny float64 model with some experts left without tokens."""
    if family == "qwen3_moe":
        cfg = tiny_config(num_hidden_layers=2, mlp_only_layers=(0,), num_experts=16, router_aux_loss_coef=0.1)
        model = qwen3_moe.build(cfg)
        params = model.init(seed=1, dtype=torch.float64)
    elif family == "deepseek_v2":
        cfg = tiny_deepseek_v2(n_routed_experts=16, n_group=4, topk_group=2)
        model = deepseek_v2.build(cfg)
        params = model.init(seed=1, dtype=torch.float64)
    elif family == "deepseek_v3":
        cfg = tiny_deepseek_v3(n_routed_experts=16)
        model = deepseek_v3.FAMILY.build(cfg)
        params = model.init(seed=1, dtype=torch.float64)
    else:
        cfg = tiny_gpt_oss(num_local_experts=16, initializer_range=0.3, sliding_window=2)
        model = gpt_oss.build(cfg)
        params = with_random_biases(model.init(seed=1, dtype=torch.float64))
    return params, stage_cases(model, params, random_batch(cfg, 2, 3))


FAMILIES = ("qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss")
_CASES: dict = {}


def cases_of(family: str):
    if family not in _CASES:
        _CASES[family] = family_cases(family)
    return _CASES[family]


def stage_names() -> list[tuple[str, str]]:
    """(family, stage name) for every stage of each tiny model (built once, here, to list them)."""
    return [(f, stage.name) for f in FAMILIES for stage, _ in cases_of(f)[1]]


def cotangents(stage, outputs):
    """Random cotangents for the carried floating outputs (None for integer ones), seeded."""
    gen = torch.Generator().manual_seed(7)
    carried = outputs[: stage.num_carried(len(outputs))]  # not the loss terms or statistics
    return [
        torch.randn(o.shape, generator=gen, dtype=o.dtype) if o.is_floating_point() else None for o in carried
    ]


def derived(stage, params, inputs, grad_outputs):
    """fmoe's F, B and (deferred) W: (input gradients, {name: weight gradient})."""
    _, fwd = S.forward(stage, params, inputs, StageContext())
    grad_inputs, work = S.backward_input(fwd, grad_outputs, loss_scale=LOSS_SCALE)
    return grad_inputs, S.backward_weight(work)


def as_function(stage, inputs):
    """f(stage params, floating inputs) -> outputs, the integer inputs held fixed; and where the
    floating inputs sit among the stage's inputs."""
    at = [i for i, t in enumerate(inputs) if t.is_floating_point()]

    def f(p, xs):
        full = list(inputs)
        for i, x in zip(at, xs, strict=True):
            full[i] = x
        return S.call(stage, p, full, StageContext())

    return f, at


def assert_same(stage, at, func_inputs, func_params, grad_inputs, grads):
    for i, g in zip(at, func_inputs, strict=True):
        mine = grad_inputs[i] if grad_inputs[i] is not None else torch.zeros_like(g)
        err = relative_error(mine, g)
        assert err <= RTOL, f"{stage.name} input {i}: relative error {err}"
    assert set(grads) <= set(func_params)
    for n, g in func_params.items():
        if n not in grads:  # fmoe gives no entry only for a parameter with no gradient
            assert torch.equal(g, torch.zeros_like(g)), (
                f"{stage.name} {n}: derived none, torch.func {g.norm()}"
            )
            continue
        err = relative_error(grads[n], g)
        assert err <= RTOL, f"{stage.name} {n}: relative error {err}"


@pytest.mark.parametrize("family,name", stage_names())
def test_torch_func_vjp_and_grad_equal_the_derived_b_and_w_in_float64(family, name):
    params, cases = cases_of(family)
    stage, inputs = next((s, i) for s, i in cases if s.name == name)
    p = {n: params[n] for n in stage.params}
    f, at = as_function(stage, inputs)
    xs = [inputs[i] for i in at]
    outputs = f(p, xs)
    grad_outputs = cotangents(stage, outputs)
    grad_inputs, grads = derived(stage, params, inputs, grad_outputs)
    assert grads or grad_inputs, f"{stage.name}: nothing to compare"

    # vjp of the floating outputs (vjp refuses integer ones: expert ids, orders); the loss outputs'
    # cotangents are weight x loss scale, as B seeds them
    carried = len(outputs) - len(stage.losses)
    cot = [g for o, g in zip(outputs[:carried], grad_outputs) if o.is_floating_point()]
    cot += [torch.full_like(outputs[carried + j], w * LOSS_SCALE) for j, w in enumerate(stage.losses)]

    def floating(p, xs):
        return tuple(o for o in f(p, xs) if o.is_floating_point())

    _, vjp_fn = torch.func.vjp(floating, p, xs)
    vjp_params, vjp_inputs = vjp_fn(tuple(cot))
    assert_same(stage, at, vjp_inputs, vjp_params, grad_inputs, grads)

    # grad of the scalar <carried outputs, cotangents> + weighted loss terms
    def objective(p, xs):
        out = f(p, xs)
        total = sum((o * g).sum() for o, g in zip(out[:carried], grad_outputs) if g is not None)
        return total + sum(w * LOSS_SCALE * out[carried + j].sum() for j, w in enumerate(stage.losses))

    grad_params, grad_xs = torch.func.grad(objective, argnums=(0, 1))(p, xs)
    assert_same(stage, at, grad_xs, grad_params, grad_inputs, grads)


def test_the_cases_cover_every_stage_kind_and_empty_experts():
    for family in FAMILIES:
        _, cases = cases_of(family)
        kinds = {s.name.rsplit(".", 1)[-1] for s, _ in cases}
        assert kinds == {"embed", "attn", "dispatch", "mlp", "combine", "aggregate", "head"}, family
        offs = next(
            t for s, inputs in cases if s.name.endswith("1.mlp") for t in inputs if t.dtype == torch.int32
        )
        assert (torch.diff(offs, prepend=offs.new_zeros(1)) == 0).any(), (
            f"{family}: some expert must get no rows"
        )


# ---------------------------------------------------------------------------------------------
# what does not apply (the README says so): forward mode and vmap through the primitives


def test_jvp_does_not_go_through_linear_or_grouped_linear():
    x, w = torch.randn(4, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    offs = torch.tensor([1, 4], dtype=torch.int32)
    wg = torch.randn(2, 5, 3, dtype=torch.float64)
    for fn in (lambda t: linear(t, w), lambda t: grouped_linear(t, wg, offs)):
        with pytest.raises(RuntimeError, match="jvp"):
            torch.func.jvp(fn, (x,), (torch.ones_like(x),))


def test_vmap_does_not_go_through_linear_or_grouped_linear():
    xs, w = torch.randn(5, 4, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    offs = torch.tensor([1, 4], dtype=torch.int32)
    wg = torch.randn(2, 5, 3, dtype=torch.float64)
    for fn in (lambda t: linear(t, w), lambda t: grouped_linear(t, wg, offs)):
        with pytest.raises(RuntimeError, match="vmap"):
            torch.func.vmap(fn)(xs)


def test_jacrev_goes_through_linear_and_grouped_linear():
    """What the README offers instead of forward mode: reverse-mode Jacobians work."""
    x, w = torch.randn(4, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    offs = torch.tensor([1, 1, 4], dtype=torch.int32)  # expert 1 gets no rows
    wg = torch.randn(3, 5, 3, dtype=torch.float64)

    def loop(t):
        return torch.cat([t[:1] @ wg[0].T, t[1:4] @ wg[2].T])

    pairs = ((lambda t: linear(t, w), lambda t: t @ w.T), (lambda t: grouped_linear(t, wg, offs), loop))
    for ours, plain in pairs:
        jac, want = torch.func.jacrev(ours)(x), torch.func.jacrev(plain)(x)
        assert relative_error(jac, want) <= RTOL
