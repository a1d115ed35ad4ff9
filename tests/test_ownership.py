"""Who may write which gradient (``fmoe/stage.py``'s ownership rules), and weight GEMMs on views of
parameters, against plain autograd in float64.

Autograd hands back one tensor object wherever a gradient passes through unchanged: ``x + pos`` with
``pos`` shaped like ``x`` gives ``x`` and ``pos`` the same gradient, ``sum`` an expanded view of its
seed. The runner adds later microbatches into the first gradient of a name in place, so any such
alias that reaches it would change a tensor a deferred W still reads. Every comparison here is a
relative norm in float64 against ``torch.autograd``; 1e-10 leaves room for the few dozen summed terms
(float64 rounding is ~1e-16 per term), while an aliasing bug shows up at 1e-2 or more.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from fmoe import dist as D
from fmoe import interpreter, pipeline, runner
from fmoe import stage as S
from fmoe.schedules.generators import generate
from fmoe.schedules.table import read_csv
from fmoe.stages import qwen3_moe
from fmoe.stages.primitives import fp8_training, grouped_linear, linear
from fmoe.stages.spec import CustomGrad, Model, Stage, StageContext

TOL = 1e-10
F64 = torch.float64


def rel(g: torch.Tensor, ref: torch.Tensor) -> float:
    return ((g - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def autograd_grads(model: Model, params, batch, microbatches: int) -> dict[str, torch.Tensor]:
    """Plain autograd of the step's loss (mean over microbatches of the weighted loss outputs), kept
    in float64 throughout (``runner.model_loss`` sums the terms in float32, as the runners report it)."""
    leaves = {n: t.clone().requires_grad_() for n, t in params.items()}
    total = 0.0
    for i, mb in enumerate(runner.split_microbatches(batch, microbatches)):
        carry: tuple = ()
        for stage in model.stages:
            outputs = S.call(stage, leaves, runner.stage_inputs(stage, carry, mb), StageContext(microbatch=i))
            carry, terms = runner.split_outputs(stage, outputs)
            total = total + sum(terms)
    (total / microbatches).backward()
    return {n: leaf.grad for n, leaf in leaves.items()}


def worst(grads, ref) -> float:
    assert set(grads) == set(ref)
    return max(rel(grads[n], ref[n]) for n in ref)


# ------------------------------------------------------------------------------------------------
# defect 1: a gradient the runner adopts as an accumulator must not be one W still reads


def test_deferred_w_of_the_previous_stage_reads_the_gradient_b_handed_it_unchanged():
    """The issue's reproduction: stage b's ``pos`` gradient is the very tensor it hands stage a, whose
    deferred W reads it after the runner has added microbatch 1's ``pos`` gradient into it."""
    gen = torch.Generator().manual_seed(0)
    a = Stage("a", lambda p, i, c: (linear(i[0], p["w"]),), ("a.w",), "a.")
    b = Stage("b", lambda p, i, c: (torch.tanh(i[0] + p["pos"]),), ("b.pos",), "b.")
    params = {
        "a.w": torch.randn(4, 4, dtype=F64, generator=gen),
        "b.pos": torch.randn(1, 3, 4, dtype=F64, generator=gen),
    }
    xs = [torch.randn(1, 3, 4, dtype=F64, generator=gen) for _ in range(2)]
    works = []
    for x in xs:
        (y,), fa = S.forward(a, params, (x,), StageContext())
        (z,), fb = S.forward(b, params, (y,), StageContext())
        (gy,), wb = S.backward_input(fb, (torch.ones_like(z),))
        _, wa = S.backward_input(fa, (gy,))
        assert len(wa.tape.entries) == 1, "a's weight GEMM must be deferred to W"
        works.append((wa, wb))
    total: dict[str, torch.Tensor] = {}
    for work in (works[0][1], works[1][1], works[0][0], works[1][0]):  # every B, then W: b's first
        runner.weight_grads([work], into=total)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    sum(torch.tanh(linear(x, leaves["a.w"]) + leaves["b.pos"]).sum() for x in xs).backward()
    for name, leaf in leaves.items():
        assert rel(total[name], leaf.grad) <= TOL, name


