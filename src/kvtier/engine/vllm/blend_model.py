"""vLLM's Llama, seen as ``kvtier.blend.blend_forward`` sees a transformers
model: the blend runs on vLLM's own weights and modules.

``BlendModel`` exposes ``model.embed_tokens``, ``model.layers``,
``model.norm``, ``model.rotary_emb``, ``lm_head`` and ``config`` with the
transformers calling conventions the blended pass uses. Each layer runs
vLLM's norms, QKV projection, rotary embedding, output projection and MLP
around ``kvtier.blend.forward.prefix_attention`` (PyTorch's SDPA) over
every position's K and V (handed back by the pass's stand-in cache); it
never calls vLLM's ``Attention`` module, whose paged kernel and connector
hooks belong to the engine's own forward. The
"position embeddings" the pass threads through the layers are the position
ids themselves: vLLM's rotary embedding takes positions.

Only tensor parallelism 1 and the plain rotary embedding are handled
(``BlendModel.of`` says why not otherwise).
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.blend.forward import prefix_attention


class _Rotary:
    """``rotary_emb(hidden, positions)`` -> the positions; ``inv_freq`` for ``RopeShift``."""

    rope_type = "default"

    def __init__(self, rotary: Any) -> None:
        self.inv_freq = rotary._compute_inv_freq(rotary.base)

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor]:
        return (positions,)


class _Layer:
    """One vLLM ``LlamaDecoderLayer`` with the transformers layer call."""

    def __init__(self, layer: Any, index: int) -> None:
        self.layer = layer
        self.index = index

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        position_embeddings: tuple[torch.Tensor],
        past_key_values: Any,
        use_cache: bool = True,
        kvtier_probe: Any = None,
    ) -> torch.Tensor:
        layer, attn = self.layer, self.layer.self_attn
        positions = position_embeddings[0][0]
        x = hidden_states[0]
        tokens = x.shape[0]
        residual = x
        qkv, _ = attn.qkv_proj(layer.input_layernorm(x))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions, q.contiguous(), k.contiguous())
        heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        k = k.view(tokens, kv_heads, dim).transpose(0, 1)[None]
        v = v.reshape(tokens, kv_heads, dim).transpose(0, 1)[None]
        keys, values = past_key_values.update(k, v, self.index)
        query = q.view(tokens, heads, dim).transpose(0, 1)[None]
        if kvtier_probe is not None:  # what the question attends to (kvtier.blend.forward)
            kvtier_probe.observe(query, keys, attention_mask, attn.scaling)
        out = prefix_attention(
            query, keys.to(query.dtype), values.to(query.dtype), attention_mask, attn.scaling
        )
        out, _ = attn.o_proj(out[0].transpose(0, 1).reshape(tokens, heads * dim))
        x = residual + out
        out = layer.mlp(layer.post_attention_layernorm(x))
        hidden: torch.Tensor = (x + out)[None]
        return hidden

    __call__ = forward


class _Norm:
    def __init__(self, norm: Any) -> None:
        self.norm = norm

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(hidden.reshape(-1, hidden.shape[-1])).reshape(hidden.shape)
        return out


class _Decoder:
    def __init__(self, model: Any) -> None:
        inner = model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = [_Layer(layer, i) for i, layer in enumerate(inner.layers)]
        self.norm = _Norm(inner.norm)
        self.rotary_emb = _Rotary(inner.layers[0].self_attn.rotary_emb)


class BlendModel:
    """A vLLM Llama for ``blend_forward`` and ``RopeShift`` (see the module docstring)."""

    probes_attention = True  # its layers hand the blend's probe their queries themselves
    attention_implementation = "sdpa"  # prefix_attention: causal where given no mask

    def __init__(self, model: Any, config: Any) -> None:
        self.vllm_model = model
        self.config = config
        self.model = _Decoder(model)
        self.dtype = next(model.parameters()).dtype

    @classmethod
    def of(cls, model: Any, hf_config: Any) -> BlendModel:
        """The blend's view of ``model``; ValueError naming what it cannot run."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None or not len(layers):
            raise ValueError(f"{type(model).__name__} has no model.layers to blend over")
        attn = layers[0].self_attn
        rotary = attn.rotary_emb
        if type(rotary).__name__ != "RotaryEmbedding" or not rotary.is_neox_style:
            raise ValueError(
                f"{type(rotary).__name__} is not vLLM's plain rotary embedding; the blend moves "
                "K only under plain RoPE"
            )
        if rotary.rotary_dim != attn.head_dim:
            raise ValueError("a partial rotary embedding cannot be moved by the blend")
        if attn.num_heads != attn.total_num_heads:
            raise ValueError("the blend runs only at tensor parallelism 1")
        return cls(model, hf_config)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.vllm_model.compute_logits(hidden.reshape(-1, hidden.shape[-1]))
        return logits.reshape(*hidden.shape[:-1], -1)


__all__ = ["BlendModel"]
