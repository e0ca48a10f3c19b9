"""The layering, read from the source with ast: no import cycle among the project's modules (lazy imports inside
functions count: they are cycles all the same), the packages import one way (recipes -> bench, tools -> app ->
precompute -> prism), nothing in prism/ or precompute/ runs a benchmark, no SQL outside precompute/, and kronfluence
(a benchmark dependency) is imported only beside the benchmarks."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("prism", "precompute", "app", "bench", "tools", "recipes")
# a module may import its own layer and those below
LAYER = {"prism": 0, "precompute": 1, "app": 2, "bench": 3, "tools": 3, "recipes": 4}
SQL = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE|CREATE|ALTER|DROP|ATTACH|COPY|PRAGMA)\b.+\b(FROM|INTO|TABLE|SET|"
                 r"DATABASE|TO|WHERE)\b", re.DOTALL)


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


def _strings(package: str) -> list[tuple[str, str]]:
    """(file, string constant) for every string literal in a package's modules."""
    return [(str(path.relative_to(ROOT)), node.value) for path in sorted((ROOT / package).rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_the_checks_below_see_what_they_look_for():
    assert SQL.search("SELECT count(*) FROM presets") and SQL.search("DROP TABLE labels")
    assert not SQL.search("Select a prototype from the table") and not SQL.search("a DROP of 3% from the top")
    assert any(s == "bench.behaviour_removal" for _, s in _strings("recipes"))  # the release runs benchmarks
    assert any(SQL.search(s) for _, s in _strings("precompute"))


def test_nothing_in_the_library_or_the_jobs_runs_a_benchmark():
    """Not imported (test_packages_import_downwards_only) and not started as a subprocess by module name either."""
    found = [f"{f}: {s}" for package in ("prism", "precompute") for f, s in _strings(package)
             if re.fullmatch(r"bench(\.\w+)+", s.strip())]
    assert found == []


def test_no_sql_outside_precompute():
    """The app reads the database only through precompute/query.py (and precompute/search.py): no SQL text in
    app/, and none in the library."""
    probe_text = "prism/probe.py"  # held-out passages the model reads (one is a SQL snippet): text, not a query
    found = [f"{f}: {s[:60]!r}" for package in ("app", "prism", "tools") for f, s in _strings(package)
             if SQL.search(s) and f != probe_text]
    assert found == []
