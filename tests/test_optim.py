"""Claims about fmoe.optim: it is torch's AdamW (fused kernel), composable, syncless, checkpointable."""

import json
import math
import runpy
from pathlib import Path

import pytest
import torch

from fmoe import optim, optim_composed, optim_fused

STEPS = 10

# Tolerances between two float32 implementations of the same optimizer math, from rounding errors
# (u = EPS32, any CPU, SIMD width or summation order):
# - a global gradient norm sums N squares (N = N_PARAMS): each implementation is within about
#   u * sqrt(N) of the exact sum (rounding errors of random sign, whatever the order), the square
#   root halves that and adds u; the two implementations' errors add:
#   NORM_RTOL = 2 * u * (sqrt(N) / 2 + 1) = u * (sqrt(N) + 2).
# - a parameter after k steps: each step each implementation rounds p - update once (half an ulp of
#   |p|, at most u * |p| / 2) and computes the update (|update| <= lr_max * (1 + wd * |p|) < 0.05
#   here) to a relative few u (m, v, sqrt, division, bias corrections: 8 u). Gradients do not depend
#   on the parameters here, so the differences add up at most linearly over the steps:
#   param_atol(k) = k * u * (P_MAX + 8 * 0.05), with a stated safety factor of 2.
# - Adam moments: see moment_atol.
EPS32 = torch.finfo(torch.float32).eps


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(17, 8, generator=g),
        "layers.0.attn.wq": torch.randn(8, 8, generator=g),
        "layers.0.norm.scale": torch.randn(8, generator=g),
        "head.bias": torch.randn(17, generator=g),
    }


N_PARAMS = sum(p.numel() for p in _params().values())
P_MAX = max(float(p.abs().max()) for p in _params().values()) + STEPS * 0.05  # moves < 0.05 a step
NORM_RTOL = EPS32 * (math.sqrt(N_PARAMS) + 2)


def param_atol(steps: int) -> float:
    """|p_a - p_b| bound after ``steps`` steps of two float32 implementations (see the top)."""
    return 2 * steps * EPS32 * (P_MAX + 8 * 0.05)


def moment_atol(steps: int, g_max: float) -> float:
    """|m_a - m_b| and |v_a - v_b| bound after ``steps`` steps when both see gradients clipped to at
    most g_max: each step rounds m (v) once (u relative) and the clip factors differ by NORM_RTOL
    (twice for v = g^2); |m| <= g_max, |v| <= g_max^2; linear accumulation, safety factor 2."""
    return 2 * steps * (2 * NORM_RTOL + 2 * EPS32) * max(g_max, g_max**2)


def _grads(step: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {n: 3.0 * torch.randn(p.shape, generator=g) for n, p in like.items()}


def _torch_reference(peak, sched, max_norm, wd, mask):
    """torch.optim.AdamW + clip_grad_norm_ + LambdaLR over STEPS steps; returns params, optimizer."""
    ref = {n: p.clone().requires_grad_(True) for n, p in _params().items()}
    groups = [
        {"params": [p for n, p in ref.items() if mask[n]], "weight_decay": wd},
        {"params": [p for n, p in ref.items() if not mask[n]], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=peak, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: sched(s) / peak)
    norms = []
    for s in range(STEPS):
        for n, g in _grads(s, ref).items():
            ref[n].grad = g
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(ref.values()), max_norm)))
        opt.step()
        lam.step()
    return ref, opt, norms


