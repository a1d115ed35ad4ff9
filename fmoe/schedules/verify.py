"""Validation and lowering of schedule tables.

``validate`` checks that every row is well formed (ranges, peers); that every (microbatch, stage)
has exactly one F and one B and one W, or one F and one BW (an FB row is the F of its forward half
and the BW of its backward half); that on each rank F comes before B before W, and a stage's input
made on the same rank is made before it is used; if the table has SEND/RECV rows, that every
transfer between ranks is written out (a RECV before its consumer, a SEND after its producer, each
send matched by the receive of the same data, in the same order); and that a run cannot deadlock:
compute-only tables run with asynchronous transfers, tables with SEND/RECV rows with blocking
(rendezvous) send/recv matched pairwise in order. All of it is a few linear passes over the rows.
"""

from __future__ import annotations

from typing import NamedTuple

from .table import COMM, Action, Schedule, ScheduleError, copy_of, locate, num_stages, stage_of

# Positive durations used to order the communication rows (any positive numbers give a valid order).
_LOWER_COST = {"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0, "FB": 2.0}

# Keys: the activation F makes for (copy k, stage st, microbatch m) is (k*S + st)*M + m; the gradient
# B makes for it is that plus n = copies*S*M. A compiled compute row is
# (row, need_act, act_remote, need_grad, grad_remote, makes_act, makes_grad, stage), -1 = none.
Op = tuple[int, int, bool, int, bool, int, int, int]


class _Scan(NamedTuple):
    ops: list[list[Op]]
    keys: int
    # Tables with SEND/RECV rows: per rank, (peer rank, peer row) of every row as two lists; -1 = compute.
    partner: list[tuple[list[int], list[int]]] | None


def _err(s: Schedule, r: int, i: int, a: Action, msg: str) -> ScheduleError:
    line = f" ({s.source} line {s.lines[r][i]})" if s.lines else ""
    return ScheduleError(f"rank {r} row {i}{line}: {a}: {msg}", r, i, a)


def _layout(s: Schedule, r: int):
    """Per chunk of rank r: key base, stage, and (rank, chunk) of the previous / next stage ((-1, -1): none)."""
    S, M = num_stages(s), s.microbatches
    base, stage, prev, nxt = [], [], [], []
    for c in range(s.chunks):
        st, k = stage_of(s.placement, s.pp, r, c), copy_of(s.placement, c)
        base.append((k * S + st) * M)
        stage.append(st)
        prev.append(locate(s.placement, s.pp, s.chunks, st - 1, k) if st > 0 else (-1, -1))
        nxt.append(locate(s.placement, s.pp, s.chunks, st + 1, k) if st < S - 1 else (-1, -1))
    return base, stage, prev, nxt


class _Shared(NamedTuple):
    """The state the scans of all ranks share, indexed by key (see ``Op``): the row of each key's F,
    B and W on its rank (-1: none yet), which keys were received and sent, the transfers between
    each pair of ranks (``_match`` pairs them), and the missing RECVs, reported after the matching."""

    n: int
    lowered: bool
    f_row: list[int]
    b_row: list[int]
    w_row: list[int]
    got: bytearray
    sent: bytearray
    # (src, dst) -> keys and rows of the sends from src to dst, keys and rows of dst's receives from src
    chan: dict[tuple[int, int], tuple[list, list, list, list]]
    late: list[ScheduleError]


class _RankScan:
    """Rank r's rows checked in order against the ``_Shared`` state; ``ops`` are its compiled compute rows.

    A missing RECV goes to ``late``: reported after the sends and receives are matched, so that a
    send without its receive is named as such.
    """

    def __init__(self, s: Schedule, r: int, shared: _Shared):
        self.s, self.r, self.sh = s, r, shared
        self.base, self.stage, prev_rc, next_rc = _layout(s, r)
        self.prev, self.nxt = [q for q, _ in prev_rc], [q for q, _ in next_rc]
        self.ops: list[Op] = []

    def row(self, i: int, a: Action) -> None:
        """Check row i, ``a``: its microbatch and chunk, then by its kind; append its compiled compute
        row to ``ops`` (a transfer has none)."""
        sh, kind, c = self.sh, a.kind, a.chunk
        key = self.key(i, a, a.microbatch, c)
        if kind == "F" or kind == "FB":
            nf, rf = self.forward(i, a, key, c)
            if kind == "F":
                self.ops.append((i, nf, rf, -1, False, key, -1, self.stage[c]))
                return
            bc = a.b_chunk
            bkey = self.key(i, a, a.b_microbatch, bc)
            ng, rg = self.backward(i, a, bkey, bc, "its backward half")
            sh.w_row[bkey] = i
            self.ops.append((i, nf, rf, ng, rg, key, sh.n + bkey, self.stage[c]))
        elif kind == "B" or kind == "BW":
            ng, rg = self.backward(i, a, key, c, "it")
            if kind == "BW":
                sh.w_row[key] = i
            self.ops.append((i, -1, False, ng, rg, -1, sh.n + key, self.stage[c]))
        elif kind == "W":
            self.weight(i, a, key)
            self.ops.append((i, -1, False, -1, False, -1, -1, self.stage[c]))
        elif kind in COMM:
            self.transfer(i, a, key, c)
        else:
            raise _err(self.s, self.r, i, a, f"kind must be one of F, B, W, BW, FB, {', '.join(COMM)}")

    def key(self, i: int, a: Action, m, c) -> int:
        """The key of (microbatch m, chunk c), after checking both are in range (and, for bidir, agree)."""
        s = self.s
        M, C = s.microbatches, s.chunks
        if type(m) is not int or not 0 <= m < M:
            raise _err(s, self.r, i, a, f"microbatch {m!r} outside 0..{M - 1}")
        if type(c) is not int or not 0 <= c < C:
            raise _err(s, self.r, i, a, f"chunk {c!r} outside 0..{C - 1}")
        if s.placement == "bidir" and (m >= M // 2) != (c == 1):
            k = int(m >= M // 2)
            raise _err(
                s,
                self.r,
                i,
                a,
                f"in placement bidir microbatch {m} travels model copy {k}, held as chunk {k}",
            )
        return self.base[c] + m

    def forward(self, i: int, a: Action, key: int, c: int) -> tuple[int, bool]:
        """Check an F; return (the key of its input or -1, whether that comes from another rank)."""
        s, r, sh, M = self.s, self.r, self.sh, self.s.microbatches
        if sh.f_row[key] >= 0:
            raise _err(s, r, i, a, f"second F of this microbatch and chunk (first: row {sh.f_row[key]})")
        q, nf, rf = self.prev[c], -1, False
        if q >= 0:
            nf = key - M
            if q == r and sh.f_row[nf] < 0:
                raise _err(
                    s, r, i, a, f"comes before the F of stage {self.stage[c] - 1} (same rank) it needs"
                )
            if q != r:
                rf = True
                if sh.lowered and not sh.got[key]:
                    sh.late.append(_err(s, r, i, a, f"no RECV_F from rank {q} comes before it"))
        sh.f_row[key] = i
        return nf, rf

    def backward(self, i: int, a: Action, key: int, c: int, what: str) -> tuple[int, bool]:
        """Check a B (``what``: how the message names it); return (the key of its output gradient
        or -1, whether that comes from another rank)."""
        s, r, sh, M = self.s, self.r, self.sh, self.s.microbatches
        if sh.f_row[key] < 0:
            raise _err(s, r, i, a, f"{what} comes before the F of the same microbatch and chunk")
        if sh.b_row[key] >= 0:
            raise _err(
                s, r, i, a, f"{what} is a second B of this microbatch and chunk (first: row {sh.b_row[key]})"
            )
        q, ng, rg = self.nxt[c], -1, False
        if q >= 0:
            ng = sh.n + key + M
            if q == r and sh.b_row[key + M] < 0:
                raise _err(
                    s, r, i, a, f"{what} comes before the B of stage {self.stage[c] + 1} (same rank) it needs"
                )
            if q != r:
                rg = True
                if sh.lowered and not sh.got[sh.n + key]:
                    sh.late.append(_err(s, r, i, a, f"no RECV_B from rank {q} comes before {what}"))
        sh.b_row[key] = i
        return ng, rg

    def weight(self, i: int, a: Action, key: int) -> None:
        sh = self.sh
        if sh.b_row[key] < 0:
            raise _err(self.s, self.r, i, a, "comes before the B of the same microbatch and chunk")
        if sh.w_row[key] >= 0:
            raise _err(
                self.s, self.r, i, a, f"second W of this microbatch and chunk (first: row {sh.w_row[key]})"
            )
        sh.w_row[key] = i

    def transfer(self, i: int, a: Action, key: int, c: int) -> None:
        """Check a SEND/RECV's peer and data; file it on its channel for ``_match``."""
        s, r, sh, kind = self.s, self.r, self.sh, a.kind
        grad = kind[-1] == "B"
        q = self.prev[c] if kind in ("RECV_F", "SEND_B") else self.nxt[c]
        if q < 0:
            raise _err(s, r, i, a, f"stage {self.stage[c]} has no neighbouring stage in that direction")
        if q == r:
            raise _err(s, r, i, a, f"the neighbouring stage is on rank {r} too; there is nothing to transfer")
        if a.peer != q:
            raise _err(s, r, i, a, f"peer must be rank {q}, which holds the neighbouring stage")
        mine = sh.n + key if grad else key
        done = sh.sent if kind[0] == "S" else sh.got
        if kind[0] == "S" and (sh.b_row if grad else sh.f_row)[key] < 0:
            raise _err(s, r, i, a, f"comes before the {'B' if grad else 'F'} that makes what it sends")
        if done[mine]:
            raise _err(s, r, i, a, f"second {kind} of this microbatch and chunk")
        done[mine] = 1
        if kind[0] == "S":
            ch = sh.chan.setdefault((r, q), ([], [], [], []))
            ch[0].append(mine - s.microbatches if grad else mine + s.microbatches)  # the receiver's key
            ch[1].append(i)
        else:
            ch = sh.chan.setdefault((q, r), ([], [], [], []))
            ch[2].append(mine)
            ch[3].append(i)


def _scan(s: Schedule) -> _Scan:
    """All static checks in one pass over the rows; returns the compiled compute rows."""
    n = (2 if s.placement == "bidir" else 1) * num_stages(s) * s.microbatches
    lowered = any(a.kind in COMM for acts in s.actions for a in acts)
    sh = _Shared(n, lowered, [-1] * n, [-1] * n, [-1] * n, bytearray(2 * n), bytearray(2 * n), {}, [])
    all_ops = []
    for r in range(s.pp):
        scan = _RankScan(s, r, sh)
        for i, a in enumerate(s.actions[r]):
            scan.row(i, a)
        all_ops.append(scan.ops)
    _complete(s, sh.f_row, sh.b_row, sh.w_row, n)
    partner = _match(s, sh.chan) if lowered else None
    if sh.late:
        raise sh.late[0]
    return _Scan(all_ops, 2 * n, partner)


def _complete(s: Schedule, f_row, b_row, w_row, n) -> None:
    S, M = num_stages(s), s.microbatches
    for key in range(n):
        if f_row[key] >= 0 and b_row[key] >= 0 and w_row[key] >= 0:
            continue
        k, rest = divmod(key, S * M)
        st, m = divmod(rest, M)
        if k != int(s.placement == "bidir" and m >= M // 2):
            continue  # bidir: copy k never carries microbatch m
        r, c = locate(s.placement, s.pp, s.chunks, st, k)
        what = f"microbatch {m} stage {st}" + (f" of copy {k}" if s.placement == "bidir" else "")
        if max(f_row[key], b_row[key], w_row[key]) < 0:
            raise ScheduleError(
                f"rank {r} (chunk {c}): no row for {what}: it needs F, B and W (or F and BW)", r
            )
        # The scan saw every B after its F and every W after its B: name the row whose follow-up is missing.
        missing, row = ("B", f_row[key]) if b_row[key] < 0 else ("W", b_row[key])
        raise _err(s, r, row, s.actions[r][row], f"{what} has no {missing}")


def _match(s: Schedule, chan) -> list[tuple[list[int], list[int]]]:
    """Pair the k-th send from rank a to rank b with the k-th receive on b from a."""
    partner = [([-1] * len(acts), [-1] * len(acts)) for acts in s.actions]
    for (src, dst), (sdata, srows, rdata, rrows) in chan.items():
        if sdata != rdata:
            have, sent = set(rdata), set(sdata)
            for d, i in zip(sdata, srows):
                if d not in have:
                    raise _err(s, src, i, s.actions[src][i], f"no matching receive on rank {dst}")
            for d, j in zip(rdata, rrows):
                if d not in sent:
                    raise _err(s, dst, j, s.actions[dst][j], f"no matching send on rank {src}")
            k = next(k for k, (d, e) in enumerate(zip(sdata, rdata)) if d != e)
            i, j = srows[k], rrows[k]
            raise _err(
                s,
                src,
                i,
                s.actions[src][i],
                f"is rank {src}'s send #{k} to rank {dst}, whose receive #{k} from rank {src} is row {j} "
                f"{s.actions[dst][j]}; blocking send/recv pair up in order",
            )
        sp, rp = partner[src], partner[dst]
        for i, j in zip(srows, rrows):
            sp[0][i], sp[1][i], rp[0][j], rp[1][j] = dst, j, src, i
    return partner


def _rendezvous(s: Schedule, partner) -> None:
    """Run with blocking send/recv: a transfer happens when both ranks stand at its two rows."""
    ptr = [0] * s.pp
    work = list(range(s.pp))
    while work:
        r = work.pop()
        p, (peer, prow) = ptr[r], partner[r]
        end = len(peer)
        while p < end:
            q = peer[p]
            if q < 0:  # compute: the scan checked its inputs arrive before it
                p += 1
            elif ptr[q] == prow[p]:
                ptr[q] += 1
                work.append(q)
                p += 1
            else:
                break
        ptr[r] = p
    stuck = [r for r in range(s.pp) if ptr[r] < len(partner[r][0])]
    if stuck:
        parts = []
        for r in stuck:
            q, j = partner[r][0][ptr[r]], partner[r][1][ptr[r]]
            parts.append(
                f"rank {r} row {ptr[r]} {s.actions[r][ptr[r]]} waits for rank {q} to reach row {j} "
                f"{s.actions[q][j]} (rank {q} stands at row {ptr[q]})"
            )
        r0 = stuck[0]
        raise ScheduleError(
            "deadlock with blocking send/recv: " + "; ".join(parts), r0, ptr[r0], s.actions[r0][ptr[r0]]
        )


def timeline(s: Schedule, ops: list[list[Op]], keys: int, durations, transfer: float):
    """Start time of every compiled row, each rank running its rows in order as soon as their inputs
    are there (``transfer`` later when made on another rank); raises ScheduleError on deadlock."""
    end: list[float | None] = [None] * keys
    waiting: dict[int, list[int]] = {}
    ptr, clock = [0] * s.pp, [0.0] * s.pp
    starts: list[list[float]] = [[] for _ in range(s.pp)]
    work = list(range(s.pp - 1, -1, -1))
    while work:
        r = work.pop()
        rops, dur, out, t, p = ops[r], durations[r], starts[r], clock[r], ptr[r]
        while p < len(rops):
            _, nf, rf, ng, rg, pf, pg, _ = rops[p]
            start = t
            if nf >= 0:
                e = end[nf]
                if e is None:
                    waiting.setdefault(nf, []).append(r)
                    break
                start = max(start, e + transfer if rf else e)
            if ng >= 0:
                e = end[ng]
                if e is None:
                    waiting.setdefault(ng, []).append(r)
                    break
                start = max(start, e + transfer if rg else e)
            t = start + dur[p]
            out.append(start)
            if pf >= 0:
                end[pf] = t
                if pf in waiting:
                    work.extend(waiting.pop(pf))
            if pg >= 0:
                end[pg] = t
                if pg in waiting:
                    work.extend(waiting.pop(pg))
            p += 1
        ptr[r], clock[r] = p, t
    stuck = [r for r in range(s.pp) if ptr[r] < len(ops[r])]
    if stuck:
        S, M, half = num_stages(s), s.microbatches, keys // 2
        parts = []
        for r in stuck:
            row, nf, _, ng, *_ = ops[r][ptr[r]]
            key = nf if nf >= 0 and end[nf] is None else ng
            k, rest = divmod(key % half, S * M)
            st, m = divmod(rest, M)
            q = locate(s.placement, s.pp, s.chunks, st, k)[0]
            what = "gradient" if key >= half else "activation"
            line = f" ({s.source} line {s.lines[r][row]})" if s.lines else ""
            parts.append(
                f"rank {r} row {row}{line}: {s.actions[r][row]} waits for the {what} of microbatch {m} "
                f"stage {st} (rank {q})"
            )
        r0 = stuck[0]
        row0 = ops[r0][ptr[r0]][0]
        raise ScheduleError("deadlock: " + "; ".join(parts), r0, row0, s.actions[r0][row0])
    return starts


def checked(s: Schedule) -> _Scan:
    """Static checks plus the blocking send/recv run of a lowered table (compute deadlocks: ``timeline``)."""
    scan = _scan(s)
    if scan.partner is not None:
        _rendezvous(s, scan.partner)
    return scan


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError (naming rank, row and action) unless ``schedule`` is complete and runnable."""
    scan = checked(schedule)
    if scan.partner is None:
        timeline(schedule, scan.ops, scan.keys, [[0.0] * len(o) for o in scan.ops], 0.0)


def lower(schedule: Schedule) -> Schedule:
    """Insert SEND/RECV rows into a compute-only table (a table that has them is validated and returned).

    Each SEND goes right after the row making its data (only other transfers may come between them);
    each RECV goes on the receiving rank where the data arrives in a simulated run (F = B = W = 1,
    BW = FB = 2), so before the row using it. Every rank's
    rows are then in the order of one global sequence of events in which each transfer is a single
    event of both ranks, so blocking send/recv matched pairwise in order cannot deadlock.
    """
    s = schedule
    scan = checked(s)
    if scan.partner is not None:
        return s
    durations = [[_LOWER_COST[s.actions[r][op[0]].kind] for op in ops] for r, ops in enumerate(scan.ops)]
    starts = timeline(s, scan.ops, scan.keys, durations, 0.0)
    # One integer order key per row, the same on both ranks for a transfer: (time, transfers before
    # computes, rank that made the data, its compute row, activation before gradient). Times are whole
    # numbers here, and a rank's compute rows have distinct start times.
    G = max(map(len, scan.ops)) + 1

    def order(t, comm, r, g, sub):
        return (((int(t) * 2 + 1 - comm) * s.pp + r) * G + g) * 2 + sub

    keys = [[order(t, 0, r, g, 0) for g, t in enumerate(st)] for r, st in enumerate(starts)]
    rows = [[s.actions[r][op[0]] for op in ops] for r, ops in enumerate(scan.ops)]
    for r, ops in enumerate(scan.ops):
        _, _, prev, nxt = _layout(s, r)
        acts, st, dur = s.actions[r], starts[r], durations[r]
        for g, op in enumerate(ops):
            if op[5] < 0 and op[6] < 0:
                continue
            a = acts[op[0]]
            outs = []
            if op[5] >= 0:  # makes an activation
                outs.append(("F", a.microbatch, a.chunk, *nxt[a.chunk], 0))
            if op[6] >= 0:  # makes a gradient
                m, c = (a.b_microbatch, a.b_chunk) if a.kind == "FB" else (a.microbatch, a.chunk)
                outs.append(("B", m, c, *prev[c], 1))
            for what, m, c, q, qc, sub in outs:
                if q < 0 or q == r:
                    continue
                k = order(st[g] + dur[g], 1, r, g, sub)
                keys[r].append(k)
                rows[r].append(Action("SEND_" + what, m, c, peer=q))
                keys[q].append(k)
                rows[q].append(Action("RECV_" + what, m, qc, peer=r))
    actions = []
    for k, row in zip(keys, rows):
        actions.append(tuple(row[i] for i in sorted(range(len(k)), key=k.__getitem__)))
    return Schedule(s.pp, s.microbatches, s.placement, s.chunks, tuple(actions), name=s.name)
