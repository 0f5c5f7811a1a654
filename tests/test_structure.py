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
import re

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


def _imports(name: str, path: pathlib.Path, known: set[str], type_checking: bool = False) -> set[str]:
    """The modules ``name`` imports; ``type_checking``: those under ``if TYPE_CHECKING:`` too (they name
    a dependency the layers count, though it never runs)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree) if type_checking else _runtime_nodes(tree):
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


# -- the layers of docs/layout.md --------------------------------------------------------------

LAYOUT = ROOT / "docs" / "layout.md"


def _layers(text: str) -> list[list[str]]:
    """The numbered list between the layout page's layer markers: each item's `names`, in order."""
    start, end = text.index("<!-- layers"), text.index("<!-- /layers -->")
    layers = []
    for line in text[start:end].splitlines():
        m = re.match(r"^\d+\. (.*)$", line)
        if m:
            names = re.findall(r"`([^`]+)`", m.group(1).partition(":")[0])
            layers.append(names)
    return layers


def _layer_of(module: str, layers: list[list[str]]) -> int | None:
    """The layer of ``module``: the most specific name that covers it (a module, or a package ending in /)."""
    best: tuple[int, int] | None = None  # (length of the matched name, layer)
    for number, names in enumerate(layers):
        for name in names:
            full = "accelport" if name == "accelport" else f"accelport.{name.rstrip('/')}"
            covers = module == full or (name.endswith("/") and module.startswith(full + "."))
            if covers and (best is None or len(full) > best[0]):
                best = (len(full), number)
    return best[1] if best else None


def test_imports_follow_the_layers_of_the_layout_page() -> None:
    layers = _layers(LAYOUT.read_text())
    assert len(layers) > 5, "docs/layout.md lost its list of layers"
    modules = _modules()
    unplaced = sorted(m for m in modules if _layer_of(m, layers) is None)
    assert not unplaced, f"modules in no layer of docs/layout.md: {unplaced}"
    against = []
    for name, path in sorted(modules.items()):
        mine = _layer_of(name, layers)
        for target in sorted(_imports(name, path, set(modules), type_checking=True)):
            theirs = _layer_of(target, layers)
            if mine is not None and theirs is not None and theirs > mine:
                against.append(f"{name} (layer {mine + 1}) imports {target} (layer {theirs + 1})")
    assert not against, "imports against the layer order of docs/layout.md:\n" + "\n".join(against)


def test_the_layer_check_sees_type_checking_imports(tmp_path: pathlib.Path) -> None:
    low = tmp_path / "low.py"
    low.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import X\n")
    assert _imports("pkg.low", low, {"pkg.low", "pkg.high"}, type_checking=True) == {"pkg.high"}
    assert _imports("pkg.low", low, {"pkg.low", "pkg.high"}) == set()
    layers = _layers("<!-- layers -->\n1. `low`\n2. `high/`, `high.api`: what\n<!-- /layers -->")
    assert layers == [["low"], ["high/", "high.api"]]
    assert _layer_of("accelport.high.x", layers) == 1 and _layer_of("accelport.low", layers) == 0
    assert _layer_of("accelport.lower", layers) is None


def test_every_module_is_named_on_the_layout_page() -> None:
    text = LAYOUT.read_text()
    missing = []
    for name, path in _modules().items():
        if path.name == "__init__.py" or name.startswith(("accelport.diagnose.rules.", "accelport.cli.",
                                                          "accelport._backends.")):
            continue  # packages by their folder; one module per kind, command or backend by theirs
        if f"{path.name}" not in text:
            missing.append(name)
    assert not missing, f"modules docs/layout.md does not describe: {sorted(missing)}"


def test_no_plugin_is_looked_up_by_name_outside_the_plugin_host() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in PACKAGES.values() for path in sorted(folder.rglob("*.py"))
        if path != ROOT / "accelport" / "plugins" / "host.py"
        for n, line in enumerate(path.read_text().splitlines(), 1) if "get_plugin(" in line
    ]
    assert not offenders, ("a plugin looked up by name (use a declared hook, or pass the object): "
                           + ", ".join(offenders))
