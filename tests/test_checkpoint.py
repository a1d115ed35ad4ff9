"""Claims about fmoe.checkpoint: atomic, complete, exact round trips; crashes and corruption are harmless and named."""

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from fmoe import checkpoint, checkpoint_install, checkpoint_write, optim


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(11, 4, generator=g),
        "layers.0.mlp.w1": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "layers.0.mlp.w2": torch.randn(6, 4, generator=g).t(),  # non-contiguous
        "layers.0.norm.scale": torch.ones(4),
    }


def _opt_flat(params):
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
    fp32 = {n: p.float().contiguous() for n, p in params.items()}
    state = tx.init(fp32)
    grads = {n: torch.ones_like(p) for n, p in fp32.items()}
    _, state = optim.step(tx, grads, state, fp32)
    return optim.state_to_flat(state)


def test_save_load_round_trips_params_optimizer_state_and_trainer_state(tmp_path):
    params, flat = _params(), _opt_flat(_params())
    path = checkpoint.save(tmp_path, 7, params, flat, {"data_cursor": 123, "note": "x"}, keep=2)
    assert path.name == "step_00000007" and checkpoint.latest(tmp_path) == path
    got, got_flat, trainer = checkpoint.load(path, expected_keys=params, expected_optim_keys=flat)
    for n, p in params.items():
        assert got[n].dtype == p.dtype and got[n].is_contiguous() and torch.equal(got[n], p)
    for k, v in flat.items():
        assert torch.equal(got_flat[k], v)
    assert trainer == {"data_cursor": 123, "note": "x", "step": 7}


def test_only_the_newest_keep_checkpoints_remain(tmp_path):
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, step, _params(step), {}, {}, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]


def test_crash_inside_the_writer_keeps_the_previous_checkpoint_and_removes_the_partial_folder(
    tmp_path, monkeypatch
):
    first = checkpoint.save(tmp_path, 1, _params(1), {}, {"data_cursor": 1})
    real = checkpoint_write._write_tensors
    calls = []

    def crashing(path, tensors, metadata):
        calls.append(path)
        if len(calls) == 2:  # model.safetensors is written, optim.safetensors fails midway
            path.write_bytes(b"partial")
            raise OSError("disk full")
        real(path, tensors, metadata)

    monkeypatch.setattr(checkpoint_write, "_write_tensors", crashing)
    with pytest.raises(checkpoint.CheckpointWriteError, match="step_00000002.*disk full") as err:
        checkpoint.save(tmp_path, 2, _params(2), {}, {"data_cursor": 2})
    assert isinstance(err.value.__cause__, OSError)
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp folder left behind
    assert checkpoint.latest(tmp_path) == first
    params, _, trainer = checkpoint.load(first)
    assert torch.equal(params["embed.weight"], _params(1)["embed.weight"]) and trainer["data_cursor"] == 1


def test_crash_while_replacing_a_step_keeps_the_old_copy(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 5, _params(1), {}, {"v": "old"})
    real_rename = os.rename

    def rename(src, dst):  # the old copy is moved aside, then moving the new one in fails
        if Path(src).name.startswith(".tmp-step_"):
            raise OSError("rename failed")
        real_rename(src, dst)

    monkeypatch.setattr(checkpoint_install.os, "rename", rename)
    with pytest.raises(checkpoint.CheckpointWriteError, match="rename failed"):
        checkpoint.save(tmp_path, 5, _params(2), {}, {"v": "new"})
    monkeypatch.undo()
    assert checkpoint.load(checkpoint.latest(tmp_path))[2]["v"] == "old"
    checkpoint.save(tmp_path, 5, _params(2), {}, {"v": "new"})  # replacing a step works
    assert checkpoint.load(checkpoint.latest(tmp_path))[2]["v"] == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000005"]


def test_latest_ignores_temp_and_incomplete_folders(tmp_path):
    assert checkpoint.latest(tmp_path / "none") is None
    good = checkpoint.save(tmp_path, 3, _params(), {}, {})
    (tmp_path / ".tmp-step_00000009-1-abc").mkdir()
    (tmp_path / "step_00000010").mkdir()  # no files: not a checkpoint
    assert checkpoint.latest(tmp_path) == good


def test_truncated_safetensors_file_is_a_one_line_error_naming_it(tmp_path):
    path = checkpoint.save(tmp_path, 1, _params(), {}, {})
    model = path / checkpoint.MODEL
    model.write_bytes(model.read_bytes()[:-10])
    with pytest.raises(ValueError, match="model.safetensors") as err:
        checkpoint.load(path)
    assert "\n" not in str(err.value)
    path = checkpoint.save(tmp_path, 2, _params(), {}, {})
    (path / checkpoint.TRAINER).write_text("{")
    with pytest.raises(ValueError, match="trainer.json"):
        checkpoint.load(path)
    (path / checkpoint.OPTIM).unlink()
    with pytest.raises(FileNotFoundError, match="optim.safetensors"):
        checkpoint.load(path)


def test_missing_expected_keys_are_named(tmp_path):
    path = checkpoint.save(tmp_path, 1, _params(), {}, {})
    want = set(_params()) | {"head.weight"}
    with pytest.raises(ValueError, match="model.safetensors.*1 missing.*head.weight"):
        checkpoint.load(path, expected_keys=want)


def test_tied_weights_are_saved(tmp_path):
    w = torch.randn(5, 3)
    path = checkpoint.save(tmp_path, 1, {"embed.weight": w, "head.weight": w}, {}, {})
    got, _, _ = checkpoint.load(path)
    assert torch.equal(got["embed.weight"], w) and torch.equal(got["head.weight"], w)


