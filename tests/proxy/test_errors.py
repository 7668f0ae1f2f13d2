"""Every class of bad input or upstream trouble gets an OpenAI-style error with the right status, and the proxy
keeps serving. The upstream is the scripted engine (a real HTTP server) where a test needs to control its bytes."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import pytest
from aiohttp import web

from proxy import ProxyConfig
from tests.support import BackgroundApp, RunningProxy, db_rows

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def proxy(upstream, tmp_path):
    p = RunningProxy(upstream.url, tmp_path / "rec.duckdb", read_timeout_s=1.0, max_body_bytes=64 * 1024)
    yield p
    p.close()


async def _post(url: str, data, headers=None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        kwargs = {"json": data} if not isinstance(data, (bytes, str)) else {"data": data}
        async with s.post(url, headers=headers, **kwargs) as r:
            return r.status, await r.json(content_type=None)


def _is_openai_error(body: dict) -> bool:
    err = body.get("error")
    return isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err and "code" in err


async def _healthy(proxy) -> None:
    status, body = await _post(proxy.url + "/v1/chat/completions", CHAT)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    "payload, param",
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": ["hello"]}, "messages[0]"),
        ({**CHAT, "n": "two"}, "n"),
        ({**CHAT, "n": 0}, "n"),
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "stream": "yes"}, "stream"),
        ({**CHAT, "max_tokens": 1.5}, "max_tokens"),
        ({**CHAT, "tools": {"name": "x"}}, "tools"),
        ({**CHAT, "model": 7}, "model"),
        # found by schemathesis: a 500 before (the continuity hash walked the tool calls)
        ({"model": "m", "messages": [{"role": "assistant", "tool_calls": 0}]}, "messages[0].tool_calls"),
        ({"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"function": 1}]}]},
         "messages[0].tool_calls"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ],
)
async def test_malformed_chat_request_is_a_400_naming_the_field(proxy, payload, param):
    status, body = await _post(proxy.url + "/v1/chat/completions", payload)
    assert status == 400
    assert _is_openai_error(body), body
    assert body["error"]["param"] == param
    await _healthy(proxy)


async def test_malformed_completions_prompt_is_a_400(proxy):
    for prompt in (None, 5, [], ["a", "b"], [{"x": 1}]):
        status, body = await _post(proxy.url + "/v1/completions", {"model": "m", "prompt": prompt})
        assert status == 400 and body["error"]["param"] == "prompt", (prompt, body)
    await _healthy(proxy)


async def test_oversized_body_is_a_413(proxy):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 200_000}]}
    status, body = await _post(proxy.url + "/v1/chat/completions", big)
    assert status == 413 and _is_openai_error(body)
    await _healthy(proxy)


async def test_unknown_route_and_wrong_method_are_openai_errors(proxy):
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.url + "/v1/nothing") as r:
            assert r.status == 404 and _is_openai_error(await r.json())
        async with s.get(proxy.url + "/v1/chat/completions") as r:
            assert r.status == 405 and _is_openai_error(await r.json())


async def test_invalid_episode_id_and_unknown_episode_token(proxy):
    status, body = await _post(proxy.url + "/e/bad%20id!/v1/chat/completions", CHAT)
    assert status == 400 and body["error"]["code"] == "invalid_episode_id"
    status, body = await _post(proxy.url + "/v1/chat/completions", CHAT,
                               headers={"Authorization": "Bearer hx-ep-never-minted"})
    assert status == 401 and body["error"]["code"] == "unknown_episode_token"
    await _healthy(proxy)


async def test_unknown_episode_is_a_404_when_episodes_are_strict(upstream, tmp_path):
    p = RunningProxy(upstream.url, tmp_path / "strict.duckdb", auto_episodes=False)
    try:
        status, body = await _post(p.url + "/e/nobody/v1/chat/completions", CHAT)
        assert status == 404 and body["error"]["code"] == "unknown_episode"
        status, opened = await _post(p.url + "/harness/episodes", {"episode_id": "task-1"}, p.admin_headers)
        assert status == 200 and opened["episode_id"] == "task-1"
        status, body = await _post(p.url + "/e/task-1/v1/chat/completions", CHAT)
        assert status == 200, body
    finally:
        p.close()


async def test_the_episode_table_is_bounded_and_numbering_goes_on_after_an_episode_is_forgotten(upstream, tmp_path):
    """With room for 2 episodes, 5 take turns (by URL and by token, strict episodes): the forgotten ones are looked
    up again, the one with a stream open is never forgotten, and every episode's calls are numbered 0..n-1."""
    upstream.script.chunk_delay_s = 0.2
    p = RunningProxy(upstream.url, tmp_path / "bounded.duckdb", max_episodes=2, auto_episodes=False,
                     record_delay_s=30)  # nothing is written unless a lookup asks for it
    try:
        tokens = {}
        for episode in ["long", "a", "b", "c", "d"]:
            status, opened = await _post(p.url + "/harness/episodes", {"episode_id": episode}, p.admin_headers)
            assert status == 200, opened
            tokens[episode] = opened["api_key"]
        async with aiohttp.ClientSession() as s:
            async with s.post(p.url + "/e/long/v1/chat/completions", json={**CHAT, "stream": True}) as long:
                assert long.status == 200
                for turn in range(3):
                    for episode in "abcd":
                        if turn == 1:  # by token
                            headers = {"Authorization": f"Bearer {tokens[episode]}"}
                            status, body = await _post(p.url + "/v1/chat/completions", CHAT, headers)
                        else:
                            status, body = await _post(p.url + f"/e/{episode}/v1/chat/completions", CHAT)
                        assert status == 200, body
                    if turn == 0:  # a second call of the streaming episode, while its first is still open
                        status, body = await _post(p.url + "/e/long/v1/chat/completions", CHAT)
                        assert status == 200, body
                assert b"[DONE]" in await long.read()  # the stream was open all along
        status, body = await _post(p.url + "/e/long/v1/chat/completions", CHAT)
        assert status == 200, body
        async with aiohttp.ClientSession() as s, s.get(p.url + "/harness/status", headers=p.admin_headers) as r:
            counts = await r.json()
        assert counts["episodes_in_memory"] <= 2 + 1 and counts["episodes_forgotten"] >= 10, counts
        forged = tokens["a"][:-4] + ("0000" if not tokens["a"].endswith("0000") else "1111")
        status, body = await _post(p.url + "/v1/chat/completions", CHAT, {"Authorization": f"Bearer {forged}"})
        assert status == 401 and body["error"]["code"] == "unknown_episode_token"
    finally:
        p.close()
    rows = db_rows(tmp_path / "bounded.duckdb", "SELECT episode_id, list(call_index ORDER BY call_index) "
                   "FROM calls GROUP BY episode_id ORDER BY episode_id")
    assert rows == [("a", [0, 1, 2]), ("b", [0, 1, 2]), ("c", [0, 1, 2]), ("d", [0, 1, 2]), ("long", [0, 1, 2])]
    assert db_rows(tmp_path / "bounded.duckdb", "SELECT count(*), count(DISTINCT episode_id) FROM episodes") == \
        [(5, 5)]


