"""Keys: namespaces, chunk hashes, labels and object keys (see ``hasher`` for the spec)."""

from kvtier.keys.hasher import (
    HASH_BYTES,
    ChunkHashStream,
    TokenHasher,
    root_hash,
    token_array,
)
from kvtier.keys.label import (
    NamespaceLabel,
    given_salt_label,
    is_salt_label,
    model_label,
    salt_label,
)
from kvtier.keys.namespace import Namespace, key_namespace
from kvtier.keys.object_key import ObjectKey, chunk_keys
from kvtier.keys.segments import SegmentHasher
from kvtier.keys.selector import KeySelector

__all__ = [
    "HASH_BYTES",
    "ChunkHashStream",
    "KeySelector",
    "Namespace",
    "NamespaceLabel",
    "ObjectKey",
    "SegmentHasher",
    "TokenHasher",
    "chunk_keys",
    "given_salt_label",
    "is_salt_label",
    "key_namespace",
    "model_label",
    "root_hash",
    "salt_label",
    "token_array",
]
