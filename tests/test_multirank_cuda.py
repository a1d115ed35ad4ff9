"""The multi-rank paths on CUDA tensors: 2 and 4 ranks sharing one GPU over gloo, each case against
the one-process run on the same device (computed in each rank's own process, so both sides run the
same kernels).

Marked ``cuda``. On a GPU machine (NCCL refuses two ranks on one device; gloo moves CUDA tensors
for the collectives, and the pipeline's sends are staged through pinned host memory, ``fmoe.p2p``):

    TRITON_INTERPRET=0 python3 -m pytest -m cuda -q tests/test_multirank_cuda.py

``FMOE_TEST_DEVICE=cpu`` runs the same cases on CPU tensors (what a machine without a GPU checks).
The ranks run float32 with TF32 off and the math attention backend, so every kernel is
deterministic and a difference is the parallel path's. One DualPipeV run queues every staged copy
behind a sleep on the copy stream: its results are still bitwise only if each consumer waits for
its copy's event (and each send for its copy to the host).

Tolerances. float32 rounds by u = 2^-24. Where the ranks run the one-process run's kernels on the
same shapes (pp: each micro-batch's stages whole on one rank), the loss is bitwise the reference's
(its terms are formed in the same order; the CPU tests claim the same) and a gradient differs only
by the order its per-micro-batch parts are summed: 4 micro-batches, and a merged expert W over up to
64 rows (K in one GEMM instead of several), so at most 64 roundings of u = 3.8e-6 per element:
``SAME_SHAPES_RTOL`` 1e-5. Where a rank's GEMMs see other shapes than the reference's (ep: an
expert's rows from both ranks; cp: half sequences; dp: the mean over ranks), cuBLAS may block a sum
differently: each GEMM output within K u (K <= 64 here) of the exact sum, along a chain of at most
16 GEMMs from the loss to a weight: 16 x 64 x u = 6e-5, so ``RESHAPED_RTOL`` 1e-4 on the gradients
and 1e-5 on the loss (8 GEMMs deep). bf16 (u = 2^-9) and FP8 runs compare to their own one-process
run: the same kernels, gradients summed over 4 micro-batches in bf16 in another order,
4 x 2^-9 = 8e-3 -> ``BF16_RTOL`` 1e-2. Under FP8 the one-process run merges each expert's weight
gradient over the micro-batches into one GEMM whose operands are quantized in other blocks than the
pipeline's per-micro-batch GEMMs: each is within sqrt(2/3) 2^-4 (rms, relative) of the exact product
(tests/test_fp8_training.py's GEMM_RMS), so the two within twice that: ``FP8_RTOL``.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import random_batch, relative_error, tiny_config

from fmoe import checkpoint, interpreter, parallel, pipeline, runner, sharding
from fmoe import dist as D
from fmoe import recipe as R
from fmoe.mesh import build_mesh
from fmoe.schedules.generators import generate
from fmoe.stages import qwen3_moe
from fmoe.stages.primitives import fp8_training

DEVICE = os.environ.get("FMOE_TEST_DEVICE", "cuda")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SAME_SHAPES_RTOL = 1e-5
RESHAPED_RTOL = 1e-4
RESHAPED_LOSS_RTOL = 1e-5
BF16_RTOL = 1e-2
FP8_RTOL = 2 * math.sqrt(2 / 3) * 2**-4
MB = 4  # micro-batches per pipeline step (DualPipeV at pp = 2 needs >= 4)
SEQ = 8


@pytest.fixture(scope="module", autouse=True)
def rank_environment():
    """The spawned ranks' kernels: compiled Triton on the GPU (conftest defaults the interpreter on
    for this process), the torch kernels on the CPU (interpreted Triton would only be slower)."""
    with pytest.MonkeyPatch.context() as mp:
        if DEVICE == "cuda":
            mp.setenv("TRITON_INTERPRET", "0")
        else:
            mp.setenv("FMOE_KERNEL_BACKEND", "torch")
        yield


@contextlib.contextmanager
def deterministic(device: str, math_attention: bool = True):
    """float32 without TF32 and the math attention backend (as tests/test_memory_policy_cuda.py)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU (fmoe.dist.local_device's mapping)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    with sdpa_kernel([SDPBackend.MATH]) if math_attention else contextlib.nullcontext():
        yield


def on(batch: dict, device: str) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def worst(grads: dict, ref: dict) -> float:
    return max(relative_error(g.float(), ref[n].float()) for n, g in grads.items())


def loss_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return abs(a.item() - b.item()) / abs(b.item())


# ------------------------------------------------------------------------------------------------
# the ranks' work: every case of a world size in one spawn (a CUDA process costs seconds to start)


def pipeline_case(device: str, name: str, dtype=None, fp8: bool = False) -> dict:
    """pp = 2 (the world) through the interpreter against run_sequential on this rank's device."""
    if fp8:  # FP8 GEMMs need dims that are multiples of 128; head_dim 128 as tests/test_cuda.py's
        cfg = tiny_config(vocab_size=264, hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
                          head_dim=128, num_experts=4, moe_intermediate_size=128, num_hidden_layers=2)  # fmt: skip
    else:
        cfg = tiny_config(num_hidden_layers=4, mlp_only_layers=(0,), router_aux_loss_coef=0.01)
    model = qwen3_moe.build(cfg)
    params = model.init(seed=1, device=device)
    if dtype is not None:
        params = {n: t.to(dtype) for n, t in params.items()}
    batch = on(random_batch(cfg, MB, SEQ, seed=5), device)
    schedule = generate(name, 2, MB)
    names = pipeline.local_param_names(model, schedule, rank=torch.distributed.get_rank())
    with fp8_training(fp8):
        ref = runner.run_sequential(model, params, batch, MB)
        got = interpreter.pipeline_step(schedule, model, {n: params[n] for n in names}, batch)
    # FP8 GEMMs ran: the loss is not the one of the same step in the compute dtype
    ran_fp8 = fp8 and not torch.equal(runner.run_sequential(model, params, batch, MB).loss, ref.loss)
    return {
        "ran_fp8": ran_fp8,
        # the pipeline forms the loss on the host (``interpreter._finish_loss``), the sequential
        # runner on the device: the same adds in the same order (``runner.mean_loss``)
        "loss_equal": torch.equal(got.loss.cpu(), ref.loss.cpu()),
        "loss_rel": loss_rel(got.loss, ref.loss),
        "worst_rel": worst(got.grads, ref.grads),
        "same_names": sorted(got.grads) == sorted(names),
        "devices": sorted({str(g.device) for g in got.grads.values()}),
    }


def mesh_case(device: str, sizes: tuple, schedule_name: str | None = None, dtype=None) -> dict:
    """``parallel.parallel_step`` on the mesh ``sizes`` with per-unit gathers and whole-step ones,
    against run_sequential over the whole batch (dp x ep x MB micro-batches) on the parameters
    cast to ``dtype`` (the step's compute dtype; None: float32)."""
    pp, dp, cp, ep = sizes
    cfg = tiny_config(num_hidden_layers=4, mlp_only_layers=(0,), router_aux_loss_coef=0.01)
    model = qwen3_moe.build(cfg)
    batch = on(random_batch(cfg, dp * ep * MB, SEQ, seed=11), device)
    mesh = build_mesh(pp, dp, cp, ep)
    shapes = qwen3_moe.param_shapes(cfg)
    schedule = generate(schedule_name, pp, MB) if pp > 1 else None
    names = pipeline.local_param_names(model, schedule, rank=mesh.coords["pp"]) if pp > 1 else list(shapes)
    infos = sharding.layout(model, mesh, shapes, names)
    full = model.init(seed=3, device=device)
    shards = sharding.shard_canonical(full, infos, mesh)
    step = {
        g: parallel.parallel_step(
            model, shards, infos, batch, MB, mesh, schedule=schedule, gather=g, dtype=dtype
        )
        for g in ("chunk", "step")
    }
    cast = full if dtype is None else {n: t.to(dtype) for n, t in full.items()}
    ref = runner.run_sequential(model, cast, batch, dp * ep * MB)
    grads = sharding.canonical(step["chunk"].grad_shards, infos, mesh, list(shapes))
    chunk, whole = step["chunk"], step["step"]
    return {
        "gathers_bitwise": torch.equal(chunk.loss, whole.loss)
        and all(torch.equal(chunk.grad_shards[n], whole.grad_shards[n]) for n in infos),
        "loss_rel": loss_rel(chunk.loss, ref.loss),
        "worst_rel": None if grads is None else worst(grads, {n: g.cpu() for n, g in ref.grads.items()}),
        "devices": sorted({str(g.device) for g in chunk.grad_shards.values()}),
    }


@contextlib.contextmanager
def copies_held_back(device: str):
    """Every staged copy (both ways) queued behind a ~25 ms sleep on the copy stream: a consumer
    that did not wait for a copy's event would read memory the copy has not written yet."""
    from fmoe import p2p

    if device != "cuda":
        yield
        return
    real = p2p.Staged.post, p2p.Staged.landed

    def held(fn):
        def run(self, *args):
            with torch.cuda.stream(self.copies):
                torch.cuda._sleep(50_000_000)
            return fn(self, *args)

        return run

    p2p.Staged.post, p2p.Staged.landed = held(real[0]), held(real[1])
    try:
        yield
    finally:
        p2p.Staged.post, p2p.Staged.landed = real


def two_rank_worker(rank, world, group, device):
    with deterministic(device):
        out = {name: pipeline_case(device, name) for name in ("1f1b", "zbv", "dualpipev")}
        with copies_held_back(device):
            out["dualpipev-held-copies"] = pipeline_case(device, "dualpipev")
        out["dualpipev-bf16"] = pipeline_case(device, "dualpipev", dtype=torch.bfloat16)
        out["dp2"] = mesh_case(device, (1, 2, 1, 1))
        out["dp2-bf16"] = mesh_case(device, (1, 2, 1, 1), dtype=torch.bfloat16)
        out["ep2"] = mesh_case(device, (1, 1, 1, 2))
        out["cp2"] = mesh_case(device, (1, 1, 2, 1))
    # FP8 with the math attention backend fails in one process too (the q/k/v projections' FP8
    # backward is handed a transposed gradient): the default backends here, compared to their own run
    with deterministic(device, math_attention=False):
        out["1f1b-fp8"] = pipeline_case(device, "1f1b", dtype=torch.bfloat16, fp8=True)
    return out


def four_rank_worker(rank, world, group, device):
    with deterministic(device):
        return {"pp2-ep2": mesh_case(device, (2, 1, 1, 2), "dualpipev")}


def spawned(worker, world: int) -> list[dict]:
    results = D.spawn(worker, world, (DEVICE,), timeout_s=240)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}"
    return [r.value for r in results]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawned(two_rank_worker, 2)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return spawned(four_rank_worker, 4)