async def test_upstream_down_is_a_502(tmp_path):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    p = RunningProxy(f"http://127.0.0.1:{port}", tmp_path / "down.duckdb", served_model="m")
    try:
        status, body = await _post(p.url + "/v1/chat/completions", CHAT)
        assert status == 502 and body["error"]["code"] == "upstream_unavailable"
        status, body = await _post(p.url + "/v1/chat/completions", {**CHAT, "stream": True})
        assert status == 502
        async with aiohttp.ClientSession() as s, s.get(p.url + "/health") as r:
            assert r.status == 200
    finally:
        p.close()
    rows = db_rows(p.db_path, "SELECT status, http_status FROM calls")
    assert rows == [("error", 502), ("error", 502)]


async def test_upstream_timeout_is_a_504(proxy, upstream):
    upstream.script.delay_s = 3.0  # the proxy waits at most 1 s for a byte
    status, body = await _post(proxy.url + "/v1/chat/completions", CHAT)
    assert status == 504 and body["error"]["code"] == "upstream_timeout"
    upstream.script.delay_s = 0.0
    await _healthy(proxy)


@pytest.mark.parametrize("engine_status, agent_status", [(500, 502), (503, 503), (400, 400), (422, 422)])
async def test_engine_errors_pass_through_as_4xx_or_upstream_5xx(proxy, upstream, engine_status, agent_status):
    upstream.script.status = engine_status
    status, body = await _post(proxy.url + "/v1/chat/completions", CHAT)
    assert status == agent_status and _is_openai_error(body)
    assert "scripted failure" in body["error"]["message"]
    upstream.script.status = 200
    await _healthy(proxy)


async def test_rejected_and_failed_calls_are_recorded(proxy, upstream):
    await _post(proxy.url + "/e/ep-rec/v1/chat/completions", b"{oops")
    await _post(proxy.url + "/e/ep-rec/v1/chat/completions", CHAT)
    upstream.script.status = 500
    await _post(proxy.url + "/e/ep-rec/v1/chat/completions", CHAT)
    proxy.close()
    rows = db_rows(proxy.db_path, "SELECT call_index, status, http_status FROM calls WHERE episode_id = 'ep-rec' "
                   "ORDER BY call_index")
    assert rows == [(0, "error", 400), (1, "ok", 200), (2, "error", 502)]


async def test_client_disconnect_cancels_the_engine_request_and_is_recorded(proxy, upstream):
    upstream.script.completion_tokens = 50
    upstream.script.chunk_delay_s = 0.05
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.url + "/e/gone/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.status == 200
            await r.content.readline()
            await r.content.readline()
    for _ in range(100):  # the cancellation travels proxy -> engine asynchronously
        if upstream.engine.cancelled:
            break
        await asyncio.sleep(0.05)
    assert upstream.engine.cancelled == 1
    proxy.close()
    rows = db_rows(proxy.db_path, "SELECT status, http_status FROM calls WHERE episode_id = 'gone'")
    assert rows == [("cancelled", 0)]


