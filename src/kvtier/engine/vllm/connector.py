"""``KVTierConnector``: vLLM's KV connector for kvtier.

Load it with::

    kv_transfer_config={
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.engine.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvtier.address": "tcp://127.0.0.1:5555"},
    }

The scheduler side (``scheduler.SchedulerSide``) and each worker's side
(``worker.WorkerSide``) live in different processes and meet only through
the cache server and the step's ``KVTierMetadata``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)

from kvtier.engine.vllm.metadata import KVTierMetadata
from kvtier.engine.vllm.scheduler import SchedulerSide
from kvtier.engine.vllm.settings import ConnectorSettings
from kvtier.engine.vllm.worker import WorkerSide

log = logging.getLogger(__name__)


def show_logs(level: str) -> None:
    """vLLM gives only its own loggers a handler: give kvtier's one too (once
    per process, unless logging is configured already) so that its summaries
    and warnings reach the engine's log."""
    logger = logging.getLogger("kvtier")
    logger.setLevel(level.upper())
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    logger.addHandler(handler)


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config or {})
        show_logs(settings.log_level)
        policy = getattr(transfer, "kv_load_failure_policy", "recompute")
        if policy != "recompute" and settings.handoff_failure != "error":
            log.warning(
                "kvtier: kv_load_failure_policy is %r: a chunk that fails to load fails its "
                'request. Set "kv_load_failure_policy": "recompute" so it is recomputed instead '
                "(keep it only on a decode engine whose failed hand-offs should be errors).",
                policy,
            )
        if policy == "recompute" and settings.handoff_failure == "error":
            log.warning(
                'kvtier: kvtier.handoff_failure is "error" but kv_load_failure_policy is '
                '"recompute": vLLM recomputes failed hand-offs instead. Set '
                '"kv_load_failure_policy": "fail" for errors.'
            )
        if settings.blend and vllm_config.cache_config.enable_prefix_caching:
            raise ValueError(
                "kvtier.blend is set but vLLM's prefix cache is on: its block hashes would "
                "serve blended KV as the plain prompt's. Start vLLM with "
                "--no-enable-prefix-caching (enable_prefix_caching=False), or unset kvtier.blend"
            )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(vllm_config, settings, kv_cache_config)
        else:
            self._worker = WorkerSide(vllm_config, settings, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss

    # ------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` with the hybrid KV-cache manager on (``SupportsHMA``)."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    # ---------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.begin_step()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # synchronous loads finish in start_load_kv, before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # stores copy whole chunks in wait_for_save, after the forward

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self._worker.wait_for_save(meta)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, KVTierMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        sent, received = self._worker.get_finished(finished_req_ids)
        return sent or None, received or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker else set()

    def shutdown(self) -> None:
        for side in (self._scheduler, self._worker):
            if side is not None:
                side.close()
