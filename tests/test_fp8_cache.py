"""FP8 activation caching (``fmoe.stages.fp8_mode``, ``memory.fp8_cache``): an FP8 linear keeps its
input in the FP8 form its weight gradient reads. The step's bits are those without caching (every
recompute / offload policy too), the bytes F saves are about half, the bf16 input is no longer
held, a merge of cached parts (which could not keep the bits) is refused, and the memory plan's
FP8 term (``fmoe.plan_fp8``) is each stage's measured change, to the byte."""

from __future__ import annotations

import dataclasses
import gc
import math
import weakref

import pytest
import torch
from conftest import random_batch, tiny_config

from fmoe import offload, parallel, plan_activations, plan_fp8, recipe, runner, sharding
from fmoe import stage as S
from fmoe.kernels import fp8_quant, fused
from fmoe.kernels.fp8_quant import Fp8ActT, quantize_act_t
from fmoe.memory_policy import MemoryPolicy
from fmoe.mesh import build_mesh
from fmoe.plan_fp8 import Fp8Caching, fp8_cache_bytes, fp8_rows_bytes
from fmoe.stages import primitives, qwen3_moe
from fmoe.stages.fp8_mode import cached_input_bytes
from fmoe.stages.primitives import fp8_training, grouped_linear, linear
from fmoe.stages.spec import Stage, StageContext


@pytest.fixture(autouse=True)
def torch_kernels(monkeypatch):
    # the FP8 kernels' plain-torch references (the Triton kernels write their bits, bitwise:
    # tests/test_kernels_fp8_quant.py, and tests/test_cuda.py compiled)
    monkeypatch.setenv("FMOE_KERNEL_BACKEND", "torch")


def fp8_config(**overrides):
    # dims multiples of 128 (the FP8 GEMMs' blocks); one dense layer and one MoE layer of 2 experts
    # (at 128 tokens a micro-batch the experts' cached form, 3 tiles, is smaller than their bf16)
    fields = dict(vocab_size=264, hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                  num_experts=2, num_experts_per_tok=2, moe_intermediate_size=128, intermediate_size=128,
                  num_hidden_layers=2, mlp_only_layers=(0,))  # fmt: skip
    fields.update(overrides)
    return tiny_config(**fields)


def cached_kinds(monkeypatch) -> list[str]:
    """The primitive kinds whose inputs get cached (one entry per quantization) while a test runs: an
    input quantized with its rows by ``quantize_act_t`` in F, or a SwiGLU output with its token-wise
    form by ``swiglu_quant(with_t=True)`` (what the fused FP8 experts cached before their W read
    SwiGLU's FP8 rows: counted, so that the counts below would show it back)."""
    kinds = []
    real, real_swiglu = fp8_quant.quantize_act_t, fused.swiglu_quant  # imported at each call

    def spy(x, offs=None, **kw):
        if kw.get("with_rows") and torch.is_grad_enabled():  # in F; B quantizes dy's two forms too
            kinds.append("linear" if offs is None else "grouped_linear")
        return real(x, offs, **kw)

    def spy_swiglu(h, offs=None, **kw):
        if kw.get("with_t"):
            kinds.append("grouped_linear")
        return real_swiglu(h, offs, **kw)

    monkeypatch.setattr(fp8_quant, "quantize_act_t", spy)
    monkeypatch.setattr(fused, "swiglu_quant", spy_swiglu)
    return kinds


def differences(a: runner.StepResult, b: runner.StepResult) -> list[str]:
    out = [] if torch.equal(a.loss, b.loss) else ["loss"]
    return out + [n for n in b.grads if not torch.equal(a.grads[n], b.grads[n])]


def run_step(model, params, batch, microbatches: int, policy: MemoryPolicy, cache: bool) -> runner.StepResult:
    with fp8_training(
        True, cache_inputs=cache and policy.fp8_cache, cache_expert_inputs=cache and policy.fp8_cache_experts(1, microbatches)
    ):  # fmt: skip
        return runner.run_sequential(model, params, batch, microbatches, memory=policy)


def test_fp8_cache_with_the_triton_kernels_gives_bitwise_the_step_without(monkeypatch):
    # interpreted Triton is slow: one MoE layer, 128 tokens, one micro-batch (every input cached)
    monkeypatch.setenv("FMOE_KERNEL_BACKEND", "triton")
    cfg = fp8_config(vocab_size=64, num_hidden_layers=1, mlp_only_layers=())
    model = qwen3_moe.build(cfg)
    params = {n: t.to(torch.bfloat16) for n, t in model.init(seed=0).items()}
    batch = random_batch(cfg, 1, 128)
    policy = MemoryPolicy()
    kinds = cached_kinds(monkeypatch)
    ref = run_step(model, params, batch, 1, policy, cache=False)
    got = run_step(model, params, batch, 1, policy, cache=True)
    # q/k/v's input; the experts' rows (gathered from the tokens inside mlp); down's input is not
    # cached: W keeps the FP8 rows its forward GEMM read (grouped_linear's w_reads_rows)
    assert not differences(got, ref) and kinds == ["linear", "grouped_linear"]


