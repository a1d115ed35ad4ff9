"""One MoE decoder builder: a family writes what differs, this module writes the stages.

The stages, what flows between them and their roles: ``fmoe.stages.decoder_stages`` (the stage
functions, and ``DecoderDims``, importable from here). Parameter names: the embedding
``model.embed_tokens.weight`` (or the family's ``embed_shapes``); per layer under
``model.layers.{l}.``, ``input_layernorm.*``, the family's attention parameters,
``post_attention_layernorm.*``, then the router's, the experts' (stacked [E, ...], declared as the
model's ``expert_params``: sharded over ep on dim 0) and the shared experts', or the dense MLP's;
``model.norm.*`` and ``lm_head.weight`` (absent when tied). A parameter's shape declares how it
starts: ``Ones`` (norm weights), ``Zeros`` (biases), a plain tuple N(0, init_std).

With ``DecoderDims.router_bias`` the router has an aux-loss-free balancing bias (DeepSeek-V3's
``e_score_correction_bias``): a buffer, not trained, kept in float32. With a
``router_bias_rate`` > 0 the attn stage also returns the layer's load (``load [E]`` int64 routing
slots per expert) as a statistic named after the bias, and ``Model.buffer_updates`` moves the bias
by rate * sign(mean load - load_e) after each optimizer step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fmoe.stages import decoder_stages as stage_fns
from fmoe.stages import layers
from fmoe.stages import moe as moe_blocks
from fmoe.stages.decoder_stages import EMBED, DecoderDims
from fmoe.stages.family import Family, ModelSizes
from fmoe.stages.hf_mapping import HFMapping, HubExperts, hub_experts, layer_prefix
from fmoe.stages.primitives import embedding
from fmoe.stages.spec import Model, Params, Stage, StageContext, Statistic

__all__ = [
    "EMBED",
    "SWIGLU_HUB_EXPERTS",
    "DecoderDims",
    "MoEDecoder",
    "Ones",
    "Shapes",
    "Zeros",
    "dense_swiglu",
    "gated_mlp",
    "gated_mlp_shapes",
    "init_kind",
    "rms_norm",
    "rms_norm_shapes",
    "router_bias_updates",
    "swiglu_expert_shapes",
    "swiglu_experts",
    "swiglu_gathered_experts",
    "token_embedding",
]

Shapes = dict[str, tuple[int, ...]]


class Ones(tuple):
    """A parameter's shape that also declares it starts at 1 (a norm's weight): ``Ones((H,))``."""

    __slots__ = ()


class Zeros(tuple):
    """A parameter's shape that also declares it starts at 0 (a bias): ``Zeros((H,))``."""

    __slots__ = ()


def init_kind(shape: tuple[int, ...]) -> str:
    """How a parameter of declared ``shape`` starts: "ones", "zeros", or "normal" (a plain tuple)."""
    return "ones" if isinstance(shape, Ones) else "zeros" if isinstance(shape, Zeros) else "normal"


def gated_mlp_shapes(prefix: str, hidden: int, intermediate: int) -> Shapes:
    """A SwiGLU MLP's weights under ``prefix``: gate_proj / up_proj [I, H], down_proj [H, I]."""
    return {
        f"{prefix}gate_proj.weight": (intermediate, hidden),
        f"{prefix}up_proj.weight": (intermediate, hidden),
        f"{prefix}down_proj.weight": (hidden, intermediate),
    }


def gated_mlp(p: Params, prefix: str, x: Tensor) -> Tensor:
    """The SwiGLU MLP of ``gated_mlp_shapes(prefix, ...)``: x [T, H] -> [T, H]."""
    return layers.dense_mlp(
        x, p[f"{prefix}gate_proj.weight"], p[f"{prefix}up_proj.weight"], p[f"{prefix}down_proj.weight"]
    )


def dense_swiglu(cfg: Any, p: Params, x: Tensor) -> Tensor:
    """``MoEDecoder.dense_mlp`` for a SwiGLU MLP under "mlp." (``gated_mlp_shapes("mlp.", ...)``)."""
    return gated_mlp(p, "mlp.", x)


