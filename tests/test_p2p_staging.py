"""The process group's backend and device placement (pure), and the pipeline's staged transport on
CPU tensors over gloo (the path gloo takes for CUDA tensors, ``fmoe.p2p.Staged``, with plain copies)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from conftest import random_batch, tiny_config
from test_train import recipe_dict

from fmoe import dist as D
from fmoe import interpreter, p2p, pipeline, runner
from fmoe import recipe as R
from fmoe.schedules.generators import generate
from fmoe.stages import qwen3_moe
from fmoe.train_setup import backend


def test_local_ranks_map_round_robin_onto_the_devices_there_are():
    assert D.local_device(0, 8) == torch.device("cuda", 0)
    assert D.local_device(5, 8) == torch.device("cuda", 5)
    assert [D.local_device(r, 1) for r in range(4)] == [torch.device("cuda", 0)] * 4
    assert [D.local_device(r, 2).index for r in range(4)] == [0, 1, 0, 1]
    assert D.local_device(3, 0) == torch.device("cpu")
    with pytest.raises(ValueError):
        D.local_device(-1, 1)


def test_auto_picks_nccl_only_when_every_local_rank_has_a_gpu_of_its_own():
    assert D.choose_backend("auto", "cuda", 8, 8) == ("nccl", "")
    assert D.choose_backend("auto", "cpu", 4, 0) == ("gloo", "")
    name, note = D.choose_backend("auto", "cuda", 2, 1)
    assert name == "gloo" and "2 local ranks share 1 CUDA device" in note
    assert D.choose_backend("gloo", "cuda", 8, 8) == ("gloo", "")
    assert D.choose_backend("nccl", "cuda", 2, 2) == ("nccl", "")


def test_nccl_on_a_shared_device_or_the_cpu_is_refused_naming_gloo():
    with pytest.raises(
        D.BackendError, match=r"^parallel.backend = 'nccl' with 4 local ranks on 1 CUDA .*'gloo'$"
    ):
        D.choose_backend("nccl", "cuda", 4, 1)
    with pytest.raises(D.BackendError, match=r"needs CUDA devices.*'gloo'"):
        D.choose_backend("nccl", "cpu", 2, 0)
    with pytest.raises(D.BackendError, match=r"parallel.backend must be 'auto', 'nccl' or 'gloo', got 'mpi'"):
        D.choose_backend("mpi", "cuda", 1, 1)


def test_the_recipe_refuses_nccl_on_a_shared_gpu_in_one_line_and_auto_says_it_chose_gloo(
    tmp_path, dataset, monkeypatch, capsys
):
    from fmoe.cli import is_bad_input

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    nccl = R.from_dict(recipe_dict(tmp_path, dataset, parallel={"backend": "nccl"}), "r.toml")
    with pytest.raises(R.RecipeError) as refused:
        backend(nccl, torch.device("cuda", 0))
    assert str(refused.value).startswith(
        "r.toml: parallel.backend = 'nccl' with 2 local ranks on 1 CUDA device"
    )
    assert "\n" not in str(refused.value) and is_bad_input(
        refused.value, "train"
    )  # the CLI: one line, exit 2
    auto = R.from_dict(recipe_dict(tmp_path, dataset), "r.toml")
    assert backend(auto, torch.device("cuda", 0)) == "gloo"
    assert "chose gloo" in capsys.readouterr().out
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert backend(auto, torch.device("cuda", 0)) == "nccl"


def test_fmoe_train_refuses_nccl_on_shared_gpus_before_the_process_group_in_one_line(
    tmp_path, dataset, monkeypatch, capsys
):
    from test_cli_errors import assert_one_line_error, train_cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    code, err, _ = train_cli(tmp_path, dataset, capsys, train={"device": "cuda"},
                             parallel={"dp": 2, "backend": "nccl"})  # fmt: skip
    assert_one_line_error(code, err, "parallel.backend = 'nccl'", "use parallel.backend = 'gloo'")


def test_fmoe_train_refuses_nccl_on_the_cpu_on_one_process_too(tmp_path, dataset, capsys):
    from test_cli_errors import assert_one_line_error, train_cli

    code, err, _ = train_cli(tmp_path, dataset, capsys, train={"device": "cpu"}, parallel={"backend": "nccl"})
    assert_one_line_error(code, err, "parallel.backend = 'nccl' needs CUDA devices", "use 'gloo'")


def test_parallel_backend_is_validated_by_name_and_round_trips(tmp_path, dataset):
    with pytest.raises(R.RecipeError, match=r"parallel.backend must be 'auto', 'nccl' or 'gloo', got 'NCCL'"):
        R.from_dict(recipe_dict(tmp_path, dataset, parallel={"backend": "NCCL"}))
    with pytest.raises(R.RecipeError, match=r"parallel.backend must be str"):
        R.from_dict(recipe_dict(tmp_path, dataset, parallel={"backend": 1}))
    recipe = R.from_dict(recipe_dict(tmp_path, dataset, parallel={"backend": "gloo"}))
    assert recipe.parallel.backend == "gloo"
    assert R.from_dict(recipe_dict(tmp_path, dataset)).parallel.backend == "auto"
    # every section written back as a dict and read again gives the same recipe: no field dropped
    data = {name: dataclasses.asdict(getattr(recipe, name)) for name in R.SECTIONS}
    data["model"] = {"family": recipe.model_family, **dataclasses.asdict(recipe.model)}
    assert R.from_dict(data) == dataclasses.replace(recipe, path="recipe")


# ------------------------------------------------------------------------------------------------
# the staged transport on CPU tensors, two gloo processes


def staging_worker(rank, world, group):
    link = p2p.Channel(group, rank, 60.0, transport=p2p.Staged(torch.device("cpu")))
    other = 1 - rank
    gen = torch.Generator().manual_seed(0)
    tuples = [
        (torch.randn(3, 5, generator=gen), None, torch.arange(6).view(2, 3) > 2,
         torch.randn(4, generator=gen).to(torch.bfloat16), torch.randint(0, 9, (7,), generator=gen))
        for _ in range(6)
    ]  # fmt: skip
    out = {}
    if rank == 0:
        # every payload posted 50 ms late by the sender thread: the headers, posted at once, run
        # ahead of the payloads, which only their own tag keeps from being received as payloads
        real_post = p2p._post_when_copied

        def late(*args):
            time.sleep(0.05)
            return real_post(*args)

        p2p._post_when_copied = late
        try:
            for t in tuples:
                link.send(t, other, "send")
            link.wait_all()
        finally:
            p2p._post_when_copied = real_post
        out["sent_allocated"] = link.transport.allocated
    else:
        got = [link.recv(other, "recv") for _ in tuples]
        out["equal"] = all(
            (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))
            for want, have in zip(tuples, got)
            for a, b in zip(want, have, strict=True)
        )
        out["recv_allocated"] = link.transport.allocated
    # through the interpreter: DualPipeV at pp = 2 with every transfer staged
    real = p2p.transport
    p2p.transport = lambda backend, device: p2p.Staged(device)
    try:
        cfg = tiny_config(num_hidden_layers=4, mlp_only_layers=(0,), router_aux_loss_coef=0.01)
        model = qwen3_moe.build(cfg)
        params = model.init(seed=1)
        batch = random_batch(cfg, 4, 8, seed=5)
        schedule = generate("dualpipev", 2, 4)
        names = pipeline.local_param_names(model, schedule, rank=rank)
        got = interpreter.pipeline_step(schedule, model, {n: params[n] for n in names}, batch, group)
        out["pipeline_loss_equal"] = torch.equal(
            got.loss, runner.run_sequential(model, params, batch, 4).loss
        )
    finally:
        p2p.transport = real
    return out


def test_staged_transfers_deliver_every_tuple_bitwise_and_reuse_their_host_buffers():
    results = D.spawn(staging_worker, 2, timeout_s=170)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}\n{r.traceback}"
    sender, receiver = results[0].value, results[1].value
    # six tuples of four tensors each: a received tuple is the consumer's own (not the pooled
    # buffer the next message lands in), and every message after the first reuses the buffers
    assert receiver["equal"], "a received tuple differs from the one sent (or a later message overwrote it)"
    assert receiver["recv_allocated"] == 4
    assert sender["sent_allocated"] <= 4 * p2p.MAX_IN_FLIGHT
    assert sender["pipeline_loss_equal"] and receiver["pipeline_loss_equal"]


def test_the_overlap_profile_measures_copies_during_compute_kernels():
    from benchmarks.profile_multirank_overlap import overlap

    def event(cat, stream, ts, dur):
        return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "args": {"stream": stream}}

    # compute stream 7 busy [0, 10) and [20, 30); copies on stream 13 over [5, 25): half inside
    events = [event("kernel", 7, 0, 10), event("kernel", 7, 20, 10), event("gpu_memcpy", 13, 5, 20),
              event("kernel", 13, 40, 1), {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 99}]  # fmt: skip
    got = overlap(events)
    assert got["compute_stream"] == 7 and got["comm_us"] == 20 and got["overlap_us"] == 10
    assert got["overlap_share"] == 0.5
    assert overlap([])["overlap_share"] is None
