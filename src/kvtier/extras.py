"""Commands that need an optional extra say which, and how to install it."""

from __future__ import annotations

import sys


def missing_extra(command: str, exc: ImportError, install: str) -> int:
    """Print what ``kvtier COMMAND`` lacks and the pip command that adds it; exit status 2."""
    print(
        f"kvtier {command} needs an optional extra ({exc.name} is missing): pip install {install}",
        file=sys.stderr,
    )
    return 2
