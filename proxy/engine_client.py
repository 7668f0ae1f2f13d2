"""The policy engine's HTTP client on the hot path: one POST a call (chat or completions), HTTP/1.1 keep-alive.

aiohttp's client is general (cookies, redirects, proxies, TLS, compression, traces, multipart payloads) and spends
~60 us of a call's ~400 on that generality (docs/BENCHMARKS.md, the proxy's profile); this client speaks only
what the proxy needs of its own engine: a JSON body out, a status, headers and a body back, the body framed by
Content-Length, chunked transfer encoding or the end of the connection, handed over whole or as it arrives (a
stream). Everything else (a frozen role's vendor, record-only mode, https, the admin routes) stays on aiohttp.

It answers as aiohttp does, so proxy/forward.py reads both alike: `post()` is an async context manager whose
response has `status`, `url`, `read()` and `content.iter_any()`, and failures are aiohttp's exceptions: the engine
not reached, or gone before its answer began, is a `ClientConnectionError` (another engine may take the call); an
answer cut off is a `ClientPayloadError`; no byte within `read_timeout_s` is a `ServerTimeoutError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator

import aiohttp
from yarl import URL

__all__ = ["EngineClient"]

_MAX_HEAD = 64 * 1024  # status line and headers; a chunk's size line
_HEX = re.compile(rb"[0-9a-fA-F]{1,16}")


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


class _Connection(asyncio.Protocol):
    """One socket: bytes in a buffer, a waiter woken when more come or the connection ends."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False
        self.error: BaseException | None = None
        self.idle_since = 0.0  # loop time it went back to the pool
        self._waiter: asyncio.Future | None = None
        self.paused = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > 4 * 1024 * 1024 and not self.paused:  # a reader that lags: the engine waits
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self.error = exc
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def more(self, timeout_s: float | None) -> None:
        """Wait for bytes beyond those in the buffer (or the end of the connection)."""
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        if self.closed:
            raise aiohttp.ClientPayloadError(f"the engine closed the connection ({self.error or 'end of stream'})")
        self._waiter = waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout_s, waiter.cancel) if timeout_s is not None else None
        try:
            await waiter
        except asyncio.CancelledError:
            if timer is not None and waiter.cancelled() and not _current_cancelling():
                raise aiohttp.ServerTimeoutError(f"no answer from the engine in {timeout_s} s") from None
            raise
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _current_cancelling() -> int:
    """Whether the task itself is being cancelled (not only its waiter, by the read timeout)."""
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0


