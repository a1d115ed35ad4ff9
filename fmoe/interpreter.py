"""The schedule interpreter: run a schedule table's rows on the pipeline process group.

    result = run_schedule(schedule, model, params, batch, group)   # on every pp rank
    result.loss       # the step's loss, bitwise equal to run_sequential's, the same on all ranks
    result.grads      # {global name: gradient} for the parameters this rank holds

Each rank validates the table (an invalid one raises the validator's ScheduleError on every rank
before any compute or communication), lowers it if it has no SEND/RECV rows (both once per table
value, ``_checked_and_lowered``), then runs its own rows in order. Nothing here knows one schedule
from another: F, B, W, BW and FB run a chunk's model stages (``fmoe.pipeline``), SEND/RECV move the
chunk's carry tuple, and per-(microbatch, chunk) state lives in dicts that each row pops from, so
an activation is dropped as soon as its B (or its W) has run.

Data between stages is the runner's: each model stage runs through ``runner.forward_stage`` /
``backward_stage`` / ``weight_grads`` (the one F/B/W sequence), a chunk's input is the carry of the
previous pipeline stage (the same rank's other chunk, or a RECV_F), and the loss terms go into a
``runner.LossTerms``. B seeds the loss outputs with ``1 / microbatches``. At the end the loss terms
of all ranks are summed into one [microbatches, terms] matrix (each slot is written by exactly one
rank, so the sum is exact), and every rank forms the losses as the sequential runner does.

Rows are run by a handler per action kind (``HANDLERS``); SEND/RECV go through ``fmoe.p2p`` (on
gloo with CUDA tensors staged through pinned host buffers on a side copy stream, whose events order
it against the compute stream). A RECV waits for the header only; its tensors are waited for (and
staged to the device) when F or B first reads them (``p2p.arrived``), so in an FB row the other
micro-batch's stages queued first (FB_ORDER starts with B) overlap the transfer. FB interleaves its
two halves in the order ``fmoe.fb_order`` reads (on one stream; putting its comm stages, EP's
dispatch and combine, on a side CUDA stream is left for later). A failing rank's error carries its
whole table with the failing row marked.

Ownership (``fmoe.stage``'s rules): a chunk's carry and input gradients go to the rank's other chunk
as the same tensor objects, and to a SEND as buffers the send reads until it is waited on; nothing
here writes them. Only ``grads`` (this rank's accumulator, built by ``runner.accumulate`` from W's
results) is written in place.

Failures: see ``fmoe.dist`` (a failure key in the group's store that blocked ranks poll).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from fmoe import dist as D
from fmoe import pipeline, runner
from fmoe.fb_order import FB_ORDER, FBStep, parse_fb_order, role
from fmoe.memory_policy import MemoryPolicy
from fmoe.p2p import Channel, Incoming, arrived
from fmoe.schedules.table import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    copy_of,
    locate,
    num_stages,
    stage_of,
)
from fmoe.schedules.verify import lower, validate
from fmoe.shared_grads import sum_shared_grads
from fmoe.stages.spec import Model, StageContext

# ----------------------------------------------------------------------------------------------
# per-rank state and the two halves of a chunk's work


class _Rank:
    """Everything one rank keeps while it runs its rows."""

    def __init__(self, schedule, model, params, batch, group, rank, seed, groups, timeout_s, memory=None):
        self.s, self.model, self.params, self.group, self.rank = schedule, model, params, group, rank
        self.timeout_s, self.memory = timeout_s, memory
        self.microbatches = runner.split_microbatches(batch, schedule.microbatches)
        self.ctxs = [
            StageContext(microbatch=m, seed=seed, groups=groups) for m in range(schedule.microbatches)
        ]
        self.smap = pipeline.schedule_stage_map(model, schedule)
        self.S = num_stages(schedule)
        self.scale = 1.0 / schedule.microbatches
        self.terms = runner.LossTerms(model)
        # what F / B read: a tuple, or one still arriving from a peer (waited on at its first use)
        self.inbox_f: dict[tuple[int, int], tuple | Incoming] = {}
        self.inbox_b: dict[tuple[int, int], tuple | Incoming] = {}
        self.outbox_f: dict[tuple[int, int], tuple] = {}
        self.outbox_b: dict[tuple[int, int], tuple] = {}
        self.fwds: dict[tuple[int, int], list] = {}
        self.works: dict[tuple[int, int], list] = {}
        self.grads: dict[str, Tensor] = {}
        self.statistics: dict[str, Tensor] = {}  # this rank's stages' counts, summed over microbatches
        # sends and receives to the other pipeline ranks, of tensors on the batch's device
        self.link = Channel(group, rank, timeout_s, batch["tokens"].device)
        self.action: object = "setup"  # what runs now and its row (None: not a row), for a failure
        self.row: int | None = None

    def neighbour(self, chunk: int, step: int) -> tuple[int, int] | None:
        """(rank, chunk) of the pipeline stage ``step`` (+1 next, -1 previous) from ``chunk``'s."""
        st = stage_of(self.s.placement, self.s.pp, self.rank, chunk)
        if not 0 <= st + step < self.S:
            return None
        return locate(self.s.placement, self.s.pp, self.s.chunks, st + step, copy_of(self.s.placement, chunk))


