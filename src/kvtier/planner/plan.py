"""``make_plan``: capacity, bandwidth and read-or-recompute for one deployment.

Pure arithmetic over frozen inputs, in bytes and seconds, no rounding: a
``ModelShape`` (what the model keeps per token), a ``Deployment`` (TP, PP,
chunk, replicas, utilisation), a ``Workload`` (prefixes and traffic), a
``Network`` (the NIC) and a ``Compute`` (the GPU, for read-or-recompute).
``docs/planning.md`` writes every formula down and works an example through
them.

Parallelism follows what engines do: TP splits KV heads across ranks
while there are at least as many heads as ranks, and replicates them when TP
exceeds the heads (an MLA latent is replicated on every rank); PP splits the
layers. One object is one chunk of one (rank, object group), so a chunk of a
TP 4 model is 4 objects.

Assumptions, stated once: a cached prefix is reused whole (a sliding-window
group stores only the chunks covering its window, a recurrent-state group one
snapshot at the prefix's end); every request looks up every object of its
prefix and reads ``read_fraction`` of it from the pool (1.0, the worst case:
all of it); only full chunks are cached.
"""

from __future__ import annotations

import dataclasses
import math

from kvtier.layout import KVLayout, LayoutKind
from kvtier.planner.checks import plan_notes, plan_warnings
from kvtier.planner.shape import ModelShape
from kvtier.planner.terms import (
    BYTES_PER_GBIT,
    Compute,
    Deployment,
    GroupPlan,
    Network,
    Plan,
    Workload,
)
from kvtier.read_or_recompute import LinkCost, Verdict, verdict


def transfer_seconds(nbytes: float, nic_gbps: float, efficiency: float = 1.0) -> float:
    """Seconds to move ``nbytes`` over a ``nic_gbps`` link at ``efficiency`` of line
    rate; with the default 1.0 it is the lower bound (1 GiB over 200 Gbit/s
    takes at least ~43 ms)."""
    return nbytes / (nic_gbps * BYTES_PER_GBIT * efficiency)


