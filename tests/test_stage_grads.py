"""Derived F/B/W of every Qwen3-MoE stage, tested alone against torch.autograd in float64."""

from __future__ import annotations

import pytest
import torch
from conftest import random_batch, relative_error, tiny_config

from fmoe import runner
from fmoe import stage as S
from fmoe.stages import qwen3_moe
from fmoe.stages.spec import StageContext

# float64: the same per-op derivatives, accumulated in possibly another order (deferred weight
# GEMMs, a gradient summed over several uses): within a few tens of eps = 1.1e-16 per element
RTOL = 1e-12


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = relative_error(got, want)
    assert err <= RTOL, f"{what}: relative error {err}"


def stage_cases(cfg, batch):
    """(stage, inputs) for every stage of the model, inputs taken from a real forward."""
    model = qwen3_moe.build(cfg)
    params = model.init(seed=1, dtype=torch.float64)
    batch = runner.with_positions(batch)
    carry, cases = (), []
    for stage in model.stages:
        inputs = runner.stage_inputs(stage, carry, batch)
        cases.append((stage, inputs))
        carry, _ = runner.split_outputs(stage, S.call(stage, params, inputs, StageContext()))
    return params, cases


def autograd_reference(stage, params, inputs, grad_outputs, loss_scale):
    """Gradients of sum(<outputs, grad_outputs>) + loss terms, by plain torch.autograd."""
    p = {n: params[n].clone().requires_grad_() for n in stage.params}
    x = [t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    outputs = S.call(stage, p, x, StageContext())
    carried = len(outputs) - len(stage.losses)
    total = sum((o * g).sum() for o, g in zip(outputs[:carried], grad_outputs) if g is not None)
    total = total + sum(w * loss_scale * outputs[carried + i] for i, w in enumerate(stage.losses))
    total.backward()
    return [t.grad if t.is_floating_point() else None for t in x], {n: p[n].grad for n in stage.params}


@pytest.mark.parametrize("name", ["embed", "attn", "dispatch", "mlp", "combine", "aggregate", "head"])
def test_every_moe_stage_b_and_w_equal_autograd_in_float64(name):
    # 16 experts, top-2 over 6 tokens: at most 12 slots, so several experts get no tokens
    cfg = tiny_config(num_hidden_layers=1, num_experts=16, router_aux_loss_coef=0.1)
    params, cases = stage_cases(cfg, random_batch(cfg, 2, 3))
    stage, inputs = next((s, i) for s, i in cases if s.name.split(".")[-1] == name)
    if name == "mlp":
        offs = inputs[4]
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        assert (counts == 0).any(), "the routing must leave some expert without tokens"
    if name == "attn":
        assert stage.losses, "the aux loss must be on"

    outputs, fwd = S.forward(stage, params, inputs, StageContext())
    gen = torch.Generator().manual_seed(2)
    carried = outputs[: len(outputs) - len(stage.losses)]
    grad_outputs = [
        torch.randn(o.shape, generator=gen, dtype=o.dtype) if o.is_floating_point() else None for o in carried
    ]
    grad_inputs, work = S.backward_input(fwd, grad_outputs, loss_scale=0.5)
    grads = S.backward_weight(work)

    ref_inputs, ref_params = autograd_reference(stage, params, inputs, grad_outputs, 0.5)
    for i, (g, r) in enumerate(zip(grad_inputs, ref_inputs)):
        if r is None:
            assert g is None, f"input {i} is not differentiable but got a gradient"
            continue
        assert g is not None, f"input {i} got no gradient"
        assert_close_rel(g, r, f"{stage.name} input {i}")
    assert set(grads) == {n for n, r in ref_params.items() if r is not None}
    for n, r in ref_params.items():
        if r is not None:
            assert_close_rel(grads[n], r, f"{stage.name} {n}")


def test_dense_layer_stages_b_and_w_equal_autograd_in_float64():
    cfg = tiny_config(num_hidden_layers=1, mlp_only_layers=(0,))
    params, cases = stage_cases(cfg, random_batch(cfg, 2, 5))
    names = [s.name for s, _ in cases]
    assert names == ["embed", "layers.0.attn", "layers.0.mlp", "layers.0.aggregate", "head"]
    for stage, inputs in cases:
        outputs, fwd = S.forward(stage, params, inputs, StageContext())
        carried = outputs[: len(outputs) - len(stage.losses)]
        grad_outputs = [torch.ones_like(o) if o.is_floating_point() else None for o in carried]
        grad_inputs, work = S.backward_input(fwd, grad_outputs)
        grads = S.backward_weight(work)
        ref_inputs, ref_params = autograd_reference(stage, params, inputs, grad_outputs, 1.0)
        for i, (g, r) in enumerate(zip(grad_inputs, ref_inputs, strict=True)):
            if r is not None:
                assert_close_rel(g, r, f"{stage.name} input {i}")
        assert set(grads) == set(ref_params), stage.name
        for n, r in ref_params.items():
            assert_close_rel(grads[n], r, f"{stage.name} {n}")


def test_weight_gemms_are_deferred_to_w():
    """B of the expert MLP computes no expert-weight gradient; W does, from the taped GEMMs."""
    cfg = tiny_config(num_hidden_layers=1)
    params, cases = stage_cases(cfg, random_batch(cfg, 2, 4))
    stage, inputs = next((s, i) for s, i in cases if s.name.endswith(".mlp"))
    outputs, fwd = S.forward(stage, params, inputs, StageContext())
    _, work = S.backward_input(fwd, [torch.ones_like(o) if o.is_floating_point() else None for o in outputs])
    assert work.partial == {}, "expert weights must not be differentiated in B"
    assert len(work.tape.entries) == 2  # gate_up and down
    grads = S.backward_weight(work)
    assert set(grads) == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}


