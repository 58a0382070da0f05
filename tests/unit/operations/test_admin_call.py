"""``kvtier admin``'s one HTTP call: an answer cut off (the server killed
while it wrote) or not JSON is a clear AdminError, never a traceback."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from kvtier.commands.admin import AdminError, call


@pytest.fixture(params=["cut", "garbled"])
def broken_server(request: pytest.FixtureRequest) -> Iterator[str]:
    """A port that answers every request with 200 and a body either cut
    short of its Content-Length or not JSON."""
    body = b'{"jobs": ["a"' if request.param == "cut" else b"<html>not json</html>"
    length = len(body) + (1460 if request.param == "cut" else 0)
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {length}\r\n\r\n".encode()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10.0)

    def serve() -> None:
        with listener:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                _read_request(conn)  # all of it: unread bytes would reset the connection
                conn.sendall(head + body)  # and close: the rest never comes

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    thread.join(timeout=15.0)


def _read_request(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += conn.recv(65536)


def test_a_broken_answer_is_an_admin_error_naming_the_call(broken_server: str) -> None:
    with pytest.raises(AdminError, match=r"POST /admin/purge: .* broken answer .* try again"):
        call(broken_server, "", "POST", "/admin/purge", {"tenant": "acme"})
