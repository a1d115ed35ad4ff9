"""Bytes a CPU run keeps under each memory policy, measured in a process of their own (its C
allocator returns every block of 64 KiB or more, so freed memory leaves the resident set at once).

Shared by tests/test_memory_policy.py (recompute and the merge window keep less) and
tests/test_plan_policy.py (the plan follows these figures). ``measure()`` runs this file as a child:

  none / selective / full   bytes held after F of one micro-batch ([2, 1024] tokens) through every
                            stage, before its B, under that recompute mode
  window 0 / window 1       the peak of a step of 8 micro-batches ([1, 512] each) at that merge window
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = dict(num_hidden_layers=2, mlp_only_layers=(), hidden_size=64, moe_intermediate_size=256,
              num_experts=4, num_experts_per_tok=2)  # fmt: skip
FORWARD_BATCH = (2, 1024)  # [b, s] of the micro-batch whose F is measured
STEP_BATCH, STEP_MICROBATCHES = (8, 512), 8  # the step measured per merge window


def measure() -> dict[str, int]:
    """{"none" | "selective" | "full" | "window 0" | "window 1": bytes}, from a child process."""
    from conftest import MEASURING_ENV

    env = dict(os.environ, **MEASURING_ENV, PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def _child() -> dict[str, int]:
    import torch
    from conftest import random_batch, tiny_config

    from fmoe import memory, runner
    from fmoe.memory_policy import MemoryPolicy
    from fmoe.stages import qwen3_moe
    from fmoe.stages.spec import StageContext

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    cfg = tiny_config(**CONFIG)
    model = qwen3_moe.build(cfg)
    params = model.init(seed=1)
    out = {}
    # the first pass of each part (unmeasured) makes what a process allocates once
    for mode in ("warm-up", "none", "selective", "full"):
        batch = runner.with_positions(random_batch(cfg, *FORWARD_BATCH, seed=5))
        policy, terms = MemoryPolicy(recompute=mode.replace("warm-up", "none")), runner.LossTerms(model)
        base = memory.reset_peak(cpu)
        carry, fwds = (), []
        for i, stage in enumerate(model.stages):
            carry, fwd = runner.forward_stage(
                0, i, stage, params, carry, batch, StageContext(), terms, memory=policy
            )
            fwds.append(fwd)
        out[mode] = memory.current_bytes(cpu) - base
        del fwds, carry
    for window in ("warm-up", 0, 1):
        batch = random_batch(cfg, *STEP_BATCH, seed=5)
        base = memory.reset_peak(cpu)
        policy = MemoryPolicy(merge_window=0 if window == "warm-up" else window)
        runner.run_sequential(model, params, batch, STEP_MICROBATCHES, memory=policy)
        out[f"window {window}"] = memory.peak_bytes(cpu) - base
    del out["warm-up"], out["window warm-up"]
    return out


if __name__ == "__main__":
    print(json.dumps(_child()))
