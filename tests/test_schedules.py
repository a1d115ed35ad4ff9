"""Schedule tables: generators validate, the simulator reproduces the published figures, bad tables are named."""

import random
from pathlib import Path

import pytest

from fmoe.schedules.generators import GENERATORS, generate
from fmoe.schedules.simulator import Costs, simulate
from fmoe.schedules.table import (
    COMM,
    Action,
    Schedule,
    ScheduleError,
    copy_of,
    microbatch_copy,
    num_stages,
    read_csv,
    stage_of,
    write_csv,
)
from fmoe.schedules.verify import lower, validate

SCHEDULE_DIR = Path(__file__).resolve().parents[1] / "fmoe" / "schedules"


def allowed(name: str, pp: int, m: int) -> bool:
    """The sizes each published schedule is defined for."""
    if name == "dualpipev":
        return m >= 2 * pp
    if name == "dualpipe":
        return pp % 2 == 0 and m % 2 == 0 and m >= 2 * pp
    if name == "interleaved-1f1b":
        return m % max(1, m // pp) == 0
    return True


def blocking_run_finishes(s: Schedule) -> bool:
    """An independent, naive run of a lowered table with rendezvous send/recv: step every rank whose
    next row is compute, or whose SEND faces the peer's matching RECV; stop when nothing moves."""
    ptr = [0] * s.pp
    moved = True
    while moved:
        moved = False
        for r in range(s.pp):
            while ptr[r] < len(s.actions[r]):
                a = s.actions[r][ptr[r]]
                if a.kind not in COMM:
                    ptr[r] += 1
                    moved = True
                    continue
                if not a.kind.startswith("SEND"):
                    break  # a RECV moves together with its SEND
                q = a.peer
                b = s.actions[q][ptr[q]] if ptr[q] < len(s.actions[q]) else None
                if b is None or b.kind != "RECV" + a.kind[4:] or b.peer != r or b.microbatch != a.microbatch:
                    break
                ptr[r] += 1
                ptr[q] += 1
                moved = True
    return all(p == len(acts) for p, acts in zip(ptr, s.actions))


@pytest.mark.parametrize("name", list(GENERATORS))
@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("which", ["pp", "2pp", "20"])
def test_every_generator_validates_lowers_and_runs_blocking(name, pp, which):
    m = {"pp": pp, "2pp": 2 * pp, "20": 20}[which]
    if not allowed(name, pp, m):
        with pytest.raises(ScheduleError, match="microbatches"):
            generate(name, pp, m)
        return
    s = generate(name, pp, m)
    validate(s)
    low = lower(s)
    validate(low)
    assert lower(low) is low  # idempotent on a lowered table
    assert blocking_run_finishes(low)
    for r in range(pp):
        # lowering only adds transfers, and puts each SEND after its producer with no compute between
        assert [a for a in low.actions[r] if a.kind not in COMM] == list(s.actions[r])
        last = None
        for a in low.actions[r]:
            if a.kind not in COMM:
                last = a
            elif a.kind.startswith("SEND"):
                made = {(last.microbatch, last.chunk)} if last.kind in ("F", "B", "BW") else set()
                if last.kind == "FB":
                    made = {(last.microbatch, last.chunk), (last.b_microbatch, last.b_chunk)}
                assert (a.microbatch, a.chunk) in made
    assert simulate(low) == simulate(s)  # transfers are asynchronous in the cost model


def test_too_few_microbatches_is_a_clear_error():
    with pytest.raises(
        ScheduleError, match=r"dualpipev: needs microbatches >= 2 \* pp, got microbatches=7, pp=4"
    ):
        generate("dualpipev", 4, 7)
    with pytest.raises(ScheduleError, match="dualpipe: needs an even number of microbatches >= 2 \\* pp"):
        generate("dualpipe", 4, 6)
    with pytest.raises(ScheduleError, match="dualpipe: needs an even pp"):
        generate("dualpipe", 3, 12)
    with pytest.raises(ScheduleError, match="multiple of the 2 rounds"):
        generate("interleaved-1f1b", 4, 9)
    with pytest.raises(ScheduleError, match="unknown schedule 'zb2'"):
        generate("zb2", 4, 8)
    with pytest.raises(ScheduleError, match="unknown option"):
        generate("1f1b", 4, 8, chunks=2)


def test_stage_placement_and_copies():
    assert [stage_of("loop", 4, r, c) for c in (0, 1) for r in range(4)] == list(range(8))
    assert [stage_of("v", 4, r, 0) for r in range(4)] == [0, 1, 2, 3]
    assert [stage_of("v", 4, r, 1) for r in range(4)] == [7, 6, 5, 4]
    assert [stage_of("bidir", 4, r, 1) for r in range(4)] == [3, 2, 1, 0]
    s = generate("dualpipe", 4, 8)
    assert num_stages(s) == 4 and num_stages(generate("dualpipev", 4, 8)) == 8
    assert copy_of("bidir", 1) == 1 and copy_of("v", 1) == 0
    assert [microbatch_copy(s, m) for m in range(8)] == [0] * 4 + [1] * 4
    # every microbatch of copy 1 enters at rank pp-1: its F there is on stage 0
    assert all(
        stage_of("bidir", 4, 3, a.chunk) == 0 for a in s.actions[3] if a.kind == "F" and a.microbatch >= 4
    )


# --- the published figures (DeepSeek-V3 report, table 2; REFERENCES.md) --------------------------
# There B is the *full* backward (our B + W) and F&B an overlapped pair (our FB); "bubble" is idle time.

ZB_COSTS = [(1.0, 1.0, 1.0), (1.0, 1.3, 0.7), (1.5, 2.0, 0.5), (1.0, 1.0, 0.25)]  # (F, B, W), W <= F, B


@pytest.mark.parametrize("pp", [4, 8])
@pytest.mark.parametrize("m", [16, 20, 33])
@pytest.mark.parametrize("f,b,w", ZB_COSTS)
def test_1f1b_and_zb1p_bubble_and_activations_match_published(pp, m, f, b, w):
    costs = Costs(f=f, b=b, w=w)
    one = simulate(generate("1f1b", pp, m), costs)
    # 1F1B: bubble (PP-1)(F+B) with B the full backward, on every rank; activations PP; params 1x
    assert one.idle == pytest.approx([(pp - 1) * (f + b + w)] * pp)
    assert max(one.peak_activations) == pp and one.param_copies == (1.0,) * pp
    zb = simulate(generate("zb-h1", pp, m), costs)
    # ZB1P (= ZB-H1): (PP-1)(F+B-2W) with B full, i.e. (pp-1)(F + B_input - W); needs W <= F, B (the paper's)
    assert zb.idle == pytest.approx([(pp - 1) * (f + (b + w) - 2 * w)] * pp)
    assert zb.peak_activations == (pp,) * pp and zb.param_copies == (1.0,) * pp


DUAL_COSTS = [
    (1.0, 1.0, 3.0),
    (1.0, 1.0, 2.0),
    (1.0, 0.5, 2.0),
    (1.0, 0.5, 2.5),
    (1.0, 0.25, 1.75),
    (2.0, 1.0, 4.5),
]


@pytest.mark.parametrize("pp", [4, 8])
@pytest.mark.parametrize("m", [0, 20, 32])
@pytest.mark.parametrize("f,w,fb", DUAL_COSTS)
def test_dualpipe_and_dualpipev_bubble_and_activations_match_published(pp, m, f, w, fb):
    """Published: DualPipe bubble (PP/2-1)(F&B + B - 3W), activations PP+1, params 2x; DualPipeV the same
    with PP = its 2*pp stages, on pp ranks. Their cost assumptions: F = B (input gradient), W <= B and
    an FB no longer than its halves (F&B <= F + B + W). Then the published bubble is the largest
    per-rank idle time, independent of the microbatch count; with F&B = F + B + W every rank has it."""
    m = m or 2 * pp
    b = f  # the published assumption F = B
    costs = Costs(f=f, b=b, w=w, fb=fb)
    for name, PP in (("dualpipe", pp), ("dualpipev", 2 * pp)):
        s = generate(name, pp, m)
        r = simulate(s, costs)
        published = (PP / 2 - 1) * (fb + (b + w) - 3 * w)
        assert max(r.idle) == pytest.approx(published)
        if fb == f + b + w:
            assert r.idle == pytest.approx([published] * pp)
        assert max(r.peak_activations) == PP + 1
        # params: ours is relative to one model copy over pp ranks; the table's 2x is in units of one
        # of PP stages, so published = ours * num_stages / pp (DualPipe 2 * pp/pp, DualPipeV 1 * 2pp/pp)
        assert r.param_copies[0] * num_stages(s) / pp == 2


def test_dualpipe_bubble_does_not_grow_with_microbatches_but_1f1b_does():
    costs = Costs(f=1, b=1, w=1, fb=2.5)
    dual = [max(simulate(generate("dualpipe", 8, m), costs).idle) for m in (16, 32, 64)]
    one = [simulate(generate("1f1b", 8, m), costs).bubble[0] for m in (16, 32, 64)]
    assert dual[0] == dual[1] == dual[2]
    assert one[0] > one[1] > one[2]  # 1F1B's idle time is fixed, its bubble fraction shrinks only with m
    assert max(simulate(generate("dualpipe", 8, 16), costs).bubble) < one[0]


def test_transfer_time_and_per_stage_costs():
    # one microbatch through pp ranks: pp forwards and full backwards, 2(pp-1) transfers on the path
    r = simulate(generate("1f1b", 4, 1), Costs(f=1, b=2, w=1, transfer=0.5))
    assert r.makespan == pytest.approx(4 * (1 + 3) + 2 * 3 * 0.5)
    r = simulate(generate("1f1b", 4, 8), Costs(f=(1, 1, 2, 1), b=(1, 1, 2, 1), w=0))
    assert r.busy == pytest.approx((16, 16, 32, 16))  # 8 x (F + BW) of each rank's own stage
    with pytest.raises(ScheduleError, match="Costs.f has 3 entries, the schedule has 4 stages"):
        simulate(generate("1f1b", 4, 8), Costs(f=(1, 1, 1)))
    with pytest.raises(ScheduleError, match="Costs.w must be a number >= 0"):
        Costs(w=-1)


# --- hand-edited tables --------------------------------------------------------------------------


def edit(text: str, fn) -> str:
    lines = text.splitlines()
    fn(lines)
    return "\n".join(lines) + "\n"


def test_swapped_rows_so_b_precedes_its_f_is_rejected_naming_the_row(tmp_path):
    text = write_csv(generate("1f1b", 4, 8))
    lines = text.splitlines()
    f = lines.index("3,F,0,0")  # the last rank: F0 then BW0
    assert lines[f + 1] == "3,BW,0,0"

    def swap(ls):
        ls[f], ls[f + 1] = ls[f + 1], ls[f]

    path = tmp_path / "swapped.csv"
    path.write_text(edit(text, swap))
    with pytest.raises(ScheduleError) as e:
        validate(read_csv(path))
    assert e.value.rank == 3 and e.value.row == 0 and e.value.action == Action("BW", 0, 0)
    assert f"rank 3 row 0 ({path} line {f + 1}): BW(mb=0, chunk=0)" in str(e.value)
    assert "comes before the F" in str(e.value)


def test_missing_w_is_rejected_naming_its_b(tmp_path):
    text = write_csv(generate("zb-h1", 4, 8))
    path = tmp_path / "no_w.csv"
    path.write_text(edit(text, lambda ls: ls.remove("2,W,5,0")))
    s = read_csv(path)
    b_row = s.actions[2].index(Action("B", 5, 0))
    with pytest.raises(
        ScheduleError, match=rf"rank 2 row {b_row} \(.* line \d+\): B\(mb=5, chunk=0\): .* has no W"
    ):
        validate(s)


def test_send_without_receive_is_rejected_naming_the_send(tmp_path):
    s = lower(generate("1f1b", 4, 8))
    text = write_csv(s)
    path = tmp_path / "no_recv.csv"
    path.write_text(edit(text, lambda ls: ls.remove("2,RECV_F,3,0,1")))
    t = read_csv(path)
    row = t.actions[1].index(Action("SEND_F", 3, 0, peer=2))
    with pytest.raises(ScheduleError) as e:
        validate(t)
    assert (e.value.rank, e.value.row) == (1, row)
    assert "SEND_F(mb=3, chunk=0, peer=2): no matching receive on rank 2" in str(e.value)


def test_blocking_deadlock_is_rejected_naming_the_stuck_rows():
    s = lower(generate("1f1b", 2, 3))
    r0 = list(s.actions[0])
    i = r0.index(Action("SEND_F", 1, 0, peer=1))
    j = r0.index(Action("RECV_B", 0, 0, peer=1))
    r0.insert(j, r0.pop(i))  # rank 0 now waits for a gradient before sending the activation it needs
    bad = Schedule(2, 3, "loop", 1, (tuple(r0), s.actions[1]))
    with pytest.raises(ScheduleError, match=r"deadlock with blocking send/recv: rank 0 row \d+ RECV_B\(mb=0"):
        validate(bad)
    assert not blocking_run_finishes(bad)


def test_compute_only_deadlock_is_rejected():
    rows0 = (Action("F", 0, 0), Action("BW", 0, 0), Action("F", 1, 0), Action("BW", 1, 0))
    rows1 = (Action("F", 0, 0), Action("F", 1, 0), Action("BW", 0, 0), Action("BW", 1, 0))
    with pytest.raises(
        ScheduleError, match=r"deadlock: rank 0 row 1: BW\(mb=0, chunk=0\) waits for the gradient"
    ):
        validate(Schedule(2, 2, "loop", 1, (rows0, rows1)))


@pytest.mark.parametrize(
    "rows, message",
    [
        ((Action("F", 2, 0),), "microbatch 2 outside 0..1"),
        ((Action("F", 0, 1),), "chunk 1 outside 0..0"),
        ((Action("F", 0, 0), Action("F", 0, 0)), "second F"),
        ((Action("F", 0, 0), Action("SEND_F", 0, 0, peer=0)), "peer must be rank 1"),
        ((Action("F", 0, 0), Action("SEND_B", 0, 0, peer=1)), "no neighbouring stage"),
        ((Action("F", 0, 0), Action("W", 0, 0)), "W(mb=0, chunk=0): comes before the B"),
    ],
)
def test_malformed_rows_are_named(rows, message):
    with pytest.raises(ScheduleError, match="rank 0 row") as e:
        validate(Schedule(2, 2, "loop", 1, (rows, ())))
    assert message in str(e.value)


def test_missing_microbatch_names_its_rank():
    s = generate("1f1b", 2, 2)
    rows1 = tuple(a for a in s.actions[1] if a.microbatch != 1)
    with pytest.raises(ScheduleError, match=r"^rank 1 \(chunk 0\): no row for microbatch 1 stage 1") as e:
        validate(Schedule(2, 2, "loop", 1, (s.actions[0], rows1)))
    assert e.value.rank == 1


# --- the CSV format ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(GENERATORS))
def test_csv_round_trip(name, tmp_path):
    s = generate(name, 4, 8)
    for t in (s, lower(s)):
        path = tmp_path / f"{name}.csv"
        write_csv(t, path)
        assert read_csv(path) == t


def test_shipped_example_tables_are_the_generators_output():
    files = sorted(SCHEDULE_DIR.glob("*.csv"))
    assert len(files) >= 8
    for path in files:
        s = read_csv(path)
        validate(s)
        fresh = generate(s.name, s.pp, s.microbatches)
        assert s == (lower(fresh) if path.stem.endswith("_lowered") else fresh), path.name
        assert path.stem.startswith(f"{s.name}_pp{s.pp}_mb{s.microbatches}")


@pytest.mark.parametrize(
    "text, message",
    [
        ("rank,action,microbatch,chunk\n0,F,0,0\n", "the header lacks pp="),
        ("# pp=2 microbatches=1 placement=loop\nrank,action,microbatch\n", "lacks column(s) chunk"),
        (
            "# pp=2 microbatches=1 placement=loop\nrank,action,microbatch,chunk\n0,X,0,0\n",
            "line 3: action 'X'",
        ),
        (
            "# pp=2 microbatches=1 placement=loop\nrank,action,microbatch,chunk\n5,F,0,0\n",
            "line 3: rank 5 outside",
        ),
        (
            "# pp=2 microbatches=1 placement=loop\nrank,action,microbatch,chunk\n0,F,a,0\n",
            "column microbatch",
        ),
        (
            "# pp=2 microbatches=1 placement=loop\nrank,action,microbatch,chunk\n0,FB,0,0\n",
            "FB needs a value",
        ),
        ("# pp=2 microbatches=1 placement=ring\nrank,action,microbatch,chunk\n", "placement must be one of"),
        (
            "# pp=2 microbatches=3 placement=bidir\nrank,action,microbatch,chunk\n",
            "even number of microbatches",
        ),
    ],
)
def test_malformed_csv_is_named(text, message):
    with pytest.raises(ScheduleError, match="x.csv") as e:
        read_csv("x.csv", text=text)
    assert message in str(e.value)


def test_hand_written_table_with_comments_and_explicit_transfers():
    text = """# fmoe-schedule pp=2 microbatches=1 placement=loop
# a hand-written 2-rank table, transfers spelled out
rank,action,microbatch,chunk,peer
0,F,0,0
0,SEND_F,0,0,1
0,RECV_B,0,0,1
0,B,0,0
0,W,0,0
1,RECV_F,0,0,0

1,F,0,0
1,BW,0,0
1,SEND_B,0,0,0
"""
    s = read_csv("hand.csv", text=text)
    validate(s)
    assert simulate(s, Costs(f=1, b=1, w=1)).makespan == 6  # F F BW(2) B W on the critical path


def test_large_table_validates():
    s = generate("dualpipev", 64, 512)
    validate(s)
    assert sum(map(len, s.actions)) > 64 * 512


@pytest.mark.parametrize("name", list(GENERATORS))
def test_mutated_tables_are_rejected_or_run_blocking(name):
    """Random hand edits (swap two neighbouring rows, drop one, move one) of a lowered table: the
    validator either names a rank for its error, or the independent blocking run finishes."""
    rng = random.Random(0)
    base = lower(generate(name, 4, 8))
    rejected = 0
    for _ in range(60):
        acts = [list(a) for a in base.actions]
        r = rng.randrange(4)
        i = rng.randrange(len(acts[r]) - 1)
        how = rng.randrange(3)
        if how == 0:
            acts[r][i], acts[r][i + 1] = acts[r][i + 1], acts[r][i]
        elif how == 1:
            del acts[r][i]
        else:
            acts[r].insert(rng.randrange(len(acts[r])), acts[r].pop(i))
        t = Schedule(4, 8, base.placement, base.chunks, tuple(map(tuple, acts)))
        try:
            validate(t)
        except ScheduleError as e:
            rejected += 1
            assert e.rank is not None and f"rank {e.rank}" in str(e)
            continue
        assert blocking_run_finishes(t)
    assert rejected > 10  # most edits break something
