"""The MoE decoder's stage functions, and the named carry between a MoE layer's stages.

Stages, with what flows between them (b batch, s sequence, T = b*s, k top-k, n = T*k), each with
its ``Stage.role``:
  embed      (tokens)            -> (h [b,s,H])
  per MoE layer:
    attn       (h, positions)    -> (h1, x [T,H], ids [T,k], w [T,k])  + aux loss (+ load statistic)
    dispatch   spec.RoutedTokens -> ExpertRows (residual, [tokens], rows, weights, order, offs, [exchange])
    mlp        ExpertRows        -> ExpertRows (residual, rows = the experts' outputs, weights, order, [exchange])
    combine    ExpertRows        -> (h1, y [T,k,H], w)
    aggregate  (h1, y, w)        -> (h [b,s,H])
  per dense layer: attn (h, positions) -> (h1, x), mlp (h1, x) -> (h1, y), aggregate (h1, y) -> (h)
  head       (h, labels)         -> (loss,)
``h1`` is the residual after attention; ``x`` the post-attention-normed tokens the experts read.

Dispatch decides once how the rows travel: with no "ep" group in the context and dropless routing
(no capacity factor) a local permutation (the slots' order grouped by expert and offs [E]; rows
are the tokens [T,H], which mlp gathers by order, and mlp's outputs [n,H] come back in token-slot
order, so the FP8 experts copy neither way); otherwise the expert-parallel exchange (``fmoe.stages.moe.ep_dispatch``: rows [n_kept,H] of this
rank's El = E / ep experts, offs [El], and an ``Exchange`` the combine reverses). Combine reads
which one from the carry (``ExpertRows.exchange``), never re-deciding it. With shared experts,
dispatch also carries the token rows x (``ExpertRows.tokens``) and mlp returns h1 + shared(x) as
the residual. The runtime moves tensors between stages, so the carry travels as a flat tuple:
``ExpertRows.pack`` / ``unpack`` are the one place that lays it out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from fmoe.stages import layers
from fmoe.stages import moe as moe_blocks
from fmoe.stages.primitives import linear
from fmoe.stages.spec import Params, RoutedTokens, StageContext

if TYPE_CHECKING:  # the builder hands itself to its stages; imported for the hints only
    from fmoe.stages.decoder import MoEDecoder

__all__ = [
    "EMBED",
    "DecoderDims",
    "Exchange",
    "ExpertRows",
    "attn_stage",
    "combine_stage",
    "dense_aggregate_stage",
    "dense_stage",
    "dispatch_stage",
    "embed_stage",
    "expert_stage",
    "head_logits",
    "head_stage",
    "moe_aggregate_stage",
]

EMBED = "model.embed_tokens.weight"


@dataclass(frozen=True)
class DecoderDims:
    """The sizes the builder reads from a family's config, under the builder's names.

    moe_layers: indices of the layers with routed experts (the rest are dense). norm_eps: the
    residual norms' eps. aux_loss_coef: the load-balancing loss weight, split evenly over the MoE
    layers (0: no loss term). capacity_factor: None for dropless routing. router_bias: the local
    name (under the layer prefix) of the router's balancing-bias buffer, None for no bias;
    router_bias_rate: its update rate (> 0: the load statistic and the update, see
    ``fmoe.stages.decoder``). init_std: the normal init's standard deviation. max_positions: the
    longest sequence (None: no limit), set by the config field ``max_positions_field``.
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


class Exchange(NamedTuple):
    """What the expert-parallel exchange hands combine to reverse it (``moe.ep_dispatch``): back
    [m] int64, the buffer row of each slot returned to its source; splits [4, ep] int64 on the
    CPU, the exchange's split sizes."""

    back: Tensor
    splits: Tensor


