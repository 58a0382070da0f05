"""``kvtier.engine.hf`` without a server: the KV layout of real (tiny) models,
the refusal of models whose cache is not plain attention KV, the cache
argument, the weights fingerprint and model identity, input validation, and
that ``LocalLink`` leaves no lookup lock behind whatever the request did."""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from transformers import DeepseekV3Config, PretrainedConfig, Qwen3NextConfig

from kvtier.engine.hf import KVTierModel, cache_argument, kv_layout
from kvtier.engine.hf_identity import model_identity, weights_fingerprint
from kvtier.engine.identity import config_fingerprint
from kvtier.engine.link import LocalLink
from kvtier.keys import TokenHasher
from kvtier.layout import KVLayout
from kvtier.protocol.client import Consume
from kvtier.storage import StorageManager
from tests.hf_helpers import (
    DelegatingLink,
    assert_same_output,
    prompt,
    tiny_model,
)

CHUNK = 16


@pytest.fixture(scope="module")
def llama() -> transformers.PreTrainedModel:
    return tiny_model("llama")


# -------------------------------------------------------------- kv_layout


@pytest.mark.parametrize(
    ("family", "overrides", "expected"),
    [
        ("llama", {}, (2, 2, 32)),
        ("llama", {"num_key_value_heads": 4}, (2, 4, 32)),  # MHA
        ("llama", {"head_dim": 48}, (2, 2, 48)),  # explicit, not hidden / heads
        ("qwen2", {"num_key_value_heads": 1, "num_hidden_layers": 3}, (3, 1, 32)),  # MQA
        ("mistral", {"head_dim": 16}, (2, 2, 16)),
    ],
)
def test_kv_layout_of_tiny_models(
    family: str, overrides: dict[str, Any], expected: tuple[int, int, int]
) -> None:
    model = tiny_model(family, **overrides)
    layers, kv_heads, head_dim = expected
    assert kv_layout(model, CHUNK) == KVLayout(layers, kv_heads, head_dim, "float32", CHUNK)

    # The layout is what the model's cache really holds, per layer.
    reference = KVTierModel(model).prefill(prompt(1, 20))
    assert len(reference.cache.layers) == layers
    for layer in reference.cache.layers:
        assert tuple(layer.keys.shape) == (1, kv_heads, 20, head_dim)
        assert layer.values.shape == layer.keys.shape
        assert layer.keys.dtype == torch.float32


@pytest.mark.parametrize(
    ("dtype", "name", "bytes_per_value"),
    [(torch.float32, "float32", 4), (torch.bfloat16, "bfloat16", 2), (torch.float16, "float16", 2)],
)
def test_kv_layout_dtype_is_the_models(
    llama: transformers.PreTrainedModel, dtype: torch.dtype, name: str, bytes_per_value: int
) -> None:
    model = copy.deepcopy(llama).to(dtype)
    layout = kv_layout(model, CHUNK)
    assert layout.dtype == name
    assert layout.object_bytes() == 2 * 2 * 2 * CHUNK * 32 * bytes_per_value
    if dtype != torch.float32:
        assert layout.digest() != kv_layout(llama, CHUNK).digest()


def test_kv_layout_accepts_sliding_window_layers() -> None:
    model = tiny_model("qwen2")  # one full, one sliding-window layer
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    assert kv_layout(model, CHUNK).num_layers == 2


def test_kv_layout_refuses_a_non_attention_layer(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    model = copy.deepcopy(llama)
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="linear_attention layers"):
        kv_layout(model, CHUNK)
    # Refused up front in every mode, before any request (and before connecting).
    with pytest.raises(ValueError, match="linear_attention"):
        KVTierModel(model)
    with pytest.raises(ValueError, match="linear_attention"):
        KVTierModel(model, storage=storage, chunk_size=CHUNK)
    with pytest.raises(ValueError, match="linear_attention"):
        KVTierModel(model, server="tcp://127.0.0.1:1")


@pytest.mark.parametrize("attribute", ["kv_lora_rank", "v_head_dim"])
def test_kv_layout_refuses_mla(llama: transformers.PreTrainedModel, attribute: str) -> None:
    model = copy.deepcopy(llama)
    setattr(model.config, attribute, 64)
    with pytest.raises(ValueError, match=f"MLA \\({attribute}\\)"):
        kv_layout(model, CHUNK)
    with pytest.raises(ValueError, match="MLA"):
        KVTierModel(model)


