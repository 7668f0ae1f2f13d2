"""Hypothesis strategies for tests/proxy/test_fuzz.py, part 1: the request model and the bodies.

`Req` is one generated HTTP request (method, target, headers, payload, encoding, chunking) with what the checks expect
of its answer (route, bad episode id, admin token, may break aiohttp's HTTP parser). The payload may hold `Deep` (JSON
nested deeper than an encoder takes), `Huge` (a body of up to 1 MB) and the placeholders ADMIN, TOKEN, PREV, resolved
at send time. The strategies here draw junk values (odd text, extreme numbers, arbitrary JSON), episode prefixes,
headers, mutations of a valid body, and the bodies of the four recorded APIs (chat completions, completions,
responses, Anthropic messages), valid and invalid. The request kinds built from them are in fuzz_requests.py.
The definitions and the order of their draws are what the derandomized run generates: change them knowingly.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from urllib.parse import quote

from hypothesis import strategies as st

MAX_BODY = 512 * 1024  # the proxy's max_body_bytes here: generated bodies go up to 1 MB, on both sides of it
LINE_LIMIT = 8190  # aiohttp's limit on a request line / header line
MAX_N = 3  # the scripted engine builds n choices in memory: n stays small where a request may reach it
RECORDED = ("chat", "completions", "responses", "messages")  # routes whose calls land in `calls`
LLM_PATHS = {"chat": "chat/completions", "completions": "completions", "responses": "responses",
             "messages": "messages"}

# Placeholders resolved at send time (they depend on what the proxy answered before).
ADMIN, TOKEN, PREV = "\x00admin", "\x00token", "\x00prev"


@dataclass(frozen=True)
class Deep:
    """JSON nested `depth` levels deep (rendered as bytes: no encoder takes it)."""

    depth: int
    kind: str  # "list" or "dict"


@dataclass(frozen=True)
class Huge:
    """A body of about `size` bytes."""

    size: int
    kind: str  # chat, messages, junk, array


@dataclass
class Req:
    plan: str
    method: str
    path: str  # the request target as sent
    headers: list = field(default_factory=list)  # [(name, value)]; values may hold ADMIN / TOKEN
    payload: object = None  # None: no body; bytes as they are; Huge; else a JSON value (may hold Deep, PREV)
    encoding: str | None = None  # gzip, deflate, gzip-fake, deflate-fake, br, identity
    chunked: bool = False
    route: str = ""  # chat, completions, responses, messages, models, passthrough, health, sql, ...
    bad_episode: bool = False  # the URL episode id is invalid (and reaches the proxy as generated)
    admin: str = ""  # "none"/"wrong": must be a 401; "admin": must not be; "": no expectation
    breaks_http: bool = False  # aiohttp's HTTP layer may refuse it before proxy code runs: a plain-text 400 is fine

    def __post_init__(self):
        if self.encoding is not None and (self.encoding == "br" or self.encoding.endswith("-fake")):
            self.breaks_http = True  # aiohttp's parser may refuse what it cannot decode before the proxy reads it


# ---------------------------------------------------------------------------------------------------------------
# Strategies.
# ---------------------------------------------------------------------------------------------------------------

INTS = [0, -1, 1, 2, 7, 2**31 - 1, 2**31, -(2**31) - 1, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1]
ODD = ["", " ", "\x00", "\u202e", "\ufeff", "😀😀", "null", "{}", "[]", "<|im_end|>", "<|im_start|>user\n",
       "hx-ep-x", "%s%n", "../../etc/passwd", "\\", "'; DROP TABLE calls;--", "\u0085\u2028",
       "w1000 w1001 w1002 w1003 w1004 w1005 w1006 w1007 "]
TEXT = st.one_of(st.text(max_size=24), st.sampled_from(ODD), st.sampled_from([300, 5000]).map(lambda n: "a" * n))
LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.sampled_from(INTS),
                 st.floats(allow_nan=False, allow_infinity=False), TEXT)
JSON = st.recursive(LEAF, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                  st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                    max_leaves=8)
DEEP = st.builds(Deep, st.sampled_from([100, 255, 256, 257, 400, 1000, 1023, 1024, 1200]),
                 st.sampled_from(["list", "dict"]))
JUNK = st.one_of(JSON, JSON, JSON, DEEP)
MODEL = st.one_of(st.sampled_from(["gpt-4o-mini", "qwen-plus", "claude-3-5-sonnet", ""]), TEXT)
NUM = st.one_of(st.integers(-10, 10_000), st.sampled_from(INTS), st.floats(allow_nan=False, allow_infinity=False))
SMALL_N = st.one_of(st.integers(1, MAX_N), st.integers(-3, 0), st.sampled_from([-(2**63), 1.5, "2", True, None]))

_VALID_EPISODE = st.one_of(st.sampled_from(["ep-1", "ep-2", "task.0:a@b+c", "Z", "a" * 128]),
                           st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,30}", fullmatch=True))
_CLEAN_INVALID = st.one_of(  # invalid, in characters a path carries as they are
    st.from_regex(r"[._:@+-][A-Za-z0-9._:@+-]{0,10}", fullmatch=True).filter(lambda s: s not in (".", "..")),
    st.from_regex(r"[A-Za-z0-9]{1,8}[!$&'()*,;=~][A-Za-z0-9]{0,8}", fullmatch=True),
    st.integers(129, 300).map(lambda n: "e" * n),
)
_ENCODED_JUNK = st.one_of(st.text(min_size=1, max_size=30), st.sampled_from([".", "..", "%", "/", "?", "#", " "]))


@st.composite
def episode_prefix(draw) -> tuple[str, bool]:
    """'' (plain /v1), '/e/<valid>', '/e/<invalid>' (expect 400), or '/e/<percent-encoded junk>'."""
    kind = draw(st.sampled_from(["none", "none", "valid", "valid", "invalid", "encoded"]))
    if kind == "none":
        return "", False
    if kind == "valid":
        return "/e/" + draw(_VALID_EPISODE), False
    if kind == "invalid":
        return "/e/" + draw(_CLEAN_INVALID), True
    return "/e/" + quote(draw(_ENCODED_JUNK), safe=draw(st.sampled_from(["", "%", "."]))), False


LATIN1 = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=40)
HEADER_NAME = st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,15}", fullmatch=True).filter(
    lambda n: n.lower() not in ("host", "content-length", "transfer-encoding", "content-encoding", "connection",
                                "expect", "upgrade", "content-type", "content-location", "content-range", "etag",
                                "max-forwards", "server", "user-agent"))  # repeating these is aiohttp's 400
AGENT_AUTH = st.one_of(
    st.just([]), st.just([]), st.just([]),
    st.sampled_from([[("Authorization", "Bearer sk-test")], [("Authorization", "Bearer hx-ep-never-minted")],
                     [("Authorization", "Bearer " + TOKEN)], [("x-api-key", "sk-ant-test")], [("api-key", "k")],
                     [("Authorization", "Basic Zm9vOmJhcg==")], [("Authorization", "Bearer")],
                     [("Authorization", "bearer   " + TOKEN + "  ")], [("x-api-key", TOKEN)],
                     [("Authorization", "Bearer " + ADMIN)]]),
    st.lists(st.tuples(st.sampled_from(["Authorization", "x-api-key", "api-key"]), LATIN1), max_size=2),
)
EXTRA_HEADERS = st.lists(st.tuples(HEADER_NAME, LATIN1), max_size=3)
CONTENT_TYPE = st.one_of(
    st.just("application/json"), st.just("application/json"), st.just("application/json"),
    st.sampled_from([None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                     "application/json; charset=latin-1", "application/octet-stream", "text/event-stream", "*/*",
                     "application/json; boundary", ";;;", "application/jsonx"]),
    LATIN1,
)
ENCODING = st.one_of(st.none(), st.none(), st.none(), st.none(),
                     st.sampled_from(["gzip", "deflate", "gzip-fake", "deflate-fake", "identity", "br"]))


@st.composite
def headers(draw, auth=AGENT_AUTH) -> list:
    out = list(draw(auth))
    ctype = draw(CONTENT_TYPE)
    if ctype is not None:
        out.append(("Content-Type", ctype))
    return out + draw(EXTRA_HEADERS)


@st.composite
def mutated(draw, base):
    """A request from `base` with 0-3 values replaced by junk (anywhere in the tree), keys deleted or added."""
    body = copy.deepcopy(draw(base))  # never the strategy's own constants (st.just)
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["poke", "poke", "delete", "add"]))
        if op == "poke":
            body = _poke(draw, body)
        elif op == "delete" and isinstance(body, dict) and body:
            del body[draw(st.sampled_from(sorted(body)))]
        elif isinstance(body, dict):
            body[draw(st.one_of(TEXT, st.sampled_from(["n", "stream", "model", "messages", "input", "tools"])))] = \
                draw(JUNK)
    return body


def _poke(draw, node):
    """Replace a value somewhere down the tree by junk."""
    if isinstance(node, (dict, list)) and node and draw(st.integers(0, 2)):
        key = draw(st.sampled_from(sorted(node))) if isinstance(node, dict) else draw(st.integers(0, len(node) - 1))
        node[key] = _poke(draw, node[key])
        return node
    return draw(JUNK)


def _with(required: dict, optional: dict):
    return st.fixed_dictionaries(required, optional=optional)


# --- chat completions -----------------------------------------------------------------------------------------
_PART = st.one_of(
    _with({"type": st.just("text"), "text": TEXT}, {}),
    _with({"type": st.just("image_url"),
           "image_url": _with({"url": st.sampled_from(["https://x.test/a.png", "data:image/png;base64,AAAA", "",
                                                       "file:///etc/passwd"])}, {"detail": TEXT})}, {}),
    _with({"type": st.sampled_from(["input_audio", "file", "video_url", "refusal", "", "text"])}, {"text": JUNK}),
    JUNK,
)
_CONTENT = st.one_of(TEXT, TEXT, st.none(), st.lists(_PART, max_size=3))
_TOOL_CALL = _with({"id": TEXT, "type": st.just("function"),
                    "function": _with({"name": TEXT, "arguments": st.one_of(st.just('{"a": 1}'), TEXT)}, {})}, {})
_MESSAGE = _with(
    {"role": st.sampled_from(["system", "user", "user", "assistant", "tool", "developer", "function", "", "USER",
                              "ipython", "bot"]), "content": _CONTENT},
    {"name": TEXT, "tool_call_id": TEXT, "tool_calls": st.lists(_TOOL_CALL, max_size=2), "reasoning_content": TEXT},
)
_SCHEMA = st.one_of(
    st.just({"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}),
    st.just({"type": "object", "properties": {"q": {"$ref": "#/nowhere"}}}),
    st.just({"type": "array", "items": None}), st.just({"type": 7}), JUNK,
)
_CHAT_TOOL = st.one_of(
    _with({"type": st.just("function"), "function": _with({"name": TEXT}, {"description": TEXT, "parameters": _SCHEMA,
                                                                         "strict": st.booleans()})}, {}),
    _with({"type": st.sampled_from(["function", "web_search", "code_interpreter", ""])}, {"function": JUNK}),
    JUNK,
)
CONTINUATION = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "w1000 w1001 w1002 w1003 w1004 w1005 w1006 w1007 "},
                {"role": "user", "content": "go on"}]
_CHAT = _with(
    {"model": MODEL, "messages": st.one_of(st.lists(_MESSAGE, min_size=1, max_size=4), st.just(CONTINUATION))},
    {"stream": st.booleans(), "n": SMALL_N, "max_tokens": NUM, "max_completion_tokens": NUM,
     "temperature": NUM, "top_p": NUM, "tools": st.lists(_CHAT_TOOL, max_size=3),
     "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "any"]),
                              _with({"type": st.just("function"), "function": _with({"name": TEXT}, {})}, {}), JUNK),
     "response_format": st.one_of(st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "nope"}]),
                                  _with({"type": st.just("json_schema"),
                                         "json_schema": _with({"name": TEXT, "schema": _SCHEMA}, {})}, {})),
     "stream_options": st.one_of(_with({}, {"include_usage": st.booleans()}), JUNK),
     "logprobs": st.booleans(), "top_logprobs": st.integers(-1, 30), "stop": st.one_of(TEXT, st.lists(TEXT)),
     "seed": NUM, "user": TEXT, "api_key": TEXT, "parallel_tool_calls": st.booleans(),
     "return_token_ids": st.booleans(), "chat_template_kwargs": JUNK, "metadata": JUNK},
)

# --- completions ------------------------------------------------------------------------------------------------
_COMPLETIONS = _with(
    {"model": MODEL, "prompt": st.one_of(TEXT, st.lists(st.integers(0, 2**31), min_size=1, max_size=8),
                                         st.lists(TEXT, min_size=1, max_size=2),
                                         st.lists(st.lists(st.integers(0, 50), max_size=3), min_size=1, max_size=2),
                                         JUNK)},
    {"stream": st.booleans(), "n": SMALL_N, "max_tokens": NUM, "logprobs": st.one_of(st.integers(-1, 6), JUNK),
     "echo": st.booleans(), "suffix": TEXT, "best_of": NUM, "stop": st.one_of(TEXT, st.lists(TEXT)),
     "temperature": NUM, "stream_options": _with({}, {"include_usage": st.booleans()}), "user": TEXT},
)

# --- responses ---------------------------------------------------------------------------------------------------
_RESP_PART = st.one_of(
    _with({"type": st.sampled_from(["input_text", "output_text", "text"]), "text": TEXT}, {}),
    _with({"type": st.just("refusal"), "refusal": TEXT}, {}),
    _with({"type": st.just("input_image")}, {"image_url": st.one_of(st.just("https://x.test/i.png"), JUNK),
                                             "file_id": TEXT}),
    _with({"type": st.sampled_from(["input_file", "input_audio", "", "nope"])}, {}),
    JUNK,
)
_RESP_CONTENT = st.one_of(TEXT, st.lists(_RESP_PART, max_size=3))
_ITEM = st.one_of(
    _with({"role": st.sampled_from(["user", "system", "developer", "assistant", "tool", ""]), "content": _RESP_CONTENT},
          {"type": st.just("message")}),
    _with({"type": st.just("function_call"), "call_id": TEXT, "name": TEXT,
           "arguments": st.one_of(st.just("{}"), TEXT)}, {"id": TEXT}),
    _with({"type": st.just("function_call_output"), "call_id": TEXT, "output": _RESP_CONTENT}, {}),
    _with({"type": st.just("reasoning")}, {"summary": JUNK}),
    _with({"type": st.sampled_from(["web_search_call", "file_search_call", "computer_call_output", "mcp_list_tools",
                                    "item_reference", "compaction", "custom_tool_call", "nope"])}, {"id": TEXT}),
    JUNK,
)
_RESP_TOOL = st.one_of(
    _with({"type": st.just("function"), "name": TEXT}, {"description": TEXT, "parameters": _SCHEMA,
                                                        "strict": st.one_of(st.booleans(), JUNK)}),
    _with({"type": st.sampled_from(["web_search", "file_search", "computer_use_preview", "code_interpreter", "mcp",
                                    "custom", "image_generation"])}, {}),
    JUNK,
)
_RESPONSES = _with(
    {"model": MODEL, "input": st.one_of(TEXT, st.lists(_ITEM, min_size=1, max_size=4))},
    {"instructions": st.one_of(TEXT, st.lists(_ITEM, max_size=2)), "tools": st.lists(_RESP_TOOL, max_size=3),
     "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "any"]),
                              _with({"type": st.sampled_from(["function", "web_search", "mcp"])}, {"name": TEXT}),
                              JUNK),
     "parallel_tool_calls": st.one_of(st.booleans(), JUNK), "max_output_tokens": NUM, "temperature": NUM,
     "top_p": NUM,
     "text": st.one_of(_with({}, {"format": st.one_of(
         st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "nope"}]),
         _with({"type": st.just("json_schema"), "name": TEXT, "schema": _SCHEMA}, {"strict": JUNK}), JUNK)}), JUNK),
     "stream": st.booleans(), "previous_response_id": st.one_of(st.just(PREV), st.just(PREV), TEXT),
     "store": st.booleans(), "metadata": JUNK, "include": JUNK, "reasoning": JUNK, "truncation": TEXT,
     "background": st.booleans(), "conversation": JUNK, "prompt": JUNK, "user": TEXT, "seed": NUM, "n": SMALL_N},
)

# --- Anthropic messages --------------------------------------------------------------------------------------------
_BLOCK = st.one_of(
    _with({"type": st.just("text"), "text": TEXT}, {"cache_control": JUNK}),
    _with({"type": st.just("image"), "source": st.one_of(
        _with({"type": st.just("url"), "url": TEXT}, {}),
        _with({"type": st.just("base64"), "data": TEXT}, {"media_type": TEXT}),
        _with({"type": st.sampled_from(["file", "", "nope"])}, {}), JUNK)}, {}),
    _with({"type": st.just("tool_use"), "id": TEXT, "name": TEXT}, {"input": st.one_of(st.just({"q": 1}), JUNK)}),
    _with({"type": st.just("tool_result"), "tool_use_id": TEXT},
          {"content": st.one_of(TEXT, st.lists(_with({"type": st.sampled_from(["text", "image"]), "text": TEXT}, {}),
                                               max_size=2), JUNK), "is_error": st.booleans()}),
    _with({"type": st.sampled_from(["thinking", "redacted_thinking"])}, {"thinking": TEXT, "signature": TEXT}),
    _with({"type": st.sampled_from(["document", "search_result", "server_tool_use", "web_search_tool_result",
                                    "container_upload", "mcp_tool_use", "nope", ""])}, {}),
    JUNK,
)
_AMSG = _with({"role": st.sampled_from(["user", "user", "assistant", "system", ""]),
               "content": st.one_of(TEXT, st.lists(_BLOCK, max_size=3))}, {})
_ATOOL = st.one_of(
    _with({"name": TEXT, "input_schema": _SCHEMA}, {"description": TEXT, "type": st.just("custom")}),
    _with({"type": st.sampled_from(["web_search_20250305", "bash_20250124", "text_editor_20250124"]),
           "name": TEXT}, {}),
    JUNK,
)
_MESSAGES = _with(
    {"model": MODEL, "max_tokens": st.one_of(st.integers(1, 64), NUM), "messages": st.lists(_AMSG, min_size=1,
                                                                                         max_size=4)},
    {"system": st.one_of(TEXT, st.lists(_BLOCK, max_size=2)), "tools": st.lists(_ATOOL, max_size=3),
     "tool_choice": st.one_of(_with({"type": st.sampled_from(["auto", "any", "tool", "none", "nope"])},
                                    {"name": TEXT, "disable_parallel_tool_use": st.one_of(st.booleans(), JUNK)}),
                              JUNK),
     "stop_sequences": st.one_of(st.lists(TEXT, max_size=3), JUNK), "temperature": NUM, "top_p": NUM,
     "top_k": NUM, "stream": st.booleans(),
     "output_config": st.one_of(_with({}, {"format": st.one_of(
         _with({"type": st.just("json_schema"), "schema": _SCHEMA}, {}), JUNK)}), JUNK),
     "metadata": JUNK, "thinking": JUNK, "service_tier": TEXT, "mcp_servers": JUNK, "container": JUNK,
     "n": SMALL_N},
)

# --- valid requests, with the features each API offers (a share of them then mutated) ------------------------
_SCHEMA_OK = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
_VALID_CHAT = _with(
    {"model": MODEL, "messages": st.one_of(
        st.lists(_with({"role": st.sampled_from(["user", "system", "user"]), "content": TEXT}, {}), min_size=1,
                 max_size=3),
        st.lists(_with({"role": st.just("user"), "content": st.lists(_with({"type": st.just("text"),
                                                                            "text": TEXT}, {}), min_size=1,
                                                                     max_size=2)}, {}), min_size=1, max_size=2),
        st.just(CONTINUATION))},
    {"stream": st.booleans(), "n": st.integers(1, MAX_N), "max_tokens": st.integers(1, 64),
     "temperature": st.floats(0, 2), "top_p": st.floats(0.1, 1),
     "tools": st.just([{"type": "function", "function": {"name": "lookup", "parameters": _SCHEMA_OK}}]),
     "tool_choice": st.sampled_from(["auto", "none"]), "stream_options": st.just({"include_usage": True}),
     "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5), "stop": st.lists(TEXT, max_size=2),
     "seed": st.integers(0, 2**31), "user": TEXT, "response_format": st.just({"type": "json_object"}),
     "parallel_tool_calls": st.booleans(), "api_key": st.just("sk-secret")},
)
_VALID_COMPLETIONS = _with(
    {"model": MODEL, "prompt": st.one_of(TEXT, st.lists(st.integers(0, 50_000), min_size=1, max_size=8))},
    {"stream": st.booleans(), "n": st.integers(1, MAX_N), "max_tokens": st.integers(1, 64),
     "logprobs": st.integers(0, 5), "echo": st.booleans(), "stop": st.lists(TEXT, max_size=2),
     "stream_options": st.just({"include_usage": True}), "temperature": st.floats(0, 2)},
)
_VALID_RESPONSES = _with(
    {"model": MODEL, "input": st.one_of(
        TEXT.filter(bool), st.lists(_with({"role": st.sampled_from(["user", "developer"]), "content": TEXT}, {}),
                                    min_size=1, max_size=2),
        st.just([{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                 {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"q": "x"}'},
                 {"type": "function_call_output", "call_id": "c1", "output": "found"}]))},
    {"instructions": TEXT, "stream": st.booleans(), "max_output_tokens": st.integers(1, 64),
     "temperature": st.floats(0, 2), "tools": st.just([{"type": "function", "name": "lookup",
                                                       "parameters": _SCHEMA_OK}]),
     "tool_choice": st.sampled_from(["auto", "none", "required"]), "previous_response_id": st.just(PREV),
     "store": st.booleans(), "text": st.just({"format": {"type": "json_object"}}), "metadata": st.just({"k": "v"}),
     "parallel_tool_calls": st.booleans()},
)
_VALID_MESSAGES = _with(
    {"model": MODEL, "max_tokens": st.integers(1, 64), "messages": st.one_of(
        st.lists(_with({"role": st.just("user"), "content": TEXT}, {}), min_size=1, max_size=2),
        st.just([{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                 {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "lookup",
                                                    "input": {"q": "x"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "found"}]}]))},
    {"system": st.one_of(TEXT, st.just([{"type": "text", "text": "be brief"}])), "stream": st.booleans(),
     "tools": st.just([{"name": "lookup", "description": "find", "input_schema": _SCHEMA_OK}]),
     "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                     {"type": "tool", "name": "lookup", "disable_parallel_tool_use": True}]),
     "stop_sequences": st.lists(TEXT, max_size=2), "temperature": st.floats(0, 1), "top_k": st.integers(1, 50),
     "metadata": st.just({"user_id": "u"}), "thinking": st.just({"type": "disabled"})},
)
BODIES = {route: st.one_of(valid, mutated(valid), base, mutated(base)) for route, valid, base in (
    ("chat", _VALID_CHAT, _CHAT), ("completions", _VALID_COMPLETIONS, _COMPLETIONS),
    ("responses", _VALID_RESPONSES, _RESPONSES), ("messages", _VALID_MESSAGES, _MESSAGES))}