def test_two_parameters_given_one_gradient_object_accumulate_separately():
    """``x + p1 + p2`` gives p1 and p2 the same gradient object: each must get its own accumulator."""
    gen = torch.Generator().manual_seed(1)
    stage = Stage("s", lambda p, i, c: ((i[0] + p["p1"] + p["p2"]).pow(2).sum(),), ("s.p1", "s.p2"), "s.",
                  losses=(1.0,))  # fmt: skip
    params = {n: torch.randn(1, 3, dtype=F64, generator=gen) for n in stage.params}
    xs = [torch.randn(1, 3, dtype=F64, generator=gen) for _ in range(3)]
    total: dict[str, torch.Tensor] = {}
    for x in xs:
        _, fwd = S.forward(stage, params, (x,), StageContext())
        _, work = S.backward_input(fwd, ())
        assert (
            work.partial["s.p1"].untyped_storage().data_ptr()
            != work.partial["s.p2"].untyped_storage().data_ptr()
        )
        runner.weight_grads([work], into=total)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    sum((x + leaves["s.p1"] + leaves["s.p2"]).pow(2).sum() for x in xs).backward()
    for name, leaf in leaves.items():
        assert rel(total[name], leaf.grad) <= TOL, name


def test_the_expanded_gradient_of_a_summed_parameter_is_a_gradient_one_can_add_into():
    """``p.sum()`` gives p a stride-0 view of the loss seed; the runner adds microbatches into it."""
    gen = torch.Generator().manual_seed(2)
    stage = Stage("s", lambda p, i, c: ((i[0] * p["scale"]).sum() + p["bias"].sum(),), ("s.scale", "s.bias"),
                  "s.", losses=(1.0,))  # fmt: skip
    params = {n: torch.randn(4, dtype=F64, generator=gen) for n in stage.params}
    xs = [torch.randn(4, dtype=F64, generator=gen) for _ in range(2)]
    total: dict[str, torch.Tensor] = {}
    for x in xs:
        _, fwd = S.forward(stage, params, (x,), StageContext())
        _, work = S.backward_input(fwd, (), loss_scale=0.5)
        runner.weight_grads([work], into=total)
    assert torch.equal(total["s.bias"], torch.ones(4, dtype=F64))
    assert rel(total["s.scale"], 0.5 * (xs[0] + xs[1])) <= TOL


def test_a_custom_w_result_that_its_b_handed_on_is_copied_before_the_runner_adds_into_it():
    """A hand-written B that returns its output gradient as the input gradient and W that returns it
    again as ``pos``'s gradient: the runner must not add into the tensor the previous stage reads."""

    def custom_forward(p, inputs, ctx):
        return (inputs[0] + p["pos"],), None

    def custom_backward_input(p, saved, grad_outputs):
        (dy,) = grad_outputs
        return (dy,), dy

    custom = CustomGrad(custom_forward, custom_backward_input, lambda p, dy: {"pos": dy})
    stage = Stage("c", lambda p, i, c: (i[0] + p["pos"],), ("c.pos",), "c.", custom=custom)
    params = {"c.pos": torch.zeros(3, dtype=F64)}
    total: dict[str, torch.Tensor] = {}
    handed = []
    for k in range(2):
        _, fwd = S.forward(stage, params, (torch.zeros(3, dtype=F64),), StageContext())
        dy = torch.full((3,), float(k + 1), dtype=F64)
        (dx,), work = S.backward_input(fwd, (dy,))
        handed.append(dx)
        runner.weight_grads([work], into=total)
    assert torch.equal(total["c.pos"], torch.full((3,), 3.0, dtype=F64))
    assert [h.tolist() for h in handed] == [[1.0] * 3, [2.0] * 3], "a gradient handed on was changed"


# ------------------------------------------------------------------------------------------------
# defect 2: weight GEMMs on views of parameters


