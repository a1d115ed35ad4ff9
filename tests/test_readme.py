"""The README's code runs, and CI runs exactly the README's test command."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_readme_python_blocks_run_in_order():
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README is ours
    assert set(namespace["grads"]) == {"block.up", "block.down"}


def test_ci_runs_the_readme_test_command():
    bash_blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    test_command = next(b.strip() for b in bash_blocks if "pytest" in b)
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert test_command in ci, f"{test_command!r} must be a line of .ci/run"


# ------------------------------------------------------------------------------------------------
# every shell command of the README, as printed


def readme_shell_commands() -> list[str]:
    """The lines of the README's bash blocks, in order (blank and comment lines left out)."""
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def readme_shortening() -> list[str]:
    """The arguments the README says this test appends to `fmoe train` (and nothing else may)."""
    said = re.search(r"runs\s+`fmoe train` with `([^`]+)`\s+appended", README)
    assert said, "the README must say how tests/test_readme.py shortens `fmoe train`"
    return shlex.split(said.group(1))


def _check_pip_install(part: str) -> None:
    """pip install lines are not run (they would install into this environment): their syntax, and
    that the project extras they name exist."""
    subprocess.run(["bash", "-n", "-c", part], check=True)
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    for target in re.findall(r"\.\[([\w,]+)\]", part):
        assert set(target.split(",")) <= set(extras), part


def _check_launcher(part: str) -> None:
    """torchrun / launch.sh lines need GPUs or SLURM and a recipe of the reader's: their syntax, and
    that what they call exists (torchrun beside this python, `-m fmoe`, recipes/launch.sh)."""
    subprocess.run(["bash", "-n", "-c", part], check=True)
    words = shlex.split(part, comments=True)
    if words[0] == "torchrun":
        assert (Path(sys.executable).parent / "torchrun").is_file() or shutil.which("torchrun")
        assert words[words.index("-m") + 1] == "fmoe" and (REPO / "fmoe" / "__main__.py").is_file()
    else:
        script = REPO / words[0]
        assert script.is_file() and os.access(script, os.X_OK), words[0]
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_every_readme_shell_command_runs_as_printed(tmp_path):
    """Each command runs in order in an empty folder (with the repository's recipes/ beside it), with
    this environment's `fmoe` on PATH; it must exit 0. The exceptions, each checked instead of run:
    `pip install` (would change this environment), the test command (this suite; see
    test_ci_runs_the_readme_test_command), and torchrun / launch.sh (GPUs or SLURM, the reader's
    recipe). `fmoe train` alone gets the shortening the README states, and nothing else is changed."""
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    env["OMP_NUM_THREADS"] = "1"
    ran, checked = [], []
    for line in readme_shell_commands():
        for part in line.split(" && "):
            part = part.strip()
            words = shlex.split(part, comments=True)
            if "pip" in words[:3] and "install" in words:
                _check_pip_install(part)
                checked.append(part)
            elif "pytest" in words:
                checked.append(part)
            elif words[0] in ("torchrun", "recipes/launch.sh"):
                _check_launcher(part)
                checked.append(part)
            else:
                command = shlex.join([*words, *readme_shortening()]) if words == ["fmoe", "train"] else part
                child = subprocess.run(
                    ["bash", "-c", command],
                    cwd=tmp_path,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                assert child.returncode == 0, f"README command failed: {command}\n{child.stderr[-3000:]}"
                ran.append(part)
    assert "fmoe train" in ran and any(r.startswith("fmoe train recipes/tiny.toml") for r in ran)
    assert any(r.startswith("fmoe schedule check") for r in ran) and len(checked) >= 4
    assert (tmp_path / "runs" / "ten").is_dir() and (tmp_path / "dualpipev.png").is_file()
