"""One ``kvtier bench`` session: the trace, the model, the settings every
configuration shares, each configuration in turn with a progress display, the
fault run, then the report, the plots and the raw JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvtier import __version__
from kvtier.bench import plots
from kvtier.bench.configs import CONFIGURATIONS, BenchSettings, Remote
from kvtier.bench.engines import EngineOptions
from kvtier.bench.replay import RequestResult
from kvtier.bench.report import markdown, targets
from kvtier.bench.runner import ConfigRun, fault_summary, reference_tokens, run_configuration
from kvtier.paths import cache_home
from kvtier.traces import (
    ChatSpec,
    RagSpec,
    ReplaySpec,
    SkippedLines,
    TraceRequest,
    chat_trace,
    is_mooncake_file,
    load_trace,
    rag_trace,
    read_trace,
)
from kvtier.traces import write_trace as save_trace

BLOCK = 128  # vLLM-CPU's KV block (tokens)
CHUNK = 256  # kvtier's and LMCache's chunk (tokens)
MIN_SMALL_L1 = 8 << 20
SMALL_L1_SHARE = 0.4  # apc+l1+remote's L1, as a share of the working set


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """What ``kvtier bench`` was asked to do (``command.py`` fills it from flags)."""

    workload: str = "rag"
    trace_path: Path | None = None
    configs: tuple[str, ...] = ("apc", "apc+l1", "apc+l1+remote", "lmcache")
    remote: Remote = "redis"
    fault: tuple[float, float] | None = (0.35, 0.65)
    trace_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    replay: ReplaySpec = dataclasses.field(default_factory=ReplaySpec)  # a Mooncake trace file
    vllm_kv_tokens: int | None = None
    l1_size_bytes: int = 1 << 30
    small_l1_size_bytes: int | None = None
    slo_ttft_s: float = 0.5
    model_dir: Path | None = None
    lmcache_venv: Path | None = None
    out: Path = Path("kvtier-bench")
    command: str = "kvtier bench"

    def __post_init__(self) -> None:
        unknown = [name for name in self.configs if name not in CONFIGURATIONS]
        if unknown or not self.configs:
            raise ValueError(
                f"--configs: unknown {unknown or 'empty list'}; "
                f"pick from {', '.join(CONFIGURATIONS)}"
            )
        if self.fault is not None and not 0 < self.fault[0] < self.fault[1] < 1:
            raise ValueError("--kill-at and --restart-at must satisfy 0 < KILL < RESTART < 1")
        if self.slo_ttft_s <= 0:
            raise ValueError("--slo-ttft-s must be positive")


def build_trace(request: BenchRequest) -> tuple[list[TraceRequest], str]:
    """The trace and a one-line description of it."""
    if request.trace_path is not None:
        path, replay = request.trace_path, request.replay
        if not is_mooncake_file(path, replay.max_line_bytes):
            return read_trace(path, replay.max_line_bytes), f"file {path}"
        skipped = SkippedLines()
        trace = load_trace(path, replay, skipped)
        return trace, (
            f"Mooncake trace {path} ({_describe(replay)}; {len(trace)} requests, "
            f"{skipped.count} bad lines skipped)"
        )
    spec_type: type[RagSpec] | type[ChatSpec] = RagSpec if request.workload == "rag" else ChatSpec
    names = {f.name for f in dataclasses.fields(spec_type)}
    options = {k: v for k, v in request.trace_options.items() if k in names}
    if isinstance(spec := spec_type(**options), RagSpec):
        return rag_trace(spec), f"RAG ({_describe(spec)})"
    return chat_trace(spec), f"chat ({_describe(spec)})"


def _describe(spec: RagSpec | ChatSpec | ReplaySpec) -> str:
    return ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(spec).items())


def working_set_chunks(trace: list[TraceRequest], chunk: int = CHUNK) -> int:
    """Distinct full chunks (as prefixes: a chunk's KV depends on all before it)."""
    seen: set[int] = set()
    for request in trace:
        parent = 0
        for start in range(0, len(request.prompt) - chunk + 1, chunk):
            parent = hash((parent, request.prompt[start : start + chunk]))
            seen.add(parent)
    return len(seen)


def _round_up(n: int, to: int) -> int:
    return math.ceil(n / to) * to


def bench_model(model_dir: Path | None, longest: int) -> tuple[Path, int, int]:
    """The bench model's directory, its vocabulary and its KV bytes per token."""
    from kvtier.models import DEMO_MODEL, demo_model

    positions = max(int(DEMO_MODEL["max_position_embeddings"]), 1 << math.ceil(math.log2(longest)))
    model, path = demo_model(model_dir, max_position_embeddings=positions)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # fp32
    return path, int(config.vocab_size), kv_bytes


def _request_rows(results: list[RequestResult]) -> list[dict[str, Any]]:
    return [
        {
            "id": r.id,
            "sent_s": r.sent_s,
            "ttft_s": r.ttft_s,
            "tokens": len(r.tokens),
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "error": r.error,
        }
        for r in results
    ]


def _timeline(run: ConfigRun) -> list[dict[str, Any]]:
    keep = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")
    return [
        {
            "t_s": s.t_s,
            "rss_bytes": s.rss_bytes,
            **{k: v for k, v in s.counters.items() if k in keep or "hit_tokens" in k},
        }
        for s in run.samples
    ]


def run_bench(request: BenchRequest, console: Console | None = None) -> dict[str, Any]:
    """Run every configuration and the fault run; write the report; return the results."""
    console = console or Console(stderr=True)
    trace, described = build_trace(request)
    longest = max(len(r.prompt) + r.output_tokens for r in trace)
    model, vocab_size, kv_bytes = bench_model(request.model_dir, longest)
    if max(max(r.prompt) for r in trace) >= vocab_size:
        raise ValueError(f"--trace: token ids must be below the model's vocabulary ({vocab_size})")
    chunks = working_set_chunks(trace)
    working_set = chunks * CHUNK * kv_bytes
    max_model_len = _round_up(longest, BLOCK)
    vllm_tokens = request.vllm_kv_tokens or max_model_len + 2 * BLOCK
    small_l1 = request.small_l1_size_bytes or max(
        MIN_SMALL_L1, _round_up(int(working_set * SMALL_L1_SHARE), 1 << 20)
    )
    measured = [r for r in trace if not r.warm]
    out = request.out
    out.mkdir(parents=True, exist_ok=True)
    save_trace(out / "trace.jsonl", trace)
    settings = BenchSettings(
        engine=EngineOptions(model, max_model_len, vllm_tokens * kv_bytes),
        workdir=out,
        l1_size_bytes=request.l1_size_bytes,
        small_l1_size_bytes=small_l1,
        remote=request.remote,
        chunk_size=CHUNK,
        lmcache_venv=request.lmcache_venv or cache_home() / "bench" / "lmcache-venv",
    )
    plan: list[tuple[str, tuple[float, float] | None]] = [(n, None) for n in request.configs]
    if request.fault is not None and "apc+l1+remote" in request.configs:
        plan.append(("apc+l1+remote", request.fault))
    runs: dict[str, ConfigRun] = {}
    reference: dict[str, list[int]] | None = None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        tasks: dict[str, Any] = {}

        for name, fault in plan:
            label = f"{name} (fault)" if fault else name
            console.log(f"starting {label}")

            def update(config: str, result: RequestResult | None, label: str = label) -> None:
                if result is None:
                    tasks[label] = progress.add_task(label, total=len(measured))
                else:
                    progress.advance(tasks[label])

            run = run_configuration(
                name,
                settings,
                trace,
                request.slo_ttft_s,
                kv_bytes,
                vocab_size,
                reference,
                update,
                fault,
            )
            runs["fault" if fault else name] = run
            if reference is None:
                reference = reference_tokens(run)
            summary = run.summary
            console.log(
                f"{label}: TTFT p50 {(summary['ttft_p50_s'] or 0) * 1e3:,.0f} ms, hit ratio "
                f"{summary['hit_ratio']:.0%}, failed {summary['failed_requests']}, "
                f"output differences {summary['output_mismatches']}"
            )
    configs = {name: run.summary for name, run in runs.items() if name != "fault"}
    fault_report = (
        fault_summary(runs["fault"], runs.get("apc+l1+remote"), request.remote)
        if "fault" in runs
        else None
    )
    figures = ["ttft_cdf.png", "hits_over_time.png"]
    clean = {name: run for name, run in runs.items() if name != "fault"}
    plots.ttft_cdf(clean, out / figures[0])
    plots.hits_over_time(clean, out / figures[1], CHUNK)
    if "fault" in runs:
        figures.append("fault_timeline.png")
        plots.fault_timeline(runs["fault"], out / figures[2])
    results: dict[str, Any] = {
        "kvtier_version": __version__,
        "command": request.command,
        "reference": request.configs[0],
        "trace": {
            "workload": described,
            "requests": len(measured),
            "warm_requests": len(trace) - len(measured),
            "prompt_tokens": sum(len(r.prompt) for r in measured),
            "unique_chunks": chunks,
            "working_set_bytes": working_set,
            "span_s": max(r.arrival_s for r in measured),
            "path": str(out / "trace.jsonl"),
        },
        "settings": {
            "model": str(model),
            "kv_bytes_per_token": kv_bytes,
            "vllm_kv_tokens": vllm_tokens,
            "max_model_len": max_model_len,
            "l1_size_bytes": request.l1_size_bytes,
            "small_l1_size_bytes": small_l1,
            "remote": request.remote,
            "chunk_size": CHUNK,
            "slo_ttft_s": request.slo_ttft_s,
        },
        "configurations": configs,
        "fault": fault_report,
        "targets": targets(configs, fault_report),
        "plots": figures,
        "requests": {name: _request_rows(run.results) for name, run in runs.items()},
        "timeline": {name: _timeline(run) for name, run in runs.items()},
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "report.md").write_text(markdown(results) + "\n")
    console.print(markdown({**results, "plots": []}))
    console.log(f"report: {out / 'report.md'}")
    return results


__all__ = ["BenchRequest", "build_trace", "run_bench", "working_set_chunks"]
