"""An OpenAI-compatible engine over a token-in, token-out `generate` function.

When the policy is served by someone else's rollout servers (verl's `server_manager.generate`, adapters/verl_loop.py),
the recording proxy still needs an engine that speaks vLLM's HTTP dialect: chat and completions with token ids and
logprobs, `/tokenize` for token-exact continuity, `/health`. This is that engine, and nothing more: the prompt is
rendered here with the model's own tokenizer and chat template (as vLLM renders it), the tokens come from
`generate`, the answer goes back in exactly the shape vLLM sends with `return_token_ids` (chat answers through
proxy/chat_answer.py, as the proxy's own token-exact path does).

    agent -> recording proxy -> TokenEngine -> generate(prompt_ids, sampling) -> verl's vLLM servers

A stream is sent as one chunk with the whole answer: the tokens exist only when `generate` returns.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
from aiohttp import web

from proxy.chat_answer import ChatAnswer
from proxy.http_json import ApiError, error_body, json_response, parse_json_object
from proxy.parsing import reply_parsing
from proxy.upstreams import EPISODE_HEADER


@dataclass(frozen=True)
class Generated:
    """What one `generate` call gave back."""

    token_ids: list[int]
    logprobs: list[float] | None  # one per token, when asked for
    aborted: bool = False  # the rollout server dropped the request (e.g. paused for a weight update)


# (prompt ids, sampling params as vLLM's SamplingParams takes them, the episode id or None) -> the generated tokens.
# The episode id comes from the proxy's X-Harness-Episode header: a rollout server's sticky routing keeps an
# episode's calls on one server, where its prefix is cached.
Generate = Callable[[list[int], dict, str | None], Awaitable[Generated]]

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "skip_special_tokens")


class RequestError(ValueError):
    """A request this engine cannot serve; answered as an OpenAI-style 400."""


class TokenEngine:
    """Serve `generate` as an OpenAI-compatible engine on 127.0.0.1 (a random port unless one is given)."""

    def __init__(self, generate: Generate, tokenizer, *, model: str, max_model_len: int,
                 tool_parser: str = "hermes", reasoning_parser: str | None = None, stop_ids: tuple[int, ...] = ()):
        self.generate = generate
        self.tokenizer = tokenizer
        self.model = model
        self.max_model_len = max_model_len
        # vLLM's own parsers on the tokenizer's model (its directory or Hub id), as the engine's chat endpoint has
        self.parsing_model = getattr(tokenizer, "name_or_path", None) or None
        self.parsing = reply_parsing(tool_parser, reasoning_parser, self.parsing_model)
        eos = tokenizer.eos_token_id
        self.stop_ids = frozenset((*stop_ids, *([eos] if isinstance(eos, int) else eos or ())))
        self._runner: web.AppRunner | None = None
        self.base_url: str | None = None

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on the running loop; returns the base URL (without /v1)."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]
        self.base_url = f"http://{host}:{bound}"
        return self.base_url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- endpoints --------------------------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "harness",
                                                  "max_model_len": self.max_model_len}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await _body(request)
        try:
            ids = self.render(body) if "messages" in body else self._encode_prompt(body.get("prompt"), body)
        except RequestError as exc:
            return _error(400, str(exc))
        return json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        try:
            prompt = self._encode_prompt(body.get("prompt"), body)
            answer = await self._answer(request, prompt, body, body.get("logprobs") is not None)
        except RequestError as exc:
            return _error(400, str(exc))
        return await self._send(request, body, answer, None)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        try:
            prompt = self.render({**body, "add_generation_prompt": body.get("add_generation_prompt", True)})
            answer = await self._answer(request, prompt, body, bool(body.get("logprobs")))
        except RequestError as exc:
            return _error(400, str(exc))
        chat = ChatAnswer(self.parsing.request(body), int(body.get("top_logprobs") or 0),
                          parallel_tool_calls=body.get("parallel_tool_calls") is not False)
        return await self._send(request, body, answer, chat)

    # ---- rendering --------------------------------------------------------------------------------------------
    def render(self, body: dict) -> list[int]:
        """The prompt ids of a chat request, rendered as vLLM's chat endpoint renders them: the template's text,
        tokenized without special tokens."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(f"'messages' must be a non-empty list, got {type(messages).__name__}")
        kwargs = dict(body.get("chat_template_kwargs") or {})
        try:
            text = self.tokenizer.apply_chat_template(
                [_template_message(m) for m in messages], tools=body.get("tools") or None, tokenize=False,
                add_generation_prompt=body.get("add_generation_prompt", True) is not False, **kwargs)
        except Exception as exc:  # the template's own error (e.g. roles out of order)
            raise RequestError(f"the chat template could not render these messages: {exc}") from exc
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _encode_prompt(self, prompt, body: dict) -> list[int]:
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=body.get("add_special_tokens", True) is not False)
        raise RequestError("'prompt' must be a string or a list of token ids (one prompt per request)")

    # ---- generation -------------------------------------------------------------------------------------------
    async def _answer(self, request: web.Request, prompt: list[int], body: dict, logprobs: bool) -> dict:
        """Generate `n` choices and build the completions answer vLLM would send (token ids included)."""
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise RequestError(f"the prompt has {len(prompt)} tokens: no room left in max_model_len "
                               f"{self.max_model_len}")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or room
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        max_tokens = min(max_tokens, room)
        sampling = {k: body[k] for k in _SAMPLING_KEYS if body.get(k) is not None}
        sampling.update(max_tokens=max_tokens, logprobs=logprobs)
        n = body.get("n") or 1
        episode = request.headers.get(EPISODE_HEADER)
        outs = await asyncio.gather(*(self.generate(list(prompt), dict(sampling), episode) for _ in range(n)))
        skip_special = body.get("skip_special_tokens", True) is not False
        choices = [self._choice(k, out, max_tokens, skip_special, body.get("stop"), prompt if k == 0 else None)
                   for k, out in enumerate(outs)]
        completion_tokens = sum(len(o.token_ids) for o in outs)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": body.get("model") or self.model, "choices": choices,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
                          "total_tokens": len(prompt) + completion_tokens}}

    def _choice(self, index: int, out: Generated, max_tokens: int, skip_special: bool, stop, prompt) -> dict:
        ids = list(out.token_ids)
        ended_on_stop_id = bool(ids) and ids[-1] in self.stop_ids
        finish = "abort" if out.aborted else "length" if len(ids) >= max_tokens and not ended_on_stop_id else "stop"
        text = self.tokenizer.decode(ids[:-1] if ended_on_stop_id else ids, skip_special_tokens=skip_special)
        for s in ([stop] if isinstance(stop, str) else stop or ()):
            if finish == "stop" and s and s in text:
                text = text[:text.index(s)]
        lp = None
        if out.logprobs is not None:
            lp = {"tokens": [self.tokenizer.decode([t]) for t in ids], "token_logprobs": list(out.logprobs),
                  "top_logprobs": None, "text_offset": None}
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish,
                "stop_reason": ids[-1] if ended_on_stop_id else None, "token_ids": ids,
                "prompt_token_ids": prompt}

    async def _send(self, request: web.Request, body: dict, answer: dict, chat: ChatAnswer | None):
        if not body.get("stream"):
            return json_response(chat.response(answer) if chat is not None else answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        usage = answer.pop("usage")
        with_usage = (body.get("stream_options") or {}).get("include_usage")
        chunk = {**answer, "usage": usage if with_usage else None}
        events = chat.chunk(chunk) if chat is not None else [chunk]
        for event in events:
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _template_message(message: dict) -> dict:
    """A chat message as vLLM hands it to the template: text parts joined, tool-call arguments as objects."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    calls = out.get("tool_calls")
    if calls:
        fixed = []
        for call in calls:
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
            fixed.append({**call, "function": fn})
        out["tool_calls"] = fixed
    return out


async def _body(request: web.Request) -> dict:
    """The request as a JSON object (proxy/http_json.py's parse: the same checks the proxy makes), else a 400."""
    try:
        return parse_json_object(await request.read())
    except ApiError as exc:
        raise web.HTTPBadRequest(body=orjson.dumps(error_body(400, exc.message)),
                                 content_type="application/json") from None


def _error(status: int, message: str) -> web.Response:
    return json_response(error_body(status, message), status=status)