@pytest.mark.parametrize("window", [1, 0])
def test_fp8_cache_gives_bitwise_the_losses_and_grads_of_no_cache(window, monkeypatch):
    cfg = fp8_config()
    model = qwen3_moe.build(cfg)
    params = {n: t.to(torch.bfloat16) for n, t in model.init(seed=0).items()}
    batch = random_batch(cfg, 2, 128)
    policy = MemoryPolicy(merge_window=window)
    kinds = cached_kinds(monkeypatch)
    ref = run_step(model, params, batch, 2, policy, cache=False)
    assert not kinds
    got = run_step(model, params, batch, 2, policy, cache=True)
    assert not differences(got, ref)
    # per micro-batch: q/k/v share one quantized input in each of 2 layers (o reads a view of the
    # attention's output, which SDPA saves: not cached); the dense MLP's down (gate/up read the mlp
    # stage's input, which F keeps anyway: not cached); the experts' rows (mlp gathers them from the
    # tokens, its input), only where W is not merged (window 1); down's input never (W keeps its
    # FP8 rows, at any window)
    dense = 2 * (2 * 1 + 1)
    assert kinds.count("linear") == dense
    assert kinds.count("grouped_linear") == (2 * 1 if window == 1 else 0)


def test_fp8_cache_under_recompute_and_offload_gives_the_bits_of_none_without_cache(monkeypatch):
    # the cached forms are saved tensors like any: dropped and remade by "full", kept by
    # "selective" (not a region's output), copied to the host and back by "offload"
    monkeypatch.setattr(offload, "MIN_BYTES", 0)  # every saved tensor, the small FP8 ones too
    cfg = fp8_config()
    model = qwen3_moe.build(cfg)
    params = {n: t.to(torch.bfloat16) for n, t in model.init(seed=0).items()}
    batch = random_batch(cfg, 2, 128)
    ref = run_step(model, params, batch, 2, MemoryPolicy(merge_window=1), cache=False)
    kinds = cached_kinds(monkeypatch)
    for policy in (
        MemoryPolicy(merge_window=1, recompute="full"),
        MemoryPolicy(merge_window=1, recompute="selective"),
        MemoryPolicy(merge_window=1, offload=True),
    ):
        kinds.clear()
        assert not differences(run_step(model, params, batch, 2, policy, cache=True), ref), policy
        if policy.recompute == "selective":
            # the norm output q/k/v read and the experts' SwiGLU output are recomputed in B, not
            # kept at all: the dense MLP's down input (a plain product) and the experts' gathered
            # rows are cached
            assert kinds == ["linear", "grouped_linear"] * 2, kinds
        else:  # "full": F, then F again before B
            assert len(kinds) == (2 if policy.recompute == "full" else 1) * 2 * (2 + 1 + 1), kinds


def test_a_cache_quantized_otherwise_changes_the_bits(monkeypatch):
    # the comparison above can fail: a cached form quantized unlike W's own (power-of-two scales)
    # changes the weight gradients (one quantized as a single group, not per expert, is refused
    # by the GEMM: the groupings of x and dy differ)
    cfg = fp8_config()
    model = qwen3_moe.build(cfg)
    params = {n: t.to(torch.bfloat16) for n, t in model.init(seed=0).items()}
    batch = random_batch(cfg, 1, 128)
    policy = MemoryPolicy(merge_window=1)
    ref = run_step(model, params, batch, 1, policy, cache=False)
    real = fp8_quant.quantize_act_t

    def pow2_in_f(x, offs=None, *, pow2_scales=False, **kw):  # F's cached forms only (B quantizes dy
        # with this call too)
        return real(x, offs, pow2_scales=pow2_scales or torch.is_grad_enabled(), **kw)

    monkeypatch.setattr(fp8_quant, "quantize_act_t", pow2_in_f)
    assert not differences(run_step(model, params, batch, 1, policy, cache=False), ref)  # B is untouched
    got = run_step(model, params, batch, 1, policy, cache=True)
    changed = differences(got, ref)
    for name in ("q_proj.weight", "mlp.down_proj.weight", "experts.gate_up_proj", "experts.down_proj"):
        assert any(n.endswith(name) for n in changed), (name, changed)


def one_process(cfg):
    """What ``parallel.parallel_step`` takes on one process: model, mesh, layout, shards, a batch."""
    model = qwen3_moe.build(cfg)
    mesh = build_mesh(1, 1, 1, 1)
    shapes = qwen3_moe.param_shapes(cfg)
    infos = sharding.layout(model, mesh, shapes, list(shapes))
    return (
        model,
        mesh,
        infos,
        sharding.shard_canonical(model.init(seed=2), infos, mesh),
        random_batch(cfg, 2, 128, seed=1),
    )