# ------------------------------------------------------------------------------------------------
# the claims


@pytest.mark.parametrize("name", ["1f1b", "zbv", "dualpipev", "dualpipev-held-copies"])
def test_pp2_loss_is_bitwise_the_one_process_run_and_grads_match(two_ranks, name):
    for rank, value in enumerate(two_ranks):
        case = value[name]
        assert case["loss_equal"], f"rank {rank}: loss off by {case['loss_rel']:.3g} relative"
        assert case["same_names"], f"rank {rank} returned gradients for other parameters than it holds"
        assert case["worst_rel"] <= SAME_SHAPES_RTOL, (rank, case["worst_rel"])
        assert case["devices"] == [f"{DEVICE}:0" if DEVICE == "cuda" else "cpu"], case["devices"]


@pytest.mark.parametrize("name", ["dualpipev-bf16", "1f1b-fp8"])
def test_pp2_in_bf16_and_fp8_matches_its_one_process_run(two_ranks, name):
    for rank, value in enumerate(two_ranks):
        case = value[name]
        # F runs the same kernels on the same rows: the loss is one summation order away
        assert case["loss_rel"] <= BF16_RTOL / 8, (rank, case["loss_rel"])
        bound = FP8_RTOL if name.endswith("fp8") else BF16_RTOL
        assert case["worst_rel"] <= bound, (rank, case["worst_rel"])
        assert case["ran_fp8"] == name.endswith("fp8"), rank


