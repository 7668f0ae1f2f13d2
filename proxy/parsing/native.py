"""Reply parsing: a model's generated text split into reasoning, content and tool calls, as vLLM's chat endpoint
splits it.

When the proxy generates from token ids (`/v1/completions`), vLLM's chat endpoint is not in the path, so the
proxy parses the completion itself, with the parsers the engine is started with: `tool_parser` is a name vLLM's
`--tool-call-parser` accepts (`TOOL_PARSERS`), `reasoning_parser` one `--reasoning-parser` accepts
(`REASONING_PARSERS`). Where vLLM is installed beside the proxy and the model's tokenizer is at hand, its own
parser code runs (proxy/parsing/vllm.py): every family, exactly as the engine would. Otherwise the proxy's core,
which must not import vllm, torch or transformers, has its own parser for the Hermes format (`hermes`,
`qwen3_json`: Qwen2.5, Qwen3, Hermes), checked against vLLM's in the tests.

The seam: proxy/parsing/__init__.py's `reply_parsing(...)` once per proxy -> `.request(body)` once per chat request ->
`.whole(...)` for a finished choice, `.stream(...)` for a streamed one.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from harness.core.flags import PARSE, flag
from harness.core.records import Call

__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "ChoiceStream", "HermesToolParser", "NativeParsing", "Parsed",
           "ReplyParsing", "RequestParsing", "ToolParser", "check_reasoning_parser", "check_tool_parser", "get_parser",
           "known_parsers", "new_tool_call_id"]


@dataclass(frozen=True)
class Parsed:
    """One generated reply, split the way the chat endpoint sends it."""

    content: str | None  # the message content the agent gets (None where vLLM sends null)
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI shape, arguments a JSON string
    reasoning: str | None = None  # reasoning text, for parsers that split it out (hermes does not)


def new_tool_call_id() -> str:
    """A fresh id in OpenAI's shape (`call_` + hex); vLLM mints random ids too, so none is canonical."""
    return "call_" + secrets.token_hex(12)


def _partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with (0 when none)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class ToolParser:
    """Base of the parser family; subclasses set `name` and implement both methods."""

    name: str = ""

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def safe_prefix_len(self, text: str) -> int:
        """For streaming: `text` is everything generated so far; return how many leading chars can be sent to the
        agent as content now: all text before any tool-call marker, holding back a trailing partial marker (text
        ending in "<tool_" keeps those chars back). Once a tool call has started, nothing more is content."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """Hermes-style calls, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes 2 Pro, Qwen2.5, Qwen3).

    Mirrors vLLM's `Hermes2ProToolParser` plus the chat endpoint around it:
    - no `<tool_call>` in the text: the whole text is the content, no tool calls;
    - otherwise every `<tool_call>` region is one call: the JSON up to the next `</tool_call>`, or, for the last
      one, up to the end of the text when the reply was cut off (it still counts if that JSON is complete);
    - the content is the text before the first `<tool_call>`, None when that is empty or only whitespace; text
      after the last call is dropped;
    - if any region is not a JSON object with a string "name" and an "arguments" key, nothing is a tool call and
      the whole text is the content (vLLM logs the error and does the same);
    - arguments are re-serialised with `json.dumps(value, ensure_ascii=False)`, whatever their type: an object
      becomes `{"a": 1}` (spaced), and a string value is encoded again as a JSON string, as vLLM does.
    Ids are fresh `call_<hex>` strings (vLLM's are random too).
    """

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def _regions(self, text: str) -> list[str]:
        """The raw body of every `<tool_call>` region, in order."""
        bodies: list[str] = []
        pos = text.find(self.start)
        while pos != -1:
            body_start = pos + len(self.start)
            close = text.find(self.end, body_start)
            if close == -1:  # cut off: the rest of the text is the last body
                bodies.append(text[body_start:])
                break
            bodies.append(text[body_start:close])
            pos = text.find(self.start, close + len(self.end))
        return bodies

    def parse(self, text: str) -> Parsed:
        if self.start not in text:
            return Parsed(content=text)
        calls: list[dict] = []
        for body in self._regions(text):
            try:
                call = json.loads(body)
            except (ValueError, RecursionError):  # vLLM catches everything and returns the text
                return Parsed(content=text)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
                return Parsed(content=text)
            arguments = json.dumps(call["arguments"], ensure_ascii=False)
            calls.append({"id": new_tool_call_id(), "type": "function",
                          "function": {"name": call["name"], "arguments": arguments}})
        before = text[: text.index(self.start)]
        return Parsed(content=before if before.strip() else None, tool_calls=calls)

    def safe_prefix_len(self, text: str) -> int:
        marker = text.find(self.start)
        if marker != -1:
            return marker
        return len(text) - _partial_marker_len(text, self.start)


# The names vLLM 0.32's --tool-call-parser and --reasoning-parser accept (tests check them against the installed
# vLLM's registries). gpt-oss is `openai` / `openai_gptoss`: its harmony format is parsed from token ids.
TOOL_PARSERS = (
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4",
    "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45", "glm47", "granite",
    "granite-20b-fc", "granite4", "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "internlm", "jamba",
    "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json", "llama4_json", "llama4_pythonic", "longcat",
    "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral", "muse_glimmer", "olmo3", "openai", "phi4_mini_json",
    "plamo3", "poolside_v1", "pythonic", "qwen3_coder", "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5",
    "xlam",
)
REASONING_PARSERS = (
    "cohere_command3", "cohere_command4", "deepseek_r1", "deepseek_v3", "deepseek_v4", "deepseek_v41", "ernie45",
    "gemma4", "glm45", "glm47", "granite", "granite_thinking_parser", "hf", "holo2", "hunyuan_a13b", "hy_v3", "hy_v4",
    "inkling", "k2_horizon", "kimi_k2", "kimi_k3", "ling3", "mimo", "minicpmv", "minimax_m2",
    "minimax_m2_append_think", "minimax_m3", "mistral", "muse_glimmer", "nemotron_v3", "olmo3", "openai_gptoss",
    "plamo3", "poolside_v1", "qwen3", "seed_oss", "step3", "step3p5",
)
_NATIVE: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "qwen3_json": HermesToolParser}


def known_parsers() -> list[str]:
    return list(TOOL_PARSERS)


def check_tool_parser(name: str) -> str:
    """`name` as vLLM's --tool-call-parser takes it, or a ValueError listing the choices."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}: use one of vLLM's --tool-call-parser names: "
                         f"{', '.join(TOOL_PARSERS)} (Qwen2.5 and Hermes: hermes; Qwen3-Coder: qwen3_xml; "
                         "Llama 3.1/3.2: llama3_json)")
    return name


