"""The connector's worker side (one per TP rank, in vLLM's worker process).

Each step, before the forward, ``start_load_kv`` copies the step's loads into
their blocks: the worker looks the chunks up (the scheduler still holds them
locked, so they are in L1), copies every page it needs straight from the
server's arena into the blocks, and releases them. Chunks that do not come
back are reported by ``get_block_ids_with_load_errors``, and vLLM recomputes
from the first bad block (set ``kv_load_failure_policy`` to ``recompute``):
never garbage.

Stores leave the step (``kvtier.save_async``, the default): ``wait_for_save``
marks the end of the forward (an event on a GPU) and hands the step's stores
to the worker's save thread, which copies the pages of the chunks the step
completed straight into the arena and commits them while the next steps run.
A full block is never written again while its request runs, so the copy
reads what the forward wrote. What could overwrite it is its reuse once
freed, so: vLLM keeps a finished request's blocks while it has stores that
left the step (``request_finished`` said so), until ``get_finished`` names it
finished sending, once its saves are done; a preemption frees blocks at once,
so ``handle_preemptions``, before the next forward, waits for the preempted
requests' saves. Every rank names the same requests (an MLA replica, which
stores nothing, at once). A prefill engine's hand-off stores, and every
store with ``save_async`` off, are copied and committed before the step
returns (``StoreSpec.in_step``). A shadow check (``ShadowSpec``) reads
kvtier's copy of a chunk this step computed and compares the two in
``wait_for_save``; its counts are logged at shutdown.

An asynchronous load (``LoadSpec.asynchronous``, ``kvtier.load_async``) is
the same lookup and copy on the worker's load thread, for a request that is
not in any forward until it is done: vLLM parked it, waiting for remote KV,
with its blocks allocated. ``get_finished`` names each one once it is done,
whether every chunk came back or not; the blocks of chunks that did not are
among the load errors by then, so vLLM recomputes them.

Rank 0 also tells the server's savings ledger what this engine's prefill
costs: the step's forward is the time from ``bind_connector_metadata`` to
``wait_for_save`` less the time ``start_load_kv`` took (which vLLM calls
before the forward when the step has synchronous loads, after it otherwise;
exact on CPU, where the forward is synchronous), over the tokens the step
computed (a step that computed too few to measure reports the latest rate
measured); with the seconds and tokens each tenant's loads took (only the
tokens copied into vLLM's blocks, never those its own prefix cache held; a
blend's, the tokens its segments loaded), one ``UsageReport`` per salt
loaded, blended or stored for.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvtier.engine.shadow import ShadowCheck
from kvtier.engine.vllm.blending import Blender
from kvtier.engine.vllm.clients import ClientPool
from kvtier.engine.vllm.metadata import (
    BlendSpec,
    KVTierMetadata,
    LoadSpec,
    ShadowSpec,
    StoreSpec,
)
from kvtier.engine.vllm.pages import PagedKV
from kvtier.engine.vllm.settings import ConnectorSettings
from kvtier.engine.vllm.timing import StepTimer
from kvtier.layout.repage import page_block

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(
        self, vllm_config: Any, settings: ConnectorSettings, kv_cache_config: Any = None
    ) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.settings = settings
        self.rank = get_tensor_model_parallel_rank()
        self.clients = ClientPool(
            vllm_config,
            settings,
            self.rank,
            f"vllm-worker-{self.rank}",
            kv_cache_config=kv_cache_config,
        )
        self.block_size = self.clients.block_size
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._paged: dict[int, PagedKV] = {}  # per chunk size
        self.stats = {"loaded_chunks": 0, "stored_chunks": 0, "failed_chunks": 0}
        self.shadow = ShadowCheck(settings.shadow_fraction, settings.shadow_tolerance)
        self.blender = Blender(vllm_config, settings, self.clients.identity)
        self._step_began = time.perf_counter()  # when this step's metadata was bound
        self._load_s = 0.0  # what this step's start_load_kv took
        # Shared with the load thread (under _lock):
        self._lock = threading.Lock()
        self._load_errors: set[int] = set()
        self._received: set[str] = set()  # asynchronous loads done, not yet reported
        self._loaded: dict[str, tuple[float, int]] = {}  # salt -> (seconds, tokens), unreported
        self._receiver: ThreadPoolExecutor | None = None  # the load thread, once needed
        self._saver: ThreadPoolExecutor | None = None  # the save thread, once needed
        self._saving: dict[str, int] = {}  # request -> its stores on the save thread
        self._saved: dict[str, Future[None]] = {}  # request -> its last store's job
        self._held: set[str] = set()  # requests whose blocks vLLM holds for their saves
        self._finishing: set[str] = set()  # held requests vLLM has finished
        # what the stores take of wait_for_save, per step that stores
        self.save_timer = StepTimer(f"kvtier worker {self.rank}", "save path per storing step")

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)

    def begin_step(self) -> None:
        """The model runner bound this step's metadata: its loads and forward follow."""
        self._step_began, self._load_s = time.perf_counter(), 0.0

    def start_load_kv(self, meta: KVTierMetadata) -> None:
        started = time.perf_counter()
        for blend in meta.blends:
            self._blend(blend)
        for spec in meta.loads:
            if spec.asynchronous:
                self._load_thread().submit(self._receive, spec)
            else:
                self._timed_load(spec)
        self._load_s += time.perf_counter() - started

    def wait_for_save(self, meta: KVTierMetadata) -> None:
        if self.rank == 0:
            forward_s = time.perf_counter() - self._step_began - self._load_s
            self._report_usage(meta, forward_s)
        if meta.stores:
            with self.save_timer:
                for spec in meta.stores:
                    if spec.in_step:
                        self._store(spec, None)
                    else:
                        self._save_later(spec)
            self.save_timer.step()
        for check in meta.shadows:
            self._shadow(check)

    def handle_preemptions(self, meta: KVTierMetadata) -> None:
        """Before the step's forward: vLLM has freed the preempted requests'
        blocks, which this forward may write; their saves finish first. With
        sliding-window layers every save does: the schedule frees the blocks a
        window slid past, any running request's."""
        with self._lock:
            if self.clients.groups.window:
                jobs = list(self._saved.values())
            else:
                jobs = [self._saved[r] for r in meta.preempted if r in self._saved]
        for job in jobs:
            job.result()

    def get_finished(self, finished: set[str]) -> tuple[set[str], set[str]]:
        """Requests vLLM held for their saves whose saves are done, of those it
        has finished (``finished``: this step's, each named once); and
        requests whose asynchronous load is done (each named once)."""
        with self._lock:
            self._finishing |= finished & self._held
            self._held -= finished
            sent = {r for r in self._finishing if not self._saving.get(r)}
            self._finishing -= sent
            received, self._received = self._received, set()
        return sent, received

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        shadow = self.shadow.stats()
        if shadow.checked_chunks or shadow.unavailable_chunks:
            log.info(
                "kvtier worker %d: shadow check: %d chunks checked, %d mismatched, %d unavailable; "
                "worst relative error %.3g",
                self.rank,
                shadow.checked_chunks,
                shadow.mismatched_chunks,
                shadow.unavailable_chunks,
                shadow.worst_error,
            )
        if self._receiver is not None:
            self._receiver.shutdown(wait=True, cancel_futures=True)
        if self._saver is not None:
            self._saver.shutdown(wait=True)  # the stores handed over are committed
        self.save_timer.report()
        if self.blender.stats["blends"] or self.blender.stats["failed_blends"]:
            log.info("kvtier worker %d: blends: %s", self.rank, self.blender.stats)
        self.blender.close()
        self.clients.close()

    # ------------------------------------------------------------ internals

    def _load_thread(self) -> ThreadPoolExecutor:
        if self._receiver is None:
            self._receiver = ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-load-{self.rank}")
        return self._receiver

    def _receive(self, spec: LoadSpec) -> None:
        """An asynchronous load, on the load thread: reported done whatever happens.
        vLLM's KV tensors are inference tensors, which only inference mode
        (thread-local) may write."""
        try:
            with torch.inference_mode():
                self._timed_load(spec)
        except Exception:  # a bug here must not leave vLLM waiting for the request forever
            log.exception("kvtier: %s: the asynchronous load failed", spec.request_id)
            self._failed(spec.block_ids())
        finally:
            with self._lock:
                self._received.add(spec.request_id)

    def _blend(self, spec: BlendSpec) -> None:
        """A blend before the forward; one that fails is a load error (vLLM
        recomputes its blocks), never a half-written prompt served as KV."""
        try:
            page_block(self.clients.layout(self.block_size))  # pages kvtier can write
            layers = self._paged_kv(self.block_size).layers
            blended = self.blender.blend(spec, layers, self.block_size)
            self._count_load(spec.salt, blended.timings.load_s, sum(blended.tiers.values()))
        except Exception:
            log.exception(
                "kvtier: %s: the blend failed; vLLM recomputes the prompt", spec.request_id
            )
            self.blender.stats["failed_blends"] += 1
            self._failed(list(spec.block_ids))

    def _timed_load(self, spec: LoadSpec) -> None:
        started = time.perf_counter()
        tokens = self._load(spec)
        self._count_load(spec.salt, time.perf_counter() - started, tokens)

    def _count_load(self, salt: str, seconds: float, tokens: int) -> None:
        """Add a load to the next usage report of ``salt``'s tenant."""
        with self._lock:
            before_s, before = self._loaded.get(salt, (0.0, 0))
            self._loaded[salt] = (before_s + seconds, before + tokens)

    def _failed(self, blocks: list[int]) -> None:
        with self._lock:
            self._load_errors.update(blocks)

    def _paged_kv(self, chunk_size: int) -> PagedKV:
        if chunk_size not in self._paged:
            layout = self.clients.layout(chunk_size)
            self._paged[chunk_size] = PagedKV(
                self._kv_caches, layout, self.block_size, self.clients.groups
            )
        return self._paged[chunk_size]

    def _report_usage(self, meta: KVTierMetadata, forward_s: float) -> None:
        with self._lock:
            loaded, self._loaded = self._loaded, {}
        for salt in loaded.keys() | {spec.salt for spec in meta.stores}:
            client = self.clients.client(salt)
            if client is not None:
                load_s, tokens = loaded.get(salt, (0.0, 0))
                client.report_usage(forward_s, meta.computed_tokens, load_s, tokens)

    def _load(self, spec: LoadSpec) -> int:
        """Tokens copied into engine blocks (not the engine's own leading blocks)."""
        loaded = 0
        client = None if spec.failed else self.clients.client(spec.salt)
        if client is not None and client.chunk_size is not None:
            paged = self._paged_kv(client.chunk_size)
            state = client.lookup(
                spec.request_id, spec.hashes, wait_s=self.settings.request_timeout_s
            )
            hit = state.hit_chunks or 0
            # a window wider than the object keeps (producer and consumer disagree): a miss there
            hit = next((i for i in range(hit) if paged.unfillable(spec.blocks[i])), hit)

            def scatter(i: int, view: npt.NDArray[np.uint8]) -> None:
                paged.scatter(view, spec.blocks[i])

            if hit and client.retrieve_with(spec.request_id, 0, hit, scatter):
                loaded = hit
            if spec.asynchronous:
                paged.landed()  # vLLM's stream does not wait for this thread's copies
            client.end_session(spec.request_id, wait=False)  # even unacked: the ack may be late
        self._failed(spec.block_ids(loaded))
        with self._lock:
            self.stats["loaded_chunks"] += loaded
            self.stats["failed_chunks"] += len(spec.blocks) - loaded
        if loaded < len(spec.blocks) and not spec.failed:
            log.warning(
                "kvtier: %s: %d of %d chunks did not load; vLLM recomputes them",
                spec.request_id,
                len(spec.blocks) - loaded,
                len(spec.blocks),
            )
        return spec.filled_blocks(loaded) * self.block_size

    def _save_later(self, spec: StoreSpec) -> None:
        """Hand a store to the save thread, its pages marked as this step's."""
        with self._lock:
            self._held.add(spec.request_id)  # vLLM holds its blocks (every rank says so)
        if self.clients.replica:
            return  # rank 0 stores the objects this rank holds a replica of
        paged = self._paged_for(spec.salt)
        ready = paged.ready() if paged is not None else None
        if self._saver is None:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-save-{self.rank}")
        with self._lock:
            self._saving[spec.request_id] = self._saving.get(spec.request_id, 0) + 1
            self._saved[spec.request_id] = self._saver.submit(self._save, spec, ready)

    def _save(self, spec: StoreSpec, ready: Any) -> None:
        """A store on the save thread; whatever happens, it no longer holds the blocks."""
        try:
            with torch.inference_mode():
                self._store(spec, ready, beside_forward=True)
        except Exception:  # a lost store is a future miss; the blocks must still be freed
            log.exception("kvtier: %s: a store failed; its chunks stay misses", spec.request_id)
        finally:
            with self._lock:
                left = self._saving[spec.request_id] - 1
                if left:
                    self._saving[spec.request_id] = left
                else:
                    del self._saving[spec.request_id]
                    self._saved.pop(spec.request_id, None)

    def _paged_for(self, salt: str) -> PagedKV | None:
        client = self.clients.client(salt)
        if client is None or client.chunk_size is None:
            return None  # the server is away: a future miss
        return self._paged_kv(client.chunk_size)

    def _store(self, spec: StoreSpec, ready: Any, beside_forward: bool = False) -> None:
        if self.clients.replica:
            return  # rank 0 stores the objects this rank holds a replica of
        client = self.clients.client(spec.salt)
        if client is None or client.chunk_size is None:
            return  # the server is away: a future miss
        paged = self._paged_kv(client.chunk_size)
        per_chunk = paged.blocks_per_chunk
        chunks = [
            [ids[i * per_chunk : (i + 1) * per_chunk] for ids in spec.block_ids]
            for i in range(len(spec.hashes))
        ]
        # a chunk stored after its window slid past a kept block: stop there (a future miss)
        whole = next((i for i, blocks in enumerate(chunks) if not paged.storable(blocks)), None)
        hashes = spec.hashes[:whole]

        def gather(i: int, dst: npt.NDArray[np.uint8]) -> None:
            paged.copy_out(chunks[i], dst, ready, beside_forward)

        sizes = [paged.object_bytes] * len(hashes)
        stored = client.store_with(spec.request_id, hashes, sizes, gather) if hashes else 0
        client.end_session(spec.request_id, wait=False)
        with self._lock:
            self.stats["stored_chunks"] += stored

    def _shadow(self, spec: ShadowSpec) -> None:
        client = self.clients.client(spec.salt)
        if client is None or client.chunk_size is None:
            self.shadow.unavailable()
            return
        paged = self._paged_kv(client.chunk_size)
        session = f"{spec.request_id}/shadow"
        served = np.empty(paged.object_bytes, np.uint8)

        def keep(i: int, view: npt.NDArray[np.uint8]) -> None:
            served[:] = view

        state = client.lookup(session, [spec.hash], wait_s=self.settings.request_timeout_s)
        read = state.hit_chunks == 1 and client.retrieve_with(session, 0, 1, keep)
        client.end_session(session, wait=False)
        if not read:  # evicted meanwhile, or the server is away: nothing to compare
            self.shadow.unavailable()
            client.report_shadow(0, 0, 1)
            return
        computed = np.empty_like(served)
        paged.copy_out(spec.block_ids, computed)
        what = f"request {spec.request_id} chunk {spec.chunk} (rank {self.rank})"
        verdict = self.shadow.compare(paged.values(served), paged.values(computed), what)
        client.report_shadow(1, int(verdict.mismatched))
