"""What the two translated wire formats share (proxy/wire/responses.py, proxy/wire/messages.py).

vLLM's own /v1/responses and /v1/messages return no token ids, so the proxy serves both APIs by translation: the
agent's request becomes a chat-completions request, which then takes the ordinary path (request.prepare,
token-exact continuity, capture, recorder), and the chat answer, whole or chunk by chunk, is translated back into
the wire format the agent asked for. What is recorded stays chat form (`calls.extra.wire` names the format).

A wire object serves one call:

    translate(body) -> chat request (dict)   (ApiError 400 naming the field, also for what is not offered)
    response(chat_obj) -> dict               a whole answer
    chunk(chat_chunk, prompt_tokens) -> bytes    SSE events for one chat chunk (after capture stripped it)
    done() -> bytes                          the closing events (the engine said [DONE])
    error_event(message) -> bytes            a stream that broke off
    error_body(status, message, code, param) -> dict    a non-200 answer in the format's error shape
"""

from __future__ import annotations

import uuid
from collections import OrderedDict

import orjson
from aiohttp import web

from proxy.http_json import ApiError, check_depth, error_body

# vLLM sampling extensions an agent may send on any format (`extra_body`): passed to the chat request as they are.
ENGINE_EXTRAS = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "min_tokens", "ignore_eos", "logit_bias", "structured_outputs", "guided_regex", "guided_json",
                 "guided_choice", "chat_template_kwargs", "skip_special_tokens", "include_stop_str_in_output")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ConversationStore:
    """The conversation behind each of the latest `size` answers (as chat messages), by answer id: what the
    Responses API's `previous_response_id` continues. In memory: lost when the proxy restarts."""

    def __init__(self, size: int = 8192):
        self.size = size
        self._items: OrderedDict[str, list[dict]] = OrderedDict()

    def get(self, answer_id: str) -> list[dict] | None:
        return self._items.get(answer_id)

    def put(self, answer_id: str, messages: list[dict]) -> None:
        self._items[answer_id] = messages
        while len(self._items) > self.size:
            self._items.popitem(last=False)


def short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"'{param}' {message}", param=param)


def not_offered(param: str, message: str) -> ApiError:
    """A field or value the engine cannot serve and that cannot be left out safely: a 400 (the request asks for
    something this server does not do; a 5xx would tell the agent to retry), `message` saying what to send or which
    setting allows it."""
    return ApiError(400, message, param=param, code="unsupported_value")


def check(value, types: tuple, param: str, what: str, *, required: bool = False):
    """`value` if it is one of `types` (bool is not an int here), else a 400 naming `param`."""
    if value is None and not required:
        return None
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise bad(param, f"must be {what}, got {type(value).__name__} {short(value)}")
    return value


def sse(event: str, data: dict) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def parse_arguments(arguments: str | None) -> dict:
    """Tool-call arguments as an object (Anthropic's `input`); {} when they are not a JSON object."""
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def reasoning_of(message: dict) -> str | None:
    """A chat message's or delta's reasoning: vLLM's `reasoning`, or the older `reasoning_content`."""
    return message.get("reasoning") or message.get("reasoning_content")


class Wire:
    """The base: OpenAI-shaped errors; subclasses translate requests and answers."""

    name = ""
    forwards_query = True  # record-only mode: the agent's query string goes on to the upstream's chat endpoint
    notes: dict | None = None  # what the translation left out or changed, for the call's record (calls.extra)

    def translate(self, body: dict) -> dict:
        """The request (parsed once, proxy/app.py) as a chat request; checked for depth as a body as sent is."""
        chat = self.to_chat(body)
        check_depth(chat)
        return chat

    def to_chat(self, body: dict) -> dict:
        raise NotImplementedError

    def error_body(self, status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
        return error_body(status, message, code=code, param=param)

    def error_response(self, exc: ApiError) -> web.Response:
        """An error raised before the engine was asked, in this format's shape."""
        body = self.error_body(exc.status, exc.message, exc.code, exc.param)
        return web.Response(body=orjson.dumps(body), status=exc.status, content_type="application/json")