class _Forward:
    """F of one (microbatch, chunk), one model stage per ``step``."""

    def __init__(self, st: _Rank, mb: int, chunk: int):
        self.st, self.mb, self.chunk = st, mb, chunk
        self.todo = list(st.smap[(st.rank, chunk)])
        prev = st.neighbour(chunk, -1)
        if prev is None:
            self.carry: tuple | Incoming = ()
        else:
            key = (mb, chunk)
            if key not in st.inbox_f:
                raise ScheduleError(
                    f"rank {st.rank}: F(mb={mb}, chunk={chunk}) has no input (no RECV_F or F before it)"
                )
            self.carry = st.inbox_f.pop(key)
        self.fwds: list = []

    def next_role(self) -> int | None:
        return role(self.st.model.stages[self.todo[0]]) if self.todo else None

    def step(self) -> None:
        st, i = self.st, self.todo.pop(0)
        mb = self.mb
        self.carry, fwd = runner.forward_stage(
            mb, i, st.model.stages[i], st.params, arrived(self.carry), st.microbatches[mb], st.ctxs[mb],
            st.terms, st.statistics, memory=st.memory,
        )  # fmt: skip
        self.fwds.append(fwd)

    def finish(self) -> None:
        while self.todo:
            self.step()
        st, key = self.st, (self.mb, self.chunk)
        st.fwds[key] = self.fwds
        nxt = st.neighbour(self.chunk, +1)
        if nxt is None:
            return
        if nxt[0] == st.rank:
            st.inbox_f[(self.mb, nxt[1])] = arrived(self.carry)
        else:
            st.outbox_f[key] = arrived(self.carry)