def _stream_and_hang_up(port: int, episode: str) -> None:
    """Read a streamed answer up to [DONE], then reset the connection at once, as an agent that exits does."""
    body = (b'{"model": "m", "stream": true, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}')
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /e/" + episode.encode() + b"/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                     + body)
        seen = b""
        while b"data: [DONE]" not in seen:
            data = sock.recv(65536)
            assert data, "the proxy closed the stream before [DONE]"
            seen += data
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST


def test_an_agent_that_hangs_up_right_after_done_keeps_its_whole_answer_recorded(proxy, upstream):
    """The engine ends its stream a little after [DONE]: the agent hangs up in between, which cancels the proxy's
    handler while it waits for the engine's end. The agent had the whole answer: recorded ok, with the answer."""
    upstream.script.linger_after_done_s = 0.3
    port = int(proxy.url.rsplit(":", 1)[1])
    for k in range(3):
        _stream_and_hang_up(port, f"hangup-{k}")
    time.sleep(0.5)
    proxy.close()
    rows = db_rows(proxy.db_path, "SELECT status, response IS NOT NULL FROM calls WHERE episode_id LIKE 'hangup-%'")
    assert len(rows) == 3 and set(rows) == {("ok", True)}


def _raw_status(port: int, path: str) -> int:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                     f"Connection: close\r\n\r\n{{}}".encode())
        head = b""
        while b"\r\n" not in head:
            head += sock.recv(4096)
    return int(head.split()[1])


@pytest.mark.parametrize("path", ["/v1/../collective_rpc", "/v1/%2e%2e/collective_rpc", "/v1/x/../../pause",
                                  "/e/ep/v1/%2E%2E/reset_prefix_cache", "/v1/.%2e/pause"])
def test_the_passthrough_never_leads_out_of_the_engines_v1(tmp_path, path):
    """The engine's admin routes (/collective_rpc, /pause...) sit beside /v1: a path that climbs out is a 404 and
    never reaches the engine, however it is spelled. The engine here answers every path and notes it."""
    seen: list[str] = []

    async def anything(request):
        seen.append(request.raw_path)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    engine = BackgroundApp(app)
    proxy = RunningProxy(engine.url, tmp_path / "rec.duckdb", served_model="m")
    try:
        assert _raw_status(int(proxy.url.rsplit(":", 1)[1]), path) == 404
        assert _raw_status(int(proxy.url.rsplit(":", 1)[1]), "/v1/embeddings") == 200  # the passthrough works
    finally:
        proxy.close()
        engine.close()
    assert seen in (["/v1/embeddings"], ["/v1/models", "/v1/embeddings"])  # at start, the proxy asks the context


async def test_non_loopback_bind_needs_an_auth_token(tmp_path):
    with pytest.raises(ValueError, match="auth token"):
        ProxyConfig(upstream_url="http://127.0.0.1:1", host="0.0.0.0")
    with pytest.raises(ValueError, match="upstream_url"):
        ProxyConfig(upstream_url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="db_memory_mb 4 is too small"):
        ProxyConfig(upstream_url="http://127.0.0.1:1", db_memory_mb=4)
    with pytest.raises(ValueError, match="max_episodes 0"):
        ProxyConfig(upstream_url="http://127.0.0.1:1", max_episodes=0)


async def test_auth_token_is_required_when_set(upstream, tmp_path):
    p = RunningProxy(upstream.url, tmp_path / "auth.duckdb", auth_token="s3cret-token")
    try:
        status, body = await _post(p.url + "/v1/chat/completions", CHAT)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, _ = await _post(p.url + "/v1/chat/completions", CHAT, {"Authorization": "Bearer s3cret-token"})
        assert status == 200
        _, opened = await _post(p.url + "/harness/episodes", {}, p.admin_headers)
        status, _ = await _post(p.url + "/v1/chat/completions", CHAT, {"Authorization": f"Bearer {opened['api_key']}"})
        assert status == 200
    finally:
        p.close()


async def test_admin_routes_need_the_admin_token(proxy):
    status, body = await _post(proxy.url + "/harness/sql", {"sql": "SELECT 1"})
    assert status == 401 and body["error"]["code"] == "invalid_admin_token"
    status, body = await _post(proxy.url + "/harness/sql", {"sql": "SELECT 1"}, {"Authorization": "Bearer nope"})
    assert status == 401
    status, body = await _post(proxy.url + "/harness/sql", {"sql": "SELECT 41 + 1 AS x"}, proxy.admin_headers)
    assert status == 200 and body["rows"] == [[42]]
    for bad in ({"sql": "DELETE FROM calls"}, {"sql": "DROP TABLE calls"}, {"sql": "COPY calls TO 'x.csv'"}):
        status, body = await _post(proxy.url + "/harness/sql", bad, proxy.admin_headers)
        assert status == 403 and body["error"]["code"] == "read_only", bad
    status, body = await _post(proxy.url + "/harness/sql", {"sql": "SELEC nonsense"}, proxy.admin_headers)
    assert status == 400 and body["error"]["code"] == "sql_error"
    status, body = await _post(proxy.url + "/harness/sql", {"sql": 5}, proxy.admin_headers)
    assert status == 400