def check_reasoning_parser(name: str | None) -> str | None:
    """`name` as vLLM's --reasoning-parser takes it (None: no reasoning parser), or a ValueError with the choices."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: use one of vLLM's --reasoning-parser names: "
                         f"{', '.join(REASONING_PARSERS)} (Qwen3: qwen3; DeepSeek-R1 and QwQ: deepseek_r1)")
    return name


def get_parser(name: str) -> ToolParser:
    """The proxy's own parser for `name` (a fresh one; parsers hold no state, so one may serve many replies)."""
    cls = _NATIVE.get(check_tool_parser(name))
    if cls is None:
        raise ValueError(f"tool parser {name!r} needs vLLM's own parser: install vllm beside the proxy, or use one of "
                         f"{', '.join(_NATIVE)}")
    return cls()


# ---- the seam ---------------------------------------------------------------------------------------------------
class ChoiceStream:
    """One streamed choice: each piece of text (and its token ids) in, the chat delta to send out (None: nothing
    yet, as vLLM holds back a marker it is still reading)."""

    def delta(self, text: str, token_ids: list[int], finished: bool) -> dict | None:
        raise NotImplementedError


class RequestParsing:
    """How the answers to one chat request are parsed, and what the completions request must carry for it."""

    skip_special_tokens: bool = True  # decode the completion as vLLM's chat endpoint would for this request
    structured_outputs: dict | None = None  # a constraint the chat endpoint would add to generation (strict tools)
    calls_finish: bool = True  # a reply with tool calls finishes "tool_calls" (not for a named tool_choice)

    def whole(self, text: str, token_ids: list[int], prompt_ids: list[int] | None) -> Parsed:
        raise NotImplementedError

    def stream(self, prompt_ids: list[int] | None) -> ChoiceStream:
        raise NotImplementedError

    def reasoning_tokens(self, token_ids: list[int]) -> int | None:
        """How many of a reply's tokens are reasoning, as vLLM's chat endpoint counts them in
        `usage.completion_tokens_details.reasoning_tokens` (None: no reasoning parser, no such count)."""
        return None


