"""A ``Plan`` as the readable table ``kvtier plan`` prints: decimal and binary
units side by side, the object groups, then warnings and notes."""

from __future__ import annotations

from kvtier.planner.handoff import HandoffPlan
from kvtier.planner.observed import Observation
from kvtier.planner.plan import Plan
from kvtier.planner.quantities import binary, decimal
from kvtier.planner.shape import ModelShape

_LABEL = 46
_VALUE = 18

Row = tuple[str, str, str]


def _size(n: float, unit: str | None = "G") -> tuple[str, str]:
    return (decimal(n, f"{unit}B"), binary(n, f"{unit}iB")) if unit else (decimal(n), binary(n))


def _rate(n: float) -> tuple[str, str]:
    gb, gib = _size(n)
    return f"{gb}/s", f"{gib}/s"


def _section(title: str, rows: list[Row]) -> list[str]:
    lines = [title]
    for label, first, second in rows:
        lines.append(f"  {label:<{_LABEL}}{first:>{_VALUE}}{second:>{_VALUE}}".rstrip())
    return lines


def describe_shape(shape: ModelShape) -> str:
    """``"llama: 32 layers, 8 KV heads x 128, bf16"``"""
    if shape.mla_latent_dim is not None:
        kv = f"MLA latent {shape.mla_latent_dim}+{shape.mla_rope_dim}"
    else:
        kv = f"{shape.kv_heads} KV heads x {shape.head_dim}"
    parts = [f"{shape.layers} layers", kv, shape.dtype]
    if shape.sliding_layers:
        parts.append(f"{shape.sliding_layers} sliding ({shape.sliding_window} tokens)")
    if shape.state_layers:
        parts.append(f"{shape.state_layers} recurrent ({binary(shape.state_bytes)} each)")
    return (f"{shape.name}: " if shape.name else "") + ", ".join(parts)


def _capacity(plan: Plan) -> list[Row]:
    w, d = plan.workload, plan.deployment
    stored = plan.chunks_per_prefix * d.chunk_size
    return [
        ("KV per token", *_size(plan.bytes_per_token, None)),
        (f"KV per prefix ({stored:,} tokens cached)", *_size(plan.bytes_per_prefix)),
        (f"{w.prefixes:,} prefixes, logical", *_size(plan.total_bytes)),
        (f"stored (TP replication {plan.tp_replication}x)", *_size(plan.stored_bytes)),
        (f"x {d.replicas} replicas", *_size(plan.replicated_bytes)),
        (f"pool at {d.utilization:.0%} utilisation", *_size(plan.pool_bytes)),
        ("chunks per prefix / all", f"{plan.chunks_per_prefix:,}", f"{plan.chunks:,}"),
        ("objects per prefix / all", f"{plan.objects_per_prefix:,}", f"{plan.objects:,}"),
        ("replica records", f"{plan.replica_records:,}", ""),
        ("largest object", *_size(plan.bytes_per_object, None)),
    ]


def _bandwidth(plan: Plan) -> list[Row]:
    w, d, n = plan.workload, plan.deployment, plan.network
    headroom = "-" if plan.read_headroom is None else f"{plan.read_headroom:.2f}x"
    reads = _rate(plan.read_bytes_per_s)
    writes = f"{w.write_fraction:.0%} x {w.new_prefix_tokens:,}"
    return [
        (f"reads ({w.qps:g} req/s x {w.read_fraction:.0%} of a prefix)", *reads),
        (f"NIC line rate ({n.nic_gbps:g} Gbit/s)", *_rate(plan.nic_line_bytes_per_s)),
        (f"NIC effective ({n.nic_efficiency:.0%})", *_rate(plan.nic_effective_bytes_per_s)),
        ("read headroom (effective / reads)", headroom, ""),
        (f"writes ({writes} tokens x {d.replicas} copies)", *_rate(plan.write_bytes_per_s)),
        ("object look-ups per second", f"{plan.metadata_objects_per_s:,.0f}", ""),
        (f"in flight ({n.staging_ms:g} ms staging)", *_size(plan.inflight_bytes)),
    ]


def _read_or_recompute(plan: Plan) -> list[Row]:
    recompute = plan.recompute_seconds_per_prefix
    return [
        ("load a prefix at line rate (lower bound)", _ms(plan.load_seconds_lower_bound), ""),
        ("load a prefix at effective rate", _ms(plan.load_seconds_per_prefix), ""),
        ("recompute a prefix", "-" if recompute is None else _ms(recompute), ""),
        ("verdict", plan.verdict or "-", ""),
    ]


