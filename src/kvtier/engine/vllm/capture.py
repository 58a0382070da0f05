"""Reaching vLLM's model from the connector, for the blend (``kvtier.blend``).

A KV connector sees layer names, paged KV tensors and attention metadata,
never the model's weights. kvtier registers a ``vllm.general_plugins`` entry
point (``register``), which vLLM calls in every process before it builds a
model. With ``VLLM_KVTIER_BLEND=1`` in the engine's environment it
registers ``CapturedLlama`` for ``LlamaForCausalLM``: vLLM's own Llama, whose
constructor also records the model for ``captured_model``. The forward is
vLLM's, unchanged (compilation and kernels are unaffected). Without the
variable the plugin does nothing, so installing kvtier changes no engine.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

ENABLE = "VLLM_KVTIER_BLEND"  # not KVTIER_*: those are the connector's settings
ARCHITECTURE = "LlamaForCausalLM"

_captured: list[weakref.ref[Any]] = []


def register() -> None:
    """vLLM's plugin hook: may run several times, in several processes."""
    if os.environ.get(ENABLE) != "1":
        return
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:CapturedLlama")


def captured_model() -> Any:
    """The model this process built last, or None (no plugin, or not built)."""
    model = _captured[-1]() if _captured else None
    return model


def __getattr__(name: str) -> Any:
    # vLLM's Llama is imported only when vLLM asks for the class (it imports
    # torch and vLLM's layers), never when the plugin is merely loaded.
    if name != "CapturedLlama":
        raise AttributeError(name)
    from vllm.model_executor.models.llama import LlamaForCausalLM

    class CapturedLlama(LlamaForCausalLM):  # type: ignore[misc]
        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)  # vLLM reads this signature
            _captured[:] = [weakref.ref(self)]

    globals()["CapturedLlama"] = CapturedLlama
    return CapturedLlama
