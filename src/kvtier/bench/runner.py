"""Run a trace through each configuration in turn, then the fault run.

For each configuration: start it (``configs.serve``), warm it up with a few
requests that share nothing with the trace (one-off costs of vLLM's first
shapes), then replay the trace while a ``Sampler`` records counters and
memory, and summarize against the reference configuration's outputs (the
first one run, ``apc`` by default). The fault run replays the trace once more
on ``apc+l1+remote`` and kills its L2 store at ``kill_at`` of the trace's
span, restarting it (empty) at ``restart_at``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from kvtier.bench.configs import CONFIGURATIONS, BenchSettings, Running, serve
from kvtier.bench.replay import RequestResult, replay, send
from kvtier.bench.sampler import (
    L2_LOADS,
    RESEED_PENDING,
    RESEEDED,
    RESEEDS,
    Sample,
    Sampler,
    by_key,
)
from kvtier.bench.summary import percentiles, summarize
from kvtier.traces import TraceRequest

WARM_UP_REQUESTS = 3

Progress = Callable[[str, RequestResult | None], None]  # (config, result or None: started)


@dataclass(slots=True)
class ConfigRun:
    name: str
    results: list[RequestResult]
    samples: list[Sample]
    summary: dict[str, Any]
    events: dict[str, float] = field(default_factory=dict)  # fault: kill/restart times


def warm_up(running: Running, model: str, trace: Sequence[TraceRequest], vocab_size: int) -> None:
    """vLLM's one-off costs first (a few requests as long as the trace's, from
    tokens it never uses), then the trace's own warm requests; one at a time,
    not measured."""
    rng = np.random.default_rng(12345)
    length = int(np.median([len(r.prompt) for r in trace]))
    engine = [
        TraceRequest(
            f"engine-{i}", 0.0, tuple(int(t) for t in rng.integers(0, vocab_size, length)), 4
        )
        for i in range(WARM_UP_REQUESTS)
    ]
    warm = engine + [r for r in trace if r.warm]

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            for request in warm:
                result = await send(
                    session, running.engine.url, model, request, time.perf_counter()
                )
                if not result.ok:
                    raise RuntimeError(f"{running.config.name}: warm-up failed: {result.error}")

    asyncio.run(run())


async def _replay_sampled(
    running: Running,
    model: str,
    trace: Sequence[TraceRequest],
    on_result: Callable[[RequestResult], None],
    faults: Sequence[tuple[float, Callable[[], None]]] = (),
) -> tuple[list[RequestResult], list[Sample], dict[str, float]]:
    started = time.perf_counter()
    http = running.kvtier.http if running.kvtier else None
    sampler = Sampler(running.engine.url, http, running.pids, started)
    events: dict[str, float] = {}

    async def inject(at: float, action: Callable[[], None], name: str) -> None:
        await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
        events[name] = time.perf_counter() - started
        await asyncio.to_thread(action)

    sampling = asyncio.create_task(sampler.run())
    injecting = [
        asyncio.create_task(inject(at, action, name))
        for (at, action), name in zip(faults, ("kill", "restart"), strict=False)
    ]
    results = await replay(running.engine.url, model, trace, on_result, started)
    await asyncio.gather(*injecting)
    sampler.stop()
    await sampling
    return results, sampler.samples, events


def run_configuration(
    name: str,
    settings: BenchSettings,
    trace: Sequence[TraceRequest],
    slo_ttft_s: float,
    kv_bytes_per_token: int,
    vocab_size: int,
    reference: dict[str, list[int]] | None,
    progress: Progress,
    fault: tuple[float, float] | None = None,
) -> ConfigRun:
    """Start ``name``, warm it up, replay ``trace`` (with the fault, if any)."""
    config = CONFIGURATIONS[name]
    model = str(settings.engine.model)
    with serve(config, settings, f"{name}-fault" if fault else name) as running:
        warm_up(running, model, trace, vocab_size)
        progress(name, None)
        faults: list[tuple[float, Callable[[], None]]] = []
        if fault is not None:
            store = running.store
            if store is None:
                raise ValueError("the fault run needs a configuration with a remote L2")
            span = max(r.arrival_s for r in trace if not r.warm)
            faults = [(fault[0] * span, store.kill), (fault[1] * span, store.launch)]
        measured = [r for r in trace if not r.warm]
        results, samples, events = asyncio.run(
            _replay_sampled(running, model, measured, lambda r: progress(name, r), faults)
        )
    summary = summarize(
        results, samples, slo_ttft_s, kv_bytes_per_token, reference, settings.chunk_size
    )
    return ConfigRun(name, results, samples, summary, events)


def fault_summary(run: ConfigRun, clean: ConfigRun | None, remote: str) -> dict[str, Any]:
    """TTFT and hits before, during and after the store was down, next to the
    same requests in the run without the fault (``clean``: the same trace and
    configuration), and how long after the restart the hits were back."""
    kill, restart = run.events["kill"], run.events["restart"]
    baseline = {r.id: r for r in clean.results} if clean is not None else {}
    phases: dict[str, list[RequestResult]] = {"before": [], "during": [], "after": []}
    for result in run.results:
        phase = (
            "before" if result.sent_s < kill else "during" if result.sent_s < restart else "after"
        )
        phases[phase].append(result)
    report: dict[str, Any] = {"kill_s": kill, "restart_s": restart, "remote": remote}
    for phase, results in phases.items():
        report[phase] = {
            "requests": len(results),
            "failed_requests": sum(not r.ok for r in results),
            **_latency_and_hits(results),
            "without_fault": _latency_and_hits(
                [baseline[r.id] for r in results if r.id in baseline]
            ),
        }
    report["hit_recovery_s"] = _hit_recovery(phases["after"], baseline, restart)
    report["l2_hits_resume_s"] = _l2_hits_resume(run.samples, remote, restart)
    # Recovered: the store answers again and holds what L1 held (re-seeded).
    # When a load is first served from it depends on the trace (an L1 miss it
    # can serve), and when every request hits as much as without the fault on
    # what was lost with it (objects evicted from L1 while it was down).
    report["reseeded_s"], report["reseeded_objects"] = _reseeded(run.samples, remote, restart)
    report["recovery_s"] = report["reseeded_s"]
    report["failed_requests"] = run.summary["failed_requests"]
    report["output_mismatches"] = run.summary["output_mismatches"]
    return report


def _latency_and_hits(results: Sequence[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        **percentiles([r.ttft_s for r in ok if r.ttft_s is not None], "ttft"),
        "hit_tokens": sum(r.cached_tokens or 0 for r in ok),
        "hit_ratio": sum(r.cached_tokens or 0 for r in ok) / prompt if prompt else 0.0,
    }


def _hit_recovery(
    after: list[RequestResult], baseline: dict[str, RequestResult], restart: float
) -> float | None:
    """Seconds from the restart to the first request from which on every
    request hit as much as it did in the run without the fault."""
    ordered = sorted(after, key=lambda r: r.sent_s)

    def recovered(r: RequestResult) -> bool:
        clean = baseline.get(r.id)
        return clean is None or (r.cached_tokens or 0) >= (clean.cached_tokens or 0)

    for i, first in enumerate(ordered):
        if all(recovered(r) for r in ordered[i:]):
            return max(0.0, first.sent_s - restart)
    return None


def _l2_hits_resume(samples: Sequence[Sample], remote: str, restart: float) -> float | None:
    """Seconds from the restart until kvtier's lookups load from the remote tier again."""
    previous = None
    for sample in samples:
        hits = by_key(sample.counters, L2_LOADS).get(remote, 0.0)
        if sample.t_s >= restart and previous is not None and hits > previous:
            return sample.t_s - restart
        previous = hits
    return None


def _reseeded(samples: Sequence[Sample], remote: str, restart: float) -> tuple[float | None, int]:
    """Seconds from the restart until the cache server had re-seeded the remote
    store from L1 (a re-seed counted, none pending), and the objects it wrote."""
    before = None
    for sample in samples:
        reseeds = by_key(sample.counters, RESEEDS).get(remote, 0.0)
        if sample.t_s < restart:
            before = reseeds
            continue
        pending = sample.counters.get(RESEED_PENDING, 0.0)
        if before is not None and reseeds > before and pending == 0:
            objects = by_key(sample.counters, RESEEDED).get(remote, 0.0)
            return sample.t_s - restart, int(objects)
    return None, 0


def reference_tokens(run: ConfigRun) -> dict[str, list[int]]:
    return {r.id: r.tokens for r in run.results if r.ok}


__all__ = [
    "ConfigRun",
    "fault_summary",
    "reference_tokens",
    "run_configuration",
    "warm_up",
]
