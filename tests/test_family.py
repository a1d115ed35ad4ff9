"""The family contract: a recipe names a family by its registered name or by an import path, and
the runtime reads stage roles and the contract's fields, never stage names or config field names."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest
import torch
from conftest import random_batch, tiny_config
from test_train import recipe_dict, run_cli, toml_text

from fmoe import expert_parallel, fb_order, hf
from fmoe import recipe as R
from fmoe.stages import qwen3_moe
from fmoe.stages.family import BUILTIN_FAMILIES, lookup
from fmoe.stages.spec import Stage

# A user's family outside fmoe: a MoE decoder whose config names nothing as fmoe's families do
# (no vocab_size, num_hidden_layers, num_experts, max_position_embeddings), so the run can only
# work if the runtime reads the contract.
USER_FAMILY = """
from dataclasses import dataclass

import torch
from fmoe.stages import decoder, layers
from fmoe.stages.primitives import linear


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 264
    width: int = 32
    depth: int = 2
    heads: int = 4
    experts: int = 4
    top: int = 2
    ffn: int = 16
    longest: int = 64


def dims(cfg):
    return decoder.DecoderDims(
        vocab_size=cfg.vocab, hidden_size=cfg.width, num_layers=cfg.depth, moe_layers=tuple(range(cfg.depth)),
        num_experts=cfg.experts, top_k=cfg.top, aux_loss_coef=0.01, max_positions=cfg.longest,
        max_positions_field="longest",
    )


def attention(cfg, layer, p, x, positions, ctx):
    b, s, h = x.shape
    q, k, v = (linear(x, p[f"attn.{n}"]).view(b, s, cfg.heads, -1).transpose(1, 2) for n in "qkv")
    out = layers.causal_attention(q, k, v, (h // cfg.heads) ** -0.5)
    return linear(out.transpose(1, 2).reshape(b, s, h), p["attn.o"])


def attention_shapes(cfg, layer):
    return {f"attn.{n}": (cfg.width, cfg.width) for n in "qkvo"}


def router(cfg, p, x):
    return layers.top_k_router(x, p["mlp.gate.weight"], cfg.top, True)


def router_shapes(cfg):
    return {"mlp.gate.weight": (cfg.experts, cfg.width)}


def expert_shapes(cfg):
    return decoder.swiglu_expert_shapes(cfg.experts, cfg.width, cfg.ffn)


def layer_norm(x, p, name, eps):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], p[f"{name}.weight"], p[f"{name}.bias"], eps)


def layer_norm_shapes(name, hidden):
    return {f"{name}.weight": decoder.Ones((hidden,)), f"{name}.bias": decoder.Zeros((hidden,))}


def embed(cfg, p, tokens, positions):  # learned positions
    return p["model.embed_tokens.weight"][tokens] + p["model.embed_positions.weight"][positions]


def embed_shapes(cfg):
    return {"model.embed_tokens.weight": (cfg.vocab, cfg.width), "model.embed_positions.weight": (cfg.longest, cfg.width)}


def flops(cfg, seq):
    return 6.0 * cfg.depth * cfg.width * cfg.width


DECODER = decoder.MoEDecoder(dims, attention, attention_shapes, router, router_shapes,
                             decoder.swiglu_experts, expert_shapes, norm=layer_norm, norm_shapes=layer_norm_shapes,
                             embed=embed, embed_shapes=embed_shapes, embed_inputs=("tokens", "positions"))