class ReplyParsing:
    """The proxy's reply parsing, set up once from the names the engine was started with."""

    forced_tools: bool = False  # knows the constraint and parse of a forced tool_choice ("required", a function)
    tool_marker: str | None = None  # text that opens a tool call: there, with no call parsed, is a parse flag
    reasoning_markers: tuple[str, str] | None = None  # open and close reasoning: opened, never closed, is a flag

    def __init__(self, tool_parser: str | None, reasoning_parser: str | None):
        self.tool_parser = check_tool_parser(tool_parser) if tool_parser is not None else None
        self.reasoning_parser = check_reasoning_parser(reasoning_parser)

    def request(self, body: dict) -> RequestParsing:
        raise NotImplementedError

    def decode(self, token_ids: list[int]) -> str | None:
        """The text of `token_ids`, special tokens kept (None: no tokenizer here)."""
        return None

    def flags(self, body: dict, call: Call) -> list[dict]:
        """Why replies of a chat call did not parse, on either path (the engine's chat endpoint or the proxy's):
        `tool_call_unparsed` (tools were offered, the reply opened a tool call and none came out: an unclosed tag,
        bad JSON), `reasoning_unclosed` (it opened reasoning and never closed it). The agent got the text as
        content, as vLLM gives it; the flag says so in `calls.extra.flags`."""
        tools_on = self.tool_marker is not None and bool(body.get("tools")) and body.get("tool_choice") != "none"
        if not tools_on and self.reasoning_markers is None:
            return []
        out = []
        for ch in call.choices:
            raw = self.decode(ch.completion_ids) if ch.completion_ids else None
            raw = raw if raw is not None else (ch.reasoning or "") + (ch.text or "")
            if tools_on and not ch.tool_calls and self.tool_marker in raw:
                out.append(flag(ch.index, PARSE, "tool_call_unparsed"))
            if self.reasoning_markers and self.reasoning_markers[0] in raw and self.reasoning_markers[1] not in raw:
                out.append(flag(ch.index, PARSE, "reasoning_unclosed"))
        return out


class NativeParsing(ReplyParsing):
    """The proxy's own parsing: Hermes tool calls, held back in a stream until the choice ends, then sent whole."""

    def __init__(self, tool_parser: str | None, reasoning_parser: str | None):
        super().__init__(tool_parser, reasoning_parser)
        if self.reasoning_parser is not None:
            raise ValueError(f"reasoning parser {reasoning_parser!r} needs vLLM's own parser: install vllm beside the "
                             "proxy and give it the model (harness serve --model), or leave the reasoning parser out")
        self.parser = get_parser(tool_parser) if tool_parser is not None else None
        self.tool_marker = getattr(self.parser, "start", None)

    def request(self, body: dict) -> RequestParsing:
        on = self.parser is not None and bool(body.get("tools")) and body.get("tool_choice") != "none"
        return _NativeRequest(self.parser if on else None)


class _NativeRequest(RequestParsing):
    def __init__(self, parser: ToolParser | None):
        self.parser = parser
        if parser is not None:
            self.skip_special_tokens = False  # as vLLM's chat endpoint does for tool parsing: markers may be special

    def whole(self, text: str, token_ids: list[int], prompt_ids: list[int] | None) -> Parsed:
        return self.parser.parse(text) if self.parser is not None else Parsed(content=text)

    def stream(self, prompt_ids: list[int] | None) -> ChoiceStream:
        return _NativeStream(self.parser)


class _NativeStream(ChoiceStream):
    """Text goes out as content as soon as it cannot be the start of a tool call; tool calls go whole at the end."""

    def __init__(self, parser: ToolParser | None):
        self.parser, self.text, self.sent = parser, "", 0

    def delta(self, text: str, token_ids: list[int], finished: bool) -> dict | None:
        self.text += text
        if self.parser is None:
            self.sent = len(self.text)
            return {"content": text} if text or finished else None
        if not finished:
            safe = self.parser.safe_prefix_len(self.text)
            if safe <= self.sent:
                return None
            out = {"content": self.text[self.sent:safe]}
            self.sent = safe
            return out
        parsed = self.parser.parse(self.text)
        out: dict = {}
        rest = (parsed.content or "")[self.sent:] if parsed.tool_calls else self.text[self.sent:]
        if rest:
            out["content"] = rest
        if parsed.tool_calls:
            out["tool_calls"] = [{"index": k, **call} for k, call in enumerate(parsed.tool_calls)]
        self.sent = len(self.text)
        return out
