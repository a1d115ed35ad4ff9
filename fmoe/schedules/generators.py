"""Generators: each returns a compute-only table (``lower`` adds the SEND/RECV rows).

Per rank, the rows follow the published schedule; BW is a full backward, B/W the split one.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from .table import Action, Schedule, ScheduleError


@lru_cache(maxsize=1 << 18)
def A(
    kind: str, microbatch: int, chunk: int, b_microbatch: int | None = None, b_chunk: int | None = None
) -> Action:
    """Action, shared between ranks and tables (they are immutable): large tables build faster."""
    return Action(kind, microbatch, chunk, b_microbatch, b_chunk)


def _need(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ScheduleError(f"{name}: {msg}")


def gpipe(pp: int, m: int) -> list[list[Action]]:
    """All forwards, then all full backwards (Huang et al. 2019)."""
    return [[A("F", i, 0) for i in range(m)] + [A("BW", i, 0) for i in range(m)] for _ in range(pp)]


def one_f_one_b(pp: int, m: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush): pp-1-r warm-up forwards, then alternate one F and one BW."""
    out = []
    for r in range(pp):
        warm = min(pp - 1 - r, m)
        rows = [A("F", i, 0) for i in range(warm)]
        for i in range(m - warm):
            rows += [A("F", warm + i, 0), A("BW", i, 0)]
        rows += [A("BW", i, 0) for i in range(m - warm, m)]
        out.append(rows)
    return out