def test_linear_on_views_of_a_fused_parameter_defers_each_gemm_into_its_slice():
    """``chunk`` of a fused weight, a column slice and a transpose: deferred to W (B computes none of
    these parameters' gradients), and W's gradients equal autograd's."""
    gen = torch.Generator().manual_seed(3)

    def fwd(p, inputs, ctx):
        (x,) = inputs
        wq, wk = p["qk"].chunk(2)
        return (
            linear(x, wq) * torch.tanh(linear(x, wk)) + linear(x, p["w"].t()) + linear(x, p["g"][:, 1:4].t()),
        )

    stage = Stage("a", fwd, ("a.qk", "a.w", "a.g"), "a.")
    params = {"a.qk": torch.randn(6, 3, dtype=F64, generator=gen), "a.w": torch.randn(3, 3, dtype=F64, generator=gen),
              "a.g": torch.randn(3, 5, dtype=F64, generator=gen)}  # fmt: skip
    x = torch.randn(2, 4, 3, dtype=F64, generator=gen)
    dy = torch.randn(2, 4, 3, dtype=F64, generator=gen)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    xr = x.clone().requires_grad_()
    (S.call(stage, leaves, (xr,), StageContext())[0] * dy).sum().backward()
    # the caller's accumulators (ones), one of them laid out unlike its parameter (column-major)
    ones = {"a.qk": torch.ones(6, 3, dtype=F64), "a.w": torch.ones(3, 3, dtype=F64),
            "a.g": torch.ones(5, 3, dtype=F64).t()}  # fmt: skip
    for accumulator in (None, ones):
        (_,), f = S.forward(stage, params, (x,), StageContext())
        (dx,), work = S.backward_input(f, (dy,))
        assert work.partial == {} and len(work.tape.entries) == 4
        assert rel(dx, xr.grad) <= TOL
        grads = S.backward_weight(work, into=accumulator)
        assert accumulator is None or grads == {}, "W adds into the caller's tensors, returns nothing"
        for name, leaf in leaves.items():
            got = grads[name] if accumulator is None else accumulator[name] - 1
            assert rel(got, leaf.grad) <= TOL, name


def test_grouped_linear_on_views_of_a_fused_expert_weight_defers_into_its_slices():
    gen = torch.Generator().manual_seed(4)
    offs = torch.tensor([2, 2, 5], dtype=torch.int32)  # expert 1 gets no rows

    def fwd(p, inputs, ctx):
        gate, up = p["gate_up"].chunk(2, dim=1)  # [E, I, H] views of [E, 2I, H]
        return (F.silu(grouped_linear(inputs[0], gate, offs)) * grouped_linear(inputs[0], up, offs),)

    stage = Stage("e", fwd, ("e.gate_up",), "e.")
    params = {"e.gate_up": torch.randn(3, 8, 3, dtype=F64, generator=gen)}
    x = torch.randn(5, 3, dtype=F64, generator=gen)
    dy = torch.randn(5, 4, dtype=F64, generator=gen)
    (_,), f = S.forward(stage, params, (x,), StageContext())
    _, work = S.backward_input(f, (dy,))
    assert work.partial == {} and len(work.tape.entries) == 2
    merge_later: dict = {}
    grads = S.backward_weight(work, merge_later=merge_later)
    assert merge_later == {}, "GEMMs on views run in W, not in a step's merged GEMM"
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    (S.call(stage, leaves, (x,), StageContext())[0] * dy).sum().backward()
    assert rel(grads["e.gate_up"], leaves["e.gate_up"].grad) <= TOL
    assert torch.equal(grads["e.gate_up"][1], torch.zeros(8, 3, dtype=F64))


