"""DeepSeek-V3: the noaux_tc router against plain torch ops and transformers' router, logits parity with
transformers' DeepseekV3ForCausalLM through import and export, stage B/W against autograd in float64,
DualPipeV at pp 2 x ep 2 against the sequential runner, the router bias moving in training, and the
two recipes."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import random_batch, relative_error
from test_deepseek_v2 import YARN, stage_cases

from fmoe import data, hf, parallel, pipeline, recipe, runner, sharding
from fmoe import dist as dist_helpers
from fmoe import stage as S
from fmoe.stages import deepseek_v3
from fmoe.stages.spec import StageContext
from fmoe.train import train

EPS64 = torch.finfo(torch.float64).eps
RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def tiny(**overrides) -> deepseek_v3.DeepseekV3Config:
    """Layer 0 dense, the rest MoE: 8 experts in 4 groups, 2 of them eligible, top-2, 2 shared
    experts, query compression, YaRN."""
    fields = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=16,
        q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8,
        n_shared_experts=2, num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, moe_intermediate_size=16, intermediate_size=40, first_k_dense_replace=1,
        rope_scaling=YARN, max_position_embeddings=640,
    )  # fmt: skip
    fields.update(overrides)
    return deepseek_v3.DeepseekV3Config(**fields)


# ----------------------------------------------------------------------------------------------
# the router


def reference_router(x, gate_w, bias, k, n_group, topk_group, norm, scale):
    """noaux_tc written token by token with Python sorting: (weights [T, k], ids [T, k])."""
    scores = torch.sigmoid(x @ gate_w.T)
    per = gate_w.shape[0] // n_group
    all_w, all_ids = [], []
    for t in range(x.shape[0]):
        biased = [(scores[t, e] + bias[e]).item() for e in range(gate_w.shape[0])]
        group_score = [sum(sorted(biased[g * per : (g + 1) * per])[-2:]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        eligible = [e for g in groups for e in range(g * per, (g + 1) * per)]
        ids = sorted(eligible, key=lambda e: -biased[e])[:k]
        w = torch.stack([scores[t, e] for e in ids])
        all_w.append(scale * (w / w.sum() if norm else w))
        all_ids.append(ids)
    return torch.stack(all_w), torch.tensor(all_ids)


@pytest.mark.parametrize("norm", [True, False])
def test_noaux_tc_router_and_its_gradients_equal_plain_torch_ops_in_float64(norm):
    gen = torch.Generator().manual_seed(0)
    T, H, E = 40, 16, 16
    x = torch.randn(T, H, generator=gen, dtype=torch.float64, requires_grad=True)
    gate_w = torch.randn(E, H, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = 0.3 * torch.randn(E, generator=gen, dtype=torch.float64)
    args = (3, 4, 2, norm, 2.5)  # top-3 among the experts of the 2 best of 4 groups
    _, w, ids = deepseek_v3.noaux_tc_router(x, gate_w, bias, *args)
    ref_w, ref_ids = reference_router(x, gate_w, bias, *args)
    assert torch.equal(ids, ref_ids)
    assert relative_error(w, ref_w) <= 8 * EPS64
    # the group limit and the bias both change the choice here (else the test would prove little)
    assert not torch.equal(ids, deepseek_v3.noaux_tc_router(x, gate_w, bias, 3, 4, 4, norm, 2.5)[2])
    assert not torch.equal(ids, deepseek_v3.noaux_tc_router(x, gate_w, 0 * bias, *args)[2])
    cotangent = torch.randn(w.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((w * cotangent).sum(), (x, gate_w))
    ref_grads = torch.autograd.grad((ref_w * cotangent).sum(), (x, gate_w))
    for g, ref in zip(grads, ref_grads):
        # each entry sums at most E * k products of a few roundings each
        assert relative_error(g, ref) <= 64 * EPS64


def test_noaux_tc_router_equals_transformers_router():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_cfg = transformers.DeepseekV3Config(
        hidden_size=16, n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5,
    )  # fmt: skip
    theirs = DeepseekV3TopkRouter(hf_cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(16, 16, generator=gen))
        theirs.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=gen))
    x = torch.randn(64, 16, generator=gen)
    _, their_w, their_ids = theirs(x)
    _, w, ids = deepseek_v3.noaux_tc_router(
        x, theirs.weight, theirs.e_score_correction_bias, 3, 4, 2, True, 2.5
    )
    order, their_order = ids.argsort(-1), their_ids.argsort(-1)  # transformers leaves the k unsorted
    assert torch.equal(ids.gather(1, order), their_ids.gather(1, their_order))
    torch.testing.assert_close(w.gather(1, order), their_w.gather(1, their_order), rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------------------------
# Hugging Face parity


def transformers_config(cfg: deepseek_v3.DeepseekV3Config, **extra):
    """transformers' DeepseekV3Config for ``cfg``, written out field by field (not via our export)."""
    import transformers

    rope = {"rope_type": "default"} if cfg.rope_scaling is None else dict(cfg.rope_scaling)
    rope["rope_theta"] = cfg.rope_theta
    names = (
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
        "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
        "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
        "norm_topk_prob", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    )  # fmt: skip
    fields = {n: getattr(cfg, n) for n in names} | {"num_mtp_layers": 0, "initializer_range": 0.2}
    return transformers.DeepseekV3Config(**fields, rope_parameters=rope, **extra)


