"""The layering, read from the source with ast: no import cycle among the project's modules (lazy imports inside
functions count: they are cycles all the same), the packages import one way, app -> precompute -> prism, and
kronfluence (a benchmark dependency) is imported only beside the benchmarks."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("prism", "precompute", "app", "bench")
LAYER = {"prism": 0, "precompute": 1, "app": 2, "bench": 3}  # a module may import its own layer and those below


def modules() -> dict[str, Path]:
    """{dotted name: file} for every module of the packages, sub-packages included (a package is its __init__)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its source (`from a import b` counts a.b when that is a
    module, else a)."""
    out = set()
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, node.level - 1 packages up
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return found


def test_the_detector_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_project_modules():
    edges = graph()
    assert len(edges) > 40 and edges["app.ui"] and "app.core" in edges["app.ui"]
    assert cycles(edges) == []


def test_packages_import_downwards_only():
    wrong = [(a, b) for a, targets in graph().items() for b in targets
             if LAYER[b.split(".")[0]] > LAYER[a.split(".")[0]]]
    assert wrong == []


def test_kronfluence_is_imported_only_beside_the_benchmarks():
    """The EK-FAC peer's library is installed with --no-deps for the benchmark; the library, the jobs, the app and
    the tests never import it themselves."""
    files = [p for p in ROOT.rglob("*.py") if ".venv" not in p.parts and p.relative_to(ROOT).parts[0] != "bench"]
    assert any(p.name == "app.py" for p in files) and len(files) > 60
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "kronfluence"]
    assert found == []
    assert "kronfluence" in (ROOT / "bench" / "attribution_ekfac.py").read_text()