def test_a_weight_computed_from_a_parameter_gets_its_gradient_in_b():
    """``linear(x, p["w"] * 2)``: not a parameter nor a view of one, so autograd differentiates it."""
    gen = torch.Generator().manual_seed(5)
    stage = Stage("a", lambda p, i, c: (linear(i[0], p["w"] * 2),), ("a.w",), "a.")
    params = {"a.w": torch.randn(3, 3, dtype=F64, generator=gen)}
    x, dy = torch.randn(4, 3, dtype=F64, generator=gen), torch.randn(4, 3, dtype=F64, generator=gen)
    (_,), f = S.forward(stage, params, (x,), StageContext())
    _, work = S.backward_input(f, (dy,))
    assert work.tape.entries == [] and set(work.partial) == {"a.w"}
    assert rel(S.backward_weight(work)["a.w"], 2 * dy.t() @ x) <= TOL


@pytest.mark.parametrize("grouped,master", [(False, False), (True, False), (True, True)],
                         ids=["linear", "grouped_linear", "grouped_linear_fp32_master"])  # fmt: skip
def test_fp8_gemms_on_views_of_a_fused_weight_land_in_their_slices(monkeypatch, grouped, master):
    """The FP8 primitives' tape entries record the view too: W equals plain autograd of the same
    FP8 function (the same quantized GEMMs, so bit for bit), and FP8 actually ran. master: bf16
    activations on an fp32 expert weight (what an FP8 trainer step hands over,
    ``fp8_mode.quantized_from_master``): the gradient comes out in bf16, each slice the bits of
    autograd's (which widens it to the weight's fp32)."""
    monkeypatch.setenv("FMOE_KERNEL_BACKEND", "torch")
    gen = torch.Generator().manual_seed(6)
    offs = torch.tensor([64, 64, 128], dtype=torch.int32)
    if grouped:
        weight = torch.randn(3, 256, 128, generator=gen) * 0.05

        def fwd(p, inputs, ctx):
            gate, up = p["w"].chunk(2, dim=1)
            return (grouped_linear(inputs[0], gate, offs) * grouped_linear(inputs[0], up, offs),)
    else:
        weight = torch.randn(256, 128, generator=gen) * 0.05

        def fwd(p, inputs, ctx):
            q, k = p["w"].chunk(2)
            return (linear(inputs[0], q) * linear(inputs[0], k),)

    stage = Stage("f", fwd, ("f.w",), "f.")
    params = {"f.w": weight}
    x, dy = torch.randn(128, 128, generator=gen), torch.randn(128, 128, generator=gen)
    if master:
        x, dy = x.bfloat16(), dy.bfloat16()
    with fp8_training():
        (y8,), f = S.forward(stage, params, (x,), StageContext())
        _, work = S.backward_input(f, (dy,))
        assert len(work.tape.entries) == 2
        got = S.backward_weight(work)["f.w"]
        leaf = weight.clone().requires_grad_()
        (S.call(stage, {"f.w": leaf}, (x,), StageContext())[0] * dy).sum().backward()
    assert got.dtype == (torch.bfloat16 if master else torch.float32)
    assert torch.equal(got.float(), leaf.grad)
    if not master:  # (bf16 activations on an fp32 weight run only as FP8 GEMMs)
        (y,), _ = S.forward(stage, params, (x,), StageContext())
        assert not torch.equal(y, y8), "the FP8 path must actually run"


# ------------------------------------------------------------------------------------------------
# a user-written model: weights shaped like activations, a fused weight split by chunk, two outputs,
# plain torch ops on weights, an expert weight split by chunk

H, SEQ, VOCAB, EXPERTS = 8, 4, 16, 3
OFFS = (1, 1, 4)  # rows of each expert (cumulative): expert 1 gets none


def _embed(p, inputs, ctx):
    (tokens,) = inputs
    h = p["emb"][tokens] + p["pos"] + p["pos_b"]  # pos and pos_b get one gradient object
    return h, h * p["scale"]  # two outputs


def _fused(p, inputs, ctx):
    h, u = inputs
    wq, wk = p["qk"].chunk(2)  # a fused weight split by chunk
    gate, up = p["experts"].chunk(2, dim=1)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    rows = u.reshape(-1, H)
    expert = F.silu(grouped_linear(rows, gate, offs)) * grouped_linear(rows, up, offs)
    b = linear(u, wk) + u @ p["m"] + linear(u, p["m"].t() * 0.5) + expert.view_as(u)
    return linear(h, wq), b


