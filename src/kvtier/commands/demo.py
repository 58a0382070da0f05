"""``kvtier demo``: a RAG-style trace on a small transformers model, run with
no cache and through a kvtier server (cold, then warm), with TTFT, hits by
tier and an output comparison against the no-cache run.

Nothing is downloaded and no service is needed. The model is
``kvtier.models``'s small random-weight Llama (15.5 M parameters, fp32). The
server runs in a child process with an L1 of
``l1_size`` (small on purpose, so some chunks come back from disk) and an fs
L2 in a temporary directory that is removed at the end.

Each cached pass also shows what the server's savings ledger says it saved
(the tokens loaded, priced at what one more computed token costs the
engine, less the seconds spent loading them: its net, ``kvtier.tenancy.ledger``)
beside what it measurably saved: the sum, over the requests that loaded
something, of their no-cache TTFT less their TTFT in the pass.

The trace (``rag_trace``): a shared system prompt, a pool of documents with
Zipf popularity, and questions that each put one or two documents after the
system prompt. Prompts are token ids: with random weights, text would mean
nothing anyway. Only a prompt's prefix can be reused, so a request hits the
system prompt and its first document when that pair was seen before.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvtier.engine.hf import Generation, KVTierModel
from kvtier.engine.link import ServerLink
from kvtier.models import DEMO_MODEL, demo_model
from kvtier.process import ServerProcess
from kvtier.traces import RagSpec, rag_prompts
from kvtier.units import format_size

CONFIGURATIONS = ("no_cache", "kvtier_cold", "kvtier_warm")


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoOptions:
    requests: int = 16
    documents: int = 6
    system_tokens: int = 200
    doc_tokens: tuple[int, int] = (1024, 2048)
    question_tokens: tuple[int, int] = (24, 64)
    new_tokens: int = 8
    seed: int = 0
    l1_size: str = "48MiB"
    model_dir: Path | None = None  # default: under ~/.cache/kvtier/models

    def __post_init__(self) -> None:
        for name in ("requests", "documents", "system_tokens", "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("doc_tokens", "question_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"--{name.replace('_', '-')} must be MIN:MAX with 1 <= MIN <= MAX")


@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    documents: tuple[int, ...]  # which documents, in prompt order


def rag_trace(options: DemoOptions, vocab_size: int) -> list[Request]:
    """The demo's requests (``kvtier.traces``'s RAG prompts with one or
    two documents each); the same ``options.seed`` gives the same trace."""
    spec = RagSpec(
        requests=options.requests,
        rate=0,
        seed=options.seed,
        vocab_size=vocab_size,
        system_tokens=options.system_tokens,
        documents=options.documents,
        doc_tokens=options.doc_tokens,
        docs_per_request=(1, 2),
        question_tokens=options.question_tokens,
    )
    return [Request(prompt, documents) for prompt, documents in rag_prompts(spec)]


@dataclass(slots=True)
class PassResult:
    """One configuration's run of the trace, added up request by request."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    tokens_by_tier: dict[str, int] = field(default_factory=dict)
    bytes_loaded: int = 0
    bytes_stored: int = 0
    ttft_s: list[float] = field(default_factory=list)
    lookup_s: float = 0.0
    load_s: float = 0.0
    prefill_s: float = 0.0
    store_s: float = 0.0
    # Against the no-cache run (set for the cached configurations)
    outputs_identical: bool = True
    max_abs_logit_diff: float = 0.0
    speedup_p50: float = 1.0
    speedup_p95: float = 1.0
    saved_s: float = 0.0  # measured: no-cache TTFT less this pass's, where it loaded
    ledger_saved_s: float | None = None  # the server's savings ledger: its net for this pass

    def add(self, generation: Generation) -> None:
        p = generation.prefill
        self.requests += 1
        self.prompt_tokens += p.prompt_tokens
        self.hit_tokens += p.hit_tokens
        self.computed_tokens += p.computed_tokens
        for tier, n in p.tokens_by_tier.items():
            self.tokens_by_tier[tier] = self.tokens_by_tier.get(tier, 0) + n
        self.bytes_loaded += p.bytes_loaded
        self.bytes_stored += p.bytes_stored
        self.ttft_s.append(p.timings.ttft_s)
        self.lookup_s += p.timings.lookup_s
        self.load_s += p.timings.load_s
        self.prefill_s += p.timings.prefill_s
        self.store_s += p.timings.store_s

    @property
    def ttft_p50_s(self) -> float:
        return float(np.percentile(self.ttft_s, 50))

    @property
    def ttft_p95_s(self) -> float:
        return float(np.percentile(self.ttft_s, 95))


