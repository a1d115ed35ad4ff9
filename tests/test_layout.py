"""stages/, kernels/, schedules/ are importable as fmoe.stages, fmoe.kernels, fmoe.schedules in a
normal and in an editable install, and no generic top-level name is installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = (
    "import importlib.util, json;"
    "names = ['fmoe', 'fmoe.stages', 'fmoe.kernels', 'fmoe.schedules', 'fmoe.recipes', 'stages', 'kernels'];"
    "print(json.dumps({n: (s.origin if (s := importlib.util.find_spec(n)) else None) for n in names}))"
)


def install_and_probe(tmp_path: Path, editable: bool) -> dict:
    import json

    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True
    )
    py = venv / "bin" / "python"  # system site-packages give it pip, setuptools and torch
    args = ["-e", str(REPO)] if editable else [str(REPO)]
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *args],
        check=True,
        cwd=tmp_path,
        env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "PIP_NO_INDEX": "1", "HOME": str(tmp_path)},
    )
    out = subprocess.run([str(py), "-c", PROBE], check=True, cwd=tmp_path, capture_output=True, text=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("editable", [False, True], ids=["normal", "editable"])
def test_subpackages_map_into_the_fmoe_namespace(tmp_path, editable):
    pytest.importorskip("setuptools")
    origins = install_and_probe(tmp_path, editable)
    root = REPO if editable else tmp_path / "venv"
    assert Path(origins["fmoe"]).is_relative_to(root)
    for sub, folder in (
        ("stages", "stages"),
        ("kernels", "kernels"),
        ("schedules", "schedules"),
        ("recipes", "recipes"),
    ):
        origin = Path(origins[f"fmoe.{sub}"])
        assert origin.name == "__init__.py"
        assert origin.is_relative_to(root), origin
        if editable:
            assert origin.parent == REPO / folder
    assert origins["stages"] is None and origins["kernels"] is None, (
        "no top-level 'stages'/'kernels' installed"
    )
