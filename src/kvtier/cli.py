"""The ``kvtier`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from kvtier import __version__
from kvtier.units import parse_size


def _version(args: argparse.Namespace) -> int:
    print(f"kvtier {__version__}")
    return 0


def _selfcheck(args: argparse.Namespace) -> int:
    from kvtier.selfcheck import format_report, run_selfcheck

    report = run_selfcheck(l1_size=parse_size(args.l1_size, "--l1-size"))
    if args.json:
        print(json.dumps({"ok": report.ok, **dataclasses.asdict(report)}, indent=2))
    else:
        print(format_report(report))
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("version", help="print the version").set_defaults(run=_version)
    check = commands.add_parser(
        "selfcheck", help="store, look up and read back a prompt's chunks through L1 and an fs L2"
    )
    check.add_argument("--l1-size", default="256MiB", help="L1 arena size (default 256MiB)")
    check.add_argument("--json", action="store_true", help="print the result as JSON")
    check.set_defaults(run=_selfcheck)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except ValueError as exc:
        print(f"kvtier {args.command}: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
