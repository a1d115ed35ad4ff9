"""Qwen3-MoE as pure stage functions.

Stages, with what flows between them (b batch, s sequence, T = b*s, k top-k, n = T*k):
  embed      (tokens)            -> (h [b,s,H])
  per MoE layer l, one expert-parallel rank (no "ep" group, dropless):
    attn       (h, positions)    -> (h1, x [T,H], ids [T,k], w [T,k])  + aux loss
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
  per dense layer (mlp_only_layers / decoder_sparse_step): attn (h, positions) -> (h1, x),
    mlp (h1, x) -> (h1, y), aggregate (h1, y) -> (h)
  head       (h, labels)         -> (loss,)
``h1`` is the residual after attention; ``x`` the post-attention-normed tokens the experts read.
Parameter names are Hugging Face's (transformers' stacked-expert layout), so checkpoint conversion is
a renaming plus splitting experts. Under expert parallelism rank r holds experts [r*El, (r+1)*El)
of ``mlp.experts.*`` under the same names ([El, ...]; see fmoe.expert_parallel). With
``moe_router_bias_update_rate > 0`` each MoE layer also has ``mlp.gate.e_score_correction_bias``
[E] (DeepSeek-V3's name): a buffer, not trained, added to the router's scores for the top-k
selection only. Its attn stage then also returns the layer's load, load [E] int64 routing slots
per expert, as a statistic (``Stage.statistics``, named after the bias) after the aux loss; the
trainer sums it over the step and every rank and adds ``Model.buffer_updates`` (DeepSeek-V3's
bias_e += rate * sign(mean load - load_e), ``router_bias_updates``) after each optimizer step.
"""

from __future__ import annotations

import functools
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import torch
from fmoe.stages import layers
from fmoe.stages import moe as moe_blocks
from fmoe.stages.primitives import linear
from fmoe.stages.spec import Model, Params, Stage, StageContext, Statistic
from torch import Tensor


@dataclass(frozen=True)
class Qwen3MoeConfig:
    """Fields named as in Hugging Face's ``Qwen3MoeConfig``; defaults give a tiny CPU model.

    rope_scaling: None (plain RoPE) or a YaRN table (transformers' ``rope_parameters`` without
    ``rope_theta``; see fmoe.stages.deepseek_v2.check_rope_scaling).
    """

    vocab_size: int = 512
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = 16
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    intermediate_size: int = 128
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    tie_word_embeddings: bool = False
    router_aux_loss_coef: float = 0.001
    initializer_range: float = 0.02
    max_position_embeddings: int = 32768
    attention_bias: bool = False  # q/k/v/o projection biases
    rope_scaling: dict | None = None
    # fmoe training settings (not Hugging Face config fields; hf_config leaves them out)
    moe_capacity_factor: float | None = None  # None: dropless
    moe_router_bias_update_rate: float = 0.0  # > 0: aux-loss-free balancing bias (DeepSeek-V3)

    def __post_init__(self) -> None:
        from fmoe.stages import deepseek_v2  # YaRN lives there; it imports this module

        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        object.__setattr__(
            self,
            "rope_scaling",
            deepseek_v2.check_rope_scaling(self.rope_scaling, "Qwen3MoeConfig.rope_scaling"),
        )
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("head_dim", "mlp_only_layers", "moe_capacity_factor", "rope_scaling") or isinstance(
                value, bool
            ):
                continue
            if isinstance(value, int | float) and value < 0:
                raise ValueError(f"Qwen3MoeConfig.{f.name} must be >= 0, got {value}")
        positive = (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "num_experts", "moe_intermediate_size", "intermediate_size", "max_position_embeddings", "rope_theta",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"Qwen3MoeConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.head_dim is not None and self.head_dim <= 0:
            raise ValueError(f"Qwen3MoeConfig.head_dim must be > 0 or None, got {self.head_dim}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"Qwen3MoeConfig: num_attention_heads ({self.num_attention_heads}) must divide "
                f"hidden_size ({self.hidden_size}) when head_dim is not set"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Qwen3MoeConfig: num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"Qwen3MoeConfig.num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                f"num_experts ({self.num_experts})"
            )
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            raise ValueError(
                f"Qwen3MoeConfig.moe_capacity_factor must be > 0 or None, got {self.moe_capacity_factor}"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(
                f"Qwen3MoeConfig.decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(
                f"Qwen3MoeConfig.mlp_only_layers names layers {bad} outside 0..{self.num_hidden_layers - 1}"
            )

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))


