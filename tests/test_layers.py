"""The layering rule of README.md's "Architecture" section, checked on the source (AST, nothing imported).

Layers, bottom to top: `privacy`, `atomic` (and the `dpbert` package itself) | `data`, `model`, `config` |
`release` | `train` | `demo`, `cli`, `bench`. A module may import its own layer and the layers below;
`privacy` imports only the standard library, the third-party packages in `PRIVACY_THIRD_PARTY` and
`dpbert.privacy` / `dpbert.atomic`. No cycle among dpbert modules. Imports sit at module top unless the
import statement carries `# deferred: <measured reason>`.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dpbert"
MARKER = "# deferred:"

# Layer of each top-level part of dpbert (its first dotted component under `dpbert`).
LAYERS = {
    "": 0,  # dpbert/__init__.py: the version only
    "privacy": 0,
    "atomic": 0,
    "data": 1,
    "model": 1,
    "config": 1,
    "release": 2,
    "train": 3,
    "demo": 4,
    "cli": 4,
    "bench": 4,
}
# What the DP core may import besides the standard library and dpbert.privacy / dpbert.atomic. scipy is
# dp_accounting's own dependency; jax_privacy is the optional second-opinion accountant (`crosscheck` extra).
PRIVACY_THIRD_PARTY = {"jax", "jaxlib", "optax", "numpy", "dp_accounting", "scipy", "jax_privacy"}


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    file: Path
    line: int
    target: str  # imported module, dotted (a dpbert submodule when it names one)
    top: bool  # at module level (not inside a function or class body)
    marked: bool  # carries the `# deferred: <reason>` marker


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    if part not in LAYERS:
        raise AssertionError(f"{module}: no layer assigned; add '{part}' to LAYERS here and to README.md")
    return LAYERS[part]


def _resolve_from(source: str, node: ast.ImportFrom, is_package: bool, known: set[str]) -> list[str]:
    if node.level:
        base = source.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    # `from dpbert.privacy import crosscheck` imports the submodule; `from dpbert.release import x` the package.
    targets = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in known]
    return targets if len(targets) == len(node.names) else [*targets, module]


def imports(path: Path, known: set[str]) -> list[Import]:
    source = module_name(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    tree = ast.parse("\n".join(lines), filename=str(path))
    top_level = {id(n) for n in tree.body}
    for node in tree.body:  # imports under a module-level `if`/`try` still run at import time
        if isinstance(node, (ast.If, ast.Try)):
            top_level |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            targets = _resolve_from(source, node, path.name == "__init__.py", known)
        else:
            continue
        text = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        marked = MARKER in text and text.split(MARKER, 1)[1].strip() != ""
        for target in targets:
            found.append(Import(source, path, node.lineno, target, id(node) in top_level, marked))
    return sorted(found, key=lambda imp: imp.line)


def all_imports() -> list[Import]:
    mods = modules()
    return [imp for path in mods.values() for imp in imports(path, set(mods))]


def _where(imp: Import) -> str:
    return f"{imp.file.relative_to(ROOT)}:{imp.line}"


def upward_imports() -> list[str]:
    out = []
    for imp in all_imports():
        is_dpbert = imp.target == "dpbert" or imp.target.startswith("dpbert.")
        if is_dpbert and layer(imp.target) > layer(imp.source):
            out.append(
                f"{_where(imp)}: {imp.source} (layer {layer(imp.source)}) imports {imp.target} "
                f"(layer {layer(imp.target)}): imports must point down"
            )
    return out


def privacy_outside_imports() -> list[str]:
    out = []
    for imp in all_imports():
        if not imp.source.startswith("dpbert.privacy"):
            continue
        root = imp.target.split(".")[0]
        if root == "__future__" or root in sys.stdlib_module_names or root in PRIVACY_THIRD_PARTY:
            continue
        if imp.target.startswith(("dpbert.privacy", "dpbert.atomic")):
            continue
        out.append(
            f"{_where(imp)}: {imp.source} imports {imp.target}: the DP core imports only the standard library, "
            f"{', '.join(sorted(PRIVACY_THIRD_PARTY))}, dpbert.privacy and dpbert.atomic"
        )
    return out


def undeclared_function_imports() -> list[str]:
    return [
        f"{_where(imp)}: {imp.source} imports {imp.target} inside a function: move it to the module top, or "
        f"mark the line '{MARKER} <measured import-time reason>'"
        for imp in all_imports()
        if not imp.top and not imp.marked
    ]


def cycles() -> list[str]:
    """Every strongly connected component of more than one dpbert module (or a module importing itself)."""
    graph: dict[str, dict[str, Import]] = {m: {} for m in modules()}
    for imp in all_imports():
        if imp.target in graph:
            graph[imp.source].setdefault(imp.target, imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
            if len(component) > 1 or v in graph[v]:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for component in components:  # name cycles through the component until every edge is on one
        members = set(component)
        uncovered = [(m, t) for m in component for t in sorted(graph[m]) if t in members]
        while uncovered:
            start, first = uncovered[0]
            path = _shortest_path(graph, first, start, members)
            edges = list(zip([start, *path[:-1]], path, strict=True))
            uncovered = [e for e in uncovered if e not in edges]
            out.append(
                "import cycle "
                + " -> ".join([start, *path])
                + ": "
                + "; ".join(f"{_where(graph[a][b])}: {a} -> {b}" for a, b in edges)
            )
    return out


def _shortest_path(graph: dict[str, dict[str, Import]], begin: str, end: str, members: set[str]) -> list[str]:
    """Modules from `begin` to `end` (both included) along imports inside `members`, fewest steps."""
    parent: dict[str, str | None] = {begin: None}
    frontier = [begin]
    while end not in parent:
        step = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w in members and w not in parent:
                    parent[w] = v
                    step.append(w)
        frontier = step
    path = [end]
    while path[-1] != begin:
        path.append(parent[path[-1]])
    return path[::-1]


def _fail(problems: list[str]) -> None:
    assert not problems, f"{len(problems)} violation(s):\n" + "\n".join(problems)


def test_every_part_of_dpbert_has_a_layer():
    for module in modules():
        layer(module)


def test_imports_point_down():
    _fail(upward_imports())


def test_privacy_imports_only_the_dp_core_dependencies():
    _fail(privacy_outside_imports())


def test_no_import_cycles():
    _fail(cycles())


def test_imports_sit_at_module_top_unless_a_reason_is_named():
    _fail(undeclared_function_imports())


def test_the_checker_finds_each_kind_of_violation(tmp_path, monkeypatch):
    """The rules catch what they claim to: an upward, a privacy-external, an unmarked function-level import
    and a cycle, each named by file and line; a marked deferred import passes."""
    pkg = tmp_path / "dpbert"
    for sub in ("privacy", "data", "release"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "a.py").write_text("from dpbert.release import b\n")
    (pkg / "release" / "b.py").write_text(
        "def f():\n    import json\n\n\ndef g():\n    import yaml  # deferred: 40 ms at import\n"
        "\n\ndef h():\n    from dpbert.data import a\n"
    )
    (pkg / "privacy" / "c.py").write_text("import numpy\nimport transformers\nfrom . import c\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)

    assert upward_imports() == [
        "dpbert/data/a.py:1: dpbert.data.a (layer 1) imports dpbert.release.b (layer 2): imports must point down"
    ]
    assert [p.split(": ")[0] + ": " + p.split(": ")[1] for p in privacy_outside_imports()] == [
        "dpbert/privacy/c.py:2: dpbert.privacy.c imports transformers"
    ]
    unmarked = undeclared_function_imports()
    assert [p.split(" inside")[0] for p in unmarked] == [
        "dpbert/release/b.py:2: dpbert.release.b imports json",
        "dpbert/release/b.py:10: dpbert.release.b imports dpbert.data.a",
    ]
    found = cycles()
    assert found == [
        "import cycle dpbert.data.a -> dpbert.release.b -> dpbert.data.a: "
        "dpbert/data/a.py:1: dpbert.data.a -> dpbert.release.b; dpbert/release/b.py:10: dpbert.release.b -> dpbert.data.a",
        "import cycle dpbert.privacy.c -> dpbert.privacy.c: dpbert/privacy/c.py:3: dpbert.privacy.c -> dpbert.privacy.c",
    ]
