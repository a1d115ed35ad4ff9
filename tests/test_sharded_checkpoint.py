"""Sharded checkpoints: every rank writes its own pieces, nothing is gathered, and any layout reads
back only the ranges it holds. Multi-process claims run on gloo through ``fmoe.dist.spawn``."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import measuring_env, relative_error, tiny_config
from test_train import recipe_dict

from fmoe import checkpoint, memory, optim, sharding, train, train_state
from fmoe import dist as D
from fmoe import recipe as R
from fmoe.mesh import build_mesh
from fmoe.stages import qwen3_moe

# ------------------------------------------------------------------------------------------------
# resume on other layouts equals an unbroken run

STEPS = 6
SAVE_LAYOUT, RESUME_LAYOUTS = (1, 2, 1, 2), [(1, 4, 1, 1), (2, 1, 1, 2)]


def layout_recipe(tmp: Path, dataset: str, sizes) -> dict:
    """8 sequences a step; every micro-batch holds one sequence on every layout (so the aux losses,
    which are per micro-batch, agree with the 1-process run's 8 micro-batches)."""
    pp, dp, cp, ep = sizes
    return recipe_dict(
        tmp, dataset,
        train={"steps": STEPS, "global_batch": 8, "microbatches": 8 // (dp * ep)},
        parallel={"pp": pp, "dp": dp, "cp": cp, "ep": ep, "schedule": "1f1b"},
    )  # fmt: skip


def _save_then_resume(rank: int, root: Path, dataset: str) -> dict:
    """Train 3 steps on SAVE_LAYOUT, then resume a copy of its checkpoint on each RESUME_LAYOUT."""
    import torch.distributed as dist

    first = train.train(R.from_dict(layout_recipe(root / "saved", dataset, SAVE_LAYOUT)), stop_after=3)
    dist.barrier()
    if rank == 0:
        for i in range(len(RESUME_LAYOUTS)):
            shutil.copytree(root / "saved" / "ckpt", root / f"resumed{i}" / "ckpt")
    dist.barrier()
    out = {"first": first.losses, "files": None, "resumed": []}
    if rank == 0:
        out["files"] = sorted(p.name for p in checkpoint.latest(root / "saved" / "ckpt").iterdir())
    for i, sizes in enumerate(RESUME_LAYOUTS):
        result = train.train(R.from_dict(layout_recipe(root / f"resumed{i}", dataset, sizes)))
        out["resumed"].append({"losses": result.losses, "step": result.step,
                               "params": result.params if rank == 0 else None})  # fmt: skip
    return out


def test_a_checkpoint_saved_sharded_resumes_on_other_layouts_equal_to_an_unbroken_run(job, tmp_path, dataset):
    straight = train.train(R.from_dict(layout_recipe(tmp_path / "straight", dataset, (1, 1, 1, 1))))
    got = job[0]["layouts"]
    # every rank wrote its own files; the pipeline-free (1, 2, 1, 2) layout has 4 distinct shards
    assert got["files"] == sorted(
        ["index.json", "manifest.json", "trainer.json"]
        + [checkpoint.rank_file(k, r) for k in checkpoint.KINDS for r in range(4)]
    )
    # Sums over ranks and micro-batches reorder float32 additions: each gradient differs from the
    # 1-process one by a few ulps (relative ~ terms x eps, at most 8 micro-batches x 4 ranks), and
    # a few AdamW steps carry that into the parameters. 2^7 eps (1.5e-5) bounds it; a resume that
    # restored a wrong slice or no optimizer state is off by 1e-3 or more.
    tol = 2**7 * torch.finfo(torch.float32).eps
    for resumed in got["resumed"]:
        assert resumed["step"] == STEPS
        losses = got["first"] + resumed["losses"]
        assert all(abs(a - b) <= tol * abs(b) for a, b in zip(losses, straight.losses, strict=True))
        for name, p in straight.params.items():
            assert relative_error(resumed["params"][name], p) <= tol, name


# ------------------------------------------------------------------------------------------------
# the one 4-process job behind every multi-process claim here (a spawned process costs seconds to
# start): the layouts above, a refused non-finite save, a checkpoint of the tiny model, and the peak
# memory of saving and loading a larger one

WORLD = 4
# 129 MiB of fp32 params (387 MiB with two Adam moments); no tensor above 16 MiB (embed, head, each
# layer's stacked gate_up experts)
BIG = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=2, num_experts=8, moe_intermediate_size=512)


def _tiny_save(root: Path, mesh, nan: bool):
    """save_sharded of the tiny model's seed-0 params and fresh AdamW state on ``mesh`` (dp = world);
    with ``nan``, rank 1's piece of the final norm is NaN."""
    cfg = tiny_config()
    model, shapes = qwen3_moe.build(cfg), qwen3_moe.param_shapes(cfg)
    infos = sharding.layout(model, mesh, shapes)
    shards = sharding.shard_canonical(model.init(seed=0, dtype=torch.float32), infos, mesh)
    if nan and mesh.rank == 1:
        shards["model.norm.weight"] = torch.full_like(shards["model.norm.weight"], float("nan"))
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
    state = tx.init(shards)
    path = checkpoint.save_sharded(
        root, 2, train_state.checkpoint_shards(shards, infos, mesh, shapes),
        train_state.opt_canonical(state, infos, mesh, shapes), {"data_cursor": 4},
    )  # fmt: skip
    # read back on the same layout: the trainer's loader gives this rank's shards bitwise
    got, got_state, counters = train_state.initial_state(
        None, model, tx, shapes, infos, mesh, torch.device("cpu"), path
    )
    same = all(torch.equal(got[n], shards[n]) for n in shards) and counters["data_cursor"] == 4
    return path, same and all(torch.equal(got_state[k], state[k]) for k in state)


def _memory(root: Path, mesh) -> dict:
    """Save then load this rank's shards of the BIG model (params and two Adam moments, ZeRO over
    the world) and measure the resident peak of each above its baseline (``fmoe.memory``)."""
    cpu = torch.device("cpu")
    cfg = tiny_config(**BIG)
    model, shapes = qwen3_moe.build(cfg), qwen3_moe.param_shapes(cfg)
    infos = sharding.layout(model, mesh, shapes)
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
    gen = torch.Generator().manual_seed(mesh.rank)
    shards = {n: torch.randn(i.shard_numel, generator=gen) for n, i in infos.items()}
    state = {k: (v.normal_(generator=gen).abs_() if "/" in k else v) for k, v in tx.init(shards).items()}
    own = sum(t.numel() * t.element_size() for t in (*shards.values(), *state.values()))
    model_shards = train_state.checkpoint_shards(shards, infos, mesh, shapes)
    opt_shards = train_state.opt_canonical(state, infos, mesh, shapes)
    base = memory.reset_peak(cpu)
    path = checkpoint.save_sharded(root, 1, model_shards, opt_shards, {"data_cursor": 0})
    save_extra = memory.peak_bytes(cpu) - base
    want = {n: t.clone() for n, t in shards.items()}
    del shards, state, model_shards, opt_shards
    gc.collect()
    base = memory.reset_peak(cpu)
    got, _, _ = train_state.initial_state(None, model, tx, shapes, infos, mesh, cpu, path)
    load_extra = memory.peak_bytes(cpu) - base
    same = all(torch.equal(got[n], want[n]) for n in want)
    return {"save_extra": save_extra, "load_extra": load_extra, "own": own, "same": same, "path": str(path)}


def job_worker(rank, world, group, root: str, dataset: str):
    """Every multi-process claim of this file in one job (a spawn costs seconds a process)."""
    root = Path(root)
    layouts = _save_then_resume(rank, root / "layouts", dataset)
    mesh = build_mesh(1, world, 1, 1)
    (root / "nan").mkdir(exist_ok=True)
    try:
        _tiny_save(root / "nan", mesh, nan=True)
        refused = None
    except ValueError as e:
        refused = str(e)
    path, round_trip = _tiny_save(root / "tiny", mesh, nan=False)
    # measured after the code paths ran once: a process's first optimizer-state rebuild costs a
    # one-time ~35 MiB of torch's own (meta-tensor machinery), the same for a model of any size
    measured = _memory(root / "big", mesh) if memory.can_measure(torch.device("cpu")) else None
    return {"layouts": layouts, "refused": refused, "path": str(path), "round_trip": round_trip,
            "memory": measured, "nan_folder": sorted(p.name for p in (root / "nan").iterdir())}  # fmt: skip


@pytest.fixture(scope="module")
def job(tmp_path_factory, dataset) -> list:
    root = tmp_path_factory.mktemp("sharded")
    with measuring_env():  # the workers measure their resident peak (``_memory``)
        results = D.spawn(job_worker, WORLD, (str(root), dataset), timeout_s=400)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}"
    return [r.value for r in results]