class _Backward:
    """B (and, unless deferred, W) of one (microbatch, chunk), one model stage per ``step``."""

    def __init__(self, st: _Rank, mb: int, chunk: int):
        self.st, self.mb, self.chunk = st, mb, chunk
        key = (mb, chunk)
        if key not in st.fwds:
            raise ScheduleError(f"rank {st.rank}: B(mb={mb}, chunk={chunk}) before its F")
        self.fwds = st.fwds.pop(key)
        self.todo = list(range(len(self.fwds) - 1, -1, -1))
        if st.neighbour(chunk, +1) is None:
            self.grad: tuple | Incoming = ()
        else:
            if key not in st.inbox_b:
                raise ScheduleError(
                    f"rank {st.rank}: B(mb={mb}, chunk={chunk}) has no output gradient (no RECV_B)"
                )
            self.grad = st.inbox_b.pop(key)
        self.works: list = []
        self.deferred: list = []  # (role, work) waiting for a W token (FB)

    def next_role(self) -> int | None:
        return role(self.fwds[self.todo[0]].stage) if self.todo else None

    def step(self, defer_w: bool = False) -> None:
        i = self.todo.pop(0)
        fwd, self.fwds[i] = self.fwds[i], None  # drop the activation as soon as its B has run
        self.grad, work = runner.backward_stage(fwd, arrived(self.grad), self.st.scale)
        if defer_w:
            self.deferred.append((role(fwd.stage), work))
        else:
            self.works.append(work)

    def run_w(self, roles: frozenset[int] | None = None) -> None:
        now = [work for r, work in self.deferred if roles is None or r in roles]
        self.deferred = [(r, work) for r, work in self.deferred if not (roles is None or r in roles)]
        runner.weight_grads(now, into=self.st.grads)

    def finish(self, w_now: bool) -> None:
        while self.todo:
            self.step()
        st, key = self.st, (self.mb, self.chunk)
        if w_now:
            runner.weight_grads(self.works, into=st.grads)
            self.run_w()
        else:
            st.works[key] = self.works
        prev = st.neighbour(self.chunk, -1)
        if prev is None:
            return
        if prev[0] == st.rank:
            st.inbox_b[(self.mb, prev[1])] = arrived(self.grad)
        else:
            st.outbox_b[key] = arrived(self.grad)


def _run_fb(st: _Rank, a: Action, order: Sequence[FBStep]) -> None:
    f = _Forward(st, a.microbatch, a.chunk)
    b = _Backward(st, a.b_microbatch, a.b_chunk)
    while f.todo or b.todo:
        progressed = False
        for tok in order:
            if tok.side == "W":
                b.run_w(tok.roles)
                continue
            side = f if tok.side == "F" else b
            used: set[int] = set()
            while side.todo:
                r = side.next_role()
                if r != 0 and (r not in tok.roles or r in used):
                    break
                used.add(r)
                if side is b:
                    b.step(defer_w=tok.input_only and r in tok.roles)
                else:
                    f.step()
                progressed = True
        if not progressed:  # stages the order never names: run them in order
            f.finish()
            b.finish(w_now=True)
    f.finish()
    b.finish(w_now=True)


# ----------------------------------------------------------------------------------------------
# the run


def _run_f(st: _Rank, a: Action, order: Sequence[FBStep]) -> None:
    _Forward(st, a.microbatch, a.chunk).finish()


def _run_b(st: _Rank, a: Action, order: Sequence[FBStep]) -> None:
    _Backward(st, a.microbatch, a.chunk).finish(w_now=False)


def _run_bw(st: _Rank, a: Action, order: Sequence[FBStep]) -> None:
    _Backward(st, a.microbatch, a.chunk).finish(w_now=True)


def _run_w(st: _Rank, a: Action, order: Sequence[FBStep]) -> None:
    key = (a.microbatch, a.chunk)
    if key not in st.works:
        raise ScheduleError(f"rank {st.rank}: {a} before its B")
    runner.weight_grads(st.works.pop(key), into=st.grads)


def _send_f(st: _Rank, a: Action, order: Sequence[FBStep]) -> None:
    st.link.send(st.outbox_f.pop((a.microbatch, a.chunk)), a.peer, str(a))


def _send_b(st: _Rank, a: Action, order: Sequence[FBStep]) -> None:
    st.link.send(st.outbox_b.pop((a.microbatch, a.chunk)), a.peer, str(a))


def _recv_f(st: _Rank, a: Action, order: Sequence[FBStep]) -> None:
    st.inbox_f[(a.microbatch, a.chunk)] = st.link.post_recv(a.peer, str(a))  # waited on at first use


def _recv_b(st: _Rank, a: Action, order: Sequence[FBStep]) -> None:
    st.inbox_b[(a.microbatch, a.chunk)] = st.link.post_recv(a.peer, str(a))