CASES = {
    "q_lora_yarn": tiny(num_hidden_layers=3),
    "no_q_lora": tiny(num_hidden_layers=3, q_lora_rank=None, rope_scaling=None, norm_topk_prob=False,
                      n_group=2, topk_group=1, first_k_dense_replace=2, num_experts_per_tok=3),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_transformers_checkpoint_imports_with_equal_logits_and_exports_back(tmp_path, case):
    transformers = pytest.importorskip("transformers")
    cfg = CASES[case]
    torch.manual_seed(0)  # transformers' random init
    theirs = transformers.DeepseekV3ForCausalLM(transformers_config(cfg)).eval()
    with torch.no_grad():  # uneven router biases, so they steer the choice
        for layer in theirs.model.layers[cfg.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    theirs.save_pretrained(tmp_path / "theirs")

    family, imported, params = hf.import_hf(tmp_path / "theirs")
    assert family == "deepseek_v3" and imported == replace(cfg, initializer_range=0.2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        their_logits = theirs(tokens).logits
    assert their_logits.abs().max() > 0.5, "logits too small for the comparison to mean anything"
    torch.testing.assert_close(
        deepseek_v3.logits(imported, params, tokens), their_logits, rtol=1e-5, atol=1e-5
    )
    biases = [n for n in params if n.endswith(deepseek_v3.ROUTER_BIAS)]
    assert len(biases) == cfg.num_moe_layers and all(params[n].abs().sum() > 0 for n in biases)

    folder = hf.export_hf("deepseek_v3", imported, params, tmp_path / "ours")
    again, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        assert torch.equal(again.eval()(tokens).logits, their_logits)
    _, cfg_back, params_back = hf.import_hf(folder)
    assert cfg_back == imported and params_back.keys() == params.keys()
    for name, t in params.items():
        assert torch.equal(params_back[name], t), name


def test_multi_token_prediction_is_refused_naming_the_field(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers_config(tiny(), num_nextn_predict_layers=1)
    transformers.DeepseekV3ForCausalLM(hf_cfg).save_pretrained(tmp_path / "mtp")
    with pytest.raises(ValueError, match=r"'num_nextn_predict_layers' = 1 is not supported"):
        hf.import_hf(tmp_path / "mtp")


def test_the_hubs_config_format_imports():
    """DeepSeek-V3's own config.json keys (remote-code era: rope_theta + rope_scaling, topk_method,
    scoring_func, ...) read into the same config as transformers 5's."""
    cfg = tiny(aux_loss_alpha=0.001)
    hub = {
        k: v for k, v in deepseek_v3.hf_config(cfg).items() if k not in ("rope_parameters", "rope_interleave")
    }
    hub.update(rope_theta=cfg.rope_theta, rope_scaling=YARN, moe_layer_freq=1, seq_aux=True, ep_size=1)
    assert deepseek_v3.config_from_hf(hub) == cfg
    for key, value in (("scoring_func", "softmax"), ("topk_method", "greedy"), ("rope_interleave", False)):
        with pytest.raises(ValueError, match=f"'{key}' = "):
            deepseek_v3.config_from_hf({**hub, key: value})


@pytest.mark.parametrize(
    ("overrides", "field"),
    [(dict(n_group=3), "n_group"), (dict(n_group=8), "n_group"), (dict(topk_group=5), "topk_group"),
     (dict(num_key_value_heads=2), "DeepseekV3Config.num_key_value_heads")],
)  # fmt: skip
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny(**overrides)


# ----------------------------------------------------------------------------------------------
# gradients in float64


@pytest.fixture(scope="module")
def float64_cases():
    # 16 experts, top-2 over 6 tokens: at most 12 slots, so some experts get no tokens
    cfg = tiny(n_routed_experts=16, aux_loss_alpha=0.01)
    model = deepseek_v3.build(cfg)
    params = model.init(seed=1, dtype=torch.float64)
    for name in model.buffers:
        params[name] = 0.1 * torch.randn(16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return model, params, stage_cases(model, params, random_batch(cfg, 2, 3))


def test_every_stage_b_and_w_equal_autograd_in_float64(float64_cases):
    model, params, cases = float64_cases
    for stage, inputs in cases:
        outputs, fwd = S.forward(stage, params, inputs, StageContext())
        carried = outputs[: stage.num_carried(len(outputs))]
        gen = torch.Generator().manual_seed(3)
        cotangents = [torch.randn(o.shape, generator=gen, dtype=o.dtype) if o.is_floating_point() else None
                      for o in carried]  # fmt: skip
        grad_inputs, work = S.backward_input(fwd, cotangents, loss_scale=0.5)
        grads = S.backward_weight(work)

        leaves = {n: params[n].clone().requires_grad_(n not in model.buffers) for n in stage.params}
        xs = [t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
        ref_out = S.call(stage, leaves, xs, StageContext())
        total = sum((o * c).sum() for o, c in zip(ref_out, cotangents) if c is not None)
        total = total + sum(w * 0.5 * ref_out[len(carried) + i] for i, w in enumerate(stage.losses))
        total.backward()
        for i, (g, x) in enumerate(zip(grad_inputs, xs)):
            if x.is_floating_point():  # a few hundred terms per entry at most: 1e3 roundings
                assert relative_error(g, x.grad) <= 1e3 * EPS64, f"{stage.name} input {i}"
        assert set(grads) == {n for n in stage.params if leaves[n].grad is not None}
        for n, g in grads.items():
            assert relative_error(g, leaves[n].grad) <= 1e3 * EPS64, f"{stage.name} {n}"
    assert any(deepseek_v3.ROUTER_BIAS in n for s, _ in cases for n in s.params), (
        "the router stage was never tested"
    )


def test_runner_step_equals_autograd_in_float64():
    cfg = tiny(num_hidden_layers=3, aux_loss_alpha=0.01)
    model = deepseek_v3.build(cfg)
    params = model.init(seed=3, dtype=torch.float64)
    batch = random_batch(cfg, 4, 8)
    result = runner.run_sequential(model, params, batch, num_microbatches=2)
    leaves = {n: t.clone().requires_grad_(n not in model.buffers) for n, t in params.items()}
    runner.model_loss(model, leaves, batch, num_microbatches=2).backward()
    for name, g in result.grads.items():
        ref = leaves[name].grad if name not in model.buffers else torch.zeros_like(g)
        assert relative_error(g, ref) <= 1e3 * EPS64, name  # summed over 2 microbatches in another order
    assert all(int(load.sum()) == 4 * 8 * 2 for load in result.statistics.values())
    assert sorted(result.statistics) == sorted(model.buffers)


# ----------------------------------------------------------------------------------------------
# DualPipeV at pp 2 with ep 2


def _pp_ep_worker(rank, world, group, cfg, params, batch, microbatches):
    from fmoe.mesh import build_mesh
    from fmoe.schedules.generators import generate

    model = deepseek_v3.build(cfg)
    mesh = build_mesh(2, 1, 1, 2)
    schedule = generate("dualpipev", 2, microbatches)
    shapes = deepseek_v3.param_shapes(cfg)
    infos = sharding.layout(
        model, mesh, shapes, pipeline.local_param_names(model, schedule, rank=mesh.coords["pp"])
    )
    shards = sharding.shard_canonical(params, infos, mesh)
    out = parallel.parallel_step(model, shards, infos, batch, microbatches, mesh, schedule=schedule)
    return {"loss": out.loss, "grads": sharding.canonical(out.grad_shards, infos, mesh, list(shapes)),
            "statistics": out.statistics}  # fmt: skip


def test_dualpipev_at_pp2_with_ep2_equals_the_sequential_runner():
    cfg = tiny(num_hidden_layers=4, aux_loss_alpha=0.01)
    params = deepseek_v3.init_params(cfg, seed=4, dtype=torch.float64)
    batch = random_batch(cfg, 8, 8, seed=5)  # 2 ep ranks x 4 microbatches of one sequence
    results = dist_helpers.spawn(_pp_ep_worker, 4, (cfg, params, batch, 4), timeout_s=240)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}"
    ref = runner.run_sequential(deepseek_v3.build(cfg), params, batch, num_microbatches=8)
    ours = results[0].value
    # float64 sums over 8 microbatches and 2 ranks in another order: a few roundings per entry
    assert abs(ours["loss"].item() - ref.loss.item()) <= 16 * EPS64 * abs(ref.loss.item())
    assert ours["grads"].keys() == ref.grads.keys()
    for name, g in ref.grads.items():
        assert relative_error(ours["grads"][name], g) <= 1e3 * EPS64, name
    for r in results:  # the loads: integers summed over every rank, the same on each
        assert r.value["statistics"].keys() == ref.statistics.keys()
        assert all(torch.equal(r.value["statistics"][n], v) for n, v in ref.statistics.items())


# ----------------------------------------------------------------------------------------------
# training and the recipes


def test_tiny_recipe_trains_and_moves_the_router_bias(tmp_path):
    corpus = data.builtin_corpus(tmp_path / "corpus.txt", 100_000)
    data.build([corpus], tmp_path / "bytes", tokenizer="bytes", workers=1)
    overrides = {
        "data.path": str(tmp_path / "bytes"), "data.seq_len": 32, "train.steps": 8, "train.global_batch": 4,
        "optim.warmup": 1, "checkpoint.dir": str(tmp_path / "ckpt"), "checkpoint.every": 8,
        "log.dir": str(tmp_path / "log"), "log.progress": False,
    }  # fmt: skip
    rec = recipe.load(RECIPES / "deepseek_v3_tiny.toml", overrides)
    assert rec.model_family == "deepseek_v3"
    result = train(rec)
    assert len(result.losses) == 8 and result.losses[-1] < result.losses[0] - 0.5, result.losses
    rate = rec.model.moe_router_bias_update_rate
    biases = [n for n in result.params if n.endswith(deepseek_v3.ROUTER_BIAS)]
    assert rate > 0 and len(biases) == rec.model.num_moe_layers
    for name in biases:  # 8 steps of +-rate or 0 from 0: whole multiples of rate, not all zero
        steps = result.params[name] / rate
        assert steps.abs().sum() > 0 and steps.abs().max() <= 8, name
        assert (steps - steps.round()).abs().max() < 1e-3, name


def test_real_recipe_parses_builds_and_has_16b_a3b_shapes():
    real = recipe.load(RECIPES / "deepseek_v3_16b_a3b.toml")
    cfg = real.model
    assert real.model_family == "deepseek_v3" and real.train.device == "cuda"
    # measured: with FP8 on, its dense weight gradients in bf16 make the step 1.5% faster
    # (benchmarks/results/issue26_variants_2026-12-07_h100.json); the experts' stay FP8
    assert not real.train.fp8 and not real.train.fp8_dense_wgrad and real.train.fp8_expert_wgrad
    model = deepseek_v3.build(cfg)  # stages only: nothing allocated
    shapes = deepseek_v3.param_shapes(cfg)
    assert set(model.param_names()) == set(shapes)
    total = sum(math.prod(s) for s in shapes.values())
    expert = sum(math.prod(s) for n, s in shapes.items() if ".mlp.experts." in n)
    active = total - expert + expert * cfg.num_experts_per_tok // cfg.n_routed_experts
    assert 15.5e9 <= total < 16.5e9, f"{total:,} parameters, not 16B"
    assert 2.5e9 <= active < 3.5e9, f"{active:,} active parameters (embedding and head included), not 3B"
