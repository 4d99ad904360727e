"""The documentation's generated parts, from the code: the parameter table of
docs/user_guide/precision.md (from ampnet/config/params.py) and the module map of
docs/architecture.md (every module's layer and the first line of its
docstring). tests/ecosystem/test_generated_docs.py fails when the pages and the code
disagree; this rewrites the pages:

    python tools/docs_tables.py
"""

from __future__ import annotations

import ast
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
import import_graph  # noqa: E402  (the one import-graph reader, shared with the tests)

from ampnet.config.params import markdown_table  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
PAGES = {
    "params": (os.path.join(ROOT, "docs", "user_guide", "precision.md"),
               "<!-- generated: params table -->", "<!-- end: params table -->"),
    "modules": (os.path.join(ROOT, "docs", "architecture.md"),
                "<!-- generated: module map -->", "<!-- end: module map -->"),
}


def _summary(path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    line = " ".join(doc.strip().split("\n\n")[0].split())
    return line if len(line) <= 150 else _shortened(line, 150)


def _shortened(line: str, limit: int) -> str:
    """``line``'s first sentence, or its words up to ``limit`` characters,
    never cut inside a name in backticks or a role such as ``:class:`x```."""
    cuts = [i + 1 for i, ch in enumerate(line[:limit]) if ch == "." and line[i + 1:i + 2] == " "
            and line[:i].count("`") % 2 == 0]
    if cuts:
        return line[:cuts[0]]
    words = [i for i, ch in enumerate(line[:limit - 1]) if ch == " " and line[:i].count("`") % 2 == 0]
    return (line[:words[-1]] if words else line[:limit - 1]).rstrip(",;:") + "…"


def module_map() -> str:
    """Every ampnet module, layer by layer (lowest first), one line each."""
    by_layer: dict[int, list[str]] = {}
    for name, path in import_graph.source_files():
        by_layer.setdefault(import_graph.layer(name), []).append(f"- `{name}`: {_summary(path)}")
    lines = ["Imports run from a layer to the layers above it in this list (lower layers) and never the other",
             "way (`tests/ecosystem/test_architecture.py` checks it, with `tests/import_graph.py`):", ""]
    for index, (label, _) in enumerate(import_graph.LAYERS):
        lines.append(f"**{index + 1}. {label}**")
        lines.append("")
        lines += by_layer.get(index, [])
        lines.append("")
    return "\n".join(lines).rstrip()


def generated(kind: str) -> str:
    return markdown_table() if kind == "params" else module_map()


def current(kind: str) -> str | None:
    """The page's generated part as it is now (None without the markers)."""
    path, start, end = PAGES[kind]
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if start not in text or end not in text:
        return None
    return text.split(start, 1)[1].split(end, 1)[0].strip()


def write(kind: str) -> None:
    path, start, end = PAGES[kind]
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{head}{start}\n{generated(kind)}\n{end}{tail}")


if __name__ == "__main__":
    for kind in PAGES:
        write(kind)
        print("wrote", PAGES[kind][0])
