"""Anthropic Messages (`POST /v1/messages`), served as a chat-completions call (see proxy/wire/common.py).

Offered: `system` (a string or text blocks), `messages` with string or block content (text, image, tool_use,
tool_result with string or text-block content; an assistant's thinking blocks become its `reasoning`,
redacted_thinking blocks are skipped; a `system` message among them, as Claude Code sends one each turn, stays a
system message where it stands), `tools` (name, description, input_schema), `tool_choice` (auto, any, tool,
none; disable_parallel_tool_use), `max_tokens` (required), `stop_sequences`, `temperature`, `top_p`, `top_k`,
`output_config.format` (json_schema), `stream`. `metadata`, `thinking`, `cache_control`, `service_tier` and the
like are accepted and ignored. Server tools (web search, code execution, computer use...), MCP servers and
containers are a 400 naming them. The answer: a thinking block (signature "") when the engine's answer has reasoning (a
reasoning parser split it out), then text and tool_use blocks (input parsed from the JSON arguments),
stop_reason end_turn / max_tokens / tool_use / stop_sequence, usage; streamed as Anthropic streams it, with
`event:` lines. Errors have Anthropic's shape: {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import orjson

from proxy.wire.common import (
    ENGINE_EXTRAS,
    Wire,
    bad,
    check,
    new_id,
    not_offered,
    parse_arguments,
    reasoning_of,
    short,
    sse,
)

MESSAGES = "messages"
_SKIPPED_BLOCKS = ("thinking", "redacted_thinking")  # thinking: an assistant's becomes its reasoning
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


# ---------------------------------------------------------------------------------------------------------------
# The request.
# ---------------------------------------------------------------------------------------------------------------


def _text_blocks(blocks, where: str) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad(where, f"must be a string or a list of text blocks, got {short(blocks)}")
    texts = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            if kind in ("image", "document", "search_result"):
                raise not_offered(f"{where}[{j}]", f"'{kind}' blocks are not offered here: text blocks only")
            raise bad(f"{where}[{j}]", f"must be a text block, got {short(block)}")
        texts.append(check(block.get("text"), (str,), f"{where}[{j}].text", "a string", required=True))
    return "\n".join(texts)


def _image(block: dict, where: str) -> dict:
    source = check(block.get("source"), (dict,), f"{where}.source", "an object", required=True)
    if source.get("type") == "url":
        url = check(source.get("url"), (str,), f"{where}.source.url", "a string", required=True)
    elif source.get("type") == "base64":
        data = check(source.get("data"), (str,), f"{where}.source.data", "a string", required=True)
        url = f"data:{source.get('media_type') or 'image/jpeg'};base64,{data}"
    else:
        raise not_offered(f"{where}.source", f"image sources of type {short(source.get('type'))} are not offered: "
                          "base64 or url")
    return {"type": "image_url", "image_url": {"url": url}}


def _message(message, i: int) -> list[dict]:
    """One Anthropic message -> chat messages: tool results become tool messages (before the user's own text, as
    vLLM orders them), an assistant's tool_use blocks its tool_calls."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise bad(where, f"must be a message object, got {short(message)}")
    role = message.get("role")
    if role == "system":  # a system message mid-conversation (Claude Code's environment, each turn): as it stands
        return [{"role": "system", "content": _text_blocks(message.get("content"), f"{where}.content")}]
    if role not in ("user", "assistant"):
        raise bad(f"{where}.role", f"must be user, assistant or system, got {short(role)}")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content", f"must be a string or a list of content blocks, got {short(content)}")
    out, parts, calls, thinking = [], [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": check(block.get("text"), (str,), f"{at}.text", "a string",
                                                        required=True)})
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind == "tool_use" and role == "assistant":
            args = check(block.get("input"), (dict,), f"{at}.input", "an object") or {}
            calls.append({"id": check(block.get("id"), (str,), f"{at}.id", "a string", required=True),
                          "type": "function",
                          "function": {"name": check(block.get("name"), (str,), f"{at}.name", "a string",
                                                     required=True),
                                       "arguments": orjson.dumps(args).decode()}})
        elif kind == "tool_result" and role == "user":
            result = block.get("content")
            out.append({"role": "tool",
                        "tool_call_id": check(block.get("tool_use_id"), (str,), f"{at}.tool_use_id", "a string",
                                              required=True),
                        "content": "" if result is None else _text_blocks(result, f"{at}.content")})
        elif kind == "thinking" and role == "assistant":
            thinking.append(check(block.get("thinking"), (str,), f"{at}.thinking", "a string", required=True))
        elif kind in _SKIPPED_BLOCKS:
            continue
        elif kind in ("tool_use", "tool_result"):
            raise bad(f"{at}.type", f"'{kind}' blocks belong in {'assistant' if kind == 'tool_use' else 'user'} "
                      "messages")
        elif isinstance(kind, str) and (kind in ("document", "search_result", "container_upload")
                                        or kind.endswith(("tool_use", "tool_result"))):
            raise not_offered(at, f"'{kind}' blocks are not offered by this proxy")
        else:
            raise bad(f"{at}.type", f"must be text, image, tool_use or tool_result, got {short(kind)}")
    if role == "assistant":
        text = "".join(p["text"] for p in parts if p["type"] == "text")
        if any(p["type"] != "text" for p in parts):
            raise bad(f"{where}.content", "of an assistant message must be text and tool_use blocks")
        reply = {"role": "assistant", "content": text or (None if calls else "")}
        if any(thinking):  # rendered where the chat template renders earlier reasoning; continuity ignores it
            reply["reasoning"] = "\n\n".join(t for t in thinking if t)
        if calls:
            reply["tool_calls"] = calls
        return [reply]
    if parts:
        single = len(parts) == 1 and parts[0]["type"] == "text"
        out.append({"role": "user", "content": parts[0]["text"] if single else parts})
    return out


