"""Judging the answers of tests/proxy/test_fuzz.py: what an answer is, how a violation is kept, and the checks' helpers.

`Answer` is what the proxy sent back (or why nothing came), `Violation` one kind of broken property with its count and
smallest example. `LogTrap` collects the warnings and errors the proxy and aiohttp log, `SpiedUpstream` is the scripted
engine noting every path it is asked for and every failure. The helpers tell an OpenAI-style (or Anthropic) error
body, a 501 for an endpoint the engine does not offer, a stream that ends with its terminator and carries no error,
a recorded 200, a path outside the engine's /v1/, and render the generated `Deep` and `Huge` payloads as bytes.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from proxy.scripted_engine import ScriptedEngine
from tests.proxy.fuzz_strategies import Deep, Huge
from tests.support import BackgroundLoop, ScriptedUpstream

# ---------------------------------------------------------------------------------------------------------------
# Sending and checking.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int | None  # None: no answer (connection dropped, timeout)
    content_type: str = ""
    body: bytes = b""
    error: str = ""


@dataclass
class Violation:
    signature: str
    count: int = 0
    request: str = ""
    answer: str = ""
    log: str = ""
    size: int = 1 << 62


class LogTrap(logging.Handler):
    """Collects the proxy's and aiohttp's warnings and errors (emitted on the proxy's thread)."""

    NAMES = ("harness", "proxy", "aiohttp", "asyncio")

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self._levels = {}

    def emit(self, record):
        self.records.append(record)

    def install(self):
        for name in self.NAMES:
            logger = logging.getLogger(name)
            self._levels[name] = logger.level
            if logger.getEffectiveLevel() > logging.WARNING:
                logger.setLevel(logging.WARNING)
            logger.addHandler(self)

    def remove(self):
        for name in self.NAMES:
            logger = logging.getLogger(name)
            logger.removeHandler(self)
            logger.setLevel(self._levels[name])


def _errors(records) -> list[logging.LogRecord]:
    return [r for r in records if r.levelno >= logging.ERROR]


def _parser_log(record: logging.LogRecord) -> bool:
    """aiohttp's log of a request its HTTP parser refused (it answers a plain-text 400 itself)."""
    exc = record.exc_info[1] if record.exc_info else None
    return record.name.startswith("aiohttp") and isinstance(exc, HttpProcessingError) and \
        record.getMessage().startswith("Error handling request")


def _render(record: logging.LogRecord) -> str:
    text = f"{record.name} {record.levelname}: {record.getMessage()}"
    if record.exc_info:
        text += "\n" + "".join(logging.Formatter().formatException(record.exc_info))
    return text


def _exc_line(records) -> str:
    """The last line of the first traceback logged (e.g. 'TypeError: Recursion limit reached')."""
    for r in records:
        if r.exc_info and r.exc_info[1] is not None:
            return f"{type(r.exc_info[1]).__name__}: {str(r.exc_info[1]).splitlines()[0] if str(r.exc_info[1]) else ''}"
    return ""


def _normalize(text: str) -> str:
    """A log message without paths, ids and numbers, to group violations."""
    text = re.sub(r"\b([A-Z]{3,7}) /\S*", r"\1 <path>", text.split("; spilling")[0])
    text = re.sub(r"(call|episode) \S+ could not", r"\1 <id> could not", text)
    return re.sub(r"[0-9a-f]{12,}|\d+", "<n>", text)[:160]


class SpiedUpstream(ScriptedUpstream):
    """The scripted engine, noting every path it is asked for and every answer >= 500 it gives."""

    def __init__(self):
        self.bg = BackgroundLoop()
        self.engine = ScriptedEngine()
        self.paths: list[str] = []
        self.failures: list[str] = []

        @web.middleware
        async def spy(request, handler):
            self.paths.append(request.raw_path)
            try:
                resp = await handler(request)
            except web.HTTPException:
                raise
            except Exception as exc:
                self.failures.append(f"{request.method} {request.raw_path}: {exc!r}")
                raise
            if resp.status >= 500:
                self.failures.append(f"{request.method} {request.raw_path}: {resp.status}")
            return resp

        self.engine.app.middlewares.append(spy)
        self.url = self.bg.run(self.engine.start())


def _escapes_v1(raw_path: str) -> bool:
    """A path the engine got that is not under its /v1/ (its admin routes sit beside /v1)."""
    path = raw_path.split("?", 1)[0]
    if path in ("/tokenize", "/detokenize", "/health"):  # token-exact continuity asks these
        return False
    decoded = path
    for _ in range(3):
        decoded = decoded.replace("%2e", ".").replace("%2E", ".").replace("%2f", "/").replace("%2F", "/")
    return not path.startswith("/v1/") or any(seg in (".", "..") for seg in decoded.split("/"))


def _error_shape(body: bytes, anthropic_ok: bool) -> dict | None:
    """The error object of an OpenAI-style (or, where allowed, Anthropic-style) error body, else None."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return None
    if anthropic_ok and obj.get("type") == "error" and isinstance(err.get("type"), str):
        return err
    return err if "type" in err and "code" in err else None


def _not_offered(err: dict) -> bool:
    if err.get("code") == "not_implemented":
        return True
    return "does not offer" in err.get("message", "")  # an endpoint the engine lacks (proxy/app.py)


def _stream_problem(route: str, body: bytes) -> str | None:
    events = [e for e in body.decode("utf-8", "replace").replace("\r\n", "\n").split("\n\n") if e.strip()]
    if not events:
        return "a 200 stream with no event"
    for event in events:
        if event.startswith("event: error") or event.startswith("event: response.failed"):
            return f"the stream carries an error event: {event[:300]}"
        if event.startswith("data: {") and '"error"' in event:
            try:
                if "error" in orjson.loads(event[6:]):
                    return f"the stream carries an error chunk: {event[:300]}"
            except orjson.JSONDecodeError:
                return f"a stream chunk that is not JSON: {event[:300]}"
    last = events[-1]
    ends = {"chat": ("data: [DONE]",), "completions": ("data: [DONE]",), "messages": ("event: message_stop",),
            "responses": ("event: response.completed", "event: response.incomplete")}.get(route)
    if ends and not any(last.startswith(end) for end in ends):
        return f"the stream does not end with {' or '.join(ends)}: ...{last[-300:]}"
    return None


def _is_llm_answer(answer: Answer) -> bool:
    """A 200 of a recorded route: a chat/completions/responses/messages answer, whole or streamed."""
    if answer.status != 200:
        return False
    if answer.content_type.startswith("text/event-stream"):
        return True
    try:
        obj = orjson.loads(answer.body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and (obj.get("object") in ("chat.completion", "text_completion", "response")
                                      or obj.get("type") == "message")


def _render_deep(deep: Deep) -> bytes:
    if deep.kind == "list":
        return b"[" * deep.depth + b"1" + b"]" * deep.depth
    return b'{"a":' * deep.depth + b"1" + b"}" * deep.depth


def _render_huge(huge: Huge) -> bytes:
    if huge.kind == "chat":
        return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * huge.size}],
                             "max_tokens": 4})
    if huge.kind == "messages":
        return orjson.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "y" * huge.size}]})
    if huge.kind == "array":
        return b"[" + b"1," * (huge.size // 2) + b"1]"
    return bytes(range(256)) * (huge.size // 256)