def test_the_trainer_step_caches_by_the_policy_and_keeps_the_bits(monkeypatch):
    # parallel_step (fmoe train's step) opens the caching from memory.fp8_cache
    model, mesh, infos, shards, batch = one_process(fp8_config())
    kinds = cached_kinds(monkeypatch)
    out = {}
    for cache in (True, False):
        policy = MemoryPolicy(merge_window=1, fp8_cache=cache)
        out[cache] = parallel.parallel_step(
            model, shards, infos, batch, 2, mesh, dtype=torch.bfloat16, fp8=True, memory=policy
        )
        if cache:  # as test_fp8_cache_gives_bitwise_..., window 1
            assert kinds.count("linear") == 2 * 3 and kinds.count("grouped_linear") == 2 * 1
    assert len(kinds) == 2 * 4, "nothing cached with fp8_cache = false"
    assert torch.equal(out[True].loss, out[False].loss)
    assert all(torch.equal(out[True].grad_shards[n], g) for n, g in out[False].grad_shards.items())


def test_the_trainer_step_quantizes_the_expert_weights_from_their_fp32_master_shards(monkeypatch):
    """One process, FP8: the stacked expert weights reach the stages as the fp32 master shards
    themselves (no bf16 copy, ``fp8_mode.quantized_from_master``) and are quantized from there;
    every other weight from its bf16 copy; every gradient comes back in bf16 all the same."""
    from fmoe.stages import fp8_mode

    model, mesh, infos, shards, batch = one_process(fp8_config())
    seen = []  # (dtype, storage) of each weight quantized
    real = fp8_mode._quantize_weight
    monkeypatch.setattr(
        fp8_mode,
        "_quantize_weight",
        lambda w: seen.append((w.dtype, w.untyped_storage().data_ptr())) or real(w),
    )
    out = parallel.parallel_step(model, shards, infos, batch, 2, mesh, dtype=torch.bfloat16, fp8=True)
    experts = {n for n in model.expert_params if len(infos[n].full_shape) == 3}
    assert len(experts) == 2  # the MoE layer's gate_up and down
    master_storage = {shards[n].untyped_storage().data_ptr() for n in experts}
    assert {p for d, p in seen if d == torch.float32} == master_storage
    # bf16: q, k, v, o of both layers and the dense MLP's gate, up and down (layer 0)
    assert (
        sum(d == torch.float32 for d, _ in seen) == 2
        and sum(d == torch.bfloat16 for d, _ in seen) == 2 * 4 + 3
    )
    assert {g.dtype for g in out.grad_shards.values()} == {torch.bfloat16}


def test_the_trainer_step_runs_the_dense_wgrad_in_bf16_from_the_recipe(monkeypatch):
    # train.fp8_dense_wgrad = false reaches parallel_step: nothing dense is cached, the dense
    # weight gradients change and the experts' do not (their W is FP8 either way)
    data = {"model": {"family": "qwen3_moe"}, "train": {"fp8": True}}
    assert recipe.from_dict(data).train.fp8_dense_wgrad is True
    flag = recipe.from_dict({**data, "train": {"fp8": True, "fp8_dense_wgrad": False}}).train.fp8_dense_wgrad
    assert flag is False
    with pytest.raises(recipe.RecipeError, match=r"^r.toml: train.fp8_dense_wgrad must be bool"):
        recipe.from_dict({**data, "train": {"fp8_dense_wgrad": "no"}}, "r.toml")
    model, mesh, infos, shards, batch = one_process(fp8_config())
    kinds = cached_kinds(monkeypatch)
    out = {}
    for fp8_wgrad in (True, False):
        kinds.clear()
        out[fp8_wgrad] = parallel.parallel_step(
            model, shards, infos, batch, 2, mesh, dtype=torch.bfloat16, fp8=True,
            fp8_dense_wgrad=fp8_wgrad, memory=MemoryPolicy(merge_window=1),
        ).grad_shards  # fmt: skip
        assert ("linear" in kinds) is fp8_wgrad and "grouped_linear" in kinds
    changed = {n for n, g in out[False].items() if not torch.equal(g, out[True][n])}
    assert any(n.endswith("q_proj.weight") for n in changed)
    assert not any("experts" in n for n in changed)


