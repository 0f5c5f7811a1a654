"""The package's shape: imports flow one way, with no cycle among accelport's modules.

Every import statement that runs counts, at module level or inside a function: a cycle
hidden in a function-level import is still a loop a reader has to untangle. Imports under
``if TYPE_CHECKING:`` never run and only name types, so they do not count. A package's ``__init__``
that a submodule import runs on the way is not counted as an edge (every module would
then depend on ``accelport/__init__.py``); an import that names the package itself is.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Where each top-level folder is importable from (backends/ ships as accelport._backends).
PACKAGES = {"accelport": ROOT / "accelport", "accelport._backends": ROOT / "backends"}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for prefix, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:``."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        for child in ast.iter_child_nodes(node):
            test = child.test if isinstance(child, ast.If) else None
            if test is not None and "TYPE_CHECKING" in ast.unparse(test):
                todo.extend(child.orelse)
                continue
            todo.append(child)
    return out


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import accelport.x.y` names accelport.x.y's module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_the_import_graph_has_no_cycle() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles among accelport's modules: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_function_level_imports(tmp_path: pathlib.Path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.c\nimport pkg.b\n")
    b.write_text("def f():\n    from pkg.a import x\n")
    c = tmp_path / "c.py"
    c.write_text("import pkg.a\n")
    known = {"pkg.a", "pkg.b", "pkg.c"}
    graph = {n: _imports(n, tmp_path / f"{n[4:]}.py", known) for n in sorted(known)}
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]  # a -> c under TYPE_CHECKING does not count


def test_core_code_never_imports_the_cli() -> None:
    modules = _modules()
    offenders = sorted(
        name for name, path in modules.items()
        if not name.startswith("accelport.cli") and name != "accelport.__main__"
        and any(t == "accelport.cli" or t.startswith("accelport.cli.") for t in _imports(name, path, set(modules)))
    )
    assert not offenders, f"core modules import the CLI: {offenders}"
