"""``memory.policy = "auto"``: the time model of each policy (``fmoe.plan_time``), the plan's choice
of the fastest policy that fits (``fmoe.plan_policy``), how a recipe says auto or explicit, and
``fmoe train`` / ``fmoe plan`` running and printing the choice."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import tiny_config

from fmoe import plan, plan_policy, plan_time, train_setup
from fmoe import recipe as R
from fmoe.hf import family as family_module
from fmoe.memory_policy import MemoryPolicy
from fmoe.mesh import DIMS, Mesh
from fmoe.plan_activations import MicroBatch, moe_stages
from fmoe.stages import qwen3_moe

REPO = Path(__file__).resolve().parents[1]

# round numbers, so the formulas below come out by hand: 1 TFLOP/s dense, 2 attention, expert
# GEMMs 1 TFLOP/s at <= 2 rows per expert and 4 at >= 32, 1 GB/s elementwise and host copies
RATES = plan_time.Rates(
    dense_tflops=1.0, grouped_tflops=((2, 1.0), (32, 4.0)), attention_tflops=2.0,
    elementwise_gbps=1.0, host_copy_gbps=1.0,
)  # fmt: skip
T, E = 1e12, 1e9


def test_the_grouped_rate_interpolates_in_log_rows_and_never_drops_with_more_rows():
    assert RATES.grouped(1) == 1.0 and RATES.grouped(2) == 1.0
    assert RATES.grouped(8) == pytest.approx(2.5)  # log2 8 = 3, halfway from 1 to 5
    assert RATES.grouped(32) == RATES.grouped(10_000) == 4.0
    dip = plan_time.Rates(1.0, ((2, 3.0), (8, 1.0)), 1.0, 1.0, 1.0)  # a noisy measurement: 8 rows slower
    assert dip.grouped(8) == 3.0
    with pytest.raises(ValueError, match="Rates.grouped_tflops"):
        plan_time.Rates(1.0, ((8, 1.0), (2, 2.0)), 1.0, 1.0, 1.0)


def test_each_stage_s_work_is_its_formula_on_a_tiny_layer():
    # qwen3: hidden 32, 4 heads of 8 (q 32), 2 kv heads (kv 16), 8 experts, top 2, expert width 16
    cfg = tiny_config()
    mb = MicroBatch(sequences=2, seq_local=8, seq_full=8, compute_bytes=4, device="cpu")  # 16 tokens
    attn = plan_time.stage_work("qwen3_moe", cfg, "attn", True, mb, 8, 1)
    assert attn.dense_flops == 2 * 16 * (32 * (32 + 16 + 16) + 32 * 32) + 2 * 16 * 32 * 8
    assert attn.attention_flops == 2 * 16 * 4 * 4 * (8 + 8)  # 4 keys on average (causal), q.k and p.v
    assert attn.recomputable_bytes == 4 * 16 * (4 * 32 + 2 * (32 + 16))  # 2 norms of [16, 32], q/k norms
    mlp = plan_time.stage_work("qwen3_moe", cfg, "mlp", True, mb, 8, 2)
    assert mlp.grouped_flops == 6 * 32 * 32 * 16  # 32 rows: gate/up [32 -> 2x16] and down [16 -> 32]
    assert mlp.rows_per_expert == 32 * 2 / 8  # ep = 2: 4 experts a rank get the 32 rows
    assert mlp.recomputable_bytes == mlp.elementwise_bytes == 4 * 3 * 32 * 16  # SwiGLU [32, 2x16] -> [32, 16]
    # 8 rows per expert: 2.5 TFLOP/s; merged over 4 micro-batches, 32 rows: 4
    assert mlp.forward_s(RATES) == pytest.approx(mlp.grouped_flops / (2.5 * T) + mlp.elementwise_bytes / E)
    assert mlp.weight_s(RATES, 4) == pytest.approx(mlp.grouped_flops / (4.0 * T))


def _tiny():
    cfg = tiny_config(num_hidden_layers=2)
    model = qwen3_moe.build(cfg)
    mb = MicroBatch(2, 8, 8, 4, "cpu")
    works = [
        plan_time.stage_work("qwen3_moe", cfg, st.role, i in moe_stages(model), mb, model.num_experts, 1)
        for i, st in enumerate(model.stages)
    ]
    cost = lambda policy, pp=1: plan_time.policy_time("qwen3_moe", cfg, model, mb, 8, pp, 1, policy, RATES)  # noqa: E731
    return cfg, model, mb, works, cost


def test_each_policy_term_is_its_formula():
    cfg, model, mb, works, cost = _tiny()
    assert cost(MemoryPolicy()).extra_s == 0
    # full: every stage's F once more; selective: the norms' and SwiGLUs' bytes once more
    assert cost(MemoryPolicy(recompute="full")).recompute_s == pytest.approx(
        sum(w.forward_s(RATES) for w in works)
    )
    assert cost(MemoryPolicy(recompute="selective")).recompute_s == pytest.approx(
        sum(w.recomputable_bytes for w in works) / E
    )
    # window 1 at pp = 1: the expert W at one micro-batch's rows (4 per expert: 1 + 3 x 1/4 = 1.75
    # TFLOP/s) instead of 8 micro-batches' (32 per expert: 4 TFLOP/s)
    grouped = sum(w.grouped_flops for w in works)
    assert cost(MemoryPolicy(merge_window=1)).window_s == pytest.approx(
        grouped / (1.75 * T) - grouped / (4.0 * T)
    )
    assert cost(MemoryPolicy(merge_window=1), pp=2).window_s == 0  # pipelines do not merge
    # offload: every stage's saved bytes out and back at 1 GB/s, less the F and B they hide behind
    from fmoe.plan_activations import stage_activation_bytes

    moe = moe_stages(model)
    saved = sum(
        stage_activation_bytes("qwen3_moe", cfg, st, i in moe, mb, 8) for i, st in enumerate(model.stages)
    )
    f, b = sum(w.forward_s(RATES) for w in works), sum(w.backward_s(RATES) for w in works)
    assert cost(MemoryPolicy(offload=True)).offload_s == pytest.approx(
        max(0, saved / E - f) + max(0, saved / E - b)
    )


def test_full_costs_at_least_selective_at_least_none_and_a_window_at_least_the_step():
    *_, cost = _tiny()
    for window in (0, 1, 2):
        none, selective, full = (cost(MemoryPolicy(recompute=m, merge_window=window)).extra_s
                                 for m in ("none", "selective", "full"))  # fmt: skip
        assert full >= selective >= none >= 0
    assert cost(MemoryPolicy(merge_window=1)).extra_s >= cost(MemoryPolicy(merge_window=2)).extra_s > 0
    assert cost(MemoryPolicy(offload=True)).extra_s >= 0


# ------------------------------------------------------------------------------------------------
# the choice


def _qwen3_30b():
    recipe = R.load(REPO / "recipes" / "qwen3_30b_a3b.toml")
    recipe = dataclasses.replace(recipe, memory=MemoryPolicy(policy="auto"))  # whatever it ships with
    fam = family_module(recipe.model_family)
    return recipe, fam.build(recipe.model), fam.param_shapes(recipe.model)


def test_auto_picks_the_fastest_policy_that_fits():
    recipe, model, shapes = _qwen3_30b()
    sizes = (1, 8, 1, 1)  # 256 rows per expert a micro-batch: a merge window costs time
    unlimited = plan_policy.choose(recipe, model, shapes, sizes, None)
    assert unlimited.policy == MemoryPolicy() and unlimited.auto and unlimited.fits
    assert unlimited.cost.extra_s == 0
    peak = {p: plan.plan_layout(recipe, model, shapes, sizes, policy=p).peak
            for p in plan_policy.candidates(1, recipe.train.microbatches)}  # fmt: skip
    step, window1, window2, window4 = (peak[MemoryPolicy(merge_window=w)] for w in (0, 1, 2, 4))
    assert window1 < window2 < window4 < step
    # window 2 fits, window 4 (the table's top: it would cost nothing) does not; window 1 fits too,
    # and comes first among the candidates, but its shorter expert GEMMs cost more time
    limit = (window2 + window4) / 2
    chosen = plan_policy.choose(recipe, model, shapes, sizes, limit)
    assert chosen.fits and chosen.plan.peak <= limit < window4
    mb = plan.micro_batch(recipe, sizes, "cuda")
    extra = {p: plan_time.policy_time("qwen3_moe", recipe.model, model, mb, recipe.train.microbatches, 1, 1, p).extra_s
             for p in peak}  # fmt: skip
    fastest = min(extra[p] for p in peak if peak[p] <= limit)
    assert chosen.cost.extra_s == pytest.approx(fastest) and fastest > 0
    first_fitting = next(p for p in plan_policy.candidates(1, recipe.train.microbatches) if peak[p] <= limit)
    assert first_fitting == MemoryPolicy(merge_window=1) and extra[first_fitting] > fastest
    assert chosen.policy == MemoryPolicy(merge_window=2)
    # nothing fits: the smallest peak, marked so
    least = plan_policy.choose(recipe, model, shapes, sizes, 1.0)
    assert not least.fits and least.plan.peak == min(peak.values())


def test_an_explicit_policy_is_planned_as_set_whatever_the_limit():
    recipe, model, shapes = _qwen3_30b()
    explicit = MemoryPolicy(recompute="selective", merge_window=2)
    chosen = plan_policy.choose(recipe, model, shapes, (1, 8, 1, 1), 1.0, policy=explicit)
    assert chosen.policy == explicit and not chosen.auto and not chosen.fits


# ------------------------------------------------------------------------------------------------
# the recipe


def _recipe(tmp_path, dataset, memory=None, **sections):
    from test_train import recipe_dict

    d = recipe_dict(tmp_path, dataset, **sections)
    if memory is not None:
        d["memory"] = memory
    return d


def test_a_recipe_is_auto_unless_it_sets_a_policy_field(tmp_path, dataset):
    assert R.from_dict(_recipe(tmp_path, dataset)).memory == MemoryPolicy(policy="auto")
    for key, value in (
        ("recompute", "none"),
        ("merge_window", 0),
        ("offload", False),
        ("recompute_roles", []),
    ):
        assert R.from_dict(_recipe(tmp_path, dataset, {key: value})).memory == MemoryPolicy(), key
    assert R.from_dict(_recipe(tmp_path, dataset, {"policy": "explicit"})).memory == MemoryPolicy()
    # every field survives a recipe written from the policy in full and read back, "auto" too
    # (its fields at their defaults pick nothing over the plan)
    for policy in (MemoryPolicy(policy="auto"), MemoryPolicy(2, "selective", ("mlp",), True)):
        table = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(policy).items()}
        assert R.from_dict(_recipe(tmp_path, dataset, table)).memory == policy


def test_auto_beside_a_policy_field_is_one_line_naming_it(tmp_path, dataset, capsys):
    from test_train import toml_text

    from fmoe import cli

    path = tmp_path / "r.toml"
    path.write_text(toml_text(_recipe(tmp_path, dataset, {"policy": "auto", "merge_window": 1})))
    assert cli.main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "memory.policy = 'auto'" in err and "memory.merge_window" in err, (
        err
    )
    with pytest.raises(ValueError, match="MemoryPolicy.offload"):
        MemoryPolicy(policy="auto", offload=True)


def test_an_explicit_policy_that_does_not_fit_is_refused_naming_rank_term_and_policy(
    tmp_path, dataset, capsys
):
    from test_train import toml_text

    from fmoe import cli

    path = tmp_path / "r.toml"
    d = _recipe(tmp_path, dataset, {"recompute": "full"}, train={"device_memory_gib": 0.0001})
    path.write_text(toml_text(d))
    assert cli.main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    for part in (
        "rank 0 (pp 0)",
        "largest term is",
        "memory: recompute full, merge_window step, offload off",
    ):
        assert part in err, (part, err)


def _setup_choice(recipe):
    """What ``fmoe train``'s setup resolves the recipe's policy to, on one CPU process."""
    import torch

    fam = family_module(recipe.model_family)
    model, shapes = fam.build(recipe.model), fam.param_shapes(recipe.model)
    mesh = Mesh(1, 1, 1, 1, rank=0, coords=dict.fromkeys(DIMS, 0))
    return (
        train_setup.check_memory_plan(recipe, model, shapes, None, mesh, torch.device("cpu")),
        model,
        shapes,
    )


def test_train_resolves_auto_once_to_the_fastest_policy_that_fits(tmp_path, dataset):
    recipe = R.from_dict(_recipe(tmp_path, dataset, train={"microbatches": 4, "global_batch": 8}))
    (tmp_path / "log").mkdir()
    policy, model, shapes = _setup_choice(recipe)
    assert policy == MemoryPolicy()  # no limit on the CPU: the fastest
    text = (tmp_path / "log" / "memory_plan.txt").read_text()
    assert "memory: recompute none, merge_window step, offload off (chosen by memory.policy = 'auto'" in text
    assert "+0.0% time per layer" in text and "no limit, the fastest" in text
    # a limit the whole step's expert operands exceed: a policy that fits, which the run then uses
    step = plan.plan_layout(recipe, model, shapes, (1, 1, 1, 1), device="cpu").peak
    least = min(plan.plan_layout(recipe, model, shapes, (1, 1, 1, 1), device="cpu", policy=p).peak
                for p in plan_policy.candidates(1, 4))  # fmt: skip
    limited = dataclasses.replace(
        recipe, train=dataclasses.replace(recipe.train, device_memory_gib=(least + step) / 2 / plan.GiB)
    )
    policy, *_ = _setup_choice(limited)
    assert policy.policy == "explicit" and policy != MemoryPolicy()
    assert (
        plan.plan_layout(limited, model, shapes, (1, 1, 1, 1), device="cpu", policy=policy).peak
        < (least + step) / 2
    )