@pytest.mark.parametrize("name", ["dp2", "ep2", "cp2"])
def test_two_ranks_match_the_one_process_run_and_per_unit_gathers_are_bitwise_the_whole_step(two_ranks, name):
    for rank, value in enumerate(two_ranks):
        case = value[name]
        assert case["gathers_bitwise"], f"rank {rank}: per-unit gathers differ from the whole step's"
        assert case["loss_rel"] <= RESHAPED_LOSS_RTOL, (rank, case["loss_rel"])
        assert all(d.startswith(DEVICE) for d in case["devices"]), case["devices"]
    assert two_ranks[0][name]["worst_rel"] <= RESHAPED_RTOL, two_ranks[0][name]["worst_rel"]


def test_dp2_in_bf16_matches_the_one_process_run_and_per_unit_gathers_are_bitwise(two_ranks):
    # each rank runs the reference's micro-batches on the same shapes: the forward is the same, the
    # loss one bf16-sized rounding of the mean away at most; gradients summed in fp32 over the ranks
    # against bf16 over every micro-batch in the reference (BF16_RTOL)
    for rank, value in enumerate(two_ranks):
        case = value["dp2-bf16"]
        assert case["gathers_bitwise"], f"rank {rank}: per-unit gathers differ from the whole step's"
        assert case["loss_rel"] <= 2**-8, (rank, case["loss_rel"])
    assert two_ranks[0]["dp2-bf16"]["worst_rel"] <= BF16_RTOL, two_ranks[0]["dp2-bf16"]["worst_rel"]