@dataclass
class ConfigOnly:
    """Enough of a model for ``kv_layout``: real configs of architectures too
    big to build here."""

    config: PretrainedConfig
    dtype: torch.dtype = torch.bfloat16


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (Qwen3NextConfig(), "linear_attention layers"),  # hybrid: Gated DeltaNet + attention
        (DeepseekV3Config(), "MLA"),
    ],
    ids=["qwen3-next", "deepseek-v3"],
)
def test_kv_layout_refuses_real_hybrid_and_mla_configs(
    config: PretrainedConfig, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        kv_layout(ConfigOnly(config), CHUNK)  # type: ignore[arg-type]


# --------------------------------------------------------- cache_argument


def test_cache_argument_of_the_installed_transformers(llama: transformers.PreTrainedModel) -> None:
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    expected = "cache" if (major, minor) >= (5, 24) else "past_key_values"
    assert expected in inspect.signature(llama.forward).parameters
    assert cache_argument(llama) == expected


class TakesCache:
    def forward(self, input_ids: Any = None, cache: Any = None, **kwargs: Any) -> None: ...


class TakesBoth:
    def forward(self, cache: Any = None, past_key_values: Any = None) -> None: ...


class TakesPastKeyValues:
    def forward(self, input_ids: Any = None, past_key_values: Any = None) -> None: ...


class TakesNeither:
    def forward(self, input_ids: Any = None, **kwargs: Any) -> None: ...


@pytest.mark.parametrize(
    ("fake", "expected"),
    [(TakesCache, "cache"), (TakesBoth, "cache"), (TakesPastKeyValues, "past_key_values")],
)
def test_cache_argument_of_fake_models(fake: type, expected: str) -> None:
    assert cache_argument(fake()) == expected


def test_cache_argument_neither_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"TakesNeither\.forward takes neither of"):
        cache_argument(TakesNeither())  # type: ignore[arg-type]


class CacheKeyword(torch.nn.Module):
    """A model whose forward takes its cache as ``cache=`` (transformers >= 5.24)."""

    def __init__(self, inner: transformers.PreTrainedModel) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def forward(self, input_ids: torch.Tensor, cache: Any = None, **kwargs: Any) -> Any:
        assert cache is not None and "past_key_values" not in kwargs
        return self.inner(input_ids=input_ids, past_key_values=cache, **kwargs)


