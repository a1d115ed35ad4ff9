"""The family contract: everything fmoe's runtime needs from a model family, as one object.

A family is a module that exposes ``FAMILY``, a ``Family``. fmoe's own families are listed in
``BUILTIN_FAMILIES``; any other family is named by the import path of its module, so a recipe's
``model.family = "mypkg.my_family"`` trains, pipelines, checkpoints and exports a family that lives
outside fmoe (``lookup``). The runtime reads only the contract's fields: no attribute probes, no
stage or parameter names parsed.

Writing a family. Most families are MoE decoders: write only what differs (attention, router,
experts, optionally shared experts and dense layers) as plain functions, hand them to
``fmoe.stages.decoder.MoEDecoder``, and the builder gives the rest (embed / attn / dispatch / mlp /
combine / aggregate / head stages with their roles, parameter shapes, seeded init, logits)::

    # mypkg/my_family.py
    from dataclasses import dataclass
    from fmoe.stages import decoder, layers
    from fmoe.stages.family import HFMapping

    @dataclass(frozen=True)
    class MyConfig:            # frozen dataclass; the recipe's [model] table fills it, field by field
        vocab: int = 256
        width: int = 32
        depth: int = 2
        experts: int = 4
        top: int = 2
        ffn: int = 16

    def dims(cfg):             # the sizes the builder reads, under the builder's names
        return decoder.DecoderDims(vocab_size=cfg.vocab, hidden_size=cfg.width, num_layers=cfg.depth,
                                   moe_layers=tuple(range(cfg.depth)), num_experts=cfg.experts, top_k=cfg.top)

    def attention(cfg, layer, p, x, positions, ctx): ...   # x [b,s,H] normed -> [b,s,H]
    def attention_shapes(cfg, layer): ...                   # {"self_attn.q_proj.weight": (..), ...}
    def router(cfg, p, x):                                  # x [T,H] -> (probs [T,E], weights [T,k], ids [T,k])
        return layers.top_k_router(x, p["mlp.gate.weight"], cfg.top, True)
    def router_shapes(cfg): return {"mlp.gate.weight": (cfg.experts, cfg.width)}
    def expert_shapes(cfg): return decoder.swiglu_expert_shapes(cfg.experts, cfg.width, cfg.ffn)

    DECODER = decoder.MoEDecoder(dims, attention, attention_shapes, router, router_shapes,
                                 decoder.swiglu_experts, expert_shapes)
    # only to export / import Hugging Face checkpoints: config.json holds MyConfig's fields by name
    HF = HFMapping(MyConfig, architecture="MyForCausalLM", model_type="my_family")
    FAMILY = DECODER.family("my_family", MyConfig, train_flops_per_token=my_flops, hf=HF)

and a recipe says ``[model] family = "mypkg.my_family"``. Optional hooks of ``MoEDecoder``: shared
experts, dense layers, the norm (LayerNorm with a bias, ...), the embedding (learned positions),
the hub's per-expert tensor names. How each parameter starts is declared with its shape
(``decoder.Ones`` / ``decoder.Zeros``; a plain tuple starts normal). tests/test_family.py holds a
complete one.

A family that is no decoder fills ``Family`` itself: ``build(cfg)`` returns a ``spec.Model`` whose
stages carry their ``role`` (``spec.ROLES``); a "dispatch" stage's inputs start with
``spec.RoutedTokens``. ``hf`` (``HFMapping``) is what ``fmoe export-hf`` / ``import-hf`` need; a
family without it trains and checkpoints, and refuses export by name. A mapping states only what
is its family's own (transformers' defaults, aliases, pinned values, extra config.json keys); the
honoured keys, config.json and the config read back follow from the config class's fields.

``HFMapping`` lives in ``fmoe.stages.hf_mapping`` with the helpers families share to read a
Hugging Face config.json and its tensors; it is importable from here too, where family authors
have always imported it. Also here: the checks a family's config makes on construction
(``check_fields``, ``check_top_k``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from fmoe.stages.hf_mapping import (
    HFMapping,
    HubExperts,
    hf_derived_tensors,
    stack_hub_experts,
    unstack_hub_experts,
)
from fmoe.stages.spec import Model, Params

__all__ = ["BUILTIN_FAMILIES", "Family", "HFMapping", "ModelSizes", "check_fields", "check_top_k", "lookup"]

# fmoe's own families: registered name -> the module that exposes its FAMILY
BUILTIN_FAMILIES: dict[str, str] = {
    "qwen3_moe": "fmoe.stages.qwen3_moe",
    "deepseek_v2": "fmoe.stages.deepseek_v2",
    "gpt_oss": "fmoe.stages.gpt_oss",
    "deepseek_v3": "fmoe.stages.deepseek_v3",
}


@dataclass(frozen=True)
class ModelSizes:
    """The sizes fmoe's runtime checks a recipe against.

    vocab_size: token ids must be below it; num_layers: transformer layers (pipeline placement);
    num_experts: routed experts per MoE layer (0: none; expert parallelism splits them);
    max_positions: the longest sequence the model takes (None: no limit), set by the config field
    ``max_positions_field`` (named in errors).
    """

    vocab_size: int
    num_layers: int
    num_experts: int = 0
    max_positions: int | None = None
    max_positions_field: str = "max_position_embeddings"


def _no_hub_experts(cfg: Any) -> HubExperts:
    """``Family.hub_experts``' default: no stacked expert tensor the hub stores one by one."""
    return {}


