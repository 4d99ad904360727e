"""The one reader of ampnet's import graph, shared by tests/test_architecture.py
and tools/structure_report.py: which module imports which (imports inside
functions included, those under ``if TYPE_CHECKING:`` left out), the import
circles, the layers and the arrows that run from a lower layer to a higher
one."""

from __future__ import annotations

import ast
import pathlib

import ampnet

ROOT = pathlib.Path(ampnet.__file__).resolve().parent.parent

#: ampnet's layers, lowest first: a module may import from its own layer and
#: the layers below. The first prefix that matches a module names its layer.
LAYERS = (
    ("base", ("ampnet.exceptions", "ampnet.utils")),
    ("precision", ("ampnet.precision",)),
    ("parameter table", ("ampnet.config.params", "ampnet.config.docstrings")),
    ("components", ("ampnet.training", "ampnet.diagnostics", "ampnet.io", "ampnet.config.net_state",
                    "ampnet.config.no_effect")),
    ("configuration", ("ampnet.config",)),
    ("auto", ("ampnet.auto",)),
    ("net", ("ampnet",)),
)


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(packages=("ampnet",)):
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield module_name(path), path


def is_module(dotted: str) -> bool:
    path = ROOT / pathlib.Path(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def imports(name: str, path: pathlib.Path):
    """The modules ``name`` imports (``from a import b`` counts as ``a.b``
    when ``a.b`` is a module), as ``(module, line, inside_function)``."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                for sub in child.orelse:
                    visit(sub, in_function)
                continue
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                subs = [f"{base}.{alias.name}" for alias in child.names if is_module(f"{base}.{alias.name}")]
                if len(subs) < len(child.names):  # not only submodules: the names come from base
                    found.append((base, child.lineno, in_function))
                found.extend((sub, child.lineno, in_function) for sub in subs)
            visit(child, inner)

    visit(tree, False)
    return found


def graph(prefix: str = "ampnet", packages=("ampnet",)):
    """Module -> the modules it imports, among the modules under ``prefix``."""
    modules = {n: p for n, p in source_files(packages) if n == prefix or n.startswith(prefix + ".")}
    return {n: {i for i, _, _ in imports(n, p) if i in modules and i != n} for n, p in modules.items()}


def cycles(g):
    """The import circles of ``g``, each as a list of modules."""
    found, done = [], set()

    def visit(node, path):
        if node in path:
            found.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        for nxt in sorted(g[node]):
            visit(nxt, path + [node])
        done.add(node)

    for node in sorted(g):
        visit(node, [])
    return found


#: Modules that belong to the net's layer though their package is lower: none
#: (``ampnet.io.persistence`` asks the net for the autos' saved choices, so it
#: imports nothing above ``io``).
NET_MIXINS: tuple[str, ...] = ()


def layer(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``'s layer."""
    if module in NET_MIXINS:
        return len(LAYERS) - 1
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise KeyError(module)


def back_arrows(g=None):
    """``(importer, imported)`` pairs where a lower layer imports a higher one."""
    g = graph() if g is None else g
    return sorted((a, b) for a, targets in g.items() for b in targets if layer(b) > layer(a))


def function_imports():
    """``(module, line, imported)`` of every import inside a function."""
    out = []
    for name, path in source_files():
        out += [(name, line, imported) for imported, line, inside in imports(name, path) if inside]
    return out
