"""Record-only mode in front of a hosted API that wants more than the body: Azure OpenAI's `?api-version=...` and
its `api-key` header. The scripted engine (and, for the passthrough, an engine that answers every path) shows what
reached it; the agent speaks through the real openai SDK's AzureOpenAI client where that client can reach the
proxy's routes."""

from __future__ import annotations

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from proxy.record_only import redact
from tests.support import BackgroundApp, RunningProxy, db_rows

SECRET, QUERY_SECRET = "azure-Secret-Key-4242", "sk-query-Secret-77"
VERSION = "api-version=2024-10-21"
CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}


def _record_only(upstream_url: str, tmp_path, **overrides) -> RunningProxy:
    """The proxy as `harness serve --upstream URL --record-only` configures it."""
    return RunningProxy(upstream_url, tmp_path / "rec.duckdb", record_only=True, returns_token_ids=False,
                        token_exact=False, **overrides)


async def _post(url: str, body: dict, headers: dict) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url, data=orjson.dumps(body),
                                                    headers={"Content-Type": "application/json", **headers}) as r:
        return r.status, await r.read()


def _no_secret_written(tmp_path, caplog, *secrets: str) -> None:
    """Not in any file under tmp_path (the database, the run-info file), not in any log record of the proxy's side
    (the openai SDK's own debug records are the agent's)."""
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert not any(s.encode() in path.read_bytes() for s in secrets), path
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records
                       if r.name.split(".")[0] not in ("openai", "httpx", "httpcore", "httpx2", "httpcore2"))
    assert not any(s in logged for s in secrets)


async def test_azure_style_calls_reach_the_upstream_with_their_query_string_and_api_key(upstream, tmp_path, caplog):
    """Every route that goes upstream forwards the query string byte for byte and the key in the `api-key` header
    it came in; neither is recorded. The AzureOpenAI client (models, Responses API) sends both as in production;
    chat and completions (which that client sends to /openai/deployments/<name>/...) go as raw requests."""
    caplog.set_level("DEBUG")
    upstream.script.token_ids = False
    proxy = _record_only(upstream.url + "/v1", tmp_path)
    query = f"{VERSION}&x=a%2Bb+c%20d&key={QUERY_SECRET}&flag"  # a key in the query: forwarded, never stored
    azure = {"api-key": SECRET}
    try:
        client = openai.AsyncAzureOpenAI(base_url=proxy.url + "/e/az-1/v1", api_key=SECRET,
                                         api_version="2024-10-21", max_retries=0)
        assert [m.id async for m in client.models.list()] == ["scripted-model"]
        answer = await client.responses.create(model="gpt-4o", input="hi")
        assert answer.output_text.startswith("w1000")
        await client.close()
        base = proxy.url + "/e/az-1/v1"
        for path, body in (("/chat/completions", CHAT), ("/chat/completions", {**CHAT, "stream": True}),
                           ("/completions", {"model": "gpt-35-turbo-instruct", "prompt": "hi"})):
            status, raw = await _post(f"{base}{path}?{query}", body, azure)
            assert status == 200, raw
        status, raw = await _post(f"{base}/messages?beta=true", {**CHAT, "max_tokens": 8}, azure)  # Anthropic's
        assert status == 200, raw
    finally:
        proxy.close()
    assert upstream.engine.targets == [f"/v1/models?{VERSION}", f"/v1/chat/completions?{VERSION}",
                                       f"/v1/chat/completions?{query}", f"/v1/chat/completions?{query}",
                                       f"/v1/completions?{query}", "/v1/chat/completions"]
    for headers in (*upstream.engine.models_headers, *upstream.engine.headers):
        assert headers.get("api-key") == SECRET and "Authorization" not in headers, headers
    assert upstream.engine.requests[1] == CHAT  # as sent: nothing added
    rows = db_rows(proxy.db_path, "SELECT episode_id, status, extra FROM calls ORDER BY started_at")
    assert [(e, s) for e, s, _ in rows] == [("az-1", "ok")] * 5
    _no_secret_written(tmp_path, caplog, SECRET, QUERY_SECRET, "a%2Bb")  # nor the query string at all


