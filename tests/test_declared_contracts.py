"""What the runtime knows about a model's parameters is declared, never read from their names.

Expert parallelism shards ``Model.expert_params`` (the decoder fills it from ``expert_shapes``),
each parameter starts as its shape declares (``decoder.Ones`` / ``Zeros`` / a plain tuple), the
hub's per-expert tensors come from a table (``Family.hub_experts``) and so do the derived buffers
an import skips (``hf_mapping.hf_derived_tensors``); a MoE layer's carry is named
(``decoder_stages.ExpertRows``), packed and unpacked in one place.
"""

from __future__ import annotations

import dataclasses

import pytest
import test_deepseek_v2
import test_deepseek_v3
import test_gpt_oss
import torch
from conftest import random_batch, tiny_config

from fmoe import expert_parallel, runner, sharding
from fmoe.mesh import Mesh
from fmoe.stages import decoder, hf_mapping, layers
from fmoe.stages.decoder_stages import Exchange, ExpertRows
from fmoe.stages.family import lookup
from fmoe.stages.spec import Model, Stage

TINY = {
    "qwen3_moe": tiny_config(attention_bias=True, moe_router_bias_update_rate=0.1),
    "deepseek_v2": test_deepseek_v2.tiny(),
    "deepseek_v3": test_deepseek_v3.tiny(),
    "gpt_oss": test_gpt_oss.tiny(),
}


@pytest.mark.parametrize("family", sorted(TINY))
def test_a_builtin_familys_expert_params_are_its_stacked_experts(family):
    fam, cfg = lookup(family), TINY[family]
    model, shapes = fam.build(cfg), fam.param_shapes(cfg)
    # what the name convention used to find: the same tensors, now declared
    assert model.expert_params == {n for n in shapes if ".mlp.experts." in n}
    assert model.expert_params and all(shapes[n][0] == model.num_experts for n in model.expert_params)


@pytest.mark.parametrize("family", sorted(TINY))
def test_every_parameter_starts_as_its_shape_declares(family):
    """Norm weights 1, biases 0, the rest normal: what the name rule gave before the declaration."""
    fam, cfg = lookup(family), TINY[family]
    params, buffers = fam.init_params(cfg, seed=2), set(fam.build(cfg).buffers)
    for name, t in params.items():
        if name in buffers:
            assert t.dtype == torch.float32 and not t.any(), name
        elif name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)), name
        elif name.endswith("bias"):
            assert not t.any(), name
        else:
            assert torch.equal(t, layers.seeded_normal(name, tuple(t.shape), 2, 0.02)), name


# a family whose experts are not under "mlp.experts." and whose router is: only the declaration counts
def _dims(cfg):
    return decoder.DecoderDims(
        vocab_size=64, hidden_size=16, num_layers=2, moe_layers=(0, 1), num_experts=4, top_k=2
    )


def _router(cfg, p, x):
    return layers.top_k_router(x, p["mlp.experts.router"], 2, True)


def _experts(cfg, p, x, offs):
    return layers.expert_mlp(x, p["mlp.ffn.gate_up"], p["mlp.ffn.down"], offs)


def _attention(cfg, layer, p, x, positions, ctx):
    return x @ p["attn.w"]


ODD = decoder.MoEDecoder(
    _dims, _attention, lambda cfg, layer: {"attn.w": (16, 16)}, _router,
    lambda cfg: {"mlp.experts.router": (4, 16)}, _experts,
    lambda cfg: {"mlp.ffn.gate_up": (4, 16, 16), "mlp.ffn.down": (4, 16, 8)},
)  # fmt: skip


def test_experts_are_sharded_by_their_declaration_not_by_their_names():
    model = ODD.build(None)
    experts = {f"model.layers.{i}.mlp.ffn.{n}" for i in (0, 1) for n in ("gate_up", "down")}
    assert model.expert_params == experts
    router = "model.layers.1.mlp.experts.router"
    shapes = ODD.param_shapes(None)
    mesh = Mesh(1, 1, 1, 2, rank=1, coords={"pp": 0, "dp": 0, "cp": 0, "ep": 1})
    infos = sharding.planned_layout(model, mesh, shapes, list(shapes))
    assert (
        infos["model.layers.1.mlp.ffn.down"].full_shape == (2, 16, 8)
        and infos["model.layers.1.mlp.ffn.down"].expert
    )
    assert infos[router].full_shape == (4, 16) and not infos[router].expert
    params = ODD.init_params(None, seed=1)
    shard = expert_parallel.shard_params(params, model.expert_params, 2, 1)
    assert torch.equal(shard["model.layers.0.mlp.ffn.gate_up"], params["model.layers.0.mlp.ffn.gate_up"][2:])
    assert shard[router] is params[router]
    # the hub's one-by-one layout lists only the SwiGLU names it knows: these stay stacked
    assert ODD.hub_experts(None) == {}
    # and the model runs: the carry between its stages is the decoder's
    batch = random_batch(tiny_config(vocab_size=64), 2, 4)
    assert torch.isfinite(runner.run_sequential(model, params, batch, num_microbatches=1).loss)


