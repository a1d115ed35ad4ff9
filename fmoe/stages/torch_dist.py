"""torch.distributed's one-tensor collectives under the names the installed torch gives them.

torch >= 2.13 names them ``all_gather_single`` / ``reduce_scatter_single`` and warns on the old
names; older torch (2.11 on our GPU machine) has only ``all_gather_into_tensor`` /
``reduce_scatter_tensor``. The same operations either way (output, input, group=, async_op=),
named once here for the stages (``fmoe.stages.moe``) and the runtime (``fmoe.dist`` re-exports them).
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]

if hasattr(dist, "all_gather_single"):
    all_gather_single, reduce_scatter_single = dist.all_gather_single, dist.reduce_scatter_single
else:  # torch < 2.13
    all_gather_single, reduce_scatter_single = dist.all_gather_into_tensor, dist.reduce_scatter_tensor
