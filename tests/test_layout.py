"""fmoe's subpackages live inside fmoe/ (fmoe/stages, fmoe/kernels, fmoe/schedules), so no folder at
the checkout's root is named like a PyPI package (``kernels``, ``stages``, ``schedules``) that
``python3 -m pytest`` or ``torchrun -m fmoe`` from the root (both put the root first on ``sys.path``)
could import in its place. The one exception is recipes/, a data folder (TOML and a launcher, no
Python, no ``__init__.py``) installed as package data of fmoe.recipes: from the root it is at most an
empty namespace portion, which every installed ``recipes`` package or module wins over. All four
import as fmoe.<name> from a normal install, an editable install and an uninstalled checkout.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("stages", "kernels", "schedules", "recipes")  # fmoe.<folder>; the names PyPI may also hold
INSIDE = ("stages", "kernels", "schedules")  # the Python subpackages: folders of fmoe/
DATA_FOLDER = "recipes"  # at the root, linked as fmoe/recipes
# one module of each folder, to show where fmoe.<folder> imports from
MODULES = {
    "stages": "qwen3_moe",
    "kernels": "fp8_gemm",
    "schedules": "table",
    "recipes": None,  # data only: the package's folder is shown instead
}
PROBE = (
    "import importlib, importlib.util, json;"
    f"folders = {FOLDERS!r}; modules = {MODULES!r};"
    "out = {'fmoe': importlib.util.find_spec('fmoe').origin};"
    "out.update({f'fmoe.{f}': "
    "  (importlib.import_module(f'fmoe.{f}.{m}').__file__ if m "
    "   else list(importlib.import_module(f'fmoe.{f}').__path__)[0]) for f, m in modules.items()});"
    "from importlib import resources;"
    "out['tiny.toml'] = resources.files('fmoe.recipes').joinpath('tiny.toml').is_file();"
    "print(json.dumps(out))"
)


def make_venv(tmp_path: Path) -> Path:
    """A venv that sees this test environment's packages (pip, setuptools, torch) through a .pth
    file, not the base interpreter's: the base interpreter's setuptools may be too old for
    pyproject's ``license = "Apache-2.0"`` (setuptools >= 77, which the test extra installs here)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    nested = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(nested) / "test_environment.pth").write_text("".join(f"{p}\n" for p in ours))
    return py


def install_and_probe(tmp_path: Path, editable: bool) -> tuple[dict, list[str]]:
    """Install the repository into a fresh venv; report where each name imports from (run from
    ``tmp_path``, not the checkout) and the files the installed distribution put into the venv.
    The build runs without isolation and without an index: no download."""
    py = make_venv(tmp_path)
    args = ["-e", str(REPO)] if editable else [str(REPO)]
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *args],
        check=True,
        cwd=tmp_path,
        env={"PATH": f"{py.parent}:/usr/bin:/bin", "PIP_NO_INDEX": "1", "HOME": str(tmp_path)},
    )
    out = subprocess.run([str(py), "-c", PROBE], check=True, cwd=tmp_path, capture_output=True, text=True)
    files = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m, json; print(json.dumps([str(f) for f in m.files('fmoe')]))"],
        check=True, cwd=tmp_path, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return json.loads(out.stdout), json.loads(files)


def test_the_build_requirement_can_read_the_license_field():
    build = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    setuptools_req = next(r for r in build if r.startswith("setuptools"))
    assert setuptools_req == "setuptools>=77", "SPDX `license = ...` strings need setuptools >= 77"


def test_the_subpackages_are_folders_of_fmoe_and_the_root_holds_only_the_recipes_data():
    for folder in INSIDE:
        assert not (REPO / folder).exists(), (
            f"{folder}/ at the root: move it into fmoe/ (it shadows PyPI's {folder!r})"
        )
        inside = REPO / "fmoe" / folder
        assert inside.is_dir() and not inside.is_symlink(), f"fmoe/{folder} is the package's own folder"
    data = REPO / DATA_FOLDER
    assert not (data / "__init__.py").exists() and not list(data.rglob("*.py")), "recipes/ holds data only"
    link = REPO / "fmoe" / DATA_FOLDER
    assert link.is_symlink() and link.resolve() == data, "fmoe/recipes -> ../recipes"


def test_from_the_root_the_packages_names_find_nothing_of_fmoe():
    """From the checkout's root, ``stages``, ``schedules`` and ``kernels`` are not found in the checkout
    (absent, or another distribution's), and ``recipes`` at most as an empty namespace portion."""
    probe = (
        "import importlib.util, json;"
        f"specs = {{n: importlib.util.find_spec(n) for n in {FOLDERS!r}}};"
        "print(json.dumps({n: None if s is None else [s.origin, list(s.submodule_search_locations or [])]"
        " for n, s in specs.items()}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env={"PATH": "/usr/bin:/bin"},
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    for name, spec in json.loads(out).items():
        if spec is None:
            continue
        origin, locations = spec
        ours = [p for p in locations if Path(p).resolve().is_relative_to(REPO)]
        if name == DATA_FOLDER:
            assert origin is None and all(not list(Path(p).glob("*.py")) for p in ours), spec
        else:
            assert not ours and not (origin and Path(origin).resolve().is_relative_to(REPO)), (name, spec)


def test_an_installed_recipes_package_wins_over_the_root_data_folder(tmp_path):
    """The root's recipes/ shadows nothing: from the checkout's root, with a regular ``recipes``
    package installed (here on PYTHONPATH, after the root on sys.path), ``import recipes`` imports
    that package, not the data folder."""
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "__init__.py").write_text("WHO = 'installed'\n")
    probe = "import recipes; print(recipes.__file__, getattr(recipes, 'WHO', None))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)},
        check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    assert out == [str(tmp_path / "recipes" / "__init__.py"), "installed"], out