def test_b_plus_w_run_the_gemms_of_one_backward_and_no_forward():
    """Count matrix multiplies: B + W of a stage run exactly as many as one autograd backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm):
                self.count += 1
            return func(*args, **(kwargs or {}))

    cfg = tiny_config(num_hidden_layers=1)
    params, cases = stage_cases(cfg, random_batch(cfg, 2, 4))
    stage, inputs = next((s, i) for s, i in cases if s.name.endswith(".attn"))
    calls = []
    counted = type(stage)(
        **{**stage.__dict__, "forward": lambda p, x, c: calls.append(1) or stage.forward(p, x, c)}
    )

    outputs, fwd = S.forward(counted, params, inputs, StageContext())
    grads_out = [torch.ones_like(o) if o.is_floating_point() else None for o in outputs[: len(outputs) - 1]]
    with CountMatmuls() as ours:
        _, work = S.backward_input(fwd, grads_out)
        S.backward_weight(work)
    assert len(calls) == 1, "F, B and W must run the forward exactly once"

    p = {n: params[n].clone().requires_grad_() for n in stage.params}
    x = [t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    out = S.call(stage, p, x, StageContext())
    total = sum((o * g).sum() for o, g in zip(out, grads_out) if g is not None) + out[-1] * stage.losses[0]
    with CountMatmuls() as plain:
        total.backward()
    assert ours.count == plain.count > 0


def test_weight_gemms_are_deferred_when_backward_runs_on_another_thread():
    """CUDA's autograd runs backward on its own device threads; the tape must not depend on the
    calling thread (it is bound at F time)."""
    import threading

    cfg = tiny_config(num_hidden_layers=1)
    params, cases = stage_cases(cfg, random_batch(cfg, 2, 4))
    stage, inputs = next((s, i) for s, i in cases if s.name.endswith(".mlp"))
    outputs, fwd = S.forward(stage, params, inputs, StageContext())
    result = {}
    grads_out = [torch.ones_like(o) if o.is_floating_point() else None for o in outputs]
    thread = threading.Thread(target=lambda: result.setdefault("work", S.backward_input(fwd, grads_out)[1]))
    thread.start()
    thread.join()
    assert result["work"].partial == {} and len(result["work"].tape.entries) == 2