@pytest.mark.parametrize("route", ["step", "update_then_apply"])
def test_adamw_with_clip_and_schedule_matches_torch_adamw_over_10_steps(route):
    peak, max_norm, wd = 3e-2, 1.0, 0.1
    sched = optim.warmup_cosine(peak, warmup=3, total=STEPS, final=3e-3)
    params = _params()
    mask = optim.default_decay_mask(params)
    ref, opt, ref_norms = _torch_reference(peak, sched, max_norm, wd, mask)

    tx = optim.chain(
        optim.clip_by_global_norm(max_norm), optim.adamw(sched, b1=0.9, b2=0.95, weight_decay=wd, mask=mask)
    )
    state = tx.init(params)
    for s in range(STEPS):
        if route == "step":
            params, state = optim.step(tx, _grads(s, params), state, params)
        else:
            updates, state = tx.update(_grads(s, params), state, params)
            params = optim.apply_updates(params, updates, inplace=False)
        assert math.isclose(float(state["grad_norm"]), ref_norms[s], rel_tol=NORM_RTOL)
    assert max(ref_norms) > max_norm  # clipping was active, so the test covers it

    assert int(state["step"]) == STEPS
    by_tensor = {id(p): n for n, p in ref.items()}
    for p, st in opt.state.items():
        name = by_tensor[id(p)]
        torch.testing.assert_close(params[name], p.detach(), rtol=0, atol=param_atol(STEPS))
        torch.testing.assert_close(
            state[f"exp_avg/{name}"], st["exp_avg"], rtol=0, atol=moment_atol(STEPS, max_norm)
        )
        torch.testing.assert_close(
            state[f"exp_avg_sq/{name}"], st["exp_avg_sq"], rtol=0, atol=moment_atol(STEPS, max_norm)
        )


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["fmoe", "torch"])
def test_fused_adamw_equals_the_composed_definition_over_10_steps(grad_dtype, kernel, monkeypatch):
    """optax's definition, chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate), fed the
    fp32 values of the same gradients, against the fused step on either kernel (fmoe's reads bf16
    grads and folds the clip in; torch's after a conversion and a scaling pass). The bounds are the
    ones derived at the top of this file: the two round in another order, nothing more."""
    monkeypatch.setattr(optim_fused, "KERNEL_MIN_NUMEL", 0 if kernel == "fmoe" else 1 << 62)
    sched = optim.warmup_cosine(3e-2, warmup=3, total=STEPS, final=3e-3)
    mask = optim.default_decay_mask(_params())
    hyper = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=mask)
    fused = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(sched, **hyper))
    composed = optim.chain(optim.clip_by_global_norm(1.0), optim_composed.adamw(sched, **hyper))
    p_fused, p_comp = _params(), _params()
    s_fused, s_comp = fused.init(p_fused), composed.init(p_comp)
    for s in range(STEPS):
        grads = {n: g.to(grad_dtype) for n, g in _grads(s, p_fused).items()}
        updates, s_comp = composed.update(
            {n: g.to(torch.float32, copy=True) for n, g in grads.items()}, s_comp, p_comp
        )
        p_comp = optim.apply_updates(p_comp, updates, inplace=False)
        p_fused, s_fused = optim.step(fused, grads, s_fused, p_fused)
        assert float(s_fused["grad_norm"]) > 1.0  # the clip is active every step
    assert int(s_fused["step"]) == int(s_comp["step"]) == int(s_comp["lr_step"]) == STEPS
    for n in p_fused:
        torch.testing.assert_close(p_fused[n], p_comp[n], rtol=0, atol=param_atol(STEPS))
        for k in ("exp_avg", "exp_avg_sq"):
            want = s_comp[f"{k}/{n}"]
            torch.testing.assert_close(s_fused[f"{k}/{n}"], want, rtol=0, atol=moment_atol(STEPS, 1.0))
    moved = max(float((p_fused[n] - p).abs().max()) for n, p in _params().items())
    assert moved > 100 * param_atol(STEPS)  # the steps moved the params far beyond the tolerance


def test_adamw_mask_false_params_get_no_weight_decay():
    params = {"w": torch.ones(4, 4), "b": torch.ones(4)}
    zero = {n: torch.zeros_like(p) for n, p in params.items()}
    for mask in ({"w": True, "b": False}, lambda name: name == "w"):
        p = {n: t.clone() for n, t in params.items()}
        tx = optim.adamw(0.1, weight_decay=0.5, mask=mask)
        state = tx.init(p)
        p, state = optim.step(tx, zero, state, p)
        # zero gradients: Adam's term is 0, so only the decoupled decay p *= 1 - lr * wd moves p
        torch.testing.assert_close(p["w"], torch.full((4, 4), 1 - 0.1 * 0.5))
        torch.testing.assert_close(p["b"], torch.ones(4))


def test_adamw_dict_mask_missing_a_parameter_is_refused_at_init():
    with pytest.raises(ValueError, match="'b'"):
        optim.adamw(0.1, mask={"w": True}).init({"w": torch.ones(2), "b": torch.ones(2)})