def test_the_trainer_step_runs_the_expert_wgrad_in_bf16_from_the_recipe(monkeypatch):
    # train.fp8_expert_wgrad = false reaches parallel_step: no expert input is cached, the experts'
    # weight gradients change (merged over the micro-batches or not) and nothing else does
    data = {"model": {"family": "qwen3_moe"}, "train": {"fp8": True}}
    assert recipe.from_dict(data).train.fp8_expert_wgrad is True
    flag = recipe.from_dict(
        {**data, "train": {"fp8": True, "fp8_expert_wgrad": False}}
    ).train.fp8_expert_wgrad
    assert flag is False
    with pytest.raises(recipe.RecipeError, match=r"^r.toml: train.fp8_expert_wgrad must be bool"):
        recipe.from_dict({**data, "train": {"fp8_expert_wgrad": 0}}, "r.toml")
    model, mesh, infos, shards, batch = one_process(fp8_config())
    kinds = cached_kinds(monkeypatch)
    merged_fp8 = []  # each merge's parts' fp8 flags
    real = primitives.merge_grouped_weight_grads
    monkeypatch.setattr(
        runner,
        "merge_grouped_weight_grads",
        lambda parts: merged_fp8.append({p.fp8 for p in parts}) or real(parts),
    )
    for window in (1, 0):  # one micro-batch's W each (expert inputs cacheable), merged over the step
        out = {}
        for fp8_wgrad in (True, False):
            kinds.clear()
            merged_fp8.clear()
            out[fp8_wgrad] = parallel.parallel_step(
                model, shards, infos, batch, 2, mesh, dtype=torch.bfloat16, fp8=True,
                fp8_expert_wgrad=fp8_wgrad, memory=MemoryPolicy(merge_window=window),
            ).grad_shards  # fmt: skip
            assert ("grouped_linear" in kinds) is (fp8_wgrad and window == 1) and "linear" in kinds
            assert window == 1 or merged_fp8 == [{fp8_wgrad}] * fp8_config().num_hidden_layers
        changed = {n for n, g in out[False].items() if not torch.equal(g, out[True][n])}
        assert changed and all("experts" in n for n in changed), sorted(changed)
        assert not any(n.endswith("q_proj.weight") for n in changed)


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves while ``fn`` runs (distinct storages)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_a_cached_fp8_linear_saves_about_half_the_bytes_of_its_bf16_input():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(384, 256, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(128, 256, generator=gen) * 0.05).to(torch.bfloat16).requires_grad_()
    xe = torch.randn(512, 128, generator=gen).to(torch.bfloat16).requires_grad_()
    we = (torch.randn(4, 256, 128, generator=gen) * 0.05).to(torch.bfloat16).requires_grad_()
    offs = torch.tensor([100, 100, 356, 512], dtype=torch.int32)  # an empty expert, ragged ones
    offs8 = torch.tensor([16 * (i + 1) for i in range(8)], dtype=torch.int32)
    we8 = (torch.randn(8, 256, 128, generator=gen) * 0.05).to(torch.bfloat16).requires_grad_()
    for cache in (False, True):
        with fp8_training(True, cache_inputs=cache, cache_expert_inputs=cache):
            # inputs made in F (x * 1): a leaf - a stage's input, kept anyway - is never cached
            dense = saved_bytes(lambda: linear(x * 1, w))
            grouped = saved_bytes(lambda: grouped_linear(xe * 1, we, offs))
            assert saved_bytes(lambda: linear(x, w)) == 2 * x.numel()
            # 128 rows over 8 experts: 1 + 7 tiles, larger cached than in bf16: kept in bf16
            few = saved_bytes(lambda: grouped_linear(xe[:128] * 1, we8, offs8))
            assert few == 2 * 128 * 128 + offs8.nbytes
        if not cache:
            assert dense == 2 * x.numel() and grouped == 2 * xe.numel() + offs.nbytes
            continue
        # 1 byte an element and a float32 scale per 128 tokens (dense: 384 tokens, 3 tiles)
        assert dense == cached_input_bytes(384, 256) == 384 * 256 + 4 * 256 * 3 + 8
        assert dense / (2 * x.numel()) < 0.52
        # grouped: cdiv(512, 128) + 4 - 1 = 7 tiles allocated (the upper bound, whatever the routing)
        assert grouped == cached_input_bytes(512, 128, experts=4) + offs.nbytes
        assert cached_input_bytes(512, 128, experts=4) == 128 * 7 * 128 + 4 * 128 * 7 + 8 * 4


def test_the_bf16_input_is_freed_after_f_and_w_reads_the_cached_form():
    # the down projection's input is the SwiGLU output, which SwiGLU's backward does not save: with
    # caching nothing keeps it (nor the forward's row quantization) once F is done
    gen = torch.Generator().manual_seed(1)
    w = {
        "l.up": torch.randn(256, 128, generator=gen) * 0.05,
        "l.down": torch.randn(128, 128, generator=gen) * 0.05,
    }
    x = torch.randn(256, 128, generator=gen)
    refs = []

    def forward(p, inputs, ctx):
        h = torch.nn.functional.silu(linear(inputs[0], p["up"])[:, :128].contiguous())
        refs.append(weakref.ref(h))
        return (linear(h, p["down"]),)

    stage = Stage("l", forward, ("l.up", "l.down"), "l.")
    alive = {}
    for cache in (False, True):
        with fp8_training(True, cache_inputs=cache):
            (y,), fwd = S.forward(stage, w, (x,), StageContext())
            gc.collect()
            alive[cache] = refs[-1]() is not None
            (dx,), work = S.backward_input(fwd, (torch.ones_like(y),))
            xs = [compute.x for _, compute in work.tape.entries]
            # in backward order: down's input cached, up's (the stage's input, kept anyway) not
            assert [isinstance(t, Fp8ActT) for t in xs] == [cache, False]
            S.backward_weight(work)
    assert alive == {False: True, True: False}


