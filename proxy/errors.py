"""OpenAI-style errors: every failure the agent sees has the shape its SDK knows how to raise.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

4xx are the agent's mistakes, 502/503/504 are upstream trouble; a 500 would be a bug of ours.
"""

from __future__ import annotations

import logging

import orjson
from aiohttp import web

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


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Turn every exception into OpenAI-style JSON; the proxy keeps serving whatever happened."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
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
