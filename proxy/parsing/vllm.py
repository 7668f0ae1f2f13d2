"""vLLM's own reply parsers, run in the proxy: a token-exact answer is split into reasoning, content and tool calls
by the very code the engine's chat endpoint runs (`vllm.parser`: `--tool-call-parser` and `--reasoning-parser`,
every family vLLM knows), on the same text and token ids, the same way, whole or streamed.

Imported only when a proxy parses replies and vLLM is installed beside it (proxy/parsing/__init__.py decides); the
proxy core never imports vLLM otherwise. The steps mirror vLLM's chat endpoint (`OpenAIServingChat`): one parser
per choice, `adjust_request` before generating, `parse` for a whole answer, `parse_delta` for each streamed piece,
`finish_reason` "tool_calls" when calls were made, `parallel_tool_calls: false` keeping the first call.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from pydantic import BaseModel
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.parser_manager import ParserManager
from vllm.tokenizers import get_tokenizer

from proxy.parsing.native import ChoiceStream, Parsed, ReplyParsing, RequestParsing, new_tool_call_id

__all__ = ["VllmParsing", "loading_parsers"]


class VllmParsing(ReplyParsing):
    """The parsers vLLM's chat endpoint would use for `tool_parser` and `reasoning_parser` on this tokenizer."""

    forced_tools = True  # adjust_request gives the chat endpoint's constraint, parse reads the forced call

    def __init__(self, tool_parser: str | None, reasoning_parser: str | None, tokenizer: str | Path):
        super().__init__(tool_parser, reasoning_parser)
        self.tokenizer = _tokenizer(str(tokenizer))
        try:
            self.parser_cls = ParserManager.get_parser(
                tool_parser_name=self.tool_parser, reasoning_parser_name=self.reasoning_parser,
                enable_auto_tools=self.tool_parser is not None, tokenizer=self.tokenizer)
        except TypeError as exc:  # vLLM's "cannot be used with the tokenizer of None: ... could not locate ..."
            raise ValueError(_misfit(self.tool_parser, self.reasoning_parser, str(tokenizer), exc)) from exc
        self.tool_marker, self.reasoning_markers = _markers(self.new_parser(None, {}), self.tokenizer)

    def new_parser(self, tools, template_kwargs: dict):
        """A fresh parser (they keep stream state: one per choice), or None with no parser configured."""
        if self.parser_cls is None:
            return None
        return self.parser_cls(self.tokenizer, tools, chat_template_kwargs=template_kwargs, model_config=None)

    def request(self, body: dict) -> RequestParsing:
        return _VllmRequest(self, body)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    """vLLM's tokenizer of a model directory, loaded once per process (doctor tries every parser on one)."""
    return get_tokenizer(model_dir)


def loading_parsers(model_dir: str | Path) -> tuple[list[str], list[str]]:
    """The tool parsers and the reasoning parsers whose tokens this model's tokenizer has (vLLM checks a parser
    against the tokenizer when it loads it): which names can be used with the model at all."""
    from proxy.parsing.native import REASONING_PARSERS, TOOL_PARSERS

    tokenizer = _tokenizer(str(model_dir))

    def loads(**names) -> bool:
        try:
            ParserManager.get_parser(**names, tokenizer=tokenizer)
        except Exception:  # a TypeError for missing tokens; an ImportError for a parser's own package
            return False
        return True

    return ([n for n in TOOL_PARSERS if loads(tool_parser_name=n, enable_auto_tools=True)],
            [n for n in REASONING_PARSERS if loads(reasoning_parser_name=n)])