def test_engine_passes_the_cache_as_cache_keyword(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    model = CacheKeyword(llama)
    assert cache_argument(model) == "cache"  # type: ignore[arg-type]
    ids = prompt(2, 40)
    reference = KVTierModel(llama).generate(ids, 3)
    engine = KVTierModel(model, storage=storage, chunk_size=CHUNK)  # type: ignore[arg-type]
    for hit in (0, 32):
        got = engine.generate(ids, 3)
        assert got.prefill.hit_tokens == hit
        assert_same_output(reference, got)


# ---------------------------------------------------- weights and identity


def test_weights_fingerprint_same_weights_same_value(llama: transformers.PreTrainedModel) -> None:
    fingerprint = weights_fingerprint(llama)
    assert fingerprint.startswith("w-") and len(fingerprint) == 34
    assert weights_fingerprint(llama) == fingerprint
    assert weights_fingerprint(copy.deepcopy(llama)) == fingerprint
    assert weights_fingerprint(tiny_model("llama", seed=0)) == fingerprint  # rebuilt
    assert weights_fingerprint(tiny_model("llama", seed=1)) != fingerprint


@pytest.mark.parametrize(
    ("tensor", "index"),
    [
        ("model.embed_tokens.weight", 0),  # first value
        ("lm_head.weight", -1),  # last value
        ("model.norm.weight", 77),  # a small tensor: every value is sampled
        ("model.layers.1.self_attn.k_proj.weight", 5),
    ],
)
def test_weights_fingerprint_sees_one_changed_value(
    llama: transformers.PreTrainedModel, tensor: str, index: int
) -> None:
    model = copy.deepcopy(llama)
    with torch.no_grad():
        model.state_dict()[tensor].view(-1)[index] += 0.5
    assert weights_fingerprint(model) != weights_fingerprint(llama)


def test_weights_fingerprint_sees_the_dtype(llama: transformers.PreTrainedModel) -> None:
    assert weights_fingerprint(copy.deepcopy(llama).to(torch.bfloat16)) != weights_fingerprint(
        llama
    )


def test_model_identity_explicit_revision_and_name_win(
    llama: transformers.PreTrainedModel,
) -> None:
    default = model_identity(llama)
    config = config_fingerprint(llama.config.to_dict())
    assert default.revision == f"{weights_fingerprint(llama)}+{config}"
    assert default.model == "llama"  # built from a config: no name_or_path, the model type
    assert model_identity(llama, revision="abc123").revision == f"abc123+{config}"
    assert model_identity(llama, name="org/tiny").model == "org/tiny"
    assert model_identity(llama, salt="tenant").salt == "tenant"
    engine = KVTierModel(llama, revision="abc123", name="org/tiny", salt="t")
    assert (engine.identity.model, engine.identity.revision, engine.identity.salt) == (
        "org/tiny",
        f"abc123+{config}",
        "t",
    )


def test_model_identity_prefers_the_hub_commit_and_name_or_path(
    llama: transformers.PreTrainedModel,
) -> None:
    model = copy.deepcopy(llama)
    model.config._commit_hash = "0123abcd"
    model.config.name_or_path = "org/model"
    identity = model_identity(model)
    config = config_fingerprint(model.config.to_dict())
    assert (identity.model, identity.revision) == ("org/model", f"0123abcd+{config}")
    assert model_identity(model, revision="explicit").revision == f"explicit+{config}"


def test_config_fingerprint_ignores_names_and_flags_but_not_kv_fields(
    llama: transformers.PreTrainedModel,
) -> None:
    base = config_fingerprint(llama.config.to_dict())
    model = copy.deepcopy(llama)
    model.config.name_or_path = "org/other-name"
    model.config.use_cache = False
    assert config_fingerprint(model.config.to_dict()) == base
    model.config.rms_norm_eps = 1e-5 if llama.config.rms_norm_eps != 1e-5 else 1e-6
    assert config_fingerprint(model.config.to_dict()) != base


def test_namespace_differs_with_every_identity_part(llama: transformers.PreTrainedModel) -> None:
    layout = kv_layout(llama, CHUNK)
    base = model_identity(llama).namespace(layout)
    others = [
        model_identity(llama, salt="x").namespace(layout),
        model_identity(llama, revision="r").namespace(layout),
        model_identity(llama, name="n").namespace(layout),
        model_identity(llama).namespace(kv_layout(copy.deepcopy(llama).to(torch.bfloat16), CHUNK)),
        model_identity(llama).namespace(kv_layout(llama, 2 * CHUNK)),
    ]
    assert len({base, *others}) == 1 + len(others)


# ------------------------------------------------------- input validation


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([], "the prompt is empty"),
        (torch.tensor([], dtype=torch.long), "the prompt is empty"),
        ([1, 2, 512], r"token id 512 is outside the vocabulary \[0, 512\)"),
        ([-1], r"token id -1 is outside the vocabulary"),
        (torch.tensor([[1, 2, 3], [4, 5, 6]]), r"input_ids has shape \(2, 3\); pass one prompt"),
        (torch.tensor(7), r"input_ids has shape \(\); pass one prompt"),
    ],
    ids=["empty", "empty-tensor", "id=vocab", "negative", "batch-of-2-tensor", "scalar"],
)
def test_bad_prompts_are_value_errors(
    llama: transformers.PreTrainedModel, storage: StorageManager, ids: Any, match: str
) -> None:
    for engine in (KVTierModel(llama), KVTierModel(llama, storage=storage, chunk_size=CHUNK)):
        with pytest.raises(ValueError, match=match):
            engine.prefill(ids)
        with pytest.raises(ValueError, match=match):
            engine.generate(ids, 2)
    assert storage.held_locks() == 0


@pytest.mark.parametrize(
    "ids",
    [[[1, 2, 3], [4, 5, 6]], np.array([[1, 2, 3], [4, 5, 6]])],
    ids=["nested-list", "numpy-2d"],
)
def test_batch_of_two_as_list_or_array_is_a_value_error(
    llama: transformers.PreTrainedModel, ids: Any
) -> None:
    with pytest.raises(ValueError, match="pass one prompt"):
        KVTierModel(llama).prefill(ids)


def test_non_integer_token_ids_are_refused(llama: transformers.PreTrainedModel) -> None:
    with pytest.raises((TypeError, ValueError)):
        KVTierModel(llama).prefill(torch.tensor([1.7, 2.2]))


def test_a_batch_of_one_tensor_is_the_prompt(llama: transformers.PreTrainedModel) -> None:
    engine = KVTierModel(llama)
    ids = prompt(3, 12)
    assert_same_output(engine.generate(ids, 2), engine.generate(torch.tensor([ids]), 2))