@pytest.fixture
def sharded(job) -> Path:
    """The tiny model's checkpoint written by 4 ranks (dp = 4), pristine (tests copy it to change it)."""
    return Path(job[0]["path"])


@pytest.mark.skipif(not memory.can_measure(torch.device("cpu")), reason="no /proc to measure peaks")
def test_no_rank_holds_more_than_its_own_shard_plus_one_tensor_while_saving_or_loading(job):
    shapes = qwen3_moe.param_shapes(tiny_config(**BIG))
    numel = {n: torch.Size(s).numel() for n, s in shapes.items()}
    one_tensor = 4 * max(numel.values())  # fp32
    whole = 3 * 4 * sum(numel.values())  # params and two Adam moments, fp32
    # slack: the interpreter's own allocations during a save/load (pickled range lists, a
    # safetensors header, 8 MiB hashing blocks, a piece's isfinite mask): small beside one tensor
    slack = 16 << 20
    for rank, value in enumerate(job):
        v = value["memory"]
        assert v["same"], f"rank {rank}: loaded shards differ from the saved ones"
        assert whole > v["own"] + one_tensor + 4 * slack  # the bounds below tell the two apart
        assert v["save_extra"] <= one_tensor + slack, (rank, v, one_tensor)
        assert v["load_extra"] <= v["own"] + one_tensor + slack, (rank, v, one_tensor)


