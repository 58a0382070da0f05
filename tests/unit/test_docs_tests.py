"""The pages that name tests (docs/guarantees.md, docs/defects.md): every
guarantee and every defect names a test, and every test named exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
REFERENCE = re.compile(r"`(tests/[\w/]+\.py)?(?:::(\w+))?`")


def named_tests(text: str, where: str) -> list[tuple[Path, str | None]]:
    """``tests/x.py::name`` references in order; ``::name`` alone is in the
    last file named; a file alone stands for its whole module."""
    named: list[tuple[Path, str | None]] = []
    current: Path | None = None
    for match in REFERENCE.finditer(text):
        path, name = match.groups()
        if path:
            current = ROOT / path
            assert current.exists(), f"{where}: {path} does not exist"
        if name:
            assert current is not None, f"{where}: ::{name} names no file"
            named.append((current, name))
        elif path and current is not None:
            named.append((current, None))
    for module, name in named:
        if name is not None:
            found = re.search(rf"^(async )?def {name}\(", module.read_text(), re.MULTILINE)
            assert found, f"{where}: {module.relative_to(ROOT)} has no test {name}"
    return named


def test_every_guarantee_names_tests_that_exist() -> None:
    parts = re.split(r"^## ", (DOCS / "guarantees.md").read_text(), flags=re.MULTILINE)[1:]
    guarantees = {p.splitlines()[0]: p for p in parts if p[0].isdigit()}
    assert len(guarantees) >= 8
    for title, text in guarantees.items():
        assert named_tests(text, title), f"{title}: names no test"


def test_every_defect_has_a_reproducer_that_exists() -> None:
    rows = [
        line for line in (DOCS / "defects.md").read_text().splitlines() if line.startswith("| `")
    ]
    assert len(rows) >= 50
    names = [row.split("`")[1] for row in rows]
    assert len(set(names)) == len(names), "a defect is listed twice"
    for row, name in zip(rows, names, strict=True):
        assert len(named_tests(row, name)) == 1, f"{name}: one reproducer, a test"
