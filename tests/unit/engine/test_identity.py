"""One engine identity: the same checkpoint has the same identity through the
transformers integration and through the vLLM connector, any local path
works, and every part of it keeps KV apart."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers

from kvtier.engine.hf import KVTierModel, kv_layout
from kvtier.engine.hf_identity import model_identity as hf_identity
from kvtier.engine.identity import (
    checkpoint_fingerprint,
    config_fingerprint,
    fingerprint,
    hub_commit,
    model_identity,
    state_tensors,
)
from kvtier.engine.vllm.clients import model_identity as connector_identity
from kvtier.engine.vllm.settings import ConnectorSettings
from kvtier.keys import ObjectKey, model_label
from kvtier.l1 import L1Config
from kvtier.storage import StorageConfig, StorageManager
from tests.hf_helpers import prompt, tiny_model


def vllm_config(directory: Path, revision: str | None = None) -> Any:
    """What the connector reads of vLLM's config: the model as given to vLLM
    and the HF config vLLM loaded from it."""
    loaded = transformers.AutoConfig.from_pretrained(directory)
    return SimpleNamespace(
        model_config=SimpleNamespace(model=str(directory), revision=revision, hf_config=loaded)
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A local path as people have them: long, with a space and a '+'.
    directory = tmp_path_factory.mktemp("models") / ("my models+v2/" + "llama-" * 20)
    tiny_model("llama").save_pretrained(directory)
    return directory


def test_one_checkpoint_one_identity_through_both_engines(checkpoint: Path) -> None:
    """The golden test: issue 15 found two rules (transformers: the config
    without its non-KV fields; vLLM: the whole diff dict), so one checkpoint
    had two identities and the engines could never share KV."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    through_hf = hf_identity(loaded)
    through_vllm = connector_identity(vllm_config(checkpoint), ConnectorSettings())
    assert through_hf == through_vllm
    assert through_hf.model == str(checkpoint.resolve())
    assert through_hf.revision.startswith(checkpoint_fingerprint(str(checkpoint)))
    layout = kv_layout(loaded, 256)
    assert through_hf.namespace(layout) == through_vllm.namespace(layout)
    explicit = connector_identity(vllm_config(checkpoint, "abc"), ConnectorSettings())
    assert explicit == hf_identity(loaded, revision="abc")


def test_a_long_local_path_is_a_valid_key_and_caches(checkpoint: Path) -> None:
    """The finding: a model loaded from a long local path (or one with a
    space or '+') failed key validation at HELLO and silently never cached."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    label = model_label(str(checkpoint.resolve()))
    assert label.startswith("m-") and len(label) == 34
    ObjectKey(bytes(32), label, 0)  # a valid key
    with StorageManager(StorageConfig(l1=L1Config(size_bytes=64 << 20, populate=False))) as s:
        engine = KVTierModel(loaded, storage=s, chunk_size=16)
        ids = prompt(3, 40)
        assert engine.prefill(ids).stored_tokens == 32
        assert engine.prefill(ids).hit_tokens == 32


def test_the_weights_fingerprint_is_the_same_from_files_and_memory(checkpoint: Path) -> None:
    """The numbers decide, not where they are read or their storage dtype."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    from_files = checkpoint_fingerprint(str(checkpoint))
    # (This model ties no weights; a file leaves tied ones out, which is why the
    # transformers integration reads the files too when there are some.)
    assert fingerprint(state_tensors(loaded.state_dict())) == from_files
    assert fingerprint(state_tensors(tiny_model("llama", seed=1).state_dict())) != from_files


def test_identity_parts() -> None:
    config = {"model_type": "llama", "rope_theta": 1e4, "_name_or_path": "x", "use_cache": True}
    base = model_identity("org/m", config, revision="r1")
    assert base.model == "org/m" and base.revision == f"r1+{config_fingerprint(config)}"
    assert config_fingerprint({**config, "_name_or_path": "y", "use_cache": False}) == (
        config_fingerprint(config)
    )
    assert config_fingerprint({**config, "rope_theta": 5e5}) != config_fingerprint(config)
    # a model whose window, or whose choice of sliding layers, changes never reuses KV
    windowed = {**config, "sliding_window": 128, "layer_types": ["sliding_attention"] * 2}
    assert config_fingerprint({**windowed, "sliding_window": 256}) != config_fingerprint(windowed)
    other_layers = {**windowed, "layer_types": ["sliding_attention", "full_attention"]}
    assert config_fingerprint(other_layers) != config_fingerprint(windowed)
    assert hub_commit("/c/models--org--m/snapshots/" + "a" * 40) == "a" * 40
    assert hub_commit("/tmp/m") is None
    with pytest.raises(ValueError, match="pass the model's revision"):
        model_identity("org/not-cached-anywhere", config)


def test_weights_changed_after_loading_or_a_display_name_get_their_own_identity(
    checkpoint: Path,
) -> None:
    """Review findings: the fingerprint came from the files even when the
    loaded weights had changed since (a merged adapter, an in-place edit), and
    a display ``name=`` took the revision the hub cache holds for that name."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    before = hf_identity(loaded)
    with torch.no_grad():
        next(loaded.parameters()).mul_(2.0)
    assert hf_identity(loaded).revision != before.revision
    named = hf_identity(loaded, name="org/base")
    assert named.model == "org/base" and named.revision == hf_identity(loaded).revision
