"""What `harness doctor` puts a model through: representative conversations, rendered by the model's chat template
as vLLM hands messages to it, and replies read back through the model's parsers as the engine's chat endpoint would.

`Template` compares renders: where a longer conversation's prompt stops extending a shorter one's prompt + reply,
as text, then as token ids (a `Finding`). The checks that judge those findings are in harness/cli/doctor.py.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from proxy.parsing.native import Parsed, ReplyParsing

CONTEXT_CHARS = 40  # chars of text shown on each side of a difference
_TOKENS_SHOWN = 6  # tokens shown on each side of a token difference


@dataclass(frozen=True)
class Finding:
    """One place where rendering does not do what merging needs."""

    where: str  # which conversation and message
    what: str  # what differs, in plain words
    level: str | None = None  # "text" or "tokens": what `position` counts
    position: int | None = None  # the first differing char or token of the longer render
    before: str | None = None  # what both sides share just before `position`
    expected: str | None = None  # from `position` on: the earlier call's prompt + reply, as the model wrote it
    found: str | None = None  # from `position` on: the longer render
    # before/expected/found are raw text when level is "text", else already printable (tokens as quoted pieces)


# --- representative conversations ------------------------------------------------------------------------------

def _fn(name: str, description: str, **properties: str) -> dict:
    props = {key: {"type": kind} for key, kind in properties.items()}
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": props}}}


TOOLS = [_fn("get_weather", "Weather for a city.", city="string", days="integer"),
         _fn("search_web", "Search the web.", query="string", filters="object")]
SYSTEM = {"role": "system", "content": "You are a careful assistant."}
NEXT_USER = {"role": "user", "content": "One more question."}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(content: str | None, *calls: tuple[str, dict]) -> dict:
    """An assistant message as vLLM hands it to the template: null content as "", arguments parsed into objects."""
    message: dict = {"role": "assistant", "content": content or ""}
    if calls:
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, (n, a) in enumerate(calls)]
    return message


def tool_result(call_id: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


_TEXT = [SYSTEM, user("What is 2 + 2?"), assistant("2 + 2 = 4."), user("And 3 + 3?"), assistant("6.")]
TOOL_USE = [
    SYSTEM, user("What's the weather in Paris and Tokyo? Then find me an umbrella."),
    assistant(None, ("get_weather", {"city": "Paris"})),
    tool_result("call_0", '{"temp_c": 21, "sky": "clear"}'),
    assistant("Now Tokyo, and umbrellas.", ("get_weather", {"city": "Tokyo", "days": 2}),
              ("search_web", {"query": "umbrella", "filters": {"max_price": 20, "colors": ["red", "blue"]}})),
    tool_result("call_0", '{"temp_c": 18, "sky": "rain"}'), tool_result("call_1", '["red umbrella, 15 EUR"]'),
    assistant("Paris: 21 °C and clear. Tokyo: rain, so take the red umbrella."),
    user("Thanks! And Zürich?"), assistant(None, ("get_weather", {"city": "Zürich"})),
    tool_result("call_0", '{"temp_c": 12}'), assistant("Zürich: 12 °C."),
]
CONVERSATIONS: list[tuple[str, list[dict], list[dict] | None]] = [
    ("text replies", _TEXT, None),
    ("text replies, tools offered", _TEXT, TOOLS),
    ("no system prompt", _TEXT[1:], None),
    ("tool calls and results", TOOL_USE, TOOLS),
]


# --- rendering -------------------------------------------------------------------------------------------------

class RenderError(Exception):
    pass


class Divergence(Exception):
    def __init__(self, finding: Finding):
        super().__init__(finding.what)
        self.finding = finding


class Template:
    """The tokenizer's chat template and stop tokens, with the comparisons the checks share."""

    def __init__(self, tokenizer, stop_ids: dict[int, str], named_ids: bool = False):
        self.tokenizer = tokenizer
        self.named_ids = named_ids  # tool-call ids as Kimi K2 writes them: functions.<name>:<index>
        self.stop_ids = stop_ids  # id -> where it comes from ("tokenizer eos", "generation_config.json")
        self.stop_texts = {tokenizer.decode([i]): i for i in stop_ids}
        self.close = ""  # the text of the token that ends an assistant turn, once check_close_token found it

    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        messages = _named_ids(messages) if self.named_ids else copy.deepcopy(messages)
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as exc:  # a template may raise anything (raise_exception, TypeError, jinja errors)
            raise RenderError(f"the template raised {type(exc).__name__}: {exc}") from exc

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def latest_turn(self, messages: list[dict], tools: list[dict] | None) -> tuple[str, str, str | None]:
        """(prompt, reply, close) for the last message, an assistant turn: the prompt of the call that produced
        it, the turn's text as the template renders it when it is the latest, and the stop token ending it (None:
        the template leaves the turn open, see split_close)."""
        prompt = self.render(messages[:-1], tools, True)
        turn = self.render(messages, tools, False)
        if not turn.startswith(prompt):
            raise Divergence(_difference(prompt, turn, "the generation prompt is not how the template starts "
                                                       "the assistant turn"))
        reply, close = self.split_close(turn[len(prompt):])
        return prompt, reply, close

    def split_close(self, tail: str) -> tuple[str, str | None]:
        """Split an assistant turn's text at its first stop token: (reply, close). A template that leaves the
        latest turn open has no stop token there (close None): the model stops on the token that opens what
        follows (GLM's `<|observation|>` after a tool call, `<|user|>` after text), whichever stop token that is."""
        hits = [(tail.find(t), t) for t in self.stop_texts if t and t in tail]
        if not hits:
            return tail, None
        pos, text = min(hits)
        return tail[:pos], text

    def divergence(self, prompt: str, reply: str, close: str | None, longer: str) -> Finding | None:
        """Where `longer` stops extending prompt + reply + close, as text, then as token ids; None if it does. An
        open turn's close (None) is the stop token `longer` has after the reply, else the usual one."""
        if close is None:
            rest = longer[len(prompt + reply):] if longer.startswith(prompt + reply) else ""
            close = next((t for t in self.stop_texts if t and rest.startswith(t)), self.close)
        expected = prompt + reply + close
        if not longer.startswith(expected):
            return _difference(expected, longer, "the next call's prompt differs from this call's prompt + reply")
        want = self.ids(prompt) + self.ids(reply) + ([self.stop_texts[close]] if close else [])
        have = self.ids(longer)
        if have[: len(want)] == want:
            return None
        pos = next((i for i, (a, b) in enumerate(zip(want, have, strict=False)) if a != b), len(have))
        return Finding(where="", what="same text, but the next call's prompt tokenizes it differently",
                       level="tokens", position=pos, before=self._pieces(have[max(0, pos - 3):pos]),
                       expected=self._pieces(want[pos:pos + _TOKENS_SHOWN]),
                       found=self._pieces(have[pos:pos + _TOKENS_SHOWN]))

    def _pieces(self, ids: list[int]) -> str:
        return " ".join(show(self.tokenizer.decode([i])) for i in ids)