def _tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools", f"must be a list of tool objects, got {short(tools)}")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad(f"tools[{i}]", f"must be a tool object, got {short(tool)}")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise not_offered(f"tools[{i}]", f"server tool '{kind}' is not offered: the proxy serves client tools "
                              "(name, description, input_schema) only")
        fn = {"name": check(tool.get("name"), (str,), f"tools[{i}].name", "a string", required=True),
              "parameters": check(tool.get("input_schema"), (dict,), f"tools[{i}].input_schema", "an object",
                                  required=True)}
        if tool.get("description") is not None:
            fn["description"] = check(tool["description"], (str,), f"tools[{i}].description", "a string")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice, chat: dict) -> None:
    if choice is None:
        return
    kind = check(choice, (dict,), "tool_choice", "an object").get("type")
    if kind in ("auto", "none"):
        chat["tool_choice"] = kind
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "tool":
        name = check(choice.get("name"), (str,), "tool_choice.name", "a string", required=True)
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise bad("tool_choice.type", f"must be auto, any, tool or none, got {short(kind)}")
    if check(choice.get("disable_parallel_tool_use"), (bool,), "tool_choice.disable_parallel_tool_use",
             "a boolean"):
        chat["parallel_tool_calls"] = False


def to_chat(body: dict) -> dict:
    """An Anthropic Messages request -> the chat request."""
    tokens = check(body.get("max_tokens"), (int,), "max_tokens", "an integer", required=True)
    if tokens < 1:
        raise bad("max_tokens", f"must be at least 1, got {tokens}")
    for key in ("mcp_servers", "container"):
        if body.get(key):
            raise not_offered(key, f"'{key}' is not offered by this proxy")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of message objects")
    chat_messages = []
    if body.get("system") is not None:
        system = _text_blocks(body["system"], "system")
        if system:
            chat_messages.append({"role": "system", "content": system})
    for i, message in enumerate(messages):
        chat_messages += _message(message, i)
    chat: dict = {"messages": chat_messages, "max_tokens": tokens}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    _tool_choice(body.get("tool_choice"), chat)
    stops = check(body.get("stop_sequences"), (list,), "stop_sequences", "a list of strings")
    if stops:
        for k, stop in enumerate(stops):
            check(stop, (str,), f"stop_sequences[{k}]", "a string", required=True)
        chat["stop"] = stops
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("top_k") is not None:
        chat["top_k"] = check(body["top_k"], (int,), "top_k", "an integer")
    fmt = (check(body.get("output_config"), (dict,), "output_config", "an object") or {}).get("format")
    if fmt is not None:
        if check(fmt, (dict,), "output_config.format", "an object").get("type") != "json_schema":
            raise bad("output_config.format.type", f"must be json_schema, got {short(fmt.get('type'))}")
        schema = check(fmt.get("schema"), (dict,), "output_config.format.schema", "an object", required=True)
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    if check(body.get("stream"), (bool,), "stream", "a boolean"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    for key in ENGINE_EXTRAS:
        if body.get(key) is not None and key not in chat:
            chat[key] = body[key]
    return chat


# ---------------------------------------------------------------------------------------------------------------
# The answer.
# ---------------------------------------------------------------------------------------------------------------


def _stop_reason(finish: str | None, stop_reason, stops: list, tool_used: bool) -> tuple[str | None, str | None]:
    """Chat finish_reason (+ vLLM's stop_reason: the stop string matched) -> Anthropic stop_reason, stop_sequence."""
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str) and stop_reason in stops:
        return "stop_sequence", stop_reason
    if finish == "tool_calls" or tool_used:
        return "tool_use", None
    return ("end_turn", None) if finish is not None else (None, None)


