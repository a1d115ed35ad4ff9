"""The schedule table: actions, placements and the CSV format.

A schedule says, for each of ``pp`` pipeline ranks, the ordered list of actions that rank runs.
Every action names a microbatch (0..microbatches-1) and a chunk: which of the rank's model pieces.

Placement (which pipeline stage a (rank, chunk) holds, ``stage_of``):
  loop   stage = chunk * pp + rank  (1F1B, GPipe, ZB-H1: one chunk; interleaved 1F1B: several)
  v      rank r holds stage r (chunk 0) and stage 2*pp-1-r (chunk 1)  (ZB-V, DualPipeV)
  bidir  DualPipe: two copies of a pp-stage model; rank r holds stage r of copy 0 (chunk 0) and
         stage pp-1-r of copy 1 (chunk 1). Copy 0 runs from rank 0 down to rank pp-1 and carries
         microbatches 0..M/2-1; copy 1 runs from rank pp-1 up to rank 0 and carries M/2..M-1
         (``copy_of``, ``microbatch_copy``). The copies' gradients are summed before the step.

Actions (one row each):
  F       forward of (microbatch, chunk)
  B       input gradient (backward for inputs); needs the F, produces the gradient for the stage below
  W       weight gradient; needs the B. B then W may be far apart (zero-bubble schedules)
  BW      full backward: B then W at once
  FB      the forward of (microbatch, chunk) overlapped with the full backward (BW) of
          (b_microbatch, b_chunk), as DualPipe does; it counts as that F and that BW
  SEND_F  send the activation made by F(microbatch, chunk) to rank ``peer`` (the next stage)
  RECV_F  receive the input of F(microbatch, chunk) from rank ``peer`` (the previous stage)
  SEND_B  send the input gradient made by B/BW(microbatch, chunk) to ``peer`` (the previous stage)
  RECV_B  receive the output gradient B/BW(microbatch, chunk) needs from ``peer`` (the next stage)
Neighbouring stages on the same rank (the bottom of a V) hand data over without a transfer.
A table is either compute-only (``lower`` then inserts the transfers: each SEND right after the row
producing the data, each RECV before the row consuming it, an FB's receives both before it and its
sends both after it) or has every transfer written out. On each rank rows run in order; with
blocking send/recv matched pairwise in order, a table that passes ``validate`` cannot deadlock.

CSV format (``read_csv`` / ``write_csv``; hand-editable, ``#`` lines are comments):

    # fmoe-schedule pp=2 microbatches=2 placement=loop chunks=1 name=1f1b
    rank,action,microbatch,chunk
    0,F,0,0
    0,F,1,0
    0,BW,0,0
    0,BW,1,0
    1,F,0,0
    1,BW,0,0
    1,F,1,0
    1,BW,1,0

The header comment gives pp, microbatches, placement and (default 1 for loop, 2 otherwise) chunks.
Columns: rank, action, microbatch, chunk, and where used b_microbatch, b_chunk (FB) and peer
(SEND/RECV). A rank's rows run in the order they appear in the file.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path


class ActionKind(StrEnum):
    """What a row does (see the module docstring). A member equals its name as a string, so a table
    read from CSV (``Action.kind`` a plain ``str``) compares and looks up like the members."""

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    FB = "FB"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


COMPUTE = (ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW, ActionKind.FB)
COMM = (ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B)
KINDS = COMPUTE + COMM
PLACEMENTS = ("loop", "v", "bidir")
COLUMNS = ("rank", "action", "microbatch", "chunk", "b_microbatch", "b_chunk", "peer")


class ScheduleError(ValueError):
    """A table that is malformed, breaks a dependency or can deadlock.

    ``rank``, ``row`` (0-based index into ``schedule.actions[rank]``) and ``action`` locate the
    offending row when there is one; the message names them too (and the file line, for a read table).
    """

    def __init__(self, message: str, rank: int | None = None, row: int | None = None, action=None):
        super().__init__(message)
        self.rank, self.row, self.action = rank, row, action


@dataclass(frozen=True, slots=True)
class Action:
    """One row of a rank's list.

    ``microbatch``/``chunk`` name the (forward half of an FB) action's microbatch and the rank-local
    model chunk; ``b_microbatch``/``b_chunk`` the full backward (B then W) that an FB overlaps with;
    ``peer`` the other pipeline rank of a SEND_*/RECV_*.
    """

    kind: str
    microbatch: int
    chunk: int
    b_microbatch: int | None = None
    b_chunk: int | None = None
    peer: int | None = None

    def __str__(self) -> str:
        if self.kind == "FB":
            return f"FB(mb={self.microbatch}, chunk={self.chunk} | b_mb={self.b_microbatch}, b_chunk={self.b_chunk})"
        peer = "" if self.peer is None else f", peer={self.peer}"
        return f"{self.kind}(mb={self.microbatch}, chunk={self.chunk}{peer})"


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``actions[rank]`` is the ordered list of what that rank runs.

    ``chunks`` model chunks per rank; ``placement`` says which stage each (rank, chunk) holds
    (``stage_of``). ``lines``/``source`` remember where a read table's rows came from, for errors.
    Construction checks the header fields only; ``validate`` checks the rows.
    """

    pp: int
    microbatches: int
    placement: str
    chunks: int
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)
    name: str = ""
    lines: tuple[tuple[int, ...], ...] | None = field(default=None, compare=False, repr=False)
    source: str = field(default="", compare=False, repr=False)

    def __post_init__(self):
        where = f"{self.source}: " if self.source else ""
        if not (isinstance(self.pp, int) and self.pp >= 1):
            raise ScheduleError(f"{where}pp must be an integer >= 1, got {self.pp!r}")
        if not (isinstance(self.microbatches, int) and self.microbatches >= 1):
            raise ScheduleError(f"{where}microbatches must be an integer >= 1, got {self.microbatches!r}")
        if self.placement not in PLACEMENTS:
            raise ScheduleError(
                f"{where}placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}"
            )
        fixed = {"v": 2, "bidir": 2}.get(self.placement)
        if not (isinstance(self.chunks, int) and self.chunks >= 1) or fixed not in (None, self.chunks):
            raise ScheduleError(
                f"{where}chunks must be {fixed or '>= 1'} for placement {self.placement}, got {self.chunks!r}"
            )
        if self.placement == "bidir" and (self.pp % 2 or self.microbatches % 2):
            raise ScheduleError(
                f"{where}placement bidir needs an even pp and an even number of microbatches, "
                f"got pp={self.pp}, microbatches={self.microbatches}"
            )
        if len(self.actions) != self.pp:
            raise ScheduleError(f"{where}actions has {len(self.actions)} ranks, pp is {self.pp}")


