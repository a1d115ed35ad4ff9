"""The memory policy (``fmoe.memory_policy``): recomputation changes no bit, the merge window only the
order of an expert gradient's sums, and both give memory back (measured).

Recomputation re-runs the same operations on the same values, so "full" and "selective" must give
bitwise the losses, statistics and gradients of "none" - in one process, under every pipeline
schedule at pp = 2 and at dp = 2, cp = 2 and ep = 2 (gloo, CPU). A recompute that read another
value than F did would change them; the one way it could (an input or parameter written in place
between F and B) is refused by B.
"""

from __future__ import annotations

import dataclasses

import memory_probe
import pytest
import torch
from conftest import random_batch, tiny_config

from fmoe import dist as D
from fmoe import memory, offload, parallel, pipeline, recipe, runner, sharding
from fmoe import stage as S
from fmoe.memory_policy import MemoryPolicy
from fmoe.mesh import build_mesh
from fmoe.schedules.generators import generate
from fmoe.stages import qwen3_moe
from fmoe.stages.primitives import grouped_mm_weight_grad
from fmoe.stages.spec import StageContext

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipe", "dualpipev"]
RECOMPUTING = [
    MemoryPolicy(recompute="full"),
    MemoryPolicy(recompute="selective"),
    MemoryPolicy(recompute="full", recompute_roles=("attn", "mlp", "head")),
    MemoryPolicy(offload=True),
    MemoryPolicy(recompute="selective", recompute_roles=("mlp",), offload=True),
]


