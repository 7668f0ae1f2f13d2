"""The OpenAI Responses API (`POST /v1/responses`), served as a chat-completions call (see proxy/wire/common.py).

Offered: `input` as a string or a list of items (messages of role user / system / developer / assistant, with
string or text-part content; `function_call` and `function_call_output` items; a `reasoning` item becomes the
`reasoning` of the assistant message or function_call it precedes), `instructions`, `tools`, `tool_choice`,
`parallel_tool_calls`, `max_output_tokens`, `temperature`, `top_p`, `text.format` (json_object, json_schema),
`stream`, and `previous_response_id` over the proxy's memory of its latest responses. `store`, `metadata`,
`user`, `include`, `reasoning`, `truncation`, `prompt_cache_key`, `client_metadata` are accepted and ignored.

Tools as coding agents send them (Codex CLI: function, namespace, custom and hosted tools) are in
proxy/wire/responses_tools.py: hosted ones are left out of the prompt and recorded (`calls.extra.tools_left_out`),
or refused with `hosted_tools: refuse`. `background`, `conversation` and prompt templates are a 400 naming them.

Output: a `reasoning` item (reasoning_text) when the engine's answer has reasoning (a reasoning parser split it
out), then a `message` item (output_text) and `function_call` (or `custom_tool_call`) items; status `incomplete`
(reason `max_output_tokens`) when the engine stopped at the token limit. Streams end as OpenAI's do:
`response.completed`, or `response.incomplete` for an answer cut off at the token limit (the openai SDK's
`responses.stream(...).get_final_response()` then raises, as it does against OpenAI itself).
"""

from __future__ import annotations

import time

from proxy.http_json import ApiError
from proxy.wire.common import (
    ENGINE_EXTRAS,
    ConversationStore,
    Wire,
    bad,
    check,
    new_id,
    not_offered,
    reasoning_of,
    short,
    sse,
)
from proxy.wire.responses_tools import Tools, history_call, to_chat_tools

RESPONSES = "responses"
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


# ---------------------------------------------------------------------------------------------------------------
# The request.
# ---------------------------------------------------------------------------------------------------------------


def _text_of(parts: list, where: str) -> str | list:
    """Content parts -> a string when they are all text (assistant parts joined as the model wrote them)."""
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            text = part.get("refusal") if kind == "refusal" else part.get("text")
            out.append({"type": "text", "text": check(text, (str,), f"{where}[{j}].text", "a string", required=True)})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise not_offered(f"{where}[{j}]", "input_image parts are offered by URL (image_url) only, "
                                  "not by file_id")
            out.append({"type": "image_url", "image_url": {"url": url}})
        elif kind in ("input_file", "input_audio"):
            raise not_offered(f"{where}[{j}]", f"{kind} content parts are not offered by this proxy")
        else:
            raise bad(f"{where}[{j}]", f"must be a content part (input_text, output_text, input_image), "
                      f"got {short(part)}")
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out) if len(out) != 1 else out[0]["text"]
    return out