def test_a_merge_of_cached_expert_inputs_is_refused():
    x = torch.randn(256, 128)
    offs = torch.tensor([128, 256], dtype=torch.int32)
    part = primitives.GroupedWeightGrad(quantize_act_t(x, offs), torch.randn(256, 128), offs, 2, fp8=True)
    with pytest.raises(ValueError, match="cannot be merged bitwise"):
        primitives.merge_grouped_weight_grads([part, part])
    assert primitives.merge_grouped_weight_grads([part]).shape == (2, 128, 128)  # alone: its own W
    # the runner never asks: a step that merges (window 0, 2 micro-batches) caches no expert input
    assert not MemoryPolicy().fp8_cache_experts(pp=1, num_microbatches=2)


def test_fp8_cache_experts_only_where_no_window_merges_two_microbatches():
    on = MemoryPolicy(merge_window=1)
    assert on.fp8_cache_experts(1, 8) and MemoryPolicy().fp8_cache_experts(1, 1)
    assert MemoryPolicy().fp8_cache_experts(2, 8)  # pp > 1: W per micro-batch, never merged
    assert not MemoryPolicy(merge_window=2).fp8_cache_experts(1, 8)
    assert not MemoryPolicy(merge_window=1, fp8_cache=False).fp8_cache_experts(1, 8)


def test_fp8_cache_reaches_the_recipe_round_trips_and_a_bad_value_names_its_field():
    data = {"model": {"family": "qwen3_moe"}}
    assert recipe.from_dict(data, "r.toml").memory.fp8_cache is True  # on by default
    got = recipe.from_dict({**data, "memory": {"fp8_cache": False, "merge_window": 1}}).memory
    assert got == MemoryPolicy(merge_window=1, fp8_cache=False)
    assert recipe.from_dict({**data, "memory": dataclasses.asdict(got)}).memory == got
    with pytest.raises(recipe.RecipeError, match=r"^r.toml: memory.fp8_cache must be bool"):
        recipe.from_dict({**data, "memory": {"fp8_cache": 1}}, "r.toml")


def saved_per_stage(model, params, batch, cache: Fp8Caching | None, fp8: bool = True) -> list[int]:
    """Bytes each stage's F saves for B (distinct storages, parameters left out), one micro-batch
    (tests/test_fp8_cache_cuda.py runs it on the GPU); FP8 on (caching nothing without ``cache``),
    or off."""
    param_storages = {t.untyped_storage().data_ptr() for t in params.values()}
    carry, out = (), []
    flags = dict(cache_inputs=cache.dense, cache_expert_inputs=cache.experts) if cache else {}
    with fp8_training(fp8, **flags):
        for stage in model.stages:
            saved: dict[int, int] = {}

            def pack(t, saved=saved):
                if t.untyped_storage().data_ptr() not in param_storages:
                    saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                outputs, _ = S.forward(
                    stage, params, runner.stage_inputs(stage, carry, batch), StageContext()
                )
            carry, _ = runner.split_outputs(stage, outputs)
            out.append(sum(saved.values()))
    return out