def _misfit(tool_parser: str | None, reasoning_parser: str | None, model_dir: str, exc: Exception) -> str:
    """Which parser does not fit the tokenizer of `model_dir`, why (vLLM's words, less its model name, which it does
    not know here), and the names that do."""
    why = str(exc).split(": ", 1)[-1].rstrip(".")
    tools, reasonings = loading_parsers(model_dir)
    if tool_parser is not None and tool_parser not in tools:
        named, fit, flag = f"tool parser {tool_parser!r}", tools, "--tool-parser (rollout.tool_parser)"
    else:
        named, fit, flag = (f"reasoning parser {reasoning_parser!r}", reasonings,
                            "--reasoning-parser (rollout.reasoning_parser)")
    kind = named.split(" ", 1)[0]
    return (f"the {named} cannot be used with the tokenizer of {model_dir!r}: {why}. The {kind} parsers that load "
            f"with this tokenizer: {', '.join(fit) or 'none'}; pick one with {flag}. `harness parsers` lists the "
            f"model families of each, and `harness doctor --model {model_dir} --tool-parser NAME` checks that one "
            "reads back the turns the model's chat template writes")


def _markers(parser, tokenizer) -> tuple[str | None, tuple[str, str] | None]:
    """The text that opens a tool call, and the pair that opens and closes reasoning (None where the parser does not
    say), which the parse flags look for. Reasoning parsers built on vLLM's parser engine name only the ids that
    end reasoning: the opening tag is then the closing one without its slash (`</think>` -> `<think>`)."""
    if parser is None:
        return None, None
    tp, rp = parser.tool_parser, parser.reasoning_parser
    tool = next((v for a in ("tool_call_start_token", "bot_token", "tool_calls_start_token")
                 if isinstance(v := getattr(tp, a, None), str) and v), None)
    start, end = getattr(rp, "start_token", None), getattr(rp, "end_token", None)
    if rp is not None and not isinstance(end, str) and getattr(rp, "reasoning_end_token_ids", None):
        ends = sorted(tokenizer.decode([i], skip_special_tokens=False) for i in rp.reasoning_end_token_ids)
        end = next((e for e in ends if e.startswith("</")), None)  # a tool call may end reasoning too: not the tag
        start = end.replace("</", "<", 1) if end else None
    return tool, ((start, end) if isinstance(start, str) and isinstance(end, str) and start and end else None)


class _VllmRequest(RequestParsing):
    def __init__(self, parsing: VllmParsing, body: dict):
        self.parsing = parsing
        fields = {k: v for k, v in body.items() if k in ChatCompletionRequest.model_fields}
        request = ChatCompletionRequest.model_validate({**fields, "model": body.get("model") or "policy"})
        self.template_kwargs = dict(body.get("chat_template_kwargs") or {})
        self.tools_on = (parsing.tool_parser is not None and bool(request.tools)
                         and request.tool_choice not in ("none",))
        probe = parsing.new_parser(request.tools, self.template_kwargs)
        if probe is not None:
            before = request.structured_outputs
            request = probe.adjust_request(request)
            if request.structured_outputs is not None and request.structured_outputs is not before:
                self.structured_outputs = {k: v for k, v in dataclasses.asdict(request.structured_outputs).items()
                                           if not k.startswith("_") and v not in (None, False)}
        self.request = request
        self.forced = request.tool_choice == "required" or isinstance(request.tool_choice, BaseModel)
        self.calls_finish = not isinstance(request.tool_choice, BaseModel)  # a named function finishes "stop"
        self.skip_special_tokens = request.skip_special_tokens

    def _parser(self):
        return self.parsing.new_parser(self.request.tools, self.template_kwargs)

    def whole(self, text: str, token_ids: list[int], prompt_ids: list[int] | None) -> Parsed:
        parser = self._parser()
        if parser is None:
            return Parsed(content=text)
        if prompt_ids is not None:
            parser.set_prompt_token_ids(prompt_ids)
        reasoning, content, calls = parser.parse(text, self.request, enable_auto_tools=self.tools_on,
                                                 model_output_token_ids=token_ids)
        tool_calls = [{"id": c.id or new_tool_call_id(), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}}
                      for c in calls or ()] if self.tools_on else []
        if self.forced and content is None:
            content = ""  # as the chat endpoint writes a forced call's message
        return Parsed(content=content, tool_calls=tool_calls,
                      reasoning=reasoning if self.request.include_reasoning else None)

    def stream(self, prompt_ids: list[int] | None) -> ChoiceStream:
        return _VllmStream(self, self._parser(), prompt_ids)

    def reasoning_tokens(self, token_ids: list[int]) -> int | None:
        if self.parsing.reasoning_parser is None:
            return None
        parser = self._parser()
        return parser.count_reasoning_tokens(token_ids) if parser is not None else None