def test_bad_trainer_state_is_refused_before_writing_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match="'cursor'"):
        checkpoint.save(tmp_path, 1, _params(), {}, {"cursor": object()})
    assert checkpoint.latest(tmp_path) is None and list(tmp_path.iterdir()) == []


def test_rng_states_survive_a_json_round_trip(tmp_path):
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    state = json.loads(json.dumps(checkpoint.capture_rng()))
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    checkpoint.restore_rng(state)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]
    with pytest.raises(ValueError, match="numpy"):
        checkpoint.restore_rng({**state, "numpy": {"kind": "MT19937"}})


@pytest.mark.parametrize("name", [checkpoint.MODEL, checkpoint.OPTIM, checkpoint.TRAINER])
def test_a_flipped_bit_in_any_file_fails_the_checksum_naming_the_file(tmp_path, name):
    params = _params()
    path = checkpoint.save(tmp_path, 1, params, _opt_flat(params), {"data_cursor": 5})
    assert checkpoint.verify(path)
    raw = bytearray((path / name).read_bytes())
    raw[len(raw) - 3] ^= 0x04
    (path / name).write_bytes(bytes(raw))
    with pytest.raises(checkpoint.CorruptCheckpointError, match=name) as err:
        checkpoint.load(path)
    assert "\n" not in str(err.value)
    assert checkpoint.newest_intact(tmp_path) == (None, [(path, str(err.value))])


def test_newest_intact_skips_a_corrupt_newest_checkpoint(tmp_path):
    older = checkpoint.save(tmp_path, 1, _params(1), {}, {})
    newest = checkpoint.save(tmp_path, 2, _params(2), {}, {})
    (newest / checkpoint.MODEL).write_bytes((newest / checkpoint.MODEL).read_bytes()[:-1] + b"\x7f")
    chosen, rejected = checkpoint.newest_intact(tmp_path)
    assert chosen == older and [p for p, _ in rejected] == [newest]


def test_clean_temp_removes_partial_folders_and_puts_back_a_step_moved_aside(tmp_path):
    kept = checkpoint.save(tmp_path, 5, _params(1), {}, {"v": "old"})
    kept.rename(tmp_path / ".tmp-old-step_00000005-0123abcd")  # killed between the two renames
    (tmp_path / ".tmp-step_00000006-99-deadbeef").mkdir()
    (tmp_path / ".tmp-drop-step_00000001-feedf00d").mkdir()
    done = checkpoint.clean_temp(tmp_path)
    assert len(done) == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["step_00000005"]
    assert checkpoint.load(tmp_path / "step_00000005")[2]["v"] == "old"


def test_non_finite_tensors_are_never_saved(tmp_path):
    params = _params()
    params["layers.0.norm.scale"] = torch.tensor([1.0, float("nan"), 1.0, 1.0])
    with pytest.raises(ValueError, match=r"params\['layers.0.norm.scale'\] holds non-finite"):
        checkpoint.save(tmp_path, 1, params, {}, {})
    with pytest.raises(ValueError, match=r"opt_state_flat\['exp_avg/x'\] holds non-finite"):
        checkpoint.save(tmp_path, 1, _params(), {"exp_avg/x": torch.tensor([float("inf")])}, {})
    assert list(tmp_path.iterdir()) == []


def test_shapes_that_differ_from_the_expected_ones_are_named(tmp_path):
    path = checkpoint.save(tmp_path, 1, _params(), {}, {})
    shapes = {n: tuple(t.shape) for n, t in _params().items()} | {"embed.weight": (11, 8)}
    with pytest.raises(
        ValueError,
        match=r"tensor 'embed.weight' has shape \(11, 4\) in the checkpoint, the recipe needs \(11, 8\)",
    ):
        checkpoint.load(path, expected_shapes=shapes)


def test_shard_canonical_refuses_a_tensor_of_another_shape():
    from fmoe.mesh import build_mesh
    from fmoe.sharding import ShardInfo, shard_canonical

    infos = {"w": ShardInfo((4, 8), "dp_cp_ep", 1, 0)}
    assert shard_canonical({"w": torch.ones(4, 8)}, infos, build_mesh(1, 1, 1, 1))["w"].shape == (32,)
    with pytest.raises(ValueError, match=r"tensor 'w' has shape \(4, 4\), the model's layout needs \(4, 8\)"):
        shard_canonical({"w": torch.ones(4, 4)}, infos, build_mesh(1, 1, 1, 1))


@pytest.mark.parametrize("background", [False, True])
def test_each_file_records_the_kind_it_holds_from_the_save_not_from_its_name(tmp_path, background):
    from safetensors import safe_open

    shards = {n: checkpoint.whole(t) for n, t in _params().items()}
    pending = checkpoint.begin_save(tmp_path, 4, shards, {"step": checkpoint.whole(torch.tensor(1.0))},
                                    {}, background=background)  # fmt: skip
    path = pending.finish()
    for name, kind in ((checkpoint.MODEL, "model"), (checkpoint.OPTIM, "optim")):
        with safe_open(str(path / name), framework="pt") as f:
            assert f.metadata() == {"fmoe_step": "4", "fmoe_content": kind}
    # the kind travels with the pieces: a file named like neither kind still says what it holds
    pending = checkpoint_write.PendingSave(tmp_path, tmp_path / "x", tmp_path / "tmp", 5, 1, {}, "")
    pending._write({"weights.safetensors": checkpoint_write.RankFile("model", {"w": torch.ones(2)})})
    assert pending.error is None
    with safe_open(str(tmp_path / "tmp" / "weights.safetensors"), framework="pt") as f:
        assert f.metadata()["fmoe_content"] == "model"
