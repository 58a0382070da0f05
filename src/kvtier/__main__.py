"""``python -m kvtier``: the ``kvtier`` command."""

from kvtier.commands.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
