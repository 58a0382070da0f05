"""What a plan should tell its reader in words: warnings where the plan does
not hold, notes on what it assumed."""

from __future__ import annotations

from kvtier.planner.quantities import both
from kvtier.planner.terms import Plan

# Below this an object's fixed costs (a directory look-up, an RPC, a lease, a
# header check) rival its transfer: 1 MiB at 25 GB/s moves in 42 us, about one
# metadata round trip. Bigger chunks trade this for coarser hits.
SMALL_OBJECT_BYTES = 1 << 20
# Reads should leave this much of the NIC free for bursts, failures and
# re-replication (16.3 GiB/s for 15 GiB/s "cannot carry" them).
MIN_READ_HEADROOM = 1.3


def plan_warnings(plan: Plan) -> tuple[str, ...]:
    """Where the plan does not hold, each with what to change."""
    deployment, workload = plan.deployment, plan.workload
    warnings = []
    if plan.chunks_per_prefix == 0:
        warnings.append(
            f"a prefix of {workload.prefix_tokens} tokens is shorter than one chunk "
            f"(--chunk-size {deployment.chunk_size}): none of it is cached"
        )
    if deployment.chunk_size % deployment.block_size:
        warnings.append(
            f"--chunk-size {deployment.chunk_size} is not a multiple of the engine's block "
            f"size {deployment.block_size} (--block-size): engines load whole blocks, so a "
            "chunk must be a whole number of them"
        )
    headroom = plan.read_headroom
    if headroom is not None and headroom < 1:
        warnings.append(
            f"reads need {both(plan.read_bytes_per_s, '/s')} but the NIC gives "
            f"{both(plan.nic_effective_bytes_per_s, '/s')} effective: the pool cannot serve "
            "every hit; add NICs or nodes, keep hot prefixes in L1, or plan for fewer "
            "remote reads (--qps, --read-fraction)"
        )
    elif headroom is not None and headroom < MIN_READ_HEADROOM:
        warnings.append(
            f"read headroom is {headroom:.2f}x (under {MIN_READ_HEADROOM}x): "
            f"{both(plan.nic_effective_bytes_per_s, '/s')} effective for "
            f"{both(plan.read_bytes_per_s, '/s')} of reads leaves no room for bursts, "
            "failures or re-replication"
        )
    sized = [g for g in plan.groups if g.objects_per_prefix]
    smallest = min(sized, key=lambda g: g.bytes_per_object, default=None)
    if smallest is not None and smallest.bytes_per_object < SMALL_OBJECT_BYTES:
        warnings.append(
            f"{smallest.name} objects are {both(smallest.bytes_per_object)} each: per-object "
            "costs (a directory look-up, an RPC, a lease, an IOP) rival moving the bytes, so "
            "metadata rather than bandwidth limits throughput as traffic grows "
            f"({plan.metadata_objects_per_s:,.0f} object look-ups per second here); a larger "
            "--chunk-size makes fewer, bigger objects"
        )
    recompute = plan.recompute_seconds_per_prefix
    if plan.verdict == "recompute" and recompute is not None:
        warnings.append(
            f"loading a prefix takes {plan.load_seconds_per_prefix * 1e3:,.1f} ms over the "
            f"NIC, recomputing it {recompute * 1e3:,.1f} ms: remote reads do not pay for "
            "this prefix length; keep it in L1 or recompute"
        )
    return tuple(warnings)


def plan_notes(plan: Plan) -> tuple[str, ...]:
    """What the plan assumed or could not compute."""
    shape, deployment, workload = plan.shape, plan.deployment, plan.workload
    notes = []
    left = workload.prefix_tokens % deployment.chunk_size
    if left and plan.chunks_per_prefix:
        notes.append(
            f"the last {left} tokens of a prefix do not fill a chunk: they are recomputed, "
            "not cached"
        )
    if plan.tp_replication > 1:
        held = (
            "an MLA latent is kept whole on each rank"
            if shape.mla
            else f"TP {deployment.tp} over {shape.kv_heads} KV heads keeps each head on "
            f"{plan.tp_replication} ranks"
        )
        notes.append(f"{held}: the pool stores {plan.tp_replication}x the logical bytes")
    if plan.verdict is None:
        notes.append("pass --gpu-tflops and --model-params for the read-or-recompute verdict")
    else:
        notes.append(
            "load time counts the NIC transfer only; look-up, host-to-device copy and "
            "queueing add to it, overlap takes from it"
        )
        if shape.attention_heads is None:
            notes.append(
                "recompute counts 2 FLOPs per parameter per token only: pass "
                "--attention-heads to add attention's quadratic term"
            )
    return tuple(notes)


__all__ = ["MIN_READ_HEADROOM", "SMALL_OBJECT_BYTES", "plan_notes", "plan_warnings"]
