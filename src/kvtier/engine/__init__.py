"""Engine integrations. ``link`` needs no torch; ``hf`` (transformers) imports
torch and transformers, so import it explicitly: ``from kvtier.engine import hf``."""

from kvtier.engine.identity import ModelIdentity
from kvtier.engine.link import CacheLink, Hit, LocalLink, ServerLink, new_request_id

__all__ = ["CacheLink", "Hit", "LocalLink", "ModelIdentity", "ServerLink", "new_request_id"]