@dataclass(frozen=True)
class Family:
    """A model family, as fmoe's runtime uses it.

    name: how recipes and checkpoints name it (a ``BUILTIN_FAMILIES`` key, or its module's path).
    config_class: the frozen dataclass of its config (a recipe's [model] table, field by field).
    param_shapes(cfg) -> {global name: shape}, every parameter in a stable order.
    init_params(cfg, seed=0, dtype=float32, device="cpu") -> params, seeded per name.
    build(cfg) -> spec.Model: the stages in forward order, each with its role.
    logits(cfg, params, tokens [b,s], positions=None) -> [b,s,V]: plain forward (inference, parity).
    train_flops_per_token(cfg, seq) -> model FLOPs per trained token (what MFU divides by).
    sizes(cfg) -> ModelSizes: vocabulary, layers, experts, longest sequence.
    hf: the Hugging Face mapping, or None (export / import refused, naming the family).
    supports_context_parallel: its attention and losses run sequence-sharded (parallel.cp > 1).
    hub_experts(cfg) -> ``hf_mapping.HubExperts``: the stacked expert tensors the hub's layout
    stores one by one, with their per-expert names (read by the hub-layout ``to_hf`` / ``from_hf``,
    the ones used when ``hf`` has none of its own); default: none.
    """

    name: str
    config_class: type
    param_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    init_params: Callable[..., dict[str, Tensor]]
    build: Callable[[Any], Model]
    logits: Callable[..., Tensor]
    train_flops_per_token: Callable[[Any, int], float]
    sizes: Callable[[Any], ModelSizes]
    hf: HFMapping | None = None
    supports_context_parallel: bool = False
    hub_experts: Callable[[Any], HubExperts] = _no_hub_experts

    def __post_init__(self) -> None:
        if not (isinstance(self.config_class, type) and dataclasses.is_dataclass(self.config_class)):
            raise TypeError(
                f"Family {self.name!r}: config_class must be a dataclass, got {self.config_class!r}"
            )
        if self.hf is not None and self.hf.config_class is not self.config_class:
            raise TypeError(
                f"Family {self.name!r}: its hf mapping reads {self.hf.config_class.__name__}, "
                f"not the family's config_class {self.config_class.__name__}"
            )

    def hf_mapping(self) -> HFMapping:
        if self.hf is None:
            raise ValueError(
                f"model family {self.name!r} has no Hugging Face mapping (its Family.hf is None)"
            )
        return self.hf

    # the Hugging Face conversions (ValueError naming the family when it has none)
    def to_hf(self, cfg: Any, params: Params) -> dict[str, Tensor]:
        mapping = self.hf_mapping()
        if mapping.to_hf is not None:
            return mapping.to_hf(cfg, params)
        return unstack_hub_experts(params, self.hub_experts(cfg))  # the hub's layout

    def from_hf(self, cfg: Any, tensors: Params) -> dict[str, Tensor]:
        mapping = self.hf_mapping()
        if mapping.from_hf is not None:
            return mapping.from_hf(cfg, tensors)
        # the hub's layout: every parameter under its own name, stacked experts one by one; a head
        # absent from the params is the tied embedding (a checkpoint's copy of it may stay)
        shapes = self.param_shapes(cfg)
        tied = "lm_head.weight" not in shapes
        derived = hf_derived_tensors(self.sizes(cfg).num_layers)
        return stack_hub_experts(shapes, tensors, self.hub_experts(cfg), derived, tied)

    def hf_config(self, cfg: Any) -> dict:
        return self.hf_mapping().hf_config(cfg)

    def config_from_hf(self, hf: Mapping) -> Any:
        return self.hf_mapping().config_from_hf(hf)


def lookup(name: str) -> Family:
    """The family a recipe or checkpoint names: a ``BUILTIN_FAMILIES`` key, or the import path of a
    module exposing ``FAMILY`` (a ``Family``). ValueError (one line, naming ``name``) otherwise."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"model family must be a non-empty string, got {name!r}")
    path = BUILTIN_FAMILIES.get(name, name)
    try:
        module = importlib.import_module(path)
    except ImportError as e:
        raise ValueError(
            f"unknown model family {name!r}: not one of {sorted(BUILTIN_FAMILIES)} and not an importable "
            f"module ({e})"
        ) from None
    family = vars(module).get("FAMILY")
    if not isinstance(family, Family):
        raise ValueError(
            f"model family {name!r}: module {module.__name__} has no FAMILY (a fmoe.stages.family.Family)"
        )
    return family


# ----------------------------------------------------------------------------------------------
# checks a family's config makes on construction (errors name ``Class.field``)


def check_fields(
    cfg: Any,
    positive: tuple[str, ...] = (),
    non_negative: tuple[str, ...] = (),
    positive_or_none: tuple[str, ...] = (),
) -> None:
    """ValueError naming the first of ``cfg``'s fields outside its range (non-negative ones first; a
    field in both is checked as positive only, so -1 and 0 get the same message)."""
    name = type(cfg).__name__
    for field_name in non_negative:
        if field_name not in positive and not getattr(cfg, field_name) >= 0:
            raise ValueError(f"{name}.{field_name} must be >= 0, got {getattr(cfg, field_name)}")
    for field_name in positive:
        if not getattr(cfg, field_name) > 0:
            raise ValueError(f"{name}.{field_name} must be > 0, got {getattr(cfg, field_name)}")
    for field_name in positive_or_none:
        value = getattr(cfg, field_name)
        if value is not None and not value > 0:
            raise ValueError(f"{name}.{field_name} must be > 0 or None, got {value}")


def check_top_k(cfg: Any, top_k_field: str, experts_field: str) -> None:
    """ValueError unless 1 <= top-k <= experts (each field named as ``cfg`` names it)."""
    top_k, experts = getattr(cfg, top_k_field), getattr(cfg, experts_field)
    if not 1 <= top_k <= experts:
        raise ValueError(
            f"{type(cfg).__name__}.{top_k_field} ({top_k}) must be between 1 and {experts_field} ({experts})"
        )
