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
how each parameter starts. tests/test_family.py holds a complete one.

A family that is no decoder fills ``Family`` itself: ``build(cfg)`` returns a ``spec.Model`` whose
stages carry their ``role`` (``spec.ROLES``); a "dispatch" stage's inputs start with
``spec.RoutedTokens``. ``hf`` (``HFMapping``) is what ``fmoe export-hf`` / ``import-hf`` need; a
family without it trains and checkpoints, and refuses export by name. A mapping states only what
is its family's own (transformers' defaults, aliases, pinned values, extra config.json keys); the
honoured keys, config.json and the config read back follow from the config class's fields.

Also here: the helpers families share to read a Hugging Face config.json without trusting a key
it does not know (``check_hf_fields``, ``checked_kwargs``, ``aliased_field``) and to read tensors
(``check_shape``, ``refuse_surplus``, ``stack_hub_experts``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from fmoe.stages.spec import Model, Params

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


def _no_keys(cfg: Any) -> dict:
    """``HFMapping.write``'s default: no config.json keys besides the config's fields."""
    return {}


def _as_read(hf: Mapping, kwargs: dict) -> dict:
    """``HFMapping.read``'s default: the fields as config.json and ``defaults`` give them."""
    return kwargs


def hub_to_hf(cfg: Any, params: Params) -> dict[str, Tensor]:
    """``HFMapping.to_hf``'s default, the hub's layout: names as fmoe's, stacked experts one by one
    (``unstack_hub_experts``)."""
    return unstack_hub_experts(params)


@dataclass(frozen=True)
class HFMapping:
    """How a family's checkpoints map to Hugging Face's (``fmoe.hf`` writes and reads the files).

    A mapping states what is its family's own; the rest follows from ``config_class``, whose fields
    are named as config.json names them:

    config_class: the family's config dataclass (``Family.config_class``).
    architecture / model_type: config.json's ``architectures[0]`` and ``model_type``.
    defaults: transformers' values for the keys a config.json omits (what transformers itself would
    use); a field missing here and in config.json takes ``config_class``'s default.
    not_in_hf: config fields config.json does not hold under their own names: fmoe's training
    settings, and fields ``write`` / ``read`` convert (rope parameters).
    aliases: {config field: config.json keys naming the same quantity} (transformers 4's and 5's).
    pinned_fields: keys accepted only at the listed values (the math fmoe implements).
    extra_honoured: keys ``read`` sets or checks a field from, besides the fields' names and aliases.
    extra_metadata: keys that change nothing the model computes, besides HF_COMMON_METADATA_FIELDS.
    write(cfg) -> config.json keys besides the fields (derived values, constants transformers reads).
    read(config.json, kwargs) -> kwargs: the family's fix-ups of the fields before the config is built.
    to_hf(cfg, params) -> HF tensors (default: the hub's layout, experts one by one);
    from_hf(cfg, tensors) -> params (KeyError naming a missing tensor, ValueError naming a misshapen or
    surplus one); None: the hub's layout read at ``Family.param_shapes`` (``Family.from_hf``).

    Derived: ``honoured_fields`` (keys that set or check a field), ``metadata_fields``,
    ``hf_config(cfg)`` (config.json) and ``config_from_hf(config.json)`` (the config; any key neither
    honoured, pinned nor metadata is refused by name).
    """

    config_class: type
    architecture: str
    model_type: str
    defaults: Mapping[str, Any] = field(default_factory=dict)
    not_in_hf: tuple[str, ...] = ()
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    pinned_fields: Mapping[str, tuple] = field(default_factory=dict)
    extra_honoured: frozenset[str] = frozenset()
    extra_metadata: frozenset[str] = frozenset()
    write: Callable[[Any], dict] = _no_keys
    read: Callable[[Mapping, dict], dict] = _as_read
    to_hf: Callable[[Any, Params], dict[str, Tensor]] = hub_to_hf
    from_hf: Callable[[Any, Params], dict[str, Tensor]] | None = None

    @property
    def honoured_fields(self) -> frozenset[str]:
        """config.json keys that set or check a config field."""
        names = {f.name for f in fields(self.config_class) if f.init and f.name not in self.not_in_hf}
        return frozenset(names | {k for keys in self.aliases.values() for k in keys} | self.extra_honoured)

    @property
    def metadata_fields(self) -> frozenset[str]:
        """config.json keys that change nothing the model computes."""
        return HF_COMMON_METADATA_FIELDS | self.extra_metadata

    def hf_config(self, cfg: Any) -> dict:
        """config.json for transformers' ``architecture``: every field but ``not_in_hf`` (tuples as
        lists), the architecture and model type, the output flags fmoe's export fixes, then ``write``'s keys."""
        out = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.init and f.name not in self.not_in_hf}
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
        out.update(architectures=[self.architecture], model_type=self.model_type)
        out.update(output_router_logits=False, use_cache=False)
        return out | self.write(cfg)

    def config_from_hf(self, hf: Mapping) -> Any:
        """The config a config.json dict gives: its keys checked (``check_hf_fields``), ``defaults``
        for the keys it omits, each field from the key of its name or an alias, ``read``'s fix-ups,
        each value's JSON type checked (``checked_kwargs``). ValueError names the key."""
        check_hf_fields(hf, self.model_type, self.honoured_fields, self.pinned_fields, self.metadata_fields)
        names = {f.name for f in fields(self.config_class) if f.init and f.name not in self.not_in_hf}
        kwargs = dict(self.defaults)
        kwargs.update({k: v for k, v in hf.items() if k in names and k not in self.aliases})
        for field_name, keys in self.aliases.items():
            kwargs.update(aliased_field(hf, field_name, keys))
        kwargs = self.read(hf, kwargs)
        for f in fields(self.config_class):
            no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if f.init and no_default and f.name not in kwargs:
                raise ValueError(
                    f"config.json lacks {f.name!r} ({self.config_class.__name__} has no default for it)"
                )
        return self.config_class(**checked_kwargs(self.config_class, kwargs))


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
        return self.hf_mapping().to_hf(cfg, params)

    def from_hf(self, cfg: Any, tensors: Params) -> dict[str, Tensor]:
        mapping = self.hf_mapping()
        if mapping.from_hf is not None:
            return mapping.from_hf(cfg, tensors)
        # the hub's layout: every parameter under its own name, stacked experts one by one; a head
        # absent from the params is the tied embedding (a checkpoint's copy of it may stay)
        shapes = self.param_shapes(cfg)
        tied = "lm_head.weight" not in shapes
        return stack_hub_experts(shapes, self.sizes(cfg).num_experts, tensors, tied)

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
    """ValueError naming the first of ``cfg``'s fields outside its range (non-negative ones first)."""
    name = type(cfg).__name__
    for field_name in non_negative:
        if not getattr(cfg, field_name) >= 0:
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