@dataclass(frozen=True)
class ExpertRows:
    """A MoE layer's carry from dispatch to combine, by name.

    residual: h1 [b,s,H] (after mlp, with shared experts: h1 + shared_experts(x)); rows: the
    experts' inputs before mlp - the tokens x [T,H] themselves for the local permutation (mlp
    gathers them by order: ``MoEDecoder.gathered_experts``, or ``layers.permute_rows`` for a family
    without it), this rank's buffer [n_kept,H] grouped
    by expert under the exchange - and their outputs after it: [n,H] in token-slot order (local;
    row t*k + j is token t's j-th expert's), [n_kept,H] grouped by expert (exchange);
    weights: w [T,k]; order: [n] int64, the
    slots grouped by expert; offs: [El] int32 cumulative row ends (dispatch -> mlp only); tokens:
    x [T,H] for the shared experts (dispatch -> mlp, with shared experts only); exchange: None for
    the local permutation, else what combine's reverse exchange needs.
    """

    residual: Tensor
    rows: Tensor
    weights: Tensor
    order: Tensor
    offs: Tensor | None = None
    tokens: Tensor | None = None
    exchange: Exchange | None = None

    def pack(self) -> tuple[Tensor, ...]:
        """The wire tuple: residual, [tokens], rows, weights, order, [offs], [back, splits]."""
        tokens = () if self.tokens is None else (self.tokens,)
        offs = () if self.offs is None else (self.offs,)
        exchange = () if self.exchange is None else tuple(self.exchange)
        return (self.residual, *tokens, self.rows, self.weights, self.order, *offs, *exchange)

    @classmethod
    def unpack(cls, inputs: Sequence[Tensor], *, tokens: bool, offs: bool) -> ExpertRows:
        """The carry ``pack`` laid out; tokens / offs: whether it holds them (the stage knows). The
        exchange is there when the tuple is two tensors longer (dispatch chose it)."""
        fixed = 4 + tokens + offs
        if len(inputs) not in (fixed, fixed + len(Exchange._fields)):
            raise ValueError(f"a MoE layer's carry of {len(inputs)} tensors; expected {fixed} or {fixed + 2}")
        it = iter(inputs)
        residual = next(it)
        x = next(it) if tokens else None
        rows, weights, order = next(it), next(it), next(it)
        grouped_offs = next(it) if offs else None
        rest = tuple(it)
        return cls(residual, rows, weights, order, grouped_offs, x, Exchange(*rest) if rest else None)


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
    outputs = tuple(RoutedTokens(h1, x, ids, w))
    if d.aux_loss_coef:
        # under context parallelism the statistics span the whole sequence (all cp ranks)
        outputs += (layers.load_balancing_loss(probs, ids, d.num_experts, group=ctx.group("cp")),)
    if d.router_bias is not None and d.router_bias_rate > 0:  # the statistic the bias update reads
        outputs += (moe_blocks.expert_load(ids, d.num_experts),)
    return outputs


def dispatch_stage(
    d: DecoderDims, shared: bool, p: Params, inputs: tuple, ctx: StageContext
) -> tuple[Tensor, ...]:
    """Group the T*k routing slots by expert; under expert parallelism (or a capacity), send them
    to their ranks: ``spec.RoutedTokens`` -> ``ExpertRows`` (packed; see the module docstring).
    The local permutation hands mlp the tokens and the order, not the rows: mlp gathers them, where
    the FP8 experts can read them from the tokens without a copy (``expert_stage``)."""
    routed = RoutedTokens(*inputs)
    x, group = routed.tokens, ctx.group("ep")
    tokens = x if shared else None
    if moe_blocks.group_size(group) == 1 and d.capacity_factor is None:
        order, counts = moe_blocks.expert_sort(routed.expert_ids.reshape(-1), d.num_experts)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return ExpertRows(routed.residual, x, routed.weights, order, offs, tokens).pack()
    sent = moe_blocks.ep_dispatch(x, routed.expert_ids, d.num_experts, group, d.capacity_factor)
    exchange = Exchange(sent.back, sent.splits)
    return ExpertRows(
        routed.residual, sent.rows, routed.weights, sent.order, sent.offs, tokens, exchange
    ).pack()


def expert_stage(
    dec: MoEDecoder, cfg: Any, d: DecoderDims, shared: bool, p: Params, inputs: tuple, ctx: StageContext
) -> tuple[Tensor, ...]:
    """This ep rank's experts over dispatch's ``ExpertRows``: the tokens [T,H] (local permutation,
    gathered here by order) -> the experts' outputs [T*k,H] in token-slot order, or the received
    rows [n_kept,H] -> their outputs grouped by expert; with shared experts the residual becomes
    h1 + shared_experts(x)."""
    carry = ExpertRows.unpack(inputs, tokens=shared, offs=True)
    residual = carry.residual
    if shared:
        residual = residual + dec.shared_experts(cfg, p, carry.tokens).view_as(residual)
    for name in dec.expert_shapes(cfg):
        if p[name].shape[0] != carry.offs.shape[0]:
            raise ValueError(
                f"{name} holds {p[name].shape[0]} experts but dispatch grouped rows for {carry.offs.shape[0]}: "
                "under expert parallelism pass each rank its shard (fmoe.expert_parallel.shard_params)"
            )
    if carry.exchange is not None:  # this rank's buffer: grouped by expert already
        y = dec.experts(cfg, p, carry.rows, carry.offs)
    elif dec.gathered_experts is not None:  # the tokens in, the outputs in slot order
        y = dec.gathered_experts(cfg, p, carry.rows, carry.order, d.top_k, carry.offs)
    else:
        y = layers.in_slot_order(
            lambda rows: dec.experts(cfg, p, rows, carry.offs), carry.rows, carry.order, d.top_k
        )
    return ExpertRows(residual, y, carry.weights, carry.order, exchange=carry.exchange).pack()


def combine_stage(d: DecoderDims, p: Params, inputs: tuple, ctx: StageContext) -> tuple[Tensor, ...]:
    """Back to token order: ``ExpertRows`` -> (h1, y [T,k,H], w), by the way dispatch sent the
    rows (the local permutation: mlp put them back in slot order already; or the reverse exchange;
    dropped slots give y = 0)."""
    carry = ExpertRows.unpack(inputs, tokens=False, offs=False)
    if carry.exchange is None:
        y = carry.rows.view(-1, d.top_k, carry.rows.shape[-1])
    else:
        back, splits = carry.exchange
        y = moe_blocks.ep_combine(carry.rows, carry.order, back, splits, d.top_k, ctx.group("ep"))
    return carry.residual, y, carry.weights


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