def num_stages(schedule: Schedule) -> int:
    """Pipeline stages of one model copy: ``chunks * pp`` for loop and v, ``pp`` for bidir."""
    return schedule.pp if schedule.placement == "bidir" else schedule.chunks * schedule.pp


def stage_of(placement: str, pp: int, rank: int, chunk: int) -> int:
    """The stage (0..num_stages-1, within its model copy) that ``chunk`` of ``rank`` holds.

    loop: ``chunk * pp + rank``; v: chunk 0 = ``rank``, chunk 1 = ``2*pp-1-rank``;
    bidir: chunk 0 = stage ``rank`` of copy 0, chunk 1 = stage ``pp-1-rank`` of copy 1.
    """
    if placement == "loop":
        return chunk * pp + rank
    if placement == "v":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    if placement == "bidir":
        return rank if chunk == 0 else pp - 1 - rank
    raise ScheduleError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")


def copy_of(placement: str, chunk: int) -> int:
    """Which model copy a chunk holds: the chunk itself for bidir (DualPipe), else 0.

    Copy 0 runs down the ranks (stage s on rank s), copy 1 up (stage s on rank pp-1-s); both copies
    have the same parameters, so their gradients are summed before the optimizer step.
    """
    return chunk if placement == "bidir" else 0


def microbatch_copy(schedule: Schedule, microbatch: int) -> int:
    """The model copy a microbatch travels through: bidir sends the first half of the microbatches
    through copy 0 (entering at rank 0), the second half through copy 1 (entering at rank pp-1)."""
    if schedule.placement != "bidir":
        return 0
    return 0 if microbatch < schedule.microbatches // 2 else 1


def locate(placement: str, pp: int, chunks: int, stage: int, copy: int = 0) -> tuple[int, int]:
    """Inverse of ``stage_of``: the (rank, chunk) holding ``stage`` of model ``copy``."""
    if placement == "loop":
        return stage % pp, stage // pp
    if placement == "v":
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return (stage, 0) if copy == 0 else (pp - 1 - stage, 1)


def write_csv(schedule: Schedule, path: str | Path | None = None) -> str:
    """Write ``schedule`` as CSV (rows grouped by rank, in run order); returns the text too.

    Columns the table never uses (b_microbatch/b_chunk without FB, peer without send/recv) are left out.
    """
    rows = [a for acts in schedule.actions for a in acts]
    cols = list(COLUMNS[:4])
    if any(a.kind == "FB" for a in rows):
        cols += ["b_microbatch", "b_chunk"]
    if any(a.kind in COMM for a in rows):
        cols.append("peer")
    out = io.StringIO()
    name = f" name={schedule.name}" if schedule.name else ""
    out.write(
        f"# fmoe-schedule pp={schedule.pp} microbatches={schedule.microbatches} "
        f"placement={schedule.placement} chunks={schedule.chunks}{name}\n"
    )
    w = csv.writer(out, lineterminator="\n")
    w.writerow(cols)
    idx = [COLUMNS.index(c) for c in cols]
    for rank, acts in enumerate(schedule.actions):
        for a in acts:
            full = (rank, a.kind, a.microbatch, a.chunk, a.b_microbatch, a.b_chunk, a.peer)
            w.writerow(["" if full[i] is None else full[i] for i in idx])
    text = out.getvalue()
    if path is not None:
        Path(path).write_text(text)
    return text


