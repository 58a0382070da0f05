"""Model shapes read from Hugging Face config.json files: the published
configs' fields for each family kvtier plan reads, the KV they imply worked out
by hand, and the sliding layers checked against transformers' own
configuration classes where those are installed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvtier.planner import ModelShape, make_plan, shape_fields
from kvtier.planner.hf_config import read_shape_fields

# The fields that matter, as the published config.json files spell them.
LLAMA_31_8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "torch_dtype": "bfloat16",
}
QWEN25_7B = {
    "model_type": "qwen2",
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "hidden_size": 3584,
    "use_sliding_window": False,
    "sliding_window": 131072,
    "max_window_layers": 28,
    "torch_dtype": "bfloat16",
}
QWEN3_8B = {
    "model_type": "qwen3",
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 4096,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 36,
    "torch_dtype": "bfloat16",
}
MISTRAL_7B_V01 = {
    "model_type": "mistral",
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "sliding_window": 4096,
    "torch_dtype": "bfloat16",
}
GEMMA2_9B = {
    "model_type": "gemma2",
    "num_hidden_layers": 42,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "hidden_size": 3584,
    "sliding_window": 4096,
    "torch_dtype": "float32",
}
GEMMA3_4B = {
    "model_type": "gemma3",
    "text_config": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_size": 2560,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
    },
    "torch_dtype": "bfloat16",
}
GEMMA3_1B = {
    "model_type": "gemma3_text",
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "hidden_size": 1152,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v2",
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    ("config", "bytes_per_token", "sliding"),
    [
        (LLAMA_31_8B, 2 * 32 * 8 * 128 * 2, None),  # 128 KiB: the seed's model
        (QWEN25_7B, 2 * 28 * 4 * 128 * 2, None),  # use_sliding_window false
        (QWEN3_8B, 2 * 36 * 8 * 128 * 2, None),
        (MISTRAL_7B_V01, 2 * 32 * 8 * 128 * 2, (4096, 32)),  # every layer slides
        (GEMMA2_9B, 2 * 42 * 8 * 256 * 4, (4096, 21)),  # every other layer, fp32
        (GEMMA3_4B, 2 * 34 * 4 * 256 * 2, (1024, 29)),  # 5 global layers of 34
        (GEMMA3_1B, 2 * 26 * 1 * 256 * 2, (512, 22)),  # 4 global layers of 26
        (DEEPSEEK_V2_LITE, 27 * (512 + 64) * 2, None),  # MLA: one latent per layer
        (DEEPSEEK_V3, 61 * (512 + 64) * 2, None),
    ],
    ids=lambda v: v["model_type"] if isinstance(v, dict) else None,
)
def test_published_configs(
    config: dict[str, Any], bytes_per_token: int, sliding: tuple[int, int] | None
) -> None:
    shape = ModelShape(**shape_fields(config))
    assert shape.name == config["model_type"]
    assert make_plan(shape).bytes_per_token == bytes_per_token
    window = (shape.sliding_window, shape.sliding_layers) if shape.sliding_layers else None
    assert window == sliding


def test_mla_config_fields() -> None:
    fields = shape_fields(DEEPSEEK_V3)
    assert fields["mla_latent_dim"] == 512 and fields["mla_rope_dim"] == 64
    assert fields["qk_head_dim"] == 192 and fields["v_head_dim"] == 128
    assert "kv_heads" not in fields and fields["dtype"] == "bf16"


def test_qwen_sliding_layers_from_max_window_layers() -> None:
    config = {
        **QWEN25_7B,
        "use_sliding_window": True,
        "sliding_window": 4096,
        "max_window_layers": 21,
    }
    fields = shape_fields(config)
    assert (fields["sliding_window"], fields["sliding_layers"]) == (4096, 7)  # layers 21..27


def test_layer_types_win_over_the_family_rule() -> None:
    types = ["sliding_attention"] * 3 + ["full_attention"] * 39
    fields = shape_fields({**GEMMA2_9B, "layer_types": types})
    assert fields["sliding_layers"] == 3


def test_defaults_follow_transformers() -> None:
    mha = {k: v for k, v in LLAMA_31_8B.items() if k != "num_key_value_heads"}
    assert shape_fields(mha)["kv_heads"] == 32  # no num_key_value_heads: multi-head
    assert shape_fields(LLAMA_31_8B)["head_dim"] == 128  # hidden_size / heads
    untyped = {k: v for k, v in LLAMA_31_8B.items() if k != "torch_dtype"}
    assert "dtype" not in shape_fields(untyped)  # ModelShape's default (or --dtype) applies
    assert shape_fields({**untyped, "dtype": "float16"})["dtype"] == "fp16"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {k: v for k, v in LLAMA_31_8B.items() if k != "num_hidden_layers"},
            "has no 'num_hidden_layers' (model_type 'llama'); pass --layers",
        ),
        (
            {k: v for k, v in DEEPSEEK_V3.items() if k != "kv_lora_rank"},
            "has no 'kv_lora_rank' (model_type 'deepseek_v3'); pass --mla-latent-dim",
        ),
        (
            {k: v for k, v in LLAMA_31_8B.items() if k != "hidden_size"},
            "has no 'hidden_size' (model_type 'llama'); pass --head-dim",
        ),
        ({**LLAMA_31_8B, "model_type": "mamba"}, "model_type 'mamba' is not one kvtier plan"),
        (
            {**GEMMA2_9B, "layer_types": ["linear_attention"] * 42},
            "layer_types ['linear_attention'] are not attention layers",
        ),
    ],
)
def test_unreadable_configs_name_the_field(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        shape_fields(config)


def test_read_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GEMMA2_9B))
    assert read_shape_fields(path)["sliding_layers"] == 21
    with pytest.raises(ValueError, match="cannot read it"):
        read_shape_fields(tmp_path / "missing.json")
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        read_shape_fields(path)


@pytest.mark.parametrize(
    "config",
    [QWEN25_7B, QWEN3_8B, GEMMA2_9B, GEMMA3_1B, GEMMA3_4B["text_config"]],
    ids=["qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3 text_config"],
)
def test_sliding_layers_agree_with_transformers(config: dict[str, Any]) -> None:
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoConfig.for_model(**config)
    ours = shape_fields(config)
    sliding = sum(kind == "sliding_attention" for kind in theirs.layer_types)
    assert ours.get("sliding_layers", 0) == sliding
    assert ours["kv_heads"] == theirs.num_key_value_heads
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    assert ours["head_dim"] == head_dim
