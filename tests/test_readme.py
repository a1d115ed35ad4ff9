"""The README's code runs, and CI runs exactly the README's test command."""

from __future__ import annotations

import re
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
