"""The schedule interpreter against the sequential runner, on gloo with several CPU processes.

Each pipeline size runs in one spawn (process startup dominates on 2 cores): the workers run every
case on the same process group and hand back plain numbers, which the tests below assert on.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import random_batch, relative_error, tiny_config

from fmoe import dist as D
from fmoe import interpreter, pipeline, runner
from fmoe.schedules.generators import generate
from fmoe.schedules.table import ScheduleError, read_csv
from fmoe.schedules.verify import lower, validate
from fmoe.stages import qwen3_moe

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipe", "dualpipev"]
CSV = Path(__file__).with_name("pp2_handwritten_fb.csv")
ROUTERS = [f"model.layers.{i}.mlp.gate.weight" for i in (1, 2, 3)]


def config(aux: float):
    # 4 layers (one dense, three MoE): at pp=4 with two chunks some pipeline stages are empty
    return tiny_config(num_hidden_layers=4, mlp_only_layers=(0,), router_aux_loss_coef=aux)


# float32 gradients summed over at most 8 microbatches in another order than the sequential run's:
# each element is off by at most ~8 float32 roundings (8 x 2^-24 = 4.8e-7) relative to its magnitude
GRAD_RTOL = 1e-6


def compare(result, ref, names) -> dict:
    """Plain numbers for the tests: bitwise loss checks and each gradient's relative error."""
    return {
        "loss_equal": torch.equal(result.loss, ref.loss),
        "mb_losses_equal": all(torch.equal(a, b) for a, b in zip(result.microbatch_losses, ref.microbatch_losses, strict=True)),
        "same_names": sorted(result.grads) == sorted(names),
        "worst_rel": max(relative_error(g, ref.grads[n]) for n, g in result.grads.items()),
        "routers": {n: (result.grads[n].abs().max().item(), relative_error(result.grads[n], ref.grads[n]))
                    for n in ROUTERS if n in result.grads},
    }  # fmt: skip


def counting(model, calls: list):
    """The model with every stage forward counting its calls into ``calls`` (a test probe)."""

    def wrap(fn):
        def counted(p, inputs, ctx):
            calls.append(1)
            return fn(p, inputs, ctx)

        return counted

    return dataclasses.replace(
        model, stages=tuple(dataclasses.replace(s, forward=wrap(s.forward)) for s in model.stages)
    )


def worker(rank: int, world: int, group, microbatches: int, extras: bool) -> dict:
    out: dict = {}
    batch = random_batch(config(0.0), microbatches, 8, seed=5)
    seq_off = None
    for aux in (0.0, 0.01):
        model = qwen3_moe.build(config(aux))
        params = model.init(seed=1)
        ref = runner.run_sequential(model, params, batch, microbatches)
        if aux == 0.0:
            seq_off = ref
        for name in SCHEDULES:
            schedule = generate(name, world, microbatches)
            names = pipeline.local_param_names(model, schedule, rank=rank)
            local = {n: params[n] for n in names}
            result = interpreter.pipeline_step(schedule, model, local, batch, group)
            case = compare(result, ref, names)
            # the aux loss's own contribution to each router gradient, and its share of the gradient
            case["aux_part"] = {n: (relative_error(result.grads[n] - seq_off.grads[n], ref.grads[n] - seq_off.grads[n]),
                                    relative_error(ref.grads[n], seq_off.grads[n]))
                                for n in ROUTERS if n in result.grads and aux}  # fmt: skip
            out[(name, aux)] = case
    if extras:
        model = qwen3_moe.build(config(0.01))
        params = model.init(seed=1)
        table = read_csv(CSV)
        ref = runner.run_sequential(
            model, params, random_batch(config(0.01), table.microbatches, 8, seed=5), table.microbatches
        )
        result = interpreter.run_schedule(
            table, model, params, random_batch(config(0.01), table.microbatches, 8, seed=5), group
        )
        out["csv"] = compare(result, ref, pipeline.local_param_names(model, table, rank=rank))
        calls: list = []
        try:
            interpreter.run_schedule(
                broken_table(world, microbatches), counting(model, calls), params, batch, group
            )
            out["invalid"] = ("no error", len(calls))
        except ScheduleError as e:
            out["invalid"] = (str(e), len(calls))
        # the group is still usable after a rejected table: run once more
        again = interpreter.run_schedule(generate("1f1b", world, microbatches), model, params, batch, group)
        out["after_invalid"] = torch.equal(
            again.loss, runner.run_sequential(model, params, batch, microbatches).loss
        )
    return out


def broken_table(pp: int, microbatches: int):
    """1F1B with the last rank's last full backward dropped."""
    s = generate("1f1b", pp, microbatches)
    actions = list(s.actions)
    actions[-1] = actions[-1][:-1]
    return dataclasses.replace(s, actions=tuple(actions))


@pytest.fixture(scope="module")
def runs() -> dict:
    results = {}
    for pp, mb in ((2, 4), (4, 8)):
        got = D.spawn(worker, pp, (mb, pp == 2), timeout_s=170)
        for r in got:
            assert r.ok, f"pp={pp} rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}"
        results[pp] = [r.value for r in got]
    return results