class _Response:
    """The engine's answer: status and headers read; the body read with `read()` or `content.iter_any()`."""

    def __init__(self, client: EngineClient, key: tuple, conn: _Connection, url: URL):
        self._client, self._key, self._conn = client, key, conn
        self.url = url
        self.status = 0
        self.headers: dict[str, str] = {}
        self._length: int | None = None  # Content-Length, or None
        self._chunked = False
        self._keep_alive = True
        self._done = False
        self._version = "HTTP/1.1"

    async def _read_head(self) -> None:
        while 100 <= await self._one_head() < 200:  # an interim answer (100 Continue, 103 Early Hints): the next
            if self.status == 101:
                raise aiohttp.ClientPayloadError("the engine switched protocols (101): not an answer")
            self.headers.clear()
        self._framing()

    async def _one_head(self) -> int:
        conn, timeout = self._conn, self._client.read_timeout_s
        while (end := conn.buffer.find(b"\r\n\r\n")) < 0:
            if len(conn.buffer) > _MAX_HEAD:
                raise aiohttp.ClientPayloadError("the engine's answer has no end of headers")
            if conn.closed:  # gone before its answer: as if not reached (the request may never have been read)
                raise aiohttp.ServerDisconnectedError(f"the engine closed the connection before answering "
                                                      f"({conn.error or 'end of stream'})")
            await conn.more(timeout)
        head = bytes(conn.buffer[:end]).decode("latin-1").split("\r\n")
        del conn.buffer[:end + 4]
        parts = head[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not _digits(parts[1]):
            raise aiohttp.ClientPayloadError(f"the engine's answer is not HTTP/1.x: {head[0][:100]!r}")
        self.status = int(parts[1])
        self._version = parts[0]
        for line in head[1:]:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        return self.status

    def _framing(self) -> None:
        if self.status in (204, 304):
            self._length = 0
        elif "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._chunked = True
        elif (length := self.headers.get("content-length")) is not None:
            if not _digits(length):
                raise aiohttp.ClientPayloadError(f"the engine sent Content-Length {length[:40]!r}")
            self._length = int(length)
        else:
            self._keep_alive = False  # the body ends with the connection
        if self._version == "HTTP/1.0" or "close" in self.headers.get("connection", "").lower():
            self._keep_alive = False

    @property
    def content(self) -> _Response:
        """aiohttp's `response.content.iter_any()`: the response is its own content."""
        return self

    def iter_any(self) -> AsyncIterator[bytes]:
        return self._body_parts()

    async def read(self) -> bytes:
        parts = [part async for part in self._body_parts()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _body_parts(self) -> AsyncIterator[bytes]:
        conn, timeout = self._conn, self._client.read_timeout_s
        buf = conn.buffer
        if self._length is not None:
            left = self._length
            while left:
                if not buf:
                    await conn.more(timeout)
                    continue
                take = min(left, len(buf))
                part = bytes(buf[:take])
                del buf[:take]
                left -= take
                yield part
        elif self._chunked:  # every whole chunk that has arrived, in one piece (a stream's events come in bursts)
            ended = False
            while not ended:
                parts, at = [], 0
                while (eol := buf.find(b"\r\n", at)) >= 0:
                    size_text = bytes(buf[at:eol]).split(b";", 1)[0].strip()
                    if not _HEX.fullmatch(size_text):
                        raise aiohttp.ClientPayloadError(f"the engine sent a bad chunk size {size_text[:20]!r}")
                    size = int(size_text, 16)
                    if size == 0:  # the last chunk; then trailers (ignored) and a blank line
                        if (end := buf.find(b"\r\n\r\n", eol)) < 0:
                            break
                        at, ended = end + 4, True
                        break
                    if len(buf) < eol + 2 + size + 2:
                        break
                    if buf[eol + 2 + size:eol + 4 + size] != b"\r\n":
                        raise aiohttp.ClientPayloadError("the engine's chunk does not end where its size says")
                    parts.append(buf[eol + 2:eol + 2 + size])
                    at = eol + 2 + size + 2
                if at:
                    del buf[:at]
                if parts:
                    yield bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
                if not ended:
                    if buf.find(b"\r\n") < 0 and len(buf) > _MAX_HEAD:
                        raise aiohttp.ClientPayloadError("the engine sent a chunk size line without an end")
                    await conn.more(timeout)
        else:
            while True:
                if buf:
                    part = bytes(buf)
                    buf.clear()
                    yield part
                elif conn.closed:
                    if conn.error is not None:  # reset, not closed: the answer may be cut off
                        raise aiohttp.ClientPayloadError(f"the engine's connection broke: {conn.error}")
                    break
                else:
                    with contextlib.suppress(aiohttp.ClientPayloadError):
                        await conn.more(timeout)
        self._done = True

    def _finish(self) -> None:
        conn, client = self._conn, self._client
        # A paused connection (a reader that lagged) would not see the engine close it: not kept.
        if self._done and self._keep_alive and not conn.closed and not conn.buffer and not conn.paused \
                and not client.closed:
            conn.idle_since = conn.loop.time()
            client._idle.setdefault(self._key, []).append(conn)
        else:
            conn.close()


class _Post:
    def __init__(self, client: EngineClient, url: str, data: bytes, headers: dict[str, str]):
        self._client, self._url, self._data, self._headers = client, url, data, headers
        self._response: _Response | None = None

    async def __aenter__(self) -> _Response:
        self._response = await self._client._send(self._url, self._data, self._headers)
        return self._response

    async def __aexit__(self, *exc) -> None:
        if self._response is not None:
            self._response._finish()


class EngineClient:
    """Keep-alive connections to plain-http engines, reused most recent first."""

    def __init__(self, *, connect_timeout_s: float | None, read_timeout_s: float | None,
                 keep_idle_s: float = 4.0):
        """`keep_idle_s`: a connection idle longer is not used again (vLLM closes its idle ones after 5 s; a
        connection taken just as the engine closes it would fail a call that never reached the engine)."""
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keep_idle_s = keep_idle_s
        self.closed = False
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._urls: dict[str, tuple[URL, tuple[str, int], bytes]] = {}

    @staticmethod
    def serves(url: str) -> bool:
        return url.startswith("http://")

    def post(self, url: str, *, data: bytes, headers: dict[str, str]) -> _Post:
        return _Post(self, url, data, headers)

    def _parsed(self, url: str) -> tuple[URL, tuple[str, int], bytes]:
        parsed = self._urls.get(url)
        if parsed is None:
            u = URL(url)
            if u.scheme != "http" or not u.host:
                raise ValueError(f"EngineClient speaks plain http to a host, not {url!r}")
            host = f"[{u.raw_host}]" if ":" in u.raw_host else u.raw_host
            start = f"POST {u.raw_path_qs or '/'} HTTP/1.1\r\nHost: {host}:{u.port}\r\n".encode("latin-1")
            parsed = (u, (u.host, u.port), start)
            if len(self._urls) < 1024:
                self._urls[url] = parsed
        return parsed

    async def _send(self, url: str, data: bytes, headers: dict[str, str]) -> _Response:
        u, key, start = self._parsed(url)
        head = [start]
        for name, value in headers.items():
            line = f"{name}: {value}\r\n"
            if line.count("\n") != 1 or line.count("\r") != 1:
                raise ValueError(f"header {name!r}: a line break in a header name or value")
            head.append(line.encode())
        head.append(b"Content-Length: %d\r\n\r\n" % len(data))
        conn = await self._connection(key)
        conn.transport.write(b"".join(head) + data)
        response = _Response(self, key, conn, u)
        try:
            await response._read_head()
        except BaseException:
            conn.close()
            raise
        return response

    async def _connection(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        idle = self._idle.get(key)
        if idle:
            now = loop.time()
            while idle:
                conn = idle.pop()
                if not conn.closed and not conn.buffer and now - conn.idle_since < self.keep_idle_s:
                    return conn
                conn.close()  # the older ones below it are older still
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(loop), key[0], key[1])
        except TimeoutError:
            raise aiohttp.ServerTimeoutError(f"could not connect to {key[0]}:{key[1]} in "
                                             f"{self.connect_timeout_s} s") from None
        except OSError as exc:
            raise aiohttp.ClientConnectorError(_ConnectionKey(key), exc) from None
        return conn

    def close(self) -> None:
        self.closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()


class _ConnectionKey:
    """What aiohttp's ClientConnectorError reads of a connection key (host, port, ssl) for its message."""

    def __init__(self, key: tuple[str, int]):
        self.host, self.port, self.ssl = key[0], key[1], False


HttpClient = aiohttp.ClientSession | EngineClient  # what proxy/forward.py and proxy/splice.py post with
