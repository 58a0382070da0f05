"""SGLang's own HiCache machinery on CPU, for the backend's tests and benchmark.

``import_sglang()`` makes SGLang's cache modules importable in the CPU-torch
virtualenv (.ci/sglang) and skips the test when SGLang is absent.
``HostEngine`` is one SGLang "engine" without a model: a real
``MHATokenToKVPool`` (device pool, on CPU), ``MHATokenToKVPoolHost``
(``pin_memory=False``), ``PagedTokenToKVPoolAllocator`` and SGLang's
``HiCacheController`` with a storage backend attached, as SGLang's scheduler
builds them; a one-rank gloo group on 127.0.0.1 stands in for the TP group.
A pipeline stage other than 0 of 1 is SGLang's parallel state overridden (its
own scoped ``override``) while the controller is built, with the stage's
first layer in the pools. No SGLang code is patched.
"""

from __future__ import annotations

import glob
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

WAIT_S = 120.0  # a queue wait: generous, the tests run on busy two-core machines
_torchvision_checked = False


def _stand_in_torchvision_ops() -> None:
    """PyPI's torchvision 0.28 is a CUDA build: on the CPU torch its C ops do not
    load and ``import torchvision`` fails registering fakes for ``nms``/``qnms``.
    SGLang's cache modules import it (model configs pull ``torchvision.transforms``)
    but never call an op, so define those two op schemas when its library cannot
    load; then the real torchvision package imports. Nothing is patched."""
    global _torchvision_checked
    if _torchvision_checked:
        return
    _torchvision_checked = True
    import importlib.util

    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    libraries = glob.glob(os.path.join(next(iter(spec.submodule_search_locations)), "_C*.so"))
    try:
        for library in libraries:
            torch.ops.load_library(library)
        if libraries:
            return
    except (OSError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBRARIES.append(lib)


_LIBRARIES: list[Any] = []


def backend_config(address: str, **extra: Any) -> dict[str, Any]:
    """The ``--hicache-storage-backend-extra-config`` of docs/sglang.md."""
    return {
        "backend_name": "kvtier",
        "module_path": "kvtier.engine.sglang",
        "class_name": "KvtierStorage",
        "interface_v1": 1,
        "address": address,
        **extra,
    }


def import_sglang() -> Any:
    """SGLang's ``cache_controller`` module, or skip the test without SGLang."""
    pytest.importorskip("torch")
    _stand_in_torchvision_ops()  # before SGLang: `import sglang` imports torchvision
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    return pytest.importorskip("sglang.srt.managers.cache_controller")


_group_lock = threading.Lock()
_group: Any = None


def tp_group() -> Any:
    """A one-rank gloo process group on 127.0.0.1 (made once per process), with
    SGLang's parallel state stated as TP 1, PP 1."""
    global _group
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    with _group_lock:
        if _group is None:
            if not dist.is_initialized():
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                dist.init_process_group(
                    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
                )
            _group = dist.new_group([0], backend="gloo")
            get_parallel().override_permanently(**PARALLEL)
    return _group


PARALLEL = {
    "tp_rank": 0,
    "tp_size": 1,
    "pp_rank": 0,
    "pp_size": 1,
    "attn_tp_rank": 0,
    "attn_tp_size": 1,
    "attn_dp_rank": 0,
    "attn_dcp_size": 1,
    "attn_dcp_rank": 0,
    "attn_cp_rank": 0,
    "attn_cp_size": 1,
}


@dataclass(eq=False)
class HostEngine:
    """One SGLang engine's cache side; see the module docstring."""

    page_size: int
    layout: str  # the host pool's layout: "layer_first" or "page_first"
    backend: str  # "dynamic" (with ``extra``) or SGLang's "file"
    extra: dict[str, Any]
    model: str = "tiny-test-model"
    layers: int = 2
    heads: int = 2
    head_dim: int = 16
    tokens: int = 4096
    # The pipeline stage SGLang's parallel state names while the controller is
    # built (it makes the backend's storage config then), and the stage's
    # first layer (its device and host pools hold [start_layer, start_layer + layers)).
    pp_rank: int = 0
    pp_size: int = 1
    start_layer: int = 0
    controller: Any = field(init=False)
    host: Any = field(init=False)
    device: Any = field(init=False)

    def __post_init__(self) -> None:
        import torch

        cc = import_sglang()
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.runtime_context import get_parallel

        group = tp_group()
        self.device = MHATokenToKVPool(
            self.tokens,
            self.page_size,
            torch.bfloat16,
            self.heads,
            self.head_dim,
            self.layers,
            "cpu",
            False,
            start_layer=self.start_layer,
            end_layer=self.start_layer + self.layers,
        )
        self.host = MHATokenToKVPoolHost(
            self.device.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            self.page_size,
            self.layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=self.device.size,
            start_layer=self.device.start_layer,
            end_layer=self.device.end_layer,
        )
        allocator = PagedTokenToKVPoolAllocator(
            self.tokens, self.page_size, torch.bfloat16, "cpu", self.device, False
        )
        stage = {"pp_rank": self.pp_rank, "pp_size": self.pp_size}
        with get_parallel().override(**stage):
            self.controller = cc.HiCacheController(
                allocator,
                self.host,
                self.page_size,
                group,
                threading.Event(),
                write_policy="write_through",
                storage_backend=self.backend,
                prefetch_threshold=self.page_size,
                model_name=self.model,
                storage_backend_extra_config=dict(self.extra),
            )

    @property
    def storage(self) -> Any:
        return self.controller.storage_backend

    def hashes(self, tokens: list[int]) -> list[str]:
        """SGLang's page keys of ``tokens`` (its SHA-256 chain, full pages only)."""
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        return list(get_storage_hash_str(tokens, None, page_size=self.page_size))

    def fill(self, tokens: int, seed: int) -> Any:
        """Host pages for ``tokens`` tokens holding random KV; their host indices."""
        import torch

        indices = self.host.alloc(tokens)
        generator = torch.Generator().manual_seed(seed)
        for start in range(0, tokens, self.page_size):
            page = self.host.get_dummy_flat_data_page()
            page.copy_(torch.randn(page.shape, generator=generator).to(page.dtype))
            self.host.set_from_flat_data_page(int(indices[start]), page)
        return indices

    def pages(self, indices: Any) -> list[bytes]:
        """The bytes of each host page starting at ``indices`` (one per page)."""
        import torch

        return [
            self.host.get_data_page(int(indices[i]), flat=True)
            .contiguous()
            .view(torch.uint8)
            .numpy()
            .tobytes()
            for i in range(0, len(indices), self.page_size)
        ]

    def write_back(self, tokens: list[int], indices: Any, timeout_s: float = WAIT_S) -> int:
        """Write the host pages through SGLang's backup thread (``batch_set_v1``);
        the tokens it reports written."""
        self.controller.write_storage(indices, tokens, hash_value=self.hashes(tokens))
        operation = self.controller.ack_backup_queue.get(timeout=timeout_s)
        return int(operation.completed_tokens)

    def fetch(self, request_id: str, tokens: list[int], timeout_s: float = WAIT_S) -> Fetched:
        """SGLang's prefetch: its storage hit query (``batch_exists``), then, as the
        scheduler does for a hit, host pages for it and the page transfer
        (``batch_get_v1``)."""
        controller = self.controller
        controller.prefetch(request_id, tokens)
        operation = controller.prefetch_hit_queue.get(timeout=timeout_s)
        hit = int(operation.storage_hit_count)
        if hit == 0:
            return Fetched(0, 0, None)
        operation.host_indices = self.host.alloc(hit)
        controller.prefetch_buffer.put(operation)
        loaded = 0
        deadline = time.monotonic() + timeout_s
        while True:
            ack = controller.ack_prefetch_queue.get(timeout=max(0.1, deadline - time.monotonic()))
            if ack.completed_tokens is not None:
                loaded = max(loaded, int(ack.completed_tokens))
            if ack.completed_req:
                return Fetched(hit, loaded, operation.host_indices)

    def close(self) -> None:
        backend = self.controller.storage_backend
        self.controller.detach_storage_backend()
        if backend is not None and hasattr(backend, "close"):
            backend.close()  # a second close does nothing


@dataclass(frozen=True, slots=True)
class Fetched:
    hit_tokens: int  # the storage hit query's answer
    loaded_tokens: int  # tokens the page transfer copied into host pages
    indices: Any  # their host indices (None without a hit)