def zb_h1(pp: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2024): 1F1B with B and W split, rank r running each W r microbatches late.

    Delaying W by r keeps at most pp activations alive on every rank (as 1F1B), and the late Ws fill
    the cool-down bubbles: bubble (pp-1)(F+B-W) instead of (pp-1)(F+B+W).
    """
    out = []
    for r in range(pp):
        warm = min(pp - 1 - r, m)
        rows = [A("F", i, 0) for i in range(warm)]
        w = 0
        for i in range(m):
            if warm + i < m:
                rows.append(A("F", warm + i, 0))
            rows.append(A("B", i, 0))
            if i >= r:
                rows.append(A("W", w, 0))
                w += 1
        rows += [A("W", i, 0) for i in range(w, m)]
        out.append(rows)
    return out


def interleaved_1f1b(pp: int, m: int, chunks: int = 2) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021), ``chunks`` model chunks per rank, loop placement.

    Microbatches go in rounds of ``m // rounds`` (rounds = max(1, m // pp)): a round runs through
    chunk 0, then chunk 1, ...; backwards visit the chunks in reverse. Like torch's version this
    relaxes Megatron's ``m % pp == 0`` to ``m % rounds == 0``.
    """
    name = "interleaved-1f1b"
    _need(isinstance(chunks, int) and chunks >= 1, name, f"chunks must be an integer >= 1, got {chunks!r}")
    rounds = max(1, m // pp)
    per = m // rounds
    _need(
        m % rounds == 0, name, f"microbatches={m} must be a multiple of the {rounds} rounds (max(1, m // pp))"
    )
    return [_interleaved_rank(pp, m, chunks, per, r) for r in range(pp)]


def _interleaved_rank(pp: int, m: int, chunks: int, per: int, r: int) -> list[Action]:
    total = m * chunks
    warm = min((chunks - 1) * per + 2 * (pp - 1 - r), total)
    nf, nb = [0] * chunks, [0] * chunks
    rows = []

    def fwd(j):
        c = (j // per) % chunks
        rows.append(A("F", nf[c], c))
        nf[c] += 1

    def bwd(j):
        c = chunks - 1 - (j // per) % chunks
        rows.append(A("BW", nb[c], c))
        nb[c] += 1

    for j in range(warm):
        fwd(j)
    for j in range(total - warm):
        fwd(warm + j)
        bwd(j)
    for j in range(total - warm, total):
        bwd(j)
    return rows


def zbv(pp: int, m: int) -> list[list[Action]]:
    """ZB-V (Qi et al. 2024, section 6): V placement, chunk 0 = stage r, chunk 1 = stage 2pp-1-r.

    Warm-up: 2(pp-r)-1 forwards of chunk 0, r pairs (F1, F0), pp-r triples (F1, B1, W1); steady:
    (F0, B0, W0, F1, B1, W1); cool-down: B0/B1 pairs, then (B0, W0) pairs, then the remaining Ws.
    Built for max(m, 2pp-1) microbatches with the rows of the extra ones dropped, so any m works.
    """
    return [_zbv_rank(pp, m, max(m, 2 * pp - 1), r) for r in range(pp)]


def _zbv_rank(pp: int, m: int, n: int, r: int) -> list[Action]:
    rows: list[Action] = []
    cnt = {"F": [0, 0], "B": [0, 0], "W": [0, 0]}

    def add(kind, c):
        k = cnt[kind]
        rows.append(A(kind, k[c], c))
        k[c] += 1

    for _ in range(2 * (pp - r) - 1):
        add("F", 0)
    for _ in range(r):
        add("F", 1)
        add("F", 0)
    for _ in range(pp - r):
        add("F", 1)
        add("B", 1)
        add("W", 1)
    nf = cnt["F"]
    while nf[1] < nf[0] or nf[0] < n:
        if nf[0] < n:
            add("F", 0)
        add("B", 0)
        add("W", 0)
        add("F", 1)
        add("B", 1)
        add("W", 1)
    for _ in range(r):
        add("B", 0)
        add("B", 1)
    for _ in range(pp - r):
        add("B", 0)
        add("W", 0)
    for c in (1, 0):
        while cnt["W"][c] < cnt["B"][c]:
            add("W", c)
    return [a for a in rows if a.microbatch < m]


class _PhaseRows:
    """The rows of one DualPipe / DualPipeV rank as its phases add them: per phase p (0 or 1) the
    count of F and of B so far, and the (microbatch, chunk) of each deferred W, oldest first."""

    def __init__(self, chunk: Callable[[int], int], mb: Callable[[int, int], int]):
        self.chunk, self.mb = chunk, mb
        self.rows: list[Action] = []
        self.nf, self.nb = [0, 0], [0, 0]
        self.queue: list[tuple[int, int]] = []

    def f(self, p: int) -> None:
        self.rows.append(A("F", self.mb(p, self.nf[p]), self.chunk(p)))
        self.nf[p] += 1

    def b(self, p: int, zero_bubble: bool = False) -> None:
        """A full backward (BW), or with ``zero_bubble`` a B whose W is queued."""
        act = A("B" if zero_bubble else "BW", self.mb(p, self.nb[p]), self.chunk(p))
        self.rows.append(act)
        if zero_bubble:
            self.queue.append((act.microbatch, act.chunk))
        self.nb[p] += 1

    def w(self) -> None:
        self.rows.append(A("W", *self.queue.pop(0)))

    def fb(self, pf: int, pb: int) -> None:
        self.rows.append(
            A("FB", self.mb(pf, self.nf[pf]), self.chunk(pf), self.mb(pb, self.nb[pb]), self.chunk(pb))
        )
        self.nf[pf] += 1
        self.nb[pb] += 1


def _eight_phases(
    n: int, h: int, m: int, chunk: Callable[[int], int], mb: Callable[[int, int], int]
) -> list[Action]:
    """One rank of DualPipe / DualPipeV, in the reference implementation's eight phases.

    ``n`` ranks in the V (DualPipe: pp/2), ``h`` this rank's place in it, ``m`` microbatches per
    phase-0 entry point; ``chunk(p)`` the table chunk of phase p (0: the chunk nearer its model's input)
    and ``mb(p, i)`` the microbatch number of that chunk's i-th microbatch. A B whose W is deferred
    ("zero bubble") queues the W; each W row runs the oldest queued one.
    """
    t = _PhaseRows(chunk, mb)
    for _ in range(2 * (n - h - 1)):  # 1: nF0
        t.f(0)
    for _ in range(h + 1):  # 2: nF0F1
        t.f(0)
        t.f(1)
    for _ in range(n - h - 1):  # 3: nB1W1F1
        t.b(1, zero_bubble=True)
        t.w()
        t.f(1)
    for i in range(m - 2 * n + h + 1):  # 4: nF0B1F1B0 (the middle rank does its first pair apart)
        if i == 0 and h == n - 1:
            t.f(0)
            t.b(1)
        else:
            t.fb(0, 1)
        t.fb(1, 0)
    for _ in range(n - h - 1):  # 5: nB1F1B0
        t.b(1)
        t.fb(1, 0)
    zb = False
    for i in range(h + 1):  # 6: nB1B0, deferring W from the middle on
        zb = zb or (i == (h + 1) // 2 and h % 2 == 1)
        t.b(1, zb)
        zb = zb or (i == (h + 1) // 2 and h % 2 == 0)
        t.b(0, zb)
    for _ in range(n - h - 1):  # 7: nWB0
        t.w()
        t.b(0, zb)
    for _ in range(h + 1):  # 8: nW
        t.w()
    assert not t.queue and t.nf == [m, m] and t.nb == [m, m], "eight phases miscounted"
    return t.rows


def dualpipev(pp: int, m: int) -> list[list[Action]]:
    """DualPipeV (DeepSeek): V placement; needs microbatches >= 2 * pp."""
    _need(m >= 2 * pp, "dualpipev", f"needs microbatches >= 2 * pp, got microbatches={m}, pp={pp}")
    return [_eight_phases(pp, r, m, lambda p: p, lambda p, i: i) for r in range(pp)]


def dualpipe(pp: int, m: int) -> list[list[Action]]:
    """DualPipe (DeepSeek-V3): two model copies, one fed at rank 0 and one at rank pp-1 (placement bidir).

    Microbatches 0..m/2-1 run through copy 0 (chunk 0), m/2..m-1 through copy 1 (chunk 1). Rank r
    and rank pp-1-r mirror each other; phase 0 is the copy whose input end is nearer.
    """
    _need(pp % 2 == 0, "dualpipe", f"needs an even pp, got {pp}")
    _need(
        m % 2 == 0 and m >= 2 * pp,
        "dualpipe",
        f"needs an even number of microbatches >= 2 * pp, got {m}, pp={pp}",
    )
    half, out = m // 2, []
    for r in range(pp):
        second = int(r >= pp // 2)
        out.append(
            _eight_phases(
                pp // 2,
                min(r, pp - 1 - r),
                half,
                lambda p, s=second: p ^ s,
                lambda p, i, s=second: (p ^ s) * half + i,
            )
        )
    return out


GENERATORS: dict[str, tuple[Callable[..., list[list[Action]]], str, int]] = {
    "gpipe": (gpipe, "loop", 1),
    "1f1b": (one_f_one_b, "loop", 1),
    "interleaved-1f1b": (interleaved_1f1b, "loop", 2),
    "zb-h1": (zb_h1, "loop", 1),
    "zbv": (zbv, "v", 2),
    "dualpipe": (dualpipe, "bidir", 2),
    "dualpipev": (dualpipev, "v", 2),
}


def generate(name: str, pp: int, microbatches: int, **options) -> Schedule:
    """The compute-only table of schedule ``name`` (one of ``GENERATORS``) for ``pp`` ranks.

    Options: ``chunks`` for interleaved-1f1b (default 2). Raises ScheduleError on bad sizes.
    """
    if name not in GENERATORS:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(GENERATORS)}")
    fn, placement, chunks = GENERATORS[name]
    for key, v in (("pp", pp), ("microbatches", microbatches)):
        if not (isinstance(v, int) and v >= 1):
            raise ScheduleError(f"{name}: {key} must be an integer >= 1, got {v!r}")
    allowed = {"chunks"} if name == "interleaved-1f1b" else set()
    if set(options) - allowed:
        raise ScheduleError(f"{name}: unknown option(s) {', '.join(sorted(set(options) - allowed))}")
    chunks = options.get("chunks", chunks)
    rows = fn(pp, microbatches, **options)
    return Schedule(pp, microbatches, placement, chunks, tuple(tuple(r) for r in rows), name=name)
