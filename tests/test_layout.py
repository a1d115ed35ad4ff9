"""stages/, kernels/, schedules/ are importable as fmoe.stages, fmoe.kernels, fmoe.schedules in a
normal and in an editable install, and no generic top-level name is installed."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = (
    "import importlib.util, json;"
    "names = ['fmoe', 'fmoe.stages', 'fmoe.kernels', 'fmoe.schedules', 'fmoe.recipes', 'stages', 'kernels'];"
    "print(json.dumps({n: (s.origin if (s := importlib.util.find_spec(n)) else None) for n in names}))"
)


def install_and_probe(tmp_path: Path, editable: bool) -> dict:
    """Install the repository into a fresh venv and report where each name imports from.

    The venv sees this test environment's packages (pip, setuptools, torch) through a .pth file,
    not the base interpreter's: the base interpreter's setuptools may be too old for pyproject's
    ``license = "Apache-2.0"`` (setuptools >= 77, which the test extra installs here). The build
    runs without isolation and without an index: no download.
    """
    import json

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    nested = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(nested) / "test_environment.pth").write_text("".join(f"{p}\n" for p in ours))
    args = ["-e", str(REPO)] if editable else [str(REPO)]
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *args],
        check=True,
        cwd=tmp_path,
        env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "PIP_NO_INDEX": "1", "HOME": str(tmp_path)},
    )
    out = subprocess.run([str(py), "-c", PROBE], check=True, cwd=tmp_path, capture_output=True, text=True)
    return json.loads(out.stdout)


def test_the_build_requirement_can_read_the_license_field():
    build = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    setuptools_req = next(r for r in build if r.startswith("setuptools"))
    assert setuptools_req == "setuptools>=77", "SPDX `license = ...` strings need setuptools >= 77"


@pytest.mark.parametrize("editable", [False, True], ids=["normal", "editable"])
def test_subpackages_map_into_the_fmoe_namespace(tmp_path, editable):
    import setuptools

    major = int(setuptools.__version__.split(".")[0])
    assert major >= 77, f"setuptools {setuptools.__version__} here: install the test extra (setuptools>=77)"
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