def test_chain_composes_members_in_order():
    params = _params()
    grads = _grads(0, params)
    clip, adam = optim.clip_by_global_norm(0.5), optim.adamw(1e-2)
    tx = optim.chain(clip, adam)
    state = tx.init(params)
    assert set(state) == {"grad_norm", "step"} | {f"exp_avg{k}/{n}" for n in params for k in ("", "_sq")}

    got, state = tx.update({n: g.clone() for n, g in grads.items()}, state, params)

    s1, s2 = clip.init(params), adam.init(params)
    clipped, s1 = clip.update({n: g.clone() for n, g in grads.items()}, s1, params)
    want, s2 = adam.update(clipped, s2, params)
    for n in params:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0)
        torch.testing.assert_close(state[f"exp_avg/{n}"], s2[f"exp_avg/{n}"], rtol=0, atol=0)
    torch.testing.assert_close(state["grad_norm"], s1["grad_norm"])
    assert float(state["grad_norm"]) > 0.5  # the clip scaled the updates


def test_chain_refuses_two_members_keeping_the_same_state_key():
    tx = optim.chain(optim.adamw(1e-3), optim.adamw(1e-3))
    with pytest.raises(ValueError, match="step"):
        tx.init({"w": torch.ones(2)})


def test_update_never_modifies_params():
    params = _params()
    before = {n: p.clone() for n, p in params.items()}
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1))
    state = tx.init(params)
    tx.update(_grads(0, params), state, params)
    for n in params:
        assert torch.equal(params[n], before[n])


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_step_makes_no_host_sync(kernel_everywhere, monkeypatch, grad_dtype):
    """The step loop never pulls a value to the host: .item(), bool(), float(), int(), tolist() all raise."""

    def sync(*args, **kwargs):
        raise AssertionError("host sync")

    params = _params()
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.warmup_stable_decay(1e-2, 2, 10, 4)))
    state = tx.init(params)
    for name in ("item", "__bool__", "__float__", "__int__", "__index__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    for s in range(3):
        grads = {n: g.to(grad_dtype) for n, g in _grads(s, params).items()}
        params, state = optim.step(tx, grads, state, params)
    monkeypatch.undo()
    assert int(state["step"]) == 3


def test_inputs_that_require_grad_build_no_graph():
    params = {n: p.requires_grad_(True) for n, p in _params().items()}
    grads = {n: g.requires_grad_(True) * 1.0 for n, g in _grads(0, params).items()}
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.warmup_cosine(1e-2, 2, 10)))
    state = tx.init(params)
    updates, _ = tx.update({n: g.clone() for n, g in grads.items()}, dict(state), params)
    params, state = optim.step(tx, grads, state, params)
    assert not any(t.grad_fn is not None for t in (*updates.values(), *state.values(), *params.values()))
    assert not state["grad_norm"].requires_grad


def test_tensor_lr_schedule_gives_the_same_step_as_a_float_lr():
    lr = 0.02
    a, b = _params(), _params()
    tx_a, tx_b = optim.adamw(lr), optim.adamw(lambda s: torch.full_like(s, lr))
    sa, sb = tx_a.init(a), tx_b.init(b)
    for s in range(3):
        a, sa = optim.step(tx_a, _grads(s, a), sa, a)
        b, sb = optim.step(tx_b, _grads(s, b), sb, b)
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=0)


@pytest.mark.parametrize(
    "sched",
    [
        optim.warmup_cosine(1.0, warmup=4, total=20, final=0.1),
        optim.warmup_stable_decay(1.0, warmup=4, total=20, decay=6, final=0.1, shape="linear"),
        optim.warmup_stable_decay(1.0, warmup=4, total=20, decay=6, final=0.1, shape="sqrt"),
        optim.warmup_stable_decay(1.0, warmup=4, total=20, decay=6, final=0.1, shape="cosine"),
    ],
)
def test_schedules_agree_on_ints_and_tensors_and_hit_their_endpoints(sched):
    for s in range(25):
        assert math.isclose(float(sched(torch.tensor(float(s)))), sched(s), rel_tol=1e-6, abs_tol=1e-7)
    assert sched(0) == pytest.approx(0.25)  # (0 + 1) / warmup of peak
    assert sched(3) == pytest.approx(1.0)  # warmup done
    assert sched(20) == pytest.approx(0.1) and sched(100) == pytest.approx(0.1)


def test_warmup_stable_decay_is_flat_until_the_decay_phase():
    sched = optim.warmup_stable_decay(2.0, warmup=2, total=100, decay=10)
    assert all(sched(s) == 2.0 for s in range(2, 91))
    assert sched(95) == pytest.approx(1.0)


def test_bad_hyperparameters_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="b2"):
        optim.adamw(1e-3, b2=1.0)
    with pytest.raises(ValueError, match="max_norm"):
        optim.clip_by_global_norm(0.0)
    with pytest.raises(ValueError, match="total"):
        optim.warmup_cosine(1e-3, warmup=10, total=5)
    with pytest.raises(ValueError, match="decay"):
        optim.warmup_stable_decay(1e-3, warmup=2, total=10, decay=20)