@pytest.fixture(autouse=True)
def offload_everything(monkeypatch):
    """Offload saved tensors of every size: the tiny models' are far below ``offload.MIN_BYTES``."""
    monkeypatch.setattr(offload, "MIN_BYTES", 0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: on a loaded 2-core machine two threads wait on each other at every op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def setup(layers: int = 3):
    cfg = tiny_config(num_hidden_layers=layers, mlp_only_layers=(0,), router_aux_loss_coef=0.01)
    model = qwen3_moe.build(cfg)
    return cfg, model, model.init(seed=1)


def differences(a: runner.StepResult, b: runner.StepResult) -> list[str]:
    """What is not bitwise equal between two steps' results (loss, each micro-batch loss, statistics,
    gradients), as names; empty when all is."""
    out = [] if torch.equal(a.loss, b.loss) else ["loss"]
    out += [
        f"loss {m}"
        for m, (x, y) in enumerate(zip(a.microbatch_losses, b.microbatch_losses))
        if not torch.equal(x, y)
    ]
    out += [k for k in a.statistics if not torch.equal(a.statistics[k], b.statistics[k])]
    if list(a.grads) != list(b.grads):
        return [*out, "gradient names"]
    return out + [n for n in a.grads if not torch.equal(a.grads[n], b.grads[n])]  # fmt: skip


# ------------------------------------------------------------------------------------------------
# the recipe section


def test_memory_section_reaches_the_recipe_and_a_bad_value_names_its_field():
    data = {"model": {"family": "qwen3_moe"}}
    assert recipe.from_dict(data, "r.toml").memory == MemoryPolicy(
        policy="auto"
    )  # no field set: the plan picks
    got = recipe.from_dict(
        {**data, "memory": {"merge_window": 2, "recompute": "full", "recompute_roles": ["mlp"]}}
    )
    assert got.memory == MemoryPolicy(2, "full", ("mlp",))
    bad = [
        ({"merge_window": -1}, "memory.merge_window must be an int >= 0"),
        ({"merge_window": 1.5}, "memory.merge_window must be int"),
        ({"recompute": "some"}, "memory.recompute must be one of"),
        ({"recompute_roles": ["attention"]}, "memory.recompute_roles: unknown role 'attention'"),
        ({"recompute_roles": ["mlp"]}, "memory.recompute_roles is set but memory.recompute is 'none'"),
        ({"offload": 1}, "memory.offload must be bool"),
        ({"prefetch": True}, "memory: unknown key 'prefetch'"),
    ]
    for section, message in bad:
        with pytest.raises(recipe.RecipeError) as e:
            recipe.from_dict({**data, "memory": section}, "r.toml")
        assert str(e.value).startswith("r.toml: ") and message in str(e.value), str(e.value)
        assert "\n" not in str(e.value)


def test_exchange_stages_are_not_recomputed_under_expert_parallelism():
    _, model, _ = setup()
    policy = MemoryPolicy(recompute="full")
    by_role = {s.role: s for s in model.stages}
    ep = StageContext(groups={"ep": object()})
    assert {r: policy.stage_mode(s, StageContext()) for r, s in by_role.items()} == dict.fromkeys(
        by_role, "full"
    )
    assert [r for r, s in by_role.items() if policy.stage_mode(s, ep) == "none"] == ["dispatch", "combine"]
    assert MemoryPolicy(recompute="full", recompute_roles=("mlp",)).stage_mode(by_role["attn"], ep) == "none"


# ------------------------------------------------------------------------------------------------
# one process


@pytest.mark.parametrize("window", [0, 2])
def test_recompute_gives_bitwise_the_losses_and_gradients_of_none(window):
    cfg, model, params = setup()
    batch = random_batch(cfg, 4, 8, seed=5)
    ref = runner.run_sequential(model, params, batch, 4, memory=MemoryPolicy(merge_window=window))
    for policy in RECOMPUTING:
        policy = dataclasses.replace(policy, merge_window=window)
        assert not differences(runner.run_sequential(model, params, batch, 4, memory=policy), ref), policy


def test_offload_moves_the_saved_tensors_and_keeps_the_stages_own(monkeypatch):
    cfg, model, params = setup(layers=2)
    batch = random_batch(cfg, 2, 8, seed=5)
    copied = []
    host = offload._Host

    def counting(t, stream):
        copied.append(t)
        return host(t, stream)

    monkeypatch.setattr(offload, "_Host", counting)
    runner.run_sequential(model, params, batch, 2)
    assert not copied
    runner.run_sequential(model, params, batch, 2, memory=MemoryPolicy(offload=True))
    assert len(copied) > 20
    own = {p.untyped_storage().data_ptr() for p in params.values()}
    assert not any(t.untyped_storage().data_ptr() in own for t in copied), "a parameter was offloaded"


def _run_capturing_expert_gemms(model, params, batch, window, monkeypatch):
    """run_sequential with ``memory.merge_window = window``; also {name: [GroupedWeightGrad parts]}
    of every expert GEMM the step merged."""
    parts: dict[str, list] = {}
    merge = runner.merged_weight_grads

    def capturing(merge_later):
        for name, ps in merge_later.items():
            parts.setdefault(name, []).extend(ps)
        return merge(merge_later)

    monkeypatch.setattr(runner, "merged_weight_grads", capturing)
    result = runner.run_sequential(model, params, batch, 4, memory=MemoryPolicy(merge_window=window))
    monkeypatch.setattr(runner, "merged_weight_grads", merge)
    return result, parts


def test_merge_window_changes_only_the_summation_order_of_expert_gradients(monkeypatch):
    cfg, model, params = setup()
    batch = random_batch(cfg, 4, 8, seed=5)
    whole, parts = _run_capturing_expert_gemms(model, params, batch, 0, monkeypatch)
    assert parts, "the step merged no expert GEMM"
    u = 2.0**-24  # float32 unit roundoff
    for window in (1, 2, 4):
        got, _ = _run_capturing_expert_gemms(model, params, batch, window, monkeypatch)
        if window == 1:
            again, _ = _run_capturing_expert_gemms(model, params, batch, window, monkeypatch)
            assert not differences(got, again), f"merge_window={window} is not deterministic"
        assert torch.equal(got.loss, whole.loss)
        for name, g in got.grads.items():
            if name not in parts:  # no merged GEMM: the same arithmetic whatever the window
                assert torch.equal(g, whole.grads[name]), (window, name)
                continue
            # dW[e] = sum over the step's n rows of expert e of dy_r x_r^T, summed in two orders
            # (one GEMM vs one per window, added in order): each order is within (n-1) u sum|dy||x|
            # of the exact sum, so the two within 2 (n-1) u sum|dy||x| of each other, elementwise
            ps = parts[name]
            n = sum(p.x.shape[0] for p in ps)
            bound = sum(grouped_mm_weight_grad(p.x.abs(), p.dy.abs(), p.offs, p.num_groups) for p in ps)
            diff = (g - whole.grads[name]).abs()
            assert bool((diff <= 2 * (n - 1) * u * bound).all()), (window, name, diff.max().item())
        if window < 4:
            assert any(not torch.equal(got.grads[n], whole.grads[n]) for n in parts), (
                f"merge_window={window} changed no expert gradient: is the window applied?"
            )


def test_a_recompute_refuses_an_input_or_parameter_written_since_its_forward(monkeypatch):
    cfg, model, params = setup(layers=1)
    batch = runner.with_positions(random_batch(cfg, 2, 8, seed=5))
    stage = model.stages[1]  # the first layer's attention: input 0 is the residual stream [b, s, H]
    assert stage.role == "attn"
    carry = S.forward(model.stages[0], params, (batch["tokens"],), StageContext())[0]
    inputs = runner.stage_inputs(stage, carry, batch)

    def backward(recompute: str, mutate=None):
        own = {n: params[n].clone() for n in stage.params}
        x = tuple(t.clone() for t in inputs)
        outputs, fwd = S.forward(stage, own, x, StageContext(), recompute)
        if mutate is not None:
            mutate(x, own)
        grad_out = [torch.ones_like(t) for t in outputs[: stage.num_carried(len(outputs))]]
        grads, work = S.backward_input(fwd, grad_out)
        return grads, S.backward_weight(work)

    ref = backward("none")
    assert all(torch.equal(a, b) for a, b in zip(ref[0][:1], backward("full")[0][:1]))
    with pytest.raises(S.StageError, match=r"its input 0 was written in place between F and B"):
        backward("full", mutate=lambda x, own: x[0].mul_(1.5))
    name = next(n for n in stage.params if n.endswith("q_proj.weight"))
    with pytest.raises(S.StageError, match=rf"its parameter '{name}' was written in place"):
        backward("full", mutate=lambda x, own: own[name].add_(0.01))
    # what the check guards: without it, the recompute differentiates the written values
    monkeypatch.setattr(S.Kept, "check", lambda self, stage: None)
    stale = backward("full", mutate=lambda x, own: x[0].mul_(1.5))
    assert not torch.equal(stale[0][0], ref[0][0])


# ------------------------------------------------------------------------------------------------
# memory, measured (tests/memory_probe.py)


@pytest.mark.skipif(not memory.can_measure(torch.device("cpu")), reason="needs Linux /proc")
def test_recompute_keeps_less_than_none_and_the_merge_window_bounds_the_expert_operands():
    held = memory_probe.measure()
    mib = {k: round(v / 2**20, 1) for k, v in held.items()}
    # one micro-batch of 2048 tokens keeps ~45 MiB of saved activations under "none"; "full" keeps
    # only the stages' inputs (the residual stream, the routed rows: a few MiB); "selective" gives
    # back at least the SwiGLU outputs, 2 layers x 4096 routed rows x 256 x 4 bytes = 8 MiB (less
    # a MiB of page-level noise), and the norms' outputs besides
    assert held["none"] > 32 * 2**20, mib
    assert held["full"] < held["none"] / 3, mib
    assert held["selective"] < held["none"] - 7 * 2**20, mib
    assert held["window 1"] < held["window 0"] / 2, mib


# ------------------------------------------------------------------------------------------------
# pipelines and meshes (gloo)


def pipeline_worker(rank: int, world: int, group) -> dict:
    from fmoe import interpreter

    offload.MIN_BYTES = 0  # as ``offload_everything`` does in the test's own process
    cfg, model, params = setup(layers=4)
    batch = random_batch(cfg, 4, 8, seed=5)
    out = {}
    for name in SCHEDULES:
        schedule = generate(name, world, 4)
        local = {n: params[n] for n in pipeline.local_param_names(model, schedule, rank=rank)}
        ref = interpreter.run_schedule(schedule, model, local, batch, group)
        out[name] = {
            str(p): differences(interpreter.run_schedule(schedule, model, local, batch, group, memory=p), ref)
            for p in RECOMPUTING
        }
    return out


def test_recompute_is_bitwise_none_under_every_schedule_at_pp2():
    results = D.spawn(pipeline_worker, 2, timeout_s=300)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}"
        for name, cases in r.value.items():
            for policy, diff in cases.items():
                assert not diff, f"rank {r.rank} {name} {policy}: differs in {diff}"