# ----------------------------------------------------------------------------------------------
# reading a Hugging Face config.json: every key honoured, pinned or metadata; nothing guessed

# metadata every family's config.json may carry: names, versions, storage dtype, special-token ids
# (pad_token_id only sets nn.Embedding's padding_idx, i.e. that row's init), generation/output flags,
# and transformers' bookkeeping of where the config came from
HF_COMMON_METADATA_FIELDS = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "_name_or_path",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "output_router_logits",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)
# the keys transformers 4 (rope_theta, rope_scaling) and 5 (rope_parameters) give the rotary
# embedding's base and scaling in (read by ``fmoe.stages.rotary.rope_from_hf``)
HF_ROPE_KEYS = frozenset({"rope_parameters", "rope_theta", "rope_scaling"})
# buffers some checkpoints carry that the config fully determines (recomputed, never read)
HF_DERIVED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


def check_hf_fields(
    hf: Mapping, family: str, honoured: frozenset, pinned: Mapping[str, tuple], metadata: frozenset
) -> None:
    """Refuse (ValueError, one line, the key named) a config.json key that is neither honoured nor
    metadata, or a pinned key at a value outside its accepted ones."""
    for key, value in hf.items():
        if key in pinned:
            if not any(_same_value(value, ok) for ok in pinned[key]):
                accepted = " or ".join(json.dumps(ok) for ok in pinned[key])
                raise ValueError(
                    f"config.json field {key!r} = {json.dumps(value)} is not supported by fmoe's {family} "
                    f"(supported: {accepted})"
                )
        elif key not in honoured and key not in metadata:
            raise ValueError(
                f"config.json field {key!r} is unknown to fmoe's {family} import: refusing rather than "
                "ignoring what it may change"
            )


def _same_value(value, ok) -> bool:
    if isinstance(value, bool) or isinstance(ok, bool):
        return isinstance(value, bool) and isinstance(ok, bool) and value == ok
    return type(value) in (int, float) and type(ok) in (int, float) and value == ok or value == ok


def checked_kwargs(cls: type, kwargs: Mapping) -> dict:
    """``kwargs`` for dataclass ``cls`` with each value's JSON type checked against the field's
    annotation (a list for a tuple field becomes a tuple); ValueError names the first bad key."""
    hints = typing.get_type_hints(cls)
    out = {}
    for key, value in kwargs.items():
        hint = hints[key]
        allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        origins = {typing.get_origin(a) or a for a in allowed}
        ok = (
            (value is None and type(None) in origins)
            or (isinstance(value, bool) and bool in origins)
            or (type(value) is int and (int in origins or float in origins))
            or (type(value) is float and float in origins)
            or (isinstance(value, str) and str in origins)
            or (isinstance(value, Mapping) and dict in origins)
            or (
                isinstance(value, list | tuple)
                and tuple in origins
                and all(isinstance(v, int | str) and not isinstance(v, bool) for v in value)
            )
        )
        if not ok:
            name = getattr(hint, "__name__", None) or str(hint)
            raise ValueError(f"config.json field {key!r} must be {name}, got {json.dumps(value)}")
        out[key] = tuple(value) if isinstance(value, list) else value
    return out