def _mix(p, inputs, ctx):
    a, b = inputs
    # a's gradient is pos's; b's gradient is the output gradient itself; b passes through unchanged
    return linear(torch.tanh(a + p["pos"]), p["w"]) + b, b


def _head(p, inputs, ctx):
    y, y2 = inputs[:2]
    labels = inputs[2]
    v = y + y2 + p["pos"]  # y, y2 and pos get one gradient object
    logits = linear(v, p["head"])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)) + 0.1 * p["bias"].sum()
    return (loss,)


def user_model() -> Model:
    stages = (
        Stage("s0", _embed, ("s0.emb", "s0.pos", "s0.pos_b", "s0.scale"), "s0.", batch_inputs=("tokens",)),
        Stage("s1", _fused, ("s1.qk", "s1.m", "s1.experts"), "s1."),
        Stage("s2", _mix, ("s2.pos", "s2.w"), "s2."),
        Stage("s3", _head, ("s3.pos", "s3.head", "s3.bias"), "s3.", batch_inputs=("labels",), losses=(1.0,)),
    )
    shapes = {"s0.emb": (VOCAB, H), "s0.pos": (1, SEQ, H), "s0.pos_b": (1, SEQ, H), "s0.scale": (H,),
              "s1.qk": (2 * H, H), "s1.m": (H, H), "s1.experts": (EXPERTS, 2 * H, H), "s2.pos": (1, SEQ, H),
              "s2.w": (H, H), "s3.pos": (1, SEQ, H), "s3.head": (VOCAB, H), "s3.bias": (3,)}  # fmt: skip

    def init(seed: int = 0, dtype=F64, device=None):
        gen = torch.Generator().manual_seed(seed)
        return {n: (torch.randn(s, generator=gen, dtype=dtype) * 0.5).to(device) for n, s in shapes.items()}

    return Model(config=None, stages=stages, init=init)


def user_batch(microbatches: int, seed: int = 7) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, VOCAB, (microbatches, SEQ), generator=gen),
            "labels": torch.randint(0, VOCAB, (microbatches, SEQ), generator=gen)}  # fmt: skip


def test_user_model_run_sequential_equals_autograd():
    model, microbatches = user_model(), 3
    params, batch = model.init(seed=1), user_batch(microbatches)
    ref = autograd_grads(model, params, batch, microbatches)
    for merge in (True, False):
        result = runner.run_sequential(model, params, batch, microbatches, merge_expert_grads=merge)
        assert worst(result.grads, ref) <= TOL


ORDERS = ["forward", "reverse", "stage-major reversed", "shuffled"]


@pytest.mark.parametrize("order", ORDERS)
def test_user_model_with_every_w_deferred_after_every_b_equals_autograd(order):
    """F and B of every microbatch first, then the W of every (microbatch, stage) in ``order``."""
    model, microbatches = user_model(), 3
    params, batch = model.init(seed=1), user_batch(microbatches)
    works = []  # (microbatch, stage index, work)
    for i, mb in enumerate(runner.split_microbatches(batch, microbatches)):
        fwds, _ = runner.forward_microbatch(model, params, mb, StageContext(microbatch=i))
        works += [(i, s, w) for s, w in enumerate(runner.backward_microbatch(fwds, 1.0 / microbatches))]
    if order == "reverse":
        works.reverse()
    elif order == "stage-major reversed":
        works.sort(key=lambda t: (-t[1], t[0]))
    elif order == "shuffled":
        random.Random(0).shuffle(works)
    grads: dict[str, torch.Tensor] = {}
    merge_later: dict = {}
    for _, _, work in works:
        runner.weight_grads([work], merge_later, into=grads)
    runner.accumulate(grads, runner.merged_weight_grads(merge_later))
    assert worst(grads, autograd_grads(model, params, batch, microbatches)) <= TOL