def mesh_worker(rank: int, world: int, group, sizes) -> dict:
    import torch.distributed as dist

    pp, dp, cp, ep = sizes
    offload.MIN_BYTES = 0  # as ``offload_everything`` does in the test's own process
    cfg, model, _ = setup()
    batch = random_batch(cfg, dp * ep * 2 * 2, 8, seed=5)
    mesh = build_mesh(pp, dp, cp, ep)
    shapes = qwen3_moe.param_shapes(cfg)
    infos = sharding.layout(model, mesh, shapes, list(shapes))
    shards = sharding.shard_canonical(model.init(seed=3), infos, mesh)
    exchanges = []
    all_to_all = dist.all_to_all_single

    def counted(*args, **kwargs):
        exchanges.append(1)
        return all_to_all(*args, **kwargs)

    dist.all_to_all_single = counted  # this process is the test's: nothing else uses it

    def step(policy):
        exchanges.clear()
        loss, grads, stats = parallel.parallel_step(model, shards, infos, batch, 2, mesh, memory=policy)
        return runner.StepResult(loss, grads, [], stats), len(exchanges)

    out = {}
    for window in (0, 1):
        ref, ref_exchanges = step(MemoryPolicy(merge_window=window))
        for p in RECOMPUTING:
            got, n = step(dataclasses.replace(p, merge_window=window))
            out[f"{p} window {window}"] = (differences(got, ref), n, ref_exchanges)
    return out


