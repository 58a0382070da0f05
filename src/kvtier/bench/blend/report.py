"""``kvtier blend-eval``'s readable report and its plot of quality against
the recompute ratio (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from rich.table import Table

from kvtier.blend import BlendConfig

DEFAULT = BlendConfig()  # kvtier's blend: the solid line in the plot


def quality_table(results: dict[str, Any]) -> Table:
    """Fidelity to full prefill's own answers, work and TTFT, per configuration."""
    quality = results["quality"]
    table = Table(title=f"Fidelity to full prefill over {quality['prompts']} prompts")
    for column in ("configuration", "top-1 agreement [95 % CI]", "greedy equal", "KL", "work",
                   "TTFT p50"):  # fmt: skip
        table.add_column(column, justify="left" if column == "configuration" else "right")
    table.add_row("full prefill", "1", "1", "0", "1",
                  f"{quality['full']['ttft_p50_s'] * 1e3:,.0f} ms")  # fmt: skip
    prefix = quality["prefix-only"]
    table.add_row("prefix-only reuse", "1", "1", "0", f"{prefix['work']:.3f}",
                  f"{prefix['ttft_p50_s'] * 1e3:,.0f} ms")  # fmt: skip
    for name in results["configurations"]:
        q = quality[name]
        table.add_row(
            name,
            _with_interval(q["top1_agreement"], q.get("top1_agreement_ci95")),
            f"{q['greedy_equal']:.3f}",
            f"{q['kl']:.4f}",
            f"{q['work']:.3f}",
            f"{q['ttft_p50_s'] * 1e3:,.0f} ms",
        )
    return table


def answers_table(results: dict[str, Any]) -> Table:
    """Right answers per configuration: accuracy, retention (the share of
    full prefill's right answers kept) with its interval, apart over the
    surer and less sure halves of them by full prefill's margin, and how
    many of them became another document's code."""
    quality = results["quality"]
    right = quality["full_prefill_correct"]
    margin = quality["full_prefill_margin"]
    margins = ""
    if margin["median"] is not None:
        low, high = margin["range"]
        margins = f"; margins {low:.2f}-{high:.2f}, median {margin['median']:.2f}"
    table = Table(
        title=(
            f"Answers: full prefill gets {right} of {quality['prompts']} right{margins}; "
            f"{quality['full_prefill_another_code']} wrong with another document's code"
        )
    )
    for column in ("configuration", "accuracy", "retention", "95 % CI", "surer half",
                   "less sure half", "to another code"):  # fmt: skip
        table.add_column(column, justify="left" if column == "configuration" else "right")
    table.add_row("full prefill", f"{quality['full_prefill_accuracy']:.3f}", "1", "", "1", "1", "")
    for name in results["configurations"]:
        q = quality[name]
        ci95 = q.get("retention_ci95")
        table.add_row(
            name,
            f"{q['accuracy']:.3f}",
            f"{q['retention']:.3f}",
            "" if ci95 is None else f"{ci95[0]:.2f}-{ci95[1]:.2f}",
            _share(q.get("retention_surer_half")),
            _share(q.get("retention_less_sure_half")),
            f"{q.get('lost_to_another_code', 0)} of {right}",
        )
    return table


def _share(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _with_interval(value: float, ci95: list[float] | None) -> str:
    return f"{value:.3f}" if ci95 is None else f"{value:.3f} [{ci95[0]:.3f}, {ci95[1]:.3f}]"


def latency_table(results: dict[str, Any]) -> Table:
    latency = results["latency"]
    table = Table(
        title=(
            f"TTFT on {latency['prompts']} prompts of 4 documents "
            f"(p50 {latency['prompt_tokens_p50']:,.0f} tokens), documents warm in L1"
        )
    )
    for column in ("configuration", "TTFT p50", "vs full prefill", "vs prefix-only"):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    table.add_row("full prefill", f"{latency['full']['ttft_p50_s'] * 1e3:,.0f} ms", "1", "")
    for name, entry in latency.items():
        if not isinstance(entry, dict) or name == "full":
            continue
        table.add_row(
            name,
            f"{entry['ttft_p50_s'] * 1e3:,.0f} ms",
            f"{entry['speedup_vs_full']:.2f}x",
            f"{entry['speedup_vs_prefix_only']:.2f}x" if "speedup_vs_prefix_only" in entry else "1",
        )
    return table


def quality_plot(results: dict[str, Any], path: Path) -> None:
    """Top-1 agreement and retention against the recompute ratio: a line per
    kind of blend measured at several ratios, a marker for the others."""
    quality = results["quality"]
    figure = Figure(figsize=(7, 4.5))
    axes = figure.subplots()
    markers = iter("xD^v*P")
    for kind, points in _kinds(results).items():
        if len(points) > 1:  # a kind measured at several ratios: a line
            style = "o-" if kind.startswith(DEFAULT.selection) else "s--"
            size, colors, label = None, ("tab:blue", "tab:orange"), kind
        else:  # one configuration: a marker
            style, size, colors = next(markers, "x"), 7, ("tab:red", "tab:purple")
            label = points[0][1]
        ratios = [r for r, _ in points]
        for metric, color in zip(("top1_agreement", "retention"), colors, strict=True):
            axes.plot(ratios, [quality[name][metric] for _, name in points], style, color=color,
                      markersize=size, label=f"{metric.replace('_', ' ')}, {label}")  # fmt: skip
    axes.set_xlabel("recompute ratio")
    axes.set_ylabel("against full prefill")
    axes.set_title(f"SmolLM2-135M, {quality['prompts']} prompts: quality vs recompute ratio")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=6, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _kinds(results: dict[str, Any]) -> dict[str, list[tuple[float, str]]]:
    """Configurations by kind (selection, anchor, mask): (ratio, name), sorted."""
    kinds: dict[str, list[tuple[float, str]]] = {}
    for name, c in results["configurations"].items():
        kind = c["selection"] + ("" if c.get("anchor", False) else ", alone")
        kind += ", bottom-right" if c["mask"] == "bottom_right" else ""
        kinds.setdefault(kind, []).append((c["ratio"], name))
    return {kind: sorted(points) for kind, points in kinds.items()}


__all__ = ["answers_table", "latency_table", "quality_plot", "quality_table"]
