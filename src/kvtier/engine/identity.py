"""What makes KV reusable: one model identity for every engine integration.

Two engines may share a chunk's KV only if the same weights, adapter, KV
dtype, KV layout and tenant computed it. ``ModelIdentity`` carries the parts
that come from the model; ``namespace`` adds the layout and dtype; the
namespace roots every chunk hash, so a change in any part is a miss, never a
misread. Both the transformers integration and the vLLM connector derive the
identity here, with the same rules, so one checkpoint has one identity
whichever engine computed its KV:

- ``model``: the name the engine was given (a hub id, or a local directory,
  resolved to its real path), as a key label (``model_label``: a name too
  long or not key-safe is hashed, so any path works).
- ``revision``: the revision given, else the hub commit the files came from,
  else a fingerprint of the weights (the name, shape and dtype of every
  tensor and its first and last ``FINGERPRINT_VALUES`` values, read from the
  checkpoint's safetensors files when there are some, else from the loaded
  model), then ``+`` and the fingerprint of the model's config without the
  fields that cannot change the KV (``CONFIG_NOT_IN_KV``): the same weights
  with another RoPE base compute other KV.
- ``salt``: the tenant's salt as the engine was given it (``salt=``, a
  request's ``cache_salt``). ``namespace`` and ``label`` each label it once
  (``salt_label``), so the chunk hashes and the keys carry the same salt
  label and the router, hashing the same salt, finds the same chunks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from blake3 import blake3

from kvtier.keys import Namespace, NamespaceLabel, key_namespace
from kvtier.layout import KVLayout

FINGERPRINT_VALUES = 1024
# Config fields that name, tag or steer generation but never change the KV;
# every other field is part of the model's identity. The dtype is in the
# namespace on its own (the KV dtype).
CONFIG_NOT_IN_KV = frozenset(
    {
        "_name_or_path", "name_or_path", "_commit_hash", "transformers_version", "architectures",
        "dtype", "torch_dtype", "use_cache", "output_attentions", "output_hidden_states",
        "return_dict", "_attn_implementation", "_attn_implementation_internal",
        "_experts_implementation", "bos_token_id", "eos_token_id", "pad_token_id",
    }
)  # fmt: skip
_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})(?:/|$)")  # the hub cache's layout

Tensors = Iterable[tuple[str, tuple[int, ...], np.ndarray]]  # name, shape, first+last values


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelIdentity:
    """What makes KV reusable; see the module docstring."""

    model: str
    revision: str = ""
    lora: str = ""
    salt: str = ""  # the tenant's salt as given, never its label

    def namespace(self, layout: KVLayout) -> Namespace:
        """The root of this engine's chunk hashes in ``layout``: ``key_namespace``
        (which labels the salt), as the router and every engine build it."""
        return key_namespace(
            self.model,
            revision=self.revision,
            lora=self.lora,
            kv_dtype=layout.dtype,
            layout=layout.digest(),
            salt=self.salt,
        )

    @property
    def label(self) -> NamespaceLabel:
        """The model and salt labels this engine's object keys carry."""
        return NamespaceLabel.named(self.model, self.salt)


def model_identity(
    name: str,
    config: Mapping[str, Any],
    *,
    revision: str | None = None,
    weights: Callable[[], str] | None = None,
    salt: str = "",
) -> ModelIdentity:
    """The identity of a model given as ``name`` (hub id or local path) with
    this config (a dict); ``weights`` computes the weights' fingerprint, used
    only when neither ``revision`` nor a hub commit is known."""
    local = Path(name)
    resolved = str(local.resolve()) if local.is_dir() else name
    revision = revision or hub_commit(resolved) or (None if local.is_dir() else hub_revision(name))
    if revision is None:
        revision = (weights or (lambda: checkpoint_fingerprint(resolved)))()
    return ModelIdentity(
        model=resolved, revision=f"{revision}+{config_fingerprint(config)}", salt=salt
    )


def hub_commit(path: str) -> str | None:
    """The commit of a hub cache snapshot directory (``.../snapshots/<sha>``)."""
    match = _SNAPSHOT.search(path)
    return match[1] if match else None


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """blake3 of the config, but for fields that cannot change the KV."""
    fields = {k: v for k, v in config.items() if k not in CONFIG_NOT_IN_KV}
    text = json.dumps(fields, sort_keys=True, default=repr)
    return "c-" + blake3(text.encode()).hexdigest()[:16]


def fingerprint(tensors: Tensors) -> str:
    """``w-`` and 32 hex digits of blake3 over every tensor's name, shape and
    first and last ``FINGERPRINT_VALUES`` values (as float64), in name order.
    The storage dtype is left out on purpose: a bf16 checkpoint loaded as
    float32 has the same values and fingerprints the same (the KV dtype is in
    the namespace on its own)."""
    digest = blake3()
    for name, shape, values in sorted(tensors, key=lambda t: t[0]):
        digest.update(f"{name}:{shape};".encode())
        digest.update(np.ascontiguousarray(values, dtype=np.float64).tobytes())
    return "w-" + digest.hexdigest()[:32]


def checkpoint_fingerprint(name: str) -> str:
    """The weights' fingerprint from a checkpoint's safetensors files: in the
    directory ``name``, or in the hub cache's snapshot of model ``name``.
    ValueError naming what to pass when there are none."""
    directory = Path(name)
    if not directory.is_dir():
        snapshot = _cached_snapshot(name)
        directory = snapshot if snapshot is not None else directory
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise ValueError(
            f"{name}: no safetensors files to fingerprint the weights from; pass the "
            "model's revision (kvtier.revision, or revision= in Python)"
        )
    return fingerprint(_file_tensors(files))


def hub_revision(name: str) -> str | None:
    """The commit of hub model ``name``'s snapshot in the local hub cache."""
    snapshot = _cached_snapshot(name)
    return hub_commit(str(snapshot)) if snapshot is not None else None


def _cached_snapshot(name: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(name, "config.json")
    except ValueError:  # not a repo id
        return None
    return Path(found).parent if isinstance(found, str) else None


def _file_tensors(files: list[Path]) -> Tensors:
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                tensor = f.get_tensor(name)
                yield name, tuple(tensor.shape), _ends(tensor)


def checkpoint_names(files: list[Path]) -> set[str]:
    """The tensor names in these safetensors files (their values are not read)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def state_tensors(state: Mapping[str, Any]) -> Tensors:
    """A loaded model's ``state_dict()`` as ``fingerprint`` input."""
    for name, tensor in state.items():
        yield name, tuple(tensor.shape), _ends(tensor)


def _ends(tensor: Any) -> np.ndarray:
    import torch

    flat = tensor.detach().reshape(-1)
    n = FINGERPRINT_VALUES
    values = torch.cat((flat[:n], flat[-n:])) if flat.numel() > 2 * n else flat
    return values.to("cpu", torch.float64).numpy()


__all__ = [
    "CONFIG_NOT_IN_KV",
    "ModelIdentity",
    "checkpoint_fingerprint",
    "checkpoint_names",
    "config_fingerprint",
    "fingerprint",
    "hub_commit",
    "hub_revision",
    "model_identity",
    "state_tensors",
]
