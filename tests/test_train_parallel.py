"""fmoe train on several processes (gloo): resume on another mesh, DualPipeV, a dying rank."""

from __future__ import annotations

import os

from test_train import recipe_dict

from fmoe import dist as D
from fmoe import recipe as R
from fmoe.train import train

STEPS = 6


def mesh_recipe(tmp, dataset, sizes, microbatches, schedule="1f1b"):
    pp, dp, cp, ep = sizes
    return recipe_dict(
        tmp, dataset,
        train={"steps": STEPS, "global_batch": 8, "microbatches": microbatches},
        parallel={"pp": pp, "dp": dp, "cp": cp, "ep": ep, "schedule": schedule},
    )  # fmt: skip


def train_worker(rank, world, group, recipe_data, stop_after):
    result = train(R.from_dict(recipe_data), stop_after=stop_after)
    return {"losses": result.losses, "step": result.step, "params": result.params if rank == 0 else None}


def run(recipe_data, world, stop_after=None):
    results = D.spawn(train_worker, world, (recipe_data, stop_after), timeout_s=300)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error}\n{r.traceback}"
    losses = [r.value["losses"] for r in results]
    assert all(x == losses[0] for x in losses), "every rank reports the same losses"
    return results[0].value


def close(a, b, tol):
    return all(abs(x - y) <= tol * abs(y) for x, y in zip(a, b, strict=True))


def test_save_on_one_mesh_resume_on_another_equals_an_unbroken_run(tmp_path, dataset):
    # every micro-batch holds one sequence in all three runs, so the aux losses agree too
    straight = train(R.from_dict(mesh_recipe(tmp_path / "one", dataset, (1, 1, 1, 1), 8)))
    ckpt = tmp_path / "moved"
    first = run(mesh_recipe(ckpt, dataset, (2, 2, 1, 2), 2), 8, stop_after=3)
    assert first["step"] == 3
    second = run(mesh_recipe(ckpt, dataset, (1, 2, 1, 1), 4), 2)
    assert second["step"] == STEPS
    # sums over ranks reorder float32 additions: equal to rounding (1e-5), not bitwise
    assert close(first["losses"] + second["losses"], straight.losses, 1e-5)
    for name, p in straight.params.items():
        err = ((second["params"][name] - p).norm() / p.norm()).item()
        assert err <= 1e-5, name


def test_dualpipev_recipe_trains_and_resumes_on_two_processes(tmp_path, dataset):
    d = mesh_recipe(tmp_path / "a", dataset, (2, 1, 1, 1), 4, schedule="dualpipev")
    straight = run(d, 2)
    assert straight["losses"][-1] < straight["losses"][0]
    d2 = mesh_recipe(tmp_path / "b", dataset, (2, 1, 1, 1), 4, schedule="dualpipev")
    first = run(d2, 2, stop_after=3)
    second = run(d2, 2)
    assert first["losses"] + second["losses"] == straight["losses"]
    for name, p in straight["params"].items():
        assert (second["params"][name] == p).all(), name


def dying_worker(rank, world, group, recipe_data):
    if rank == 1:
        from fmoe import parallel

        real = parallel.parallel_step
        calls = {"n": 0}

        def dies(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                os._exit(17)  # the process vanishes mid-run, no message
            return real(*args, **kwargs)

        parallel.parallel_step = dies
    return train(R.from_dict(recipe_data)).step


def test_a_rank_that_dies_mid_step_ends_the_job_with_an_error_everywhere(tmp_path, dataset):
    d = mesh_recipe(tmp_path, dataset, (1, 2, 1, 1), 4)
    results = D.spawn(dying_worker, 2, (d,), timeout_s=120)
    assert not any(r.ok for r in results)
    survivor = results[0]
    assert survivor.error_type != "Timeout", "the surviving rank must fail, not hang"