# one handler per action kind: the interpreter knows no schedule, only these
HANDLERS: dict[ActionKind, Callable[[_Rank, Action, Sequence[FBStep]], None]] = {
    ActionKind.F: _run_f,
    ActionKind.B: _run_b,
    ActionKind.BW: _run_bw,
    ActionKind.W: _run_w,
    ActionKind.FB: _run_fb,
    ActionKind.SEND_F: _send_f,
    ActionKind.SEND_B: _send_b,
    ActionKind.RECV_F: _recv_f,
    ActionKind.RECV_B: _recv_b,
}


def rank_table(actions: Sequence[Action], rank: int, marked: int | None = None) -> str:
    """A rank's rows, numbered, one per line; row ``marked`` (if any) flagged: what a failure prints."""
    lines = [f"rank {rank}'s rows:"]
    for k, a in enumerate(actions):
        lines.append(f"  {k:4d}  {a}" + ("   <-- failed here" if k == marked else ""))
    return "\n".join(lines)


def _finish_loss(st: _Rank) -> tuple[Tensor, list[Tensor]]:
    """Every rank's loss terms summed (each slot was written by one rank only, so the sum is exact),
    then each microbatch's loss and the step's, as the sequential runner forms them."""
    # made where the terms are (one copy to the wire's device, not one per term), summed there
    terms = st.terms.matrix(st.s.microbatches, st.link.compute).to(st.link.device())
    st.link.wait([dist.all_reduce(terms, group=st.group, async_op=True)], "the loss all-reduce")
    losses = st.terms.losses_from(terms.cpu())
    return runner.mean_loss(losses), losses


@functools.lru_cache(maxsize=16)
def _checked_and_lowered(schedule: Schedule) -> Schedule:
    """validate + lower, once per table: a trainer runs the same table every step. A ``Schedule`` is
    a frozen dataclass of tuples, so the cache is keyed by its value (pp, microbatches, placement,
    chunks, rows, name), not by the object; an invalid table raises on every call (errors are not cached)."""
    validate(schedule)
    return lower(schedule)


def rank_actions(schedule: Schedule, rank: int) -> tuple[Action, ...]:
    """The rows pipeline ``rank`` runs for ``schedule`` (validated, lowered when it has no SEND/RECV
    rows): what ``run_schedule``'s ``hooks`` count."""
    return tuple(_checked_and_lowered(schedule).actions[rank])