# Kimi K2's template writes a call's id where its name goes, and the model writes ids as functions.<name>:<index>
# (vLLM's kimi_k2 parser reads the name from there): its agents send those ids back, so doctor's conversations do.
NAMED_ID_PARSERS = ("kimi_k2", "kimi_k3", "k2_horizon")


def _named_ids(messages: list[dict]) -> list[dict]:
    out, names = [], {}
    for message in copy.deepcopy(messages):
        for k, call in enumerate(message.get("tool_calls") or ()):
            names[call["id"]] = call["id"] = f"functions.{call['function']['name']}:{k}"
        if message.get("role") == "tool" and message.get("tool_call_id") in names:
            message["tool_call_id"] = names[message["tool_call_id"]]
        out.append(message)
    return out


def show(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _difference(expected: str, found: str, what: str) -> Finding:
    pos = next((i for i, (a, b) in enumerate(zip(expected, found, strict=False)) if a != b),
               min(len(expected), len(found)))
    return Finding(where="", what=what, level="text", position=pos, before=expected[max(0, pos - CONTEXT_CHARS):pos],
                   expected=expected[pos:pos + CONTEXT_CHARS], found=found[pos:pos + CONTEXT_CHARS])


# --- reading replies back --------------------------------------------------------------------------------------

class Reader:
    """Reads a reply as the engine's chat endpoint and the proxy would: the model's tool (and reasoning) parser
    on a request that offers TOOLS."""

    def __init__(self, parsing: ReplyParsing, tokenizer):
        self.parsing, self.tokenizer = parsing, tokenizer
        self.name = parsing.tool_parser or "none"
        self._request = parsing.request({"model": "doctor", "messages": [SYSTEM], "tools": TOOLS})

    def parse(self, text: str) -> Parsed:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self._request.whole(text, ids, None)


# --- tool-call turns, as the template writes them and a parser reads them ------------------------------------------

@dataclass(frozen=True)
class ToolTurn:
    """An assistant turn of TOOL_USE as the template writes it and the engine hands it back."""

    where: str
    message: dict
    text: str  # the turn's ids decoded, special tokens kept (vLLM does so with tools on)
    bare: str | None  # the same turn rendered without its text before the calls (None: it has none)


def tool_turns(template: Template) -> list[ToolTurn]:
    """Every assistant turn of TOOL_USE; a RenderError or Divergence when one cannot be rendered."""
    def text_of(messages: list[dict]) -> str:
        _, reply, _ = template.latest_turn(messages, TOOLS)
        return template.tokenizer.decode(template.ids(reply), skip_special_tokens=False)

    turns = []
    for i, message in enumerate(TOOL_USE):
        if message["role"] != "assistant":
            continue
        bare = (text_of([*TOOL_USE[:i], {**message, "content": ""}])
                if message.get("tool_calls") and message["content"] else None)
        turns.append(ToolTurn(f"tool calls and results, assistant message {i}", message, text_of(TOOL_USE[:i + 1]),
                           bare))
    return turns


def read_turn(turn: ToolTurn, parser: Reader, reasoned: Reader | None) -> tuple[str, Finding | None]:
    """How `parser` reads the turn: ("ok", None); ("limit", finding), it reads the calls only without the text
    written before them, which the format has no place for; ("misread", finding), it reads other calls or content
    than the template wrote."""
    markers = reasoned.parsing.reasoning_markers if reasoned is not None else None

    def parse(text: str):
        parsed = (reasoned if markers and markers[1] in text else parser).parse(text)
        return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls], parsed

    message, name = turn.message, parser.name
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    got, parsed = parse(turn.text)
    written = (message["content"] or "").strip()
    rendered = written if written and written in turn.text else ""  # a template may leave it out (Mistral v3)
    content = (parsed.content or "").strip()
    if got == want and content == rendered:
        return "ok", None
    if turn.bare is not None and rendered and parse(turn.bare)[0] == want:
        read = ("reads the calls and drops the text" if got == want else "reads no call, only text")
        return "limit", Finding(turn.where, f"the template writes text before the calls: {show(turn.text)}; the "
                                f"{name} parser {read} (as the engine does), and reads the same calls written alone: "
                                "this format has calls open a reply", expected=show(want), found=show(got))
    if got != want:
        return "misread", Finding(turn.where, f"the template renders this turn as {show(turn.text)}; the {name} "
                                  "parser reads other tool calls from it", expected=show(want), found=show(got))
    return "misread", Finding(turn.where, f"the template renders this turn as {show(turn.text)}; the {name} parser "
                              "returns other content", expected=show(rendered), found=show(parsed.content))