class _VllmStream(ChoiceStream):
    """vLLM's streaming parsers are written for one token a delta, as an idle engine streams; a busy engine sends
    several tokens in one piece, and some parsers then garble a call (vLLM's own chat endpoint included: Mistral's
    arguments lose their start). A piece of several tokens is handed to the parser one token at a time, each with
    its own text, and the deltas it answers are joined into the one delta the piece sends: what the client gets no
    longer depends on how busy the engine was."""

    CONTEXT = 4  # earlier tokens decoded before a piece's own, so each token's text is what it adds in context

    def __init__(self, owner: _VllmRequest, parser, prompt_ids: list[int] | None):
        self.owner, self.parser, self.prompt_ids = owner, parser, prompt_ids
        self.tail = list(prompt_ids[-self.CONTEXT:]) if prompt_ids else []

    def delta(self, text: str, token_ids: list[int], finished: bool) -> dict | None:
        if self.parser is None:
            return {"content": text} if text or finished else None
        pieces = self._per_token(text, list(token_ids))
        self.tail = (self.tail + list(token_ids))[-self.CONTEXT:]
        out = None
        for k, (piece, ids) in enumerate(pieces):
            message = self.parser.parse_delta(piece, ids, self.owner.request, self.prompt_ids,
                                              finished=finished and k == len(pieces) - 1)
            if message is not None:
                out = _joined(out, message.model_dump(exclude_unset=True, mode="json"))
        if out is None:
            return None
        if not self.owner.request.include_reasoning:
            out.pop("reasoning", None)
        if not self.owner.tools_on:
            out.pop("tool_calls", None)
        return out

    def _per_token(self, text: str, token_ids: list[int]) -> list[tuple[str, list[int]]]:
        """The piece as (text, ids) one token each (a token whose bytes end mid-character goes with the next); the
        piece whole when its tokens do not decode to exactly its text (a stop string cut it, say)."""
        if len(token_ids) < 2:
            return [(text, token_ids)]
        skip = self.owner.skip_special_tokens
        decode = self.owner.parsing.tokenizer.decode
        seen = list(self.tail)
        before = decode(seen, skip_special_tokens=skip).rstrip("\ufffd") if seen else ""  # a character the
        # context's last token began is this piece's text
        pieces, pending = [], []
        for token in token_ids:
            pending.append(token)
            now = decode(seen + pending, skip_special_tokens=skip)
            if now.endswith("\ufffd") or not now.startswith(before):
                continue
            pieces.append((now[len(before):], pending))
            seen, before, pending = seen + pending, now, []
        if pending:  # a character not finished in this piece: the engine sends it with the next
            if not pieces:
                return [(text, token_ids)]
            pieces[-1] = (pieces[-1][0], pieces[-1][1] + pending)
        if "".join(p for p, _ in pieces) != text:
            return [(text, token_ids)]
        return pieces


def _joined(a: dict | None, b: dict) -> dict:
    """Two chat deltas as one: text appended, a tool call's pieces joined under its index, as a client adds them."""
    if a is None:
        return b
    for key, value in b.items():
        if key == "tool_calls":
            calls = {c.get("index"): c for c in a.setdefault("tool_calls", [])}
            for call in value:
                mine = calls.get(call.get("index"))
                if mine is None:
                    a["tool_calls"].append(call)
                    calls[call.get("index")] = call
                    continue
                for field, v in call.items():
                    if field == "function":
                        fn = mine.setdefault("function", {})
                        for name, part in (v or {}).items():
                            fn[name] = (fn.get(name) or "") + part if isinstance(part, str) else fn.get(name, part)
                    elif mine.get(field) is None:
                        mine[field] = v
        elif isinstance(value, str) and isinstance(a.get(key), str):
            a[key] += value
        elif a.get(key) is None:
            a[key] = value
    return a