def test_max_new_tokens_and_link_arguments(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        KVTierModel(llama).generate([1, 2, 3], 0)
    with pytest.raises(ValueError, match="pass server= or storage=, not both"):
        KVTierModel(llama, server="tcp://127.0.0.1:1", storage=storage)


def test_no_cache_reference(llama: transformers.PreTrainedModel) -> None:
    engine = KVTierModel(llama)
    assert engine.link is None
    result = engine.generate(prompt(4, 40), 3)
    p = result.prefill
    assert (p.prompt_tokens, p.hit_tokens, p.computed_tokens, p.stored_tokens) == (40, 0, 40, 0)
    assert result.logits.shape == (3, 512) and result.logits.dtype == torch.float32
    assert result.tokens == [int(row.argmax()) for row in result.logits]


def test_generate_stops_at_eos(llama: transformers.PreTrainedModel) -> None:
    engine = KVTierModel(llama)
    ids = prompt(5, 20)
    free = engine.generate(ids, 5)
    stopped = engine.generate(ids, 5, eos_token_id=free.tokens[1])
    cut = free.tokens.index(free.tokens[1]) + 1
    assert stopped.tokens == free.tokens[:cut]
    assert torch.equal(stopped.logits, free.logits[:cut])


# ---------------------------------------------------- LocalLink and locks


def assert_nothing_held(storage: StorageManager, engine: KVTierModel) -> None:
    assert storage.held_locks() == 0
    status = storage.l1_status()
    assert status["locked_objects"] == status["fenced_objects"] == 0
    assert isinstance(engine.link, LocalLink) and engine.link._locked == {}


def test_local_link_leaves_no_locks(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK)
    reference = KVTierModel(llama)
    first = prompt(6, 70)  # 4 full chunks and 6 tokens
    diverging = first[:40] + prompt(7, 30)  # mid-chunk 2: chunks 0 and 1 are shared
    exact = first[:64]  # a full hit
    short = first[:10]  # shorter than a chunk
    cases = [
        (first, 0, 64),
        (first, 64, 0),
        (diverging, 32, 32),
        (exact, 63, 0),
        (short, 0, 0),
        (first[:1], 0, 0),
    ]
    for ids, hit, stored in cases:
        got = engine.generate(ids, 2)
        p = got.prefill
        assert (p.hit_tokens, p.stored_tokens) == (hit, stored), ids
        assert p.computed_tokens == len(ids) - hit and not p.load_failed
        assert_same_output(reference.generate(ids, 2), got)
        assert_nothing_held(storage, engine)
        engine.prefill(ids)  # the prefill alone, again (now a hit where there are chunks)
        assert_nothing_held(storage, engine)
    assert storage.l1_status()["resident_objects"] == 6  # 4 + the 2 diverging chunks


def test_prefill_says_why_its_hit_ends(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK)
    ids = prompt(11, 50)  # 3 full chunks
    assert engine.prefill(ids).miss_reason == "not_in_l1"  # no L2 here to ask
    assert engine.prefill(ids).miss_reason == ""  # every full chunk hit
    assert engine.prefill(ids[:40] + prompt(12, 10)).miss_reason == "not_in_l1"  # chunk 2
    engine.link = TruncatingLink(engine.link)
    assert engine.prefill(ids).miss_reason == "load_failed"


class TruncatingLink(DelegatingLink):
    """Hands each loaded object over one byte short (a wrong-size object)."""

    def load(self, request_id: str, start: int, end: int, consume: Consume) -> bool:
        return self.inner.load(request_id, start, end, lambda i, view: consume(i, view[:-1]))


class FailingLink(DelegatingLink):
    """The engine's consume raises something that is not a ValueError."""

    def load(self, request_id: str, start: int, end: int, consume: Consume) -> bool:
        def boom(i: int, view: Any) -> None:
            raise RuntimeError("disk on fire")

        return self.inner.load(request_id, start, end, boom)


def test_wrong_size_object_is_a_miss_and_releases_locks(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK)
    ids = prompt(8, 50)
    reference = KVTierModel(llama).generate(ids, 3)
    engine.generate(ids, 3)
    engine.link = TruncatingLink(engine.link)
    got = engine.generate(ids, 3)
    assert got.prefill.load_failed
    assert (got.prefill.hit_tokens, got.prefill.computed_tokens) == (0, 50)
    assert got.prefill.tokens_by_tier == {} and got.prefill.stored_tokens == 0
    assert_same_output(reference, got)
    assert storage.held_locks() == 0


def test_exception_while_loading_propagates_and_releases_locks(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK)
    ids = prompt(9, 50)
    engine.prefill(ids)
    inner = engine.link
    engine.link = FailingLink(inner)
    with pytest.raises(RuntimeError, match="disk on fire"):
        engine.prefill(ids)
    assert storage.held_locks() == 0
    engine.link = inner
    assert engine.prefill(ids).hit_tokens == 48  # nothing was lost or left locked
    assert storage.held_locks() == 0


def test_close_releases_a_request_left_open(
    llama: transformers.PreTrainedModel, storage: StorageManager
) -> None:
    engine = KVTierModel(llama, storage=storage, chunk_size=CHUNK)
    ids = prompt(10, 40)
    engine.prefill(ids)
    link = engine.link
    assert isinstance(link, LocalLink)
    hashes = TokenHasher(engine.identity.namespace(kv_layout(llama, CHUNK)), CHUNK).chunk_hashes(
        ids
    )
    assert link.lookup("open", hashes).chunks == 2
    assert storage.held_locks() == 2
    engine.close()
    assert storage.held_locks() == 0