# the aux-loss-free balancing bias of a MoE layer (a buffer: never trained, see the module docstring)
ROUTER_BIAS = "mlp.gate.e_score_correction_bias"


def router_bias_name(layer: int) -> str:
    return f"model.layers.{layer}.{ROUTER_BIAS}"


def router_bias_updates(cfg: Qwen3MoeConfig, statistics: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``Model.buffer_updates``: {bias name: [E] f32 step} from each MoE layer's load over the step
    (statistics: {router_bias_name(layer): [E] int64}, summed over every rank)."""
    rate = cfg.moe_router_bias_update_rate
    return {name: moe_blocks.router_bias_step(load, rate) for name, load in statistics.items()}


# ----------------------------------------------------------------------------------------------
# stage functions: pure, over a params dict with the layer prefix stripped


def embed(p: Params, inputs: tuple[Tensor, ...], ctx: StageContext) -> tuple[Tensor, ...]:
    """(tokens [b,s] int64) -> (h [b,s,H])."""
    (tokens,) = inputs
    return (torch.nn.functional.embedding(tokens, p["model.embed_tokens.weight"]),)


def attn(cfg: Qwen3MoeConfig, moe: bool, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """Pre-norm attention with residual, then the post-attention norm and (MoE layers) the router.

    (h [b,s,H], positions [b,s]|[s]) -> MoE: (h1 [b,s,H], x [T,H], ids [T,k] i64, w [T,k], aux [],
                                             load [E] i64 with the router bias)
                                       dense: (h1, x [T,H])
    """
    h, positions = inputs
    a = layers.gqa_attention(
        layers.rms_norm(h, p["input_layernorm.weight"], cfg.rms_norm_eps),
        positions,
        p["self_attn.q_proj.weight"],
        p["self_attn.k_proj.weight"],
        p["self_attn.v_proj.weight"],
        p["self_attn.o_proj.weight"],
        p["self_attn.q_norm.weight"],
        p["self_attn.k_norm.weight"],
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_size,
        cfg.rope_theta,
        cfg.rms_norm_eps,
        cp_group=ctx.group("cp"),
        **_attention_biases(cfg, p),
        **_scaled_rotary(cfg),
    )
    h1 = h + a
    x = layers.rms_norm(h1, p["post_attention_layernorm.weight"], cfg.rms_norm_eps).reshape(
        -1, cfg.hidden_size
    )
    if not moe:
        return h1, x
    if cfg.moe_router_bias_update_rate > 0:
        probs, w, ids = moe_blocks.biased_top_k_router(
            x, p["mlp.gate.weight"], p[ROUTER_BIAS], cfg.num_experts_per_tok, cfg.norm_topk_prob
        )
    else:
        probs, w, ids = layers.top_k_router(
            x, p["mlp.gate.weight"], cfg.num_experts_per_tok, cfg.norm_topk_prob
        )
    outputs = (h1, x, ids, w)
    if cfg.router_aux_loss_coef:
        # under context parallelism the statistics span the whole sequence (all cp ranks)
        outputs += (layers.load_balancing_loss(probs, ids, cfg.num_experts, group=ctx.group("cp")),)
    if cfg.moe_router_bias_update_rate > 0:  # the statistic the bias update reads (build: statistics)
        outputs += (moe_blocks.expert_load(ids, cfg.num_experts),)
    return outputs


def _attention_biases(cfg: Qwen3MoeConfig, p: Params) -> dict[str, Tensor]:
    """layers.gqa_attention's bias keywords: the four projection biases under attention_bias."""
    if not cfg.attention_bias:
        return {}
    return {f"{n}_b": p[f"self_attn.{n}_proj.bias"] for n in "qkvo"}


def _scaled_rotary(cfg: Qwen3MoeConfig) -> dict:
    """layers.gqa_attention's rotary keywords under rope_scaling (YaRN's frequencies and cos/sin
    factor, as transformers computes them); none for plain RoPE."""
    if cfg.rope_scaling is None:
        return {}
    from fmoe.stages import deepseek_v2  # it imports this module

    inv_freq, factor = deepseek_v2.rotary_inv_freq(cfg.head_size, cfg.rope_theta, cfg.rope_scaling)
    return {"rotary_inv_freq": inv_freq, "rotary_scale": factor}


def dispatch(cfg: Qwen3MoeConfig, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """Group the T*k routing slots by expert; under expert parallelism, send them to their ranks.

    No ep group, dropless: (h1, x [T,H], ids [T,k], w [T,k]) -> (h1, x_perm [n,H], w, order [n] i64,
    offs [E] i32), a local permutation. Otherwise -> (h1, x_buf [n_kept,H], w, order [n], offs [El],
    back [m] i64, splits [4,ep] i64 CPU) (fmoe.stages.moe.ep_dispatch; one host sync).
    """
    h1, x, ids, w = inputs
    group = ctx.group("ep")
    if moe_blocks.group_size(group) == 1 and cfg.moe_capacity_factor is None:
        order, counts = moe_blocks.expert_sort(ids.reshape(-1), cfg.num_experts)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return h1, layers.permute_rows(x, order, cfg.num_experts_per_tok), w, order, offs
    x_buf, order, offs, back, splits = moe_blocks.ep_dispatch(
        x, ids, cfg.num_experts, group, cfg.moe_capacity_factor
    )
    return h1, x_buf, w, order, offs, back, splits


def mlp(cfg: Qwen3MoeConfig, moe: bool, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """MoE: (h1, x_perm [n,H], w, order, offs, *rest) -> (h1, y_perm [n,H], w, order, *rest), the
    experts of this ep rank (rest: dispatch's back and splits under expert parallelism);
    dense: (h1, x) -> (h1, y)."""
    if not moe:
        h1, x = inputs
        return h1, layers.dense_mlp(
            x, p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"], p["mlp.down_proj.weight"]
        )
    h1, x_perm, w, order, offs, *rest = inputs
    gate_up, down = p["mlp.experts.gate_up_proj"], p["mlp.experts.down_proj"]
    if gate_up.shape[0] != offs.shape[0] or down.shape[0] != offs.shape[0]:
        raise ValueError(
            f"mlp.experts.gate_up_proj / down_proj hold {gate_up.shape[0]} / {down.shape[0]} experts but "
            f"dispatch grouped rows for {offs.shape[0]}: under expert parallelism pass each rank its "
            "shard (fmoe.expert_parallel.shard_params)"
        )
    y = layers.expert_mlp(x_perm, gate_up, down, offs)
    return (h1, y, w, order, *rest)


def combine(cfg: Qwen3MoeConfig, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """Back to token order: (h1, y_perm [n,H], w, order) -> (h1, y [T,k,H], w); under expert
    parallelism (h1, y_buf, w, order, back, splits) -> the same, through the reverse exchange."""
    if len(inputs) == 4:
        h1, y_perm, w, order = inputs
        return h1, layers.unpermute_rows(y_perm, order, cfg.num_experts_per_tok), w
    h1, y_buf, w, order, back, splits = inputs
    y = moe_blocks.ep_combine(y_buf, order, back, splits, cfg.num_experts_per_tok, ctx.group("ep"))
    return h1, y, w


def aggregate(cfg: Qwen3MoeConfig, moe: bool, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """Weighted sum of the k expert outputs plus the residual: (h1, y [T,k,H], w [T,k]) -> (h [b,s,H])."""
    if not moe:
        h1, y = inputs
        return (h1 + y.view_as(h1),)
    h1, y, w = inputs
    return (layers.moe_output(h1, y, w),)


def head_logits(cfg: Qwen3MoeConfig, p: Params, h: Tensor) -> Tensor:
    """Final norm and LM head: h [b,s,H] -> logits [b,s,V]."""
    lm_head = p["model.embed_tokens.weight"] if cfg.tie_word_embeddings else p["lm_head.weight"]
    return linear(layers.rms_norm(h, p["model.norm.weight"], cfg.rms_norm_eps), lm_head, fp8=False)


def head(cfg: Qwen3MoeConfig, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """(h [b,s,H], labels [b,s] i64, -100 ignored) -> (mean token cross-entropy,)."""
    h, labels = inputs
    logits = head_logits(cfg, p, h)
    return (layers.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)),)


# ----------------------------------------------------------------------------------------------
# the model


def param_shapes(cfg: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's global name and shape, in a stable order."""
    H, d = cfg.hidden_size, cfg.head_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        shapes[pre + "input_layernorm.weight"] = (H,)
        shapes[pre + "self_attn.q_proj.weight"] = (cfg.num_attention_heads * d, H)
        shapes[pre + "self_attn.k_proj.weight"] = (cfg.num_key_value_heads * d, H)
        shapes[pre + "self_attn.v_proj.weight"] = (cfg.num_key_value_heads * d, H)
        shapes[pre + "self_attn.o_proj.weight"] = (H, cfg.num_attention_heads * d)
        if cfg.attention_bias:
            shapes[pre + "self_attn.q_proj.bias"] = (cfg.num_attention_heads * d,)
            shapes[pre + "self_attn.k_proj.bias"] = (cfg.num_key_value_heads * d,)
            shapes[pre + "self_attn.v_proj.bias"] = (cfg.num_key_value_heads * d,)
            shapes[pre + "self_attn.o_proj.bias"] = (H,)
        shapes[pre + "self_attn.q_norm.weight"] = (d,)
        shapes[pre + "self_attn.k_norm.weight"] = (d,)
        shapes[pre + "post_attention_layernorm.weight"] = (H,)
        if cfg.is_moe_layer(i):
            E, I = cfg.num_experts, cfg.moe_intermediate_size
            shapes[pre + "mlp.gate.weight"] = (E, H)
            if cfg.moe_router_bias_update_rate > 0:
                shapes[pre + ROUTER_BIAS] = (E,)
            shapes[pre + "mlp.experts.gate_up_proj"] = (E, 2 * I, H)
            shapes[pre + "mlp.experts.down_proj"] = (E, H, I)
        else:
            I = cfg.intermediate_size
            shapes[pre + "mlp.gate_proj.weight"] = (I, H)
            shapes[pre + "mlp.up_proj.weight"] = (I, H)
            shapes[pre + "mlp.down_proj.weight"] = (H, I)
    shapes["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    return shapes


def init_params(
    cfg: Qwen3MoeConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> dict[str, Tensor]:
    """Seeded init: norms 1, attention biases 0, everything else N(0, initializer_range).

    Each parameter draws from its own generator seeded by (seed, name), so a parameter's values do not
    depend on which others are created (a sharded or pipelined layout inits the same numbers).
    """
    params = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight"):
            value = torch.ones(shape)
        elif name.endswith("_proj.bias"):
            value = torch.zeros(shape)
        elif name.endswith(ROUTER_BIAS):  # balancing starts neutral; kept in float32 (a buffer)
            params[name] = torch.zeros(shape, dtype=torch.float32, device=device)
            continue
        else:
            value = layers.seeded_normal(name, shape, seed, cfg.initializer_range)
        params[name] = value.to(device=device, dtype=dtype)
    return params


def build(cfg: Qwen3MoeConfig) -> Model:
    """The model's stages in forward order."""
    shapes = param_shapes(cfg)
    stages = [Stage("embed", embed, ("model.embed_tokens.weight",), batch_inputs=("tokens",))]
    layer_of = [-1]
    aux_weight = cfg.router_aux_loss_coef / max(cfg.num_moe_layers, 1)
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        moe = cfg.is_moe_layer(i)
        owned = [n for n in shapes if n.startswith(pre)]
        attn_params = tuple(
            n
            for n in owned
            if "self_attn" in n or "layernorm" in n or n.endswith(("mlp.gate.weight", ROUTER_BIAS))
        )
        mlp_params = tuple(n for n in owned if n not in attn_params)
        losses = (aux_weight,) if moe and cfg.router_aux_loss_coef else ()
        biased = moe and cfg.moe_router_bias_update_rate > 0
        stats = (Statistic(router_bias_name(i), (cfg.num_experts,)),) if biased else ()
        part = functools.partial
        layer = [
            Stage(
                f"layers.{i}.attn", part(attn, cfg, moe), attn_params, pre, ("positions",), losses,
                statistics=stats,
            )
        ]  # fmt: skip
        if moe:
            layer += [
                Stage(f"layers.{i}.dispatch", part(dispatch, cfg), kind="comm"),
                Stage(f"layers.{i}.mlp", part(mlp, cfg, True), mlp_params, pre),
                Stage(f"layers.{i}.combine", part(combine, cfg), kind="comm"),
            ]
        else:
            layer.append(Stage(f"layers.{i}.mlp", part(mlp, cfg, False), mlp_params, pre))
        layer.append(Stage(f"layers.{i}.aggregate", part(aggregate, cfg, moe)))
        stages += layer
        layer_of += [i] * len(layer)
    head_params = (
        "model.norm.weight",
        "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight",
    )
    stages.append(
        Stage("head", functools.partial(head, cfg), head_params, batch_inputs=("labels",), losses=(1.0,))
    )
    layer_of.append(-1)
    biased = cfg.moe_router_bias_update_rate > 0
    return Model(
        cfg, tuple(stages), functools.partial(init_params, cfg), tuple(layer_of),
        buffer_updates=functools.partial(router_bias_updates, cfg) if biased else None,
        buffers=tuple(n for n in shapes if n.endswith(ROUTER_BIAS)),
    )  # fmt: skip


def train_flops_per_token(cfg: Qwen3MoeConfig, seq: int) -> float:
    """Model FLOPs per trained token at sequence length ``seq`` (what MFU divides by): forward +
    backward = 6 x the weights a token's GEMMs touch (q/k/v/o, the router and top-k experts of MoE
    layers, the dense MLPs, the LM head; the embedding lookup is free), plus the causal score and
    value GEMMs, 3 x their forward (seq/2 keys on average)."""
    H, d = cfg.hidden_size, cfg.head_size
    attn = H * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    active = cfg.vocab_size * H
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            mlp = cfg.num_experts_per_tok * 3 * H * cfg.moe_intermediate_size + H * cfg.num_experts
        else:
            mlp = 3 * H * cfg.intermediate_size
        active += attn + mlp
    scores = 3 * 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * d * seq / 2
    return 6.0 * active + scores


def logits(cfg: Qwen3MoeConfig, params: Params, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
    """Plain forward to logits [b,s,V] (inference, HF parity checks); runs the same stage functions."""
    model = build(cfg)
    ctx = StageContext()
    pos = torch.arange(tokens.shape[1], device=tokens.device) if positions is None else positions
    batch = {"tokens": tokens, "positions": pos}
    carry: tuple[Tensor, ...] = ()
    for stage in model.stages[:-1]:
        local = {stage.local_name(n): params[n] for n in stage.params}
        out = stage.forward(local, carry + tuple(batch[k] for k in stage.batch_inputs), ctx)
        carry = out[: stage.num_carried(len(out))]
    head_stage = model.stages[-1]
    return head_logits(cfg, {n: params[n] for n in head_stage.params}, carry[0])


# ----------------------------------------------------------------------------------------------
# Hugging Face checkpoint layout: experts stored one by one (the hub's layout; transformers also
# reads it into its stacked layout), everything else under the same names as here.
#
# Import trusts no field it does not know: every key of config.json is either honoured (it sets a
# config field, or is checked against one), pinned (only the listed values, the ones whose math
# fmoe implements, are accepted), or harmless metadata (names, versions, storage dtype, token ids,
# output flags: nothing the model computes). Anything else is refused with the key named. A key
# config.json omits takes transformers' default (HF_DEFAULTS), as transformers itself would.

HF_ARCHITECTURE = "Qwen3MoeForCausalLM"
SUPPORTS_CONTEXT_PARALLEL = True  # attn passes ctx.group("cp") to the attention and the aux loss
HF_MODEL_TYPE = "qwen3_moe"
FMOE_ONLY_FIELDS = ("moe_capacity_factor", "moe_router_bias_update_rate")
_ROPE_FIELDS = ("rope_theta", "rope_scaling")  # written and read as transformers' rope_parameters

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
HF_HONOURED_FIELDS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_experts",  # the hub's and transformers 4's name
        "num_local_experts",  # transformers 5's name for the same count
        "num_experts_per_tok",
        "moe_intermediate_size",
        "intermediate_size",
        "norm_topk_prob",
        "rms_norm_eps",
        "rope_parameters",  # transformers 5: rope_type "default" or "yarn"
        "rope_theta",  # transformers 4 / the hub
        "rope_scaling",  # transformers 4 / the hub: null or yarn
        "decoder_sparse_step",
        "mlp_only_layers",
        "tie_word_embeddings",
        "router_aux_loss_coef",
        "initializer_range",
        "max_position_embeddings",
        "attention_bias",
    }
)
# fields accepted only at these values: fmoe has no math for the others
HF_PINNED_FIELDS: dict[str, tuple] = {
    "hidden_act": ("silu",),
    "attention_dropout": (0.0,),
    "use_sliding_window": (False,),  # sliding-window attention is not implemented
}
# sliding_window / max_window_layers are read only when use_sliding_window is true (refused above)
HF_METADATA_FIELDS = HF_COMMON_METADATA_FIELDS | {"sliding_window", "max_window_layers"}
# transformers' Qwen3MoeConfig defaults, for keys config.json omits
HF_DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": None,
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "num_experts": 128,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
    "mlp_only_layers": (),
}
HF_DEFAULT_ROPE_THETA = 10000.0
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


def to_hf(cfg: Qwen3MoeConfig, params: Params) -> dict[str, Tensor]:
    """fmoe params -> Hugging Face hub tensors (per-expert gate/up/down projections)."""
    out: dict[str, Tensor] = {}
    inter = cfg.moe_intermediate_size
    for name, t in params.items():
        if name.endswith(ROUTER_BIAS):  # an fmoe training buffer; Qwen3-MoE on the hub has none
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{pre}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(cfg: Qwen3MoeConfig, tensors: Params) -> dict[str, Tensor]:
    """Hugging Face tensors (hub per-expert layout or transformers' stacked layout) -> fmoe params.

    Raises KeyError naming the first missing tensor, ValueError naming a tensor whose shape is not
    the one the config implies or one the config has no place for.
    """
    return stack_hub_experts(param_shapes(cfg), cfg.num_experts, tensors, cfg.tie_word_embeddings)


def stack_hub_experts(
    shapes: dict[str, tuple[int, ...]], num_experts: int, tensors: Params, tied: bool = False
) -> dict[str, Tensor]:
    """fmoe params named in ``shapes`` from HF tensors: stacked expert weights built from the hub's
    per-expert ``experts.{e}.gate_proj/up_proj/down_proj`` when not already stacked. Shared by the
    families that store experts as Qwen3-MoE does (DeepSeek-V2 too). Every tensor read is checked
    against the shape ``shapes`` implies; a tensor left unread is refused (``refuse_surplus``)."""
    params: dict[str, Tensor] = {}
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...]) -> Tensor:
        t = _need(tensors, name)
        check_shape(name, t, shape)
        used.add(name)
        return t

    for name, shape in shapes.items():
        if name in tensors:
            params[name] = take(name, shape)
        elif name.endswith(ROUTER_BIAS):  # not in Hugging Face checkpoints: start neutral
            params[name] = torch.zeros(shape, dtype=torch.float32)
        elif name.endswith("mlp.experts.gate_up_proj"):
            pre, (_, two_inter, hidden) = name[: -len("gate_up_proj")], shape
            half = (two_inter // 2, hidden)
            params[name] = torch.stack(
                [
                    torch.cat(
                        [take(f"{pre}{e}.gate_proj.weight", half), take(f"{pre}{e}.up_proj.weight", half)]
                    )
                    for e in range(num_experts)
                ]
            )
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[: -len("down_proj")]
            params[name] = torch.stack(
                [take(f"{pre}{e}.down_proj.weight", shape[1:]) for e in range(num_experts)]
            )
        else:
            take(name, shape)
    refuse_surplus(tensors, used, tied)
    return params


def check_shape(name: str, t: Tensor, shape: tuple[int, ...]) -> None:
    """ValueError naming tensor ``name`` when its shape is not ``shape`` (what config.json implies)."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"Hugging Face tensor {name!r} has shape {tuple(t.shape)}, config.json implies {tuple(shape)}"
        )


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


def _need(tensors: Params, name: str) -> Tensor:
    if name not in tensors:
        raise KeyError(f"Hugging Face checkpoint lacks tensor {name!r}")
    return tensors[name]


def hf_config(cfg: Qwen3MoeConfig) -> dict:
    """config.json for transformers' Qwen3MoeForCausalLM."""
    from fmoe.stages import deepseek_v2  # it imports this module

    skip = FMOE_ONLY_FIELDS + _ROPE_FIELDS
    out = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in skip}
    out["head_dim"] = cfg.head_size
    out["mlp_only_layers"] = list(cfg.mlp_only_layers)
    out["rope_theta"] = cfg.rope_theta  # transformers 4 reads it here
    out["rope_parameters"] = deepseek_v2.rope_parameters(cfg.rope_theta, cfg.rope_scaling)
    out.update(architectures=[HF_ARCHITECTURE], model_type=HF_MODEL_TYPE, hidden_act="silu")
    out.update(output_router_logits=False, use_cache=False)
    return out


def config_from_hf(hf: Mapping) -> Qwen3MoeConfig:
    """Our config from a config.json dict. Every key is honoured, pinned or metadata (see
    HF_HONOURED_FIELDS); ValueError names an unknown key or an unsupported value."""
    from fmoe.stages import deepseek_v2  # it imports this module

    check_hf_fields(hf, HF_MODEL_TYPE, HF_HONOURED_FIELDS, HF_PINNED_FIELDS, HF_METADATA_FIELDS)
    names = {f.name for f in fields(Qwen3MoeConfig) if f.name not in FMOE_ONLY_FIELDS + _ROPE_FIELDS}
    kwargs = dict(HF_DEFAULTS)
    kwargs.update({k: v for k, v in hf.items() if k in names and k != "num_experts"})
    # transformers 5 writes num_local_experts, the hub and transformers 4 num_experts
    kwargs.update(aliased_field(hf, "num_experts", ("num_local_experts", "num_experts")))
    kwargs["rope_theta"], kwargs["rope_scaling"] = deepseek_v2.rope_from_hf(hf, HF_DEFAULT_ROPE_THETA)
    if kwargs.get("mlp_only_layers") is None:  # transformers reads null as no dense layers
        kwargs["mlp_only_layers"] = ()
    return Qwen3MoeConfig(**checked_kwargs(Qwen3MoeConfig, kwargs))
