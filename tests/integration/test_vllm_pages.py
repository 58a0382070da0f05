"""vLLM's CPU page packing, from its own kernel (``cpu_attn_reshape_and_cache``):
the rule ``kvtier.layout.repage`` relies on holds on the installed vLLM, and
re-paged objects are byte for byte what the kernel writes at the other
block size. No engine starts: the kernel writes into tensors of the
backend's shape."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import numpy as np
import torch

from kvtier.layout.repage import repage
from tests.unit.layout.test_repage import HEADS, LAYERS, TOKENS, cpu_pages, pages_layout

pytestmark = [pytest.mark.slow, pytest.mark.engine]  # needs vLLM

DIM = 64  # a head size the kernel supports
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kernel_object(kv: torch.Tensor, block: int, dtype: torch.dtype) -> tuple[str, bytes]:
    """The backend's packing name, and one chunk's object as vLLM's kernel
    writes it: ``kv`` ([layers, K/V, heads, tokens, dim]) stored token by
    token into each layer's ``[blocks, heads, block, 2 x dim]`` cache."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block, DIM, "auto")
    blocks = TOKENS // block
    slots = torch.arange(TOKENS, dtype=torch.int64)
    pages = []
    for layer in range(LAYERS):
        cache = torch.zeros(blocks, HEADS, block, 2 * DIM, dtype=dtype)
        key_cache, value_cache = cache.view(blocks, HEADS, 2 * block, DIM).chunk(2, dim=2)
        key = kv[layer, 0].transpose(0, 1).contiguous()  # [tokens, heads, dim]
        value = kv[layer, 1].transpose(0, 1).contiguous()
        ops.cpu_attn_reshape_and_cache(
            key, value, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0
        )
        pages.append(cache.view(torch.uint8).numpy().tobytes())
    return isa, b"".join(pages)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_kernel_packs_pages_as_kvtier_repages_them(dtype: str) -> None:
    torch.manual_seed(0)
    kv = torch.randn(LAYERS, 2, HEADS, TOKENS, DIM).to(DTYPES[dtype])
    raw = kv.view(torch.int16) if kv.element_size() == 2 else kv
    reference = {block: cpu_pages(raw.numpy(), block) for block in (16, 32, 64)}
    written = {}
    for block in (16, 32, 64):
        isa, written[block] = kernel_object(kv, block, DTYPES[dtype])
        if isa not in ("vec", "vec16"):  # e.g. amx for bf16: kvtier refuses to re-page those
            pytest.skip(f"this machine packs {dtype} pages of {block} tokens as {isa!r}")
        assert written[block] == reference[block]  # the rule, as the kernel writes
    for source, target in ((16, 32), (32, 16), (64, 16)):
        got = repage(
            np.frombuffer(written[source], np.uint8),
            pages_layout(source, dtype, DIM),
            pages_layout(target, dtype, DIM),
        )
        assert got.tobytes() == written[target]