# ------------------------------------------------------------------------------------------------
# the interpreter, 2 gloo ranks, V placement: rank r holds stage r (chunk 0) and stage 3 - r (chunk 1)


def v_table(w_order: list[tuple[int, int]], microbatches: int):
    """Every F, then every B (stage order), then the Ws in ``w_order`` ((microbatch, chunk) pairs),
    the same order on both ranks; the interpreter lowers it (adds the transfers)."""
    rows = ["rank,action,microbatch,chunk"]
    for rank in range(2):
        ms = range(microbatches)
        rows += [f"{rank},F,{m},0" for m in ms] + [f"{rank},F,{m},1" for m in ms]
        rows += [f"{rank},B,{m},1" for m in ms] + [f"{rank},B,{m},0" for m in ms]
        rows += [f"{rank},W,{m},{c}" for m, c in w_order]
    header = f"# fmoe-schedule pp=2 microbatches={microbatches} placement=v chunks=2 name=w-deferred\n"
    return read_csv("w-deferred.csv", text=header + "\n".join(rows) + "\n")


def v_worker(rank: int, world: int, group, microbatches: int) -> dict:
    model = user_model()
    params, batch = model.init(seed=1), user_batch(microbatches)
    ref = autograd_grads(model, params, batch, microbatches)
    loss = runner.run_sequential(model, params, batch, microbatches).loss
    pairs = list(itertools.product(range(microbatches), range(2)))
    tables = {
        "chunk 1's Ws first": v_table(sorted(pairs, key=lambda t: (-t[1], t[0])), microbatches),
        "shuffled": v_table(random.Random(1).sample(pairs, len(pairs)), microbatches),
        "zbv": generate("zbv", world, microbatches),
        "dualpipev": generate("dualpipev", world, microbatches),
    }
    out = {}
    for name, table in tables.items():
        names = pipeline.local_param_names(model, table, rank=rank)
        result = interpreter.run_schedule(table, model, {n: params[n] for n in names}, batch, group)
        out[name] = (worst(result.grads, {n: ref[n] for n in names}), torch.equal(result.loss, loss))
    return out


def test_user_model_on_two_ranks_with_v_placement_equals_autograd():
    """Rank 1 hands gradients from its chunk 1 (stage 2) to its chunk 0 (stage 1) as the same objects;
    stage 2's ``pos`` gradient is the one it hands on, and stage 1's deferred W reads it."""
    got = D.spawn(v_worker, 2, (4,), timeout_s=120)
    for r in got:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}"
        for name, (worst_rel, loss_equal) in r.value.items():
            assert worst_rel <= TOL, (r.rank, name, worst_rel)
            assert loss_equal, (r.rank, name)


# ------------------------------------------------------------------------------------------------
# no alias, no copy


def test_qwen3_stages_keep_the_gradients_autograd_returned_without_a_copy(monkeypatch):
    """On the ordinary path nothing aliases: every partial gradient B keeps (norm weights, router) is
    the very tensor ``torch.autograd.grad`` returned. (The embedding's is not one: its rows go on
    the tape for W, ``primitives.embedding``.)"""
    from conftest import random_batch, tiny_config

    returned: set[int] = set()
    real = torch.autograd.grad

    def spy(*args, **kwargs):
        grads = real(*args, **kwargs)
        returned.update(id(g) for g in grads if g is not None)
        return grads

    monkeypatch.setattr(torch.autograd, "grad", spy)
    cfg = tiny_config()
    model = qwen3_moe.build(cfg)
    params = model.init(seed=0)
    (mb,) = runner.split_microbatches(random_batch(cfg, 2, 8), 1)
    fwds, _ = runner.forward_microbatch(model, params, mb, StageContext())
    works = runner.backward_microbatch(fwds, 1.0)
    partial = {n: g for w in works for n, g in w.partial.items()}
    assert any(n.endswith("layernorm.weight") for n in partial) and "model.embed_tokens.weight" not in partial
    assert all(id(g) in returned for g in partial.values()), "a partial gradient was copied"
