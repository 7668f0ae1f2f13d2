"""A scripted engine: a real HTTP server that answers like vLLM (token ids, logprobs, SSE) with fixed content.

For tests that need exact control of the bytes (timeouts, engine errors, stream timing) and for benchmarks that
measure the proxy rather than the model. Everything else tests against the real engine.

It also answers vLLM's dev routes the trainer uses, as vLLM does in dev mode: the weight push's (/pause, /resume,
/collective_rpc, /reset_prefix_cache, /v1/load_lora_adapter, /v1/unload_lora_adapter: accepted, nothing changes)
and sleep mode's (POST /sleep?level=N, POST /wake_up, GET /is_sleeping). While it sleeps it refuses generation and
weight reloads with 503 and counts them (`refused_asleep`): a test asserts the trainer never sends either.
`targets` logs every request in arrival order, so a test can read the order of sleep, wake, push and calls.
A LoRA adapter loaded by name is served under that name, as vLLM serves it: a request naming it is answered with
it as the model (what the proxy records as `calls.served_model`); any other name gets `Script.model`.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field

import orjson
from aiohttp import web

MAX_N = 128  # larger `n` is a 400, as from a server with a bound on sequences


@dataclass
class Script:
    """What the scripted engine does; change it between requests."""

    prompt_tokens: int = 32  # length of the returned prompt ids
    completion_tokens: int = 8  # tokens per choice
    delay_s: float = 0.0  # wait before answering
    chunk_delay_s: float = 0.0  # wait between stream chunks
    status: int = 200  # answer with this HTTP status (non-200: an OpenAI-style error)
    model: str = "scripted-model"
    max_model_len: int | None = None  # GET /v1/models says this context (vLLM's field), when set
    break_stream_after: int | None = None  # close the connection after this many chunks
    linger_after_done_s: float = 0.0  # wait this long after [DONE] before ending the stream
    healthy: bool = True  # False: GET /health answers 503, like an engine that is dying
    token_ids: bool = True  # False: answer like a server that knows nothing of token ids (no such fields)
    tool_arguments: str | None = None  # chat answers a call of tool `tool_name` with these arguments instead of text
    tool_name: str = "lookup"
    content: str | None = None  # fixed reply text (chat and completions) instead of the generated "w1000 w1001 ..."
    text_finish: str = "length"  # a chat text answer's finish_reason ("stop": as a model that ended its reply)
    reasoning: str | None = None  # chat answers carry this as `reasoning` (streamed word by word, before the text)
    wake_status: int = 200  # POST /wake_up answers this (non-200: a wake that failed; the engine keeps sleeping)
    models_status: int = 200  # GET /v1/models answers this (non-200: an OpenAI-style error, e.g. a dying engine's 503)
    # A scripted conversation: before each chat request, the first of these is taken off and its fields set on
    # this script (e.g. [{"tool_name": "exec_command", "tool_arguments": ...}, {"tool_arguments": None, ...}])
    then: list[dict] = field(default_factory=list)


class ScriptedEngine:
    def __init__(self, script: Script | None = None):
        self.script = script or Script()
        self.requests: list[dict] = []  # bodies received, newest last
        self.authorizations: list[str | None] = []  # each request's Authorization header, same order
        self.headers: list[dict[str, str]] = []  # each request's headers, same order
        self.models_headers: list[dict[str, str]] = []  # each GET /v1/models's headers
        self.targets: list[str] = []  # every request's path and query string as they arrived (chat, models, dev
        # routes...); "METHOD " before dev routes' paths, e.g. "POST /sleep?level=1"
        self.cancelled = 0  # requests whose client went away before the answer ended
        self.sleep_level = 0  # 0: awake; else the level of the POST /sleep it sleeps at
        self.refused_asleep: list[str] = []  # requests refused because it was asleep (generation, reloads)
        self.adapters: set[str] = set()  # LoRA adapters loaded (/v1/load_lora_adapter) and not unloaded since
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self._chat)
        self.app.router.add_post("/v1/completions", self._completions)
        self.app.router.add_post("/openai/deployments/{deployment}/chat/completions", self._chat)  # Azure's URLs
        self.app.router.add_post("/openai/deployments/{deployment}/completions", self._completions)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_post("/sleep", self._sleep)
        self.app.router.add_post("/wake_up", self._wake_up)
        self.app.router.add_get("/is_sleeping", self._is_sleeping)
        for route in ("/pause", "/resume", "/reset_prefix_cache", "/collective_rpc", "/v1/load_lora_adapter",
                      "/v1/unload_lora_adapter"):
            self.app.router.add_post(route, self._weights_route)
        self._runner: web.AppRunner | None = None
        self.url: str | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok") if self.script.healthy else web.Response(status=503, text="dying")

    async def _sleep(self, request: web.Request) -> web.Response:
        self.targets.append(f"POST {request.raw_path}")
        level = int(request.query.get("level", "1"))
        if level not in (0, 1, 2):
            return _error(422, f"level must be 0, 1 or 2, got {level}")
        self.sleep_level = level or self.sleep_level
        return web.json_response({"status": "sleeping", "level": level})

    async def _wake_up(self, request: web.Request) -> web.Response:
        self.targets.append(f"POST {request.raw_path}")
        if self.script.wake_status != 200:
            return _error(self.script.wake_status, "scripted wake-up failure")
        self.sleep_level = 0
        return web.json_response({"status": "awake", "tags": None})

    async def _is_sleeping(self, request: web.Request) -> web.Response:
        self.targets.append(f"GET {request.raw_path}")
        return web.json_response({"is_sleeping": self.sleep_level > 0})

    async def _weights_route(self, request: web.Request) -> web.Response:
        self.targets.append(f"POST {request.raw_path}")
        if self.sleep_level and request.path in ("/collective_rpc", "/v1/load_lora_adapter"):
            self.refused_asleep.append(request.raw_path)
            return _error(503, "the engine is sleeping: wake it up before loading weights")
        if request.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            try:
                name = orjson.loads(await request.read()).get("lora_name")
            except (orjson.JSONDecodeError, AttributeError):  # accepted all the same, as before
                name = None
            if isinstance(name, str) and request.path == "/v1/load_lora_adapter":
                self.adapters.add(name)
            elif isinstance(name, str):
                self.adapters.discard(name)
        return web.json_response({"success": True} if request.path == "/reset_prefix_cache" else {})

    async def _models(self, request: web.Request) -> web.Response:
        self.models_headers.append(dict(request.headers))
        self.targets.append(request.raw_path)
        if self.script.models_status != 200:
            return _error(self.script.models_status, "scripted /v1/models failure")
        card = {"id": self.script.model, "object": "model", "owned_by": "scripted"}
        if self.script.max_model_len is not None:
            card["max_model_len"] = self.script.max_model_len
        data = {"object": "list", "data": [card]}
        return web.json_response(data)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=False)

    async def _answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.requests.append(body)
        self.authorizations.append(request.headers.get("Authorization"))
        self.headers.append(dict(request.headers))
        self.targets.append(request.raw_path)
        s = self.script
        if chat and s.then:
            for key, value in s.then.pop(0).items():
                setattr(s, key, value)
        if self.sleep_level:
            self.refused_asleep.append(request.raw_path)
            return _error(503, "the engine is sleeping")
        if s.delay_s:
            await asyncio.sleep(s.delay_s)
        if s.status != 200:
            err = {"error": {"message": f"scripted failure {s.status}", "type": "server_error", "code": s.status}}
            return web.Response(body=orjson.dumps(err), status=s.status, content_type="application/json")
        n = body.get("n") or 1
        if not isinstance(n, int) or not 1 <= n <= MAX_N:  # as an engine refuses what it cannot hold
            err = {"error": {"message": f"n must be an integer from 1 to {MAX_N}, got {n!r}",
                             "type": "BadRequestError", "param": "n", "code": 400}}
            return web.Response(body=orjson.dumps(err), status=400, content_type="application/json")
        prompt_ids = list(range(100, 100 + s.prompt_tokens))
        ids = [1000 + i for i in range(s.completion_tokens)]
        try:
            if body.get("stream"):
                return await self._stream(request, body, chat, n, prompt_ids, ids)
            return web.Response(body=orjson.dumps(self._full(body, chat, n, prompt_ids, ids)),
                                content_type="application/json")
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    def _full(self, body: dict, chat: bool, n: int, prompt_ids: list[int], ids: list[int]) -> dict:
        choices = []
        for i in range(n):
            text = "".join(f"w{t} " for t in ids) if self.script.content is None else self.script.content
            if chat:
                lp = {"content": [{"token": f"w{t} ", "logprob": -0.5, "bytes": None, "top_logprobs": []}
                                  for t in ids]}
                calls = []
                if self.script.tool_arguments is not None:
                    text = None
                    calls = [{"id": f"call_{len(self.requests)}_{i}", "type": "function",
                              "function": {"name": self.script.tool_name,
                                           "arguments": self.script.tool_arguments}}]
                message = {"role": "assistant", "content": text, "tool_calls": calls}
                if self.script.reasoning is not None:
                    message["reasoning"] = self.script.reasoning
                choice = {"index": i, "message": message,
                          "logprobs": lp if body.get("logprobs") else None,
                          "finish_reason": "tool_calls" if calls else self.script.text_finish, "stop_reason": None,
                          "token_ids": ids}
            else:
                lp = {"text_offset": list(range(len(ids))), "token_logprobs": [-0.5] * len(ids),
                      "tokens": [f"w{t} " for t in ids], "top_logprobs": None}
                choice = {"index": i, "text": text, "logprobs": lp if body.get("logprobs") is not None else None,
                          "finish_reason": "length", "stop_reason": None, "prompt_token_ids": prompt_ids,
                          "token_ids": ids}
            choices.append(choice)
        if not self.script.token_ids:
            for choice in choices:
                choice.pop("token_ids"), choice.pop("prompt_token_ids", None)
        out = {"id": "scripted-1", "object": "chat.completion" if chat else "text_completion",
               "created": int(time.time()), "model": self._model(body), "choices": choices,
               "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": n * len(ids),
                         "total_tokens": len(prompt_ids) + n * len(ids)}}
        if chat and self.script.token_ids:
            out["prompt_token_ids"] = prompt_ids
        return out

    async def _stream(self, request, body, chat, n, prompt_ids, ids) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        s = self.script
        sent = 0
        base = {"id": "scripted-1", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self._model(body)}
        for i in range(n):
            if chat:
                first = dict(base, choices=[{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None, "token_ids": []}])
                if i == 0 and s.token_ids:
                    first["prompt_token_ids"] = prompt_ids
                elif not s.token_ids:
                    first["choices"][0].pop("token_ids")
                await resp.write(b"data: " + orjson.dumps(first) + b"\n\n")
        for piece in re.findall(r"\S+\s*", s.reasoning or "") if chat else ():
            for i in range(n):
                choice = {"index": i, "delta": {"reasoning": piece}, "logprobs": None, "finish_reason": None}
                if s.token_ids:
                    choice["token_ids"] = []
                await resp.write(b"data: " + orjson.dumps(dict(base, choices=[choice])) + b"\n\n")
        for pos, t in enumerate(ids):
            for i in range(n):
                last = pos == len(ids) - 1
                if chat:
                    lp = {"content": [{"token": f"w{t} ", "logprob": -0.5, "bytes": None, "top_logprobs": []}]}
                    choice = {"index": i, "delta": self._delta(pos, t, len(ids)), "token_ids": [t],
                              "logprobs": lp if body.get("logprobs") else None,
                              "finish_reason": ("tool_calls" if s.tool_arguments is not None else s.text_finish)
                              if last else None}
                else:
                    lp = {"text_offset": [pos], "token_logprobs": [-0.5], "tokens": [f"w{t} "], "top_logprobs": None}
                    text = f"w{t} " if s.content is None else (s.content if pos == 0 else "")
                    choice = {"index": i, "text": text, "token_ids": [t],
                              "logprobs": lp if body.get("logprobs") is not None else None,
                              "finish_reason": "length" if last else None}
                    if pos == 0:
                        choice["prompt_token_ids"] = prompt_ids
                if not s.token_ids:
                    choice.pop("token_ids"), choice.pop("prompt_token_ids", None)
                await resp.write(b"data: " + orjson.dumps(dict(base, choices=[choice])) + b"\n\n")
                sent += 1
                if s.break_stream_after is not None and sent >= s.break_stream_after:
                    request.transport.close()
                    return resp
            if s.chunk_delay_s:
                await asyncio.sleep(s.chunk_delay_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": n * len(ids),
                     "total_tokens": len(prompt_ids) + n * len(ids)}
            await resp.write(b"data: " + orjson.dumps(dict(base, choices=[], usage=usage)) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        if s.linger_after_done_s:
            await asyncio.sleep(s.linger_after_done_s)
        await resp.write_eof()
        return resp

    def _model(self, body: dict) -> str:
        """The model an answer names: the adapter the request asked for when one is loaded, else the base."""
        asked = body.get("model")
        return asked if asked in self.adapters else self.script.model

    def _delta(self, pos: int, token: int, count: int) -> dict:
        """Text, or a tool call streamed the way vLLM does: id and name first, then the arguments in pieces."""
        args = self.script.tool_arguments
        if args is None and self.script.content is not None:
            return {"content": self.script.content} if pos == 0 else {}
        if args is None:
            return {"content": f"w{token} "}
        if pos == 0:
            return {"tool_calls": [{"index": 0, "id": f"call_{len(self.requests)}_0", "type": "function",
                                    "function": {"name": self.script.tool_name, "arguments": ""}}]}
        piece = -(-len(args) // max(count - 1, 1))
        part = args[(pos - 1) * piece: pos * piece]
        return {"tool_calls": [{"index": 0, "function": {"arguments": part}}]} if part else {}


def _error(status: int, message: str) -> web.Response:
    err = {"error": {"message": message, "type": "server_error", "code": status}}
    return web.Response(body=orjson.dumps(err), status=status, content_type="application/json")