def test_pp2_by_ep2_on_four_ranks_matches_the_one_process_run(four_ranks):
    for rank, value in enumerate(four_ranks):
        case = value["pp2-ep2"]
        assert case["gathers_bitwise"], f"rank {rank}: per-unit gathers differ from the whole step's"
        assert case["loss_rel"] <= RESHAPED_LOSS_RTOL, (rank, case["loss_rel"])
    assert four_ranks[0]["pp2-ep2"]["worst_rel"] <= RESHAPED_RTOL, four_ranks[0]["pp2-ep2"]["worst_rel"]


# ------------------------------------------------------------------------------------------------
# a sharded checkpoint saved by GPU ranks, resumed on the CPU, and back


def ckpt_recipe(root: Path, dataset: str, device: str, dp: int) -> dict:
    from test_train import recipe_dict

    # one sequence per micro-batch at both sizes, so every step's arithmetic is the same per sequence
    return recipe_dict(
        root, dataset,
        train={"steps": 6, "global_batch": 8, "microbatches": 8 // dp, "device": device},
        parallel={"dp": dp, "backend": "gloo"},
        checkpoint={"every": 100, "keep": 3},
    )  # fmt: skip


def train_worker(rank, world, group, device, recipes: list, stop_after):
    from fmoe.train import train

    with deterministic(device):
        out = []
        for data, stop in zip(recipes, stop_after):
            result = train(R.from_dict(data), stop_after=stop)
            params = {n: t.cpu() for n, t in result.params.items()} if rank == 0 else None
            out.append({"losses": result.losses, "step": result.step, "params": params})
        return out


def test_a_sharded_checkpoint_saved_on_gpu_ranks_resumes_on_the_cpu_and_back(tmp_path, dataset):
    from fmoe.train import train

    unbroken = ckpt_recipe(tmp_path / "unbroken", dataset, DEVICE, 2)
    moved = ckpt_recipe(tmp_path / "moved", dataset, DEVICE, 2)
    results = D.spawn(train_worker, 2, (DEVICE, [unbroken, moved], [None, 2]), timeout_s=240)
    assert all(r.ok for r in results), [(r.error, r.traceback) for r in results]
    straight, first = results[0].value
    assert first["step"] == 2
    saved = checkpoint.latest(tmp_path / "moved" / "ckpt")
    params, _, _ = checkpoint.load(saved)  # on the CPU: the GPU ranks' masters, bit for bit
    assert all(torch.equal(params[n], p) for n, p in first["params"].items())
    on_cpu = train(R.from_dict(ckpt_recipe(tmp_path / "moved", dataset, "cpu", 1)), stop_after=2)
    assert on_cpu.step == 4
    back = D.spawn(train_worker, 2, (DEVICE, [moved], [None]), timeout_s=240)
    assert all(r.ok for r in back), [(r.error, r.traceback) for r in back]
    (last,) = back[0].value
    assert last["step"] == 6
    losses = first["losses"] + on_cpu.losses + last["losses"]
    # CPU and GPU kernels round differently (a few u = 2^-24 per GEMM, see RESHAPED_RTOL); AdamW
    # normalises each update, so over six steps the relative difference stays of that order
    assert all(abs(a - b) <= RESHAPED_RTOL * abs(b) for a, b in zip(losses, straight["losses"], strict=True))
    for n, p in straight["params"].items():
        assert relative_error(last["params"][n], p) <= RESHAPED_RTOL, n