FAMILY = DECODER.family("tiny_user_family", TinyConfig, flops)
"""


@pytest.fixture
def user_family(tmp_path, monkeypatch) -> str:
    """The import path of USER_FAMILY, written as a package outside fmoe."""
    package = tmp_path / "user_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "tiny_family.py").write_text(textwrap.dedent(USER_FAMILY))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_pkg.tiny_family"


def test_a_recipe_trains_a_family_named_by_its_import_path(tmp_path, dataset, capsys, user_family):
    d = recipe_dict(tmp_path, dataset, train={"steps": 2}, optim={"warmup": 0}, checkpoint={"every": 2})
    d["model"] = {"family": user_family, "vocab": 264, "width": 32, "depth": 2}
    path = tmp_path / "user.toml"
    path.write_text(toml_text(d))
    code, err = run_cli(["train", str(path)], capsys)
    assert code == 0, err
    assert (tmp_path / "ckpt").is_dir() and any((tmp_path / "ckpt").iterdir()), "no checkpoint written"
    recipe = R.load(path)
    assert type(recipe.model).__name__ == "TinyConfig" and recipe.model_family == user_family
    family = lookup(user_family)
    shapes = family.param_shapes(recipe.model)
    assert shapes["model.embed_positions.weight"] == (64, 32) and shapes[
        "model.layers.1.input_layernorm.bias"
    ] == (32,)
    assert family.build(recipe.model).stages[0].batch_inputs == ("tokens", "positions")
    init = family.init_params(recipe.model, seed=3)
    assert torch.equal(init["model.norm.bias"], torch.zeros(32)) and torch.equal(
        init["model.norm.weight"], torch.ones(32)
    )
    # a family without a Hugging Face mapping trains, and refuses export naming itself
    with pytest.raises(ValueError, match=r"model family 'tiny_user_family' has no Hugging Face mapping"):
        hf.export_hf(user_family, recipe.model, init, tmp_path / "hf")


def test_the_runtime_reads_the_user_familys_sizes_not_its_field_names(
    tmp_path, dataset, user_family, monkeypatch
):
    d = recipe_dict(tmp_path, dataset)
    d["model"] = {"family": user_family, "longest": 16}
    with pytest.raises(R.RecipeError, match=r"model\.longest \(16\) must be >= data\.seq_len \(32\)"):
        R.from_dict(d, "r.toml")
    d["model"] = {"family": user_family, "experts": 6}
    d["parallel"] = {"ep": 4}
    d["train"] = {"global_batch": 8}
    monkeypatch.setenv("WORLD_SIZE", "4")  # the sizes are checked before any process group is made
    from fmoe.train import train

    with pytest.raises(
        R.RecipeError, match=r"model.num_experts \(6\) must be a multiple of parallel.ep \(4\)"
    ):
        train(R.from_dict(d, "r.toml"))


@pytest.mark.parametrize("name", ["no_such_family_xyz", "json"])
def test_a_family_that_is_neither_registered_nor_a_module_with_FAMILY_is_named(tmp_path, dataset, name):
    d = recipe_dict(tmp_path, dataset)
    d["model"] = {"family": name}
    with pytest.raises(R.RecipeError) as e:
        R.from_dict(d, "r.toml")
    message = str(e.value)
    assert message.startswith("r.toml: model.family: ") and f"{name!r}" in message and "\n" not in message
    assert ("has no FAMILY" if name == "json" else "not an importable module") in message


def test_every_builtin_family_is_looked_up_by_its_name():
    for name in BUILTIN_FAMILIES:
        family = lookup(name)
        assert family.name == name and family.hf is not None and family.hf.model_type == name


def renamed(model):
    """The model with opaque stage names: only roles say what a stage is."""
    stages = tuple(dataclasses.replace(s, name=f"stage{i}") for i, s in enumerate(model.stages))
    return dataclasses.replace(model, stages=stages)


def test_the_fb_order_reads_each_stages_role_not_its_name():
    model = qwen3_moe.build(tiny_config(mlp_only_layers=(0,)))  # layer 0 dense, layer 1 MoE
    assert [fb_order.role(s) for s in renamed(model).stages] == [0, 1, 3, 5, 1, 2, 3, 4, 5, 0]
    assert [s.role for s in model.stages] == [
        "embed", "attn", "mlp", "aggregate", "attn", "dispatch", "mlp", "combine", "aggregate", "head",
    ]  # fmt: skip


def test_expert_parallel_finds_the_routing_by_role():
    cfg = tiny_config(num_hidden_layers=3, mlp_only_layers=(0,))
    model = qwen3_moe.build(cfg)
    params = model.init(seed=1)
    batch = random_batch(cfg, 4, 8, seed=3)
    named = expert_parallel.ep_step(model, params, batch, 2, None)
    opaque = expert_parallel.ep_step(renamed(model), params, batch, 2, None)
    assert sorted(named.expert_loads) == [1, 2]
    for layer, load in named.expert_loads.items():
        assert int(load.sum()) == 4 * 8 * cfg.num_experts_per_tok
        assert torch.equal(opaque.expert_loads[layer], load), layer


def test_a_stage_role_outside_the_roles_is_refused_naming_the_stage():
    with pytest.raises(ValueError, match=r"Stage 'layers.0.x': role must be one of .* got 'dispatcher'"):
        Stage("layers.0.x", lambda p, inputs, ctx: inputs, role="dispatcher")


def test_the_exported_tokenizers_length_limit_is_the_familys_longest_sequence(tmp_path, monkeypatch):
    cfg = tiny_config()
    sizes = qwen3_moe.FAMILY.sizes(cfg)
    assert sizes.max_positions == cfg.max_position_embeddings
    shorter = dataclasses.replace(sizes, max_positions=77)
    monkeypatch.setattr(qwen3_moe, "FAMILY", dataclasses.replace(qwen3_moe.FAMILY, sizes=lambda c: shorter))
    out = hf.export_hf("qwen3_moe", cfg, qwen3_moe.init_params(cfg), tmp_path / "hf", tokenizer="bytes")
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 77
