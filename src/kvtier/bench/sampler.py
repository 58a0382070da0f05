"""Counters and memory over time, while a configuration runs.

Every ``every_s`` seconds: vLLM's ``/metrics`` (its own prefix-cache hits and
the connector's, in tokens; preemptions), kvtier's ``/metrics`` when the
configuration has a kvtier server (hit tokens by tier, L1 staging bytes, L2
bytes read and written), and the resident memory of every process the
configuration runs (vLLM with its engine processes, the cache server, the L2
store). Counter names are kept as Prometheus spells them; ``delta`` turns two
samples into what happened in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import psutil
from prometheus_client.parser import text_string_to_metric_families

Counters = dict[str, float]  # "name" or "name{key}" -> value
KEY_LABELS = ("adapter", "tier", "reason")  # kvtier's labels that become the key

# objects kvtier's lookups brought up from each L2 adapter into L1 (key: adapter)
L2_LOADS = "kvtier_storage_prefetch_loaded_objects_total"
# re-seeds of an L2 adapter that came back (key: adapter), the objects written
# by them, and the objects still to re-seed (all adapters)
RESEEDS = "kvtier_storage_store_reseeds_total"
RESEEDED = "kvtier_storage_store_reseeded_objects_total"
RESEED_PENDING = "kvtier_storage_store_reseed_objects"
VLLM_COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:num_preemptions_total",
)


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float  # seconds after the replay started
    counters: Counters
    rss_bytes: int  # proportional set size of every process of the configuration


def parse_counters(text: str, prefix: str) -> Counters:
    """Samples whose name starts with ``prefix``, summed over label sets except
    the key (kvtier's adapter, tier or reason label)."""
    counters: Counters = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(prefix):
                continue
            key = next((sample.labels[k] for k in KEY_LABELS if k in sample.labels), "")
            name = f"{sample.name}{{{key}}}" if key else sample.name
            counters[name] = counters.get(name, 0.0) + sample.value
    return counters


def delta(after: Counters, before: Counters, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def by_key(counters: Counters, name: str) -> dict[str, float]:
    """``{key: value}`` of a kvtier counter with a key label (``KEY_LABELS``)."""
    start = f"{name}{{"
    return {k[len(start) : -1]: v for k, v in counters.items() if k.startswith(start)}


def resident_bytes(pids: Sequence[int]) -> int:
    """Memory of these processes and all their children: the sum of their
    proportional set sizes, so pages they share (kvtier's L1 arena is mapped by
    the server and by vLLM's workers) count once."""
    seen: dict[int, int] = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    seen[proc.pid] = proc.memory_full_info().pss
    return sum(seen.values())


@dataclass(eq=False)
class Sampler:
    """Samples until ``stop()``; ``samples`` in time order."""

    vllm_url: str
    kvtier_http: str | None
    pids: Callable[[], Sequence[int]]  # asked at every sample: a restarted store has new ones
    started: float
    every_s: float = 0.5
    samples: list[Sample] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def take(self, session: aiohttp.ClientSession) -> Sample:
        counters: Counters = {}
        for url, prefix in ((self.vllm_url, "vllm:"), (self.kvtier_http, "kvtier_")):
            if url is None:
                continue
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(f"{url}/metrics") as response:
                    counters.update(parse_counters(await response.text(), prefix))
        rss = await asyncio.to_thread(resident_bytes, self.pids())
        sample = Sample(time.perf_counter() - self.started, counters, rss)
        self.samples.append(sample)
        return sample

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not self._stop.is_set():
                await self.take(session)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.every_s)
            await self.take(session)  # the counters after the last request

    def stop(self) -> None:
        self._stop.set()


__all__ = [
    "L2_LOADS",
    "RESEEDED",
    "RESEEDS",
    "RESEED_PENDING",
    "VLLM_COUNTERS",
    "Sample",
    "Sampler",
    "by_key",
    "delta",
    "parse_counters",
]