@pytest.mark.parametrize("aux", [0.0, 0.01], ids=["no_aux", "aux"])
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", SCHEDULES)
def test_pipelined_loss_bitwise_equals_sequential_and_grads_match(runs, name, pp, aux):
    for rank, value in enumerate(runs[pp]):
        case = value[(name, aux)]
        assert case["loss_equal"] and case["mb_losses_equal"], f"rank {rank}"
        assert case["same_names"], f"rank {rank} returned gradients for other parameters than it holds"
        assert case["worst_rel"] <= GRAD_RTOL, f"rank {rank}: gradient relative error {case['worst_rel']}"


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", SCHEDULES)
def test_router_aux_loss_gradient_reaches_every_router(runs, name, pp):
    seen = set()
    for value in runs[pp]:
        case = value[(name, 0.01)]
        for n, (peak, rel) in case["routers"].items():
            seen.add(n)
            assert peak > 0 and rel <= GRAD_RTOL, (n, rel)
        for n, (rel, share) in case["aux_part"].items():
            # share = ||ref - off|| / ||off||; the aux part (ref - off) is off by ||result - ref|| <=
            # GRAD_RTOL ||ref|| <= GRAD_RTOL (1 + share) ||off||, so relative to itself by the bound below
            assert share > 1e-3, f"{n}: the aux loss changes the router gradient by only {share}"
            assert rel <= GRAD_RTOL * (1 + share) / share, (
                f"{n}: the aux loss's part of the gradient is off by {rel}"
            )
    assert seen == set(ROUTERS)


def test_handwritten_csv_table_with_fb_and_explicit_transfers_matches_sequential(runs):
    for value in runs[2]:
        case = value["csv"]
        assert case["loss_equal"] and case["same_names"] and case["worst_rel"] <= GRAD_RTOL, case


def test_invalid_table_fails_on_every_rank_before_any_compute(runs):
    with pytest.raises(ScheduleError) as expected:
        validate(broken_table(2, 4))
    for value in runs[2]:
        message, calls = value["invalid"]
        assert message == str(expected.value)
        assert calls == 0
        assert value["after_invalid"]


def test_a_table_is_validated_and_lowered_once_per_value_and_an_invalid_one_every_time(monkeypatch):
    """The interpreter keeps a table's lowered form keyed by the table's value (pp, microbatches,
    placement, chunks, rows, name), not by the object: an equal table made again is not lowered again."""
    lowered: list = []
    monkeypatch.setattr(interpreter, "lower", lambda s: lowered.append(s) or lower(s))
    interpreter._checked_and_lowered.cache_clear()
    a, b = generate("zbv", 2, 4), generate("zbv", 2, 4)
    assert a is not b and a == b
    assert interpreter.rank_actions(a, 1) == interpreter.rank_actions(b, 1) == lower(a).actions[1]
    assert len(lowered) == 1
    for _ in range(2):
        with pytest.raises(ScheduleError, match="has no B"):
            interpreter.rank_actions(broken_table(2, 4), 1)
    assert len(lowered) == 1


def failing_worker(rank: int, world: int, group) -> str:
    model = qwen3_moe.build(config(0.01))

    def boom(p, inputs, ctx):
        if ctx.microbatch == 1:
            raise RuntimeError("boom: injected failure in layers.2.mlp")
        return target.forward(p, inputs, ctx)

    stages = list(model.stages)
    at = next(i for i, s in enumerate(stages) if s.name == "layers.2.mlp")
    target = stages[at]
    stages[at] = dataclasses.replace(target, forward=boom)
    model = dataclasses.replace(model, stages=tuple(stages))
    batch = random_batch(config(0.01), 6, 8)
    interpreter.run_schedule(generate("1f1b", world, 6), model, model.init(seed=0), batch, group)
    return "finished"


def test_rank_failing_mid_schedule_brings_every_rank_down_with_its_message():
    # pp=3: layers.2 sits on rank 1; rank 2 waits on rank 1 and rank 0 on both
    assert any(model_stage == "layers.2.mlp" for model_stage in
               (qwen3_moe.build(config(0.01)).stages[i].name for i in pipeline.stage_map(qwen3_moe.build(config(0.01)), "loop", 3, 1)[(1, 0)]))  # fmt: skip
    results = D.spawn(failing_worker, 3, timeout_s=90)
    for r in results:
        assert not r.ok and r.error_type == "PipelineError", (r.rank, r.error_type, r.error)
        assert "pipeline rank 1 failed" in r.error and "boom: injected failure" in r.error, r.error
        # the failing rank's whole table follows, its failing row marked (what a reader needs to place it)
        table = r.error.split("\n", 1)[1].splitlines()
        assert table[0] == "rank 1's rows:", r.error
        marked = [line for line in table if line.endswith("<-- failed here")]
        assert len(marked) == 1 and "(mb=" in marked[0], r.error