def aliased_field(hf: Mapping, field_name: str, keys: tuple[str, ...]) -> dict:
    """{field_name: value} from whichever of ``keys`` (names of one quantity) config.json has, {}
    when none; ValueError when two of them disagree."""
    found = {k: hf[k] for k in keys if k in hf}
    if len({json.dumps(v) for v in found.values()}) > 1:
        raise ValueError(
            "config.json fields "
            + " and ".join(f"{k!r} ({json.dumps(v)})" for k, v in found.items())
            + " disagree"
        )
    return {field_name: next(iter(found.values()))} if found else {}


# ----------------------------------------------------------------------------------------------
# reading Hugging Face tensors: every tensor read at the shape the config implies, none left over


def check_shape(name: str, t: Tensor, shape: tuple[int, ...]) -> None:
    """ValueError naming tensor ``name`` when its shape is not ``shape`` (what config.json implies)."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"Hugging Face tensor {name!r} has shape {tuple(t.shape)}, config.json implies {tuple(shape)}"
        )


def need_tensor(tensors: Params, name: str) -> Tensor:
    """tensors[name]; KeyError naming it when the checkpoint lacks it."""
    if name not in tensors:
        raise KeyError(f"Hugging Face checkpoint lacks tensor {name!r}")
    return tensors[name]


def refuse_surplus(tensors: Params, used: set[str], tied: bool) -> None:
    """ValueError naming a tensor the config has no place for (more experts, layers or weights in
    the checkpoint than config.json says): importing would silently drop it. Derived buffers
    (HF_DERIVED_TENSOR_SUFFIXES) pass, and so does a tied ``lm_head.weight`` equal to the embedding."""
    for name in sorted(set(tensors) - used):
        if name.endswith(HF_DERIVED_TENSOR_SUFFIXES):
            continue
        if (
            tied
            and name == "lm_head.weight"
            and "model.embed_tokens.weight" in used
            and torch.equal(tensors[name], tensors["model.embed_tokens.weight"])
        ):
            continue
        extra = len(set(tensors) - used) - 1
        more = f" (and {extra} more)" if extra > 0 else ""
        raise ValueError(
            f"Hugging Face tensor {name!r} of shape {tuple(tensors[name].shape)} has no place in the "
            f"model config.json describes{more}: check its layer/expert counts and tie_word_embeddings"
        )


def hub_expert_names(name: str, num_experts: int) -> list[list[str]] | None:
    """The hub's per-expert tensor names that stacked expert tensor ``name`` gathers, per expert
    (``mlp.experts.gate_up_proj``: [gate_proj, up_proj]; ``mlp.experts.down_proj``: [down_proj]);
    None for any other tensor."""
    for stacked, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        if name.endswith("mlp.experts." + stacked):
            pre = name[: -len(stacked)]
            return [[f"{pre}{e}.{part}.weight" for part in parts] for e in range(num_experts)]
    return None


def unstack_hub_experts(params: Params, skip: frozenset[str] = frozenset()) -> dict[str, Tensor]:
    """fmoe params -> the hub's tensors: stacked ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows
    first) and ``down_proj`` [E, H, I] split into one gate/up/down weight per expert; the rest as
    they are; ``skip``: params the hub's checkpoints do not hold (fmoe training buffers)."""
    out: dict[str, Tensor] = {}
    for name, t in params.items():
        if name in skip:
            continue
        per_expert = hub_expert_names(name, t.shape[0])
        if per_expert is None:
            out[name] = t
            continue
        for e, names in enumerate(per_expert):
            for part, rows in zip(names, t[e].chunk(len(names))):
                out[part] = rows
    return {k: v.contiguous() for k, v in out.items()}


def stack_hub_experts(
    shapes: Mapping[str, tuple[int, ...]],
    num_experts: int,
    tensors: Params,
    tied: bool = False,
    absent_buffers: frozenset[str] = frozenset(),
) -> dict[str, Tensor]:
    """fmoe params named in ``shapes`` from HF tensors: stacked expert weights built from the hub's
    per-expert ``experts.{e}.gate_proj/up_proj/down_proj`` when not already stacked. Every tensor
    read is checked against the shape ``shapes`` implies; a tensor left unread is refused
    (``refuse_surplus``). absent_buffers: params a checkpoint may lack (fmoe training buffers,
    e.g. a router bias), then zeros in float32."""
    params: dict[str, Tensor] = {}
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...]) -> Tensor:
        t = need_tensor(tensors, name)
        check_shape(name, t, shape)
        used.add(name)
        return t

    for name, shape in shapes.items():
        per_expert = hub_expert_names(name, num_experts)
        if name in tensors:
            params[name] = take(name, shape)
        elif name in absent_buffers:
            params[name] = torch.zeros(shape, dtype=torch.float32)
        elif per_expert is not None:
            rows = shape[1] // len(per_expert[0])
            params[name] = torch.stack(
                [torch.cat([take(n, (rows, *shape[2:])) for n in names]) for names in per_expert]
            )
        else:
            take(name, shape)
    refuse_surplus(tensors, used, tied)
    return params
