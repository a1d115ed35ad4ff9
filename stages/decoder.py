"""One MoE decoder builder: a family writes what differs, this module writes the stages.

Stages, with what flows between them (b batch, s sequence, T = b*s, k top-k, n = T*k), each with
its ``Stage.role``:
  embed      (tokens)            -> (h [b,s,H])
  per MoE layer l, one expert-parallel rank (no "ep" group, dropless):
    attn       (h, positions)    -> (h1, x [T,H], ids [T,k], w [T,k])  + aux loss (+ load statistic)
    dispatch   (h1, x, ids, w)   -> (h1, x_perm [n,H], w, order [n], offs [E])
    mlp        (h1, x_perm, w, order, offs) -> (h1, y_perm [n,H], w, order)
    combine    (h1, y_perm, w, order)       -> (h1, y [T,k,H], w)
    aggregate  (h1, y, w)        -> (h [b,s,H])
  per MoE layer with an "ep" group in the context (or a capacity factor), El = E / ep local experts:
    dispatch   (h1, x, ids, w)   -> (h1, x_buf [n_kept,H], w, order [n], offs [El], back [m], splits)
    mlp        (h1, x_buf, w, order, offs, back, splits) -> (h1, y_buf [n_kept,H], w, order, back, splits)
    combine    (h1, y_buf, w, order, back, splits)       -> (h1, y [T,k,H], w)
    x_buf holds this rank's experts' rows (UniEP order: expert, then source rank, then token); back
    [m] int64 the buffer row of each slot returned to its source; splits [4, ep] int64 on the CPU
    the exchange's split sizes (see fmoe.stages.moe for the layout). Dropped slots give y = 0.
  with shared experts, dispatch also carries the token rows x after h1, and mlp returns
    h1s = h1 + shared_experts(x) in the residual's slot: (h1, x, x_perm, ...) -> (h1s, y_perm, ...).
  per dense layer: attn (h, positions) -> (h1, x), mlp (h1, x) -> (h1, y), aggregate (h1, y) -> (h)
  head       (h, labels)         -> (loss,)
``h1`` is the residual after attention; ``x`` the post-attention-normed tokens the experts read. A
dispatch stage's first four inputs are ``spec.RoutedTokens``. Parameter names: the embedding
``model.embed_tokens.weight`` (or the family's ``embed_shapes``); per layer under
``model.layers.{l}.``, ``input_layernorm.*``, the family's attention parameters,
``post_attention_layernorm.*``, then the router's, the
experts' (stacked [E, ...] under ``mlp.experts.``, sharded over ep on dim 0) and the shared
experts', or the dense MLP's; ``model.norm.*`` and ``lm_head.weight`` (absent when tied).

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
import torch.nn.functional as F
from torch import Tensor

from fmoe.stages import layers
from fmoe.stages import moe as moe_blocks
from fmoe.stages.family import Family, HFMapping, ModelSizes
from fmoe.stages.primitives import linear
from fmoe.stages.spec import Model, Params, Stage, StageContext, Statistic

Shapes = dict[str, tuple[int, ...]]
EMBED = "model.embed_tokens.weight"


@dataclass(frozen=True)
class DecoderDims:
    """The sizes the builder reads from a family's config, under the builder's names.

    moe_layers: indices of the layers with routed experts (the rest are dense). norm_eps: the
    residual norms' eps. aux_loss_coef: the load-balancing loss weight, split evenly over the MoE
    layers (0: no loss term). capacity_factor: None for dropless routing. router_bias: the local
    name (under the layer prefix) of the router's balancing-bias buffer, None for no bias;
    router_bias_rate: its update rate (> 0: the load statistic and the update, see the module
    docstring). init_std: the normal init's standard deviation. max_positions: the longest sequence
    (None: no limit), set by the config field ``max_positions_field``.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    norm_eps: float = 1e-6
    aux_loss_coef: float = 0.0
    tie_word_embeddings: bool = False
    init_std: float = 0.02
    capacity_factor: float | None = None
    router_bias: str | None = None
    router_bias_rate: float = 0.0
    max_positions: int | None = None
    max_positions_field: str = "max_position_embeddings"

    def __post_init__(self) -> None:
        # a set beside the tuple: is_moe_layer is asked once per layer, so a scan of the tuple
        # would make every walk over the layers quadratic in their number
        object.__setattr__(self, "_moe_set", frozenset(self.moe_layers))

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self._moe_set


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


