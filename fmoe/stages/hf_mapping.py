"""How a family's checkpoints map to Hugging Face's: the ``HFMapping`` a family declares, and the
helpers families share to read a Hugging Face config.json without trusting a key it does not know
(``check_hf_fields``, ``checked_kwargs``, ``aliased_field``) and to read and write its tensors
(``check_shape``, ``refuse_surplus``, ``stack_hub_experts``, ``unstack_hub_experts``).

Every tensor name here comes from a table a family declares (``hf_derived_tensors``, the hub's
per-expert names of each stacked expert tensor): no name is parsed.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from fmoe.stages.spec import Params

__all__ = [
    "HF_COMMON_METADATA_FIELDS",
    "HF_ROPE_KEYS",
    "HFMapping",
    "HubExperts",
    "aliased_field",
    "check_hf_fields",
    "check_shape",
    "checked_kwargs",
    "hf_derived_tensors",
    "hub_experts",
    "layer_prefix",
    "need_tensor",
    "refuse_surplus",
    "stack_hub_experts",
    "unstack_hub_experts",
]

# {global name of a stacked expert tensor [E, ...]: the hub's names of its per-expert parts, each
# with "{e}" where the expert's index goes}: what the hub's one-by-one layout splits it into
HubExperts = Mapping[str, tuple[str, ...]]


def layer_prefix(layer: int) -> str:
    """The prefix of transformer layer ``layer``'s tensors, as Hugging Face (and fmoe's decoder) name them."""
    return f"model.layers.{layer}."


def _no_keys(cfg: Any) -> dict:
    """``HFMapping.write``'s default: no config.json keys besides the config's fields."""
    return {}


def _as_read(hf: Mapping, kwargs: dict) -> dict:
    """``HFMapping.read``'s default: the fields as config.json and ``defaults`` give them."""
    return kwargs


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
    to_hf(cfg, params) -> HF tensors; None: the hub's layout, the stacked experts the family's
    ``Family.hub_experts`` names written one by one (``Family.to_hf``).
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
    to_hf: Callable[[Any, Params], dict[str, Tensor]] | None = None
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


def hf_derived_tensors(num_layers: int) -> frozenset[str]:
    """The buffers some checkpoints carry that the config fully determines (recomputed, never read):
    the rotary inverse frequencies, model-wide or per layer's attention."""
    per_layer = (layer_prefix(i) + "self_attn.rotary_emb.inv_freq" for i in range(num_layers))
    return frozenset({"model.rotary_emb.inv_freq", *per_layer})


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


def refuse_surplus(tensors: Params, used: set[str], tied: bool, derived: frozenset[str]) -> None:
    """ValueError naming a tensor the config has no place for (more experts, layers or weights in
    the checkpoint than config.json says): importing would silently drop it. Derived buffers
    (``derived``: ``hf_derived_tensors``) pass, and so does a tied ``lm_head.weight`` equal to the
    embedding."""
    for name in sorted(set(tensors) - used):
        if name in derived:
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


def hub_experts(
    layers: Iterable[int], parts: HubExperts, stacked: Iterable[str]
) -> dict[str, tuple[str, ...]]:
    """The ``HubExperts`` table of a decoder: for each of ``layers``, each local stacked tensor of
    ``stacked`` (its expert shapes) that ``parts`` ({local stacked name: local per-expert names})
    lists, under the layer's prefix."""
    local = [n for n in stacked if n in parts]
    return {
        layer_prefix(i) + n: tuple(layer_prefix(i) + part for part in parts[n]) for i in layers for n in local
    }


def unstack_hub_experts(
    params: Params, experts: HubExperts, skip: frozenset[str] = frozenset()
) -> dict[str, Tensor]:
    """fmoe params -> the hub's tensors: each stacked tensor ``experts`` names ([E, rows, ...], e.g.
    ``mlp.experts.gate_up_proj`` [E, 2I, H] with the gate rows first) split into its parts per expert
    (rows chunked evenly over the parts); the rest as they are; ``skip``: params the hub's
    checkpoints do not hold (fmoe training buffers)."""
    out: dict[str, Tensor] = {}
    for name, t in params.items():
        if name in skip:
            continue
        if name not in experts:
            out[name] = t
            continue
        parts = experts[name]
        for e in range(t.shape[0]):
            for part, rows in zip(parts, t[e].chunk(len(parts))):
                out[part.format(e=e)] = rows
    return {k: v.contiguous() for k, v in out.items()}


def stack_hub_experts(
    shapes: Mapping[str, tuple[int, ...]],
    tensors: Params,
    experts: HubExperts,
    derived: frozenset[str],
    tied: bool = False,
    absent_buffers: frozenset[str] = frozenset(),
) -> dict[str, Tensor]:
    """fmoe params named in ``shapes`` from HF tensors: each stacked tensor ``experts`` names built
    from the hub's per-expert parts when not already stacked. Every tensor read is checked against
    the shape ``shapes`` implies; a tensor left unread is refused (``refuse_surplus``; ``derived``
    pass). absent_buffers: params a checkpoint may lack (fmoe training buffers, e.g. a router bias),
    then zeros in float32."""
    params: dict[str, Tensor] = {}
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...]) -> Tensor:
        t = need_tensor(tensors, name)
        check_shape(name, t, shape)
        used.add(name)
        return t

    for name, shape in shapes.items():
        if name in tensors:
            params[name] = take(name, shape)
        elif name in absent_buffers:
            params[name] = torch.zeros(shape, dtype=torch.float32)
        elif name in experts:
            parts = experts[name]
            rows = shape[1] // len(parts)
            params[name] = torch.stack(
                [torch.cat([take(p.format(e=e), (rows, *shape[2:])) for p in parts]) for e in range(shape[0])]
            )
        else:
            take(name, shape)
    refuse_surplus(tensors, used, tied, derived)
    return params
