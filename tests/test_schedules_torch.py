"""Our tables against torch.distributed.pipelining's own per-rank action lists (no process group).

torch builds each rank's compute order in plain Python (``_get_pipeline_order`` /
``_calculate_single_rank_operations``); we build those objects without ``__init__`` (which needs
stages and a process group) and compare the compute order rank by rank, in stage numbers.
"""

import pytest
import torch.distributed.pipelining.schedules as tps

from fmoe.schedules.generators import generate
from fmoe.schedules.table import Action, Schedule, ScheduleError, stage_of
from fmoe.schedules.verify import validate

PP, M = 4, 10
# torch's names: F forward, I input backward, W weight backward, B full backward
KIND = {"F": "F", "I": "B", "W": "W", "B": "BW"}


def torch_schedule(cls, **attrs):
    obj = object.__new__(cls)
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


def from_torch(actions) -> list[tuple]:
    """(kind, microbatch, stage) per compute action; FB as (FB, mb, stage, b_mb, b_stage)."""
    out = []
    for a in actions:
        if a is None or a.computation_type == tps.REDUCE_GRAD:
            continue
        if a.computation_type == tps.OVERLAP_F_B:
            f, b = a.sub_actions
            assert (f.computation_type, b.computation_type) == (tps.FORWARD, tps.FULL_BACKWARD)
            out.append(("FB", f.microbatch_index, f.stage_index, b.microbatch_index, b.stage_index))
        else:
            out.append((KIND[a.computation_type.value], a.microbatch_index, a.stage_index))
    return out


def ours(s, r) -> list[tuple]:
    out = []
    for a in s.actions[r]:
        st = stage_of(s.placement, s.pp, r, a.chunk)
        if a.kind == "FB":
            out.append(("FB", a.microbatch, st, a.b_microbatch, stage_of(s.placement, s.pp, r, a.b_chunk)))
        else:
            out.append((a.kind, a.microbatch, st))
    return out


def test_zbv_matches_torch_per_rank():
    t = torch_schedule(tps.ScheduleZBVZeroBubble, pp_group_size=PP, _n_microbatches=M, num_stages=2 * PP)
    s = generate("zbv", PP, M)
    for r in range(PP):
        assert ours(s, r) == from_torch(t._calculate_single_rank_operations(r)), f"rank {r}"


def test_dualpipev_matches_torch_per_rank():
    t = torch_schedule(tps.ScheduleDualPipeV, pp_group_size=PP, _n_microbatches=M, num_stages=2 * PP)
    s = generate("dualpipev", PP, M)
    for r in range(PP):
        theirs = from_torch(t._calculate_single_rank_operations(r))
        assert ours(s, r) == theirs, f"rank {r}"
        assert any(x[0] == "FB" for x in theirs)  # the comparison covers the overlapped pairs


def test_1f1b_matches_torch_except_torchs_last_rank_numbering():
    """torch's ``Schedule1F1B._get_pipeline_order`` (its dry-run/visualisation order) numbers the last
    rank's forwards from 1: it lists F1..F10 where we list F0..F9, and F10 does not exist for 10
    microbatches (its forward loop increments the counter before the first forward when there is no
    warm-up). Ranks 0..pp-2 are identical; on the last rank ours is theirs with forward numbers minus
    one. Read as a table, theirs fails validation (the last rank's BW0 precedes F0, and F10 is out of range)."""
    order = torch_schedule(tps.Schedule1F1B, _num_stages=PP, _n_microbatches=M)._get_pipeline_order()
    s = generate("1f1b", PP, M)
    for r in range(PP - 1):
        assert ours(s, r) == from_torch(order[r]), f"rank {r}"
    theirs = from_torch(order[PP - 1])
    shifted = [(k, mb - 1 if k == "F" else mb, st) for k, mb, st in theirs]
    assert ours(s, PP - 1) == shifted
    assert ("F", M, PP - 1) in theirs
    as_table = [tuple(Action(k, mb, 0) for k, mb, _ in from_torch(order[r])) for r in range(PP)]
    # as a table theirs is rejected: the last rank's first backward has no forward before it
    with pytest.raises(
        ScheduleError, match=rf"rank {PP - 1} row 1: BW\(mb=0, chunk=0\): it comes before the F"
    ):
        validate(Schedule(PP, M, "loop", 1, tuple(as_table)))


@pytest.mark.parametrize("pp,m", [(4, 10), (4, 8), (2, 20), (8, 20)])
def test_interleaved_1f1b_and_zb_h1_match_torch(pp, m):
    per = m // max(1, m // pp)  # torch's microbatches per round
    inter = torch_schedule(
        tps.ScheduleInterleaved1F1B,
        pp_group_size=pp,
        _n_microbatches=m,
        n_local_stages=2,
        microbatches_per_round=per,
    )
    zb = torch_schedule(
        tps.ScheduleInterleavedZeroBubble,
        pp_group_size=pp,
        _n_microbatches=m,
        n_local_stages=1,
        microbatches_per_round=per,
    )
    s_inter, s_zb = generate("interleaved-1f1b", pp, m), generate("zb-h1", pp, m)
    for r in range(pp):
        assert ours(s_inter, r) == from_torch(inter._calculate_single_rank_operations(r)), f"rank {r}"
        # torch's interleaved zero bubble with one stage per rank is ZB-H1
        assert ours(s_zb, r) == from_torch(zb._calculate_single_rank_operations(r)), f"rank {r}"