def swiglu_expert_shapes(num_experts: int, hidden: int, intermediate: int) -> Shapes:
    """Stacked SwiGLU experts: ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first) and
    ``mlp.experts.down_proj`` [E, H, I]."""
    return {
        "mlp.experts.gate_up_proj": (num_experts, 2 * intermediate, hidden),
        "mlp.experts.down_proj": (num_experts, hidden, intermediate),
    }


# how the hub stores ``swiglu_expert_shapes`` one by one: {local stacked name: its per-expert
# parts, "{e}" the expert's index, rows split evenly in this order} (``MoEDecoder.hub_expert_parts``)
SWIGLU_HUB_EXPERTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mlp.experts.gate_up_proj", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
    ("mlp.experts.down_proj", ("mlp.experts.{e}.down_proj.weight",)),
)


def swiglu_experts(cfg: Any, p: Params, x: Tensor, offs: Tensor) -> Tensor:
    """``MoEDecoder.experts`` for ``swiglu_expert_shapes``: x [n,H] grouped by expert -> [n,H]."""
    return layers.expert_mlp(x, p["mlp.experts.gate_up_proj"], p["mlp.experts.down_proj"], offs)


def swiglu_gathered_experts(
    cfg: Any, p: Params, x: Tensor, order: Tensor, top_k: int, offs: Tensor
) -> Tensor:
    """``MoEDecoder.gathered_experts`` for ``swiglu_expert_shapes``: the tokens x [T,H], gathered
    into expert-grouped rows by order [T*k] i64 -> [T*k,H] in token-slot order
    (``layers.gathered_expert_mlp``)."""
    return layers.gathered_expert_mlp(
        x, order, top_k, p["mlp.experts.gate_up_proj"], p["mlp.experts.down_proj"], offs
    )


def rms_norm(x: Tensor, p: Params, name: str, eps: float) -> Tensor:
    """``MoEDecoder.norm`` default: RMSNorm with weight ``{name}.weight``."""
    return layers.rms_norm(x, p[f"{name}.weight"], eps)


def rms_norm_shapes(name: str, hidden: int) -> Shapes:
    return {f"{name}.weight": Ones((hidden,))}


def token_embedding(cfg: Any, p: Params, tokens: Tensor) -> Tensor:
    """``MoEDecoder.embed`` default: tokens [b,s] int64 -> h [b,s,H] from ``model.embed_tokens.weight``."""
    return embedding(tokens, p[EMBED])


def _no_params(cfg: Any) -> Shapes:
    return {}