async def test_azure_deployment_urls_are_recorded_and_go_to_the_same_path_on_the_upstream_s_host(upstream, tmp_path,
                                                                                                caplog):
    """AzureOpenAI(azure_endpoint=the proxy) sends chat calls to /openai/deployments/<name>/chat/completions: in
    record-only mode they are recorded and go to that path on the upstream's host (given as the resource, or its
    /openai/v1 API), with the query string and the api-key; a body without a model is recorded under the
    deployment's name."""
    caplog.set_level("DEBUG")
    upstream.script.token_ids = False
    targets = []
    for k, given in enumerate((upstream.url, upstream.url + "/openai/v1")):
        (tmp_path / str(k)).mkdir()
        proxy = _record_only(given, tmp_path / str(k))
        try:
            client = openai.AsyncAzureOpenAI(azure_endpoint=proxy.url + "/e/az-2", api_key=SECRET,
                                             api_version="2024-10-21", max_retries=0)
            answer = await client.chat.completions.create(model="gpt-4o", messages=CHAT["messages"])
            assert answer.choices[0].message.content.startswith("w1000")
            stream = await client.chat.completions.create(model="gpt-4o", messages=CHAT["messages"], stream=True)
            assert [c async for c in stream]
            await client.close()
            bare = {k: v for k, v in CHAT.items() if k != "model"}
            status, raw = await _post(f"{proxy.url}/openai/deployments/my-dep/chat/completions?{VERSION}", bare,
                                      {"api-key": SECRET})
            assert status == 200, raw
            status, raw = await _post(f"{proxy.url}/openai/deployments/my-dep/completions?{VERSION}",
                                      {"prompt": "hi"}, {"api-key": SECRET})
            assert status == 200, raw
        finally:
            proxy.close()
        rows = db_rows(proxy.db_path, "SELECT episode_id, endpoint, stream, requested_model, status FROM calls "
                       "ORDER BY started_at")
        assert rows == [("az-2", "chat", False, "gpt-4o", "ok"), ("az-2", "chat", True, "gpt-4o", "ok"),
                        (rows[2][0], "chat", False, "my-dep", "ok"), (rows[2][0], "completions", False, "my-dep", "ok")]
        targets.append(upstream.engine.targets[-4:])
    deployment = "/openai/deployments/{}/{}?" + VERSION
    assert targets == [[deployment.format("gpt-4o", "chat/completions")] * 2
                       + [deployment.format("my-dep", "chat/completions"), deployment.format("my-dep", "completions")]
                       ] * 2
    assert all(h.get("api-key") == SECRET and "Authorization" not in h for h in upstream.engine.headers)
    assert upstream.engine.requests[-2]["model"] == "my-dep"  # the deployment's name, added to the body
    _no_secret_written(tmp_path, caplog, SECRET)


async def test_outside_record_only_azure_deployment_urls_serve_the_policy(upstream, tmp_path):
    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb", served_model="scripted-model")
    try:
        client = openai.AsyncAzureOpenAI(azure_endpoint=proxy.url + "/e/az-3", api_key="sk-x",
                                         api_version="2024-10-21", max_retries=0)
        answer = await client.chat.completions.create(model="gpt-4o-mini", messages=CHAT["messages"])
        await client.close()
    finally:
        proxy.close()
    assert answer.model == "gpt-4o-mini"  # answered under the name asked for
    # at start the proxy asks the engine's /v1/models for its context
    assert upstream.engine.targets == ["/v1/models", "/v1/chat/completions"]
    assert upstream.engine.requests[0]["model"] == "scripted-model"
    assert db_rows(proxy.db_path, "SELECT episode_id, requested_model, token_source FROM calls") == [
        ("az-3", "gpt-4o-mini", "engine")]


@pytest.mark.parametrize("carried", ["proxy-token", "episode-token", "bearer"])
async def test_the_proxy_s_own_token_in_api_key_is_replaced_by_the_env_key_in_the_same_header(
        upstream, tmp_path, monkeypatch, carried):
    """An agent that sends the proxy's token (or an episode token) as `api-key` gets the key from
    --upstream-key-env sent on in `api-key`; one that sends it as a Bearer token, in `Authorization`."""
    monkeypatch.setenv("AZ_KEY", "sk-env-Azure-9")
    proxy = _record_only(upstream.url, tmp_path, auth_token="proxy-tok", upstream_key_env="AZ_KEY")
    try:
        token = "proxy-tok"
        if carried == "episode-token":
            async with aiohttp.ClientSession() as s, s.post(proxy.url + "/harness/episodes", json={},
                                                            headers=proxy.admin_headers) as r:
                token = (await r.json())["api_key"]
        sent = {"Authorization": f"Bearer {token}"} if carried == "bearer" else {"api-key": token}
        status, raw = await _post(f"{proxy.url}/v1/chat/completions?{VERSION}", CHAT, sent)
        assert status == 200, raw
    finally:
        proxy.close()
    headers = upstream.engine.headers[0]
    if carried == "bearer":
        assert headers.get("Authorization") == "Bearer sk-env-Azure-9" and "api-key" not in headers
    else:
        assert headers.get("api-key") == "sk-env-Azure-9" and "Authorization" not in headers
    assert upstream.engine.targets == [f"/v1/chat/completions?{VERSION}"]


async def test_outside_record_only_no_query_string_or_agent_key_goes_to_the_engine(upstream, tmp_path):
    """Our own engine gets the recorded routes and /v1/models without the agent's query string or key."""
    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb", served_model="scripted-model")
    try:
        status, raw = await _post(f"{proxy.url}/v1/chat/completions?{VERSION}", CHAT, {"api-key": SECRET})
        assert status == 200, raw
        async with aiohttp.ClientSession() as s, s.get(f"{proxy.url}/v1/models?{VERSION}",
                                                       headers={"api-key": SECRET}) as r:
            assert r.status == 200
    finally:
        proxy.close()
    assert upstream.engine.targets == ["/v1/models", "/v1/chat/completions", "/v1/models"]  # the first: at start
    assert not any("api-key" in h or "Authorization" in h for h in (*upstream.engine.headers,
                                                                    *upstream.engine.models_headers))


