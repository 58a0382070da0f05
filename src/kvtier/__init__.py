"""kvtier: a tiered, shared KV-cache layer for LLM serving.

The storage core (``kvtier.keys``, ``kvtier.layout``, ``kvtier.l1``,
``kvtier.storage``) needs only numpy and blake3; heavy dependencies belong to
optional extras and are imported where they are used.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvtier")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
