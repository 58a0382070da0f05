"""Shared by the integration tests and their peer processes: one model's layout,
its chunk hashes, deterministic payloads and a raw ZeroMQ caller.

Every payload is a pure function of ``(seed, chunk, rank)``, so a process that
stores and another that retrieves agree on the expected bytes without talking.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq

from kvtier.keys import Namespace, TokenHasher
from kvtier.layout import DTYPE_BYTES, KVLayout
from kvtier.protocol import messages as p
from kvtier.protocol.client import ClientConfig

MODEL = "test-org/tiny-model"
LAYOUT = p.LayoutSpec(group=0, num_layers=2, kv_heads=2, head_dim=16, dtype="float16")


def object_bytes(chunk_size: int, spec: p.LayoutSpec = LAYOUT) -> int:
    """Bytes of one (chunk, rank) object of kind "kv", written out by hand."""
    assert spec.kind == "kv"
    return (
        2 * spec.num_layers * spec.kv_heads * spec.head_dim * DTYPE_BYTES[spec.dtype] * chunk_size
    )


def client_config(address: str, **overrides: Any) -> ClientConfig:
    options: dict[str, Any] = {
        "address": address,
        "model": MODEL,
        "layouts": (LAYOUT,),
        "request_timeout_s": 5.0,
        "retry_s": 0.2,
    }
    options.update(overrides)
    return ClientConfig(**options)


def chunk_layout(chunk_size: int, num_ranks: int = 1) -> KVLayout:
    """The layout the server builds from ``LAYOUT`` at HELLO."""
    return KVLayout(
        LAYOUT.num_layers,
        LAYOUT.kv_heads,
        LAYOUT.head_dim,
        LAYOUT.dtype,
        chunk_size,
        num_ranks=num_ranks,
    )


def chunk_hashes(chunk_size: int, seed: int, n_chunks: int, num_ranks: int = 1) -> list[bytes]:
    """The chunk hashes of a deterministic prompt of ``n_chunks`` full chunks."""
    layout = chunk_layout(chunk_size, num_ranks)
    namespace = Namespace(MODEL, kv_dtype=LAYOUT.dtype, layout=layout.digest())
    hashes = TokenHasher(namespace, chunk_size).chunk_hashes(
        prompt_tokens(seed, n_chunks, chunk_size)
    )
    assert len(hashes) == n_chunks
    return hashes


def prompt_tokens(seed: int, n_chunks: int, chunk_size: int) -> npt.NDArray[np.int64]:
    """The tokens of ``chunk_hashes``'s prompt."""
    return np.random.default_rng(seed).integers(0, 50_000, n_chunks * chunk_size)


def payload(seed: int, chunk: int, rank: int, nbytes: int) -> npt.NDArray[np.uint8]:
    return np.random.default_rng([seed, chunk, rank]).integers(0, 256, nbytes, dtype=np.uint8)


def payloads(
    seed: int, n_chunks: int, nbytes: int, num_ranks: int = 1, first: int = 0
) -> list[npt.NDArray[np.uint8]]:
    """One buffer per (chunk, rank), chunk-major, for chunks [first, first + n_chunks)."""
    return [
        payload(seed, chunk, rank, nbytes)
        for chunk in range(first, first + n_chunks)
        for rank in range(num_ranks)
    ]


def empty_buffers(count: int, nbytes: int) -> list[npt.NDArray[np.uint8]]:
    return [np.zeros(nbytes, dtype=np.uint8) for _ in range(count)]


# ------------------------------------------------------------ raw protocol


@contextlib.contextmanager
def raw_dealer(address: str) -> Iterator[zmq.Socket[bytes]]:
    """A bare DEALER (its own routing id) on the server's RPC address."""
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    try:
        yield socket
    finally:
        socket.close(linger=0)


def send_raw(socket: zmq.Socket[bytes], frames: Sequence[bytes]) -> None:
    socket.send_multipart(list(frames))


def recv_reply(socket: zmq.Socket[bytes], timeout_s: float = 10.0) -> tuple[p.Reply, list[bytes]]:
    """The next reply body, decoded, and its data frames; fails if none comes in time."""
    if not socket.poll(int(timeout_s * 1000)):
        raise AssertionError(f"no reply within {timeout_s} s")
    body, *data = socket.recv_multipart()
    return p.decode_reply(body), data


def call(
    socket: zmq.Socket[bytes],
    message: p.Message,
    frames: Sequence[bytes] = (),
    timeout_s: float = 10.0,
) -> tuple[p.Reply, list[bytes]]:
    send_raw(socket, [p.encode(message), *frames])
    return recv_reply(socket, timeout_s)


def status_via(socket: zmq.Socket[bytes]) -> dict[str, Any]:
    """The server's tables now, over RPC (``GET /status`` serves a snapshot
    that the server loop refreshes every tick)."""
    reply, _ = call(socket, p.Status())
    assert isinstance(reply, p.StatusReply), reply
    return reply.status


def live_status(address: str, token: str = "") -> dict[str, Any]:
    """``status_via`` a socket of its own, registered first (one more client)."""
    with raw_dealer(address) as socket:
        welcome, _ = call(socket, hello(token=token, client_id="observer"))
        assert isinstance(welcome, p.Welcome), welcome
        return status_via(socket)


def hello(
    chunk_alignment: int = 1, num_ranks: int = 1, shm: bool = False, **fields: Any
) -> p.Hello:
    return p.Hello(
        version=fields.pop("version", p.PROTOCOL_VERSION),
        client_id=fields.pop("client_id", "raw"),
        model=fields.pop("model", MODEL),
        layouts=fields.pop("layouts", [LAYOUT]),
        num_ranks=num_ranks,
        block_alignment=chunk_alignment,
        shm=shm,
        **fields,
    )
