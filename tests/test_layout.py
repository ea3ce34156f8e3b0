"""The package layout is the architecture (docs/architecture.md): no module imports one that imports it back, and
the engine's parts import each other in one direction only. Every import counts, including those inside functions
and under ``if TYPE_CHECKING`` (a lazy import hides a cycle; it does not remove it)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "gdnserve"


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the gdnserve modules it imports (a name imported from a package counts as its submodule when
    there is one; ``from x import y`` of a plain name counts as x)."""
    mods = modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[:len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for n in names:
                target = owner(n)
                if target is not None and target != mod:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_lazy_two_file_cycle():
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def imports_of(prefix: str, graph: dict[str, set[str]]) -> set[str]:
    return {t for m, ts in graph.items() if m == prefix or m.startswith(prefix + ".") for t in ts}


def test_engine_parts_import_one_way():
    g = import_graph()
    e = "gdnserve.engine"
    leaves = {f"{e}.config", f"{e}.engine_api", f"{e}.sampling_params", f"{e}.detokenizer"}

    def engine_deps(part: str) -> set[str]:
        assert any(m.startswith(f"{e}.{part}.") for m in g), f"no engine/{part}/ package"
        return {t for t in imports_of(f"{e}.{part}", g) if t.startswith(e + ".") and not t.startswith(f"{e}.{part}.")}

    assert engine_deps("cache") <= leaves
    assert engine_deps("execution") <= leaves | {t for t in g if t.startswith(f"{e}.cache.")}
    assert engine_deps("scheduling") <= leaves | {t for t in g if t.startswith(f"{e}.cache.")}, \
        "scheduling imports the runner or the loop"


def test_entrypoints_do_not_import_replicas():
    """Replicas serve through the entrypoints' server; the CLI that offers ``serve --replicas`` sits above both."""
    g = import_graph()
    assert not {t for t in imports_of("gdnserve.entrypoints", g) if t.startswith("gdnserve.replicas")}
