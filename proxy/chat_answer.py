"""A /v1/completions answer (token-exact continuity, proxy/continuity.py) turned into the chat answer the agent
asked for, in exactly the shape vLLM's chat endpoint sends with token ids and logprobs on; proxy/forward.py then
records it and strips what the agent did not ask for, as for any chat call.

The generated text becomes a message with the model's tool-call parser (proxy/tool_parsers.py). Streamed, text is
sent as content as soon as it cannot be the start of a tool call; tool calls are sent whole when the choice ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.tool_parsers import ToolParser


def _chat_id(completion_id: str | None) -> str:
    return "chatcmpl-" + (completion_id or "").removeprefix("cmpl-")


@dataclass
class _StreamedChoice:
    text: str = ""
    sent: int = 0  # characters of `text` sent as content


class ChatAnswer:
    """Translate one completions answer (whole, or chunk by chunk) into chat form."""

    def __init__(self, parser: ToolParser | None, top_logprobs: int = 0, parallel_tool_calls: bool = True):
        self.parser = parser  # None: no tools offered (or tool_choice "none"): the text is the content
        self.top_logprobs = top_logprobs
        self.parallel_tool_calls = parallel_tool_calls  # False: only the first tool call, as vLLM does
        self._choices: dict[int, _StreamedChoice] = {}

    # ---- a whole answer -------------------------------------------------------------------------------------
    def response(self, obj: dict) -> dict:
        choices, prompt_ids = [], None
        for ch in obj.get("choices") or ():
            prompt_ids = prompt_ids or ch.get("prompt_token_ids")
            content, tool_calls, reasoning = self._parse(ch.get("text") or "")
            choices.append({
                "index": ch.get("index", 0),
                "message": {"role": "assistant", "content": content, "refusal": None, "annotations": None,
                            "audio": None, "function_call": None, "tool_calls": tool_calls, "reasoning": reasoning},
                "logprobs": self._logprobs(ch.get("logprobs")),
                "finish_reason": "tool_calls" if tool_calls else ch.get("finish_reason"),
                "stop_reason": ch.get("stop_reason"),
                "token_ids": ch.get("token_ids"),
            })
        return {"id": _chat_id(obj.get("id")), "object": "chat.completion", "created": obj.get("created"),
                "model": obj.get("model"), "choices": choices, "usage": obj.get("usage"),
                "prompt_token_ids": prompt_ids}

    def _parse(self, text: str) -> tuple[str | None, list[dict], str | None]:
        if self.parser is None:
            return text, [], None
        parsed = self.parser.parse(text)
        calls = list(parsed.tool_calls) if self.parallel_tool_calls else list(parsed.tool_calls[:1])
        return parsed.content, calls, parsed.reasoning

    # ---- a stream -------------------------------------------------------------------------------------------
    def chunk(self, chunk: dict) -> list[dict]:
        """One completions stream chunk -> the chat chunks vLLM would have sent (possibly with empty deltas)."""
        head = {"id": _chat_id(chunk.get("id")), "object": "chat.completion.chunk", "created": chunk.get("created"),
                "model": chunk.get("model")}
        out = []
        choices = []
        for ch in chunk.get("choices") or ():
            index = ch.get("index", 0)
            state = self._choices.get(index)
            if state is None:
                state = self._choices[index] = _StreamedChoice()
                out.append({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}],
                            "prompt_token_ids": ch.get("prompt_token_ids")})
            state.text += ch.get("text") or ""
            finish = ch.get("finish_reason")
            delta = self._final_delta(state) if finish is not None else self._content_delta(state)
            if delta.get("tool_calls"):
                finish = "tool_calls"
            choices.append({"index": index, "delta": delta, "logprobs": self._logprobs(ch.get("logprobs")),
                            "finish_reason": finish, "token_ids": ch.get("token_ids")})
        if choices:
            out.append({**head, "choices": choices})
        if chunk.get("usage"):
            out.append({**head, "choices": [], "usage": chunk["usage"]})
        return out

    def _content_delta(self, state: _StreamedChoice) -> dict:
        safe = self.parser.safe_prefix_len(state.text) if self.parser is not None else len(state.text)
        if safe <= state.sent:
            return {}
        delta = {"content": state.text[state.sent:safe]}
        state.sent = safe
        return delta

    def _final_delta(self, state: _StreamedChoice) -> dict:
        """The choice ended: parse everything it said; send what is left of the content, and the tool calls."""
        content, tool_calls, _ = self._parse(state.text)
        delta: dict = {}
        rest = (content or "")[state.sent:] if tool_calls else state.text[state.sent:]
        if rest:
            delta["content"] = rest
        if tool_calls:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(tool_calls)]
        state.sent = len(state.text)
        return delta

    # ---- logprobs -------------------------------------------------------------------------------------------
    def _logprobs(self, lp: dict | None) -> dict | None:
        """Completions logprobs (parallel lists) -> chat logprobs (one entry per token)."""
        if not lp or lp.get("token_logprobs") is None:
            return None
        tokens = lp.get("tokens") or []
        tops = lp.get("top_logprobs") or []
        content = []
        for k, (token, logprob) in enumerate(zip(tokens, lp["token_logprobs"], strict=False)):
            top = []
            if self.top_logprobs and k < len(tops) and tops[k]:
                ranked = sorted(tops[k].items(), key=lambda kv: kv[1], reverse=True)[:self.top_logprobs]
                top = [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in ranked]
            content.append({"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": top})
        return {"content": content}
