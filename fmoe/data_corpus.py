"""A corpus that ships with Python: English prose for tests, examples and ``build_from = "builtin"``."""

from __future__ import annotations

import ast
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from fmoe.data_format import write_atomic

__all__ = ["builtin_corpus"]


def builtin_corpus(out_path: str | os.PathLike, max_bytes: int = 4 << 20) -> Path:
    """Write up to ``max_bytes`` of English prose that ships with Python, as JSONL, to ``out_path``.

    Documents: the Python reference manual's topics (``pydoc_data.topics``, what ``help()`` shows)
    first, then one per stdlib module: its module, class and function docstrings (via ``ast``), in
    sorted file order, tests left out. No download; deterministic for a given Python installation
    (the text differs between Python versions). About 2 MB exist on CPython 3.11.
    """
    if not (isinstance(max_bytes, int) and max_bytes > 0):
        raise ValueError(f"max_bytes must be an int > 0, got {max_bytes!r}")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines, size = [], 0
    for text in _builtin_documents():
        line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
        n = len(text.encode("utf-8"))
        if size + n > max_bytes:
            break
        lines.append(line)
        size += n
    write_atomic(out, "".join(lines).encode("utf-8"))
    return out


def _builtin_documents() -> Iterator[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions split pydoc_data out
        topics = {}
    for key in sorted(topics):
        yield topics[key].strip()
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if skip & set(path.relative_to(stdlib).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        docs = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 40:
                    docs.append(doc)
        if docs:
            yield "\n\n".join(docs)
