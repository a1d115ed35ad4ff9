"""DeepSeek-V2 / DeepSeek-V2-Lite as pure stage functions.

Multi-head latent attention (MLA): keys and values come from one compressed latent per token
(``kv_a_proj_with_mqa`` -> [kv_lora_rank | qk_rope_head_dim], the latent RMS-normed and expanded per
head by ``kv_b_proj``); the rotary part of the key is one head shared by all heads (decoupled RoPE,
interleaved-pair layout as in transformers). Queries are compressed too (``q_a_proj`` ->
``q_a_layernorm`` -> ``q_b_proj``) unless ``q_lora_rank`` is None (V2-Lite: one ``q_proj``). YaRN
rotary scaling comes from ``rope_scaling``. The first ``first_k_dense_replace`` layers are dense;
the rest have routed experts (softmax router, greedy or group-limited top-k, weights times
``routed_scaling_factor``) plus ``n_shared_experts`` shared experts every token goes through.

Stages, with what flows between them (b batch, s sequence, T = b*s, k top-k, n = T*k):
  embed      (tokens)            -> (h [b,s,H])
  per MoE layer (one expert-parallel rank, dropless; see fmoe.stages.qwen3_moe for the ep forms):
    attn       (h, positions)    -> (h1, x [T,H], ids [T,k], w [T,k])  + aux loss
    dispatch   (h1, x, ids, w)   -> (h1, x, x_perm [n,H], w, order [n], offs [E])
    mlp        (h1, x, x_perm, w, order, offs) -> (h1s, y_perm [n,H], w, order)
    combine    (h1s, y_perm, w, order)         -> (h1s, y [T,k,H], w)
    aggregate  (h1s, y, w)       -> (h [b,s,H])
  per dense layer (the first first_k_dense_replace): attn (h, positions) -> (h1, x),
    mlp (h1, x) -> (h1, y), aggregate (h1, y) -> (h)
  head       (h, labels)         -> (loss,)
Dispatch, combine and aggregate are Qwen3-MoE's (``fmoe.stages.qwen3_moe``); dispatch here also
carries the token rows ``x`` unchanged, because the shared experts run in the mlp stage beside the
routed ones: mlp returns ``h1s = h1 + shared_experts(x)`` in the residual's slot, so aggregate's
weighted sum of the routed outputs completes the layer. Under expert parallelism the shared experts
run on every rank for its own tokens (they are not ``mlp.experts.*``, so they are not sharded).

Parameter names and layouts are transformers' (``DeepseekV2ForCausalLM``, stacked experts
``mlp.experts.gate_up_proj`` [E, 2I, H] gate rows first, ``mlp.experts.down_proj`` [E, H, I]); the
hub stores experts one by one, which ``to_hf`` writes and ``from_hf`` reads.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from fmoe.stages import layers, qwen3_moe
from fmoe.stages.primitives import linear
from fmoe.stages.spec import Model, Params, Stage, StageContext
from torch import Tensor

# transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6
TOPK_METHODS = ("greedy", "group_limited_greedy")
YARN_KEYS = (
    "rope_type",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
)


@dataclass(frozen=True)
class DeepseekV2Config:
    """Fields named as in transformers' ``DeepseekV2Config``; defaults give a tiny CPU model.

    rope_scaling: None (plain RoPE) or a YaRN table as in the hub's config.json (``type``/``rope_type``
    "yarn", ``factor``, ``original_max_position_embeddings``, optional ``beta_fast``, ``beta_slow``,
    ``mscale``, ``mscale_all_dim``, ``attention_factor``, ``truncate``).
    aux_loss_alpha: the router's load-balancing loss weight (the hub config's name; the loss is fmoe's
    Switch-style batch loss, not DeepSeek's per-sequence one).
    """

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    n_shared_experts: int = 1
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    first_k_dense_replace: int = 1
    kv_lora_rank: int = 32
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    aux_loss_alpha: float = 0.001
    # fmoe training settings (not Hugging Face config fields; hf_config leaves them out)
    moe_capacity_factor: float | None = None  # None: dropless

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "n_routed_experts",
            "num_experts_per_tok",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "moe_intermediate_size",
            "intermediate_size",
            "max_position_embeddings",
            "rope_theta",
        )
        for f in positive:
            if getattr(self, f) <= 0:
                raise ValueError(f"{name}.{f} must be > 0, got {getattr(self, f)}")
        for f in ("n_shared_experts", "first_k_dense_replace", "aux_loss_alpha", "rms_norm_eps"):
            if getattr(self, f) < 0:
                raise ValueError(f"{name}.{f} must be >= 0, got {getattr(self, f)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"{name}.qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}"
            )
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"{name}.q_lora_rank must be > 0 or None, got {self.q_lora_rank}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"{name}.num_key_value_heads ({self.num_key_value_heads}) must equal num_attention_heads "
                f"({self.num_attention_heads}): MLA expands keys and values for every head"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{name}: num_attention_heads ({self.num_attention_heads}) must divide hidden_size "
                f"({self.hidden_size}), as transformers requires"
            )
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"{name}.num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                f"n_routed_experts ({self.n_routed_experts})"
            )
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"{name}.topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if self.topk_method == "group_limited_greedy":
            if self.n_group is None or self.topk_group is None:
                raise ValueError(f"{name}: topk_method 'group_limited_greedy' needs n_group and topk_group")
            if self.n_group <= 0 or self.n_routed_experts % self.n_group:
                raise ValueError(
                    f"{name}.n_group ({self.n_group}) must be > 0 and divide n_routed_experts "
                    f"({self.n_routed_experts})"
                )
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(
                    f"{name}.topk_group ({self.topk_group}) must be between 1 and n_group ({self.n_group})"
                )
            if self.topk_group * (self.n_routed_experts // self.n_group) < self.num_experts_per_tok:
                raise ValueError(
                    f"{name}: topk_group ({self.topk_group}) groups of {self.n_routed_experts // self.n_group} "
                    f"experts hold fewer than num_experts_per_tok ({self.num_experts_per_tok})"
                )
        if self.norm_topk_prob:
            raise ValueError(
                f"{name}.norm_topk_prob must be false: transformers' DeepseekV2 never renormalises the "
                "top-k weights (the released V2 / V2-Lite configs have it false)"
            )
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            raise ValueError(
                f"{name}.moe_capacity_factor must be > 0 or None, got {self.moe_capacity_factor}"
            )
        object.__setattr__(
            self, "rope_scaling", check_rope_scaling(self.rope_scaling, f"{name}.rope_scaling")
        )

    @property
    def num_experts(self) -> int:  # the name fmoe's shared MoE stages read
        return self.n_routed_experts

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (as transformers)."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.get("mscale_all_dim"):
            m = yarn_mscale(rs["factor"], rs["mscale_all_dim"])
            scale = scale * m * m
        return scale


# ----------------------------------------------------------------------------------------------
# rotary positions with YaRN scaling (shared with fmoe.stages.gpt_oss)


def check_rope_scaling(rs: Mapping | None, where: str) -> dict | None:
    """None or a validated YaRN dict (``type`` renamed ``rope_type``); errors name ``where``.key."""
    if rs is None:
        return None
    if not isinstance(rs, Mapping):
        raise ValueError(f"{where} must be a table or None, got {type(rs).__name__}")
    rs = dict(rs)
    if "type" in rs:
        rs.setdefault("rope_type", rs.pop("type"))
    unknown = sorted(set(rs) - set(YARN_KEYS))
    if unknown:  # checked for "default" too: a key such as partial_rotary_factor changes plain RoPE
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(YARN_KEYS)})")
    if rs.get("rope_type") == "default":
        return None
    if rs.get("rope_type") != "yarn":
        raise ValueError(f"{where}.rope_type must be 'yarn' (or 'default'), got {rs.get('rope_type')!r}")
    for key in ("factor", "original_max_position_embeddings"):
        if not isinstance(rs.get(key), int | float) or rs[key] <= 0:
            raise ValueError(f"{where}.{key} must be a number > 0, got {rs.get(key)!r}")
    return rs


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rotary_inv_freq(dim: int, theta: float, rope_scaling: Mapping | None) -> tuple[Tensor, float]:
    """(inv_freq [dim/2] float32, attention_factor): plain RoPE, or YaRN's blend of interpolated and
    extrapolated frequencies with its cos/sin magnitude factor (the formulas transformers uses)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope_scaling is None:
        return 1.0 / pos_freqs, 1.0
    rs = rope_scaling
    factor, original = rs["factor"], rs["original_max_position_embeddings"]
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim index that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def rotary_angles(
    positions: Tensor, dim: int, theta: float, rope_scaling: Mapping | None
) -> tuple[Tensor, float]:
    """(angles [..., dim/2] float32 for integer ``positions`` [...], attention_factor)."""
    inv_freq, factor = rotary_inv_freq(dim, theta, rope_scaling)
    return positions[..., None].to(torch.float32) * inv_freq.to(positions.device), factor


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def rotate_pairs(x: Tensor, angles: Tensor, factor: float) -> Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of x [b, heads, s, d] by angles [b|1, s, d/2],
    scaled by ``factor``; computed in at least float32 (transformers' complex form), cast back."""
    dtype = _compute_dtype(x)
    cos = (angles.cos() * factor).to(dtype)[:, None]
    sin = (angles.sin() * factor).to(dtype)[:, None]
    pairs = x.to(dtype).unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    out = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def _batch_angles(angles: Tensor) -> Tensor:
    return angles if angles.dim() == 3 else angles[None]


# ----------------------------------------------------------------------------------------------
# stage functions: pure, over a params dict with the layer prefix stripped


def mla_attention(cfg: DeepseekV2Config, p: Params, x: Tensor, positions: Tensor) -> Tensor:
    """Multi-head latent attention, causal. x: [b, s, H] (normed), positions [b, s] | [s] -> [b, s, H]."""
    b, s, _ = x.shape
    nh, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank is None:
        q = linear(x, p["self_attn.q_proj.weight"])
    else:
        q_latent = layers.rms_norm(
            linear(x, p["self_attn.q_a_proj.weight"]), p["self_attn.q_a_layernorm.weight"], LATENT_NORM_EPS
        )
        q = linear(q_latent, p["self_attn.q_b_proj.weight"])
    q_nope, q_pe = q.view(b, s, nh, dn + dr).transpose(1, 2).split([dn, dr], dim=-1)
    kv_latent, k_pe = linear(x, p["self_attn.kv_a_proj_with_mqa.weight"]).split(
        [cfg.kv_lora_rank, dr], dim=-1
    )
    kv_latent = layers.rms_norm(kv_latent, p["self_attn.kv_a_layernorm.weight"], LATENT_NORM_EPS)
    kv = linear(kv_latent, p["self_attn.kv_b_proj.weight"]).view(b, s, nh, dn + dv).transpose(1, 2)
    k_nope, v = kv.split([dn, dv], dim=-1)

    angles, factor = rotary_angles(positions, dr, cfg.rope_theta, cfg.rope_scaling)
    angles = _batch_angles(angles)
    q_pe = rotate_pairs(q_pe, angles, factor)
    k_pe = rotate_pairs(k_pe.view(b, 1, s, dr), angles, factor)  # one rotary key head, shared
    q = torch.cat((q_nope, q_pe), dim=-1)
    k = torch.cat((k_nope, k_pe.expand(b, nh, s, dr)), dim=-1)
    # SDPA: query/key and value head dims differ (MLA), which flash_attn does not take
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=cfg.softmax_scale)
    return linear(out.transpose(1, 2).reshape(b, s, nh * dv), p["self_attn.o_proj.weight"])