class MessagesWire(Wire):
    name = MESSAGES
    forwards_query = False  # Anthropic's own (the SDK's ?beta=true), nothing an OpenAI-compatible upstream knows

    def __init__(self):
        self.id = new_id("msg")
        self.model: str | None = None
        self.stops: list = []
        self._started = self._failed = False
        self._blocks = 0  # content blocks started
        self._open: str | None = None  # type of the block taking deltas ("thinking", "text", "tool_use")
        self._calls: dict[int, int] = {}  # chat tool-call index -> content block index
        self._finish: str | None = None
        self._stop_reason = None
        self._usage: dict | None = None
        self._prompt_tokens: int | None = None

    def to_chat(self, body: dict) -> dict:
        chat = to_chat(body)
        self.model, self.stops = body.get("model"), chat.get("stop") or []
        return chat

    def error_body(self, status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
        kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}

    def _usage_of(self, usage: dict | None) -> dict:
        usage = usage or {}
        prompt = usage.get("prompt_tokens", self._prompt_tokens)
        return {"input_tokens": prompt or 0, "output_tokens": usage.get("completion_tokens") or 0}

    # ---- a whole answer -------------------------------------------------------------------------------------
    def response(self, obj: dict) -> dict:
        choice = (obj.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        content = []
        if reasoning_of(message):
            content.append({"type": "thinking", "thinking": reasoning_of(message), "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or ():
            fn = call.get("function") or {}
            content.append({"type": "tool_use", "id": call.get("id") or new_id("toolu"),
                            "name": fn.get("name") or "", "input": parse_arguments(fn.get("arguments"))})
        if not content:
            content.append({"type": "text", "text": ""})  # Anthropic's shape of an empty answer
        reason, sequence = _stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), self.stops,
                                        bool(message.get("tool_calls")))
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model or obj.get("model"),
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": self._usage_of(obj.get("usage"))}

    # ---- a stream -------------------------------------------------------------------------------------------
    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": self._usage_of(None)}
        return [sse("message_start", {"type": "message_start", "message": message}), sse("ping", {"type": "ping"})]

    def _open_block(self, block: dict) -> list[bytes]:
        out = self._close()
        self._open = block["type"]
        out.append(sse("content_block_start", {"type": "content_block_start", "index": self._blocks,
                                               "content_block": block}))
        self._blocks += 1
        return out

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1})]

    def _delta(self, delta: dict) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self._blocks - 1, "delta": delta})

    def chunk(self, chunk: dict, prompt_tokens: int | None = None) -> bytes:
        if self._prompt_tokens is None:
            self._prompt_tokens = prompt_tokens
        out = self._start()
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if reasoning_of(delta):
                if self._open != "thinking":
                    out += self._open_block({"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": reasoning_of(delta)}))
            if delta.get("content"):
                if self._open != "text":
                    out += self._open_block({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                fn = call.get("function") or {}
                index = call.get("index", 0)
                if index not in self._calls:
                    out += self._open_block({"type": "tool_use", "id": call.get("id") or new_id("toolu"),
                                             "name": fn.get("name") or "", "input": {}})
                    self._calls[index] = self._blocks - 1
                if fn.get("arguments") and self._calls[index] == self._blocks - 1 and self._open == "tool_use":
                    out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
            if choice.get("finish_reason") is not None:
                self._finish, self._stop_reason = choice["finish_reason"], choice.get("stop_reason")
        return b"".join(out)

    def done(self) -> bytes:
        if self._failed:
            return b""
        out = self._start() + self._close()
        reason, sequence = _stop_reason(self._finish, self._stop_reason, self.stops, bool(self._calls))
        out.append(sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                         "usage": self._usage_of(self._usage)}))
        out.append(sse("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def error_event(self, message: str) -> bytes:
        self._failed = True
        return sse("error", self.error_body(500, message))
