"""Routes the proxy only forwards (GET /v1/models, any other /v1/... route) record nothing: an engine failing there
must still show. They are counted by route and the engine's status in GET /harness/status, and an engine's 5xx or
no answer is logged as a warning with the route and status, never the agent's key. A real proxy in front of the
scripted engine (a real HTTP server) that answers /v1/models with 503."""

from __future__ import annotations

import logging
import socket

import aiohttp

from tests.support import RunningProxy, db_rows

KEY = "sk-agent-secret-0123456789"


async def _get(session: aiohttp.ClientSession, url: str, **kwargs) -> int:
    async with session.get(url, **kwargs) as r:
        await r.read()
        return r.status


async def _status(session: aiohttp.ClientSession, proxy: RunningProxy) -> dict:
    async with session.get(proxy.url + "/harness/status", headers=proxy.admin_headers) as r:
        assert r.status == 200
        return await r.json()


async def test_an_engine_5xx_on_a_forwarded_route_is_counted_and_logged(upstream, tmp_path, caplog):
    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb")
    agent = {"Authorization": f"Bearer {KEY}"}
    try:
        async with aiohttp.ClientSession() as session:
            assert await _get(session, proxy.url + "/v1/models", headers=agent) == 200
            upstream.script.models_status = 503  # the engine is failing
            with caplog.at_level(logging.WARNING, logger="harness.proxy"):
                assert await _get(session, proxy.url + "/v1/models", headers=agent) == 503
                assert await _get(session, proxy.url + "/e/ep/v1/models", headers=agent) == 503
                assert await _get(session, proxy.url + "/v1/files/file-abc", headers=agent) == 501  # engine: 404
            status = await _status(session, proxy)
    finally:
        proxy.close()
    assert status["forwarded"] == {"GET /v1/models": {"200": 1, "503": 2}, "GET /v1/files/*": {"404": 1}}
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and r.getMessage().startswith("forwarded")]
    assert len(warnings) == 2, warnings  # the two 503s; a 404 is the agent's business, not the engine failing
    assert all("GET /v1/models" in w and "answered 503" in w and upstream.url in w for w in warnings), warnings
    assert KEY not in caplog.text
    assert db_rows(tmp_path / "rec.duckdb", "SELECT count(*) FROM calls") == [(0,)]  # forwarded, not recorded


async def test_an_engine_that_does_not_answer_a_forwarded_route_is_counted_as_unreachable(tmp_path, caplog):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    proxy = RunningProxy(dead, tmp_path / "rec.duckdb", served_model="m")
    try:
        async with aiohttp.ClientSession() as session:
            with caplog.at_level(logging.WARNING, logger="harness.proxy"):
                assert await _get(session, proxy.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}) == 502
                assert await _get(session, proxy.url + "/v1/embeddings") == 502
            status = await _status(session, proxy)
    finally:
        proxy.close()
    assert status["forwarded"] == {"GET /v1/models": {"unreachable": 1}, "GET /v1/embeddings": {"unreachable": 1}}
    warnings = [r.getMessage() for r in caplog.records if "could not be reached" in r.getMessage()]
    assert [w.split(":", 1)[0] for w in warnings] == ["forwarded GET /v1/models", "forwarded GET /v1/embeddings"]
    assert all(dead in w for w in warnings) and KEY not in caplog.text