def chunks_used(action: Action) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the rank-local chunks whose parameters ``action`` reads, those whose W it runs)."""
    if action.kind == "FB":
        return (action.chunk, action.b_chunk), (action.b_chunk,)
    if action.kind in ("F", "B"):
        return (action.chunk,), ()
    if action.kind in ("W", "BW"):
        return (action.chunk,), (action.chunk,)
    return (), ()


def run_schedule(
    schedule: Schedule,
    model: Model,
    params: Mapping[str, Tensor],
    batch: runner.Batch,
    group: dist.ProcessGroup | None = None,
    *,
    seed: int = 0,
    stage_groups: Mapping | None = None,
    fb_order: str | Sequence[FBStep] = FB_ORDER,
    reduce_shared: bool = True,
    timeout_s: float = D.DEFAULT_TIMEOUT_S,
    hooks: runner.StepHooks | None = None,
    memory: MemoryPolicy | None = None,
) -> runner.StepResult:
    """Run this rank's rows of ``schedule``; return the step's loss and this rank's gradients.

    schedule: a table with pp = the group's size (compute-only tables are lowered here);
    params: {global name: tensor}, at least this rank's (``pipeline.local_param_names``);
    batch: the whole step's batch ({"tokens": [b, s] int64, "labels": [b, s] int64}), the same on
    every rank; group: the pipeline process group (default: the world); seed/stage_groups: the
    StageContext fields; fb_order: the FB stage order (see ``FB_ORDER``); reduce_shared: sum the
    gradients of parameters several ranks hold (DualPipe copies, tied embeddings) here, so every
    holder gets the total; hooks: called around each of this rank's rows (``rank_actions``; k is
    the row's index there), e.g. to gather a chunk's parameters before its first use and take its
    gradients after its last W (``fmoe.parallel``); names it takes are absent from the result;
    memory: each stage's recomputation (``fmoe.memory_policy``; the merge window is pp = 1's).
    Returns StepResult(loss [] float32, {name: grad} for this rank's params, per-microbatch losses,
    the statistics of this rank's stages summed over its microbatches).
    Raises ScheduleError (every rank, nothing run) for an invalid table; PipelineError when any rank
    fails or a wait times out.
    """
    group = group or torch.distributed.distributed_c10d._get_default_group()
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if schedule.pp != size:
        raise ScheduleError(f"schedule pp={schedule.pp} but the pipeline group has {size} ranks")
    schedule = _checked_and_lowered(schedule)
    order = parse_fb_order(fb_order) if isinstance(fb_order, str) else tuple(fb_order)
    st = _Rank(schedule, model, params, batch, group, rank, seed, dict(stage_groups or {}), timeout_s, memory)
    names = pipeline.local_param_names(model, schedule, rank=rank)
    if hooks is not None:
        taken = {n for ns in hooks.take.values() for n in ns}
        names = [n for n in names if n not in taken]
    actions = schedule.actions[rank]

    def run_row(k: int) -> None:
        st.action, st.row = actions[k], k
        HANDLERS[actions[k].kind](st, actions[k], order)

    try:
        runner.run_steps(
            len(actions), run_row, hooks, lambda ns: runner.take_grads(st.grads, None, params, ns)
        )
        st.action, st.row = "the final waits", None
        return _finish(st, params, names, reduce_shared)
    except D.PipelineError:
        raise
    except Exception as e:
        raise _failure(st, e) from e


def _finish(
    st: _Rank, params: Mapping[str, Tensor], names: Sequence[str], reduce_shared: bool
) -> runner.StepResult:
    """The step's end on this rank: the sends waited on, the loss, the gradients of ``names`` (zeros
    where its rows gave none; with ``reduce_shared``, summed over their holders: ``fmoe.shared_grads``)."""
    st.link.wait_all()
    loss, losses = _finish_loss(st)
    st.grads = runner.zero_missing(st.grads, params, names)
    if reduce_shared:
        sum_shared_grads(st.grads, names, pipeline.param_holders(st.model, st.s), st.link)
    return runner.StepResult(loss, st.grads, losses, st.statistics)


def _failure(st: _Rank, e: Exception) -> D.PipelineError:
    """A peer's earlier failure (its closed sockets are what broke this rank), else this rank's at
    ``st.action`` with its table, recorded in the group's store for the peers (``fmoe.dist``)."""
    earlier = D.failure(st.group)
    if earlier is not None:
        return D.PipelineError(earlier)
    msg = f"pipeline rank {st.rank} failed at {st.action}: {type(e).__name__}: {e}"
    if st.row is not None:
        msg += "\n" + rank_table(st.s.actions[st.rank], st.rank, marked=st.row)
    D.fail(st.group, msg)
    return D.PipelineError(msg)


def pipeline_step(
    schedule: Schedule,
    model: Model,
    params_local: Mapping[str, Tensor],
    batch: runner.Batch,
    group: dist.ProcessGroup | None = None,
    **options,
) -> runner.StepResult:
    """What the trainer calls once per step on every pipeline rank: ``run_schedule`` (same options).

    params_local: this rank's parameters (``pipeline.local_param_names``); the returned grads have
    the same keys, already summed over the ranks that share a parameter.
    """
    return run_schedule(schedule, model, params_local, batch, group, **options)
