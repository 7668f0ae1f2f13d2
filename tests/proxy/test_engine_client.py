"""proxy/engine_client.py against a real TCP server that sends exactly the bytes each test needs: the framings an
engine uses (Content-Length, chunked with and without trailers, the end of the connection), keep-alive reuse, and
every way an answer can fail, each as the aiohttp exception proxy/forward.py already handles."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from proxy.engine_client import EngineClient


class Server:
    """Reads one request at a time (head + Content-Length body) and answers with `script(request_number)`: a list of
    byte strings written with a short pause between them, or None to close the connection without a word."""

    def __init__(self, script):
        self.script = script
        self.requests: list[bytes] = []
        self.connections = 0
        self.port = 0
        self._server = None
        self._handlers: set[asyncio.Task] = set()

    async def start(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._handlers.add(asyncio.current_task())
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                self.requests.append(head + await reader.readexactly(length))
                pieces = self.script(len(self.requests))
                if pieces is None:
                    return
                for piece in pieces:
                    if piece == b"<stall>":
                        await asyncio.sleep(30)
                    if piece in (b"<stall>", b"<close>"):
                        continue
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.005)
                if pieces and pieces[-1] == b"<close>":
                    return
        finally:
            writer.close()

    async def stop(self) -> None:
        self._server.close()
        for task in self._handlers:
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)


def _json(body: bytes, extra: bytes = b"") -> list[bytes]:
    return [b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra
            + b"Content-Length: %d\r\n\r\n" % len(body) + body]


def _chunked(*chunks: bytes, trailers: bytes = b"") -> list[bytes]:
    out = [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"]
    out += [b"%x\r\n%s\r\n" % (len(c), c) for c in chunks]
    return out + [b"0\r\n" + trailers + b"\r\n"]


@pytest.fixture
async def client():
    c = EngineClient(connect_timeout_s=2, read_timeout_s=5)
    yield c
    c.close()


async def _post(client: EngineClient, url: str, body: bytes = b'{"x": 1}', **headers) -> tuple[int, bytes]:
    async with client.post(url, data=body, headers={"Content-Type": "application/json", **headers}) as resp:
        return resp.status, await resp.read()


async def test_a_length_framed_answer_and_the_connection_is_kept_for_the_next_call(client):
    server = await Server(lambda n: _json(b'{"n": %d}' % n)).start()
    assert await _post(client, server.url, b'{"a": "\xc3\xa9"}', **{"x-harness-episode": "ep-1"}) == (200, b'{"n": 1}')
    assert await _post(client, server.url) == (200, b'{"n": 2}')
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % server.port)
    assert b"\r\nx-harness-episode: ep-1\r\n" in first and b"\r\nContent-Length: 11\r\n" in first
    assert first.endswith(b'\r\n\r\n{"a": "\xc3\xa9"}')
    await server.stop()


async def test_a_chunked_stream_arrives_as_it_comes_with_trailers_and_keeps_the_connection(client):
    events = [b'data: {"i": %d}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]
    server = await Server(lambda n: _chunked(*events, trailers=b"X-Trailer: 1\r\n")).start()
    for _ in range(2):
        async with client.post(server.url, data=b"{}", headers={}) as resp:
            assert resp.status == 200 and resp.headers["content-type"] == "text/event-stream"
            parts = [part async for part in resp.content.iter_any()]
        assert b"".join(parts) == b"".join(events)
        assert len(parts) > 1  # handed over as they came (the server pauses between chunks), not at the end
    assert server.connections == 1
    await server.stop()


async def test_an_answer_ended_by_the_connection_is_read_whole_and_the_connection_not_reused(client):
    body = b'{"whole": true}' * 100
    server = await Server(lambda n: [b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n", body[:700],
                                     body[700:], b"<close>"]).start()
    assert await _post(client, server.url) == (200, body)
    assert await _post(client, server.url) == (200, body)
    assert server.connections == 2
    await server.stop()


async def test_a_connection_the_engine_closed_while_idle_is_not_reused(client):
    server = await Server(lambda n: [*_json(b"{}", b"X-N: %d\r\n" % n), b"<close>"]).start()
    for _ in range(3):
        assert await _post(client, server.url) == (200, b"{}")
        await asyncio.sleep(0.05)  # the engine's close reaches us
    assert server.connections == 3
    await server.stop()


async def test_an_engine_not_listening_is_a_connection_error(client):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(aiohttp.ClientConnectionError):
        await _post(client, f"http://127.0.0.1:{port}/v1/chat/completions")


async def test_an_engine_that_hangs_up_before_answering_is_a_connection_error(client):
    server = await Server(lambda n: None).start()
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await _post(client, server.url)
    await server.stop()


@pytest.mark.parametrize("pieces", [
    [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", b'{"cut', b"<close>"],
    [*_chunked(b"data: 1\n\n")[:2], b"<close>"],
], ids=["length", "chunked"])
async def test_an_answer_cut_off_is_a_payload_error_not_an_unreachable_engine(client, pieces):
    server = await Server(lambda n: pieces).start()
    with pytest.raises(aiohttp.ClientPayloadError) as caught:
        await _post(client, server.url)
    assert not isinstance(caught.value, aiohttp.ClientConnectionError)
    await server.stop()


@pytest.mark.parametrize("chunk, error", [
    (b"zz\r\nxx\r\n", "chunk size"), (b"-1\r\nxx\r\n", "chunk size"), (b"0x2\r\nxx\r\n", "chunk size"),
    (b"2\r\nxxyy\r\n", "does not end where its size says"),
], ids=["not-hex", "negative", "prefixed", "longer-than-said"])
async def test_a_bad_chunk_is_a_payload_error(client, chunk, error):
    server = await Server(lambda n: [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", chunk]).start()
    with pytest.raises(aiohttp.ClientPayloadError, match=error):
        await _post(client, server.url)
    await server.stop()


async def test_interim_answers_are_skipped_for_the_answer_itself(client):
    server = await Server(lambda n: [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n",
                                     *_json(b'{"n": %d}' % n)]).start()
    assert await _post(client, server.url) == (200, b'{"n": 1}')
    assert await _post(client, server.url) == (200, b'{"n": 2}')  # the connection reused, nothing left over
    assert server.connections == 1
    await server.stop()


async def test_a_big_answer_read_late_leaves_no_paused_connection_for_the_next_call():
    """Reading pauses past 4 MiB unread; a connection still paused would not see the engine close it."""
    client = EngineClient(connect_timeout_s=2, read_timeout_s=2)
    big = b"x" * (4 * 1024 * 1024 + 64 * 1024)  # its last bytes come in the read that pauses
    server = await Server(lambda n: [*_json(big), b"<close>"] if n == 1 else _json(b"{}")).start()
    async with client.post(server.url, data=b"{}", headers={}) as resp:
        await asyncio.sleep(0.3)  # the whole answer arrives before it is read
        assert await resp.read() == big
    await asyncio.sleep(0.1)  # the engine's close reaches a connection that reads
    assert await _post(client, server.url) == (200, b"{}")
    client.close()
    await server.stop()


async def test_a_connection_idle_past_keep_idle_s_is_not_used_again():
    client = EngineClient(connect_timeout_s=2, read_timeout_s=5, keep_idle_s=0.1)
    server = await Server(lambda n: _json(b"{}")).start()
    assert await _post(client, server.url) == (200, b"{}")
    assert await _post(client, server.url) == (200, b"{}")
    await asyncio.sleep(0.2)
    assert await _post(client, server.url) == (200, b"{}")
    assert server.connections == 2
    client.close()
    await server.stop()


async def test_an_answer_that_is_not_http_is_a_payload_error(client):
    server = await Server(lambda n: [b"SSH-2.0-OpenSSH\r\n\r\n"]).start()
    with pytest.raises(aiohttp.ClientPayloadError, match="not HTTP"):
        await _post(client, server.url)
    await server.stop()


@pytest.mark.parametrize("pieces", [
    [b"<stall>"],
    [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", b"<stall>"],
], ids=["before-the-head", "mid-body"])
async def test_no_byte_within_the_read_timeout_is_a_timeout(pieces):
    client = EngineClient(connect_timeout_s=2, read_timeout_s=0.2)
    server = await Server(lambda n: pieces).start()
    with pytest.raises(aiohttp.ServerTimeoutError) as caught:
        await _post(client, server.url)
    assert isinstance(caught.value, asyncio.TimeoutError)  # forward.py answers it 504
    client.close()
    await server.stop()


async def test_a_caller_cancelled_mid_wait_is_cancelled_not_timed_out(client):
    server = await Server(lambda n: [b"<stall>"]).start()
    task = asyncio.create_task(_post(client, server.url))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await server.stop()


async def test_a_line_break_in_a_header_is_refused_before_anything_is_sent(client):
    server = await Server(lambda n: _json(b"{}")).start()
    with pytest.raises(ValueError, match="line break"):
        await _post(client, server.url, **{"x-bad": "a\r\nInjected: 1"})
    assert server.requests == []
    await server.stop()


def test_only_plain_http_is_served():
    assert EngineClient.serves("http://127.0.0.1:8000/v1/completions")
    assert not EngineClient.serves("https://api.openai.com/v1/chat/completions")
