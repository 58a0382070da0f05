"""A ``ModelShape``'s fields from a Hugging Face ``config.json``.

One reader per ``model_type`` (a registry): Llama, Mistral, Qwen2, Qwen3,
Gemma 2, Gemma 3 and DeepSeek-V2/V3 (MLA). The field names and their
fallbacks are those of the model's transformers configuration class: a missing
``num_key_value_heads`` means as many as attention heads, a missing
``head_dim`` is ``hidden_size / num_attention_heads``, and which layers slide
comes from ``layer_types`` when present, else from the family's rule (Mistral:
all layers; Qwen: layers from ``max_window_layers`` on, when
``use_sliding_window``; Gemma 2: every other layer; Gemma 3: all but every
``sliding_window_pattern``-th). A field the shape needs and the file lacks is
a ValueError naming the field and the flag that can stand in for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

_TORCH_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

Fields = dict[str, Any]


class _Config:
    """A config.json's fields, with errors that name the file and the flag."""

    def __init__(self, data: Mapping[str, Any], source: str) -> None:
        self.data = data
        self.source = source

    def get(self, name: str) -> Any:
        return self.data.get(name)

    def need(self, name: str, flag: str) -> Any:
        value = self.data.get(name)
        if value is None:
            raise ValueError(
                f"{self.source} has no {name!r} (model_type {self.data.get('model_type')!r}); "
                f"pass {flag}"
            )
        return value


def _dtype(config: _Config) -> Fields:
    name = config.get("torch_dtype") or config.get("dtype")
    return {"dtype": _TORCH_DTYPES[name]} if name in _TORCH_DTYPES else {}


def _attention(config: _Config) -> Fields:
    """Layers, heads and head size of a multi-head/GQA model."""
    heads = config.need("num_attention_heads", "--attention-heads")
    head_dim = config.get("head_dim")
    if head_dim is None:
        head_dim = config.need("hidden_size", "--head-dim") // heads
    return {
        "layers": config.need("num_hidden_layers", "--layers"),
        "kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "attention_heads": heads,
        **_dtype(config),
    }


def _sliding(config: _Config, rule: Callable[[int], bool]) -> Fields:
    """Sliding layers from ``layer_types``, else ``rule(layer index)``."""
    window = config.get("sliding_window")
    types = config.get("layer_types")
    layers = config.need("num_hidden_layers", "--layers")
    if types is not None:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(
                f"{config.source}: layer_types {unknown} are not attention layers kvtier plan "
                "reads; pass the shape with flags (--state-layers, --state-bytes for "
                "recurrent layers)"
            )
        count = types.count("sliding_attention")
    else:
        count = sum(rule(i) for i in range(layers)) if window is not None else 0
    if not count:
        return {}
    return {
        "sliding_window": config.need("sliding_window", "--sliding-window"),
        "sliding_layers": count,
    }


def _llama(config: _Config) -> Fields:
    return _attention(config)


def _mistral(config: _Config) -> Fields:
    return {**_attention(config), **_sliding(config, lambda i: True)}


def _qwen(config: _Config) -> Fields:
    if not config.get("use_sliding_window"):
        return _attention(config)
    first = config.need("max_window_layers", "--sliding-layers")
    return {**_attention(config), **_sliding(config, lambda i: i >= first)}


def _gemma2(config: _Config) -> Fields:
    return {**_attention(config), **_sliding(config, lambda i: (i + 1) % 2 == 1)}


def _gemma3(config: _Config) -> Fields:
    text = config.get("text_config")
    if text is not None:  # the multimodal checkpoint: its language model
        config = _Config({"torch_dtype": config.get("torch_dtype"), **text}, config.source)
    pattern = config.get("sliding_window_pattern") or 6  # transformers' default
    return {**_attention(config), **_sliding(config, lambda i: (i + 1) % pattern != 0)}


def _deepseek(config: _Config) -> Fields:
    """MLA: one latent of kv_lora_rank + qk_rope_head_dim per token per layer."""
    nope = config.need("qk_nope_head_dim", "--qk-head-dim")
    rope = config.need("qk_rope_head_dim", "--mla-rope-dim")
    return {
        "layers": config.need("num_hidden_layers", "--layers"),
        "mla_latent_dim": config.need("kv_lora_rank", "--mla-latent-dim"),
        "mla_rope_dim": rope,
        "attention_heads": config.need("num_attention_heads", "--attention-heads"),
        "qk_head_dim": nope + rope,
        "v_head_dim": config.need("v_head_dim", "--v-head-dim"),
        **_dtype(config),
    }


READERS: dict[str, Callable[[_Config], Fields]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen,
    "qwen3": _qwen,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gemma3_text": _gemma3,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
}


def shape_fields(data: Mapping[str, Any], source: str = "config.json") -> Fields:
    """``ModelShape`` keyword arguments read from a parsed config.json, plus
    ``name`` (its model_type). ``dtype`` is absent when the file names none."""
    model_type = data.get("model_type")
    reader = READERS.get(str(model_type))
    if reader is None:
        raise ValueError(
            f"{source}: model_type {model_type!r} is not one kvtier plan reads "
            f"({', '.join(READERS)}); pass the shape with --layers, --kv-heads, --head-dim "
            "and --dtype instead of --model-config"
        )
    return {"name": str(model_type), **reader(_Config(data, source))}


def read_shape_fields(path: str | Path) -> Fields:
    """``shape_fields`` of the config.json at ``path``."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--model-config {path}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model-config {path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--model-config {path}: expected a JSON object")
    return shape_fields(data, str(path))


__all__ = ["READERS", "read_shape_fields", "shape_fields"]
