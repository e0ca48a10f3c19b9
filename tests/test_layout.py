"""The layout's promises, read from the files: the design document is in the repository and every citation of it
points at a section that exists (nothing cites the brief outside the repository), and no module is over about 600
lines without saying why in its docstring."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "DESIGN.md"
MAX_LINES = 600
KNOWN_LONG: set[str] = set()  # modules allowed over MAX_LINES without a reason in their docstring: none


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in listed if Path(f).suffix in (".py", ".md", ".txt", ".toml", ".cfg", ".yml", ".yaml")
            and (ROOT / f).is_file()]


def test_design_citations_point_at_existing_sections():
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", DESIGN.read_text(), re.MULTILINE)}
    assert sections == set(range(1, 11))
    cited = {}
    for path in tracked_text_files():
        for n in re.findall(r"DESIGN\.md sections? (\d+)", path.read_text(errors="replace")):
            cited.setdefault(int(n), []).append(str(path.relative_to(ROOT)))
    assert len(cited) >= 6, cited
    assert set(cited) <= sections, {n: files for n, files in cited.items() if n not in sections}


def test_nothing_cites_a_document_outside_the_repository():
    brief = "PRISM" + ".md"  # spelled in two parts so this file does not cite it either
    citing = [str(p.relative_to(ROOT)) for p in tracked_text_files() if brief in p.read_text(errors="replace")]
    assert citing == []


def test_long_modules_say_why():
    """A module over MAX_LINES is listed in its own docstring's "Length: about N lines" with the reason, and N is
    the module's length within 10% (a stale or copied length paragraph fails)."""
    too_long, stale = [], []
    for package in ("prism", "precompute", "bench", "app", "recipes", "tools"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            n_lines = len(path.read_text().splitlines())
            docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
            stated = re.search(r"^Length: (?:about |over )?([\d,]+) lines", docstring, re.MULTILINE)
            if n_lines > MAX_LINES and stated is None and name not in KNOWN_LONG:
                too_long.append(f"{name}: {n_lines} lines")
            if stated is not None and abs(int(stated.group(1).replace(",", "")) - n_lines) > 0.1 * n_lines:
                stale.append(f"{name}: says {stated.group(1)} lines, has {n_lines}")
            if name in KNOWN_LONG:
                assert n_lines > MAX_LINES, f"{name} is short now: remove it from KNOWN_LONG"
    assert too_long == []
    assert stale == []
