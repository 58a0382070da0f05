"""Every package under src/kvtier is a regular package, so ``pip install .``
(not only an editable install) ships it."""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "kvtier"


def test_every_package_directory_has_an_init() -> None:
    missing = [
        str(d.relative_to(SRC))
        for d in SRC.rglob("*")
        if d.is_dir()
        and d.name != "__pycache__"
        and any(d.glob("*.py"))
        and not (d / "__init__.py").exists()
    ]
    assert missing == []