def stage_layers(layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage holding any: an even split, earlier stages
    taking the remainder."""
    base, extra = divmod(layers, pp)
    return [base + (stage < extra) for stage in range(pp) if base or stage < extra]


def split_kv_heads(kv_heads: int, tp: int) -> tuple[int, int]:
    """(KV heads per rank, TP replication). Engines split heads evenly while
    there are enough, and give each rank a copy of one head beyond that."""
    if kv_heads >= tp:
        if kv_heads % tp:
            raise ValueError(
                f"--tp {tp} does not divide the model's {kv_heads} KV heads; engines need "
                "one to divide the other: pick a --tp that divides --kv-heads or a multiple"
            )
        return kv_heads // tp, 1
    if tp % kv_heads:
        raise ValueError(
            f"--tp {tp} is not a multiple of the model's {kv_heads} KV heads; engines "
            "replicate heads only a whole number of times: pick a multiple of --kv-heads"
        )
    return 1, tp // kv_heads


def prefix_groups(shape: ModelShape, deployment: Deployment, tokens: int) -> tuple[GroupPlan, ...]:
    """The object groups of one cached prefix of ``tokens`` tokens."""
    chunk = deployment.chunk_size
    chunks = tokens // chunk
    if shape.mla_latent_dim is not None:
        name, heads, dim = "MLA latent", 1, shape.mla_latent_dim + shape.mla_rope_dim
    else:
        name, heads, dim = "full attention", shape.kv_heads or 0, shape.head_dim or 0
    groups = []
    if shape.full_layers:
        groups.append(_attention(name, shape, deployment, shape.full_layers, heads, dim, chunks))
    if shape.sliding_layers and shape.sliding_window is not None:
        window_chunks = min(chunks, math.ceil(shape.sliding_window / chunk))
        name = f"sliding window {shape.sliding_window}"
        layers = shape.sliding_layers
        groups.append(_attention(name, shape, deployment, layers, heads, dim, window_chunks))
    if shape.state_layers:
        groups.append(_state(shape, deployment, snapshots=min(chunks, 1)))
    return tuple(groups)


def _attention(
    name: str,
    shape: ModelShape,
    deployment: Deployment,
    layers: int,
    kv_heads: int,
    head_dim: int,
    chunks: int,
) -> GroupPlan:
    kind: LayoutKind = "kv" if shape.mla_latent_dim is None else "latent"
    if kind == "latent":
        heads_per_rank, replication = 1, deployment.tp  # every rank keeps the whole latent
    else:
        heads_per_rank, replication = split_kv_heads(kv_heads, deployment.tp)
    stages = stage_layers(layers, deployment.pp)

    def layout(num_layers: int, heads: int, ranks: int) -> KVLayout:
        return KVLayout(
            num_layers=num_layers,
            kv_heads=heads,
            head_dim=head_dim,
            dtype=shape.layout_dtype,
            tokens_per_chunk=deployment.chunk_size,
            kind=kind,
            num_ranks=ranks,
        )

    logical = layout(layers, kv_heads, 1)
    tokens = chunks * deployment.chunk_size
    return GroupPlan(
        name=name,
        layers=layers,
        tp_replication=replication,
        tokens_per_prefix=tokens,
        bytes_per_token=logical.bytes_per_token(),
        bytes_per_prefix=logical.bytes_per_token() * tokens,
        stored_bytes_per_prefix=logical.bytes_per_token() * tokens * replication,
        objects_per_prefix=chunks * deployment.tp * len(stages),
        bytes_per_object=layout(max(stages), heads_per_rank, deployment.tp).object_bytes(),
    )


def _state(shape: ModelShape, deployment: Deployment, snapshots: int) -> GroupPlan:
    """A recurrent state is split across TP ranks (by heads), never replicated."""
    per_rank = -(-shape.state_bytes // deployment.tp)
    stages = stage_layers(shape.state_layers, deployment.pp)
    return GroupPlan(
        name="recurrent state",
        layers=shape.state_layers,
        tp_replication=1,
        tokens_per_prefix=0,
        bytes_per_token=0,
        bytes_per_prefix=shape.state_layers * shape.state_bytes * snapshots,
        stored_bytes_per_prefix=shape.state_layers * per_rank * deployment.tp * snapshots,
        objects_per_prefix=deployment.tp * len(stages) * snapshots,
        bytes_per_object=per_rank * max(stages),
    )


def prefill_flops(shape: ModelShape, tokens: int, model_params: float) -> float:
    """FLOPs of a prefill of ``tokens`` tokens: 2 per parameter per token, plus
    causal attention (QK^T and AV, 2 FLOPs per multiply-add) over the query/key
    pairs each layer sees; the attention term needs ``attention_heads``."""
    flops = 2.0 * model_params * tokens
    if shape.attention_heads is None:
        return flops
    qk = shape.qk_head_dim or shape.head_dim or 0
    v = shape.v_head_dim or shape.head_dim or 0
    pairs = shape.full_layers * tokens * (tokens + 1) / 2
    if shape.sliding_layers and shape.sliding_window is not None:
        window = min(tokens, shape.sliding_window)
        pairs += shape.sliding_layers * (window * (window + 1) / 2 + (tokens - window) * window)
    return flops + 2.0 * pairs * shape.attention_heads * (qk + v)


def make_plan(
    shape: ModelShape,
    deployment: Deployment | None = None,
    workload: Workload | None = None,
    network: Network | None = None,
    compute: Compute | None = None,
) -> Plan:
    """The plan for one deployment; ValueError naming the flag for bad input."""
    deployment = deployment or Deployment()
    workload = workload or Workload()
    network = network or Network()
    compute = compute or Compute()
    groups = prefix_groups(shape, deployment, workload.prefix_tokens)
    new_groups = prefix_groups(shape, deployment, workload.new_prefix_tokens)

    bytes_per_prefix = sum(g.bytes_per_prefix for g in groups)
    stored_per_prefix = sum(g.stored_bytes_per_prefix for g in groups)
    objects_per_prefix = sum(g.objects_per_prefix for g in groups)
    stored = stored_per_prefix * workload.prefixes
    replicated = stored * deployment.replicas
    chunks_per_prefix = workload.prefix_tokens // deployment.chunk_size

    read = workload.qps * workload.read_fraction * stored_per_prefix
    write = (
        workload.qps
        * workload.write_fraction
        * sum(g.stored_bytes_per_prefix for g in new_groups)
        * deployment.replicas
    )
    load = LinkCost(0.0, network.effective_bytes_per_s).seconds(stored_per_prefix)
    recompute = None
    if compute.gpu_tflops is not None and compute.model_params is not None:
        peak = deployment.tp * compute.gpu_tflops * 1e12 * compute.mfu
        recompute = prefill_flops(shape, workload.prefix_tokens, compute.model_params) / peak
    choice: Verdict | None = None if recompute is None else verdict(load, recompute)

    plan = Plan(
        shape=shape,
        deployment=deployment,
        workload=workload,
        network=network,
        compute=compute,
        groups=groups,
        bytes_per_token=sum(g.bytes_per_token for g in groups),
        bytes_per_prefix=bytes_per_prefix,
        total_bytes=bytes_per_prefix * workload.prefixes,
        tp_replication=max((g.tp_replication for g in groups), default=1),
        stored_bytes=stored,
        replicated_bytes=replicated,
        pool_bytes=replicated / deployment.utilization,
        chunks_per_prefix=chunks_per_prefix,
        chunks=chunks_per_prefix * workload.prefixes,
        objects_per_prefix=objects_per_prefix,
        objects=objects_per_prefix * workload.prefixes,
        replica_records=objects_per_prefix * workload.prefixes * deployment.replicas,
        bytes_per_object=max((g.bytes_per_object for g in groups), default=0),
        read_bytes_per_s=read,
        write_bytes_per_s=write,
        nic_line_bytes_per_s=network.line_bytes_per_s,
        nic_effective_bytes_per_s=network.effective_bytes_per_s,
        read_headroom=network.effective_bytes_per_s / read if read else None,
        metadata_objects_per_s=workload.qps * objects_per_prefix,
        inflight_bytes=read * network.staging_ms / 1000,
        load_seconds_lower_bound=stored_per_prefix / network.line_bytes_per_s,
        load_seconds_per_prefix=load,
        recompute_seconds_per_prefix=recompute,
        verdict=choice,
        warnings=(),
        notes=(),
    )
    return dataclasses.replace(plan, warnings=plan_warnings(plan), notes=plan_notes(plan))


__all__ = [
    "BYTES_PER_GBIT",
    "Compute",
    "Deployment",
    "GroupPlan",
    "Network",
    "Plan",
    "Workload",
    "make_plan",
    "prefill_flops",
    "prefix_groups",
    "split_kv_heads",
    "stage_layers",
    "transfer_seconds",
]
