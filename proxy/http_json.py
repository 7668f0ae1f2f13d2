"""OpenAI-style errors: every failure the agent sees has the shape its SDK knows how to raise.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

4xx are the agent's mistakes, 502/503/504 are upstream trouble; a 500 would be a bug of ours.
"""

from __future__ import annotations

import logging

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

log = logging.getLogger("harness.proxy")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    502: "upstream_error",
    503: "upstream_error",
    504: "upstream_timeout",
}


class ApiError(Exception):
    """An error to hand back to the client as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> dict:
        return error_body(self.status, self.message, code=self.code, param=self.param)

    def response(self) -> web.Response:
        return json_response(self.body(), status=self.status)


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


MAX_JSON_DEPTH = 128  # orjson parses 1024 levels but writes 255: deeper bodies could be read, never sent on


def parse_json_object(raw: bytes) -> dict:
    """A request body as a JSON object; ApiError(400) naming what is wrong with it otherwise."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    check_depth(body)
    return body


def check_depth(body: dict) -> None:
    """ApiError(400) for an object nested deeper than MAX_JSON_DEPTH (a translated request is checked again)."""
    level, depth = [body], 1
    while level:
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x) if isinstance(v, (dict, list))]
        depth += bool(level)
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"request body is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json")


async def read_body(request: web.Request) -> bytes:
    """The request's bytes as sent. A compressed body is refused (415): agents send JSON as is, and the proxy
    records and forwards exactly what it was given."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ApiError(415, f"Content-Encoding {encoding!r} is not accepted: send the request body uncompressed",
                       code="unsupported_content_encoding")
    return await request.read()


def dumps_values(obj) -> bytes:
    """JSON of query results, whatever DuckDB returned: dates and decimals as text, map keys as text, and integers
    past 64 bits (HUGEINT) as text."""
    option = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
    try:
        return orjson.dumps(obj, default=str, option=option)
    except TypeError:  # an integer orjson cannot write: the slow way, once
        return orjson.dumps(_wide_ints_as_text(obj), default=str, option=option)


def _wide_ints_as_text(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if -2**63 <= value < 2**64 else str(value)
    if isinstance(value, dict):
        return {k: _wide_ints_as_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_wide_ints_as_text(v) for v in value]
    return value


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Turn every exception into OpenAI-style JSON; the proxy keeps serving whatever happened."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except RequestPayloadError as exc:  # a body that broke off or does not decode
        return ApiError(400, f"the request body could not be read: {exc}", code="invalid_body").response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.reason if exc.status != 413 else f"request body is too large: {exc.text}"
        if exc.status == 404:
            message = f"no route for {request.method} {request.path}: the proxy serves /v1/... and /e/<episode>/v1/..."
        return ApiError(exc.status, message, code=exc.reason.lower().replace(" ", "_")).response()
    except Exception:  # a bug of ours: log it, answer, keep serving
        log.exception("internal error serving %s %s", request.method, request.path)
        return json_response(error_body(500, "internal proxy error (logged)", code="internal_error"), status=500)
