"""A /v1/completions answer (token-exact continuity, proxy/continuity.py) turned into the chat answer the agent
asked for, in exactly the shape vLLM's chat endpoint sends with token ids and logprobs on; proxy/forward.py then
records it and strips what the agent did not ask for, as for any chat call.

The generated text becomes a message with the model's reply parsing (proxy/parsing/native.py: reasoning, content,
tool calls), whole or piece by piece as the stream comes, as vLLM's chat endpoint sends it.
"""

from __future__ import annotations

from proxy.parsing.native import ChoiceStream, RequestParsing


def _chat_id(completion_id: str | None) -> str:
    return "chatcmpl-" + (completion_id or "").removeprefix("cmpl-")


class ChatAnswer:
    """Translate one completions answer (whole, or chunk by chunk) into chat form."""

    def __init__(self, parsing: RequestParsing, top_logprobs: int = 0, parallel_tool_calls: bool = True):
        self.parsing = parsing
        self.top_logprobs = top_logprobs
        self.parallel_tool_calls = parallel_tool_calls  # False: only the first tool call, as vLLM does
        self._streams: dict[int, ChoiceStream] = {}
        self._streamed_calls: set[int] = set()  # choices that have sent tool calls
        self._prompt_ids: list[int] | None = None
        self._ids: dict[int, list[int]] = {}  # each streamed choice's ids so far, for the reasoning count

    # ---- a whole answer -------------------------------------------------------------------------------------
    def response(self, obj: dict) -> dict:
        choices, prompt_ids = [], None
        for ch in obj.get("choices") or ():
            prompt_ids = prompt_ids or ch.get("prompt_token_ids")
            parsed = self.parsing.whole(ch.get("text") or "", ch.get("token_ids") or [], prompt_ids)
            tool_calls = list(parsed.tool_calls) if self.parallel_tool_calls else list(parsed.tool_calls[:1])
            choices.append({
                "index": ch.get("index", 0),
                "message": {"role": "assistant", "content": parsed.content, "refusal": None, "annotations": None,
                            "audio": None, "function_call": None, "tool_calls": tool_calls,
                            "reasoning": parsed.reasoning},
                "logprobs": self._logprobs(ch.get("logprobs")),
                "finish_reason": ("tool_calls" if tool_calls and self.parsing.calls_finish
                                  else ch.get("finish_reason") or "stop"),
                "stop_reason": ch.get("stop_reason"),
                "token_ids": ch.get("token_ids"),
            })
        usage = self._usage(obj.get("usage"), [ch.get("token_ids") or [] for ch in obj.get("choices") or ()])
        return {"id": _chat_id(obj.get("id")), "object": "chat.completion", "created": obj.get("created"),
                "model": obj.get("model"), "choices": choices, "usage": usage, "prompt_token_ids": prompt_ids}

    def _usage(self, usage: dict | None, replies: list[list[int]]) -> dict | None:
        """The completions usage, with the reasoning tokens counted as the chat endpoint counts them."""
        counts = [self.parsing.reasoning_tokens(ids) for ids in replies]
        if usage is None or not counts or counts[0] is None:
            return usage
        details = {**(usage.get("completion_tokens_details") or {}), "reasoning_tokens": sum(counts)}
        return {**usage, "completion_tokens_details": details}

    # ---- a stream -------------------------------------------------------------------------------------------
    def chunk(self, chunk: dict) -> list[dict]:
        """One completions stream chunk -> the chat chunks vLLM would have sent (possibly with empty deltas)."""
        head = {"id": _chat_id(chunk.get("id")), "object": "chat.completion.chunk", "created": chunk.get("created"),
                "model": chunk.get("model")}
        out = []
        choices = []
        for ch in chunk.get("choices") or ():
            index = ch.get("index", 0)
            stream = self._streams.get(index)
            if stream is None:
                self._prompt_ids = self._prompt_ids or ch.get("prompt_token_ids")
                stream = self._streams[index] = self.parsing.stream(self._prompt_ids)
                out.append({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}],
                            "prompt_token_ids": ch.get("prompt_token_ids")})
            finish = ch.get("finish_reason")
            self._ids.setdefault(index, []).extend(ch.get("token_ids") or ())
            delta = stream.delta(ch.get("text") or "", ch.get("token_ids") or [], finish is not None) or {}
            if delta.get("tool_calls"):
                if not self.parallel_tool_calls:
                    delta["tool_calls"] = [c for c in delta["tool_calls"] if c.get("index") == 0]
                self._streamed_calls.add(index)
            if finish == "stop" and index in self._streamed_calls and self.parsing.calls_finish:
                finish = "tool_calls"
            choices.append({"index": index, "delta": delta, "logprobs": self._logprobs(ch.get("logprobs")),
                            "finish_reason": finish, "token_ids": ch.get("token_ids")})
        if choices:
            out.append({**head, "choices": choices})
        if chunk.get("usage"):
            out.append({**head, "choices": [], "usage": self._usage(chunk["usage"], list(self._ids.values()))})
        return out

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