@pytest.mark.parametrize("editable", [False, True], ids=["normal", "editable"])
def test_subpackages_map_into_the_fmoe_namespace_and_nothing_else_is_installed(tmp_path, editable):
    import setuptools

    major = int(setuptools.__version__.split(".")[0])
    assert major >= 77, f"setuptools {setuptools.__version__} here: install the test extra (setuptools>=77)"
    origins, files = install_and_probe(tmp_path, editable)
    root = REPO if editable else tmp_path / "venv"
    assert Path(origins["fmoe"]).is_relative_to(root)
    for folder, module in MODULES.items():
        origin = Path(origins[f"fmoe.{folder}"])
        assert origin.is_relative_to(root), origin
        if editable:
            own = REPO / (folder if folder == DATA_FOLDER else f"fmoe/{folder}")
            assert origin.resolve().is_relative_to(own), origin
        else:
            expected = "fmoe/" + folder + (f"/{module}.py" if module else "")
            assert origin.as_posix().endswith(expected), origin
    assert origins["tiny.toml"], "the shipped recipes are package data of fmoe.recipes"
    # fmoe installs the fmoe package and its metadata, no generic top-level name (a legitimately
    # installed `kernels` distribution, such as Hugging Face's, is another distribution's files)
    tops = {Path(f).parts[0] for f in files if not f.startswith("..")}  # bin/fmoe lies outside site-packages
    stray = {t for t in tops if t != "fmoe" and not t.startswith(("fmoe-", "__editable__", "__pycache__"))}
    assert not stray, f"fmoe installs top-level names {sorted(stray)}"


def stand_in_packages(where: Path) -> Path:
    """Regular packages named like the checkout's folders, each saying where it is: what PyPI's
    ``kernels``, ``stages``, ``schedules`` or ``recipes`` would be once installed."""
    for folder in FOLDERS:
        (where / folder).mkdir(parents=True)
        (where / folder / "__init__.py").write_text(f"WHO = 'installed {folder}'\n")
    return where


def test_installed_packages_of_the_folders_names_win_from_the_checkout_root(tmp_path):
    """From the checkout's root (first on sys.path, as `python3 -m pytest` and `torchrun -m` put it),
    `import kernels` etc. give the installed packages, not the checkout's folders."""
    site = stand_in_packages(tmp_path / "site")
    probe = f"import json; print(json.dumps([__import__(n).WHO for n in {FOLDERS!r}]))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    assert json.loads(out) == [f"installed {f}" for f in FOLDERS]


def test_hugging_faces_kernels_is_the_one_imported_under_pytest_from_the_root():
    """This very process runs as the README's `python3 -m pytest` from the checkout's root."""
    import importlib.util

    spec = importlib.util.find_spec("kernels")
    if spec is None or spec.origin is None:  # not installed: at most our folder as a namespace portion
        locations = [] if spec is None else list(spec.submodule_search_locations)
        assert all(not (Path(p) / "__init__.py").exists() for p in locations)
        return
    assert not Path(spec.origin).resolve().is_relative_to(REPO), spec.origin


def test_an_uninstalled_checkout_imports_fmoe_and_its_folders(tmp_path):
    """A copy of the checkout that was never installed runs `python -m fmoe` from its root and
    imports its own fmoe.stages, fmoe.kernels and fmoe.schedules (not this environment's install)."""
    copy = tmp_path / "checkout"
    copy.mkdir()
    for folder in ("fmoe", DATA_FOLDER):
        shutil.copytree(
            REPO / folder, copy / folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=copy, check=True, capture_output=True, text=True
    ).stdout
    origins = json.loads(out)
    for name in ("fmoe", *(f"fmoe.{f}" for f in FOLDERS)):
        assert Path(origins[name]).is_relative_to(copy), (name, origins[name])
    help_text = subprocess.run(
        [sys.executable, "-m", "fmoe", "--help"], cwd=copy, check=True, capture_output=True, text=True
    ).stdout
    assert "train" in help_text


# The one-letter module aliases a reader may meet, each meaning the same module in every file
# (issue 28: ``F`` was the family in one file and torch.nn.functional elsewhere, ``R`` runner or
# recipe, ``P`` pipeline, parallel or permute); every other module is imported under its own name.
MODULE_ALIASES = {"F": "torch.nn.functional", "S": "fmoe.stage", "D": "fmoe.dist", "R": "fmoe.recipe"}


def test_a_one_letter_module_alias_means_one_module_everywhere():
    import ast

    wrong = []
    for folder in ("fmoe", "benchmarks", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom | ast.Import):
                    for alias in node.names:
                        if alias.asname is None or len(alias.asname) != 1:
                            continue
                        module = alias.name
                        if isinstance(node, ast.ImportFrom):
                            module = f"{node.module}.{alias.name}"
                        if MODULE_ALIASES.get(alias.asname) != module:
                            wrong.append(
                                f"{path.relative_to(REPO)}:{node.lineno}: {module} as {alias.asname}"
                            )
    assert not wrong, "one-letter aliases outside MODULE_ALIASES:\n" + "\n".join(wrong)
