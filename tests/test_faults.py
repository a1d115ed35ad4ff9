"""Fault injection on `fmoe train`: processes SIGKILLed at 10 seeded points (inside checkpoint writes,
inside a metrics line, between steps, at random times, one rank of two), a flipped bit in the newest
checkpoint, a full disk during a save and a read-only checkpoint folder. Every time the run resumes
from the newest intact checkpoint, and the final parameters and optimizer state are bitwise those of
an unbroken run.

Speed: every training process is forked from one server process that imported torch and fmoe once
(``_serve``), so a launch costs a fork, not an interpreter start. The children are ``fmoe train``
itself (``cli.main``), with faults installed by wrapping fmoe functions inside the child only.
Every run adds noise drawn from torch's global RNG to the gradients, so a resume that did not restore
the RNG state (``checkpoint.restore_rng``) would not be bitwise equal.

The full disk is a real tmpfs of a few hundred KiB and the read-only folder a real read-only bind
mount when this process may mount (root); otherwise the disk-full error is injected (an OSError
ENOSPC from the tensor writer) and the folder is made read-only by chmod (which binds non-root
users), or, for root without mount rights, placed below a plain file. FMOE_TEST_NO_MOUNT=1 takes
the fallbacks.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fmoe import checkpoint
from fmoe import dist as D

STEPS = 30
OVERRIDES = {
    "model.hidden_size": 16, "model.num_hidden_layers": 1, "model.num_attention_heads": 2,
    "model.num_key_value_heads": 1, "model.head_dim": 8, "model.num_experts": 4,
    "model.num_experts_per_tok": 2, "model.moe_intermediate_size": 8, "model.intermediate_size": 16,
    "data.seq_len": 8, "train.global_batch": 4, "train.microbatches": 2, "train.device": "cpu",
    "optim.warmup": 1, "checkpoint.every": 1, "checkpoint.keep": 2, "log.every": 1, "log.progress": False,
}  # fmt: skip


# ------------------------------------------------------------------------------------------------
# the fork server and the faults installed in its children


def _install(hooks: dict) -> None:
    """In a child: wrap fmoe functions to add RNG-drawn gradient noise, SIGKILL this process at the
    n-th call of a named point, send it other signals there (``signal``: [[point, n, name], ...]),
    sleep there (``sleep``: [point, n, seconds]), or fail tensor writes with ENOSPC."""
    import fmoe.checkpoint_install as CI
    import fmoe.checkpoint_write as CW
    from fmoe import metrics_log, optim, parallel

    calls: dict[str, int] = {}

    def die_at(point: str) -> None:
        calls[point] = calls.get(point, 0) + 1
        if hooks.get("kill") == [point, calls[point]]:
            os.kill(os.getpid(), signal.SIGKILL)
        for at, n, name in hooks.get("signal", []):
            if [at, n] == [point, calls[point]]:
                os.kill(os.getpid(), signal.Signals[name])
        if hooks.get("sleep", [None, None])[:2] == [point, calls[point]]:
            time.sleep(hooks["sleep"][2])

    real_step = parallel.parallel_step

    def parallel_step(*args, **kwargs):
        die_at("step")
        out = real_step(*args, **kwargs)
        for g in out.grad_shards.values():  # a seeded op on the global RNG: resuming must restore it
            g.add_(torch.randn_like(g), alpha=1e-3)
        return out

    parallel.parallel_step = parallel_step
    real_opt = optim.step

    def opt_step(*args, **kwargs):
        out = real_opt(*args, **kwargs)
        die_at("update")
        return out

    optim.step = opt_step
    real_write = CW._write_tensors

    def write_tensors(path, tensors, metadata):
        if hooks.get("enospc"):
            path.write_bytes(b"\0" * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_write(path, tensors, metadata)
        die_at("write")  # after model.safetensors (odd calls) or optim.safetensors (even calls)

    CW._write_tensors = write_tensors
    real_fsync = CI._fsync_dir

    def fsync_dir(path):
        real_fsync(path)
        die_at("fsync_dir")  # odd calls: the temp folder, before its rename; even: after it

    CI._fsync_dir = fsync_dir
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        die_at("rmtree")  # a checkpoint moved aside to be dropped, not yet deleted
        real_rmtree(path, *args, **kwargs)

    fake_shutil = type("shutil", (), {"rmtree": staticmethod(rmtree)})
    CI.shutil = CW.shutil = fake_shutil  # every rmtree of a save, a drop and a tidy-up
    real_log = metrics_log.MetricsLog.write

    def log_write(self, record):
        if hooks.get("kill") == ["metrics", calls.get("metrics", 0) + 1]:
            self.file.write(json.dumps(record)[:20])  # half a line reaches the file, then SIGKILL
            self.file.flush()
        die_at("metrics")
        real_log(self, record)

    metrics_log.MetricsLog.write = log_write


def _serve() -> None:
    """Read JSON commands on stdin: launch (fork a child running ``fmoe train``) or wait (its exit)."""
    import fmoe.cli  # noqa: F401 - imported once here, inherited by every child
    import fmoe.train  # noqa: F401

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "launch":
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    out = os.open(cmd["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(out, 1)
                    os.dup2(out, 2)
                    os.environ.update(cmd["env"])
                    torch.set_num_threads(1)
                    _install(cmd["hooks"])
                    from fmoe import cli

                    code = cli.main(cmd["argv"])
                except BaseException:
                    import traceback

                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    if not cmd.get("teardown"):
                        os._exit(code)
                # teardown: leave as ``python -m fmoe`` does, through the interpreter's exit (what
                # is still alive then, e.g. a process group, is torn down by it)
                sys.exit(code)
            reply = {"pid": pid}
        else:
            deadline = time.monotonic() + cmd["timeout"]
            while True:
                pid, status = os.waitpid(cmd["pid"], os.WNOHANG)
                if pid:
                    reply = {"rc": os.waitstatus_to_exitcode(status)}
                    break
                if time.monotonic() > deadline:
                    os.kill(cmd["pid"], signal.SIGKILL)
                    os.waitpid(cmd["pid"], 0)
                    reply = {"rc": "timeout"}
                    break
                time.sleep(0.01)
        print(json.dumps(reply), flush=True)


class Server:
    def __init__(self, cwd: Path):
        # the children import the fmoe this process imported (a worktree's on PYTHONPATH, not the install's)
        path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import test_faults; test_faults._serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=cwd, env=env,
        )  # fmt: skip
        self.n = 0
        self.cwd = cwd

    def ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the fork server died"
        return json.loads(line)

    def launch(self, argv, hooks=None, env=None, teardown: bool = False) -> tuple[int, Path]:
        self.n += 1
        log = self.cwd / f"launch{self.n}.log"
        pid = self.ask(
            {"op": "launch", "argv": argv, "hooks": hooks or {}, "env": env or {}, "log": str(log),
             "teardown": teardown}
        )  # fmt: skip
        return pid["pid"], log

    def wait(self, pid: int, timeout: float = 120.0):
        return self.ask({"op": "wait", "pid": pid, "timeout": timeout})["rc"]

    def run(self, argv, hooks=None, env=None) -> tuple[int, str]:
        pid, log = self.launch(argv, hooks, env)
        return self.wait(pid), log.read_text()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("server"))
    yield s
    s.close()


def argv_for(dataset: str, root: Path, ckpt: Path | None = None, **extra) -> list[str]:
    from fmoe.cli import default_recipe

    sets = {**OVERRIDES, "train.steps": STEPS, "data.path": dataset, "log.dir": str(root / "log"),
            "checkpoint.dir": str(ckpt or root / "ckpt"), **extra}  # fmt: skip
    argv = ["train", str(default_recipe())]
    for k, v in sets.items():
        argv += ["--set", f"{k}={json.dumps(v) if not isinstance(v, bool) else str(v).lower()}"]
    return argv


def final_state(ckpt: Path, steps: int = STEPS) -> tuple[dict, dict, dict]:
    last = checkpoint.latest(ckpt)
    assert last is not None and last.name == f"step_{steps:08d}", last
    return checkpoint.load(last)


def assert_bitwise(got: tuple, want: tuple) -> None:
    for g, w in zip(got[:2], want[:2]):
        assert g.keys() == w.keys()
        for name in w:
            assert torch.equal(g[name], w[name]), name
    assert {k: v for k, v in got[2].items() if k != "rng"} == {k: v for k, v in want[2].items() if k != "rng"}


def assert_all_intact(ckpt: Path) -> None:
    for p in checkpoint.list_checkpoints(ckpt):
        assert checkpoint.verify(p), p


def strict_json_lines(path: Path) -> list[dict]:
    def refuse(name):
        raise ValueError(f"{path}: bare {name}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------------------
# mounts (root) or their fallbacks


def _mount(*args: str) -> bool:
    """Run mount(8); False where this process may not (not root, no CAP_SYS_ADMIN, or
    FMOE_TEST_NO_MOUNT=1 set to exercise the fallbacks)."""
    if os.geteuid() != 0 or shutil.which("mount") is None or os.environ.get("FMOE_TEST_NO_MOUNT") == "1":
        return False
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", str(path)], check=True)


def flip_one_bit(file: Path, rng: random.Random) -> None:
    """Flip one bit inside the tensor bytes of a safetensors file (past its JSON header)."""
    raw = bytearray(file.read_bytes())
    (header,) = struct.unpack("<Q", raw[:8])
    pos = rng.randrange(8 + header, len(raw))
    raw[pos] ^= 1 << rng.randrange(8)
    file.write_bytes(bytes(raw))


# ------------------------------------------------------------------------------------------------


KILL_POINTS = [("step", 2), ("update", 1), ("update", 2), ("write", 1), ("write", 2), ("write", 3),
               ("fsync_dir", 1), ("fsync_dir", 2), ("fsync_dir", 3), ("rmtree", 1), ("metrics", 2)]  # fmt: skip


def test_sigkills_a_flipped_bit_a_full_disk_and_a_read_only_folder_resume_bitwise(server, dataset, tmp_path):
    rng = random.Random(2026)
    t0 = time.perf_counter()
    rc, out = server.run(argv_for(dataset, tmp_path / "straight"))
    assert rc == 0, out
    per_step = (time.perf_counter() - t0) / STEPS
    want = final_state(tmp_path / "straight" / "ckpt")

    root = tmp_path / "broken"
    ckpt = root / "ckpt"
    argv = argv_for(dataset, root)
    kills = [("hook", p) for p in rng.sample(KILL_POINTS, 7)] + [("timer", None)] * 2
    events = kills + [("bitflip", None), ("full_disk", None), ("read_only", None)]
    rng.shuffle(events)
    killed = 0
    for kind, point in events:
        if kind != "hook" and kind != "timer" and len(checkpoint.list_checkpoints(ckpt)) < 2:
            rc, out = server.run(argv, {"kill": ["update", 3]})  # make progress first
            assert rc == -signal.SIGKILL, out
        if kind == "hook":
            rc, out = server.run(argv, {"kill": list(point)})
            assert rc == -signal.SIGKILL, f"{point}: {out}"
            killed += 1
        elif kind == "timer":
            pid, log = server.launch(argv)
            time.sleep(rng.uniform(0.5, 2.5) * per_step)
            os.kill(pid, signal.SIGKILL)
            assert server.wait(pid) == -signal.SIGKILL, "the run ended before the timer: raise STEPS"
            killed += 1
        elif kind == "bitflip":
            newest, older = checkpoint.list_checkpoints(ckpt)[-2:][::-1]
            flip_one_bit(newest / checkpoint.MODEL, rng)
            rc, out = server.run(argv, {"kill": ["fsync_dir", 4]})  # two saves, then killed
            assert rc == -signal.SIGKILL, out
            warning = next(line for line in out.splitlines() if "is corrupt" in line)
            assert str(newest) in warning and str(older) in warning, out
        elif kind == "full_disk":
            before = {
                p.name: checkpoint.file_sha256(p / checkpoint.MODEL)
                for p in checkpoint.list_checkpoints(ckpt)
            }
            full = root / "full"
            full.mkdir()
            size = sum(f.stat().st_size for f in checkpoint.list_checkpoints(ckpt)[-1].iterdir())
            if _mount("-t", "tmpfs", "-o", f"size={4 * size}", "tmpfs", str(full)):
                try:
                    for p in checkpoint.list_checkpoints(ckpt):
                        shutil.copytree(p, full / p.name)
                    with open(
                        full / "filler", "wb", buffering=0
                    ) as f:  # fill the disk, then free half a checkpoint
                        try:
                            while True:
                                f.write(b"\0" * 4096)
                        except OSError:
                            pass
                    os.truncate(full / "filler", max(0, (full / "filler").stat().st_size - size // 2))
                    rc, out = server.run(argv_for(dataset, root, ckpt=full))
                    after = {
                        p.name: checkpoint.file_sha256(p / checkpoint.MODEL)
                        for p in checkpoint.list_checkpoints(full)
                    }
                    assert_all_intact(full)
                    leftovers = [p.name for p in full.iterdir() if p.name.startswith(".tmp-")]
                finally:
                    _umount(full)
            else:
                rc, out = server.run(argv, {"enospc": True})
                after = {
                    p.name: checkpoint.file_sha256(p / checkpoint.MODEL)
                    for p in checkpoint.list_checkpoints(ckpt)
                }
                leftovers = [p.name for p in ckpt.iterdir() if p.name.startswith(".tmp-")]
            assert rc == 2, out
            # the resume's own line first, then the one error line
            lines = [line for line in out.strip().splitlines() if not line.startswith("fmoe: resuming from ")]
            assert len(lines) == 1 and lines[0].startswith("fmoe: error: ") and "No space left" in lines[0], (
                out
            )
            assert after == before and leftovers == [], (after, before, leftovers)
        elif kind == "read_only":
            metrics = (root / "log" / "metrics.jsonl").read_bytes()
            if _mount("--bind", "-o", "ro", str(ckpt), str(ckpt)):
                try:
                    rc, out = server.run(argv)
                finally:
                    _umount(ckpt)
            elif os.geteuid() != 0:  # chmod binds every user but root
                ckpt.chmod(0o555)
                try:
                    rc, out = server.run(argv)
                finally:
                    ckpt.chmod(0o755)
            else:  # root that may not mount: a folder below a plain file, where no write succeeds
                (root / "a-file").write_text("not a folder")
                rc, out = server.run(argv_for(dataset, root, ckpt=root / "a-file" / "ckpt"))
            lines = out.strip().splitlines()
            assert (
                rc == 2 and len(lines) == 1 and "checkpoint.dir" in lines[0] and "not writable" in lines[0]
            ), out
            assert (root / "log" / "metrics.jsonl").read_bytes() == metrics, "a step ran before the error"
        assert_all_intact(ckpt)
    assert killed == 9
    rc, out = server.run(argv)
    assert rc == 0, out
    assert not [p.name for p in ckpt.iterdir() if p.name.startswith(".tmp-")]
    assert_bitwise(final_state(ckpt), want)
    assert len(strict_json_lines(root / "log" / "metrics.jsonl")) >= STEPS


def test_one_rank_of_two_sigkilled_then_resumed_equals_an_unbroken_two_rank_run(server, dataset, tmp_path):
    rng = random.Random(17)
    extra = {"parallel.dp": 2, "train.steps": 8}

    def run_two(root: Path, hooks_by_rank: dict) -> list:
        port = str(D.free_port())
        pids = []
        for rank in range(2):
            env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
            pids.append(server.launch(argv_for(dataset, root, **extra), hooks_by_rank.get(rank), env))
        return [(server.wait(pid, timeout=90), log.read_text()) for pid, log in pids]

    results = run_two(tmp_path / "straight", {})
    assert all(rc == 0 for rc, _ in results), results
    want = final_state(tmp_path / "straight" / "ckpt", steps=8)
    rank, point = rng.choice([(1, ["step", rng.randint(2, 4)]), (0, ["write", rng.randint(2, 5)])])
    results = run_two(tmp_path / "broken", {rank: {"kill": point}})
    assert results[rank][0] == -signal.SIGKILL, results
    assert results[1 - rank][0] not in (0, "timeout"), results  # the survivor fails, it does not hang
    results = run_two(tmp_path / "broken", {})
    assert all(rc == 0 for rc, _ in results), results
    assert_bitwise(final_state(tmp_path / "broken" / "ckpt", steps=8), want)