# FP8-sized configs of each family the plan has formulas for: dims multiples of 128, 4 experts, top-2
FAMILY_CONFIGS = {
    "qwen3_moe": dict(vocab_size=264, hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
                      head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                      intermediate_size=128, num_hidden_layers=2, mlp_only_layers=[0]),
    # kv_a_proj_with_mqa: 128 + 64 rows, not FP8 (as the real models' 576)
    "deepseek_v2": dict(vocab_size=264, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=128, qk_nope_head_dim=64,
                        qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=4, n_shared_experts=2,
                        num_experts_per_tok=2, first_k_dense_replace=1, topk_method="greedy"),
    "gpt_oss": dict(vocab_size=264, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                    num_experts_per_tok=2, layer_types=["full_attention"]),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_the_plan_knows_the_bytes_fp8_caching_saves_per_stage(family):
    # each stage's measured change of saved bytes equals the plan's fp8_cache_bytes, to the byte;
    # the rank's 4 experts at window 1 (their inputs cached too)
    built = recipe.from_dict({"model": {"family": family, **FAMILY_CONFIGS[family]}})
    cfg = built.model
    model = recipe.model_family(family).build(cfg)
    params = {n: t.to(torch.bfloat16) for n, t in model.init(seed=0).items()}
    batch = runner.with_positions(random_batch(cfg, 2, 128))
    caching = Fp8Caching.of(True, True, MemoryPolicy(merge_window=1), 1, 4, model.num_experts)
    assert caching == Fp8Caching(dense=True, experts=True, local_experts=4)
    without, with_cache = (saved_per_stage(model, params, batch, c) for c in (None, caching))
    formulas = plan_activations.ACTIVATION_FORMULAS[family]
    moe = plan_activations.moe_stages(model)
    planned = [
        fp8_cache_bytes(formulas, cfg, st.role, i in moe, 256, 2, caching)
        for i, st in enumerate(model.stages)
    ]
    measured = [c - n for c, n in zip(with_cache, without)]
    assert measured == planned, [(st.name, m, p) for st, m, p in zip(model.stages, measured, planned)]
    assert sum(planned) < 0
    # FP8 itself, caching nothing, against FP8 off: the inputs W keeps as FP8 rows (SwiGLU's output)
    off = saved_per_stage(model, params, batch, None, fp8=False)
    rows = [
        fp8_rows_bytes(formulas, cfg, st.role, i in moe, 256, 2, caching) for i, st in enumerate(model.stages)
    ]
    measured = [n - f for n, f in zip(without, off)]
    assert measured == rows, [(st.name, m, p) for st, m, p in zip(model.stages, measured, rows)]
    assert (sum(rows) < 0) == (family != "gpt_oss")  # gpt-oss's clamped SwiGLU keeps its output
    # the plan's activations of the micro-batch move by as much
    mb = plan_activations.MicroBatch(2, 128, 128, 2, "cpu")
    every = range(len(model.stages))
    kept = [
        plan_activations.chunk_activation_bytes(formulas, cfg, model, every, mb, fp8=c)[0]
        for c in (None, caching)
    ]
    assert kept[1] - kept[0] == sum(planned) + sum(rows)


def test_the_plans_fp8_terms_are_the_cached_forms_bytes():
    cfg = recipe.from_dict({"model": {"family": "qwen3_moe", **FAMILY_CONFIGS["qwen3_moe"]}}).model
    caching = Fp8Caching(dense=True, experts=True, local_experts=4)
    # q/k/v's input [256, 128]: 2 tiles of 128 tokens, 1 byte an element and a float32 scale a tile
    dense = (256 * 128 + 4 * 128 * 2 + 8) - 2 * 256 * 128
    assert fp8_cache_bytes("qwen3_moe", cfg, "attn", True, 256, 2, caching) == dense
    # the experts' gathered rows [512, 128] over 4 experts: 512 / 128 + 3 = 7 tiles, where mlp
    # gathers them (the local permutation), not where they are its input (expert parallelism)
    experts = 7 * 128 * 132 + 8 * 4 - 2 * 512 * 128
    assert fp8_cache_bytes("qwen3_moe", cfg, "mlp", True, 256, 2, caching) == experts
    assert fp8_cache_bytes("qwen3_moe", cfg, "mlp", True, 256, 2, caching, local=False) == 0
    # on CUDA the fused FP8 experts read the rows from the tokens (no copy) - not under selective
    # recomputation, which takes the composition, and not gpt-oss's experts
    assert fp8_cache_bytes("qwen3_moe", cfg, "mlp", True, 256, 2, caching, device="cuda") == 0
    assert plan_fp8.mlp_copies_rows("qwen3_moe", cfg, True, "cuda", selective=True)
    assert plan_fp8.mlp_copies_rows("gpt_oss", cfg, True, "cuda", selective=False)
    assert not plan_fp8.mlp_copies_rows("qwen3_moe", cfg, False, "cpu", selective=False)
    # the experts' down input [512, 128] is never cached: W keeps its FP8 rows, 1 byte an element
    # and a float32 scale per 128, with FP8 expert weight gradients, cached or not, on any device
    rows = 512 * (128 + 4) - 2 * 512 * 128
    for fp8 in (caching, Fp8Caching(False, False, 4)):
        for where in ({}, {"local": False}, {"device": "cuda"}):
            assert fp8_rows_bytes("qwen3_moe", cfg, "mlp", True, 256, 2, fp8, **where) == rows, (fp8, where)
    assert fp8_rows_bytes("qwen3_moe", cfg, "attn", True, 256, 2, caching) == 0
    assert fp8_rows_bytes("qwen3_moe", cfg, "mlp", True, 256, 2, None) == 0  # FP8 off
    no_fp8_w = Fp8Caching(dense=True, experts=False, local_experts=4, expert_grads=False)
    assert fp8_rows_bytes("qwen3_moe", cfg, "mlp", True, 256, 2, no_fp8_w) == 0  # W reads bf16 a
    gpt = recipe.from_dict({"model": {"family": "gpt_oss", **FAMILY_CONFIGS["gpt_oss"]}}).model
    assert fp8_rows_bytes("gpt_oss", gpt, "mlp", True, 256, 2, caching) == 0  # clamped SwiGLU: kept as is
    # under selective recomputation the regions' outputs (the norm's, the SwiGLU's) are neither cached
    # nor kept as rows
    assert fp8_cache_bytes("qwen3_moe", cfg, "attn", True, 256, 2, caching, selective=True) == 0
    assert fp8_cache_bytes("qwen3_moe", cfg, "mlp", True, 256, 2, caching, selective=True) == experts
    assert fp8_cache_bytes("qwen3_moe", cfg, "mlp", True, 256, 2, caching, selective=True, local=False) == 0
    assert fp8_rows_bytes("qwen3_moe", cfg, "mlp", True, 256, 2, caching, selective=True) == 0
    assert fp8_cache_bytes("qwen3_moe", cfg, "mlp", False, 256, 2, caching, selective=True) < 0
    # FP8 on with nothing cached is still FP8 to the plan; off, there is no caching at all
    assert Fp8Caching.of(True, True, MemoryPolicy(fp8_cache=False), 1, 4, 4) == Fp8Caching(False, False, 4)
    assert Fp8Caching.of(False, True, MemoryPolicy(), 1, 4, 4) is None
    assert not Fp8Caching.of(True, True, MemoryPolicy(), 1, 4, 4).experts  # window 0 merges 4
    # a dense weight gradient in the compute dtype reads x itself: no dense input is cached
    assert Fp8Caching.of(True, True, MemoryPolicy(merge_window=1), 1, 4, 4, fp8_dense_wgrad=False) == (
        Fp8Caching(dense=False, experts=True, local_experts=4)
    )
    # and an expert weight gradient in the compute dtype: no expert input is cached
    # (and its W keeps the bf16 output gradients, not their FP8 rows)
    assert Fp8Caching.of(True, True, MemoryPolicy(merge_window=1), 1, 4, 4, fp8_expert_wgrad=False) == (
        Fp8Caching(dense=True, experts=False, local_experts=4, expert_grads=False)
    )


def test_fmoe_plan_of_an_fp8_recipe_plans_less_with_the_cache():
    from pathlib import Path

    from fmoe import plan
    from fmoe.hf import family as family_module

    r = recipe.load(Path(__file__).resolve().parents[1] / "recipes" / "qwen3_30b_a3b.toml")
    fam = family_module(r.model_family)
    model, shapes = fam.build(r.model), fam.param_shapes(r.model)
    acts = {}
    for fp8, cache in ((False, True), (True, False), (True, True)):
        policy = MemoryPolicy(merge_window=1, fp8_cache=cache)
        fp8_recipe = dataclasses.replace(r, train=dataclasses.replace(r.train, fp8=fp8))
        acts[fp8, cache] = (
            plan.plan_layout(fp8_recipe, model, shapes, (1, 1, 1, 8), policy=policy)
            .stage_terms[0]
            .activations
        )
    # FP8 alone keeps SwiGLU's output as FP8 rows (its W reads them); caching keeps less again
    assert acts[False, True] > acts[True, False] > acts[True, True]


def test_the_plan_keeps_the_tokens_for_the_fused_experts_merged_w():
    # a step merging its expert W (window 0, 4 micro-batches): on CUDA the fused FP8 experts' W
    # keeps each micro-batch's [T, H] tokens, not their k gathered rows; FP8 is known on from its
    # caching (here caching nothing: only W's terms move), and on the CPU the copy stays; on both,
    # the FP8 experts' W keeps the FP8 rows of the output gradients and of SwiGLU's output, not bf16
    # ones (the rows of SwiGLU's output from F on: the micro-batch in B holds them too)
    cfg = recipe.from_dict({"model": {"family": "qwen3_moe", **FAMILY_CONFIGS["qwen3_moe"]}}).model
    model = qwen3_moe.build(cfg)
    grads = {n: 0 for n in model.init(seed=0)}
    fp8_on = Fp8Caching(dense=False, experts=False, local_experts=4)
    peaks = {}
    for device in ("cuda", "cpu"):
        mb = plan_activations.MicroBatch(2, 128, 128, 2, device)
        for fp8 in (None, fp8_on):
            peaks[device, fp8] = plan_activations.rank_activation_peaks(
                "qwen3_moe", cfg, model, None, 0, mb, grads, 4, MemoryPolicy(), 1, fp8
            )[0]
    k, h, inter = cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    copies = (k - 1) * 256 * 2 * h  # one micro-batch's, one layer
    # dy [k T, H], the gate/up gradient [k T, 2I] and SwiGLU's output [k T, I]: 2 -> 1 + 1/32 bytes
    fp8_grads = 256 * k * (h + 2 * inter + inter) * (2 - (1 + 4 / 128))
    a_rows = 256 * k * inter * (2 - (1 + 4 / 128))  # the micro-batch in B: SwiGLU's output in F's rows
    # the peak holds 3 (during the last B, beside its F's activations) or 4 (at the step's end)
    # micro-batches' merge operands
    assert peaks["cuda", None] - peaks["cuda", fp8_on] in (
        3 * (copies + fp8_grads) + a_rows,
        4 * (copies + fp8_grads),
    )
    assert peaks["cpu", None] - peaks["cpu", fp8_on] in (3 * fp8_grads + a_rows, 4 * fp8_grads)
    # FP8 with fp8_cache off caches nothing, and the plan still knows the fused experts keep tokens
    no_cache = MemoryPolicy(fp8_cache=False)
    mb = plan_activations.MicroBatch(2, 128, 128, 2, "cuda")
    fp8_no_cache = Fp8Caching.of(True, True, no_cache, 1, 4, 4)
    assert (
        plan_activations.rank_activation_peaks(
            "qwen3_moe", cfg, model, None, 0, mb, grads, 4, no_cache, 1, fp8_no_cache
        )[0]
        == peaks["cuda", fp8_on]
    )
    # under the exchange (ep 2, or a capacity at ep 1) W keeps the received rows: only the output
    # gradients' term moves
    mb = plan_activations.MicroBatch(2, 128, 128, 2, "cuda")
    capped = dataclasses.replace(cfg, moe_capacity_factor=1.5)
    for c, ep in ((cfg, 2), (capped, 1)):
        assert not plan_fp8.local_dispatch(c, ep)
        bf16, fp8 = (
            plan_activations.rank_activation_peaks(
                "qwen3_moe", c, model, None, 0, mb, grads, 4, MemoryPolicy(), ep, f
            )[0]
            for f in (None, fp8_on)
        )
        assert bf16 - fp8 in (3 * fp8_grads + a_rows, 4 * fp8_grads)
    assert plan_fp8.local_dispatch(cfg, 1) and not plan_fp8.experts_read_tokens(
        "qwen3_moe", cfg, False, "cuda", False
    )


@pytest.mark.parametrize("dense", [True, False], ids=["fp8_dense", "experts_only"])
def test_the_plans_fp8_weight_copies_bound_what_a_step_quantizes(monkeypatch, dense):
    """The plan's FP8 weight copies (``plan.fp8_weight_bytes``, in the gathered term) against the
    bytes of every FP8 weight a trainer step makes (data, scales and their transposes): never less,
    and less than 1.5x (the bound counts the embedding, router and LM head where dims allow)."""
    from fmoe import plan
    from fmoe.stages import fp8_mode

    made = []
    real = fp8_mode._quantize_weight

    def counting(w):
        made.append(real(w))
        return made[-1]

    monkeypatch.setattr(fp8_mode, "_quantize_weight", counting)
    # the embedding and LM head in 128-blocks too: counted by the bound
    cfg = fp8_config(vocab_size=256)
    model, mesh, infos, shards, batch = one_process(cfg)
    shapes = qwen3_moe.param_shapes(cfg)
    parallel.parallel_step(
        model, shards, infos, batch, 2, mesh, dtype=torch.bfloat16, fp8=True, fp8_dense=dense
    )
    quantized = sum(
        t.numel() * t.element_size() for w in made for t in (w.data, w.scale, w.data_t, w.scale_t)
    )
    planned = plan.fp8_weight_bytes(infos, dense)
    assert made and quantized <= planned < 1.5 * quantized, (quantized, planned)
    # the formula, computed here from the shapes: 2 bytes an element and two fp32 scales a block
    blocks = [s for n, s in shapes.items() if len(s) >= 2 and s[-1] % 128 == 0 and s[-2] % 128 == 0
              and (dense or n in model.expert_params)]  # fmt: skip
    assert planned == sum(2 * math.prod(s) + 8 * math.prod(s) // 128**2 for s in blocks)


def test_the_plan_counts_the_fp8_weight_copies_in_gathered():
    from pathlib import Path

    from fmoe import plan
    from fmoe.hf import family as family_module

    r = recipe.load(Path(__file__).resolve().parents[1] / "recipes" / "qwen3_30b_a3b.toml")
    fam = family_module(r.model_family)
    model, shapes = fam.build(r.model), fam.param_shapes(r.model)
    policy = MemoryPolicy(merge_window=1)
    gathered = {
        fp8: plan.plan_layout(dataclasses.replace(r, train=dataclasses.replace(r.train, fp8=fp8)), model, shapes,
                              (1, 1, 1, 1), policy=policy).stage_terms[0].gathered
        for fp8 in (False, True)
    }  # fmt: skip
    infos = sharding.layout(model, build_mesh(1, 1, 1, 1), shapes, list(shapes))
    # and no bf16 copy of the stacked expert weights, which the step hands over as the fp32 masters
    experts_bf16 = sum(
        2 * math.prod(s) for n, s in shapes.items() if n in model.expert_params and len(s) == 3
    )
    assert experts_bf16 > 0
    assert gathered[True] - gathered[False] == plan.fp8_weight_bytes(infos, True) - experts_bf16


@pytest.mark.parametrize("cache", [False, True])
def test_w_reads_rows_of_an_x_no_region_makes_keeps_rows_under_selective_recomputation(cache):
    # grouped_linear(w_reads_rows=True) decides by x itself, not by the F running under selective
    # recomputation: an x no recomputable block made is kept as its FP8 rows (never cached in its
    # token-wise form, which W would read rounded once) with recomputation or without, the same bits
    gen = torch.Generator().manual_seed(11)
    counts = [300, 0, 190, 278]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    n = sum(counts)
    x = torch.randn(n, 256, generator=gen).bfloat16()
    w = (torch.randn(len(counts), 256, 128, generator=gen) * 0.05).bfloat16()
    dy = torch.randn(n, 256, generator=gen).bfloat16()
    stage = Stage(
        "ex",
        lambda p, i, c: (grouped_linear(torch.tanh(i[0][:, :128] * 1), p["w"], offs, w_reads_rows=True),),
        ("e.w",),
        "e.",
    )
    out = {}
    for mode in ("none", "selective"):
        with fp8_training(True, cache_expert_inputs=cache):
            _, fwd = S.forward(stage, {"e.w": w}, (x,), StageContext(), mode=mode)
            _, work = S.backward_input(fwd, (dy,))
            kinds = [type(c.x).__name__ for _, c in work.tape.entries]
            out[mode] = (kinds, S.backward_weight(work)["e.w"])
    assert out["none"][0] == out["selective"][0] == ["Fp8Act"]
    assert torch.equal(out["none"][1], out["selective"][1])