@dataclass(frozen=True)
class MoEDecoder:
    """What a MoE decoder family supplies; the methods build the rest (see the module docstring).

    dims(cfg) -> DecoderDims.
    attention(cfg, layer, p, x [b,s,H] normed, positions [b,s]|[s], ctx) -> [b,s,H];
      attention_shapes(cfg, layer) -> {local name: shape} (names under the layer prefix).
    router(cfg, p, x [T,H]) -> (probs [T,E] >= f32 for the aux loss, weights [T,k], ids [T,k] i64);
      router_shapes(cfg) (the bias buffer, when dims has one, included).
    experts(cfg, p, x [n,H] grouped by expert, offs [El] i32 cumulative row ends) -> [n,H], this ep
      rank's experts; expert_shapes(cfg): the stacked [E, ...] tensors (the model's expert_params).
    gathered_experts(cfg, p, x [T,H] tokens, order [T*k] i64, k, offs) -> [T*k,H] in token-slot
      order: ``layers.unpermute_rows(experts(layers.permute_rows(x, order, k)), order, k)``, flat,
      for the local permutation (no expert parallelism), where the family can read the rows from
      the tokens and write its outputs in slot order without the gathered copies (the FP8
      experts); None: the mlp stage gathers the rows, calls ``experts`` and puts the rows back.
    shared_experts(cfg, p, x [T,H]) -> [T,H] or None (no shared experts); shared_shapes(cfg).
    dense_mlp(cfg, p, x [T,H]) -> [T,H] for the layers not in dims.moe_layers; dense_shapes(cfg).
    norm(x, p, name, eps): the residual norms ("input_layernorm", "post_attention_layernorm" of each
      layer) and the final one ("model.norm"), reading its parameters ``norm_shapes(name, H)``
      under ``name`` (RMSNorm with ``{name}.weight`` by default; a LayerNorm adds ``{name}.bias``).
    embed(cfg, p, *batch fields ``embed_inputs``) -> h [b,s,H]; embed_shapes(cfg): its parameters
      (default: ``token_embedding``, reading ``tokens`` only; learned positions read "positions" too).
    hub_expert_parts: ({local stacked expert name: its per-expert hub names}, ...): which of
      expert_shapes the hub's checkpoints store one by one (``SWIGLU_HUB_EXPERTS``; () for none).
    Every shape function declares how its parameters start: ``Ones`` / ``Zeros`` / a plain tuple.
    """

    dims: Callable[[Any], DecoderDims]
    attention: Callable[..., Tensor]
    attention_shapes: Callable[[Any, int], Shapes]
    router: Callable[[Any, Params, Tensor], tuple[Tensor, Tensor, Tensor]]
    router_shapes: Callable[[Any], Shapes]
    experts: Callable[[Any, Params, Tensor, Tensor], Tensor]
    expert_shapes: Callable[[Any], Shapes]
    gathered_experts: Callable[[Any, Params, Tensor, Tensor, int, Tensor], Tensor] | None = None
    shared_experts: Callable[[Any, Params, Tensor], Tensor] | None = None
    shared_shapes: Callable[[Any], Shapes] = _no_params
    dense_mlp: Callable[[Any, Params, Tensor], Tensor] | None = None
    dense_shapes: Callable[[Any], Shapes] = _no_params
    norm: Callable[[Tensor, Params, str, float], Tensor] = rms_norm
    norm_shapes: Callable[[str, int], Shapes] = rms_norm_shapes
    embed: Callable[..., Tensor] = token_embedding
    embed_shapes: Callable[[Any], Shapes] | None = None
    embed_inputs: tuple[str, ...] = ("tokens",)
    hub_expert_parts: tuple[tuple[str, tuple[str, ...]], ...] = SWIGLU_HUB_EXPERTS

    # ------------------------------------------------------------------------------------------
    # parameters

    def layer_shapes(self, cfg: Any, layer: int, dims: DecoderDims | None = None) -> tuple[Shapes, Shapes]:
        """(attn stage's, mlp stage's) local parameter shapes of one layer, in order, as declared
        (``Ones`` / ``Zeros`` / plain). dims: the config's ``self.dims(cfg)`` when the caller has
        it (a walk over the layers passes it: the family's dims walks every layer, so one call per
        layer would be quadratic)."""
        d = self.dims(cfg) if dims is None else dims
        H = d.hidden_size
        attn = {**self.norm_shapes("input_layernorm", H), **self.attention_shapes(cfg, layer)}
        attn.update(self.norm_shapes("post_attention_layernorm", H))
        if not d.is_moe_layer(layer):
            return attn, dict(self.dense_shapes(cfg))
        attn.update(self.router_shapes(cfg))
        return attn, {**self.expert_shapes(cfg), **self.shared_shapes(cfg)}

    def declared_shapes(self, cfg: Any) -> Shapes:
        """Every parameter's global name and declared shape (``Ones`` / ``Zeros`` / plain), in a
        stable order."""
        d = self.dims(cfg)
        shapes = self.embedding_shapes(cfg)
        for i in range(d.num_layers):
            for part in self.layer_shapes(cfg, i, d):
                shapes.update({layer_prefix(i) + n: s for n, s in part.items()})
        shapes.update(self.norm_shapes("model.norm", d.hidden_size))
        if not d.tie_word_embeddings:
            shapes["lm_head.weight"] = (d.vocab_size, d.hidden_size)
        return shapes

    def param_shapes(self, cfg: Any) -> Shapes:
        """Every parameter's global name and shape (plain tuples), in a stable order."""
        return {n: tuple(s) for n, s in self.declared_shapes(cfg).items()}

    def embedding_shapes(self, cfg: Any) -> Shapes:
        """The embed stage's parameters (``model.embed_tokens.weight`` [V, H] unless embed_shapes says)."""
        if self.embed_shapes is not None:
            return dict(self.embed_shapes(cfg))
        d = self.dims(cfg)
        return {EMBED: (d.vocab_size, d.hidden_size)}

    def buffers(self, cfg: Any) -> tuple[str, ...]:
        """The router-bias buffers' global names (never trained; float32)."""
        d = self.dims(cfg)
        if d.router_bias is None:
            return ()
        return tuple(layer_prefix(i) + d.router_bias for i in d.moe_layers)

    def expert_params(self, cfg: Any) -> frozenset[str]:
        """The global names of every MoE layer's stacked experts (``expert_shapes``): the model's
        ``expert_params``, sharded over ep."""
        local = tuple(self.expert_shapes(cfg))
        return frozenset(layer_prefix(i) + n for i in self.dims(cfg).moe_layers for n in local)

    def hub_experts(self, cfg: Any) -> HubExperts:
        """``Family.hub_experts``: the stacked experts of ``hub_expert_parts`` in every MoE layer,
        with the hub's per-expert names."""
        parts = dict(self.hub_expert_parts)
        return hub_experts(self.dims(cfg).moe_layers, parts, self.expert_shapes(cfg))

    def init_params(
        self, cfg: Any, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> dict[str, Tensor]:
        """Seeded init as each shape declares it (norm weights 1, biases 0, the rest N(0, init_std));
        buffers 0 in float32.

        Each parameter draws from its own generator seeded by (seed, name), so a parameter's values
        do not depend on which others are created (a sharded or pipelined layout inits the same numbers).
        """
        buffers, std = set(self.buffers(cfg)), self.dims(cfg).init_std
        params = {}
        for name, declared in self.declared_shapes(cfg).items():
            shape = tuple(declared)
            if name in buffers:  # balancing starts neutral; kept in float32 (a buffer)
                params[name] = torch.zeros(shape, dtype=torch.float32, device=device)
                continue
            kind = init_kind(declared)
            if kind == "ones":
                value = torch.ones(shape)
            elif kind == "zeros":
                value = torch.zeros(shape)
            else:
                value = layers.seeded_normal(name, shape, seed, std)
            params[name] = value.to(device=device, dtype=dtype)
        return params

    # ------------------------------------------------------------------------------------------
    # the model

    def build(self, cfg: Any) -> Model:
        """The model's stages in forward order, each with its role."""
        d = self.dims(cfg)
        if self.dense_mlp is None and len(d.moe_layers) < d.num_layers:
            raise ValueError(f"{type(cfg).__name__}: dense layers need the family's dense_mlp")
        part = functools.partial
        embed = Stage("embed", part(stage_fns.embed_stage, self, cfg), tuple(self.embedding_shapes(cfg)),
                      batch_inputs=self.embed_inputs, role="embed")  # fmt: skip
        stages, layer_of = [embed], [-1]
        for i in range(d.num_layers):
            layer = self.layer_stages(cfg, d, i)
            stages += layer
            layer_of += [i] * len(layer)
        head_params = (
            *self.norm_shapes("model.norm", d.hidden_size),
            EMBED if d.tie_word_embeddings else "lm_head.weight",
        )
        stages.append(
            Stage("head", part(stage_fns.head_stage, self, d), head_params, batch_inputs=("labels",),
                  losses=(1.0,), role="head")
        )  # fmt: skip
        layer_of.append(-1)
        biased = d.router_bias is not None and d.router_bias_rate > 0
        return Model(
            cfg, tuple(stages), part(self.init_params, cfg), tuple(layer_of),
            buffer_updates=part(router_bias_updates, d.router_bias_rate) if biased else None,
            buffers=self.buffers(cfg), num_experts=d.num_experts if d.moe_layers else 0,
            expert_params=self.expert_params(cfg),
        )  # fmt: skip

    def layer_stages(self, cfg: Any, d: DecoderDims, i: int) -> list[Stage]:
        """Layer ``i``'s stages: attn, then dispatch / mlp / combine / aggregate (MoE) or mlp /
        aggregate (dense)."""
        part, pre, moe = functools.partial, layer_prefix(i), d.is_moe_layer(i)
        attn_shapes, mlp_shapes = self.layer_shapes(cfg, i, d)
        mlp_params = tuple(pre + n for n in mlp_shapes)
        losses = (d.aux_loss_coef / max(len(d.moe_layers), 1),) if moe and d.aux_loss_coef else ()
        biased = moe and d.router_bias is not None and d.router_bias_rate > 0
        stats = (Statistic(pre + d.router_bias, (d.num_experts,)),) if biased else ()
        attn = Stage(f"layers.{i}.attn", part(stage_fns.attn_stage, self, cfg, d, i, moe),
                     tuple(pre + n for n in attn_shapes), pre, ("positions",), losses, role="attn",
                     statistics=stats)  # fmt: skip
        if not moe:
            return [
                attn,
                Stage(f"layers.{i}.mlp", part(stage_fns.dense_stage, self, cfg), mlp_params, pre, role="mlp"),
                Stage(f"layers.{i}.aggregate", stage_fns.dense_aggregate_stage, role="aggregate"),
            ]
        shared = self.shared_experts is not None and bool(self.shared_shapes(cfg))
        expert_fn = part(stage_fns.expert_stage, self, cfg, d, shared)
        return [
            attn,
            Stage(f"layers.{i}.dispatch", part(stage_fns.dispatch_stage, d, shared), role="dispatch"),
            Stage(f"layers.{i}.mlp", expert_fn, mlp_params, pre, role="mlp"),
            Stage(f"layers.{i}.combine", part(stage_fns.combine_stage, d), role="combine"),
            Stage(f"layers.{i}.aggregate", stage_fns.moe_aggregate_stage, role="aggregate"),
        ]

    def sizes(self, cfg: Any) -> ModelSizes:
        d = self.dims(cfg)
        experts = d.num_experts if d.moe_layers else 0
        return ModelSizes(d.vocab_size, d.num_layers, experts, d.max_positions, d.max_positions_field)

    def head_logits(self, cfg: Any, p: Params, h: Tensor) -> Tensor:
        """Final norm and LM head: h [b,s,H] -> logits [b,s,V] (p: the head stage's params)."""
        return stage_fns.head_logits(self, self.dims(cfg), p, h)

    def logits(self, cfg: Any, params: Params, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """Plain forward to logits [b,s,V] (inference, HF parity checks); runs the same stage functions."""
        model = self.build(cfg)
        ctx = StageContext()
        pos = torch.arange(tokens.shape[1], device=tokens.device) if positions is None else positions
        batch = {"tokens": tokens, "positions": pos}
        carry: tuple[Tensor, ...] = ()
        for stage in model.stages[:-1]:
            local = {stage.local_name(n): params[n] for n in stage.params}
            out = stage.forward(local, carry + tuple(batch[k] for k in stage.batch_inputs), ctx)
            carry = out[: stage.num_carried(len(out))]
        return self.head_logits(cfg, {n: params[n] for n in model.stages[-1].params}, carry[0])

    def family(
        self,
        name: str,
        config_class: type,
        train_flops_per_token: Callable[[Any, int], float],
        hf: HFMapping | None = None,
        supports_context_parallel: bool = False,
    ) -> Family:
        """The family contract of a decoder family: shapes, init, build, logits and the hub's
        expert names from here."""
        return Family(
            name=name, config_class=config_class, param_shapes=self.param_shapes, init_params=self.init_params,
            build=self.build, logits=self.logits, train_flops_per_token=train_flops_per_token, sizes=self.sizes, hf=hf,
            supports_context_parallel=supports_context_parallel, hub_experts=self.hub_experts,
        )  # fmt: skip


def router_bias_updates(rate: float, statistics: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``Model.buffer_updates``: {bias name: [E] f32 step} from each MoE layer's load over the step
    (statistics: {bias name: [E] int64}, summed over every rank)."""
    return {name: moe_blocks.router_bias_step(load, rate) for name, load in statistics.items()}