def test_a_non_finite_shard_on_any_rank_stops_every_rank_and_writes_nothing(job):
    for value in job:
        assert "model tensor 'model.norm.weight' (rank 1's piece) holds non-finite" in value["refused"]
        assert value["nan_folder"] == []  # not even a temp folder


# ------------------------------------------------------------------------------------------------
# bad checkpoints: one line naming the file or tensor


def copy_of(path: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(path, tmp_path / "ckpt" / path.name))


def test_the_index_tiles_every_tensor_and_reads_equal_the_canonical_tensors(job, sharded, tmp_path):
    assert all(v["round_trip"] for v in job), "a rank's shards differ after a save and load on its layout"
    ck = checkpoint.open_checkpoint(sharded)
    assert ck.format == checkpoint.SHARDED_FORMAT
    full = qwen3_moe.build(tiny_config()).init(seed=0, dtype=torch.float32)
    assert set(ck.model) == set(full)
    files = {p.file for e in ck.model.values() for p in e.pieces}
    assert files == {checkpoint.rank_file("model", r) for r in range(WORLD)}
    for name, t in full.items():
        assert torch.equal(ck.read_whole("model", name), t), name
        n = t.numel()
        a, b = n // 3, n - n // 5  # a range across several ranks' pieces
        assert torch.equal(ck.read("model", name, a, b), t.reshape(-1)[a:b]), name
    # replicated values (the optimizer's step count) are written once, by rank 0
    assert [p.file for p in ck.optim["step"].pieces] == [checkpoint.OPTIM]
    params, opt, trainer = checkpoint.load(sharded)
    assert trainer["data_cursor"] == 4 and all(torch.equal(params[n], full[n]) for n in full)
    # the gathered form of the same checkpoint reads back the same, range by range
    gathered = checkpoint.save(tmp_path / "old", 2, params, opt, trainer)
    old = checkpoint.open_checkpoint(gathered)
    assert old.format == checkpoint.MANIFEST_FORMAT
    for name, t in full.items():
        n = t.numel()
        assert torch.equal(old.read("model", name, n // 3, n - n // 5), t.reshape(-1)[n // 3 : n - n // 5])


def test_a_corrupt_or_missing_rank_file_is_named(sharded, tmp_path):
    path = copy_of(sharded, tmp_path)
    victim = path / checkpoint.rank_file("model", 1)
    raw = bytearray(victim.read_bytes())
    raw[-5] ^= 0x10
    victim.write_bytes(bytes(raw))
    with pytest.raises(checkpoint.CorruptCheckpointError, match=str(victim)) as err:
        checkpoint.open_checkpoint(path)
    assert "\n" not in str(err.value)
    chosen, rejected = checkpoint.newest_intact(path.parent)
    assert chosen is None and str(victim) in rejected[0][1]
    (path / checkpoint.rank_file("optim", 1)).unlink()
    with pytest.raises(FileNotFoundError, match="optim-rank00001.safetensors"):
        checkpoint.verify(path, [checkpoint.rank_file("optim", 1)])
    # unchecked, a read that needs the missing file names it too
    ck = checkpoint.open_checkpoint(path, check_integrity=False)
    with pytest.raises(FileNotFoundError, match="optim-rank00001.safetensors"):
        ck.read_whole("optim", "exp_avg/model.norm.weight")


def test_a_shape_mismatch_is_named_before_anything_is_read(sharded, tmp_path):
    path = copy_of(sharded, tmp_path)
    for f in path.glob("*.safetensors"):
        f.unlink()  # the check needs the index only
    ck = checkpoint.open_checkpoint(path, check_integrity=False)
    shapes = qwen3_moe.param_shapes(tiny_config(hidden_size=64, head_dim=16))
    with pytest.raises(
        ValueError, match=r"tensor '[^']+' has shape \(\d+, 32\) in the checkpoint, the recipe needs"
    ):
        ck.check("model", list(shapes), shapes)


def test_a_resume_refuses_a_rank_file_that_fails_its_checksum_naming_it(tmp_path, dataset, capsys):
    from test_train import toml_text

    from fmoe import cli

    d = recipe_dict(tmp_path, dataset)
    train.train(R.from_dict(d), stop_after=3)
    newest = checkpoint.latest(tmp_path / "ckpt")
    index = json.loads((newest / checkpoint.INDEX).read_text())
    assert index["format"] == checkpoint.SHARDED_FORMAT
    raw = bytearray((newest / checkpoint.OPTIM).read_bytes())
    raw[-7] ^= 0x01  # one bit of a stored value: the file still parses, only its checksum tells
    (newest / checkpoint.OPTIM).write_bytes(bytes(raw))
    (tmp_path / "r.toml").write_text(toml_text(d))
    assert cli.main(["train", str(tmp_path / "r.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(newest / checkpoint.OPTIM) in err, err


# ------------------------------------------------------------------------------------------------
# export to Hugging Face, streamed from the pieces


def test_export_hf_from_a_sharded_checkpoint_equals_the_export_of_the_whole_dict(sharded, tmp_path):
    from safetensors.torch import load_file

    from fmoe import hf

    cfg = tiny_config()
    lazy = checkpoint.open_checkpoint(sharded).tensors("model")
    streamed = hf.export_hf("qwen3_moe", cfg, lazy, tmp_path / "streamed", dtype=torch.bfloat16)
    whole = {n: lazy[n] for n in lazy}
    want = {k: v.to(torch.bfloat16) for k, v in qwen3_moe.to_hf(cfg, whole).items()}
    got = load_file(streamed / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((streamed / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.skipif(not memory.can_measure(torch.device("cpu")), reason="no /proc to measure peaks")
def _export_peak(rank: int, world: int, group, path: str, out_dir: str) -> int:
    """export_hf of the checkpoint at ``path`` (lazily read) in a fresh process: its peak extra bytes."""
    from fmoe import hf

    cpu = torch.device("cpu")
    lazy = checkpoint.open_checkpoint(path).tensors("model")
    base = memory.reset_peak(cpu)
    hf.export_hf("qwen3_moe", tiny_config(**BIG), lazy, out_dir)
    return memory.peak_bytes(cpu) - base


def test_export_hf_streams_holding_about_one_tensor_not_the_model(job, tmp_path):
    from safetensors import safe_open

    cfg = tiny_config(**BIG)
    shapes = qwen3_moe.param_shapes(cfg)
    one_tensor = 4 * max(torch.Size(s).numel() for s in shapes.values())
    whole = 4 * sum(torch.Size(s).numel() for s in shapes.values())
    path, out = job[0]["memory"]["path"], tmp_path / "hf"
    with measuring_env():  # a fresh process whose resident peak follows its tensors'
        [result] = D.spawn(_export_peak, 1, (path, str(out)), timeout_s=240)
    assert result.ok, f"{result.error_type}: {result.error}\n{result.traceback}"
    extra = result.value
    # one canonical tensor assembled, plus its Hugging Face form (qwen3_moe unstacks the experts
    # into contiguous per-expert copies), plus the slack of the memory test above
    slack = 16 << 20
    assert whole > 2 * one_tensor + 2 * slack
    assert extra <= 2 * one_tensor + slack, (extra, one_tensor, whole)
    lazy = checkpoint.open_checkpoint(path).tensors("model")
    name = "model.layers.1.mlp.experts.7.down_proj.weight"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor(name), lazy["model.layers.1.mlp.experts.down_proj"][7])


def test_shard_range_is_the_slice_of_the_canonical_tensor_that_shard_canonical_takes():
    from fmoe.mesh import Mesh
    from fmoe.sharding import ShardInfo, shard_range

    gen = torch.Generator().manual_seed(0)
    full = {"model.layers.0.mlp.experts.down_proj": torch.randn(8, 3, 5, generator=gen),
            "model.norm.weight": torch.randn(7, generator=gen)}  # fmt: skip
    for dp, ep in [(2, 2), (4, 1), (1, 4), (3, 1)]:  # dp = 3 pads the last shard
        for d in range(dp):
            for e in range(ep):
                mesh = Mesh(1, dp, 1, ep, rank=d * ep + e, coords={"pp": 0, "dp": d, "cp": 0, "ep": e})
                infos = {}
                for n, t in full.items():
                    if n == "model.layers.0.mlp.experts.down_proj":  # ep-local experts, split over dp (x cp)
                        infos[n] = ShardInfo((t.shape[0] // ep, *t.shape[1:]), "dp_cp", dp, d, expert=True)
                    else:  # split over dp x cp x ep, ep innermost
                        infos[n] = ShardInfo(tuple(t.shape), "dp_cp_ep", dp * ep, d * ep + e)
                shards = sharding.shard_canonical(full, infos, mesh)
                for n, t in full.items():
                    a, b = shard_range(n, infos[n], mesh, t.shape)
                    assert torch.equal(shards[n][: b - a], t.reshape(-1)[a:b]), (n, dp, ep, d, e)
                    assert not shards[n][b - a :].any(), (n, dp, ep, d, e)  # the rest is padding
