"""Which tokens a blend recomputes, layer by layer (``BlendConfig``, ``Selector``).

Positions of a blended prompt are of three kinds:

- *computed*: in no reusable segment (the question, glue between segments)
  and always the last prompt token: every layer computes them;
- *exact*: in a segment placed where its stored KV was computed: at
  position 0 (computed alone), or right after the anchor it was computed
  after (the first document after the system prompt); in the prompt those
  tokens see the same context, so their stored KV is exact and recomputing
  them would change nothing;
- *candidates*: in a segment placed anywhere else; their stored KV lacks
  the context before the segment, and a share ``ratio`` of them is
  recomputed.

Four selections (``BlendConfig.selection``):

- ``question`` (the default): a first pass runs only the computed positions
  (the question) through every layer over the stored KV, and reads the
  attention they pay each position in the later layers (from layer
  ``read_from * num_layers``; mean over those layers, heads and positions).
  The candidates the question reads most, a share ``ratio`` of them, are
  recomputed at every layer from layer 0; the rest keep their stored KV.
  Deviation ranks tokens by how stale their KV is; this ranks them by how
  much the answer depends on them, read where the answer is decided (the
  later layers) rather than at a check layer near the bottom. The first
  pass costs the question's tokens at every layer (about 2 % of a full
  prefill on a 2 K-token RAG prompt).
- ``deviation`` (CacheBlend's): layers ``0 .. check_layer`` run every
  position; after layer ``l >= check_layer`` the candidates whose freshly
  computed K and V differ most from the stored ones stay selected, a share
  of all candidates that starts at ``ratio * (1 + spread)`` after the check
  layer and narrows linearly to ``ratio`` over ``filter_layers`` layers (or
  by the last layer but one, in a shallow model): gradual filtering, each
  set taken from the one before.
- ``impact``: the same layers and shares as ``deviation``, ranked by deviation
  times the attention the computed positions (the question) pay the token
  in that layer, mean over heads and positions. A token's stale KV changes
  what the question reads in proportion to both; deviation alone also
  spends the budget on tokens nothing later looks at. On SmolLM2-135M's
  retrieval prompts it cuts the mean KL to full prefill by about 40 % at the
  same work (docs/bench-log/blend.md, "Non-prefix reuse, anchored and impact-selected").
- ``static``: the first ``ceil(ratio * n)`` tokens of each candidate segment,
  at every layer from layer 0 (no full layers, no check).

``ratio`` 0 recomputes no candidate (plain concatenation: only the computed
positions run); ``ratio`` 1 recomputes every one at every layer (full
prefill, the same numbers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

SELECTIONS = ("question", "impact", "deviation", "static")
RANKED = frozenset({"impact", "deviation"})  # the selections that narrow layer by layer
MASKS = ("exact", "bottom_right")


@dataclass(frozen=True, slots=True, kw_only=True)
class BlendConfig:
    """How a blend reuses segments and picks what to recompute (see the
    module docstring).

    ``mask``: ``exact`` (a recomputed token attends to every position at or
    before its own) or ``bottom_right`` (the causal mask aligned to the last
    key, as peers run selected tokens through a prefill kernel; for
    comparison only: it lets a token in the middle see keys after it).

    ``anchor``: compute (and store) each moved segment after the prompt's
    first segment, the one at position 0 (the system prompt), instead of
    alone: its KV then holds that context and no attention sink of its own,
    and is found again by prompts that start with the same first segment
    (``kvtier.engine.segments``). Off: segments alone, found after any.

    ``at_offset`` (anchored segments only): compute a segment placed ``d``
    tokens past the anchor's end at the largest power of two ``g <= d``
    past it (positions ``A+g ..``, nothing in between), not right after it,
    and move it the remaining ``d - g``: a document three documents in then
    sits as far from the system prompt as it does in the prompt, instead of
    holding KV for "the first document". Each power of two is its own stored
    object (``SegmentHasher.after``), so a document is found again at
    offsets within the same power of two. Off: every anchored segment is
    computed right after the anchor (one object per document).
    """

    ratio: float = 0.15
    selection: str = "question"
    read_from: float = 0.5  # question: the share of layers, from the bottom, not read
    check_layer: int = 1
    spread: float = 1.0
    filter_layers: int = 3
    mask: str = "exact"
    anchor: bool = True
    at_offset: bool = True

    def gap(self, offset: int) -> int:
        """How far past the anchor's end a segment placed ``offset`` tokens
        past it is computed: the largest power of two <= ``offset`` with
        ``at_offset``, else (and at offset 0) right after it."""
        return 1 << (offset.bit_length() - 1) if self.at_offset and offset > 0 else 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"BlendConfig.ratio must be in [0, 1], got {self.ratio}")
        if self.selection not in SELECTIONS:
            raise ValueError(
                f"BlendConfig.selection must be one of {SELECTIONS}, got {self.selection!r}"
            )
        if self.mask not in MASKS:
            raise ValueError(f"BlendConfig.mask must be one of {MASKS}, got {self.mask!r}")
        if self.check_layer < 1:
            raise ValueError(
                "BlendConfig.check_layer must be >= 1: layer 0's stored K and V are exact "
                f"(they depend on the token and its position only), got {self.check_layer}"
            )
        if not 0.0 <= self.read_from < 1.0:
            raise ValueError(
                "BlendConfig.read_from must be in [0, 1) (a share of the layers), "
                f"got {self.read_from}"
            )
        if self.spread < 0 or self.filter_layers < 0:
            raise ValueError("BlendConfig.spread and filter_layers must be >= 0")


class Selector:
    """The positions each layer runs, for one prompt.

    ``computed`` and ``candidates`` are ``[tokens]`` boolean masks (see the
    module docstring); ``spans`` the candidate segments' ``(start, end)``.
    """

    def __init__(
        self,
        config: BlendConfig,
        num_layers: int,
        computed: torch.Tensor,
        candidates: torch.Tensor,
        spans: Sequence[tuple[int, int]],
    ) -> None:
        self.config = config
        self.num_layers = num_layers
        self.computed = computed
        self.candidates = candidates
        self.spans = list(spans)
        self.total = int(candidates.sum())
        # the last layer that narrows: filter_layers after the check layer, and
        # never the model's last (nothing runs after it)
        self.last_filter = min(config.check_layer + config.filter_layers, num_layers - 2)
        self.reading: torch.Tensor | None = None  # question: what the question reads, [N]

    @property
    def reads_question(self) -> bool:
        """Whether the blend first reads what the question attends to
        (``reader``, then ``read``): the ``question`` selection."""
        config = self.config
        return config.selection == "question" and 0.0 < config.ratio < 1.0 and self.total > 0

    def reader(self) -> QuestionReader:
        """The selector of the first pass (the computed positions alone)."""
        return QuestionReader(self)

    def read(self, attention: Sequence[torch.Tensor]) -> None:
        """Take what the first pass read: per read layer, the attention the
        computed positions pay every position (``[N]``)."""
        self.reading = torch.stack(list(attention)).mean(dim=0)

    def reads_after(self, layer: int) -> bool:
        """Whether the pass reads the attention of ``layer`` (the first pass's)."""
        return False

    def initial(self) -> torch.Tensor:
        """Sorted positions layer 0 runs."""
        config = self.config
        if self.total == 0 or config.ratio == 0.0:
            chosen = self.computed
        elif self.reads_question:
            if self.reading is None:
                raise ValueError(
                    "the question selection ranks by what the question reads: read first"
                )
            pool = torch.nonzero(self.candidates).flatten()
            top = torch.topk(self.reading[pool], round(config.ratio * self.total)).indices
            chosen = self.computed.clone()
            chosen[pool[top]] = True
        elif config.selection == "static":
            chosen = self.computed.clone()
            for start, end in self.spans:
                chosen[start : start + math.ceil(config.ratio * (end - start))] = True
        else:
            chosen = torch.ones_like(self.computed)  # layers 0 .. check_layer: everything
        return torch.nonzero(chosen).flatten()

    def narrows_after(self, layer: int) -> bool:
        """Whether ``after`` picks a new set at the end of ``layer``."""
        config = self.config
        return (
            config.selection in RANKED
            and 0.0 < config.ratio < 1.0
            and self.total > 0
            and config.check_layer <= layer <= self.last_filter
        )

    def share(self, layer: int) -> float:
        """The share of all candidates selected after ``layer``: from
        ``ratio * (1 + spread)`` after the check layer down to ``ratio`` after
        the last filtering layer."""
        config = self.config
        steps = self.last_filter - config.check_layer
        left = (self.last_filter - layer) / steps if steps > 0 else 0.0
        return min(1.0, config.ratio * (1.0 + config.spread * left))

    @property
    def wants_attention(self) -> bool:
        """Whether ``after`` needs the attention the computed positions pay
        (the ``impact`` selection, when it narrows at all)."""
        config = self.config
        return config.selection == "impact" and 0.0 < config.ratio < 1.0 and self.total > 0

    def after(
        self,
        layer: int,
        positions: torch.Tensor,
        deviation: torch.Tensor,
        attention: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Of ``positions`` (this layer's, sorted), the indices into it that
        the next layer runs: every computed one and the candidates of highest
        rank, a share ``share(layer)`` of all candidates. The rank is
        ``deviation`` (``[S]``), times ``attention`` (``[S]``, what the
        computed positions pay each) for ``impact``."""
        if self.wants_attention:
            if attention is None:
                raise ValueError("the impact selection ranks by attention: pass attention")
            deviation = deviation * attention
        keep = self.computed[positions]
        pool = torch.nonzero(self.candidates[positions] & ~keep).flatten()
        count = min(round(self.share(layer) * self.total), pool.numel())
        if count:
            top = torch.topk(deviation[pool], count).indices
            keep = keep.clone()
            keep[pool[top]] = True
        return torch.nonzero(keep).flatten()


class QuestionReader(Selector):
    """The first pass of the ``question`` selection: only the computed
    positions run, at every layer, and the attention they pay every position
    is read from layer ``read_from * num_layers`` on."""

    def __init__(self, selector: Selector) -> None:
        super().__init__(
            selector.config,
            selector.num_layers,
            selector.computed,
            selector.candidates,
            selector.spans,
        )
        self.first = int(selector.num_layers * selector.config.read_from)

    @property
    def wants_attention(self) -> bool:
        return True

    def initial(self) -> torch.Tensor:
        return torch.nonzero(self.computed).flatten()

    def narrows_after(self, layer: int) -> bool:
        return False

    def reads_after(self, layer: int) -> bool:
        return layer >= self.first


__all__ = ["MASKS", "SELECTIONS", "BlendConfig", "QuestionReader", "Selector"]
