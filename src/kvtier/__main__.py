"""The ``kvtier`` command (``python -m kvtier``, or the ``kvtier`` script)."""

import os
import sys


def main() -> int:
    if sys.argv[1:2] == ["serve"]:
        # The cache server does no BLAS: spare it OpenBLAS's pool (a thread per
        # core, started when numpy loads, so this must come before any import).
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from kvtier.commands.cli import main as run

    return run()


if __name__ == "__main__":
    raise SystemExit(main())
