"""The tool-call parsers turn generated text into the message vLLM's chat endpoint would send, and stream safely."""

from __future__ import annotations

import json
import re

import pytest

from proxy.parsing import reply_parsing
from proxy.parsing.native import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    Parsed,
    check_reasoning_parser,
    get_parser,
    known_parsers,
)


def _call(name: str, arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


PARIS = _call("get_weather", {"city": "Paris"})
TOKYO = _call("get_weather", {"city": "Tokyo", "days": 2})
MALFORMED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'

# (case, generated text, expected content, expected [(name, arguments string)])
CASES = [
    ("plain text", "Hello there.", "Hello there.", []),
    ("empty reply", "", "", []),
    ("one call", PARIS, None, [("get_weather", '{"city": "Paris"}')]),
    ("text before the call", "Let me check.\n" + PARIS, "Let me check.\n", [("get_weather", '{"city": "Paris"}')]),
    ("only whitespace before the call", "\n\n" + PARIS, None, [("get_weather", '{"city": "Paris"}')]),
    ("parallel calls", PARIS + "\n" + TOKYO, None,
     [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Tokyo", "days": 2}')]),
    ("compact arguments come back spaced", '<tool_call>{"name":"f","arguments":{"a":1,"b":[1,2]}}</tool_call>', None,
     [("f", '{"a": 1, "b": [1, 2]}')]),
    ("whitespace and newlines around the JSON", '<tool_call>  \n\n {"name": "f",\n "arguments": {}} \n</tool_call>',
     None, [("f", "{}")]),
    ("non-ASCII stays as written", _call("f", {"city": "Zürich", "note": "日本"}), None,
     [("f", '{"city": "Zürich", "note": "日本"}')]),
    ("nested arguments", _call("search", {"q": "x", "filters": {"max": 20, "tags": ["a", None, True]}}), None,
     [("search", '{"q": "x", "filters": {"max": 20, "tags": ["a", null, true]}}')]),
    ("arguments given as a string are encoded again, as vLLM does",
     '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", '"{\\"a\\": 1}"')]),
    ("text after the last call is dropped", PARIS + "\nDone.", None, [("get_weather", '{"city": "Paris"}')]),
    ("cut off after complete JSON still counts", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', None,
     [("f", '{"a": 1}')]),
    ("cut off inside the JSON is plain content", 'Sure <tool_call>\n{"name": "f", "argu',
     'Sure <tool_call>\n{"name": "f", "argu', []),
    ("malformed JSON is plain content", "Hi " + MALFORMED, "Hi " + MALFORMED, []),
    ("one bad call of two makes it all content", PARIS + MALFORMED, PARIS + MALFORMED, []),
    ("missing arguments is plain content", '<tool_call>{"name": "f"}</tool_call>',
     '<tool_call>{"name": "f"}</tool_call>', []),
    ("a name that is not a string is plain content", '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
     '<tool_call>{"name": 3, "arguments": {}}</tool_call>', []),
    ("a JSON list is plain content", "<tool_call>[1, 2]</tool_call>", "<tool_call>[1, 2]</tool_call>", []),
    ("an empty call is plain content", "<tool_call></tool_call>", "<tool_call></tool_call>", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hermes_parses_like_vllm_chat(text, content, calls):
    parsed = get_parser("hermes").parse(text)
    assert parsed.content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls] == calls
    assert parsed.reasoning is None
    for call in parsed.tool_calls:
        assert call["type"] == "function"
        assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    assert len({c["id"] for c in parsed.tool_calls}) == len(calls)


@pytest.mark.parametrize(
    ("text", "safe"),
    [
        ("", 0),
        ("Hello", 5),
        ("Hello <", 6),
        ("Hello <tool_", 6),
        ("Hello <tool_call", 6),
        ("Hello <tool_call>", 6),
        ("Hello <tool_call>\n{\"name\"", 6),
        ("a < b", 5),
        ("a <t b", 6),
        ("Hi</tool_call>", 14),
        (PARIS + "more <tool_call>", 0),
    ],
)
def test_hermes_streaming_holds_back_markers(text, safe):
    assert get_parser("hermes").safe_prefix_len(text) == safe


@pytest.mark.parametrize("text", [c[1] for c in CASES if c[3]], ids=[c[0] for c in CASES if c[3]])
def test_streamed_content_never_shrinks_and_stops_at_the_first_call(text):
    """Growing the text char by char, the sendable prefix only grows and ends where the parsed content ends."""
    parser = get_parser("hermes")
    sent = 0
    for end in range(len(text) + 1):
        safe = parser.safe_prefix_len(text[:end])
        assert safe >= sent
        sent = safe
    assert text[:sent] == text[: text.index("<tool_call>")]
    assert (parser.parse(text).content or "").strip() == text[:sent].strip()


def test_the_names_are_vllms_and_a_wrong_one_lists_them():
    assert {"hermes", "qwen3_xml", "llama3_json", "mistral", "pythonic", "deepseek_v3", "glm45", "kimi_k2"} <= set(
        known_parsers())
    assert get_parser("hermes").name == "hermes" and type(get_parser("qwen3_json")) is type(get_parser("hermes"))
    for wrong in ("qwen2.5", "Hermes", "nope"):
        with pytest.raises(ValueError, match=rf"unknown tool parser '{re.escape(wrong)}'.*hermes.*llama3_json"):
            get_parser(wrong)
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'qwen'.*qwen3.*deepseek_r1"):
        check_reasoning_parser("qwen")
    with pytest.raises(ValueError, match=r"tool parser 'llama3_json' needs vLLM's own parser"):
        get_parser("llama3_json")  # a real name the proxy's core has no parser of its own for
    with pytest.raises(ValueError, match=r"reasoning parser 'qwen3' needs vLLM's own parser"):
        reply_parsing("hermes", "qwen3", tokenizer=None)


def test_the_names_are_the_installed_vllms():
    """The lists the core keeps without importing vLLM are exactly the installed vLLM's registries."""
    pytest.importorskip("vllm")
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    assert set(TOOL_PARSERS) == set(ToolParserManager.lazy_parsers) | set(ToolParserManager.tool_parsers)
    assert set(REASONING_PARSERS) == (set(ReasoningParserManager.lazy_parsers)
                                      | set(ReasoningParserManager.reasoning_parsers))


def test_parsed_is_frozen():
    with pytest.raises(AttributeError):
        Parsed(content="x").content = "y"


# ---------------------------------------------------------------------------------------------------------------


ROUND_TRIP = [
    ("one call", None, [("get_weather", {"city": "Paris"})]),
    ("text and two calls", "Let me check both.", [("get_weather", {"city": "Paris"}), ("get_weather", {"days": 2})]),
    ("nested non-ASCII arguments", None, [("search", {"q": "Zürich café", "f": {"n": [1, 2.5, None], "ok": True}})]),
    ("no arguments", "", [("list_dir", {})]),
]


@pytest.mark.parametrize("as_string", [False, True], ids=["arguments as object", "arguments as JSON string"])
@pytest.mark.parametrize(("content", "calls"), [c[1:] for c in ROUND_TRIP], ids=[c[0] for c in ROUND_TRIP])
def test_what_the_tiny_template_renders_parses_back(tiny_model_dir, content, calls, as_string):
    """The assistant text the template renders (what the model learns to write) parses to the same calls."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tool_calls = [{"id": f"c{i}", "type": "function",
                   "function": {"name": name, "arguments": json.dumps(args) if as_string else args}}
                  for i, (name, args) in enumerate(calls)]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content, "tool_calls": tool_calls}]
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert full.startswith(prompt)
    reply = full[len(prompt):].split("<|im_end|>")[0]
    # what the engine hands back: the reply's ids decoded, special tokens skipped, tool tags kept
    reply = tokenizer.decode(tokenizer.encode(reply, add_special_tokens=False), skip_special_tokens=True)
    parsed = get_parser("hermes").parse(reply)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == calls
    assert (parsed.content or "").strip() == (content or "")


def test_agrees_with_vllms_own_hermes_parser(tiny_model_dir):
    """Same content and calls as vLLM's Hermes parser as the chat endpoint runs it (the proxy's vLLM path), on every
    table case; test_vllm_parsing.py checks the two agree through the whole chat answer."""
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}
    theirs = reply_parsing("hermes", None, tokenizer=str(tiny_model_dir)).request(body)
    ours = get_parser("hermes")
    for case, text, _, _ in CASES:
        expected = theirs.whole(text, tokenizer.encode(text, add_special_tokens=False), None)
        parsed = ours.parse(text)
        assert _message(parsed) == _message(expected), case


def _message(parsed: Parsed) -> tuple:
    return parsed.content, [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls]
