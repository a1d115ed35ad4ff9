"""Pipeline schedules as tables: format, generators, validator, simulator, rendering.

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

from .generators import GENERATORS, generate
from .simulator import Costs, SimResult, simulate
from .table import (
    COMM,
    COMPUTE,
    KINDS,
    PLACEMENTS,
    Action,
    Schedule,
    ScheduleError,
    copy_of,
    locate,
    microbatch_copy,
    num_stages,
    read_csv,
    stage_of,
    write_csv,
)
from .verify import lower, validate

__all__ = [
    "COMM",
    "COMPUTE",
    "GENERATORS",
    "KINDS",
    "PLACEMENTS",
    "Action",
    "Costs",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "copy_of",
    "generate",
    "locate",
    "lower",
    "microbatch_copy",
    "num_stages",
    "read_csv",
    "simulate",
    "stage_of",
    "validate",
    "write_csv",
]
