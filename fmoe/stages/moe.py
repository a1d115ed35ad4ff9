"""Expert-parallel (ep) dispatch and combine, deterministic, as plain functions over tensors.

Layout. E experts are split over the ep ranks of a group: rank r owns experts
[r * El, (r + 1) * El), El = E / ep. A source rank has T tokens, each routed to k experts
(``ids [T, k]``); the n = T * k routing slots are numbered ``i = t * k + j``.

dispatch (source rank s -> expert rank r):
  1. ``order = stable argsort(ids.flatten())``: the slots grouped by global expert (so also by
     destination rank), within an expert by token. ``combine`` returns rows in this order.
  2. every rank counts, per destination r, its slots for each of r's El experts and its distinct
     tokens routed to r; one all-gather of that [ep, El + 1] int tensor gives every rank the whole
     [ep (src), ep (dst), El + 1] table, and one ``.tolist()`` of it is the single host sync of
     the step's exchange: all split sizes and buffer sizes come from it.
  3. a token routed to several experts of one rank is sent to that rank once (dedupe per
     (token, destination)): the send buffer is, for r = 0..ep-1, the tokens routed to r in token
     order. With each row goes its k local expert ids (El = "not for this rank") in an int
     all-to-all of the same split sizes.
  4. on arrival rows are copied into the expert buffer: UniEP's deterministic slots. Local expert
     e's rows are those of source 0, then source 1, ..., each source's in its token order. A
     capacity C (optional) keeps the first C rows of each expert's buffer in that order and drops
     the rest: which slots survive depends only on the routing, never on timing.

combine is the exact reverse: expert rank r sends back one row per received slot (source s's
slots to r in its ``order``: expert, then token; a dropped slot sends a zero row), so source s
receives [n, H] in ``order`` and un-permutes it to [T, k, H]. The weighted sum over k stays in
``aggregate``, so a token's k expert outputs add up in the same order at any ep.

Gradients: the exchanges are ``all_to_all`` (autograd: its backward is the all-to-all with the
split sizes swapped, i.e. dispatch's backward runs combine's exchange and vice versa); the row
copies are ``copy_rows``, whose backward sums each source row's copies in a fixed order (no
atomics), so the backward is bitwise reproducible on GPUs too.

Host syncs: one per dispatch (step 2). The split sizes travel to ``combine`` (and to every
backward) as a CPU int64 tensor, read without touching the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from fmoe.stages.layers import unpermute_rows
from fmoe.stages.primitives import linear
from fmoe.stages.torch_dist import all_gather_single

__all__ = [
    "DispatchPlan",
    "Dispatched",
    "all_to_all",
    "biased_top_k_router",
    "capacity",
    "copy_rows",
    "ep_dispatch",
    "ep_combine",
    "expert_load",
    "expert_sort",
    "group_rank",
    "group_size",
    "plan_dispatch",
    "receive_plan",
    "router_bias_step",
    "update_router_bias",
]


# ----------------------------------------------------------------------------------------------
# groups and the stable sort


def group_size(group) -> int:
    """Ranks in the ep group; 1 for ``None`` (no expert parallelism)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def expert_sort(flat_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """Stable sort of slots by expert: (order [n] int64, counts [num_experts] int64).

    Uses ``fmoe.kernels.permute.expert_sort`` (a Triton counting sort on CUDA) when it exists,
    else ``torch.argsort(stable=True)``; both give the same permutation.
    """
    try:
        from fmoe.kernels.permute import expert_sort as kernel_sort
    except ImportError:  # the kernel module is optional; the torch path is the definition
        order = torch.argsort(flat_ids, stable=True)
        return order, torch.bincount(flat_ids, minlength=num_experts)
    return kernel_sort(flat_ids, num_experts)


def expert_load(ids: Tensor, num_experts: int) -> Tensor:
    """Routing slots per expert, ids [T, k] -> [E] int64 (what the router bias update uses).

    A scatter-add of ones rather than ``bincount``, which reads the largest id back to the host on
    CUDA; integer sums are exact, so the counts are the same in any order."""
    flat = ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


def capacity(capacity_factor: float | None, total_slots: int, num_experts: int) -> int | None:
    """Rows an expert keeps: ceil(capacity_factor * total_slots / E), total_slots = T * k summed over
    the ep group; None (dropless) when capacity_factor is None."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * total_slots / num_experts)


# ----------------------------------------------------------------------------------------------
# differentiable building blocks


def _all_to_all_raw(x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    if group is None:  # ep = 1: the exchange is the identity
        out.copy_(x)
        return out
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
        return _all_to_all_raw(x, send, recv, group)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, ctx.send, ctx.recv, ctx.group = inputs

    @staticmethod
    def backward(ctx, g: Tensor):
        # the reverse exchange: what rank a sent to rank b comes back from b to a
        return _all_to_all_raw(g, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    """Rows ``x [sum(send), ...]`` to the ranks of ``group``: send[r] rows to rank r, recv[r] from r
    -> [sum(recv), ...]. Differentiable: the backward is the same exchange with send/recv swapped."""
    return _AllToAll.apply(x, send, recv, group)


class _CopyRows(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, index: Tensor, table: Tensor) -> Tensor:
        return x.index_select(0, index)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, index, table = inputs
        ctx.save_for_backward(table)
        ctx.rows = index.numel()

    @staticmethod
    def backward(ctx, g: Tensor):
        (table,) = ctx.saved_tensors
        g_pad = torch.cat([g, g.new_zeros((1, *g.shape[1:]))])  # row ctx.rows: "no copy"
        grad = g_pad.index_select(0, table[:, 0])
        for c in range(1, table.shape[1]):  # a fixed summation order: bitwise reproducible
            grad = grad + g_pad.index_select(0, table[:, c])
        return grad, None, None


def copy_rows(x: Tensor, index: Tensor, table: Tensor) -> Tensor:
    """``x[index]`` with a deterministic backward.

    x: [m, ...], index: [n] int64 rows of x (repeats allowed), table: [m, c] int64, for each row of
    x the positions in the output holding its copies, padded with n -> [n, ...]. The backward sums
    each row's copies in table order (no scatter-add, so no atomics on GPUs).
    """
    return _CopyRows.apply(x, index, table)


# ----------------------------------------------------------------------------------------------
# the plan: every index and split size of one dispatch, from the routing alone


@dataclass(frozen=True)
class DispatchPlan:
    """The source side of one dispatch and the exchange's sizes (Python ints: read once, from the
    gathered count table).

    order [n] int64: the source's slots grouped by expert (combine returns rows in this order);
    counts [ep src, ep dst, El + 1] int64 (device): slots per (source, destination, local expert),
    then distinct tokens per (source, destination);
    send_index [S] int64 / send_table [T, ep] int64: rows of x sent, and each token's positions in
    the send buffer (S = none), for ``copy_rows``; send_lid [S, k] int64: local expert ids of each
    sent row's slots (El = not for that rank);
    send / recv: rows to / from each rank; ret_send / ret_recv: slots returned to / by each rank;
    capacity: rows an expert keeps (None: dropless); num_kept: rows of this rank's expert buffer.
    """

    order: Tensor
    counts: Tensor
    send_index: Tensor
    send_table: Tensor
    send_lid: Tensor
    send: list[int]
    recv: list[int]
    ret_send: list[int]
    ret_recv: list[int]
    capacity: int | None
    num_kept: int

    def splits(self) -> Tensor:
        """[4, ep] int64 on the CPU: send, recv, ret_send, ret_recv (what flows to combine)."""
        return torch.tensor([self.send, self.recv, self.ret_send, self.ret_recv], dtype=torch.int64)


def _excl_cumsum(x: Tensor, dim: int) -> Tensor:
    return torch.cumsum(x, dim) - x


def _all_gather(t: Tensor, group) -> Tensor:
    if group is None:
        return t[None]
    out = t.new_empty((group_size(group) * t.numel(),))
    all_gather_single(out, t.contiguous().view(-1), group=group)
    return out.view(group_size(group), *t.shape)


def plan_dispatch(ids: Tensor, num_experts: int, group, capacity_factor: float | None = None) -> DispatchPlan:
    """Everything a dispatch needs that depends only on the routing. ids: [T, k] int64 global ids.

    Runs the one all-gather of counts and the one host sync of the exchange.
    """
    ep, me = group_size(group), group_rank(group)
    if num_experts % ep:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the ep group size ({ep})")
    el = num_experts // ep
    T, k = ids.shape
    device = ids.device
    order, slot_counts = expert_sort(ids.reshape(-1), num_experts)
    dest = torch.div(ids, el, rounding_mode="floor")  # [T, k] destination rank of each slot
    hit = torch.zeros(T, ep, dtype=torch.bool, device=device)
    hit.scatter_(1, dest, True)  # [T, ep]: token t goes to rank r (once, however many of r's experts)
    local = torch.cat([slot_counts.view(ep, el), hit.sum(0)[:, None]], 1).to(torch.int64)
    counts = _all_gather(local, group)  # [ep src, ep dst, El + 1]
    host = counts.tolist()  # THE host sync: split sizes must be Python ints

    send = [host[me][r][el] for r in range(ep)]
    recv = [host[s][me][el] for s in range(ep)]
    per_expert = [sum(host[s][me][e] for s in range(ep)) for e in range(el)]
    cap = capacity(capacity_factor, sum(sum(row[:el]) for src in host for row in src), num_experts)

    # the send buffer: for r = 0..ep-1, the tokens routed to r in token order
    n_send = sum(send)
    pos = _excl_cumsum(local[:, el], 0)[None, :] + torch.cumsum(hit, 0) - 1  # [T, ep]
    send_table = torch.where(hit, pos, n_send)
    pair = torch.empty(n_send + 1, dtype=torch.int64, device=device)  # the last entry takes the misses
    pair.scatter_(0, send_table.reshape(-1), torch.arange(T * ep, device=device))
    pair = pair[:n_send]  # flat [T, ep] index of each sent row
    ranks = torch.arange(ep, device=device)[None, :, None]
    lid = torch.where(dest[:, None, :] == ranks, ids[:, None, :] - ranks * el, el)  # [T, ep, k]
    return DispatchPlan(
        order=order,
        counts=counts,
        send_index=torch.div(pair, ep, rounding_mode="floor"),
        send_table=send_table,
        send_lid=lid.reshape(T * ep, k).index_select(0, pair),
        send=send,
        recv=recv,
        ret_send=[sum(host[s][me][:el]) for s in range(ep)],  # slots received from s, returned to s
        ret_recv=[sum(host[me][r][:el]) for r in range(ep)],  # this rank's slots at r, coming back
        capacity=cap,
        num_kept=sum(per_expert) if cap is None else sum(min(c, cap) for c in per_expert),
    )


def receive_plan(plan: DispatchPlan, recv_lid: Tensor, me: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The expert rank's side: where each received row's slots go.

    recv_lid: [R, k] int64 local expert ids of the received rows (El = none) ->
    (buf_index [n_kept] received row of each buffer row, buf_table [R, k] buffer rows of each
    received row (n_kept = none), offs [El] int32, back_index [m] buffer row of each slot combine
    returns, source by source in the source's order (n_kept = dropped: a zero row)).
    """
    device = recv_lid.device
    R, k = recv_lid.shape
    el = plan.counts.shape[2] - 1
    cnt = plan.counts[:, me, :el]  # [ep src, El]: slots from source s for local expert e
    per_expert = cnt.sum(0)
    m, n_kept = sum(plan.ret_send), plan.num_kept
    order_r, _ = expert_sort(recv_lid.reshape(-1), el + 1)  # UniEP order: expert, source, token
    o = order_r[:m]  # the El sentinels sort last
    e_i = recv_lid.reshape(-1).index_select(0, o)
    i = torch.arange(m, device=device)
    rank_i = i - _excl_cumsum(per_expert, 0).index_select(0, e_i)  # place in expert e's buffer
    if plan.capacity is None:
        kept, pos_i = per_expert, i
    else:  # keep the first `capacity` rows of each expert, in the deterministic order
        kept = per_expert.clamp(max=plan.capacity)
        pos_i = torch.where(
            rank_i < plan.capacity, _excl_cumsum(kept, 0).index_select(0, e_i) + rank_i, n_kept
        )
    row_i = torch.div(o, k, rounding_mode="floor")
    table = torch.full((R * k,), n_kept, dtype=torch.int64, device=device)
    table.scatter_(0, o, pos_i)
    buf_index = torch.empty(n_kept + 1, dtype=torch.int64, device=device)  # the last takes drops
    buf_index.scatter_(0, pos_i, row_i)
    # combine's return order: source by source, within a source by (expert, token)
    row_src = torch.repeat_interleave(
        torch.arange(cnt.shape[0], device=device), plan.counts[:, me, el], output_size=R
    )
    s_i = row_src.index_select(0, row_i)
    q_i = rank_i - _excl_cumsum(cnt, 0)[s_i, e_i]  # place among source s's slots of expert e
    j_i = _excl_cumsum(cnt.sum(1), 0).index_select(0, s_i) + _excl_cumsum(cnt, 1)[s_i, e_i] + q_i
    back_index = torch.empty(m, dtype=torch.int64, device=device)
    back_index.scatter_(0, j_i, pos_i)
    return buf_index[:n_kept], table.view(R, k), torch.cumsum(kept, 0).to(torch.int32), back_index


