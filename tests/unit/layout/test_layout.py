from __future__ import annotations

import pytest

from kvtier.layout import KVLayout, windowed

GiB = 1 << 30


def test_seed_q3_gqa_model() -> None:
    # Seed Q3 / §1.2: 32 layers, 8 KV heads, head dim 128, bf16.
    layout = KVLayout(32, 8, 128, "bfloat16", tokens_per_chunk=256)
    assert layout.bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert layout.bytes_per_token() * 8192 == 1 * GiB  # 8K tokens is 1 GiB
    assert layout.bytes_per_token() * 6144 == 0.75 * GiB  # a 6K prefix is 0.75 GiB
    assert layout.object_bytes() == 32 * (1 << 20)


def test_seed_tp4_split_gives_8_mib_objects() -> None:
    # §1.2: TP = 4, each rank holds 2 of the 8 KV heads; one object per rank per chunk.
    layout = KVLayout(32, 2, 128, "bfloat16", tokens_per_chunk=256, num_ranks=4)
    assert layout.object_bytes() == 8 * (1 << 20)
    assert layout.chunk_bytes() == 32 * (1 << 20)


def test_mla_latent() -> None:
    # DeepSeek-V3 style MLA: 61 layers, one latent of 512 + 64 rope dims per token per
    # layer, bf16: 61 * 576 * 2 = 70,272 bytes per token; no separate K and V.
    layout = KVLayout(61, 1, 576, "bfloat16", tokens_per_chunk=64, kind="latent")
    assert layout.bytes_per_token() == 70_272
    assert layout.object_bytes() == 70_272 * 64
    # Replicated on 8 TP ranks: every rank stores the whole latent.
    replicated = KVLayout(61, 1, 576, "bfloat16", 64, kind="latent", num_ranks=8)
    assert replicated.object_bytes() == layout.object_bytes()
    assert replicated.chunk_bytes() == 8 * layout.object_bytes()


def test_fp8_and_fp32() -> None:
    assert KVLayout(1, 1, 128, "float8_e4m3fn", 16).bytes_per_token() == 256
    assert KVLayout(1, 1, 128, "float32", 16).bytes_per_token() == 1024


def test_digest_is_stable_and_changes_with_every_field() -> None:
    base = KVLayout(32, 8, 128, "bfloat16", 256)
    assert base.digest() == "df518ef9e6e5d94573a50ff61a1e295f"  # golden: pinned format
    assert base.digest() == KVLayout(32, 8, 128, "bfloat16", 256).digest()
    variants = [
        KVLayout(31, 8, 128, "bfloat16", 256),
        KVLayout(32, 4, 128, "bfloat16", 256),
        KVLayout(32, 8, 64, "bfloat16", 256),
        KVLayout(32, 8, 128, "float16", 256),
        KVLayout(32, 8, 128, "bfloat16", 512),
        KVLayout(32, 8, 128, "bfloat16", 256, num_ranks=2),
        KVLayout(32, 1, 128, "bfloat16", 256, kind="latent"),
    ]
    digests = {v.digest() for v in variants}
    assert len(digests) == len(variants) and base.digest() not in digests


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 0}, "num_layers must be a positive int"),
        ({"kv_heads": -1}, "kv_heads"),
        ({"head_dim": 1.5}, "head_dim"),
        ({"tokens_per_chunk": True}, "tokens_per_chunk"),
        ({"num_ranks": 0}, "num_ranks"),
        ({"dtype": "bf16"}, "dtype 'bf16' is not one of"),
        ({"kind": "k"}, "kind must be 'kv' or 'latent'"),
        ({"kind": "latent", "kv_heads": 2}, "must be 1 for kind 'latent'"),
    ],
)
def test_invalid_layouts(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {
        "num_layers": 2,
        "kv_heads": 1,
        "head_dim": 8,
        "dtype": "float32",
        "tokens_per_chunk": 16,
        **kwargs,
    }
    with pytest.raises(ValueError, match=message):
        KVLayout(**fields)  # type: ignore[arg-type]


def test_window_layers_keep_only_the_end_of_a_chunk() -> None:
    # Gemma-3-style: 26 layers, 5 of 6 slide over 1,024 tokens; chunks of 4,096, blocks of 16.
    full = KVLayout(26, 4, 256, "bfloat16", 4096, format="vllm-cuda-NHD-bs16")
    layout = windowed(full, window_layers=21, window_tokens=1024)
    per_layer_token = full.bytes_per_token() // 26
    assert layout.object_bytes() == per_layer_token * (5 * 4096 + 21 * 1024)
    assert layout.object_bytes() < full.object_bytes()
    assert layout.digest() != full.digest()  # a window is never read as full layers, nor back
    assert windowed(full, 21, 4096) is full  # a window as wide as the chunk keeps it all
    assert windowed(full, 21, 8192) is full


@pytest.mark.parametrize(
    ("window_layers", "window_tokens", "message"),
    [(0, 128, "window_layers must be in"), (3, 128, "must be in"), (1, 0, "positive")],
)
def test_invalid_windows_name_the_field(
    window_layers: int, window_tokens: int, message: str
) -> None:
    layout = KVLayout(2, 1, 8, "float32", 256, format="vllm-cpu-vec-bs16")
    with pytest.raises(ValueError, match=message):
        windowed(layout, window_layers, window_tokens)
    with pytest.raises(ValueError, match="window_tokens must be in"):
        KVLayout(2, 1, 8, "float32", 256, window_layers=1, window_tokens=16)  # no format
