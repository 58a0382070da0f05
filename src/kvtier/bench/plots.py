"""The bench's PNG plots (matplotlib, no display needed): TTFT CDF per
configuration, hit tokens by tier over time, and the fault run's timeline."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.figure import Figure

from kvtier.bench.sampler import L2_LOADS, by_key

if TYPE_CHECKING:
    from kvtier.bench.runner import ConfigRun


def ttft_cdf(runs: Mapping[str, ConfigRun], path: Path) -> None:
    figure = Figure(figsize=(7, 4.5))
    axes = figure.subplots()
    for name, run in runs.items():
        ttfts = np.sort([r.ttft_s for r in run.results if r.ok and r.ttft_s is not None])
        if len(ttfts):
            axes.step(
                ttfts * 1e3, np.arange(1, len(ttfts) + 1) / len(ttfts), where="post", label=name
            )
    axes.set_xscale("log")
    axes.set_xlabel("TTFT (ms, log scale)")
    axes.set_ylabel("share of requests")
    axes.set_title("TTFT CDF per configuration")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def hits_over_time(runs: Mapping[str, ConfigRun], path: Path, chunk_tokens: int) -> None:
    """Cumulative prompt tokens served from each tier, per configuration."""
    figure = Figure(figsize=(4.2 * len(runs), 3.8))
    panels = np.atleast_1d(figure.subplots(1, len(runs), sharey=True))
    for axes, (name, run) in zip(panels, runs.items(), strict=True):
        if run.samples:
            t = [s.t_s for s in run.samples]
            first = run.samples[0].counters
            for label, metric in (
                ("vLLM prefix cache", "vllm:prefix_cache_hits_total"),
                ("connector", "vllm:external_prefix_cache_hits_total"),
            ):
                base = first.get(metric, 0.0)
                axes.plot(t, [s.counters.get(metric, 0.0) - base for s in run.samples], label=label)
            for adapter in sorted(by_key(run.samples[-1].counters, L2_LOADS)):
                base = by_key(first, L2_LOADS).get(adapter, 0.0)
                values = [
                    (by_key(s.counters, L2_LOADS).get(adapter, 0.0) - base) * chunk_tokens
                    for s in run.samples
                ]
                axes.plot(t, values, linestyle="--", label=f"kvtier: loaded from {adapter}")
        axes.set_title(name)
        axes.set_xlabel("seconds into the replay")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7)
    panels[0].set_ylabel("hit tokens (cumulative)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def fault_timeline(run: ConfigRun, path: Path) -> None:
    figure = Figure(figsize=(8, 4))
    axes = figure.subplots()
    ok = [r for r in run.results if r.ok and r.ttft_s is not None]
    failed = [r for r in run.results if not r.ok]
    axes.scatter([r.sent_s for r in ok], [(r.ttft_s or 0) * 1e3 for r in ok], s=14, label="TTFT")
    if failed:
        axes.scatter(
            [r.sent_s for r in failed], [0] * len(failed), marker="x", color="red", label="failed"
        )
    for name, at in run.events.items():
        axes.axvline(
            at, color="black" if name == "kill" else "green", linestyle=":", label=f"L2 {name}"
        )
    axes.set_yscale("log")
    axes.set_xlabel("request sent at (s)")
    axes.set_ylabel("TTFT (ms, log scale)")
    axes.set_title("apc+l1+remote: the L2 store killed, then restarted")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


__all__ = ["fault_timeline", "hits_over_time", "ttft_cdf"]