def read_csv(path: str | Path, text: str | None = None) -> Schedule:
    """Parse a table written by ``write_csv`` or by hand. Errors name the file and line.

    ``text`` (optional) is parsed instead of reading ``path``, which then only names the source.
    """
    src = str(path)
    if text is None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ScheduleError(f"{src}: cannot read: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ScheduleError(f"{src}: not a UTF-8 text table (byte {e.start}: {e.reason})") from None
    header: dict[str, str] = {}
    cols: list[str] | None = None
    per_rank: dict[int, list[Action]] = {}
    per_line: dict[int, list[int]] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s:
            continue
        if s.startswith("#"):
            if cols is None:  # key=value words before the column names are the header
                header.update(t.split("=", 1) for t in s[1:].split() if "=" in t)
            continue
        cells = [c.strip() for c in next(csv.reader([s]))]
        where = f"{src} line {lineno}"
        if cols is None:  # step 1: the column row, then the header it closes
            cols = _column_row(cells, where)
            pp, mbs, placement, chunks = _parse_header(header, src)
            continue
        rank, action = _parse_row(cells, cols, pp, where)  # step 2: every other line is a row
        per_rank.setdefault(rank, []).append(action)
        per_line.setdefault(rank, []).append(lineno)
    if cols is None:
        raise ScheduleError(f"{src}: no column row (expected {','.join(COLUMNS)})")
    return Schedule(
        pp,
        mbs,
        placement,
        chunks,
        tuple(tuple(per_rank.get(r, ())) for r in range(pp)),
        name=header.get("name", ""),
        lines=tuple(tuple(per_line.get(r, ())) for r in range(pp)),
        source=src,
    )


def _column_row(cells: list[str], where: str) -> list[str]:
    """The column names (lower case) of the column row, which must name the first four of ``COLUMNS``."""
    cols = [c.lower() for c in cells]
    missing = [c for c in COLUMNS[:4] if c not in cols]
    unknown = [c for c in cols if c not in COLUMNS]
    if missing or unknown:
        what = (
            f"lacks column(s) {', '.join(missing)}"
            if missing
            else f"has unknown column(s) {', '.join(unknown)}"
        )
        raise ScheduleError(f"{where}: the column row {what}; columns are {', '.join(COLUMNS)}")
    return cols


def _parse_row(cells: list[str], cols: list[str], pp: int, where: str) -> tuple[int, Action]:
    """(rank, action) of one row; ``where`` ("<file> line <n>") starts its error messages."""
    if len(cells) > len(cols):
        raise ScheduleError(f"{where}: {len(cells)} cells, the column row names {len(cols)}")
    row = dict(zip(cols, cells))
    kind = row["action"].upper()
    if kind not in KINDS:
        raise ScheduleError(f"{where}: action {row['action']!r} is not one of {', '.join(KINDS)}")
    vals: dict[str, int | None] = {}
    for c in ("rank", "microbatch", "chunk", "b_microbatch", "b_chunk", "peer"):
        v = row.get(c, "")
        need = (
            c in ("rank", "microbatch", "chunk")
            or (kind == "FB" and c.startswith("b_"))
            or (kind in COMM and c == "peer")
        )
        if v == "":
            if need:
                raise ScheduleError(f"{where}: {kind} needs a value in column {c}")
            vals[c] = None
            continue
        try:
            vals[c] = int(v)
        except ValueError:
            raise ScheduleError(f"{where}: column {c} must be an integer, got {v!r}") from None
    rank = vals.pop("rank")
    if not 0 <= rank < pp:
        raise ScheduleError(f"{where}: rank {rank} outside 0..{pp - 1} (pp={pp})")
    return rank, Action(kind, **vals)


def _parse_header(header: dict[str, str], src: str) -> tuple[int, int, str, int]:
    for key in ("pp", "microbatches", "placement"):
        if key not in header:
            raise ScheduleError(
                f"{src}: the header lacks {key}=; start the file with a line like "
                "'# fmoe-schedule pp=4 microbatches=8 placement=loop chunks=1'"
            )
    placement = header["placement"]
    out = []
    for key, default in (("pp", None), ("microbatches", None), ("chunks", 1 if placement == "loop" else 2)):
        v = header.get(key, default)
        try:
            out.append(int(v))
        except ValueError:
            raise ScheduleError(f"{src}: header {key}={v!r} is not an integer") from None
    return out[0], out[1], placement, out[2]
