"""A lean HTTP/1.1 transport for the dispatcher's hot path: many long requests to a few plain-HTTP servers.

Why not httpcore's pool (httpx's default): the dispatcher holds one connection per running request, 64-600 per
server, each open for the seconds to minutes a generation takes. httpcore re-examines every connection of the pool
on each request and each release (an `is_socket_readable` poll per idle connection, anyio cancel scopes per read),
which profiled at ~55% of the client's CPU and, on a 2-core box, starved the event loop while short requests
finished at ~200/s (`benchmarks/generation.py`). Here a request takes the most recently used idle connection from a
list (O(1)), parses with h11 (the same parser httpcore uses) and times reads with one `asyncio.timeout`.

Scope: `http://` only, HTTP/1.1 with keep-alive, Content-Length or chunked bodies, `Connection: close`. Anything
else (https, a proxy) goes to httpx's own transport. Errors are httpx's (`ConnectError`, `ConnectTimeout`,
`ReadTimeout`, `WriteError`, `ReadError`, `RemoteProtocolError`), so callers classify them as before. A reused
keep-alive connection that the server had already closed (EOF or reset before any byte of the answer) is retried
once on a fresh connection, as browsers and urllib3 do; a fresh connection is never retried.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import h11
import httpx

_READ_CHUNK = 65536


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    h11: h11.Connection = field(default_factory=lambda: h11.Connection(h11.CLIENT))

    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof() and self.h11.our_state is h11.IDLE

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class _StaleConnection(Exception):
    """A reused connection was closed by the server before any byte of the answer."""


def _timeouts(request: httpx.Request) -> dict[str, float | None]:
    raw = request.extensions.get("timeout", {})
    return {k: raw.get(k) for k in ("connect", "read", "write", "pool")}


class H11PoolTransport(httpx.AsyncBaseTransport):
    """Keep-alive HTTP/1.1 connections per origin, at most `max_connections` open per origin."""

    def __init__(self, max_connections: int = 256) -> None:
        self._max = max_connections
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._slots: dict[tuple[str, int], asyncio.Semaphore] = {}
        self._fallback: httpx.AsyncHTTPTransport | None = None
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            if self._fallback is None:
                limits = httpx.Limits(max_connections=self._max, max_keepalive_connections=self._max)
                self._fallback = httpx.AsyncHTTPTransport(limits=limits)
            return await self._fallback.handle_async_request(request)
        if self._closed:
            raise RuntimeError("transport is closed")
        origin = (url.host, url.port or 80)
        timeouts = _timeouts(request)
        slots = self._slots.get(origin) or self._slots.setdefault(origin, asyncio.Semaphore(self._max))
        try:
            async with asyncio.timeout(timeouts["pool"]):
                await slots.acquire()
        except TimeoutError as exc:
            raise httpx.PoolTimeout(f"no free connection to {url.host}:{origin[1]}", request=request) from exc
        try:
            body = await request.aread()
            conn = self._take_idle(origin)
            if conn is not None:
                try:
                    return await self._exchange(conn, origin, request, body, timeouts, reused=True)
                except _StaleConnection:
                    pass
            conn = await self._connect(origin, request, timeouts["connect"])
            return await self._exchange(conn, origin, request, body, timeouts, reused=False)
        finally:
            slots.release()

    def _take_idle(self, origin: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()  # most recently used: the least likely to have been closed as idle
            if conn.usable():
                return conn
            conn.close()
        return None

    async def _connect(self, origin: tuple[str, int], request: httpx.Request, timeout: float | None) -> _Conn:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(origin[0], origin[1], limit=_READ_CHUNK * 4)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connect to {origin[0]}:{origin[1]} timed out", request=request) from exc
        except OSError as exc:
            raise httpx.ConnectError(f"{exc.strerror or exc}", request=request) from exc
        return _Conn(reader, writer)

    async def _exchange(
        self,
        conn: _Conn,
        origin: tuple[str, int],
        request: httpx.Request,
        body: bytes,
        timeouts: dict[str, float | None],
        *,
        reused: bool,
    ) -> httpx.Response:
        try:
            status, response_headers, chunks = await self._send_and_read(conn, request, body, timeouts, reused=reused)
        except BaseException:  # mid-exchange (error, timeout, cancellation): the connection's state is unknown
            conn.close()
            raise
        if conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE and not self._closed:
            conn.h11.start_next_cycle()
            self._idle.setdefault(origin, []).append(conn)
        else:
            conn.close()
        return httpx.Response(
            status,
            headers=response_headers,
            content=b"".join(chunks),
            extensions={"http_version": b"HTTP/1.1"},
            request=request,
        )

    async def _send_and_read(
        self,
        conn: _Conn,
        request: httpx.Request,
        body: bytes,
        timeouts: dict[str, float | None],
        *,
        reused: bool,
    ) -> tuple[int, list[tuple[bytes, bytes]], list[bytes]]:
        try:
            headers = list(request.headers.raw)
            if not any(k.lower() == b"content-length" for k, _ in headers) and body:
                headers.append((b"Content-Length", str(len(body)).encode()))
            out = conn.h11.send(h11.Request(method=request.method, target=request.url.raw_path, headers=headers))
            if body:
                out += conn.h11.send(h11.Data(data=body))
            out += conn.h11.send(h11.EndOfMessage())
            try:
                conn.writer.write(out)
                async with asyncio.timeout(timeouts["write"]):
                    await conn.writer.drain()
            except TimeoutError as exc:
                raise httpx.WriteTimeout("write timed out", request=request) from exc
            except OSError as exc:
                if reused:
                    raise _StaleConnection from exc
                raise httpx.WriteError(str(exc) or type(exc).__name__, request=request) from exc
            status, got_any = 0, False
            response_headers: list[tuple[bytes, bytes]] = []
            chunks: list[bytes] = []
            async with asyncio.timeout(timeouts["read"]) as scope:
                read_timeout = timeouts["read"]
                while True:
                    try:
                        event = conn.h11.next_event()
                    except h11.RemoteProtocolError as exc:
                        raise httpx.RemoteProtocolError(str(exc), request=request) from exc
                    if event is h11.NEED_DATA:
                        try:
                            data = await conn.reader.read(_READ_CHUNK)
                        except OSError as exc:
                            if reused and not got_any:
                                raise _StaleConnection from exc
                            raise httpx.ReadError(str(exc) or type(exc).__name__, request=request) from exc
                        if not data and reused and not got_any:
                            raise _StaleConnection
                        if not data and not got_any:
                            raise httpx.RemoteProtocolError(
                                "Server disconnected without sending a response.", request=request
                            )
                        got_any = got_any or bool(data)
                        conn.h11.receive_data(data)
                        if read_timeout is not None:  # like httpx: the read timeout is per read, not per answer
                            scope.reschedule(asyncio.get_running_loop().time() + read_timeout)
                    elif isinstance(event, h11.InformationalResponse):
                        continue
                    elif isinstance(event, h11.Response):
                        status, response_headers = event.status_code, list(event.headers)
                    elif isinstance(event, h11.Data):
                        chunks.append(bytes(event.data))
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    elif isinstance(event, h11.ConnectionClosed):
                        raise httpx.RemoteProtocolError("peer closed connection mid-response", request=request)
        except TimeoutError as exc:
            raise httpx.ReadTimeout("read timed out", request=request) from exc
        return status, response_headers, chunks

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        if self._fallback is not None:
            await self._fallback.aclose()
