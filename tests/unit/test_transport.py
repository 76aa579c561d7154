"""The dispatcher's HTTP/1.1 transport (datagen/engine/transport.py) against a real socket server.

The server is a plain TCP listener in a thread that answers with scripted bytes, so each test can produce what a
real server or proxy might: keep-alive, chunked bodies, `Connection: close`, an idle connection closed by the
server, a drop mid-answer, silence, garbage. The stand-in (a real uvicorn server) is covered by the generation and
occupancy tests, which run through this transport.
"""

from __future__ import annotations

import asyncio
import socket
import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from datagen.engine.transport import H11PoolTransport


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        self.server.connections += 1
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                data = self.request.recv(65536)
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            path = lines[0].split(" ")[1]
            length = next(
                (int(v) for k, _, v in (x.partition(": ") for x in lines[1:]) if k.lower() == "content-length"), 0
            )
            while len(buf) < length:
                buf += self.request.recv(65536)
            body, buf = buf[:length], buf[length:]
            self.server.requests.append((path, body))
            if not self._answer(path, body):
                return

    def _answer(self, path: str, body: bytes) -> bool:
        """Send the scripted answer for `path`; False closes the connection."""
        send = self.request.sendall
        if path == "/echo":
            send(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            return True
        if path == "/chunked":
            send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
            return True
        if path == "/close":
            send(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            return False
        if path == "/then-close":  # answers, keeps the connection "alive", then closes it while idle
            send(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            return False
        if path == "/drop":  # half an answer, then the connection is gone
            send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
            return False
        if path == "/silent":
            threading.Event().wait(5)
            return False
        if path == "/garbage":
            send(b"this is not http\r\n\r\n")
            return False
        if path == "/error":
            err = b'{"error":"busy"}'
            send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n%s" % (len(err), err))
            return True
        raise AssertionError(path)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0
        self.requests: list[tuple[str, bytes]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@contextmanager
def _server() -> Iterator[_Server]:
    server = _Server()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _run(server: _Server, *paths: str, timeout: float = 5.0) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, transport=H11PoolTransport(8), timeout=timeout) as http:
            return [await http.post(p, json={"n": i}) for i, p in enumerate(paths)]

    return asyncio.run(go())


def test_keep_alive_reuses_one_connection_and_bodies_arrive_whole() -> None:
    with _server() as server:
        responses = _run(server, "/echo", "/echo", "/echo")
    assert [r.json() for r in responses] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert server.connections == 1


def test_chunked_body_is_joined() -> None:
    with _server() as server:
        (resp,) = _run(server, "/chunked")
    assert resp.status_code == 200 and resp.text == "hello world"


def test_connection_close_is_honoured() -> None:
    with _server() as server:
        responses = _run(server, "/close", "/echo")
    assert [r.status_code for r in responses] == [200, 200]
    assert server.connections == 2


def test_idle_connection_closed_by_the_server_is_replaced_without_an_error() -> None:
    async def go(server: _Server) -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, transport=H11PoolTransport(8), timeout=5) as http:
            first = await http.post("/then-close", json={})
            await asyncio.sleep(0.3)  # the server has closed the kept-alive connection meanwhile
            second = await http.post("/echo", json={"again": True})
            return [first.status_code, second.status_code]

    with _server() as server:
        assert asyncio.run(go(server)) == [200, 200]
    # The second request was sent once, on a fresh connection.
    assert [p for p, _ in server.requests] == ["/then-close", "/echo"]
    assert server.connections == 2


def test_error_status_is_returned_not_raised() -> None:
    with _server() as server:
        (resp,) = _run(server, "/error")
    assert resp.status_code == 503 and resp.json() == {"error": "busy"}


def test_drop_mid_answer_on_a_fresh_connection_is_an_error_and_not_resent() -> None:
    with _server() as server, pytest.raises(httpx.RemoteProtocolError):
        _run(server, "/drop")
    assert [p for p, _ in server.requests] == ["/drop"]


def test_garbage_is_a_protocol_error() -> None:
    with _server() as server, pytest.raises(httpx.RemoteProtocolError):
        _run(server, "/garbage")


def test_silence_is_a_read_timeout() -> None:
    with _server() as server, pytest.raises(httpx.ReadTimeout):
        _run(server, "/silent", timeout=0.5)


def test_refused_connection_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused

        async def go() -> None:
            async with httpx.AsyncClient(transport=H11PoolTransport(8), timeout=2) as http:
                await http.get(f"http://127.0.0.1:{port}/health")

        with pytest.raises(httpx.ConnectError):
            asyncio.run(go())


def test_connection_limit_queues_requests_instead_of_opening_more() -> None:
    async def go(server: _Server) -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, transport=H11PoolTransport(2), timeout=5) as http:
            responses = await asyncio.gather(*(http.post("/echo", json={"i": i}) for i in range(10)))
            return [r.json()["i"] for r in responses]

    with _server() as server:
        assert sorted(asyncio.run(go(server))) == list(range(10))
    assert server.connections <= 2
