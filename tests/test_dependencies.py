"""pyproject's runtime dependencies are exactly what the installed package needs.

A dependency nothing in the package imports is a download every user pays for and a version pin
that can break their environment for no reason (einops and torchopt were such, issue 21); a module
the package imports at the top of a file but does not declare breaks ``import fmoe`` on a fresh
install. Both are read from the source with ``ast``: no import is run.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the folders pyproject installs as fmoe's packages (benchmarks/ and tests/ are not installed)
PACKAGE_DIRS = ("fmoe", "recipes")


def runtime_dependencies() -> set[str]:
    """Import names of ``[project].dependencies``: the distribution name, lower case, ``-`` -> ``_``
    (true of every dependency fmoe declares; a future one whose import name differs needs a map)."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.match(r"[A-Za-z0-9_.\-]+", d).group(0).lower().replace("-", "_") for d in declared}


def third_party_imports() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """({module: files importing it at the top level}, {module: files importing it anywhere}) for
    the top-level names of absolute imports that are neither the standard library nor fmoe."""
    top: dict[str, list[str]] = {}
    anywhere: dict[str, list[str]] = {}
    for folder in PACKAGE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            module_level = {id(node) for node in tree.body}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    root = name.split(".")[0]
                    if root in sys.stdlib_module_names or root == "fmoe":
                        continue
                    where = str(path.relative_to(REPO))
                    anywhere.setdefault(root, []).append(where)
                    if id(node) in module_level:
                        top.setdefault(root, []).append(where)
    return top, anywhere


def test_every_runtime_dependency_is_imported_by_the_package():
    _, anywhere = third_party_imports()
    unused = sorted(runtime_dependencies() - set(anywhere))
    assert not unused, f"pyproject declares {unused} but nothing under {PACKAGE_DIRS} imports them"


def test_every_module_the_package_imports_at_load_time_is_a_runtime_dependency():
    top, _ = third_party_imports()
    undeclared = {m: files for m, files in top.items() if m not in runtime_dependencies()}
    assert not undeclared, f"imported at module level but not in [project].dependencies: {undeclared}"


def test_the_scan_sees_the_imports_it_reasons_about():
    """The scan finds what is known to be there: torch at the top of the stage machinery, and the
    optional backends (triton, flash_attn) only inside functions or try blocks."""
    top, anywhere = third_party_imports()
    assert "fmoe/stage.py" in top["torch"]
    assert "triton" in anywhere and "triton" not in top
    assert {"torch", "numpy", "safetensors"} <= runtime_dependencies()


def test_the_optimizer_benchmark_runs_without_torchopt_and_says_why_its_cases_are_missing(
    tmp_path, monkeypatch
):
    """torchopt is only a comparison in benchmarks/bench_optim.py: without it (a None entry in
    sys.modules makes ``import torchopt`` raise ImportError) the benchmark still writes its JSON,
    with the torchopt cases under ``skipped`` naming the missing package."""
    import json
    import runpy

    monkeypatch.setitem(sys.modules, "torchopt", None)
    bench = runpy.run_path(str(REPO / "benchmarks" / "bench_optim.py"))
    out = tmp_path / "bench.json"
    cases = "fmoe_adamw_step,torchopt_adamw,torchopt_adamw_accelerated"
    args = ["--out", str(out), "--device", "cpu", "--tensors", "2", "--numel", "1024", "--iters", "1"]
    assert bench["main"]([*args, "--repeats", "1", "--warmup", "0", "--cases", cases]) == 0
    result = json.loads(out.read_text())
    assert result["ms_per_step"]["fmoe_adamw_step"] > 0
    assert set(result["skipped"]) == {"torchopt_adamw", "torchopt_adamw_accelerated"}
    assert all("torchopt is not installed" in why for why in result["skipped"].values())


KNOWN_GOOD = REPO / ".ci" / "known-good.txt"


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a PEP 440 version: "2.13.0+cpu" -> (2, 13, 0), "5.0.0rc1" -> (5, 0, 0)."""
    return tuple(int(re.match(r"\d+", part).group(0)) for part in version.split("+")[0].split(".")[:3])


def test_the_known_good_versions_pin_every_dependency_within_pyproject_bounds():
    """`.ci/known-good.txt` (the README's "reproducible test environment") pins every runtime and
    test dependency at a version that pyproject's lower bound admits: a constraints file that misses
    one, or pins one below its bound, reproduces nothing."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in KNOWN_GOOD.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{KNOWN_GOOD.name}: {line!r} is not NAME==VERSION"
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    wanted = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    for requirement in wanted:
        spec = requirement.split(";")[0].split("#")[0].strip()
        name, _, bound = re.match(r"([A-Za-z0-9_.\-]+)\s*(>=\s*([0-9.]+))?", spec).groups()
        name = name.lower().replace("_", "-")
        assert name in pins, f"{KNOWN_GOOD.name} pins no version of {name}"
        if bound:
            assert _release(pins[name]) >= _release(bound), f"{name}=={pins[name]} is below {spec}"
