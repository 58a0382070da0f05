"""The prefill/decode hand-off's vocabulary, shared by the cache server (which
holds a hand-off), the vLLM connector (which offers and takes it) and the P/D
proxy (which sets a request's parameters and reads its outcome).

- The names in a request's ``kv_transfer_params``: ``PRODUCE`` and ``CONSUME``
  are vLLM's; the rest are kvtier's.
- ``HandoffOutcome``: the server's answer to an offer, a take or a done
  (carried by ``messages.HandoffState``).
- The consumer's response: ``OUTCOME`` is ``LOADED``, ``RECOMPUTED`` or
  ``ERROR``; ``CAUSE`` is a ``HandoffOutcome`` value or one of the consumer's
  own reasons (``NOT_OFFERED``...).
"""

from __future__ import annotations

from enum import StrEnum

# kv_transfer_params
PRODUCE = "do_remote_decode"  # vLLM's names for the two sides of a P/D request
CONSUME = "do_remote_prefill"
HANDOFF_ID = "kvtier_handoff"
PROMPT_TOKENS = "kvtier_prompt_tokens"
CONSUMER = "kvtier_consumer"  # the decode engine's id that alone may take it ("" any)
RANKS = "kvtier_ranks"  # the producer's TP size: a consumer of another has its objects re-sharded
SERVER = "kvtier_server"  # the boot id of the producer's cache server: another's is found in L2
PAGES = "kvtier_page_format"  # the producer's page format: another block size is re-paged
ON_FAILURE = "kvtier_on_failure"  # one of POLICIES, for this request
OUTCOME = "kvtier_handoff_outcome"  # the consumer's response: LOADED, RECOMPUTED or ERROR
CAUSE = "kvtier_handoff_cause"  # why it was not loaded

# What a consumer does when its hand-off does not come
RECOMPUTE = "recompute"
FAIL = "error"
POLICIES = (RECOMPUTE, FAIL)

# The consumer's response
LOADED = "loaded"
RECOMPUTED = "recomputed"
ERROR = "error"

# The consumer's own causes, beside the server's ``HandoffOutcome`` values
NOT_OFFERED = "not_offered"  # nothing offered within handoff_wait_s: the producer is gone
SERVER_AWAY = "server_away"
REFUSED = "refused"  # the server refused the TAKE itself (an error reply)
BAD_PARAMS = "bad_params"
INCOMPLETE_LOAD = "incomplete_load"  # granted, but not every chunk came back


class HandoffOutcome(StrEnum):
    OFFERED = "offered"  # held for its consumer
    INCOMPLETE = "incomplete"  # some of its objects were not in L1 when offered: nothing held
    PENDING = "pending"  # not offered (yet): ask again
    GRANTED = "granted"  # this taker has it: load the chunks, then DONE
    TAKEN = "taken"  # another consumer has it
    CONSUMED = "consumed"  # taken and done
    EXPIRED = "expired"  # the lease ended before it was taken and done
    WRONG_CONSUMER = "wrong_consumer"  # it is held for another consumer
    NAMESPACE_MISMATCH = "namespace_mismatch"  # another model or tenant
    LAYOUT_MISMATCH = "layout_mismatch"  # another TP size, block size or page format
    PROMPT_MISMATCH = "prompt_mismatch"  # other chunks than the taker's prompt
    RELEASED = "released"  # DONE's answer: its hold is dropped
    CONVERTING = "converting"  # (internal) granted once its objects are re-sharded
    FINDING = "finding"  # (internal) granted if its chunks are found in this server's tiers


# What a consumer may still wait for; every other outcome of a TAKE ends its wait.
WAITING = frozenset({HandoffOutcome.PENDING})
