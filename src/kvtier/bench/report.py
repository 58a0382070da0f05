"""The bench's results as JSON and as a Markdown report, and its targets
checked on them (reported, never asserted: a missed target is a
finding, not a crash)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.units import format_size

TARGET_SPEEDUP = 2.0  # apc+l1 TTFT p50 and p95 at least this much better than apc
REMOTE_P50_WITHIN = 1.1  # apc+l1+remote TTFT p50 at most this many times apc+l1's


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def targets(
    configs: Mapping[str, Mapping[str, Any]], fault: Mapping[str, Any] | None
) -> dict[str, Any]:
    """Each target with the numbers behind it and ``met`` (None: not measured)."""
    apc, l1, peer = configs.get("apc"), configs.get("apc+l1"), configs.get("lmcache")
    found: dict[str, Any] = {}
    if apc and l1:
        p50 = _ratio(apc["ttft_p50_s"], l1["ttft_p50_s"])
        p95 = _ratio(apc["ttft_p95_s"], l1["ttft_p95_s"])
        found["apc+l1_ttft_speedup_over_apc"] = {
            "p50": p50,
            "p95": p95,
            "met": p50 is not None and p95 is not None and min(p50, p95) >= TARGET_SPEEDUP,
        }
    if l1 and peer:
        ratio = _ratio(l1["ttft_p50_s"], peer["ttft_p50_s"])
        found["apc+l1_ttft_p50_over_lmcache"] = {
            "ratio": ratio,
            "met": ratio is not None and ratio <= 1.0,
        }
        found["apc+l1_hit_tokens_vs_lmcache"] = {
            "kvtier": l1["hit_tokens"],
            "lmcache": peer["hit_tokens"],
            "met": l1["hit_tokens"] >= peer["hit_tokens"],
        }
    for name in ("apc+l1+remote", "apc+l1+remote+async"):
        remote = configs.get(name)
        if remote and l1 and apc:  # loads from a slower tier must not cost the engine
            p50 = _ratio(remote["ttft_p50_s"], l1["ttft_p50_s"])
            found[f"{name}_ttft_p50_over_apc+l1"] = {
                "ratio": p50,
                "met": p50 is not None and p50 <= REMOTE_P50_WITHIN,
            }
            found[f"{name}_ttft_p95_vs_apc"] = {
                "remote_s": remote["ttft_p95_s"],
                "apc_s": apc["ttft_p95_s"],
                "met": remote["ttft_p95_s"] <= apc["ttft_p95_s"],
            }
    runs = {**configs, **({"fault": fault} if fault else {})}
    found["no_output_differences"] = {
        "by_configuration": {name: run["output_mismatches"] for name, run in runs.items()},
        "met": all(run["output_mismatches"] == 0 for run in runs.values()),
    }
    found["no_failed_requests"] = {
        "by_configuration": {name: run["failed_requests"] for name, run in runs.items()},
        "met": all(run["failed_requests"] == 0 for run in runs.values()),
    }
    return found


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.0f}"


def _tokens(n: float) -> str:
    return f"{n:,.0f}"


def _configurations_table(configs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    rows = [
        "| configuration | TTFT p50 / p95 / p99 (ms) | ITL p50 / p95 / p99 (ms) | goodput (req/s) "
        "| throughput (req/s, tok/s) | hit tokens (ratio) | failed | output diffs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, c in configs.items():
        rows.append(
            f"| {name} | {_ms(c['ttft_p50_s'])} / {_ms(c['ttft_p95_s'])} / {_ms(c['ttft_p99_s'])} "
            f"| {_ms(c['itl_p50_s'])} / {_ms(c['itl_p95_s'])} / {_ms(c['itl_p99_s'])} "
            f"| {c['goodput_rps']:.2f} | {c['throughput_rps']:.2f}, {c['output_tokens_per_s']:.0f} "
            f"| {_tokens(c['hit_tokens'])} ({c['hit_ratio']:.0%}) | {c['failed_requests']} "
            f"| {c['output_mismatches']} |"
        )
    return rows


def _tiers_table(configs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    rows = [
        "| configuration | from vLLM's prefix cache | from the connector | kvtier: loaded from L2 "
        "| connector bytes | L2 read / written | peak host memory | peak staging | preemptions |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in configs.items():
        tiers = ", ".join(
            f"{tier} {_tokens(n)}" for tier, n in sorted(c["l2_loaded_tokens"].items())
        )
        l2 = ", ".join(
            f"{adapter} {format_size(moved.get('read_bytes', 0))} / "
            f"{format_size(moved.get('written_bytes', 0))}"
            for adapter, moved in sorted(c["l2_bytes"].items())
        )
        rows.append(
            f"| {name} | {_tokens(c['hit_tokens_by_tier']['vllm_apc'])} "
            f"| {_tokens(c['hit_tokens_by_tier']['connector'])} | {tiers or '-'} "
            f"| {format_size(c['connector_bytes'])} | {l2 or '-'} "
            f"| {format_size(c['peak_rss_bytes'])} | {format_size(c['peak_staging_bytes'])} "
            f"| {c['preemptions']:.0f} |"
        )
    return rows


def _fault_lines(fault: Mapping[str, Any]) -> list[str]:
    rows = [
        f"The {fault['remote']} L2 was killed at {fault['kill_s']:.1f} s and restarted (empty) at "
        f'{fault["restart_s"]:.1f} s of the replay; "without fault" is the same requests in the '
        "clean apc+l1+remote run.",
        "",
        "| phase | requests | TTFT p50 / p99 (ms) | without fault | hit tokens (ratio) "
        "| without fault | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for phase in ("before", "during", "after"):
        p, clean = fault[phase], fault[phase]["without_fault"]
        rows.append(
            f"| {phase} | {p['requests']} | {_ms(p['ttft_p50_s'])} / {_ms(p['ttft_p99_s'])} "
            f"| {_ms(clean['ttft_p50_s'])} / {_ms(clean['ttft_p99_s'])} "
            f"| {_tokens(p['hit_tokens'])} ({p['hit_ratio']:.0%}) "
            f"| {_tokens(clean['hit_tokens'])} ({clean['hit_ratio']:.0%}) "
            f"| {p['failed_requests']} |"
        )
    recovery, resume = fault["hit_recovery_s"], fault["l2_hits_resume_s"]
    remote = fault["remote"]
    rows += [
        "",
        f"- recovered ({remote} answers again and is re-seeded from L1, "
        f"{fault['reseeded_objects']} objects): {_after_restart(fault['recovery_s'])}",
        f"- kvtier loads from {remote} again (its first L1 miss that {remote} holds): "
        f"{_after_restart(resume)}",
        f"- every request hits as much as without the fault: {_after_restart(recovery)}",
        f"- failed requests: {fault['failed_requests']}; output differences: "
        f"{fault['output_mismatches']}",
    ]
    return rows


def _after_restart(seconds: float | None) -> str:
    return "not within the run" if seconds is None else f"{seconds:.1f} s after the restart"


def _target_lines(found: Mapping[str, Any]) -> list[str]:
    def verdict(met: bool | None) -> str:
        return "met" if met else "NOT met"

    rows = []
    speed = found.get("apc+l1_ttft_speedup_over_apc")
    if speed and speed["p50"] is not None and speed["p95"] is not None:
        rows.append(
            f"- apc+l1 TTFT vs apc: p50 {speed['p50']:.2f}x, p95 {speed['p95']:.2f}x faster "
            f"(target >= {TARGET_SPEEDUP}x): {verdict(speed['met'])}"
        )
    peer = found.get("apc+l1_ttft_p50_over_lmcache")
    if peer and peer["ratio"] is not None:
        rows.append(
            f"- apc+l1 TTFT p50 / lmcache TTFT p50 = {peer['ratio']:.2f} (target <= 1.0): "
            f"{verdict(peer['met'])}"
        )
    hits = found.get("apc+l1_hit_tokens_vs_lmcache")
    if hits:
        rows.append(
            f"- hit tokens: kvtier {_tokens(hits['kvtier'])}, LMCache {_tokens(hits['lmcache'])}: "
            f"{verdict(hits['met'])}"
        )
    for name in ("apc+l1+remote", "apc+l1+remote+async"):
        p50, p95 = found.get(f"{name}_ttft_p50_over_apc+l1"), found.get(f"{name}_ttft_p95_vs_apc")
        if p50 and p95 and p50["ratio"] is not None:
            rows.append(
                f"- {name} TTFT p50 {p50['ratio']:.2f}x apc+l1's (target <= {REMOTE_P50_WITHIN}x): "
                f"{verdict(p50['met'])}; p95 {_ms(p95['remote_s'])} ms vs apc's "
                f"{_ms(p95['apc_s'])} ms (target: no worse): {verdict(p95['met'])}"
            )
    rows.append(
        f"- zero output differences everywhere: {verdict(found['no_output_differences']['met'])}"
    )
    rows.append(f"- zero failed requests everywhere: {verdict(found['no_failed_requests']['met'])}")
    return rows


def _setup_line(results: Mapping[str, Any]) -> str:
    trace, settings = results["trace"], results["settings"]
    small = format_size(settings["small_l1_size_bytes"])
    return (
        f"Trace: {trace['workload']}, {trace['requests']} measured requests after "
        f"{trace['warm_requests']} warm ones, "
        f"{_tokens(trace['prompt_tokens'])} prompt tokens ({trace['unique_chunks']} distinct "
        f"{settings['chunk_size']}-token chunks, {format_size(trace['working_set_bytes'])} of KV), "
        f"arrivals over {trace['span_s']:.1f} s. vLLM KV space "
        f"{_tokens(settings['vllm_kv_tokens'])} tokens (prefix caching on); kvtier L1 "
        f"{format_size(settings['l1_size_bytes'])} (apc+l1), {small} + {settings['remote']} "
        f"(apc+l1+remote). TTFT SLO for goodput: {settings['slo_ttft_s'] * 1e3:.0f} ms. "
        f"Outputs are compared with `{results['reference']}`."
    )


def markdown(results: Mapping[str, Any]) -> str:
    """The report: what ran, the tables, the fault run, the targets, the plots."""
    lines = [
        "# kvtier bench",
        "",
        f"`{results['command']}`",
        "",
        _setup_line(results),
        "",
        "## Latency, goodput and correctness",
        "",
        *_configurations_table(results["configurations"]),
        "",
        "## Where the hits came from",
        "",
        *_tiers_table(results["configurations"]),
        "",
    ]
    if results.get("fault"):
        lines += ["## Fault run (apc+l1+remote)", "", *_fault_lines(results["fault"]), ""]
    lines += ["## Targets", "", *_target_lines(results["targets"]), ""]
    if results.get("plots"):
        lines += ["## Plots", "", *(f"![{name}]({name})" for name in results["plots"]), ""]
    return "\n".join(lines)


__all__ = ["markdown", "targets"]