class Dispatched(NamedTuple):
    """What ``ep_dispatch`` returns: rows [n_kept, H] grouped by local expert (this rank's buffer),
    order [n] int64 (the source's slot order), offs [El] int32 cumulative row ends, back [m] int64
    (the buffer row of each slot returned to its source), splits [4, ep] int64 on the CPU (the
    exchange's split sizes). ``ep_combine`` takes order, back and splits."""

    rows: Tensor
    order: Tensor
    offs: Tensor
    back: Tensor
    splits: Tensor


def ep_dispatch(
    x: Tensor, ids: Tensor, num_experts: int, group, capacity_factor: float | None = None
) -> Dispatched:
    """Tokens to the ranks owning their experts, in UniEP's deterministic slots.

    x: [T, H], ids: [T, k] int64 global expert ids -> ``Dispatched``.
    """
    plan = plan_dispatch(ids, num_experts, group, capacity_factor)
    x_recv = all_to_all(copy_rows(x, plan.send_index, plan.send_table), plan.send, plan.recv, group)
    recv_lid = _all_to_all_raw(plan.send_lid, plan.send, plan.recv, group)
    buf_index, buf_table, offs, back_index = receive_plan(plan, recv_lid, group_rank(group))
    return Dispatched(copy_rows(x_recv, buf_index, buf_table), plan.order, offs, back_index, plan.splits())


