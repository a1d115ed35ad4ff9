"""The GPU tier runs from the same folder as the CPU suite: `TRITON_INTERPRET=0 python3 -m pytest -m
cuda tests/` must collect every module without one of them switching the interpreter back on.

Triton picks interpreter or compiler when a kernel is defined, so a module that sets
``TRITON_INTERPRET`` at import (the CPU tests do, to run the kernels interpreted) must only default
it: an explicit ``TRITON_INTERPRET=0`` from the person running the GPU tier wins.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _forced_interpreter_lines(source: str) -> list[int]:
    """Lines that assign ``os.environ["TRITON_INTERPRET"]`` outright (not ``setdefault``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for t in targets:
            if (
                isinstance(t, ast.Subscript)
                and ast.unparse(t.value) == "os.environ"
                and isinstance(t.slice, ast.Constant)
                and t.slice.value == "TRITON_INTERPRET"
            ):
                lines.append(node.lineno)
    return lines


def test_no_test_module_forces_the_triton_interpreter_on_at_import():
    forced = {
        f"{path.name}:{line}"
        for path in sorted(TESTS.glob("*.py"))
        for line in _forced_interpreter_lines(path.read_text())
    }
    assert not forced, f"use os.environ.setdefault('TRITON_INTERPRET', '1'): {sorted(forced)}"


def test_the_check_sees_an_outright_assignment():
    assert _forced_interpreter_lines('import os\nos.environ["TRITON_INTERPRET"] = "1"\n') == [2]
    assert _forced_interpreter_lines('import os\nos.environ.setdefault("TRITON_INTERPRET", "1")\n') == []