def swiglu_experts(cfg: Any, p: Params, x: Tensor, offs: Tensor) -> Tensor:
    """``MoEDecoder.experts`` for ``swiglu_expert_shapes``: x [n,H] grouped by expert -> [n,H]."""
    return layers.expert_mlp(x, p["mlp.experts.gate_up_proj"], p["mlp.experts.down_proj"], offs)


def rms_norm(x: Tensor, p: Params, name: str, eps: float) -> Tensor:
    """``MoEDecoder.norm`` default: RMSNorm with weight ``{name}.weight``."""
    return layers.rms_norm(x, p[f"{name}.weight"], eps)


def rms_norm_shapes(name: str, hidden: int) -> Shapes:
    return {f"{name}.weight": (hidden,)}


def token_embedding(cfg: Any, p: Params, tokens: Tensor) -> Tensor:
    """``MoEDecoder.embed`` default: tokens [b,s] int64 -> h [b,s,H] from ``model.embed_tokens.weight``."""
    return F.embedding(tokens, p[EMBED])


def default_init(name: str) -> str:
    """How a parameter starts, by its Hugging Face name: "ones" for norm weights, "zeros" for
    biases, else "normal" (N(0, init_std))."""
    if name.endswith("norm.weight"):
        return "ones"
    return "zeros" if name.endswith("bias") else "normal"


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
      rank's experts; expert_shapes(cfg): stacked [E, ...] tensors under "mlp.experts.".
    shared_experts(cfg, p, x [T,H]) -> [T,H] or None (no shared experts); shared_shapes(cfg).
    dense_mlp(cfg, p, x [T,H]) -> [T,H] for the layers not in dims.moe_layers; dense_shapes(cfg).
    norm(x, p, name, eps): the residual norms ("input_layernorm", "post_attention_layernorm" of each
      layer) and the final one ("model.norm"), reading its parameters ``norm_shapes(name, H)``
      under ``name`` (RMSNorm with ``{name}.weight`` by default; a LayerNorm adds ``{name}.bias``).
    embed(cfg, p, *batch fields ``embed_inputs``) -> h [b,s,H]; embed_shapes(cfg): its parameters
      (default: ``token_embedding``, reading ``tokens`` only; learned positions read "positions" too).
    init(name) -> "ones" | "zeros" | "normal": how each parameter starts (``default_init``).
    """

    dims: Callable[[Any], DecoderDims]
    attention: Callable[..., Tensor]
    attention_shapes: Callable[[Any, int], Shapes]
    router: Callable[[Any, Params, Tensor], tuple[Tensor, Tensor, Tensor]]
    router_shapes: Callable[[Any], Shapes]
    experts: Callable[[Any, Params, Tensor, Tensor], Tensor]
    expert_shapes: Callable[[Any], Shapes]
    shared_experts: Callable[[Any, Params, Tensor], Tensor] | None = None
    shared_shapes: Callable[[Any], Shapes] = _no_params
    dense_mlp: Callable[[Any, Params, Tensor], Tensor] | None = None
    dense_shapes: Callable[[Any], Shapes] = _no_params
    norm: Callable[[Tensor, Params, str, float], Tensor] = rms_norm
    norm_shapes: Callable[[str, int], Shapes] = rms_norm_shapes
    embed: Callable[..., Tensor] = token_embedding
    embed_shapes: Callable[[Any], Shapes] | None = None
    embed_inputs: tuple[str, ...] = ("tokens",)
    init: Callable[[str], str] = default_init

    # ------------------------------------------------------------------------------------------
    # parameters

    def layer_shapes(self, cfg: Any, layer: int, dims: DecoderDims | None = None) -> tuple[Shapes, Shapes]:
        """(attn stage's, mlp stage's) local parameter shapes of one layer, in order. dims: the
        config's ``self.dims(cfg)`` when the caller has it (a walk over the layers passes it: the
        family's dims walks every layer, so one call per layer would be quadratic)."""
        d = self.dims(cfg) if dims is None else dims
        H = d.hidden_size
        attn = {**self.norm_shapes("input_layernorm", H), **self.attention_shapes(cfg, layer)}
        attn.update(self.norm_shapes("post_attention_layernorm", H))
        if not d.is_moe_layer(layer):
            return attn, dict(self.dense_shapes(cfg))
        attn.update(self.router_shapes(cfg))
        return attn, {**self.expert_shapes(cfg), **self.shared_shapes(cfg)}

    def param_shapes(self, cfg: Any) -> Shapes:
        """Every parameter's global name and shape, in a stable order."""
        d = self.dims(cfg)
        shapes = self.embedding_shapes(cfg)
        for i in range(d.num_layers):
            for part in self.layer_shapes(cfg, i, d):
                shapes.update({f"model.layers.{i}.{n}": s for n, s in part.items()})
        shapes.update(self.norm_shapes("model.norm", d.hidden_size))
        if not d.tie_word_embeddings:
            shapes["lm_head.weight"] = (d.vocab_size, d.hidden_size)
        return shapes

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
        return tuple(f"model.layers.{i}.{d.router_bias}" for i in d.moe_layers)

    def init_params(
        self, cfg: Any, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> dict[str, Tensor]:
        """Seeded init (``init``: norms 1, biases 0, the rest N(0, init_std); buffers 0 in float32).

        Each parameter draws from its own generator seeded by (seed, name), so a parameter's values
        do not depend on which others are created (a sharded or pipelined layout inits the same numbers).
        """
        buffers, std = set(self.buffers(cfg)), self.dims(cfg).init_std
        params = {}
        for name, shape in self.param_shapes(cfg).items():
            if name in buffers:  # balancing starts neutral; kept in float32 (a buffer)
                params[name] = torch.zeros(shape, dtype=torch.float32, device=device)
                continue
            kind = self.init(name)
            if kind == "ones":
                value = torch.ones(shape)
            elif kind == "zeros":
                value = torch.zeros(shape)
            elif kind == "normal":
                value = layers.seeded_normal(name, shape, seed, std)
            else:
                raise ValueError(f"init of {name!r}: {kind!r} is not 'ones', 'zeros' or 'normal'")
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
        embed_params = tuple(self.embedding_shapes(cfg))
        stages = [
            Stage(
                "embed",
                part(embed_stage, self, cfg),
                embed_params,
                batch_inputs=self.embed_inputs,
                role="embed",
            )
        ]
        layer_of = [-1]
        aux_weight = d.aux_loss_coef / max(len(d.moe_layers), 1)
        biased = d.router_bias is not None and d.router_bias_rate > 0
        for i in range(d.num_layers):
            pre = f"model.layers.{i}."
            moe = d.is_moe_layer(i)
            attn_shapes, mlp_shapes = self.layer_shapes(cfg, i, d)
            attn_params = tuple(pre + n for n in attn_shapes)
            mlp_params = tuple(pre + n for n in mlp_shapes)
            losses = (aux_weight,) if moe and d.aux_loss_coef else ()
            stats = (Statistic(pre + d.router_bias, (d.num_experts,)),) if moe and biased else ()
            layer = [
                Stage(f"layers.{i}.attn", part(attn_stage, self, cfg, d, i, moe), attn_params, pre,
                      ("positions",), losses, role="attn", statistics=stats),
            ]  # fmt: skip
            if moe:
                shared = self.shared_experts is not None and bool(self.shared_shapes(cfg))
                layer += [
                    Stage(f"layers.{i}.dispatch", part(dispatch_stage, d, shared), role="dispatch"),
                    Stage(
                        f"layers.{i}.mlp", part(expert_stage, self, cfg, shared), mlp_params, pre, role="mlp"
                    ),
                    Stage(f"layers.{i}.combine", part(combine_stage, d), role="combine"),
                    Stage(f"layers.{i}.aggregate", moe_aggregate_stage, role="aggregate"),
                ]
            else:
                layer += [
                    Stage(f"layers.{i}.mlp", part(dense_stage, self, cfg), mlp_params, pre, role="mlp"),
                    Stage(f"layers.{i}.aggregate", dense_aggregate_stage, role="aggregate"),
                ]
            stages += layer
            layer_of += [i] * len(layer)
        head_params = (
            *self.norm_shapes("model.norm", d.hidden_size),
            EMBED if d.tie_word_embeddings else "lm_head.weight",
        )
        stages.append(
            Stage("head", part(head_stage, self, d), head_params, batch_inputs=("labels",), losses=(1.0,),
                  role="head")
        )  # fmt: skip
        layer_of.append(-1)
        return Model(
            cfg, tuple(stages), part(self.init_params, cfg), tuple(layer_of),
            buffer_updates=part(router_bias_updates, d.router_bias_rate) if biased else None,
            buffers=self.buffers(cfg), num_experts=d.num_experts if d.moe_layers else 0,
        )  # fmt: skip

    def sizes(self, cfg: Any) -> ModelSizes:
        d = self.dims(cfg)
        experts = d.num_experts if d.moe_layers else 0
        return ModelSizes(d.vocab_size, d.num_layers, experts, d.max_positions, d.max_positions_field)

    def head_logits(self, cfg: Any, p: Params, h: Tensor) -> Tensor:
        """Final norm and LM head: h [b,s,H] -> logits [b,s,V] (p: the head stage's params)."""
        return head_logits(self, self.dims(cfg), p, h)

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
        """The family contract of a decoder family: shapes, init, build and logits from here."""
        return Family(
            name=name, config_class=config_class, param_shapes=self.param_shapes, init_params=self.init_params,
            build=self.build, logits=self.logits, train_flops_per_token=train_flops_per_token, sizes=self.sizes, hf=hf,
            supports_context_parallel=supports_context_parallel,
        )  # fmt: skip


def router_bias_updates(rate: float, statistics: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``Model.buffer_updates``: {bias name: [E] f32 step} from each MoE layer's load over the step
    (statistics: {bias name: [E] int64}, summed over every rank)."""
    return {name: moe_blocks.router_bias_step(load, rate) for name, load in statistics.items()}


# ----------------------------------------------------------------------------------------------
# stage functions: pure, over a params dict with the layer prefix stripped


def embed_stage(dec: MoEDecoder, cfg: Any, p: Params, inputs: tuple, ctx: StageContext) -> tuple[Tensor]:
    """(tokens [b,s] int64, *the other embed_inputs) -> (h [b,s,H])."""
    return (dec.embed(cfg, p, *inputs),)


def attn_stage(
    dec: MoEDecoder,
    cfg: Any,
    d: DecoderDims,
    layer: int,
    moe: bool,
    p: Params,
    inputs: tuple,
    ctx: StageContext,
) -> tuple[Tensor, ...]:
    """Pre-norm attention with residual, then the post-attention norm and (MoE layers) the router.

    (h [b,s,H], positions [b,s]|[s]) -> MoE: (h1 [b,s,H], x [T,H], ids [T,k] i64, w [T,k], aux [],
                                             load [E] i64 with a router bias rate)
                                       dense: (h1, x [T,H])
    """
    h, positions = inputs
    h1 = h + dec.attention(cfg, layer, p, dec.norm(h, p, "input_layernorm", d.norm_eps), positions, ctx)
    x = dec.norm(h1, p, "post_attention_layernorm", d.norm_eps).reshape(-1, d.hidden_size)
    if not moe:
        return h1, x
    probs, w, ids = dec.router(cfg, p, x)
    outputs = (h1, x, ids, w)
    if d.aux_loss_coef:
        # under context parallelism the statistics span the whole sequence (all cp ranks)
        outputs += (layers.load_balancing_loss(probs, ids, d.num_experts, group=ctx.group("cp")),)
    if d.router_bias is not None and d.router_bias_rate > 0:  # the statistic the bias update reads
        outputs += (moe_blocks.expert_load(ids, d.num_experts),)
    return outputs


def dispatch_stage(
    d: DecoderDims, shared: bool, p: Params, inputs: tuple, ctx: StageContext
) -> tuple[Tensor, ...]:
    """Group the T*k routing slots by expert; under expert parallelism, send them to their ranks.

    No ep group, dropless: (h1, x [T,H], ids [T,k], w [T,k]) -> (h1, x_perm [n,H], w, order [n] i64,
    offs [E] i32), a local permutation. Otherwise -> (h1, x_buf [n_kept,H], w, order [n], offs [El],
    back [m] i64, splits [4,ep] i64 CPU) (fmoe.stages.moe.ep_dispatch; one host sync). With shared
    experts, x follows h1 (they read it in the mlp stage).
    """
    h1, x, ids, w = inputs
    kept = (h1, x) if shared else (h1,)
    group = ctx.group("ep")
    if moe_blocks.group_size(group) == 1 and d.capacity_factor is None:
        order, counts = moe_blocks.expert_sort(ids.reshape(-1), d.num_experts)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return *kept, layers.permute_rows(x, order, d.top_k), w, order, offs
    x_buf, order, offs, back, splits = moe_blocks.ep_dispatch(x, ids, d.num_experts, group, d.capacity_factor)
    return *kept, x_buf, w, order, offs, back, splits


def expert_stage(
    dec: MoEDecoder, cfg: Any, shared: bool, p: Params, inputs: tuple, ctx: StageContext
) -> tuple:
    """This ep rank's experts: (h1, x_perm [n,H], w, order, offs, *rest) -> (h1, y_perm [n,H], w,
    order, *rest) (rest: dispatch's back and splits under expert parallelism); with shared experts
    (h1, x [T,H], x_perm, ...) -> (h1 + shared_experts(x), y_perm, ...)."""
    if shared:
        h1, x, x_perm, w, order, offs, *rest = inputs
        h1 = h1 + dec.shared_experts(cfg, p, x).view_as(h1)
    else:
        h1, x_perm, w, order, offs, *rest = inputs
    for name in dec.expert_shapes(cfg):
        if p[name].shape[0] != offs.shape[0]:
            raise ValueError(
                f"{name} holds {p[name].shape[0]} experts but dispatch grouped rows for {offs.shape[0]}: "
                "under expert parallelism pass each rank its shard (fmoe.expert_parallel.shard_params)"
            )
    return (h1, dec.experts(cfg, p, x_perm, offs), w, order, *rest)


def combine_stage(d: DecoderDims, p: Params, inputs: tuple, ctx: StageContext) -> tuple[Tensor, ...]:
    """Back to token order: (h1, y_perm [n,H], w, order) -> (h1, y [T,k,H], w); under expert
    parallelism (h1, y_buf, w, order, back, splits) -> the same, through the reverse exchange."""
    if moe_blocks.group_size(ctx.group("ep")) == 1 and d.capacity_factor is None:  # as dispatch chose
        h1, y_perm, w, order = inputs
        return h1, layers.unpermute_rows(y_perm, order, d.top_k), w
    h1, y_buf, w, order, back, splits = inputs
    return h1, moe_blocks.ep_combine(y_buf, order, back, splits, d.top_k, ctx.group("ep")), w


def moe_aggregate_stage(p: Params, inputs: tuple, ctx: StageContext) -> tuple[Tensor]:
    """Weighted sum of the k expert outputs plus the residual: (h1, y [T,k,H], w [T,k]) -> (h [b,s,H])."""
    h1, y, w = inputs
    return (layers.moe_output(h1, y, w),)


def dense_stage(
    dec: MoEDecoder, cfg: Any, p: Params, inputs: tuple, ctx: StageContext
) -> tuple[Tensor, Tensor]:
    """A dense layer's MLP: (h1, x [T,H]) -> (h1, y [T,H])."""
    h1, x = inputs
    return h1, dec.dense_mlp(cfg, p, x)


def dense_aggregate_stage(p: Params, inputs: tuple, ctx: StageContext) -> tuple[Tensor]:
    """(h1, y [T,H]) -> (h1 + y,)."""
    h1, y = inputs
    return (h1 + y.view_as(h1),)


def head_logits(dec: MoEDecoder, d: DecoderDims, p: Params, h: Tensor) -> Tensor:
    """Final norm and LM head: h [b,s,H] -> logits [b,s,V]."""
    lm_head = p[EMBED] if d.tie_word_embeddings else p["lm_head.weight"]
    return linear(dec.norm(h, p, "model.norm", d.norm_eps), lm_head, fp8=False)


def head_stage(dec: MoEDecoder, d: DecoderDims, p: Params, inputs: tuple, ctx: StageContext) -> tuple[Tensor]:
    """(h [b,s,H], labels [b,s] i64, -100 ignored) -> (mean token cross-entropy,)."""
    h, labels = inputs
    logits = head_logits(dec, d, p, h)
    return (layers.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)),)