def test_state_round_trips_through_flat_keyed_by_parameter_names(tmp_path):
    from safetensors.torch import load_file, save_file

    params = _params()
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2))
    state = tx.init(params)
    params, state = optim.step(tx, _grads(0, params), state, params)
    flat = optim.state_to_flat(state)
    assert "exp_avg_sq/layers.0.attn.wq" in flat and "step" in flat
    save_file(flat, tmp_path / "optim.safetensors")
    back = optim.state_from_flat(tx, load_file(tmp_path / "optim.safetensors"), params)

    p1, s1 = optim.step(tx, _grads(1, params), state, {n: p.clone() for n, p in params.items()})
    p2, s2 = optim.step(tx, _grads(1, params), back, {n: p.clone() for n, p in params.items()})
    for n in params:
        assert torch.equal(p1[n], p2[n])

    broken = dict(flat)
    del broken["exp_avg/head.bias"]
    with pytest.raises(ValueError, match="exp_avg/head.bias"):
        optim.state_from_flat(tx, broken, params)


def test_grads_with_a_missing_parameter_are_refused_naming_it():
    params = _params()
    tx = optim.adamw(1e-3)
    state = tx.init(params)
    grads = _grads(0, params)
    del grads["head.bias"]
    with pytest.raises(ValueError, match="head.bias"):
        optim.step(tx, grads, state, params)