def _content(content, where: str):
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return _text_of(content, where)
    raise bad(where, f"must be a string or a list of content parts, got {short(content)}")


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary text ("" when it has neither, as an
    item with only encrypted_content has)."""
    for key, kind, joint in (("content", "reasoning_text", ""), ("summary", "summary_text", "\n\n")):
        texts = []
        for j, part in enumerate(check(item.get(key), (list,), f"{where}.{key}", "a list of parts") or ()):
            if not isinstance(part, dict) or part.get("type") != kind:
                raise bad(f"{where}.{key}[{j}]", f"must be a {kind} part, got {short(part)}")
            texts.append(check(part.get("text"), (str,), f"{where}.{key}[{j}].text", "a string", required=True))
        if any(texts):
            return joint.join(texts)
    return ""


def _add_reasoning(message: dict, reasoning: str | None) -> None:
    if reasoning:
        message["reasoning"] = f"{message['reasoning']}\n\n{reasoning}" if message.get("reasoning") else reasoning


def input_messages(items, field: str = "input") -> list[dict]:
    """Responses input (a string or a list of items) -> chat messages. An assistant message and the function
    calls that follow it become one assistant message with tool_calls, as a chat agent would send it; the
    reasoning items before them become its `reasoning` (rendered where the chat template renders earlier
    reasoning; token-exact continuity ignores it when matching). Reasoning followed by anything else is dropped."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad(field, f"must be a string or a list of input items, got {short(items)}")
    out: list[dict] = []
    pending: str | None = None  # the text of the reasoning items since the last other item
    for i, item in enumerate(items):
        where = f"{field}[{i}]"
        if not isinstance(item, dict):
            raise bad(where, f"must be an input item object, got {short(item)}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind != "reasoning":
            reasoning, pending = pending, None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad(f"{where}.role", f"must be user, system, developer or assistant, got {short(role)}")
            text = _content(item.get("content"), f"{where}.content")
            if role == "assistant" and isinstance(text, list):
                raise bad(f"{where}.content", "of an assistant message must be output_text parts")
            out.append({"role": "system" if role == "developer" else role, "content": text})
            if role == "assistant":
                _add_reasoning(out[-1], reasoning)
        elif kind in ("function_call", "custom_tool_call"):
            call = history_call(item, kind, where)
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": None})
            _add_reasoning(out[-1], reasoning)
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = check(item.get("call_id"), (str,), f"{where}.call_id", "a string", required=True)
            output = _content(item.get("output"), f"{where}.output")
            if isinstance(output, list):
                raise bad(f"{where}.output", "must be a string or text parts")
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if text:
                pending = f"{pending}\n\n{text}" if pending else text
        elif isinstance(kind, str) and (kind.endswith(("_call", "_call_output")) or kind.startswith("mcp_")
                                        or kind in ("item_reference", "compaction")):
            raise not_offered(where, f"'{kind}' items belong to built-in tools, which this proxy does not offer")
        else:
            raise bad(f"{where}.type", f"must be message, function_call, function_call_output or reasoning, "
                      f"got {short(kind)}")
    return out


def _tool_choice(choice):
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function":
        return {"type": "function",
                "function": {"name": check(choice.get("name"), (str,), "tool_choice.name", "a string", required=True)}}
    if isinstance(kind, str):
        raise not_offered("tool_choice", f"tool_choice of type '{kind}' is not offered: auto, none, required or "
                          "a function")
    raise bad("tool_choice", f"must be auto, none, required or {{'type': 'function', 'name': ...}}, "
              f"got {short(choice)}")


def _response_format(text) -> dict | None:
    if text is None:
        return None
    fmt = check(text, (dict,), "text", "an object").get("format")
    if fmt is None:
        return None
    kind = check(fmt, (dict,), "text.format", "an object").get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {"name": check(fmt.get("name"), (str,), "text.format.name", "a string", required=True),
                  "schema": check(fmt.get("schema"), (dict,), "text.format.schema", "an object", required=True)}
        for key in ("strict", "description"):
            if fmt.get(key) is not None:
                schema[key] = fmt[key]
        return {"type": "json_schema", "json_schema": schema}
    raise bad("text.format.type", f"must be text, json_object or json_schema, got {short(kind)}")


def to_chat(body: dict, history: list[dict] | None = None,
            hosted: str = "leave_out") -> tuple[dict, list[dict], Tools]:
    """A Responses request -> (the chat request, the conversation without instructions: what the answer extends,
    its tools). `history` is the conversation of `previous_response_id`; `hosted` what becomes of hosted tools."""
    if body.get("background"):
        raise not_offered("background", "background responses are not offered: ask without background")
    for key in ("conversation", "prompt"):
        if body.get(key) is not None:
            raise not_offered(key, f"'{key}' is not offered: send the input itself (or previous_response_id)")
    if body.get("input") in (None, "", []):
        raise bad("input", "is required: a string or a non-empty list of input items")
    instructions = body.get("instructions")
    if instructions is None or isinstance(instructions, str):
        system = [{"role": "system", "content": instructions}] if instructions else []
    else:
        system = input_messages(instructions, "instructions")
    conversation = [*(history or ()), *input_messages(body["input"])]
    chat: dict = {"messages": [*system, *conversation]}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    tools = to_chat_tools(body.get("tools"), hosted)
    if tools.chat:
        chat["tools"] = tools.chat
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
        if not tools.chat and chat["tool_choice"] in ("auto", "none"):
            del chat["tool_choice"]  # nothing to choose from (Codex's compaction request): chat engines refuse it
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = check(body["parallel_tool_calls"], (bool,), "parallel_tool_calls", "a boolean")
    if body.get("max_output_tokens") is not None:
        tokens = check(body["max_output_tokens"], (int,), "max_output_tokens", "an integer")
        if tokens < 1:
            raise bad("max_output_tokens", f"must be at least 1, got {tokens}")
        chat["max_tokens"] = tokens
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if check(body.get("stream"), (bool,), "stream", "a boolean"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    for key in ENGINE_EXTRAS:
        if body.get(key) is not None:
            chat[key] = body[key]
    return chat, conversation, tools


# ---------------------------------------------------------------------------------------------------------------
# The answer.
# ---------------------------------------------------------------------------------------------------------------


def _usage(usage: dict | None) -> dict | None:
    if not usage:
        return None
    prompt, completion = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    details = usage.get("completion_tokens_details")
    reasoning = details.get("reasoning_tokens") if isinstance(details, dict) else None  # the engine's own count
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning if isinstance(reasoning, int) else 0},
            "total_tokens": prompt + completion}


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class ResponsesWire(Wire):
    name = RESPONSES

    def __init__(self, store: ConversationStore, hosted_tools: str = "leave_out"):
        self.store = store
        self.hosted_tools = hosted_tools  # "leave_out" or "refuse" (ProxyConfig.hosted_tools)
        self.tools = Tools()
        self.id = new_id("resp")
        self.created = int(time.time())
        self.body: dict = {}
        self.conversation: list[dict] = []
        self._seq = 0
        self._started = self._failed = False
        self._items: list[dict] = []  # output items as streamed so far (open or closed)
        self._open: int | None = None  # index of the item still taking deltas
        self._calls: dict[int, int] = {}  # chat tool-call index -> output item index
        self._texts: dict[int, str] = {}  # output item index -> the text of a message or reasoning item so far
        self._finish: str | None = None
        self._usage: dict | None = None

    def to_chat(self, body: dict) -> dict:
        self.body = body
        previous = check(body.get("previous_response_id"), (str,), "previous_response_id", "a string")
        history = None
        if previous is not None:
            history = self.store.get(previous)
            if history is None:
                raise ApiError(400, f"previous_response_id '{previous}' is not known: this proxy remembers its latest "
                               f"{self.store.size} responses, in memory", param="previous_response_id",
                               code="previous_response_not_found")
        chat, self.conversation, self.tools = to_chat(body, history, self.hosted_tools)
        if self.tools.left_out:
            self.notes = {"tools_left_out": self.tools.left_out}
        return chat

    def _response(self, status: str, output: list[dict], usage: dict | None, **more) -> dict:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": None, "instructions": b.get("instructions"),
                "max_output_tokens": b.get("max_output_tokens"), "model": b.get("model"),
                "output": [self.tools.as_sent(item) for item in output],
                "parallel_tool_calls": b.get("parallel_tool_calls", True),
                "previous_response_id": b.get("previous_response_id"), "reasoning": None,
                "store": b.get("store", True), "temperature": b.get("temperature"),
                "text": b.get("text") or {"format": {"type": "text"}}, "tool_choice": b.get("tool_choice", "auto"),
                "tools": b.get("tools") or [], "top_p": b.get("top_p"), "truncation": "disabled", "usage": usage,
                "user": b.get("user"), "metadata": b.get("metadata") or {}, **more}

    def _finished(self, finish: str | None, output: list[dict], usage: dict | None) -> dict:
        """The closing Response; remembers the conversation for previous_response_id."""
        incomplete = finish == "length"
        text = "".join(c["text"] for item in output if item["type"] == "message" for c in item["content"])
        reasoning = "".join(c["text"] for item in output if item["type"] == "reasoning" for c in item["content"])
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in output if item["type"] == "function_call"]
        reply = {"role": "assistant", "content": text or None}
        if reasoning:  # as an agent echoing the reasoning item would send it
            reply["reasoning"] = reasoning
        if calls:
            reply["tool_calls"] = calls
        self.store.put(self.id, [*self.conversation, reply])
        return self._response("incomplete" if incomplete else "completed", output, _usage(usage),
                              incomplete_details={"reason": "max_output_tokens"} if incomplete else None)

    # ---- a whole answer -------------------------------------------------------------------------------------
    def response(self, obj: dict) -> dict:
        choice = (obj.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        finish = choice.get("finish_reason")
        status = "incomplete" if finish == "length" else "completed"
        output = []
        if reasoning_of(message):  # finished when more follows it, else cut off with the rest
            done = "completed" if message.get("content") or message.get("tool_calls") else status
            output.append(_reasoning_item(new_id("rs"), reasoning_of(message), done))
        if message.get("content"):
            output.append(_message_item(new_id("msg"), message["content"], status))
        for call in message.get("tool_calls") or ():
            fn = call.get("function") or {}
            output.append(_call_item(new_id("fc"), call.get("id") or new_id("call"), fn.get("name") or "",
                                     fn.get("arguments") or "", status))
        return self._finished(finish, output, obj.get("usage"))

    # ---- a stream -------------------------------------------------------------------------------------------
    def _event(self, kind: str, **data) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        return sse(kind, data)

    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        return [self._event("response.created", response=self._response("in_progress", [], None)),
                self._event("response.in_progress", response=self._response("in_progress", [], None))]

    def _add(self, item: dict) -> list[bytes]:
        out = self._close()
        self._open = len(self._items)
        self._items.append(item)
        out.append(self._event("response.output_item.added", output_index=self._open, item=self.tools.as_sent(item)))
        if item["type"] in ("message", "reasoning"):
            self._texts[self._open] = ""
            part = ({"type": "output_text", "text": "", "annotations": [], "logprobs": []} if item["type"] == "message"
                    else {"type": "reasoning_text", "text": ""})
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._open,
                                   content_index=0, part=part))
        return out

    def _close(self, status: str = "completed") -> list[bytes]:
        index, self._open = self._open, None
        if index is None:
            return []
        item = self._items[index]
        item["status"] = status
        out = []
        if item["type"] == "message":
            text = self._texts[index]
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text, logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part))
            item["content"] = [part]
        elif item["type"] == "reasoning":
            text = self._texts[index]
            part = {"type": "reasoning_text", "text": text}
            out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part))
            item["content"] = [part]
        elif item["name"] in self.tools.custom:
            out.append(self._event("response.custom_tool_call_input.done", item_id=item["id"], output_index=index,
                                   input=self.tools.as_sent(item)["input"]))
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=index, item=self.tools.as_sent(item)))
        return out

    def chunk(self, chunk: dict, prompt_tokens: int | None = None) -> bytes:
        out = self._start()
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if reasoning_of(delta):
                out += self._reasoning(reasoning_of(delta))
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._tool_call(call)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
        return b"".join(out)

    def _reasoning(self, text: str) -> list[bytes]:
        out = []
        if self._open is None or self._items[self._open]["type"] != "reasoning":
            out += self._add(_reasoning_item(new_id("rs"), "", "in_progress"))
        item = self._items[self._open]
        self._texts[self._open] += text
        out.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=self._open,
                               content_index=0, delta=text))
        return out

    def _text(self, text: str) -> list[bytes]:
        out = []
        if self._open is None or self._items[self._open]["type"] != "message":
            out += self._add(_message_item(new_id("msg"), "", "in_progress"))
        item = self._items[self._open]
        self._texts[self._open] += text
        out.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self._open,
                               content_index=0, delta=text, logprobs=[]))
        return out

    def _tool_call(self, call: dict) -> list[bytes]:
        fn = call.get("function") or {}
        out = []
        index = self._calls.get(call.get("index", 0))
        if index is None:
            out += self._add(_call_item(new_id("fc"), call.get("id") or new_id("call"), fn.get("name") or "",
                                        "", "in_progress"))
            index = self._calls[call.get("index", 0)] = self._open
        item = self._items[index]
        if fn.get("name") and not item["name"]:
            item["name"] = fn["name"]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            if index == self._open and item["name"] not in self.tools.custom:  # a custom input comes whole, at done
                out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=index, delta=fn["arguments"]))
        return out

    def done(self) -> bytes:
        if self._failed:
            return b""
        out = self._start()
        out += self._close("incomplete" if self._finish == "length" else "completed")
        final = self._finished(self._finish, self._items, self._usage)
        out.append(self._event(f"response.{final['status']}", response=final))  # as OpenAI: .incomplete when cut off
        return b"".join(out)

    def error_event(self, message: str) -> bytes:
        self._failed = True
        out = self._start()
        out.append(self._event("error", code="server_error", message=message, param=None))
        failed = self._response("failed", self._items, _usage(self._usage),
                                error={"code": "server_error", "message": message})
        out.append(self._event("response.failed", response=failed))
        return b"".join(out)
