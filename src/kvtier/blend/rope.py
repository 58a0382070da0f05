"""Moving a segment's K to a new position: ``RopeShift``.

With rotary position embeddings a key at position ``p`` is ``s * R(p) k``: a
rotation by ``p * inv_freq`` of each pair of dimensions, times a constant
``s`` (1 for plain RoPE, YaRN's attention factor otherwise). Rotations
compose, ``R(d) R(p) = R(p + d)``, so a segment's K computed at positions
``0 .. n-1`` becomes the K of positions ``d .. d+n-1`` by one more pure
rotation by ``d`` (``s`` is in the stored K already). That is exact
whenever ``inv_freq`` is one fixed vector: plain RoPE, linear scaling,
Llama 3's and YaRN's (static) frequency maps. It is not exact, and
``RopeShift.of`` refuses the model, when the frequencies depend on the
sequence length (``dynamic`` NTK, ``longrope``), for an unknown RoPE type,
for a partial rotary embedding, and for a model without RoPE.

The rotation uses the rotate-half pairing of transformers' Llama family
(dimension ``i`` with ``i + head_dim/2``), the one those models apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# RoPE types whose inverse frequencies are fixed at load time.
EXACT_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
REFUSED_ROPE_TYPES = {
    "dynamic": "its frequencies change with the sequence length (dynamic NTK scaling)",
    "longrope": "it switches between short and long frequency factors by sequence length",
}


@dataclass(frozen=True, slots=True, eq=False)
class RopeShift:
    """The rotation that moves K along the sequence (see the module docstring)."""

    inv_freq: torch.Tensor  # [head_dim / 2], float64
    rope_type: str

    @classmethod
    def of(cls, model: Any) -> RopeShift:
        """The shift for a transformers causal LM; ValueError naming the reason
        when moving its K is not exact."""
        name = type(model).__name__
        rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
        inv_freq = getattr(rotary, "inv_freq", None)
        if not isinstance(inv_freq, torch.Tensor):
            raise ValueError(
                f"{name} has no rotary position embedding (model.model.rotary_emb); a segment's "
                "KV can only move to a new position under RoPE"
            )
        rope_type = str(getattr(rotary, "rope_type", "default"))
        if rope_type in REFUSED_ROPE_TYPES:
            raise ValueError(
                f"{name} uses rope_type {rope_type!r}: moving K is not exact because "
                f"{REFUSED_ROPE_TYPES[rope_type]}; blend only models with one of "
                f"{sorted(EXACT_ROPE_TYPES)}"
            )
        if rope_type not in EXACT_ROPE_TYPES:
            raise ValueError(
                f"{name} uses rope_type {rope_type!r}, which kvtier has not shown exact to move; "
                f"blend only models with one of {sorted(EXACT_ROPE_TYPES)}"
            )
        config = model.config.get_text_config(decoder=True)
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        if 2 * inv_freq.numel() != head_dim:
            raise ValueError(
                f"{name} rotates {2 * inv_freq.numel()} of its {head_dim} head dimensions "
                "(a partial rotary embedding), which kvtier's shift does not model"
            )
        return cls(inv_freq.detach().to(torch.float64).cpu(), rope_type)

    def rotate(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """``keys`` (``[..., tokens, head_dim]``) moved ``delta`` positions on
        (a new tensor; ``delta`` may be negative)."""
        if delta == 0:
            return keys.clone()
        angles = float(delta) * self.inv_freq
        cos = torch.cat((angles.cos(), angles.cos())).to(keys.dtype)
        sin = torch.cat((angles.sin(), angles.sin())).to(keys.dtype)
        half = keys.shape[-1] // 2
        rotated = torch.cat((-keys[..., half:], keys[..., :half]), dim=-1)
        return keys * cos + rotated * sin


__all__ = ["EXACT_ROPE_TYPES", "REFUSED_ROPE_TYPES", "RopeShift"]