def test_bench_optim_runs_on_cpu_and_writes_json(tmp_path):
    bench = runpy.run_path(str(Path(__file__).parents[1] / "benchmarks" / "bench_optim.py"))
    out = tmp_path / "bench.json"
    assert (
        bench["main"](
            ["--out", str(out), "--device", "cpu", "--tensors", "4", "--numel", "4096", "--iters", "2"]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["params"] == 4 * 4096
    cases = result["ms_per_step"]
    for case in (
        "torch_adamw_fused",
        "torch_adamw_foreach",
        "fmoe_adamw_step",
        "fmoe_clip_adamw_step",
        "fmoe_clip_adamw_bf16_step",
        "fmoe_clip_adamw_bf16_old_route",
    ):
        assert cases[case] > 0
    assert result["ratio_vs_torch_fused"]["fmoe_adamw_step"] > 0
    assert result["ratio_bf16_fused_vs_old_route"] > 0


# --------------------------------------------------------------------------------------------------
# gradients in another dtype than the params, and the clip factor folded into AdamW's kernel


@pytest.fixture
def kernel_everywhere(monkeypatch):
    """fmoe's AdamW kernel for tensors of any size (by default small ones take the copy route)."""
    monkeypatch.setattr(optim_fused, "KERNEL_MIN_NUMEL", 0)


def _bf16_grads(step: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: g.bfloat16() for n, g in _grads(step, like).items()}


def _clip_adamw(sched, mask, sq_norm_reduce=None):
    clip = optim.clip_by_global_norm(1.0, sq_norm_reduce=sq_norm_reduce)
    adam = optim.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1, mask=mask)
    return clip, adam, optim.chain(clip, adam)


def _old_route(clip, adam, grads, state, params):
    """What the trainer did before: an fp32 copy of the grads, the clip's scaling pass, torch's AdamW."""
    g32, state = clip.update({n: g.float() for n, g in grads.items()}, state, params)
    return optim.step(adam, g32, state, params)


@pytest.mark.parametrize("route", ["kernel", "small_tensors_copy"])
@pytest.mark.parametrize("sq_norm_reduce", [None, lambda sq: 4.0 * sq])
def test_chain_clip_adamw_on_bf16_grads_equals_float_grads_through_the_old_path(
    sq_norm_reduce, route, monkeypatch
):
    if route == "kernel":
        monkeypatch.setattr(optim_fused, "KERNEL_MIN_NUMEL", 0)
    sched = optim.warmup_cosine(3e-2, warmup=2, total=STEPS, final=3e-3)
    mask = optim.default_decay_mask(_params())
    clip, adam, tx = _clip_adamw(sched, mask, sq_norm_reduce)
    new, old = _params(), _params()
    s_new, s_old = tx.init(new), tx.init(old)
    for s in range(5):
        grads = _bf16_grads(s, new)
        before = {n: g.clone() for n, g in grads.items()}
        new, s_new = optim.step(tx, grads, s_new, new)
        old, s_old = _old_route(clip, adam, before, s_old, old)
        assert all(torch.equal(grads[n], before[n]) for n in grads)  # read as they are: no scaling pass
        torch.testing.assert_close(s_new["grad_norm"], s_old["grad_norm"], rtol=NORM_RTOL, atol=0)
    want_norm = torch.cat([g.float().flatten() for g in _bf16_grads(4, new).values()]).norm()
    factor = 2.0 if sq_norm_reduce is not None else 1.0  # the hook reached the fused step's norm
    torch.testing.assert_close(s_new["grad_norm"], factor * want_norm, rtol=NORM_RTOL, atol=0)
    assert float(s_new["grad_norm"]) > 1.0  # clipping was active
    for n in new:
        torch.testing.assert_close(new[n], old[n], rtol=0, atol=param_atol(5))
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(s_new[f"{k}/{n}"], s_old[f"{k}/{n}"], rtol=0, atol=moment_atol(5, 1.0))
    assert int(s_new["step"]) == 5


def test_chain_step_scales_no_gradient_in_a_pass_of_its_own(kernel_everywhere, monkeypatch):
    """The clip factor goes to the AdamW kernel: no _foreach_mul_ runs and no grad is copied to fp32."""
    params = _params()
    _, _, tx = _clip_adamw(1e-2, None)
    state = tx.init(params)

    grads = _bf16_grads(0, params)
    ids = {id(g) for g in grads.values()}

    def refuse(*args, **kwargs):
        raise AssertionError("a separate pass over the gradients")

    def watch(method):
        def wrapped(self, *args, **kwargs):
            if id(self) in ids:
                raise AssertionError(f"a {method.__name__} of a gradient")
            return method(self, *args, **kwargs)

        return wrapped

    monkeypatch.setattr(torch, "_foreach_mul_", refuse)
    for name in ("float", "to", "clone", "contiguous", "mul", "mul_"):
        monkeypatch.setattr(torch.Tensor, name, watch(getattr(torch.Tensor, name)))
    params, state = optim.step(tx, grads, state, params)
    monkeypatch.undo()
    assert int(state["step"]) == 1 and float(state["grad_norm"]) > 1.0


def test_clip_factor_is_the_scalar_its_update_multiplies_by():
    params = _params()
    grads = _grads(0, params)
    clip = optim.clip_by_global_norm(0.5)
    scale, s1 = clip.factor({n: g.clone() for n, g in grads.items()}, clip.init(params), params)
    scaled, s2 = clip.update({n: g.clone() for n, g in grads.items()}, clip.init(params), params)
    assert scale.shape == () and scale.dtype == torch.float32 and float(scale) < 1.0
    torch.testing.assert_close(s1["grad_norm"], s2["grad_norm"], rtol=0, atol=0)
    for n in grads:
        torch.testing.assert_close(scaled[n], grads[n] * scale, rtol=0, atol=0)
    assert clip.factor({}, clip.init(params), params)[0] is None  # nothing to scale


def test_bf16_grads_without_clip_equal_their_float_copy(kernel_everywhere):
    a, b = _params(), _params()
    tx = optim.adamw(optim.warmup_stable_decay(1e-2, 2, 10, 4), weight_decay=0.1)
    sa, sb = tx.init(a), tx.init(b)
    for s in range(3):
        a, sa = optim.step(tx, _bf16_grads(s, a), sa, a)
        b, sb = optim.step(tx, {n: g.float() for n, g in _bf16_grads(s, b).items()}, sb, b)
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=param_atol(3))


def test_update_route_with_bf16_grads_equals_the_fused_step(kernel_everywhere):
    params = _params()
    _, _, tx = _clip_adamw(1e-2, None)
    state = tx.init(params)
    updates, s_upd = tx.update(_bf16_grads(0, params), {k: v.clone() for k, v in state.items()}, params)
    stepped, s_step = optim.step(tx, _bf16_grads(0, params), state, {n: p.clone() for n, p in params.items()})
    for n in params:
        torch.testing.assert_close(params[n] + updates[n], stepped[n], rtol=0, atol=param_atol(1))
    torch.testing.assert_close(s_upd["grad_norm"], s_step["grad_norm"], rtol=0, atol=0)


def _halve() -> optim.GradientTransformation:
    """A stateless transformation that only scales, exposing its factor (0.5)."""

    def factor(updates, state, params=None):
        return torch.tensor(0.5), state

    def update(updates, state, params=None):
        return optim.scale_updates(updates, torch.tensor(0.5)), state

    return optim.GradientTransformation(lambda params: {}, update, factor=factor)


