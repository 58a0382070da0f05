"""``kvtier plan --trace``: what a real trace reuses, and the cache it takes.

From a Mooncake-format trace: the reuse ceiling (an infinite cache), the
exact LRU curve (``reuse.py``) at chosen capacities with kvtier's other
eviction policies simulated beside it and the offline optimum (Belady with
prefix semantics, ``policy_sim.py``), each policy's share of that optimum,
the capacity that reaches each share
of the ceiling, the split between an L1 and an L2 of given sizes with the L2
read bandwidth it takes, and the prefill seconds saved at a prefill rate.

Capacities are in tokens and count whole 512-token blocks (a partial last
block takes a slot, as in a paged cache); bytes come from the model shape
when one is given. kvtier writes every stored chunk through to L2, so L2 is
modelled as an LRU of its own size over the same accesses: a token is an L1
hit when L1 holds it, an L2 hit when L1 does not and L2 does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.l1.policies import EVICTION_POLICIES
from kvtier.planner.policy_sim import optimum_hit_tokens, simulate_policy
from kvtier.planner.quantities import binary
from kvtier.planner.reuse import MINUTE_S, Access, ReuseCurve, accesses, reuse_curve
from kvtier.traces.lines import DEFAULT_MAX_LINE_BYTES, MAX_LINE_FLAG
from kvtier.traces.mooncake import TRACE_BLOCK_TOKENS, SkippedLines, read_mooncake

DEFAULT_TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
DEFAULT_POINTS = 6
SMALLEST_DEFAULT_BLOCKS = 64


@dataclass(frozen=True, slots=True)
class TraceQuestion:
    """What the operator asks of a trace (``kvtier plan --trace`` flags)."""

    capacities_tokens: tuple[int, ...] = ()  # empty: spread over the working set
    policies: tuple[str, ...] = ("gdsf", "probation")  # simulated beside the exact LRU curve
    targets: tuple[float, ...] = DEFAULT_TARGETS  # shares of the reuse ceiling
    l1_tokens: int | None = None
    l2_tokens: int | None = None
    prefill_tokens_per_s: float | None = None
    bytes_per_token: int | None = None  # from the model shape, when given
    skip_bad_lines: bool = False
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES  # a longer trace line is a bad line

    def __post_init__(self) -> None:
        if self.max_line_bytes < 1:
            raise ValueError(f"{MAX_LINE_FLAG} must be >= 1 byte, got {self.max_line_bytes}")
        if any(c < 1 for c in self.capacities_tokens):
            raise ValueError("--capacities takes token counts >= 1, e.g. 1000000,8000000")
        unknown = [name for name in self.policies if name not in EVICTION_POLICIES]
        if unknown:
            raise ValueError(
                f"--policies: unknown eviction policy {unknown[0]!r}; "
                f"choose from {sorted(EVICTION_POLICIES)}"
            )
        if any(not 0 < t <= 1 for t in self.targets):
            raise ValueError("--targets takes shares of the ceiling in (0, 1], e.g. 0.8,0.9")
        for flag, value in (("--l1-tokens", self.l1_tokens), ("--l2-tokens", self.l2_tokens)):
            if value is not None and value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")
        if self.l2_tokens is not None and self.l1_tokens is None:
            raise ValueError("--l2-tokens needs --l1-tokens (the tier in front of it)")
        if self.prefill_tokens_per_s is not None and self.prefill_tokens_per_s <= 0:
            raise ValueError("--prefill-rate must be positive (tokens per second)")


def _blocks(tokens: int) -> int:
    return tokens // TRACE_BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class TracePlan:
    """Everything ``kvtier plan --trace`` reports; ``to_json()`` for ``--json``."""

    path: str
    question: TraceQuestion
    curve: ReuseCurve
    points: list[dict[str, Any]]
    targets: list[dict[str, Any]]
    tiers: dict[str, Any] | None
    skipped: SkippedLines = field(default_factory=SkippedLines)

    @property
    def reuse_ceiling(self) -> float:
        return self.curve.ceiling_tokens / self.curve.input_tokens

    def to_json(self) -> dict[str, Any]:
        curve = self.curve
        return {
            "trace": {
                "path": self.path,
                "requests": curve.requests,
                "duration_s": curve.duration_s,
                "input_tokens": curve.input_tokens,
                "block_accesses": curve.accesses,
                "distinct_blocks": curve.distinct_blocks,
                "block_tokens": TRACE_BLOCK_TOKENS,
                "skipped_lines": self.skipped.count,
                "skipped_reasons": self.skipped.reasons,
            },
            "bytes_per_token": self.question.bytes_per_token,
            "prefill_tokens_per_s": self.question.prefill_tokens_per_s,
            "reuse_ceiling": self.reuse_ceiling,
            "curve": self.points,
            "targets": self.targets,
            "tiers": self.tiers,
        }


def _bytes(tokens: float, question: TraceQuestion) -> float | None:
    return None if question.bytes_per_token is None else tokens * question.bytes_per_token


def _saved_s(tokens: float, question: TraceQuestion) -> float | None:
    rate = question.prefill_tokens_per_s
    return None if rate is None else tokens / rate


def _default_capacities(curve: ReuseCurve) -> tuple[int, ...]:
    """``DEFAULT_POINTS`` capacities, log-spaced from 64 blocks to the working set."""
    top = max(1, curve.distinct_blocks)
    low = min(SMALLEST_DEFAULT_BLOCKS, top)
    blocks = np.unique(np.geomspace(low, top, DEFAULT_POINTS).round().astype(np.int64))
    return tuple(int(b) * TRACE_BLOCK_TOKENS for b in blocks)


def _point(
    curve: ReuseCurve, touches: list[Access], capacity: int, q: TraceQuestion
) -> dict[str, Any]:
    blocks = _blocks(capacity)
    hit = curve.hit_tokens(blocks)
    best = optimum_hit_tokens(touches, blocks)
    policies = {
        name: simulate_policy(touches, name, blocks) / curve.input_tokens for name in q.policies
    }
    opt = best / curve.input_tokens
    return {
        "capacity_tokens": capacity,
        "capacity_bytes": _bytes(blocks * TRACE_BLOCK_TOKENS, q),
        "hit_ratio": hit / curve.input_tokens,
        "share_of_ceiling": hit / curve.ceiling_tokens if curve.ceiling_tokens else 0.0,
        "opt_hit_ratio": opt,
        "policies": policies,
        "share_of_opt": {  # LRU's and each policy's hit ratio over the optimum's
            name: (ratio / opt if opt else 1.0)
            for name, ratio in {"lru": hit / curve.input_tokens, **policies}.items()
        },
        "prefill_s_saved": _saved_s(hit, q),
    }


def _target(curve: ReuseCurve, share: float, q: TraceQuestion) -> dict[str, Any]:
    blocks = curve.blocks_for(share * curve.ceiling_tokens)
    tokens = None if blocks is None else blocks * TRACE_BLOCK_TOKENS
    return {
        "share_of_ceiling": share,
        "hit_ratio": share * curve.ceiling_tokens / curve.input_tokens,
        "capacity_tokens": tokens,
        "capacity_bytes": None if tokens is None else _bytes(tokens, q),
    }


def _tiers(curve: ReuseCurve, q: TraceQuestion) -> dict[str, Any] | None:
    if q.l1_tokens is None:
        return None
    l1 = _blocks(q.l1_tokens)
    l2 = max(l1, _blocks(q.l2_tokens or 0))
    l1_hit, both = curve.hit_tokens(l1), curve.hit_tokens(l2)
    per_minute = curve.tokens_per_minute(l1, l2)
    mean_tokens_per_s = (both - l1_hit) / max(curve.duration_s, MINUTE_S)
    peak_tokens_per_s = float(per_minute.max()) / MINUTE_S if len(per_minute) else 0.0
    return {
        "l1_tokens": q.l1_tokens,
        "l2_tokens": q.l2_tokens,
        "l1_hit_ratio": l1_hit / curve.input_tokens,
        "l2_hit_ratio": (both - l1_hit) / curve.input_tokens,
        "l2_read_tokens_per_s_mean": mean_tokens_per_s,
        "l2_read_tokens_per_s_peak_minute": peak_tokens_per_s,
        "l2_read_bytes_per_s_mean": _bytes(mean_tokens_per_s, q),
        "l2_read_bytes_per_s_peak_minute": _bytes(peak_tokens_per_s, q),
        "prefill_s_saved_l1": _saved_s(l1_hit, q),
        "prefill_s_saved_l2": _saved_s(both - l1_hit, q),
    }


def plan_trace(path: Path, question: TraceQuestion) -> TracePlan:
    """The trace plan of ``path``; ValueError naming the line for a bad trace."""
    skipped = SkippedLines()
    records = read_mooncake(
        path,
        skip_bad_lines=question.skip_bad_lines,
        skipped=skipped,
        max_line_bytes=question.max_line_bytes,
    )
    touches, requests, last_ms = [], 0, 0.0
    for record in records:  # streamed: only the block accesses are kept
        touches.extend(accesses((record,), requests))
        requests += 1
        last_ms = record.timestamp_ms
    if not touches:
        raise ValueError(f"--trace {path}: no requests in it")
    curve = reuse_curve(touches, requests, last_ms / 1000)
    capacities = question.capacities_tokens or _default_capacities(curve)
    return TracePlan(
        path=str(path),
        question=question,
        curve=curve,
        points=[_point(curve, touches, c, question) for c in capacities],
        targets=[_target(curve, share, question) for share in question.targets],
        tiers=_tiers(curve, question),
        skipped=skipped,
    )


def _tokens(n: float, unit: str = "tokens") -> str:
    """``_tokens(1.5e6) == "1.50M tokens"``."""
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{prefix} {unit}"
    return f"{n:.0f} {unit}"


def _size(tokens: float | None, nbytes: float | None) -> str:
    if tokens is None:
        return "unreachable"
    return _tokens(tokens) if nbytes is None else f"{_tokens(tokens)} ({binary(nbytes)})"


def format_trace_plan(plan: TracePlan) -> str:
    """The report for people."""
    curve, q = plan.curve, plan.question
    lines = [
        f"Trace {plan.path}: {curve.requests} requests over {curve.duration_s:.0f} s, "
        f"{_tokens(curve.input_tokens, 'input tokens')}, "
        f"{curve.distinct_blocks} distinct {TRACE_BLOCK_TOKENS}-token blocks",
    ]
    if plan.skipped.count:
        lines.append(f"  skipped {plan.skipped.count} bad lines, first: {plan.skipped.reasons[0]}")
    lines += [
        f"Reuse ceiling (infinite cache): {plan.reuse_ceiling:.1%} of input tokens",
        "",
        "Hit ratio (tokens) against capacity; LRU exact, "
        + (", ".join(q.policies) + " simulated" if q.policies else "no other policy")
        + "; the offline optimum (Belady, prefix hits), and each one's share of it",
    ]
    header = f"  {'capacity':>28}  {'LRU':>7}  {'of ceiling':>10}  {'optimum':>7}"
    header += "".join(f"  {name:>9}" for name in q.policies)
    header += f"  {'of optimum: LRU':>15}" + "".join(f"  {name:>9}" for name in q.policies)
    if q.prefill_tokens_per_s is not None:
        header += f"  {'prefill saved':>14}"
    lines.append(header)
    for point in plan.points:
        row = f"  {_size(point['capacity_tokens'], point['capacity_bytes']):>28}"
        row += f"  {point['hit_ratio']:>7.1%}  {point['share_of_ceiling']:>10.1%}"
        row += f"  {point['opt_hit_ratio']:>7.1%}"
        row += "".join(f"  {point['policies'][name]:>9.1%}" for name in q.policies)
        shares = point["share_of_opt"]
        row += f"  {shares['lru']:>15.0%}" + "".join(f"  {shares[n]:>9.0%}" for n in q.policies)
        if point["prefill_s_saved"] is not None:
            row += f"  {point['prefill_s_saved']:>12.0f} s"
        lines.append(row)
    lines += ["", "Capacity (LRU) for a share of the reuse the trace allows:"]
    for target in plan.targets:
        size = _size(target["capacity_tokens"], target["capacity_bytes"])
        lines.append(
            f"  {target['share_of_ceiling']:>4.0%} of the ceiling "
            f"({target['hit_ratio']:.1%} hit): {size}"
        )
    if plan.tiers is not None:
        t = plan.tiers
        lines += [
            "",
            f"Tiers: L1 {_tokens(t['l1_tokens'])} hits {t['l1_hit_ratio']:.1%}; "
            f"L2 {_tokens(t['l2_tokens'] or 0)} adds {t['l2_hit_ratio']:.1%}",
            f"  L2 reads: {_tokens(t['l2_read_tokens_per_s_mean'], 'tokens/s')} mean, "
            f"{_tokens(t['l2_read_tokens_per_s_peak_minute'], 'tokens/s')} in the busiest minute"
            + (
                f" ({binary(t['l2_read_bytes_per_s_mean'])}/s mean, "
                f"{binary(t['l2_read_bytes_per_s_peak_minute'])}/s peak)"
                if t["l2_read_bytes_per_s_mean"] is not None
                else ""
            ),
        ]
    if q.bytes_per_token is None:
        lines += ["", "Bytes: give the model shape (--model-config or the shape flags)."]
    return "\n".join(lines)


def plot_trace_plan(plan: TracePlan, path: Path) -> None:
    """The LRU curve (every depth), the simulated policies and the ceiling, as a PNG."""
    from matplotlib.figure import Figure

    curve = plan.curve
    figure = Figure(figsize=(7, 4.2))
    axes = figure.add_subplot()
    if len(curve.depths):
        depths = np.unique(curve.depths)
        ratios = [curve.hit_ratio(int(d)) for d in depths]
        axes.step(depths * TRACE_BLOCK_TOKENS, ratios, where="post", label="LRU (exact)")
    for name in plan.question.policies:
        xs = [p["capacity_tokens"] for p in plan.points]
        axes.plot(xs, [p["policies"][name] for p in plan.points], "o", label=f"{name} (simulated)")
    xs = [p["capacity_tokens"] for p in plan.points]
    axes.plot(xs, [p["opt_hit_ratio"] for p in plan.points], "k^--", label="optimum (offline)")
    axes.axhline(plan.reuse_ceiling, linestyle="--", color="grey", label="ceiling")
    axes.set_xscale("log")
    axes.set_xlabel("cache capacity (tokens)")
    axes.set_ylabel("hit ratio (tokens)")
    axes.set_title(Path(plan.path).name)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


__all__ = [
    "DEFAULT_TARGETS",
    "TracePlan",
    "TraceQuestion",
    "format_trace_plan",
    "plan_trace",
    "plot_trace_plan",
]