@pytest.mark.parametrize("record_only", [True, False])
def test_the_passthrough_forwards_the_query_string(tmp_path, record_only):
    """A /v1 route the proxy does not serve (the AzureOpenAI client's /deployments/<name>/chat/completions, here)
    keeps its query string: byte for byte with the agent's key in record-only mode; parsed and re-encoded, without
    the key, in front of our own engine (as before)."""
    seen: list[tuple[str, str | None, str | None]] = []

    async def anything(request):
        seen.append((request.raw_path, request.headers.get("api-key"), request.headers.get("Authorization")))
        return web.json_response({"object": "chat.completion", "choices": []})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    engine = BackgroundApp(app)
    proxy = _record_only(engine.url, tmp_path) if record_only else RunningProxy(engine.url, tmp_path / "rec.duckdb",
                                                                                 served_model="m")
    try:
        client = openai.AzureOpenAI(base_url=proxy.url + "/v1", api_key=SECRET, api_version="2024-10-21",
                                    max_retries=0)
        client.chat.completions.create(model="gpt-4o", messages=CHAT["messages"])
    finally:
        proxy.close()
        engine.close()
    path = f"/v1/deployments/gpt-4o/chat/completions?{VERSION}"
    assert seen == ([(path, SECRET, None)] if record_only else [("/v1/models", None, None), (path, None, None)])
    assert db_rows(proxy.db_path, "SELECT count(*) FROM calls") == [(0,)]  # unrecorded, as every passthrough


async def _call_with_query_key(handler, tmp_path):
    """One chat call with a key in its query, through a record-only proxy in front of an upstream that answers
    every path with `handler`: (the upstream, (status, body) the agent got, the proxy, closed)."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    engine = BackgroundApp(app)
    proxy = _record_only(engine.url, tmp_path)
    try:
        answer = await _post(f"{proxy.url}/v1/chat/completions?{VERSION}&key={QUERY_SECRET}", CHAT,
                             {"api-key": SECRET})
    finally:
        proxy.close()
        engine.close()
    return engine, answer, proxy


async def test_a_query_key_quoted_in_an_upstream_error_is_not_recorded(tmp_path, caplog):
    """An upstream that redirects forever: aiohttp's error quotes the URL, query and all; what is recorded (and
    answered) has the key taken out."""
    caplog.set_level("DEBUG")

    async def loop(request):
        raise web.HTTPTemporaryRedirect(str(request.rel_url))

    engine, (status, raw), proxy = await _call_with_query_key(loop, tmp_path)
    assert status == 502 and QUERY_SECRET.encode() not in raw
    (error,), = db_rows(proxy.db_path, "SELECT error FROM calls")
    assert error.endswith(f"url='{engine.url}/v1/chat/completions?{VERSION}&key=REDACTED'")  # aiohttp's words
    _no_secret_written(tmp_path, caplog, SECRET, QUERY_SECRET)


async def test_an_upstream_error_body_that_echoes_the_query_key_is_recorded_without_it(tmp_path, caplog):
    """A gateway whose 4xx page quotes the request URL: the agent gets the page as it came (its own key), the
    database gets the message and the body with the key taken out."""
    caplog.set_level("DEBUG")

    async def refuse(request):
        return web.json_response({"error": {"message": f"no deployment at {request.rel_url}", "type": "invalid"}},
                                 status=404)

    _, (status, raw), proxy = await _call_with_query_key(refuse, tmp_path)
    assert status == 404 and QUERY_SECRET.encode() in raw  # the agent's own answer, as the upstream gave it
    (error, response), = db_rows(proxy.db_path, "SELECT error, response FROM calls")
    assert error.endswith(f"/v1/chat/completions?{VERSION}&key=REDACTED")
    assert "key=REDACTED" in response
    _no_secret_written(tmp_path, caplog, SECRET, QUERY_SECRET)


def test_redact_takes_out_secret_looking_query_values_only():
    text = ("url=URL('https://h/x?api-version=1&key=k1&api_key=k2&API-KEY=k3&apikey=k4&access_token=t&token=t2"
            "&X-Amz-Signature=s&sig=s2&client_secret=c&password=p&subscription-key=k5&monkey=m&keyword=w')")
    assert redact(text) == ("url=URL('https://h/x?api-version=1&key=REDACTED&api_key=REDACTED&API-KEY=REDACTED"
                            "&apikey=REDACTED&access_token=REDACTED&token=REDACTED&X-Amz-Signature=REDACTED"
                            "&sig=REDACTED&client_secret=REDACTED&password=REDACTED&subscription-key=REDACTED"
                            "&monkey=m&keyword=w')")