@pytest.mark.parametrize("sizes", [(1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)], ids=["dp2", "cp2", "ep2"])
def test_recompute_is_bitwise_none_at_dp2_cp2_ep2_and_never_repeats_an_all_to_all(sizes):
    results = D.spawn(mesh_worker, 2, (sizes,), timeout_s=300)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}"
        for case, (diff, exchanges, ref_exchanges) in r.value.items():
            assert not diff, f"rank {r.rank} {case}: differs in {diff}"
            assert exchanges == ref_exchanges, (
                f"rank {r.rank} {case}: {exchanges} all-to-alls, none ran {ref_exchanges}"
            )
        if sizes[3] == 2:
            assert all(ref > 0 for _, _, ref in r.value.values()), "ep = 2 ran no all-to-all"


# ------------------------------------------------------------------------------------------------
# the benchmark's options


def test_throughput_benchmark_runs_its_fmoe_sides_under_the_policy_it_is_given(monkeypatch):
    from benchmarks import train_throughput

    seen = []
    real = train_throughput.runner.run_sequential

    def spy(model, params, batch, num_microbatches, **kw):
        seen.append(kw["memory"])
        return real(model, params, batch, num_microbatches, **kw)

    monkeypatch.setattr(train_throughput.runner, "run_sequential", spy)
    args = ["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "0", "--microbatches", "2"]
    options = ["--recompute", "full", "--recompute-roles", "attn,mlp", "--merge-window", "1"]
    result = train_throughput.main([*args, *options, "--sides", "fmoe,fmoe_recompute_selective"])
    policy = MemoryPolicy(merge_window=1, recompute="full", recompute_roles=("attn", "mlp"))
    assert set(seen) == {policy, MemoryPolicy(recompute="selective")}
    assert result["shape"]["memory"] == dataclasses.asdict(policy)
    with pytest.raises(SystemExit):
        train_throughput.main([*args, "--recompute", "most"])
