"""``--json FILE``: how every ``kvtier`` subcommand writes its results as JSON.

One meaning across subcommands: ``--json FILE`` writes the results to FILE,
``--json -`` to standard output (then the readable report goes to standard
error, so the output stays parseable).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

JSON_HELP = "also write the results as JSON to FILE ('-': standard output)"


def write_json(target: str, data: Any) -> None:
    text = json.dumps(data, indent=2, default=str) + "\n"
    if target == "-":
        sys.stdout.write(text)
    else:
        Path(target).write_text(text)


def report_stream(json_target: str | None) -> Any:
    """Where the readable report goes: stderr when the JSON takes stdout."""
    return sys.stderr if json_target == "-" else sys.stdout
