"""No parameter or stage name is parsed anywhere in fmoe (issue 28: contracts by declaration).

What the runtime needs to know about a parameter or a stage is a declared field (``Model.expert_params``,
``Stage.role``, a shape's ``decoder.Ones`` / ``Zeros``, a family's ``hub_experts``, ...), never read
out of its name. This test reads the source of fmoe/, fmoe/stages/ and fmoe/schedules/ (the syntax tree, so
comments and docstrings do not count) and refuses every string operation on a name-like value:
``name.endswith(...)``, ``n.split(...)``, ``".mlp.experts." in name``, ``re.match(..., key)``,
``name[: -len(suffix)]``, ... Each operation that is not on a parameter or stage name is listed in
ALLOWED with the reason. A new one fails the test naming its file, line and source.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("fmoe", "fmoe/stages", "fmoe/schedules")
# string methods that take a string apart; the searching ones (and the strips) only count with a
# string argument (``names.index(x)`` finds an item of a list; ``key.strip()`` trims whitespace)
STRING_METHODS = frozenset(
    {"startswith", "endswith", "split", "rsplit", "partition", "rpartition", "removeprefix", "removesuffix"}
)
WITH_A_STRING = frozenset({"find", "rfind", "index", "rindex", "count", "lstrip", "rstrip", "strip"})
REGEX_METHODS = frozenset({"match", "fullmatch", "search", "findall", "finditer", "split", "sub", "subn"})
# what one name-like value is called in this code base (a parameter, stage or tensor name, a state
# key; ``*_name`` too): a collection of them (``names``) is searched, not parsed
NAME_LIKE = re.compile(r"(?<![A-Za-z0-9])(name|n|k|key|prefix|stage|param|local)(?![A-Za-z0-9_])")

# (file, the operation's source): why it is no parameter or stage name parsed
ALLOWED: dict[tuple[str, str], str] = {
    # torch operator names a traced call records (fmoe.check's in-place detection), not parameters
    ("fmoe/check.py", "name.endswith('_')"): "an operator's name (in-place ops end in _)",
    ("fmoe/check.py", "name.startswith('__')"): "an operator's name (dunder methods)",
    ("fmoe/check.py", "name.startswith(module)"): "an operator's qualified name and its module",
    # files and folders on disk
    ("fmoe/recipe.py", "name.endswith('.csv')"): "a schedule given as a CSV file's path",
    ("fmoe/checkpoint_install.py", "p.name.startswith('.tmp-')"): "a temporary checkpoint folder's name",
    ("fmoe/checkpoint_install.py", "_MOVED_ASIDE.match(p.name)"): "a checkpoint folder moved aside",
    ("fmoe/checkpoint_verify.py", "STEP_DIR.match(p.name)"): "a checkpoint folder's step-000123 name",
    ("fmoe/checkpoint_verify.py", "'/' in name"): "a manifest's file name kept inside its folder",
    ("fmoe/checkpoint_verify.py", "name.startswith('.')"): "a manifest's file name, not hidden",
    # a recipe's --set key (section.field) and a TOML override
    ("fmoe/recipe.py", "key.partition('.')"): "a recipe override's section.field",
    # optimizer-state keys "<moment>/<param>" (fmoe.optim.state_to_flat's layout, a key the optimizer
    # composes, not a parameter's name) split back to find the parameter's shard
    ("fmoe/train_state.py", "key.partition('/')"): "an optimizer-state key, moment/param",
    # the declared prefix a Stage strips to form the keys its forward sees (spec.Stage.prefix)
    ("fmoe/stages/spec.py", "global_name[len(self.prefix):]"): "Stage.prefix, declared, stripped",
}


def operations(tree: ast.AST):
    """(node, why) for every string operation on a name-like value in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver, method = ast.unparse(node.func.value), node.func.attr
            with_string = any(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args)
            string_op = method in STRING_METHODS or (method in WITH_A_STRING and with_string)
            if string_op and NAME_LIKE.search(receiver):
                yield node, f"{method} on a name"
            elif method in REGEX_METHODS and any(NAME_LIKE.search(ast.unparse(a)) for a in node.args):
                yield node, "a regular expression over a name"
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant):
            text = node.left.value
            substring = any(isinstance(op, ast.In | ast.NotIn) for op in node.ops)
            fragment = isinstance(text, str) and len(text) > 1 and (text[0] == "." or text[-1] == ".")
            if substring and (fragment or any(NAME_LIKE.search(ast.unparse(c)) for c in node.comparators)):
                yield node, "a substring test of a name"
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.slice, ast.Slice)
            and isinstance(node.value, ast.Name | ast.Attribute)
            and NAME_LIKE.search(ast.unparse(node.value))
        ):
            yield node, "a name cut at a position"


def source_files() -> list[Path]:
    return sorted(p for folder in SOURCES for p in (REPO / folder).glob("*.py"))


def found() -> list[tuple[str, int, str, str]]:
    out = []
    for path in source_files():
        rel = path.relative_to(REPO).as_posix()
        for node, why in operations(ast.parse(path.read_text(), str(path))):
            out.append((rel, node.lineno, ast.unparse(node), why))
    return out


def test_no_parameter_or_stage_name_is_parsed_in_fmoe():
    assert len(source_files()) > 40, "the sources were not found"
    unlisted = [f"{f}:{line}: {src} ({why})" for f, line, src, why in found() if (f, src) not in ALLOWED]
    assert not unlisted, "names parsed (declare a field instead, or list the case in ALLOWED):\n" + "\n".join(
        unlisted
    )


@pytest.mark.parametrize(
    "parse",
    [
        'def is_expert(name):\n    return ".mlp.experts." in name\n',
        'def init(name):\n    return "ones" if name.endswith("norm.weight") else "normal"\n',
        'def layer(n):\n    return int(n.split(".")[2])\n',
        "def stacked(name, suffix):\n    return name[: -len(suffix)]\n",
        'def hub(names):\n    return [k for k in names if "experts." in k]\n',
        'import re\ndef layer(key):\n    return re.match(r"model\\.layers\\.(\\d+)", key)\n',
    ],
)
def test_the_scan_finds_a_name_parsed(parse):
    assert [why for _, why in operations(ast.parse(parse))], parse
