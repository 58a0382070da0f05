"""Non-prefix reuse (CacheBlend): a segment's KV reused wherever it is placed.

``rope``: moving stored K to a new position; ``select``: which tokens to
recompute, layer by layer; ``forward``: the blended forward pass over a
transformers model's own layers. The engine side (storing and loading
segments, ``KVTierModel.prefill_segments``) is in ``kvtier.engine.hf``.
"""

from kvtier.blend.forward import BlendPass, blend_forward
from kvtier.blend.rope import RopeShift
from kvtier.blend.select import BlendConfig, Selector

__all__ = ["BlendConfig", "BlendPass", "RopeShift", "Selector", "blend_forward"]