@pytest.mark.parametrize("order", ["halve_clip_adamw", "clip_halve_adamw"])
def test_factors_before_other_members_are_applied_first_so_the_step_equals_update(kernel_everywhere, order):
    """A pending factor is applied to the grads before a member that reads them (here: the next
    factor's member); the chain's fused step still equals its update + apply."""
    members = {"halve": _halve(), "clip": optim.clip_by_global_norm(0.5), "adamw": optim.adamw(1e-2)}
    tx = optim.chain(*(members[k] for k in order.split("_")))
    params = _params()
    state = tx.init(params)
    updates, s_upd = tx.update(_grads(0, params), {k: v.clone() for k, v in state.items()}, params)
    stepped, s_step = optim.step(tx, _grads(0, params), state, {n: p.clone() for n, p in params.items()})
    want_norm = torch.cat([g.flatten() for g in _grads(0, params).values()]).norm()
    factor = 0.5 if order.startswith("halve") else 1.0  # the clip saw the halved grads
    torch.testing.assert_close(s_step["grad_norm"], factor * want_norm, rtol=NORM_RTOL, atol=0)
    torch.testing.assert_close(s_upd["grad_norm"], s_step["grad_norm"], rtol=0, atol=0)
    for n in params:
        torch.testing.assert_close(params[n] + updates[n], stepped[n], rtol=0, atol=param_atol(1))


def test_chain_step_accepts_an_outer_grad_scale(kernel_everywhere):
    a, b = _params(), _params()
    _, _, tx = _clip_adamw(1e-2, None)
    sa, sb = tx.init(a), tx.init(b)
    half = torch.tensor(0.5)
    a, sa = optim.step(tx, _grads(0, a), sa, a, grad_scale=half)
    b, sb = optim.step(tx, {n: 0.5 * g for n, g in _grads(0, b).items()}, sb, b)
    torch.testing.assert_close(sa["grad_norm"], sb["grad_norm"], rtol=NORM_RTOL, atol=0)
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=param_atol(1))


def test_without_triton_bf16_grads_take_the_copy_path_with_the_same_numbers(kernel_everywhere, monkeypatch):
    sched = optim.warmup_cosine(3e-2, warmup=2, total=STEPS)
    clip, adam, tx = _clip_adamw(sched, None)
    a, b = _params(), _params()
    sa, sb = tx.init(a), tx.init(b)
    a, sa = optim.step(tx, _bf16_grads(0, a), sa, a)
    monkeypatch.setenv("FMOE_KERNEL_BACKEND", "torch")
    b, sb = optim.step(tx, _bf16_grads(0, b), sb, b)
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=param_atol(1))


def test_bf16_params_with_a_clip_still_step():
    """Params not in fp32: torch's fused kernel, with the clip factor applied in a pass first."""
    params = {n: p.bfloat16() for n, p in _params().items()}
    _, _, tx = _clip_adamw(1e-2, None)
    state = tx.init(params)
    ref = {n: p.clone() for n, p in params.items()}
    updates, _ = tx.update(_bf16_grads(0, params), tx.init(ref), ref)
    params, state = optim.step(tx, _bf16_grads(0, params), state, params)
    for n in params:
        assert params[n].dtype == torch.bfloat16
        torch.testing.assert_close(params[n], ref[n] + updates[n], rtol=0, atol=1e-2)
    assert state[f"exp_avg/{next(iter(params))}"].dtype == torch.bfloat16


def test_small_bf16_grads_are_converted_in_one_cat_not_one_copy_each(monkeypatch):
    """Below KERNEL_MIN_NUMEL the copy route converts all of a group's grads together."""
    calls = []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if self.dtype == torch.bfloat16 and self.dim() > 0:
            calls.append(tuple(self.shape))
        return real_to(self, *args, **kwargs)

    params = _params()
    tx = optim.adamw(1e-2)
    state = tx.init(params)
    grads = _bf16_grads(0, params)
    monkeypatch.setattr(torch.Tensor, "to", to)
    got, _ = optim.step(tx, grads, state, {n: p.clone() for n, p in params.items()})
    monkeypatch.undo()
    assert calls == [(sum(p.numel() for p in params.values()),)]  # the one flat cat
    want, _ = optim.step(tx, {n: g.float() for n, g in grads.items()}, tx.init(params), params)
    for n in params:
        assert torch.equal(got[n], want[n])