@dataclass(slots=True)
class DemoResults:
    """What ``kvtier demo`` measured; ``to_json()`` is its ``--json`` file."""

    model: dict[str, Any]  # directory, parameters and the config it was built from
    trace: dict[str, int]
    server: dict[str, str] = field(default_factory=dict)
    passes: dict[str, PassResult] = field(default_factory=dict)  # by configuration

    @property
    def outputs_identical(self) -> bool:
        return all(self.passes[n].outputs_identical for n in CONFIGURATIONS[1:])

    @property
    def max_abs_logit_diff(self) -> float:
        return max(self.passes[n].max_abs_logit_diff for n in CONFIGURATIONS[1:])

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "trace": self.trace, "server": self.server}
        for name, result in self.passes.items():
            out[name] = {
                **asdict(result),
                "ttft_p50_s": result.ttft_p50_s,
                "ttft_p95_s": result.ttft_p95_s,
                "ttft_mean_s": float(np.mean(result.ttft_s)),
            }
        out["outputs_identical"] = self.outputs_identical
        out["max_abs_logit_diff"] = self.max_abs_logit_diff
        return out


Step = Callable[[str], None]  # called after each request with the configuration's name


def run_pass(
    engine: KVTierModel, trace: Sequence[Request], new_tokens: int, name: str, step: Step
) -> tuple[PassResult, list[Generation]]:
    result, generations = PassResult(), []
    for request in trace:
        generation = engine.generate(request.prompt, new_tokens)
        result.add(generation)
        generations.append(generation)
        step(name)
    return result, generations


def compare(reference: Sequence[Generation], other: Sequence[Generation]) -> tuple[bool, float]:
    """(greedy tokens equal for every request, max |logit difference| over every step)."""
    same = all(a.tokens == b.tokens for a, b in zip(reference, other, strict=True))
    diff = 0.0
    for a, b in zip(reference, other, strict=True):
        steps = min(len(a.tokens), len(b.tokens))
        diff = max(diff, float((a.logits[:steps] - b.logits[:steps]).abs().max()))
    return same, diff


def run_demo(options: DemoOptions, console: Console | None = None) -> DemoResults:
    """Run the three configurations; return what they measured."""
    console = console or Console(stderr=True)
    with console.status("loading the demo model"):
        model, model_dir = demo_model(options.model_dir)
    trace = rag_trace(options, model.config.vocab_size)
    parameters = sum(p.numel() for p in model.parameters())
    results = DemoResults(
        model={"directory": str(model_dir), "parameters": parameters, **DEMO_MODEL},
        trace={
            "requests": len(trace),
            "documents": options.documents,
            "prompt_tokens": sum(len(r.prompt) for r in trace),
            "new_tokens_per_request": options.new_tokens,
            "seed": options.seed,
        },
    )
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        server = ServerProcess.start(
            ["--port", "0", "--http-port", "-1", "--l1-size", options.l1_size,
             "--cache-dir", str(Path(tmp) / "l2")],
            Path(tmp) / "server.log",
        )  # fmt: skip
        try:
            reference = KVTierModel(model)
            reference.prefill(trace[0].prompt[: options.system_tokens])  # one-off start-up costs
            with KVTierModel(model, server=server.rpc, name="kvtier-demo/llama") as cached:
                results.server = {"rpc": server.rpc, "l1_size": options.l1_size, "l2": "fs"}
                generations = _run_all(reference, cached, trace, options, results, console)
        finally:
            code = server.stop()
        if code != 0:
            raise RuntimeError(f"the demo's kvtier server exited {code}; log:\n{server.log}")
    base = results.passes["no_cache"]
    for name in CONFIGURATIONS[1:]:
        result = results.passes[name]
        result.outputs_identical, result.max_abs_logit_diff = compare(
            generations["no_cache"], generations[name]
        )
        result.speedup_p50 = base.ttft_p50_s / result.ttft_p50_s
        result.speedup_p95 = base.ttft_p95_s / result.ttft_p95_s
        result.saved_s = sum(
            before - after
            for before, after, g in zip(base.ttft_s, result.ttft_s, generations[name], strict=True)
            if g.prefill.hit_tokens
        )
    return results