def test_a_model_refuses_expert_params_that_no_stage_reads():
    stage = Stage("s", lambda p, inputs, ctx: inputs, ("w",))
    with pytest.raises(ValueError, match=r"Model.expert_params names 'v', which no stage reads"):
        Model(None, (stage,), lambda **kw: {}, expert_params=frozenset({"w", "v"}))


def test_the_hub_layout_comes_from_the_familys_table():
    cfg = tiny_config()
    fam = lookup("qwen3_moe")
    table = fam.hub_experts(cfg)
    assert table == {
        name: parts
        for i in (0, 1)
        for name, parts in (
            (f"model.layers.{i}.mlp.experts.gate_up_proj", (
                f"model.layers.{i}.mlp.experts.{{e}}.gate_proj.weight",
                f"model.layers.{i}.mlp.experts.{{e}}.up_proj.weight",
            )),
            (f"model.layers.{i}.mlp.experts.down_proj", (f"model.layers.{i}.mlp.experts.{{e}}.down_proj.weight",)),
        )
    }  # fmt: skip
    params = fam.init_params(cfg, seed=1)
    hub = fam.to_hf(cfg, params)
    gate_up = params["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(hub["model.layers.1.mlp.experts.3.up_proj.weight"], gate_up[3, 16:])
    assert "model.layers.1.mlp.experts.gate_up_proj" not in hub
    back = fam.from_hf(cfg, hub)
    assert set(back) == set(params) and all(torch.equal(back[n], params[n]) for n in params)


def test_an_import_skips_the_declared_derived_buffers_only():
    cfg = tiny_config()
    fam = lookup("qwen3_moe")
    hub = fam.to_hf(cfg, fam.init_params(cfg, seed=1))
    derived = hf_mapping.hf_derived_tensors(cfg.num_hidden_layers)
    assert (
        "model.layers.1.self_attn.rotary_emb.inv_freq" in derived and "model.rotary_emb.inv_freq" in derived
    )
    fam.from_hf(cfg, {**hub, "model.layers.1.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    for extra in ("model.layers.2.self_attn.rotary_emb.inv_freq", "model.layers.1.mlp.extra.weight"):
        with pytest.raises(ValueError, match=f"Hugging Face tensor '{extra}' of shape"):
            fam.from_hf(cfg, {**hub, extra: torch.ones(4)})


def test_gpt_oss_transposes_its_declared_expert_weights_only():
    cfg = test_gpt_oss.tiny()
    fam = lookup("gpt_oss")
    params = fam.init_params(cfg, seed=1)
    hub = fam.to_hf(cfg, params)
    flipped = {f"model.layers.{i}.mlp.experts.{n}" for i in (0, 1) for n in ("gate_up_proj", "down_proj")}
    assert set(hub) == set(params)
    for name, t in params.items():
        assert torch.equal(hub[name], t.transpose(1, 2) if name in flipped else t), name


@pytest.mark.parametrize("tokens", [False, True])
@pytest.mark.parametrize("offs", [False, True])
@pytest.mark.parametrize("exchanged", [False, True])
def test_a_moe_layers_carry_packs_and_unpacks_by_name(tokens, offs, exchanged):
    t = [torch.full((1,), float(i)) for i in range(8)]
    carry = ExpertRows(
        t[0], t[1], t[2], t[3], t[4] if offs else None, t[5] if tokens else None,
        Exchange(t[6], t[7]) if exchanged else None,
    )  # fmt: skip
    wire = carry.pack()
    assert type(wire) is tuple and len(wire) == 4 + tokens + offs + 2 * exchanged
    assert wire[0] is t[0] and (wire[1] is t[5]) == tokens  # the residual first, the tokens after it
    back = ExpertRows.unpack(wire, tokens=tokens, offs=offs)
    assert all(
        getattr(back, f.name) is getattr(carry, f.name)
        for f in dataclasses.fields(ExpertRows)
        if f.name != "exchange"
    )
    assert (back.exchange is None) == (not exchanged)
    if exchanged:
        assert back.exchange.back is t[6] and back.exchange.splits is t[7]
    with pytest.raises(ValueError, match=r"a MoE layer's carry of \d+ tensors; expected"):
        ExpertRows.unpack(wire + (t[0],), tokens=tokens, offs=offs)
