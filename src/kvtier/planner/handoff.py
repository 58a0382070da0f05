"""Prefill/decode hand-off budgets, kept apart from cross-request reuse.

The two needs are sized separately. The rest
of ``kvtier plan`` sizes cross-request reuse (prefixes kept for later
requests); this sizes the hand-off of *this* request's KV from a prefill
engine to a decode engine through the cache:

- what one hand-off moves: the whole prompt, its last partial chunk padded to
  a chunk (``handoff_tokens``), over the prefill side's ranks, and what the
  decode side reads under its own ranks (different TP: re-sharded by KV
  heads, ``kvtier.layout.reshard``);
- the hand-off rate in bytes per second, written and read;
- how long a hand-off object lives: written, waited for (the decode side's
  queue), read — then released at once; at most the lease when the consumer
  never comes;
- what is resident because of hand-offs (Little's law: rate x lifetime x
  bytes; with another decode TP the server also holds the re-sharded copy
  from the take through the read), its bound under the lease, and the
  double-buffered bytes: during the write the prefill engine still holds its
  copy, during the read the store still holds its copy, so those bytes
  exist twice;
- the KV the decode side holds for its sequences in flight (Little's law
  again: rate x output tokens x time per token sequences, each with its
  prompt and half its output on average, rounded up to chunks).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvtier.planner.plan import Deployment, Network, prefix_groups, split_kv_heads
from kvtier.planner.shape import ModelShape, require_int, require_positive


@dataclass(frozen=True, slots=True)
class Handoff:
    """Prefill/decode disaggregated traffic."""

    pd_qps: float = 1.0  # hand-offs per second
    pd_prompt_tokens: int = 8192
    pd_output_tokens: int = 256
    pd_itl_ms: float = 30.0  # the decode side's time per output token
    decode_tp: int | None = None  # None: the prefill side's TP
    handoff_wait_ms: float = 50.0  # from the producer's commit to the consumer's load
    handoff_lease_s: float = 30.0  # a hand-off nobody consumes is reclaimed after this

    def __post_init__(self) -> None:
        require_positive("--pd-qps", self.pd_qps)
        require_int("--pd-prompt-tokens", self.pd_prompt_tokens)
        require_int("--pd-output-tokens", self.pd_output_tokens)
        require_positive("--pd-itl-ms", self.pd_itl_ms)
        require_int("--decode-tp", self.decode_tp)
        require_positive("--handoff-wait-ms", self.handoff_wait_ms, allow_zero=True)
        require_positive("--handoff-lease-s", self.handoff_lease_s)


@dataclass(frozen=True, slots=True)
class HandoffPlan:
    handoff: Handoff
    prefill_tp: int
    decode_tp: int
    layout: str  # "same split" or how the objects are converted
    handoff_tokens: int
    written_bytes: int  # one hand-off, over the prefill side's ranks
    read_bytes: int  # one hand-off, over the decode side's ranks
    write_bytes_per_s: float
    read_bytes_per_s: float
    write_s: float
    read_s: float
    lifetime_s: float
    resident_bytes: float
    resident_bytes_bound: float  # every consumer gone: objects live out their lease
    double_buffered_bytes: float
    decode_sequences: float
    decode_kv_bytes: float

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def plan_handoff(
    shape: ModelShape, deployment: Deployment, network: Network, handoff: Handoff
) -> HandoffPlan:
    """The hand-off budgets of ``handoff`` between a prefill side deployed as
    ``deployment`` and a decode side with ``handoff.decode_tp`` ranks (the
    same PP, chunk and block size), over ``network``'s effective rate;
    ValueError naming the flag for a decode TP the model cannot be split by."""
    decode = dataclasses.replace(deployment, tp=handoff.decode_tp or deployment.tp)
    if shape.mla_latent_dim is None:
        try:
            split_kv_heads(shape.kv_heads or 0, decode.tp)
        except ValueError as exc:
            raise ValueError(f"--decode-tp {decode.tp}: {exc}") from None
    chunk = deployment.chunk_size
    tokens = math.ceil(handoff.pd_prompt_tokens / chunk) * chunk

    def stored(side: Deployment, n: int) -> int:
        return sum(g.stored_bytes_per_prefix for g in prefix_groups(shape, side, n))

    written, read = stored(deployment, tokens), stored(decode, tokens)
    link = network.effective_bytes_per_s
    write_s, read_s = written / link, read / link
    lifetime = write_s + handoff.handoff_wait_ms / 1000 + read_s
    sequences = handoff.pd_qps * handoff.pd_output_tokens * handoff.pd_itl_ms / 1000
    mean_tokens = handoff.pd_prompt_tokens + handoff.pd_output_tokens // 2
    resharded = decode.tp != deployment.tp
    if not resharded:
        layout = "same split"
    elif shape.mla_latent_dim is not None:
        layout = "latent copied to every rank"
    else:
        layout = "re-sharded by KV heads"
    return HandoffPlan(
        handoff=handoff,
        prefill_tp=deployment.tp,
        decode_tp=decode.tp,
        layout=layout,
        handoff_tokens=tokens,
        written_bytes=written,
        read_bytes=read,
        write_bytes_per_s=handoff.pd_qps * written,
        read_bytes_per_s=handoff.pd_qps * read,
        write_s=write_s,
        read_s=read_s,
        lifetime_s=lifetime,
        resident_bytes=handoff.pd_qps * (lifetime * written + (read_s * read if resharded else 0)),
        resident_bytes_bound=handoff.pd_qps * handoff.handoff_lease_s * written,
        double_buffered_bytes=handoff.pd_qps * (write_s * written + read_s * read),
        decode_sequences=sequences,
        decode_kv_bytes=sequences * stored(decode, math.ceil(mean_tokens / chunk) * chunk),
    )


__all__ = ["Handoff", "HandoffPlan", "plan_handoff"]
