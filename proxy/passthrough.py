"""The routes the proxy only forwards, unrecorded: GET /v1/models and any other /v1/<path> the engine serves. Each is
counted by route and the engine's status for GET /harness/status (`forwarded`), and an engine's 5xx or silence is
logged, so a failing engine shows on a route nothing records."""

from __future__ import annotations

import logging

import aiohttp
import orjson
from aiohttp import web

from proxy.http_json import ApiError, read_body
from proxy.record_only import forwarded, redact
from proxy.state import CONFIG, ENGINES, SESSION, STATE, check_agent_auth, request_key

log = logging.getLogger("harness.proxy")


async def models(request: web.Request) -> web.Response:
    api_key = request_key(request)
    check_agent_auth(request, api_key)
    engine = request.app[ENGINES].any_up()
    url, fwd = engine + "/v1/models", forwarded(request, api_key)
    try:
        async with request.app[SESSION].get(fwd.url(url), headers=fwd.headers) as resp:
            body, status = await resp.read(), resp.status
    except (TimeoutError, aiohttp.ClientError) as exc:
        _count_forwarded(request, "/v1/models", engine, None, exc)
        raise ApiError(502, redact(f"the engine at {url} is unreachable: {exc}"), code="upstream_unavailable") from None
    _count_forwarded(request, "/v1/models", engine, status)
    return web.Response(body=body, status=status, content_type="application/json")


def _count_forwarded(request: web.Request, route: str, engine: str, status: int | None,
                     error: BaseException | None = None) -> None:
    """Count a call the proxy only forwards (it records none of them) by route and the engine's status, for
    GET /harness/status (`forwarded`); an engine's 5xx or no answer at all is logged, with the route and status only
    (never a header, a key or a query string), so a failing engine shows on a route nothing records."""
    key = f"{request.method} {route}"
    counts = request.app[STATE].forwarded.setdefault(key, {})
    label = "unreachable" if status is None else str(status)
    counts[label] = counts.get(label, 0) + 1
    if status is None:
        log.warning("forwarded %s: the engine at %s could not be reached (%s); the agent got a 502", key,
                    redact(engine), redact(f"{type(error).__name__}: {error}"))
    elif status >= 500:
        log.warning("forwarded %s: the engine at %s answered %d", key, redact(engine), status)


_OWN_ROUTES = {"chat/completions": "POST", "completions": "POST", "models": "GET", "responses": "POST",
               "messages": "POST"}
# First path segments of OpenAI / Anthropic API endpoints: one the engine lacks is a 501 (not offered), any other
# path the engine does not know stays a 404 (no such route).
_API_ENDPOINTS = {"embeddings", "audio", "images", "moderations", "files", "uploads", "batches", "fine_tuning",
                  "fine-tunes", "assistants", "threads", "vector_stores", "realtime", "conversations", "containers",
                  "evals", "videos", "responses", "messages", "rerank", "score", "classify", "pooling", "tokenize",
                  "detokenize", "models", "chat", "completions"}


async def passthrough(request: web.Request) -> web.Response:
    """A /v1/<tail> the proxy does not serve itself: forwarded to the engine unrecorded (a JSON body's model name
    becomes the served policy's, as on the recorded routes). An API endpoint the engine does not offer (it answers
    404 or 405) is a 501 that says so."""
    tail = request.match_info["tail"]
    if tail in _OWN_ROUTES:  # one of ours, asked with the other method
        raise web.HTTPMethodNotAllowed(request.method, [_OWN_ROUTES[tail]])
    if any(part in (".", "..") or "%" in part or "\\" in part for part in tail.split("/")):
        raise web.HTTPNotFound()  # never a way out of the engine's /v1 (its admin routes live beside it)
    api_key = request_key(request)
    check_agent_auth(request, api_key)
    engine = request.app[ENGINES].any_up()
    url = f"{engine}/v1/{tail}"
    fwd = forwarded(request, api_key)
    headers = {k: v for k in ("Content-Type", "Accept") if (v := request.headers.get(k))}
    headers.update(fwd.headers)
    data = await read_body(request) if request.method == "POST" else None
    served = request.app[STATE].served_model
    if data and served and request.content_type == "application/json":  # any model name serves the policy
        try:
            body = orjson.loads(data)
            if isinstance(body, dict) and isinstance(body.get("model"), str):
                data = orjson.dumps({**body, "model": served})
        except (orjson.JSONDecodeError, orjson.JSONEncodeError):  # not JSON, or nested too deep to write back
            pass  # forwarded as it came
    # record-only: the query string byte for byte, as on every route; our engine gets it parsed and re-encoded
    target, params = (fwd.url(url), None) if request.app[CONFIG].record_only else (url, request.query)
    try:
        async with request.app[SESSION].request(request.method, target, params=params, data=data,
                                                headers=headers) as resp:
            body, status = await resp.read(), resp.status
            out_headers = {k: v for k in ("Content-Type", "Content-Encoding") if (v := resp.headers.get(k))}
    except (TimeoutError, aiohttp.ClientError) as exc:
        _count_forwarded(request, _route_of(tail), engine, None, exc)
        raise ApiError(502, redact(f"the engine at {url} is unreachable: {exc}"), code="upstream_unavailable") from None
    _count_forwarded(request, _route_of(tail), engine, status)
    if status in (404, 405):
        if tail.split("/", 1)[0] in _API_ENDPOINTS:
            raise ApiError(501, f"the engine at {engine} does not offer /v1/{tail} (it answered "
                           f"{status}); the proxy records /v1/chat/completions, /v1/completions, /v1/responses and "
                           "/v1/messages", code="not_implemented")
        raise web.HTTPNotFound()
    if status >= 500 and status not in (502, 503, 504):
        status = 502
    return web.Response(body=body, status=status, headers=out_headers)


def _route_of(tail: str) -> str:
    """A pass-through path as counted: its first segment, the rest (ids: files/<id>, models/<name>) as `*`, so the
    counts stay a few keys however many ids agents ask for."""
    first, _, rest = tail.partition("/")
    return f"/v1/{first}" + ("/*" if rest else "")
