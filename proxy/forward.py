"""The answer side of one call: forward the prepared request (proxy/request.py) to the engine, hand the answer
back (a stream chunk by chunk, as it arrives), and collect what the recorder needs on the side: every `Call`
record is built here (`Capture.to_call`), a request the proxy refused included (`refused_call`).

What changes on the way back: exactly what the request side added (token ids, logprobs) is removed again, and
the model name is the one the agent asked for, so the agent sees the shape it asked for.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import orjson
from aiohttp import web

from harness.core.records import CANCELLED, ENGINE, ERROR, NONE, OK, Call, Choice
from proxy.chat_answer import ChatAnswer
from proxy.engine_client import HttpClient
from proxy.http_json import ApiError, error_body
from proxy.record_only import redact, redact_bytes, with_query
from proxy.request import CHAT, COMPLETIONS, Prepared
from proxy.wire.common import Wire

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}
CALL_ID_HEADER = "x-harness-call-id"  # on every forwarded answer: the `calls.call_id` it is recorded under


# ---------------------------------------------------------------------------------------------------------------
# The answer: collect ids, logprobs and text per choice while passing everything through.
# ---------------------------------------------------------------------------------------------------------------


def _take(obj: dict, key: str, keep: bool):
    """Read a field the proxy asked for; unless the agent asked too, leave it as vLLM sends it unasked (null)."""
    value = obj.get(key)
    if value is not None and not keep:
        obj[key] = None
    return value


@dataclass
class _ChoiceAcc:
    index: int
    ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict] = field(default_factory=dict)

    def add_ids(self, ids) -> None:
        if ids is None:
            return
        if self.ids is None:
            self.ids = []
        self.ids.extend(ids)

    def add_logprobs(self, endpoint: str, lp) -> None:
        if not lp:
            return
        values = [e["logprob"] for e in lp.get("content") or ()] if endpoint == CHAT else lp.get("token_logprobs")
        if values is None:
            return
        if self.logprobs is None:
            self.logprobs = []
        self.logprobs.extend(values)

    def add_tool_call_delta(self, delta: dict) -> None:
        slot = self.tool_calls.setdefault(delta.get("index", len(self.tool_calls)), {"function": {"arguments": ""}})
        for key in ("id", "type"):
            if delta.get(key):
                slot[key] = delta[key]
        fn = delta.get("function") or {}
        if fn.get("name"):
            slot["function"]["name"] = fn["name"]
        if fn.get("arguments"):
            slot["function"]["arguments"] += fn["arguments"]

    def to_choice(self) -> Choice:
        calls = [self.tool_calls[k] for k in sorted(self.tool_calls)] or None
        return Choice(
            index=self.index,
            completion_ids=self.ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            text="".join(self.text) if self.text else None,
            tool_calls=calls,
            reasoning="".join(self.reasoning) if self.reasoning else None,
        )


class Capture:
    """Everything the recorder needs about one call, filled in as the call goes."""

    def __init__(self, prepared: Prepared, *, run_id: str, episode_id: str, call_index: int, weight_version: int):
        self.p = prepared
        self.run_id = run_id
        self.episode_id = episode_id
        self.call_index = call_index
        self.weight_version = weight_version
        self.call_id = uuid.uuid4().hex
        self.started_at = time.time()
        self.t0 = time.perf_counter()
        self.ttft_ms: float | None = None
        self.served_model: str | None = None
        self.prompt_ids: list[int] | None = None
        self.choices: dict[int, _ChoiceAcc] = {}
        self.usage: dict | None = None
        self.response: bytes | None = None
        self.first_chunk: dict | None = None  # id and created of a stream's first chunk
        self.status = OK
        self.http_status = 200
        self.error: str | None = None
        self.continuity: dict | None = None  # how a chat call was served (proxy/continuity.py), and why
        self.wire: str | None = None  # the wire format the agent spoke, when not chat ("responses", "messages")
        self.notes: dict = {}  # more for calls.extra: the role's name, the upstream that served a frozen role
        self.role: str | None = None  # the matched role rule's name (calls.role)
        self.policy: str | None = None  # the policy that served it, when the policy engine did (calls.policy)
        self.upstream_body = b""  # what goes upstream: the prepared body, or its completions form (continuity)
        self.upstream_headers: dict[str, str] = {}  # e.g. a frozen role's upstream key: sent, never recorded
        self.upstream_query = ""  # record-only: the agent's query string, sent as it came, never recorded
        self.unreachable = False  # the engine could not be reached: nothing went to the agent, another may take it
        self.saw_done = False  # the engine's stream said [DONE]...
        self.done_sent = False  # ...and it went out to the agent: the agent has the whole answer
        self.complete = False  # a stream's answer is assembled into `response`: nothing more comes
        # Called with the call's record once a stream's answer is complete, before its last bytes go out (app.py
        # journals it, so a crash right after loses nothing); the record proper follows once they went out.
        self.on_complete: Callable[[Call], None] | None = None

    def _acc(self, index: int) -> _ChoiceAcc:
        acc = self.choices.get(index)
        if acc is None:
            acc = self.choices[index] = _ChoiceAcc(index)
        return acc

    def fail(self, status: str, http_status: int, error: str) -> None:
        self.status, self.http_status, self.error = status, http_status, error

    # The engine's answer in one piece.
    def take_response(self, obj: dict) -> dict:
        """Collect ids, logprobs and text from a complete answer; strip what the agent did not ask for."""
        p = self.p
        self.served_model = obj.get("model")
        self.usage = obj.get("usage")
        keep = p.asked_token_ids
        prompt_ids = _take(obj, "prompt_token_ids", keep)
        for choice in obj.get("choices") or ():
            acc = self._acc(choice.get("index", 0))
            acc.add_ids(_take(choice, "token_ids", keep))
            if p.endpoint == COMPLETIONS:
                prompt_ids = prompt_ids or _take(choice, "prompt_token_ids", keep)
                acc.text.append(choice.get("text") or "")
            else:
                message = choice.get("message") or {}
                if message.get("content") is not None:
                    acc.text.append(message["content"])
                reasoning = message.get("reasoning_content") or message.get("reasoning")
                if reasoning:
                    acc.reasoning.append(reasoning)
                    _both_names(message, reasoning)
                for i, call in enumerate(message.get("tool_calls") or ()):
                    acc.tool_calls[i] = call
            acc.add_logprobs(p.endpoint, choice.get("logprobs"))
            if not p.asked_logprobs:
                choice["logprobs"] = None
            acc.finish_reason = choice.get("finish_reason")
        self.prompt_ids = prompt_ids
        if p.requested_model is not None:
            obj["model"] = p.requested_model
        return obj

    # The engine's answer as a stream, one chunk at a time.
    def take_chunk(self, chunk: dict) -> dict | None:
        """Collect from one stream chunk; returns the chunk for the agent, or None if the agent gets nothing."""
        p = self.p
        keep = p.asked_token_ids
        ids = _take(chunk, "prompt_token_ids", keep)
        if ids is not None:
            self.prompt_ids = ids
        if self.served_model is None:
            self.served_model = chunk.get("model")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or ()
        for choice in choices:
            acc = self._acc(choice.get("index", 0))
            acc.add_ids(_take(choice, "token_ids", keep))
            if p.endpoint == COMPLETIONS:
                cp = _take(choice, "prompt_token_ids", keep)
                if cp is not None and self.prompt_ids is None:
                    self.prompt_ids = cp
                if choice.get("text"):
                    acc.text.append(choice["text"])
            else:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    acc.text.append(delta["content"])
                reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                if reasoning:
                    acc.reasoning.append(reasoning)
                    _both_names(delta, reasoning)
                for tc in delta.get("tool_calls") or ():
                    acc.add_tool_call_delta(tc)
            if "logprobs" in choice:
                acc.add_logprobs(p.endpoint, choice["logprobs"])
                if not p.asked_logprobs:
                    choice["logprobs"] = None
            if choice.get("finish_reason") is not None:
                acc.finish_reason = choice["finish_reason"]
        if choices and p.endpoint == CHAT and not (keep or p.asked_logprobs):
            # vLLM sends a chat chunk with no text (a special token, half a character) only because we asked for
            # ids and logprobs; unasked, it would have skipped it, so the agent does not see it either.
            chunk["choices"] = choices = [c for c in choices if c.get("delta") or c.get("finish_reason") is not None]
            if not choices and not chunk.get("usage"):
                return None
        if p.requested_model is not None and "model" in chunk:
            chunk["model"] = p.requested_model
        return chunk

    def assembled_response(self) -> bytes:
        """A stream, assembled into the one completion object a non-streamed call would have returned."""
        choices = []
        for acc in sorted(self.choices.values(), key=lambda a: a.index):
            c = acc.to_choice()
            if self.p.endpoint == CHAT:
                message = {"role": "assistant", "content": c.text}
                if c.tool_calls:
                    message["tool_calls"] = c.tool_calls
                if c.reasoning:
                    message["reasoning_content"] = c.reasoning
                choices.append({"index": c.index, "message": message, "finish_reason": c.finish_reason})
            else:
                choices.append({"index": c.index, "text": c.text or "", "finish_reason": c.finish_reason})
        head = self.first_chunk or {}
        obj = {
            "id": head.get("id"),
            "object": "chat.completion" if self.p.endpoint == CHAT else "text_completion",
            "created": head.get("created"),
            "model": self.p.requested_model or self.served_model,
            "choices": choices,
        }
        if self.usage:
            obj["usage"] = self.usage
        return orjson.dumps(obj)

    def to_call(self, latency_ms: float | None = None) -> Call:
        """The record of this call (`latency_ms`: None, from its start until now)."""
        choices = [acc.to_choice() for acc in sorted(self.choices.values(), key=lambda a: a.index)]
        have_ids = self.prompt_ids is not None
        completion_tokens = sum(len(c.completion_ids) for c in choices if c.completion_ids) if have_ids else None
        if self.usage:
            prompt_tokens = self.usage.get("prompt_tokens")
            completion_tokens = self.usage.get("completion_tokens", completion_tokens)
        else:
            prompt_tokens = len(self.prompt_ids) if have_ids else None
        extra = {"sampling_overrides": self.p.overrides} if self.p.overrides else {}
        if self.continuity is not None:
            extra["continuity"] = self.continuity
        if self.wire is not None:
            extra["wire"] = self.wire
        extra.update(self.notes)
        return Call(
            call_id=self.call_id,
            run_id=self.run_id,
            episode_id=self.episode_id,
            call_index=self.call_index,
            endpoint=self.p.endpoint,
            stream=self.p.stream,
            requested_model=self.p.requested_model,
            served_model=self.served_model,
            role_key=self.p.role_key,
            system_hash=self.p.system_hash,
            tools_hash=self.p.tools_hash,
            request=self.p.record_request,
            response=self.response,
            prompt_ids=self.prompt_ids,
            choices=choices,
            token_source=ENGINE if have_ids else NONE,
            status=self.status,
            http_status=self.http_status,
            error=self.error,
            started_at=self.started_at,
            latency_ms=(time.perf_counter() - self.t0) * 1000.0 if latency_ms is None else latency_ms,
            ttft_ms=self.ttft_ms,
            weight_version=self.weight_version,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            extra=extra,
            role=self.role,
            policy=self.policy,
        )


def _both_names(message: dict, reasoning: str) -> None:
    """Reasoning under both names agents read: `reasoning` (vLLM's) and `reasoning_content` (DeepSeek's API, older
    vLLM; what LangChain's and LiteLLM's DeepSeek clients look for)."""
    message["reasoning"] = message["reasoning_content"] = reasoning


def refused_call(endpoint: str, exc: ApiError, wire: Wire | None, *, run_id: str, episode_id: str,
                 call_index: int, weight_version: int) -> Call:
    """A request the proxy refused: recorded (without its body, which may not even be JSON) so nothing vanishes."""
    nothing = Prepared(endpoint=endpoint, stream=False, requested_model=None, asked_logprobs=False,
                       asked_token_ids=False, record_request=b"null", system_hash=None, tools_hash=None, role_key="")
    cap = Capture(nothing, run_id=run_id, episode_id=episode_id, call_index=call_index, weight_version=weight_version)
    cap.fail(ERROR, exc.status, exc.message)
    cap.wire = wire.name if wire is not None else None
    return cap.to_call(latency_ms=0.0)


# ---------------------------------------------------------------------------------------------------------------
# Forwarding: one JSON answer, or a stream passed through chunk by chunk.
# ---------------------------------------------------------------------------------------------------------------


def _upstream_error(exc: BaseException, url: str) -> ApiError:
    """`url` without its query string; `exc` may quote it (a redirect loop), so its secrets are taken out."""
    if isinstance(exc, asyncio.TimeoutError):
        return ApiError(504, f"the engine at {url} did not answer in time", code="upstream_timeout")
    return ApiError(502, redact(f"the engine at {url} is unreachable: {exc}"), code="upstream_unavailable")


def _passthrough_status(status: int) -> int:
    """Engine 4xx pass through as they are; any engine 5xx is upstream trouble (502/503/504), never our 500."""
    if status < 500:
        return status
    return status if status in (502, 503, 504) else 502


def _error_message(raw: bytes) -> str:
    try:
        obj = orjson.loads(raw)
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict):
            return str(err.get("message"))
        if isinstance(obj, dict) and "message" in obj:
            return str(obj["message"])
    except orjson.JSONDecodeError:
        pass
    return raw[:500].decode("utf-8", "replace")


async def forward(
    request: web.Request, session: HttpClient, url: str, cap: Capture,
    answer: ChatAnswer | None = None, wire: Wire | None = None,
) -> web.StreamResponse:
    """Send the prepared request to the engine and answer the agent; `cap` records what happened. With `answer`,
    the engine answers a completions request and the agent gets it as the chat answer it asked for. With `wire`,
    the agent spoke another API (proxy/wire/common.py): it gets the chat answer translated back, errors included, while
    the record stays chat form. A whole answer is returned unsent: the caller records it first."""
    resp = await _forward(request, session, url, cap, answer, wire)
    if not resp.prepared:
        resp.headers[CALL_ID_HEADER] = cap.call_id
    return resp


async def _forward(request: web.Request, session: HttpClient, url: str, cap: Capture,
                   answer: ChatAnswer | None, wire: Wire | None) -> web.StreamResponse:
    # identity: the answer is parsed and recorded here, and a vendor's fixed model would otherwise compress it
    headers = {"Content-Type": "application/json", "Accept-Encoding": "identity", **cap.upstream_headers}
    if wire is not None:
        cap.wire = wire.name
    try:
        async with session.post(with_query(url, cap.upstream_query), data=cap.upstream_body,
                                headers=headers) as upstream:
            if upstream.status != 200:
                raw = await upstream.read()
                status = _passthrough_status(upstream.status)
                # recorded without secrets an error page may quote (an upstream URL with ?key=...)
                cap.fail(ERROR, status, redact(f"engine answered {upstream.status}: {_error_message(raw)}"))
                if status != upstream.status:
                    raw = orjson.dumps(error_body(status, cap.error, code="upstream_error"))
                cap.response = redact_bytes(raw)
                if wire is not None:
                    raw = orjson.dumps(wire.error_body(status, cap.error, "upstream_error"))
                return web.Response(body=raw, status=status, content_type="application/json")
            if cap.p.stream:
                return await _forward_stream(request, upstream, cap, answer, wire)
            raw = await upstream.read()
    except (TimeoutError, aiohttp.ClientError) as exc:
        err = _upstream_error(exc, url)
        cap.fail(ERROR, err.status, err.message)
        cap.unreachable = isinstance(exc, aiohttp.ClientConnectionError)
        return err.response() if wire is None else wire.error_response(err)
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        err = ApiError(502, f"the engine at {url} answered 200 with a body that is not JSON", code="upstream_error")
        cap.fail(ERROR, 502, err.message)
        return err.response() if wire is None else wire.error_response(err)
    obj = cap.take_response(answer.response(obj) if answer is not None else obj)
    cap.response = orjson.dumps(obj)
    body = cap.response if wire is None else orjson.dumps(wire.response(obj))
    return web.Response(body=body, status=200, content_type="application/json")


def _split_events(buf: bytearray) -> list[bytes]:
    """Cut complete SSE events (terminated by a blank line) off the front of `buf`."""
    events = []
    while True:
        end = buf.find(b"\n\n")
        if end < 0:
            break
        events.append(bytes(buf[:end]))
        del buf[: end + 2]
    return events


async def _forward_stream(request: web.Request, upstream: aiohttp.ClientResponse, cap: Capture,
                          answer: ChatAnswer | None, wire: Wire | None) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={**_SSE_HEADERS, CALL_ID_HEADER: cap.call_id})
    await resp.prepare(request)
    buf = bytearray()
    try:
        try:
            async for data in upstream.content.iter_any():
                buf += data.replace(b"\r\n", b"\n") if b"\r" in data else data
                out = []
                for event in _split_events(buf):
                    out.append(_translate_event(event, cap, answer, wire))
                payload = b"".join(out)
                if cap.saw_done:
                    _complete(cap)
                if payload:
                    await resp.write(payload)
                    cap.done_sent = cap.saw_done
                    if cap.ttft_ms is None and cap.choices:
                        cap.ttft_ms = (time.perf_counter() - cap.t0) * 1000.0
        except (TimeoutError, aiohttp.ClientError) as exc:
            err = _upstream_error(exc, str(upstream.url.with_query(None)))
            cap.fail(ERROR, 200, f"stream broke off: {err.message}")
            cap.notes["engine_fault"] = "stream_broke_off"  # the agent saw a 200: this says whose fault it was
            _complete(cap)
            await resp.write(b"data: " + orjson.dumps(err.body()) + b"\n\n" if wire is None
                             else wire.error_event(cap.error))
        _complete(cap)
        await resp.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
        if not cap.done_sent:  # an agent that hangs up after [DONE] got the whole answer
            cap.fail(CANCELLED, 0, f"the agent disconnected mid-stream: {exc}")
    finally:  # also when the handler is cancelled (an agent that hangs up right after [DONE]): the answer stays
        if not cap.complete:
            cap.response = cap.assembled_response()
    return resp


def _complete(cap: Capture) -> None:
    """The stream's answer is complete and its last bytes are about to go out: assemble it, and hand its record to
    `on_complete` (once)."""
    if cap.complete:
        return
    cap.complete = True
    cap.response = cap.assembled_response()
    if cap.on_complete is not None:
        hook, cap.on_complete = cap.on_complete, None
        hook(cap.to_call())


def _translate_event(event: bytes, cap: Capture, answer: ChatAnswer | None, wire: Wire | None) -> bytes:
    """One SSE event of the engine -> what the agent gets: the chat chunk(s), or with `wire`, that API's events
    (the engine's [DONE] becomes the wire's closing events: the agent then has the whole answer)."""
    if not event.startswith(b"data: "):
        return event + b"\n\n" if wire is None else b""
    payload = event[6:]
    if payload == b"[DONE]":
        cap.saw_done = True
        return event + b"\n\n" if wire is None else wire.done()
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError:
        cap.fail(ERROR, 200, f"the engine sent a stream chunk that is not JSON: {payload[:200]!r}")
        return event + b"\n\n" if wire is None else wire.error_event(cap.error)
    if "error" in chunk:
        err = chunk["error"]
        cap.fail(ERROR, 200, f"engine error mid-stream: {err.get('message') if isinstance(err, dict) else err}")
        cap.notes["engine_fault"] = "error_mid_stream"
        return event + b"\n\n" if wire is None else wire.error_event(cap.error)
    out = []
    for piece in answer.chunk(chunk) if answer is not None else (chunk,):
        if cap.first_chunk is None:
            cap.first_chunk = {"id": piece.get("id"), "created": piece.get("created")}
        piece = cap.take_chunk(piece)
        if piece is None:
            continue
        if wire is None:
            out.append(b"data: " + orjson.dumps(piece) + b"\n\n")
        else:
            out.append(wire.chunk(piece, len(cap.prompt_ids) if cap.prompt_ids is not None else None))
    return b"".join(out)
