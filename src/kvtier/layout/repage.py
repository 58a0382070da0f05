"""Re-paging one object between vLLM CPU block sizes.

vLLM's CPU attention keeps each layer as ``[blocks][kv_heads][page]``, and
how a page (one head's part of one block of ``B`` tokens) packs K and V
depends on the instruction set its format names
(``vllm-cpu-<isa>-bs<B>``, see ``kvtier.engine.vllm.pages``). For the
``vec`` and ``vec16`` packings a page is K transposed, ``[head_dim][B]``,
then V, ``[B][head_dim]``, whatever the dtype: checked against vLLM 0.32's
``cpu_attn_reshape_and_cache`` for fp32, bf16 and fp16 at block sizes 16 to
128 (``tests/integration/test_vllm_pages.py`` checks it on the installed
vLLM). ``repage`` unpacks an object's pages to token order and packs them
again at the other block size, byte for byte what an engine of that block
size stores for the same KV. Other packings (``amx``, ``neon``, ...) are
refused: kvtier does not know them, and a guess could be wrong KV.
"""

from __future__ import annotations

import re

import numpy as np
import numpy.typing as npt

from kvtier.layout import KVLayout

Bytes = npt.NDArray[np.uint8]
_KNOWN_PAGES = re.compile(r"vllm-cpu-(?:vec|vec16)-bs(\d+)")  # K^T then V, per head and block


def page_block(layout: KVLayout) -> int:
    """The block size of ``layout``'s pages if kvtier can re-page them;
    ValueError naming why not."""
    pages = _KNOWN_PAGES.fullmatch(layout.format)
    if pages is None or layout.kind != "kv":
        raise ValueError(
            f"pages in the format {layout.format or 'canonical'!r} cannot be converted to "
            "another block size (vLLM's CPU 'vec' and 'vec16' pages can)"
        )
    block = int(pages[1])
    if not block or layout.tokens_per_chunk % block:
        raise ValueError(
            f"a chunk of {layout.tokens_per_chunk} tokens is not whole blocks of {block} tokens"
        )
    return block


def repage(obj: Bytes, source: KVLayout, target: KVLayout) -> Bytes:
    """``obj`` (one rank's object under ``source``) as ``target``'s block size
    packs it; the layouts may differ in the format's block size only."""
    src, dst = page_block(source), page_block(target)
    if obj.nbytes != source.object_bytes():
        raise ValueError(f"{obj.nbytes} bytes for an object of {source.object_bytes()}")
    layers, heads, dim = source.num_layers, source.kv_heads, source.head_dim
    tokens, size = source.tokens_per_chunk, source.dtype_bytes
    pages = np.asarray(obj).reshape(layers, tokens // src, heads, 2, src * dim * size)
    # Token order, [layers][heads][blocks][block x head_dim x element bytes]:
    k = pages[:, :, :, 0].reshape(layers, tokens // src, heads, dim, src, size)
    k = k.transpose(0, 2, 1, 4, 3, 5)
    v = pages[:, :, :, 1].reshape(layers, tokens // src, heads, src, dim, size)
    v = v.transpose(0, 2, 1, 3, 4, 5)
    out: Bytes = np.empty((layers, tokens // dst, heads, 2, dst * dim * size), np.uint8)
    shape = (layers, heads, tokens // dst, dst, dim, size)
    out[:, :, :, 0] = k.reshape(shape).transpose(0, 2, 1, 4, 3, 5).reshape(out[:, :, :, 0].shape)
    out[:, :, :, 1] = v.reshape(shape).transpose(0, 2, 1, 3, 4, 5).reshape(out[:, :, :, 1].shape)
    return out.reshape(-1)


__all__ = ["page_block", "repage"]
