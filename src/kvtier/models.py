"""The small model kvtier runs without downloading anything: a Llama-style
decoder with random weights built from a config (``DEMO_MODEL``: 4 layers,
hidden 512, 8 query heads and 2 KV heads of dim 64, vocabulary 4,096, fp32:
about 15.5 M parameters, 62 MB on disk), with a word-level tokenizer so that
vLLM can serve it too. ``kvtier demo`` and ``kvtier bench`` both use it; it
is built once and cached under ``~/.cache/kvtier/models/``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast
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