def _handoff(h: HandoffPlan) -> list[Row]:
    pd = h.handoff
    lifetime = f"write + {pd.handoff_wait_ms:g} ms wait + read"
    lease = f"{pd.handoff_lease_s:g} s lease"
    return [
        (f"hand-off ({pd.pd_prompt_tokens:,} tokens, as {h.handoff_tokens:,})",
         *_size(h.written_bytes)),
        (f"read by decode, TP {h.prefill_tp} -> {h.decode_tp} ({h.layout})",
         *_size(h.read_bytes)),
        (f"writes ({pd.pd_qps:g} hand-offs/s)", *_rate(h.write_bytes_per_s)),
        ("reads", *_rate(h.read_bytes_per_s)),
        ("write / read at the effective rate", _ms(h.write_s), _ms(h.read_s)),
        (f"object lifetime ({lifetime})", _ms(h.lifetime_s), ""),
        ("resident for hand-offs (rate x lifetime)", *_size(h.resident_bytes)),
        (f"  if no consumer comes ({lease})", *_size(h.resident_bytes_bound)),
        ("double-buffered (two copies while moving)", *_size(h.double_buffered_bytes)),
        (f"decode sequences in flight ({pd.pd_output_tokens} x {pd.pd_itl_ms:g} ms)",
         f"{h.decode_sequences:,.1f}", ""),
        ("their KV on the decode side", *_size(h.decode_kv_bytes)),
    ]  # fmt: skip


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


_GROUP_WIDTHS = (26, 8, 10, 9, 14, 9, 14)


def _group_row(cells: tuple[str, ...]) -> str:
    name, *rest = cells
    width, *widths = _GROUP_WIDTHS
    return f"  {name:<{width}}" + "".join(
        f"{cell:>{w}}" for cell, w in zip(rest, widths, strict=True)
    )


def _groups(plan: Plan) -> list[str]:
    lines = ["Object groups (per cached prefix)"]
    lines.append(
        _group_row(("group", "layers", "TP copies", "tokens", "stored", "objects", "object size"))
    )
    for g in plan.groups:
        cells = (
            g.name,
            str(g.layers),
            f"{g.tp_replication}x",
            f"{g.tokens_per_prefix:,}",
            binary(g.stored_bytes_per_prefix),
            f"{g.objects_per_prefix:,}",
            binary(g.bytes_per_object),
        )
        lines.append(_group_row(cells))
    return lines


def _observed(seen: Observation) -> list[str]:
    tiers = ", ".join(
        f"{tier} {tokens / seen.lookup_tokens:.0%}"
        for tier, tokens in sorted(seen.hit_tokens.items())
    )
    return [
        f"Observed on {seen.url} ({seen.namespace}) over {seen.window_s:,.1f} s:",
        f"  {seen.qps:,.2f} lookups/s of {seen.prefix_tokens:,} tokens; hits by tier: "
        f"{tiers or 'none'}; {seen.stored_tokens / seen.window_s:,.0f} tokens stored/s",
    ]


def format_plan(
    plan: Plan, observed: Observation | None = None, handoff: HandoffPlan | None = None
) -> str:
    d = plan.deployment
    lines = [
        f"kvtier plan - {describe_shape(plan.shape)}; TP {d.tp}, PP {d.pp}; "
        f"chunk {d.chunk_size} tokens (block {d.block_size})",
    ]
    if observed is not None:
        lines += ["", *_observed(observed)]
    capacity = f"{'Capacity':<{_LABEL + 2}}{'decimal':>{_VALUE}}{'binary':>{_VALUE}}"
    lines += ["", *_section(capacity, _capacity(plan))]
    lines += ["", *_section("Bandwidth", _bandwidth(plan))]
    lines += ["", *_section("Read or recompute (one prefix)", _read_or_recompute(plan))]
    if handoff is not None:
        title = "Prefill/decode hand-off (this request's KV; reuse is above)"
        lines += ["", *_section(title, _handoff(handoff))]
    lines += ["", *_groups(plan)]
    if plan.warnings:
        lines += ["", "Warnings", *(f"  ! {w}" for w in plan.warnings)]
    if plan.notes:
        lines += ["", "Notes", *(f"  - {n}" for n in plan.notes)]
    return "\n".join(lines)


__all__ = ["describe_shape", "format_plan"]
