"""The identity of a transformers model's KV (``identity.model_identity``
for a loaded ``PreTrainedModel``): its name, and the revision of what was
loaded (the hub commit, else a fingerprint of its weights)."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel

from kvtier.engine.identity import (
    ModelIdentity,
    checkpoint_names,
    fingerprint,
    hub_commit,
    state_tensors,
)
from kvtier.engine.identity import model_identity as identity_of


def weights_fingerprint(model: PreTrainedModel) -> str:
    """A loaded model's weights fingerprint (``identity.fingerprint``): the
    revision of weights that have none. Pass a real revision (a commit hash,
    a checksum) to ``KVTierModel`` to be exact."""
    return fingerprint(state_tensors(model.state_dict()))


def model_identity(
    model: PreTrainedModel, name: str | None = None, revision: str | None = None, salt: str = ""
) -> ModelIdentity:
    """``identity.model_identity`` for a transformers model: its name is
    ``name``, else its ``name_or_path``, else its type. The revision comes
    from what was loaded, never from ``name`` (a display name must not borrow
    the hub cache's commit of another model): the hub commit, else the
    weights' fingerprint, taken from memory (weights changed after loading
    fingerprint differently) over the tensors of the safetensors files it was
    loaded from, when there are some (so it equals the vLLM connector's,
    which reads the files)."""
    config = model.config
    source = getattr(config, "name_or_path", "") or ""
    revision = revision or getattr(config, "_commit_hash", None)  # the hub commit
    if revision is None and name and name != source:
        revision = (hub_commit(str(Path(source).resolve())) if source else None) or _weights(
            model, source
        )
    return identity_of(
        name or source or config.model_type,
        config.to_dict(),
        revision=revision,
        weights=lambda: _weights(model, source),
        salt=salt,
    )


def _weights(model: PreTrainedModel, source: str) -> str:
    state = model.state_dict()
    files = sorted(Path(source).glob("*.safetensors")) if source and Path(source).is_dir() else []
    names = checkpoint_names(files)
    if names and names <= state.keys():
        return fingerprint(state_tensors({k: v for k, v in state.items() if k in names}))
    return weights_fingerprint(model)


__all__ = ["model_identity", "weights_fingerprint"]