def router(cfg: DeepseekV2Config, x: Tensor, gate_w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x [T, H], gate_w [E, H] -> (probs [T, E] >= f32, weights [T, k] x.dtype, ids [T, k] i64).

    Softmax over all experts in (at least) float32; greedy top-k, or (group_limited_greedy) top-k among the
    experts of the ``topk_group`` groups with the highest best score; weights = the chosen
    probabilities times ``routed_scaling_factor`` (never renormalised).
    """
    probs = torch.softmax(linear(x, gate_w, fp8=False), dim=-1, dtype=_compute_dtype(x))
    scores = probs
    if cfg.topk_method == "group_limited_greedy":
        per = cfg.n_routed_experts // cfg.n_group
        best = probs.view(-1, cfg.n_group, per).amax(dim=-1)  # [T, groups]
        groups = torch.topk(best, cfg.topk_group, dim=-1).indices
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, groups, True)
        scores = probs.masked_fill(~keep.repeat_interleave(per, dim=1), 0.0)
    weights, ids = torch.topk(scores, cfg.num_experts_per_tok, dim=-1)
    return probs, (weights * cfg.routed_scaling_factor).to(x.dtype), ids


def embed(p: Params, inputs: tuple[Tensor, ...], ctx: StageContext) -> tuple[Tensor, ...]:
    """(tokens [b,s] int64) -> (h [b,s,H])."""
    (tokens,) = inputs
    return (F.embedding(tokens, p["model.embed_tokens.weight"]),)


def attn(cfg: DeepseekV2Config, moe: bool, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """Pre-norm MLA with residual, then the post-attention norm and (MoE layers) the router.

    (h [b,s,H], positions [b,s]|[s]) -> MoE: (h1 [b,s,H], x [T,H], ids [T,k] i64, w [T,k], aux [])
                                       dense: (h1, x [T,H])
    """
    h, positions = inputs
    if ctx.group("cp") is not None:
        raise NotImplementedError(
            "DeepSeek-V2 MLA attention has no context-parallel form yet: run it with parallel.cp = 1"
        )
    h1 = h + mla_attention(
        cfg, p, layers.rms_norm(h, p["input_layernorm.weight"], cfg.rms_norm_eps), positions
    )
    x = layers.rms_norm(h1, p["post_attention_layernorm.weight"], cfg.rms_norm_eps).reshape(
        -1, cfg.hidden_size
    )
    if not moe:
        return h1, x
    probs, w, ids = router(cfg, x, p["mlp.gate.weight"])
    outputs = (h1, x, ids, w)
    if cfg.aux_loss_alpha:
        outputs += (layers.load_balancing_loss(probs, ids, cfg.num_experts),)
    return outputs


def dispatch(cfg: DeepseekV2Config, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """Qwen3-MoE's dispatch, with the token rows x carried for the shared experts:
    (h1, x [T,H], ids, w) -> (h1, x, *qwen3_moe.dispatch outputs after h1)."""
    h1, x, _, _ = inputs
    _, *routed = qwen3_moe.dispatch(cfg, p, inputs, ctx)
    return (h1, x, *routed)


def mlp(cfg: DeepseekV2Config, moe: bool, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """MoE: (h1, x [T,H], x_perm [n,H], w, order, offs, *rest) -> (h1s, y_perm [n,H], w, order, *rest),
    h1s = h1 + shared_experts(x) and y_perm the routed experts (Qwen3-MoE's expert MLP);
    dense: (h1, x) -> (h1, y [T,H])."""
    if not moe:
        h1, x = inputs
        return h1, layers.dense_mlp(
            x, p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"], p["mlp.down_proj.weight"]
        )
    h1, x, *routed = inputs
    if cfg.n_shared_experts:
        shared = layers.dense_mlp(
            x,
            p["mlp.shared_experts.gate_proj.weight"],
            p["mlp.shared_experts.up_proj.weight"],
            p["mlp.shared_experts.down_proj.weight"],
        )
        h1 = h1 + shared.view_as(h1)
    return qwen3_moe.mlp(cfg, True, p, (h1, *routed), ctx)


def combine(cfg: DeepseekV2Config, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """Qwen3-MoE's combine: (h1s, y_perm, w, order, *rest) -> (h1s, y [T,k,H], w)."""
    return qwen3_moe.combine(cfg, p, inputs, ctx)


def aggregate(cfg: DeepseekV2Config, moe: bool, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """(h1s, y [T,k,H], w [T,k]) -> (h [b,s,H]); dense (h1, y) -> (h1 + y)."""
    return qwen3_moe.aggregate(cfg, moe, p, inputs, ctx)


def head_logits(cfg: DeepseekV2Config, p: Params, h: Tensor) -> Tensor:
    """Final norm and LM head: h [b,s,H] -> logits [b,s,V] (as Qwen3-MoE's)."""
    return qwen3_moe.head_logits(cfg, p, h)


def head(cfg: DeepseekV2Config, p: Params, inputs: tuple[Tensor, ...], ctx: StageContext):
    """(h [b,s,H], labels [b,s] i64, -100 ignored) -> (mean token cross-entropy,) (as Qwen3-MoE's)."""
    return qwen3_moe.head(cfg, p, inputs, ctx)


# ----------------------------------------------------------------------------------------------
# the model


def param_shapes(cfg: DeepseekV2Config) -> dict[str, tuple[int, ...]]:
    """Every parameter's global name and shape, in a stable order."""
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        shapes[pre + "input_layernorm.weight"] = (H,)
        if cfg.q_lora_rank is None:
            shapes[pre + "self_attn.q_proj.weight"] = (nh * cfg.qk_head_dim, H)
        else:
            shapes[pre + "self_attn.q_a_proj.weight"] = (cfg.q_lora_rank, H)
            shapes[pre + "self_attn.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            shapes[pre + "self_attn.q_b_proj.weight"] = (nh * cfg.qk_head_dim, cfg.q_lora_rank)
        shapes[pre + "self_attn.kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H)
        shapes[pre + "self_attn.kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
        shapes[pre + "self_attn.kv_b_proj.weight"] = (
            nh * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            cfg.kv_lora_rank,
        )
        shapes[pre + "self_attn.o_proj.weight"] = (H, nh * cfg.v_head_dim)
        shapes[pre + "post_attention_layernorm.weight"] = (H,)
        if cfg.is_moe_layer(i):
            E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
            shapes[pre + "mlp.gate.weight"] = (E, H)
            shapes[pre + "mlp.experts.gate_up_proj"] = (E, 2 * I, H)
            shapes[pre + "mlp.experts.down_proj"] = (E, H, I)
            if cfg.n_shared_experts:
                Is = I * cfg.n_shared_experts
                shapes[pre + "mlp.shared_experts.gate_proj.weight"] = (Is, H)
                shapes[pre + "mlp.shared_experts.up_proj.weight"] = (Is, H)
                shapes[pre + "mlp.shared_experts.down_proj.weight"] = (H, Is)
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
    cfg: DeepseekV2Config,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, Tensor]:
    """Seeded init: norms 1, everything else N(0, initializer_range), each parameter from its own
    generator seeded by (seed, name) so any layout inits the same numbers."""
    params = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight"):
            value = torch.ones(shape)
        else:
            value = layers.seeded_normal(name, shape, seed, cfg.initializer_range)
        params[name] = value.to(device=device, dtype=dtype)
    return params


def build(cfg: DeepseekV2Config) -> Model:
    """The model's stages in forward order."""
    shapes = param_shapes(cfg)
    stages = [Stage("embed", embed, ("model.embed_tokens.weight",), batch_inputs=("tokens",))]
    layer_of = [-1]
    aux_weight = cfg.aux_loss_alpha / max(cfg.num_moe_layers, 1)
    part = functools.partial
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        moe = cfg.is_moe_layer(i)
        owned = [n for n in shapes if n.startswith(pre)]
        attn_params = tuple(
            n for n in owned if "self_attn" in n or "layernorm" in n or n.endswith("mlp.gate.weight")
        )
        mlp_params = tuple(n for n in owned if n not in attn_params)
        losses = (aux_weight,) if moe and cfg.aux_loss_alpha else ()
        layer = [Stage(f"layers.{i}.attn", part(attn, cfg, moe), attn_params, pre, ("positions",), losses)]
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
    stages.append(Stage("head", part(head, cfg), head_params, batch_inputs=("labels",), losses=(1.0,)))
    layer_of.append(-1)
    return Model(cfg, tuple(stages), part(init_params, cfg), tuple(layer_of))


def train_flops_per_token(cfg: DeepseekV2Config, seq: int) -> float:
    """Model FLOPs per trained token at sequence length ``seq`` (what MFU divides by): forward +
    backward = 6 x the weights a token's GEMMs touch (MLA's low-rank projections, top-k routed and
    the shared experts, the router, the LM head; the embedding lookup is free), plus the causal
    score and value GEMMs (query-key width qk_nope + qk_rope, value width v_head_dim; seq/2 keys
    on average), 3 x their forward."""
    H, nh, r, dr = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    q = H * nh * cfg.qk_head_dim if cfg.q_lora_rank is None else cfg.q_lora_rank * (H + nh * cfg.qk_head_dim)
    attn = q + H * (r + dr) + r * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim) + nh * cfg.v_head_dim * H
    active = cfg.vocab_size * H
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            experts = cfg.num_experts_per_tok + cfg.n_shared_experts
            mlp = experts * 3 * H * cfg.moe_intermediate_size + H * cfg.n_routed_experts
        else:
            mlp = 3 * H * cfg.intermediate_size
        active += attn + mlp
    scores = 3 * 2 * cfg.num_hidden_layers * nh * (cfg.qk_head_dim + cfg.v_head_dim) * seq / 2
    return 6.0 * active + scores


def run_to_logits(
    model: Model, head_logits_fn, params: Params, tokens: Tensor, positions: Tensor | None
) -> Tensor:
    """Run every stage but the head's loss, then ``head_logits_fn(head params, h)`` -> [b,s,V]."""
    ctx = StageContext()
    pos = torch.arange(tokens.shape[1], device=tokens.device) if positions is None else positions
    batch = {"tokens": tokens, "positions": pos}
    carry: tuple[Tensor, ...] = ()
    for stage in model.stages[:-1]:
        local = {stage.local_name(n): params[n] for n in stage.params}
        out = stage.forward(local, carry + tuple(batch[k] for k in stage.batch_inputs), ctx)
        carry = out[: stage.num_carried(len(out))]
    return head_logits_fn({n: params[n] for n in model.stages[-1].params}, carry[0])


def logits(cfg: DeepseekV2Config, params: Params, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
    """Plain forward to logits [b,s,V] (inference, HF parity checks); runs the same stage functions."""
    return run_to_logits(build(cfg), functools.partial(head_logits, cfg), params, tokens, positions)


# ----------------------------------------------------------------------------------------------
# Hugging Face checkpoint layout: the hub's DeepSeek-V2 stores experts one by one (transformers'
# conversion mapping stacks them on load); everything else under the same names as here.

HF_ARCHITECTURE = "DeepseekV2ForCausalLM"
HF_MODEL_TYPE = "deepseek_v2"
FMOE_ONLY_FIELDS = ("moe_capacity_factor", "rope_theta", "rope_scaling")
# config.json keys, as in fmoe.stages.qwen3_moe: honoured (set or checked against a config field),
# pinned (only the listed values), metadata (nothing the model computes); anything else is refused
HF_HONOURED_FIELDS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "n_shared_experts",
        "n_routed_experts",
        "num_experts",  # transformers' alias of n_routed_experts
        "num_experts_per_tok",
        "routed_scaling_factor",
        "topk_method",
        "n_group",
        "topk_group",
        "norm_topk_prob",
        "first_k_dense_replace",
        "kv_lora_rank",
        "q_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "rms_norm_eps",
        "rope_parameters",  # transformers 5: default or yarn (check_rope_scaling)
        "rope_theta",  # the hub / transformers 4
        "rope_scaling",  # the hub / transformers 4: null or yarn
        "max_position_embeddings",
        "tie_word_embeddings",
        "initializer_range",
        "aux_loss_alpha",
    }
)
HF_PINNED_FIELDS: dict[str, tuple] = {
    "hidden_act": ("silu",),
    "attention_bias": (False,),  # q_a / kv_a / o projection biases: not implemented
    "mlp_bias": (False,),
    "attention_dropout": (0.0,),
    "moe_layer_freq": (1,),  # the hub's remote code: MoE every layer after first_k_dense_replace
    "scoring_func": ("softmax",),  # the hub's remote code: the router's softmax
    "quantization_config": (None,),
}
HF_METADATA_FIELDS = qwen3_moe.HF_COMMON_METADATA_FIELDS | {
    "head_dim",  # transformers recomputes it as qk_rope_head_dim
    "qk_head_dim",  # transformers recomputes it as qk_nope_head_dim + qk_rope_head_dim
    "pretraining_tp",  # the hub's remote code: tensor-parallel slicing of the same products
    "ep_size",  # the hub's remote code: its expert-parallel degree
    "seq_aux",  # the hub's remote code: the aux loss's form (fmoe's is its own, see aux_loss_alpha)
    "auto_map",  # the hub's remote-code pointer (fmoe, like transformers 5, reads the weights itself)
}
# transformers' DeepseekV2Config defaults, for keys config.json omits (rope_theta 10000, plain RoPE)
HF_DEFAULTS = {
    "vocab_size": 102400,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "first_k_dense_replace": 0,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "n_group": None,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "routed_scaling_factor": 1.0,
    "topk_group": None,
    "topk_method": "greedy",
    "norm_topk_prob": False,
    "v_head_dim": 128,
    "num_experts_per_tok": None,
    "moe_intermediate_size": 1407,
}
HF_DEFAULT_ROPE_THETA = 10000.0


def to_hf(cfg: DeepseekV2Config, params: Params) -> dict[str, Tensor]:
    """fmoe params -> Hugging Face hub tensors (per-expert gate/up/down projections)."""
    return qwen3_moe.to_hf(cfg, params)


def from_hf(cfg: DeepseekV2Config, tensors: Params) -> dict[str, Tensor]:
    """Hugging Face tensors (hub per-expert layout or transformers' stacked layout) -> fmoe params.

    Raises KeyError naming the first missing tensor, ValueError naming a tensor of the wrong shape
    or one the config has no place for.
    """
    return qwen3_moe.stack_hub_experts(
        param_shapes(cfg), cfg.n_routed_experts, tensors, cfg.tie_word_embeddings
    )


def rope_parameters(theta: float, rope_scaling: Mapping | None) -> dict:
    """transformers 5's ``rope_parameters`` from our rope_theta + rope_scaling."""
    if rope_scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    return {**rope_scaling, "rope_theta": theta}


def rope_from_hf(hf: Mapping, default_theta: float) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a config.json: transformers 5's ``rope_parameters`` or the
    hub's older ``rope_theta`` + ``rope_scaling``; ValueError when the two forms disagree."""
    rp = hf.get("rope_parameters")
    if isinstance(rp, Mapping):
        rp = dict(rp)
        theta = rp.pop("rope_theta", hf.get("rope_theta", default_theta))
        if "rope_theta" in hf and hf["rope_theta"] != theta:
            raise ValueError(
                f"config.json fields 'rope_theta' ({hf['rope_theta']}) and 'rope_parameters.rope_theta' "
                f"({theta}) disagree"
            )
        scaling = check_rope_scaling(rp, "config.json rope_parameters")
        legacy = check_rope_scaling(hf.get("rope_scaling"), "config.json rope_scaling")
        if legacy is not None and legacy != scaling:
            raise ValueError("config.json fields 'rope_scaling' and 'rope_parameters' disagree")
        return theta, scaling
    if rp is not None:
        raise ValueError(f"config.json field 'rope_parameters' must be a table, got {rp!r}")
    return hf.get("rope_theta", default_theta), check_rope_scaling(
        hf.get("rope_scaling"), "config.json rope_scaling"
    )


def hf_config(cfg: DeepseekV2Config) -> dict:
    """config.json for transformers' DeepseekV2ForCausalLM."""
    out = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.init and f.name not in FMOE_ONLY_FIELDS}
    out["rope_parameters"] = rope_parameters(cfg.rope_theta, cfg.rope_scaling)
    out.update(
        architectures=[HF_ARCHITECTURE],
        model_type=HF_MODEL_TYPE,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        head_dim=cfg.qk_rope_head_dim,
        output_router_logits=False,
        use_cache=False,
    )
    return out


def config_from_hf(hf: Mapping) -> DeepseekV2Config:
    """Our config from a config.json dict: every key honoured, pinned or metadata (HF_HONOURED_FIELDS
    ...), a key it omits at transformers' default; ValueError names an unknown key or bad value."""
    qwen3_moe.check_hf_fields(hf, HF_MODEL_TYPE, HF_HONOURED_FIELDS, HF_PINNED_FIELDS, HF_METADATA_FIELDS)
    names = {f.name for f in fields(DeepseekV2Config) if f.init and f.name not in FMOE_ONLY_FIELDS}
    kwargs = dict(HF_DEFAULTS)
    kwargs.update({k: v for k, v in hf.items() if k in names and k != "n_routed_experts"})
    kwargs.update(qwen3_moe.aliased_field(hf, "n_routed_experts", ("n_routed_experts", "num_experts")))
    kwargs["rope_theta"], kwargs["rope_scaling"] = rope_from_hf(hf, HF_DEFAULT_ROPE_THETA)
    return DeepseekV2Config(**qwen3_moe.checked_kwargs(DeepseekV2Config, kwargs))