def ep_combine(y_buf: Tensor, order: Tensor, back_index: Tensor, splits: Tensor, top_k: int, group) -> Tensor:
    """Expert outputs back to token order: y_buf [n_kept, H] -> y [T, k, H] (dropped slots are zero).

    order, back_index, splits: as ``ep_dispatch`` returned them.
    """
    if splits.device.type != "cpu":
        raise ValueError("ep_combine: splits must be the CPU tensor ep_dispatch returned")
    y_pad = torch.cat([y_buf, y_buf.new_zeros((1, y_buf.shape[1]))])  # row n_kept: a dropped slot
    y_ret = y_pad.index_select(0, back_index)  # each real row once: its backward has no collisions
    y_src = all_to_all(y_ret, splits[2].tolist(), splits[3].tolist(), group)  # [n, H] in ``order``
    return unpermute_rows(y_src, order, top_k)


# ----------------------------------------------------------------------------------------------
# load balancing without an aux loss (DeepSeek-V3)


def biased_top_k_router(
    x: Tensor, gate_w: Tensor, bias: Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax router whose top-k selection sees ``probs + bias`` while the weights do not.

    x: [T, H], gate_w: [E, H], bias: [E] f32 (a buffer: no gradient flows to it) ->
    (probs [T, E] f32, weights [T, k] x.dtype, ids [T, k] int64).
    """
    probs = torch.softmax(linear(x, gate_w, fp8=False), dim=-1, dtype=torch.float32)
    ids = torch.topk(probs + bias.detach().to(torch.float32), top_k, dim=-1).indices
    weights = probs.gather(1, ids)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights.to(x.dtype), ids


def router_bias_step(load: Tensor, rate: float) -> Tensor:
    """The aux-loss-free balancing step of one router: rate * sign(mean load - load_e).

    load: [E] int64 routing slots per expert over a whole step (every rank's tokens) -> [E] f32:
    +rate for the experts below the mean load, -rate above it, 0 at it.
    """
    load = load.to(torch.float32)
    return rate * torch.sign(load.mean() - load)


def update_router_bias(
    params: dict[str, Tensor],
    loads: dict[str, Tensor],
    rate: float,
) -> dict[str, Tensor]:
    """One aux-loss-free balancing step: bias_e += rate * sign(mean load - load_e).

    params: {name: tensor} holding the biases; loads: {bias name: [E] int64 slots per expert over the
    step (all ranks)}. Returns a new dict (params is not mutated); other entries are shared.
    """
    out = dict(params)
    for name, load in loads.items():
        if name not in params:
            raise KeyError(f"update_router_bias: no router bias {name!r} in params")
        bias = params[name]
        if load.shape != bias.shape:
            raise ValueError(
                f"update_router_bias: load for {name!r} has shape {tuple(load.shape)}, bias {tuple(bias.shape)}"
            )
        out[name] = bias + router_bias_step(load.to(bias.device), rate).to(bias.dtype)
    return out