def _ledger_saved(engine: KVTierModel) -> float | None:
    """The seconds the server's savings ledger says the cache saved so far,
    net of the loads (None: it cannot say: no server, or no rate known yet).
    The usage reports went before on the same connection, so they are in."""
    client = engine.link.client if isinstance(engine.link, ServerLink) else None
    status = None if client is None else client.status()
    if status is None:
        return None
    saved = [e.net_seconds for e in status.ledger]
    if any(s is None for s in saved):
        return None
    return float(sum(s for s in saved if s is not None))


def _run_all(
    reference: KVTierModel,
    cached: KVTierModel,
    trace: Sequence[Request],
    options: DemoOptions,
    results: DemoResults,
    console: Console,
) -> dict[str, list[Generation]]:
    engines = {"no_cache": reference, "kvtier_cold": cached, "kvtier_warm": cached}
    generations = {}
    with Progress(console=console, transient=True) as progress:
        tasks = {n: progress.add_task(n.replace("_", " "), total=len(trace)) for n in engines}

        def step(name: str) -> None:
            progress.advance(tasks[name])

        before = 0.0
        for name, engine in engines.items():
            results.passes[name], generations[name] = run_pass(
                engine, trace, options.new_tokens, name, step
            )
            if engine is cached:  # this pass's share of the ledger
                total = _ledger_saved(cached)
                results.passes[name].ledger_saved_s = None if total is None else total - before
                before = total if total is not None else before
    return generations


def format_report(results: DemoResults) -> Table:
    """The results as a table, one column per configuration."""
    table = Table(
        title=f"kvtier demo: {results.trace['requests']} RAG requests, random-weight Llama "
        f"({results.model['parameters'] / 1e6:.1f} M parameters, fp32)"
    )
    table.add_column("")
    for name in CONFIGURATIONS:
        table.add_column(name.replace("_", " "), justify="right")
    r = [results.passes[name] for name in CONFIGURATIONS]
    identical = ["reference"] + [
        f"{'yes' if x.outputs_identical else 'NO'} ({x.max_abs_logit_diff:.1e})" for x in r[1:]
    ]
    rows = {
        "prompt tokens": [f"{x.prompt_tokens:,}" for x in r],
        "hit tokens": [f"{x.hit_tokens:,} ({x.hit_tokens / x.prompt_tokens:.0%})" for x in r],
        "  from L1": [f"{x.tokens_by_tier.get('L1', 0):,}" for x in r],
        "  from L2 (fs)": [
            f"{sum(n for t, n in x.tokens_by_tier.items() if t != 'L1'):,}" for x in r
        ],
        "TTFT p50": [f"{x.ttft_p50_s * 1000:.0f} ms" for x in r],
        "TTFT p95": [f"{x.ttft_p95_s * 1000:.0f} ms" for x in r],
        "speed-up p50 / p95": [f"{x.speedup_p50:.2f}x / {x.speedup_p95:.2f}x" for x in r],
        "KV loaded / stored": [
            f"{format_size(x.bytes_loaded)} / {format_size(x.bytes_stored)}" for x in r
        ],
        "saved, measured": ["-"] + [f"{x.saved_s:.2f} s" for x in r[1:]],
        "saved, per the ledger (net)": ["-"] + [_seconds(x.ledger_saved_s) for x in r[1:]],
        "outputs identical (max |Δlogit|)": identical,
    }
    for label, cells in rows.items():
        table.add_row(label, *cells)
    return table


def _seconds(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f} s"
