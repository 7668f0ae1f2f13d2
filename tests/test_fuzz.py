"""Property-based fuzzing of every proxy route: Hypothesis generates HTTP requests, a plain keep-alive client sends
them to a real proxy (RunningProxy over the scripted engine, recording into a tmp DuckDB), and every answer is checked.

Routes (docs/proxy.md): POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages and their
/e/<episode>/v1/... forms (valid, invalid and percent-encoded episode ids), GET /v1/models, the passthrough under
/v1/ (API endpoints the engine lacks, `..`, `%2e%2e`, long paths), GET /health, and the admin routes /harness/sql,
/harness/episodes, /harness/weights, /harness/status with and without the admin token. Bodies: valid requests with
fields mutated (wrong types, huge and negative numbers, nulls, unicode, nesting deeper than a JSON encoder takes,
unknown fields, broken tools), arbitrary JSON values, bytes, empty bodies, wrong content types, gzip/deflate
bodies (real and fake), chunked uploads, bodies up to 1 MB (the proxy here takes 512 KiB).

Properties of each answer:
- no status >= 500, except a 501 whose error says the feature or endpoint is not offered (502/503/504 would mean
  the scripted engine failed, which it does not);
- every 4xx/5xx body is an OpenAI-style JSON error (on /v1/messages the Anthropic shape is accepted too); the one
  exemption: aiohttp's HTTP parser answers a request that breaks HTTP or its limits (request line or header over
  8190 bytes, a repeated Content-Type or Host, a method it does not know, a Content-Encoding it cannot decode) with
  a plain-text 400 before any proxy code runs: such requests are generated on purpose, marked, and must get a 400;
- an answer within 5 s (a hang is a violation), never a dropped connection;
- documented specifics: a bad episode id is a 400 `invalid_episode_id`; an admin route without the admin token is a
  401 and with it is not; SQL that writes never runs; /health is 200; a 200 stream ends with its terminator
  ([DONE], message_stop, response.completed/incomplete) and carries no error event; a weight version or an episode
  the admin routes accept is recordable (a call made right after lands in the database);
- the engine never receives a path outside its /v1/, and never fails; the proxy logs no error.
After the run: /health is 200, a normal chat call works and is recorded, the proxy thread is alive, the recorder
spilled nothing; after close, the DuckDB file opens, `SELECT count(*) FROM calls` works, and every 200 of a
recorded route is exactly one `ok` call.

Size: HARNESS_FUZZ_REQUESTS (default 3000) generated requests, split across the plans by weight, plus the explicit
examples (earlier findings, sent on every run) and the probe requests. `n` is clamped to 3 in what is sent: the
scripted engine builds n choices in memory. Figures (requests sent, status histogram, seconds, requests/s,
violations) are printed and, if HARNESS_FUZZ_REPORT names a file, written there as JSON. By default every violation
is collected and the test fails at the end listing each kind once with its smallest example; HARNESS_FUZZ_SHRINK=1
stops a plan at its first violation instead and lets Hypothesis shrink it to a minimal request. Reproducible:
derandomized, no example database.
"""

from __future__ import annotations

import copy
import gzip
import http.client
import json
import logging
import os
import re
import time
import uuid
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import orjson
import pytest
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from proxy.scripted import ScriptedEngine
from tests.support import BackgroundLoop, RunningProxy, ScriptedUpstream, db_rows

TOTAL = int(os.environ.get("HARNESS_FUZZ_REQUESTS", "3000"))
REPORT = os.environ.get("HARNESS_FUZZ_REPORT")
SHRINK = os.environ.get("HARNESS_FUZZ_SHRINK", "") not in ("", "0")
MAX_BODY = 512 * 1024  # the proxy's max_body_bytes here: generated bodies go up to 1 MB, on both sides of it
LINE_LIMIT = 8190  # aiohttp's limit on a request line / header line
TIMEOUT_S = 5.0  # per request: no answer within this is a hang (the scripted engine answers in milliseconds)
MAX_N = 3  # the scripted engine builds n choices in memory: n stays small where a request may reach it

# Share of the generated requests per plan.
WEIGHTS = {"chat": 0.19, "completions": 0.08, "responses": 0.12, "messages": 0.12, "raw": 0.12, "passthrough": 0.09,
           "models": 0.03, "health": 0.02, "sql": 0.06, "episodes": 0.03, "weights": 0.02, "status": 0.02,
           "protocol": 0.10}
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


@st.composite
def llm_request(draw, route: str) -> Req:
    body = draw(BODIES[route])
    prefix, bad = draw(episode_prefix())
    query = draw(st.sampled_from(["", "", "", "?", "?x=1", "?stream=true&api-version=2024-01-01", "?%zz"]))
    return Req(route, "POST", f"{prefix}/v1/{LLM_PATHS[route]}{query}", draw(headers()), body,
               encoding=draw(ENCODING), chunked=draw(st.integers(0, 9)) == 0, route=route, bad_episode=bad)


INVALID_JSON = [b"{", b'{"model":', b"{'a': 1}", b"NaN", b'{"a": NaN}', b"[1,]", b'{"a":1,}', b"\xef\xbb\xbf{}",
                b"{} {}", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', b'{"n": 1e400}',
                b'{"n": 123456789012345678901234567890}', b'{"max_tokens": 1e400, "model": "m"}', b"\x00",
                "{}".encode("utf-16"), b"\xff\xfe", b"true", b"null", b'"str"', b"12", b"[]", b"{}",
                b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}',
                b'{"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}',
                b'{"model": "m", "input": "hi"}', b'{"model": "m", "prompt": "hi"}', b'{"sql": "SELECT 1"}',
                b'{"a": 1, "a": 2}', b'{"model": "m", "messages": [], "messages": [{"role": "user"}]}']
HUGE = st.builds(Huge, st.sampled_from([4096, 65536, 300_000, MAX_BODY - 4096, MAX_BODY + 1, 1_000_000]),
                 st.sampled_from(["chat", "messages", "junk", "array"]))
RAW_PAYLOAD = st.one_of(st.binary(max_size=256), st.just(b""), st.sampled_from(INVALID_JSON), JSON,
                        DEEP, HUGE, st.none())


@st.composite
def raw_request(draw) -> Req:
    """Anything as the body of a recorded route or an admin POST route."""
    route = draw(st.sampled_from([*RECORDED, "sql", "episodes", "weights"]))
    if route in RECORDED:
        prefix, bad = draw(episode_prefix())
        path, auth = f"{prefix}/v1/{LLM_PATHS[route]}", AGENT_AUTH
    else:
        path, bad, auth = f"/harness/{route}", False, st.just([("Authorization", "Bearer " + ADMIN)])
    return Req("raw", "POST", path, draw(headers(auth)), draw(RAW_PAYLOAD), encoding=draw(ENCODING),
               chunked=draw(st.integers(0, 5)) == 0, route=route, bad_episode=bad,
               admin="" if route in RECORDED else "admin")


_SEGMENTS = ["embeddings", "audio/speech", "images/generations", "messages/count_tokens", "moderations", "files",
             "responses/resp_1/cancel", "chat", "chat/completions/", "completions/", "tokenize", "detokenize",
             "health", "metrics", "models/gpt-4o", "..", ".", "%2e%2e", "%2E%2E", ".%2e", "%2F", "%5C", "\\", "%00",
             "%", "%zz", "", "collective_rpc", "pause", "reset_prefix_cache", "x/../../pause", "%2e%2e/%2e%2e/pause",
             "chat%2Fcompletions", "%C3%A9", "%FF", "~", "a;b=c", "@", ":", "v1", "e", "harness/sql", "realtime",
             "videos", "rerank", "score", "pooling", "classify", "load_lora_adapter", "sleep", "wake_up"]
_TAIL = st.one_of(
    st.lists(st.sampled_from(_SEGMENTS), min_size=1, max_size=4).map("/".join),
    st.text(min_size=1, max_size=20).map(lambda s: quote(s, safe="/")),
    st.integers(100, 7900).map(lambda n: "x" * n),
)


@st.composite
def passthrough_request(draw) -> Req:
    prefix, _ = draw(episode_prefix())
    tail = draw(_TAIL)
    query = draw(st.sampled_from(["", "", "?a=1", "?model=x&&", "?%"]))
    method = draw(st.sampled_from(["GET", "GET", "POST", "POST", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS"]))
    payload = draw(st.one_of(st.none(), _with({"model": MODEL}, {"input": JUNK}), RAW_PAYLOAD))
    path = f"{prefix}/v1/{tail}{query}"
    return Req("passthrough", method, path, draw(headers()), payload, encoding=draw(ENCODING), route="passthrough",
               breaks_http=len(path) > LINE_LIMIT - 64)


@st.composite
def models_request(draw) -> Req:
    prefix, _ = draw(episode_prefix())
    method = draw(st.sampled_from(["GET", "GET", "GET", "HEAD", "POST", "DELETE"]))
    query = draw(st.sampled_from(["", "", "?limit=1", "?%zz", "?a=" + "b" * 100]))
    return Req("models", method, f"{prefix}/v1/models{query}", draw(headers()),
               draw(st.one_of(st.none(), st.none(), RAW_PAYLOAD)), route="models")


@st.composite
def health_request(draw) -> Req:
    method = draw(st.sampled_from(["GET", "GET", "GET", "HEAD", "POST", "PUT"]))
    path = "/health" + draw(st.sampled_from(["", "", "?x=1", "?%zz", "/", "/x"]))
    payload = draw(st.one_of(st.none(), st.none(), RAW_PAYLOAD))
    plain = method == "GET" and (path == "/health" or path.startswith("/health?"))
    return Req("health", method, path, draw(headers()), payload, route="health" if plain else "other")


# --- admin -----------------------------------------------------------------------------------------------------------
_ADMIN_AUTH = st.sampled_from([
    *[("admin", [("Authorization", "Bearer " + ADMIN)])] * 12, ("none", []),
    ("wrong", [("Authorization", "Bearer hx-admin-wrong")]), ("wrong", [("Authorization", "Bearer " + TOKEN)]),
    ("wrong", [("Authorization", "Bearer " + ADMIN + "x")]), ("wrong", [("Authorization", "Bearer")]),
    ("", [("Authorization", "bearer " + ADMIN)]), ("", [("Authorization", "Bearer   " + ADMIN + "  ")]),
    ("", [("Authorization", "Basic " + ADMIN)]), ("", [("x-api-key", ADMIN)]), ("", [("api-key", ADMIN)]),
    ("", [("Authorization", ADMIN)]), ("", [("Authorization", "Bearer " + ADMIN), ("Authorization", "Bearer x")]),
])
SQL_READ = ["SELECT 1", "SELECT count(*) FROM calls", "SELECT status, count(*) FROM calls GROUP BY 1",
            "SELECT call_id, status FROM calls LIMIT 2", "SELECT * FROM episodes LIMIT 3", "SELECT ?", "SELECT ?, ?",
            "SELECT $1", "SELECT $x", "FROM calls SELECT call_id LIMIT 1", "DESCRIBE calls", "SHOW TABLES",
            "PRAGMA version", "EXPLAIN SELECT 1", "SUMMARIZE SELECT 1 AS x",
            "WITH t AS (SELECT 1 AS a) SELECT * FROM t", "SELECT 1; SELECT 2", "VALUES (1), (2)",
            "SELECT * FROM range(5)", "SELECT 170141183460469231731687303715884105727::HUGEINT",
            "SELECT -170141183460469231731687303715884105728::HUGEINT",
            "SELECT 340282366920938463463374607431768211455::UHUGEINT", "SELECT 18446744073709551615::UBIGINT",
            "SELECT MAP {1: 'a'}", "SELECT MAP {'k': 1}", "SELECT {'a': [1, 2]}", "SELECT 'x'::BLOB",
            "SELECT uuid()", "SELECT INTERVAL 3 DAY", "SELECT DATE '2024-01-01'", "SELECT 1.5::DECIMAL(38, 10)",
            "SELECT 'nan'::DOUBLE, 'inf'::DOUBLE", "SELECT [1, NULL]", "SELECT union_value(k := 1)",
            "SELECT '101'::BIT", "SELECT TIMESTAMPTZ '2024-01-01 00:00:00+00'", "SELECT TIME '12:00'",
            "SELECT NULL", "SELECT '\\x00'", "SELECT 'é😀'", "SELECT [MAP {[1]: 2}]", "SELECT", "SELEC nonsense",
            "", ";", "   ", "-- only a comment", "SELECT * FROM nowhere", "SELECT 1/0", "SELECT 'a'::INT"]
SQL_WRITE = ["DELETE FROM calls", "DROP TABLE calls", "INSERT INTO calls SELECT * FROM calls",
             "UPDATE calls SET status = 'x'", "COPY calls TO '/tmp/harness-fuzz.csv'", "CREATE TABLE t (a INT)",
             "ATTACH ':memory:' AS m", "SET threads = 1", "CALL pragma_version()",
             "WITH x AS (DELETE FROM calls RETURNING *) SELECT 1", "INSTALL httpfs", "LOAD httpfs", "CHECKPOINT",
             "VACUUM", "BEGIN", "COMMIT", "ROLLBACK", "EXPORT DATABASE '/tmp/harness-fuzz-export'",
             "PRAGMA enable_profiling", "EXPLAIN ANALYZE DELETE FROM calls", "SELECT 1; DROP TABLE calls",
             "DETACH DATABASE memory", "USE memory", "CREATE MACRO f(a) AS a", "TRUNCATE calls"]
_SQL = st.one_of(st.sampled_from(SQL_READ), st.sampled_from(SQL_READ), st.sampled_from(SQL_WRITE), TEXT, JUNK)
_MAX_ROWS = st.one_of(st.none(), st.sampled_from([0, 1, 5, -1, 2**63 - 1, 2**63, 2**64 - 1, 1.5, "3", True]), JUNK)


@st.composite
def admin_request(draw, route: str) -> Req:
    label, auth = draw(_ADMIN_AUTH)
    if route == "sql":
        payload = draw(st.one_of(_with({"sql": _SQL}, {"params": st.one_of(st.lists(LEAF, max_size=3), JUNK),
                                                         "max_rows": _MAX_ROWS}), mutated(_with({"sql": _SQL}, {}))))
    elif route == "episodes":
        payload = draw(st.one_of(_with({}, {"episode_id": st.one_of(_VALID_EPISODE, _CLEAN_INVALID, JUNK),
                                            "meta": JUNK}), JUNK))
    elif route == "weights":
        payload = draw(st.one_of(_with({"version": st.one_of(st.integers(0, 1000), st.sampled_from(INTS), JUNK)},
                                       {}), JUNK))
    else:
        payload = draw(st.one_of(st.none(), st.none(), RAW_PAYLOAD))
    method = "GET" if route == "status" else "POST"
    if draw(st.integers(0, 15)) == 0:
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD"]))
    hdrs = auth + [("Content-Type", "application/json")] + draw(EXTRA_HEADERS)
    expected_method = method == ("GET" if route == "status" else "POST")
    return Req(route, method, f"/harness/{route}", hdrs, payload, route=route if expected_method else "other",
               admin=label if expected_method else "")


# --- HTTP-level oddities ---------------------------------------------------------------------------------------------
_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/models", "/health",
           "/harness/sql", "/harness/status", "/v1/embeddings", "/e/ep-1/v1/chat/completions"]


@st.composite
def protocol_request(draw) -> Req:
    """Requests odd at the HTTP level: long lines and headers, many headers, odd methods and targets."""
    target = draw(st.sampled_from(_ROUTES))
    kind = draw(st.sampled_from(["long_query", "long_path", "long_header", "many_headers", "method", "target",
                                 "dup_headers", "dup_singleton", "latin1", "br"]))
    method, hdrs, breaks = draw(st.sampled_from(["GET", "POST"])), [("Content-Type", "application/json")], False
    payload = draw(st.one_of(st.none(), st.sampled_from(INVALID_JSON)))
    encoding = None
    if kind == "long_query":
        n = draw(st.sampled_from([1000, 8000, 8100, 8200, 9000, 20000]))
        target, breaks = f"{target}?q={'a' * n}", n > 8000
    elif kind == "long_path":
        n = draw(st.sampled_from([1000, 8000, 8100, 8200, 9000, 20000]))
        target, breaks = f"/v1/{'p' * n}", n > 8000
    elif kind == "long_header":
        n = draw(st.sampled_from([1000, 8000, 8100, 8200, 9000, 20000]))
        name = draw(st.sampled_from(["X-Long", "Authorization", "Content-Type"]))
        hdrs = [h for h in hdrs if h[0] != name] + [(name, "v" * n)]
        breaks = n > 8000
    elif kind == "many_headers":
        hdrs += [(f"X-H{i}", "v") for i in range(draw(st.sampled_from([50, 200, 1000])))]
        breaks = True
    elif kind == "method":
        method = draw(st.sampled_from(["FOO", "TRACE", "CONNECT", "PROPFIND", "get", "OPTIONS", "PATCH"]))
        breaks = method in ("CONNECT", "get", "FOO")  # methods aiohttp's parser does not know
        payload = None if method == "CONNECT" else payload  # a CONNECT has no body: one would be the next request
    elif kind == "target":
        target = draw(st.sampled_from(["v1/models", "*", "http://127.0.0.1/v1/models", "//v1/models", "/v1//models",
                                       "/./v1/models", "/v1/models#frag", "/v1/models?#", "/%2Fv1/models", "/?",
                                       "/e//v1/models", "/e/ep-1/v1/", "/v1/", "/v1", "/e/ep-1", "/harness/",
                                       "/HEALTH", "/health/", "/v1/Chat/Completions"]))
        breaks = target in ("v1/models", "*", "http://127.0.0.1/v1/models")
    elif kind == "dup_headers":
        hdrs += [("Authorization", "Bearer a"), ("Authorization", "Bearer b"), ("x-api-key", "a"), ("x-api-key", "b")]
    elif kind == "dup_singleton":  # aiohttp refuses a repeated Content-Type, Host, User-Agent...
        hdrs.append(draw(st.sampled_from([("Content-Type", "text/plain"), ("Host", "other"), ("User-Agent", "a"),
                                          ("User-Agent", "b")])))
        hdrs += [("User-Agent", "fuzz")] if hdrs[-1][0] == "User-Agent" else []
        breaks = True
    elif kind == "latin1":  # obs-text (0x80-0xff) in a header value is legal HTTP
        hdrs = [(draw(st.sampled_from(["Authorization", "x-api-key", "Content-Type", "X-Any"])), draw(LATIN1))]
    else:
        encoding, breaks = "br", True
    route = "health" if target == "/health" and method == "GET" and kind != "method" else "other"
    return Req("protocol", method, target, hdrs, payload, encoding=encoding, route=route, breaks_http=breaks)


# Explicit examples, sent on every run before the generated ones: the fuzzer's earlier findings, so each stays
# covered whatever the generated sample happens to hold.
_J = [("Content-Type", "application/json")]
_A = [("Authorization", "Bearer " + ADMIN), *_J]
_HI = [{"role": "user", "content": "hi"}]
_DEEP = Deep(300, "list")  # deeper than orjson.dumps takes (255), shallower than orjson.loads refuses (1024)
EXPLICIT = {
    "chat": [Req("chat", "POST", "/v1/chat/completions", _J, {"model": "m", "messages": _HI, "x": _DEEP},
                 route="chat"),
             Req("chat", "POST", "/v1/chat/completions", _J, {"model": "m", "messages": _HI}, encoding="gzip-fake",
                 route="chat")],
    "completions": [Req("completions", "POST", "/v1/completions", _J, {"model": "m", "prompt": "hi", "x": _DEEP},
                        route="completions")],
    "responses": [Req("responses", "POST", "/v1/responses", _J, {"model": "m", "input": "hi", "seed": _DEEP},
                      route="responses")],
    "messages": [Req("messages", "POST", "/v1/messages", _J,
                     {"model": "m", "max_tokens": 4, "messages": _HI,
                      "tools": [{"name": "t", "input_schema": {"a": _DEEP}}]}, route="messages")],
    "passthrough": [Req("passthrough", "POST", "/v1/embeddings", _J, {"model": "m", "input": "hi"},
                        encoding="deflate-fake", route="passthrough"),
                    Req("passthrough", "POST", "/v1/embeddings", _J, {"model": "m", "input": _DEEP},
                        route="passthrough")],
    "sql": [Req("sql", "POST", "/harness/sql", _A, body, route="sql", admin="admin") for body in (
        {"sql": "SELECT 170141183460469231731687303715884105727::HUGEINT"}, {"sql": "SELECT MAP {1: 'a'}"},
        {"sql": "SELECT 1", "max_rows": 2**64 - 1}, {"sql": "SELECT ?", "params": [_DEEP]})],
    "episodes": [Req("episodes", "POST", "/harness/episodes", _A, {"episode_id": "deep-meta", "meta": {"a": _DEEP}},
                     route="episodes", admin="admin")],
    "weights": [Req("weights", "POST", "/harness/weights", _A, {"version": 2**31}, route="weights", admin="admin")],
}

PLANS = {
    "chat": llm_request("chat"), "completions": llm_request("completions"), "responses": llm_request("responses"),
    "messages": llm_request("messages"), "raw": raw_request(), "passthrough": passthrough_request(),
    "models": models_request(), "health": health_request(), "sql": admin_request("sql"),
    "episodes": admin_request("episodes"), "weights": admin_request("weights"), "status": admin_request("status"),
    "protocol": protocol_request(),
}


# ---------------------------------------------------------------------------------------------------------------
# Sending and checking.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int | None  # None: no answer (connection dropped, timeout)
    content_type: str = ""
    body: bytes = b""
    error: str = ""


@dataclass
class Violation:
    signature: str
    count: int = 0
    request: str = ""
    answer: str = ""
    log: str = ""
    size: int = 1 << 62


class LogTrap(logging.Handler):
    """Collects the proxy's and aiohttp's warnings and errors (emitted on the proxy's thread)."""

    NAMES = ("harness", "proxy", "aiohttp", "asyncio")

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self._levels = {}

    def emit(self, record):
        self.records.append(record)

    def install(self):
        for name in self.NAMES:
            logger = logging.getLogger(name)
            self._levels[name] = logger.level
            if logger.getEffectiveLevel() > logging.WARNING:
                logger.setLevel(logging.WARNING)
            logger.addHandler(self)

    def remove(self):
        for name in self.NAMES:
            logger = logging.getLogger(name)
            logger.removeHandler(self)
            logger.setLevel(self._levels[name])


def _errors(records) -> list[logging.LogRecord]:
    return [r for r in records if r.levelno >= logging.ERROR]


def _parser_log(record: logging.LogRecord) -> bool:
    """aiohttp's log of a request its HTTP parser refused (it answers a plain-text 400 itself)."""
    exc = record.exc_info[1] if record.exc_info else None
    return record.name.startswith("aiohttp") and isinstance(exc, HttpProcessingError) and \
        record.getMessage().startswith("Error handling request")


def _render(record: logging.LogRecord) -> str:
    text = f"{record.name} {record.levelname}: {record.getMessage()}"
    if record.exc_info:
        text += "\n" + "".join(logging.Formatter().formatException(record.exc_info))
    return text


def _exc_line(records) -> str:
    """The last line of the first traceback logged (e.g. 'TypeError: Recursion limit reached')."""
    for r in records:
        if r.exc_info and r.exc_info[1] is not None:
            return f"{type(r.exc_info[1]).__name__}: {str(r.exc_info[1]).splitlines()[0] if str(r.exc_info[1]) else ''}"
    return ""


def _normalize(text: str) -> str:
    """A log message without paths, ids and numbers, to group violations."""
    text = re.sub(r"\b([A-Z]{3,7}) /\S*", r"\1 <path>", text.split("; spilling")[0])
    text = re.sub(r"(call|episode) \S+ could not", r"\1 <id> could not", text)
    return re.sub(r"[0-9a-f]{12,}|\d+", "<n>", text)[:160]


class SpiedUpstream(ScriptedUpstream):
    """The scripted engine, noting every path it is asked for and every answer >= 500 it gives."""

    def __init__(self):
        self.bg = BackgroundLoop()
        self.engine = ScriptedEngine()
        self.paths: list[str] = []
        self.failures: list[str] = []

        @web.middleware
        async def spy(request, handler):
            self.paths.append(request.raw_path)
            try:
                resp = await handler(request)
            except web.HTTPException:
                raise
            except Exception as exc:
                self.failures.append(f"{request.method} {request.raw_path}: {exc!r}")
                raise
            if resp.status >= 500:
                self.failures.append(f"{request.method} {request.raw_path}: {resp.status}")
            return resp

        self.engine.app.middlewares.append(spy)
        self.url = self.bg.run(self.engine.start())


def _escapes_v1(raw_path: str) -> bool:
    """A path the engine got that is not under its /v1/ (its admin routes sit beside /v1)."""
    path = raw_path.split("?", 1)[0]
    if path in ("/tokenize", "/detokenize", "/health"):  # token-exact continuity asks these
        return False
    decoded = path
    for _ in range(3):
        decoded = decoded.replace("%2e", ".").replace("%2E", ".").replace("%2f", "/").replace("%2F", "/")
    return not path.startswith("/v1/") or any(seg in (".", "..") for seg in decoded.split("/"))


def _error_shape(body: bytes, anthropic_ok: bool) -> dict | None:
    """The error object of an OpenAI-style (or, where allowed, Anthropic-style) error body, else None."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return None
    if anthropic_ok and obj.get("type") == "error" and isinstance(err.get("type"), str):
        return err
    return err if "type" in err and "code" in err else None


def _not_offered(err: dict) -> bool:
    if err.get("code") == "not_implemented":
        return True
    message = err.get("message", "").lower()
    return any(s in message for s in ("not offered", "not supported", "does not offer"))


def _stream_problem(route: str, body: bytes) -> str | None:
    events = [e for e in body.decode("utf-8", "replace").replace("\r\n", "\n").split("\n\n") if e.strip()]
    if not events:
        return "a 200 stream with no event"
    for event in events:
        if event.startswith("event: error") or event.startswith("event: response.failed"):
            return f"the stream carries an error event: {event[:300]}"
        if event.startswith("data: {") and '"error"' in event:
            try:
                if "error" in orjson.loads(event[6:]):
                    return f"the stream carries an error chunk: {event[:300]}"
            except orjson.JSONDecodeError:
                return f"a stream chunk that is not JSON: {event[:300]}"
    last = events[-1]
    ends = {"chat": ("data: [DONE]",), "completions": ("data: [DONE]",), "messages": ("event: message_stop",),
            "responses": ("event: response.completed", "event: response.incomplete")}.get(route)
    if ends and not any(last.startswith(end) for end in ends):
        return f"the stream does not end with {' or '.join(ends)}: ...{last[-300:]}"
    return None


def _is_llm_answer(answer: Answer) -> bool:
    """A 200 of a recorded route: a chat/completions/responses/messages answer, whole or streamed."""
    if answer.status != 200:
        return False
    if answer.content_type.startswith("text/event-stream"):
        return True
    try:
        obj = orjson.loads(answer.body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and (obj.get("object") in ("chat.completion", "text_completion", "response")
                                      or obj.get("type") == "message")


def _render_deep(deep: Deep) -> bytes:
    if deep.kind == "list":
        return b"[" * deep.depth + b"1" + b"]" * deep.depth
    return b'{"a":' * deep.depth + b"1" + b"}" * deep.depth


def _render_huge(huge: Huge) -> bytes:
    if huge.kind == "chat":
        return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * huge.size}],
                             "max_tokens": 4})
    if huge.kind == "messages":
        return orjson.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "y" * huge.size}]})
    if huge.kind == "array":
        return b"[" + b"1," * (huge.size // 2) + b"1]"
    return bytes(range(256)) * (huge.size // 256)


class Fuzzer:
    def __init__(self, proxy: RunningProxy, upstream: SpiedUpstream, trap: LogTrap):
        self.proxy, self.upstream, self.trap = proxy, upstream, trap
        self.host, port = proxy.url.rsplit("/", 1)[1].split(":")
        self.port = int(port)
        self.conn: http.client.HTTPConnection | None = None
        self.tokens: list[str] = []
        self.response_ids: list[str] = []
        self.sent = 0
        self.statuses: Counter = Counter()
        self.by_plan: Counter = Counter()
        self.route_statuses: Counter = Counter()
        self.wire_seconds: Counter = Counter()  # per plan, the time spent waiting for the proxy
        self.slowest = 0.0  # the longest wait for an answer that came
        self.checks: Counter = Counter()  # how often each specific property was checked
        self.llm_ok = 0  # 200s of recorded routes: each must be one ok call in the database
        self.parser_rejects = 0
        self.violations: dict[str, Violation] = {}
        self.probe_n = 0
        self.last_breaks = -10  # the index of the latest request that may break aiohttp's HTTP parser

    # ---- the wire ------------------------------------------------------------------------------------------
    def _resolve(self, value, deeps: list):
        if isinstance(value, Deep):
            deeps.append(value)
            return f"\x00deep{len(deeps) - 1}"
        if isinstance(value, dict):
            return {k: self._resolve(v, deeps) for k, v in value.items()}
        if isinstance(value, list):
            return [self._resolve(v, deeps) for v in value]
        if isinstance(value, str) and "\x00" in value:
            token = self.tokens[self.sent % len(self.tokens)] if self.tokens else "hx-ep-none"
            prev = self.response_ids[self.sent % len(self.response_ids)] if self.response_ids else "resp_unknown"
            return value.replace(ADMIN, self.proxy.config.admin_token).replace(TOKEN, token).replace(PREV, prev)
        return value

    def body_of(self, req: Req) -> bytes | None:
        payload = req.payload
        if payload is None:
            data = None
        elif isinstance(payload, bytes):
            data = payload
        elif isinstance(payload, Huge):
            data = _render_huge(payload)
        else:
            deeps: list[Deep] = []
            payload = self._resolve(payload, deeps)
            if isinstance(payload, dict) and type(payload.get("n")) is int and payload["n"] > MAX_N:
                payload["n"] = MAX_N  # the scripted engine would build that many choices (vLLM refuses them)
            data = orjson.dumps(payload)
            for i, deep in enumerate(deeps):
                data = data.replace(b'"\\u0000deep%d"' % i, _render_deep(deep), 1)
        if data is None or req.encoding in (None, "identity", "br") or req.encoding.endswith("-fake"):
            return data
        return gzip.compress(data, mtime=0) if req.encoding == "gzip" else zlib.compress(data)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def exchange(self, req: Req, body: bytes | None) -> Answer:
        hdrs = [(k, self._resolve(v, [])) for k, v in req.headers]
        if req.encoding is not None:
            hdrs.append(("Content-Encoding", req.encoding.removesuffix("-fake")))
        for _ in range(2):
            fresh = self.conn is None
            if fresh:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT_S)
            conn = self.conn
            try:
                conn.putrequest(req.method, req.path, skip_accept_encoding=True)
                for name, value in hdrs:
                    conn.putheader(name, value)
                if body is not None:
                    conn.putheader(*(("Transfer-Encoding", "chunked") if req.chunked
                                     else ("Content-Length", str(len(body)))))
                try:
                    conn.endheaders()
                    if body is not None and req.chunked:
                        for i in range(0, len(body), 4096):
                            piece = body[i:i + 4096]
                            conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
                        conn.send(b"0\r\n\r\n")
                    elif body:
                        conn.send(body)
                except (BrokenPipeError, ConnectionResetError):
                    if not fresh:
                        raise
                    # the server answered before taking the whole body (a refused header, a body too large)
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if fresh or isinstance(exc, TimeoutError):
                    return Answer(None, error=f"{type(exc).__name__}: {exc}")
                continue  # a kept-alive connection the server had closed: once more on a fresh one
            parser_answer = req.breaks_http and "json" not in (resp.getheader("Content-Type") or "")
            if resp.will_close or parser_answer:  # what the parser left unread must not become the next request
                self.close()
            return Answer(resp.status, resp.getheader("Content-Type") or "", data)
        return Answer(None, error="no answer on a fresh connection")

    # ---- one request, checked ------------------------------------------------------------------------------
    def send(self, req: Req) -> tuple[Answer, list[str]]:
        body = self.body_of(req)
        logs_before, paths_before, fails_before = len(self.trap.records), len(self.upstream.paths), \
            len(self.upstream.failures)
        t0 = time.perf_counter()
        answer = self.exchange(req, body)
        took = time.perf_counter() - t0
        self.wire_seconds[req.plan] += took
        if answer.status is not None:
            self.slowest = max(self.slowest, took)
        self.sent += 1
        self.by_plan[req.plan] += 1
        status = str(answer.status) if answer.status is not None else "no answer"
        self.statuses[status] += 1
        self.route_statuses[f"{req.route or req.plan} {status}"] += 1
        logs = self.trap.records[logs_before:]
        problems = self.check(req, answer, logs)
        for path in self.upstream.paths[paths_before:]:
            if _escapes_v1(path):
                problems.append(f"the engine was asked for {path!r}, outside its /v1/")
        problems += [f"the scripted engine failed: {f}" for f in self.upstream.failures[fails_before:]]
        if answer.status == 400 and answer.content_type.startswith("text/plain") and req.breaks_http:
            self.parser_rejects += 1
        if _is_llm_answer(answer):
            self.llm_ok += 1
        if problems:
            self.note(req, body, answer, logs, problems)
        return answer, problems

    def check(self, req: Req, answer: Answer, logs) -> list[str]:
        s, problems = answer.status, []
        errors = _errors(logs)
        if req.breaks_http:
            self.last_breaks = self.sent
        if self.sent - self.last_breaks <= 2:  # aiohttp's parser answered (and logged) a request breaking HTTP
            errors = [r for r in errors if not _parser_log(r)]
        if s is not None and s >= 500:  # the middleware's log of a 500: reported with the status below
            errors = [r for r in errors if not r.getMessage().startswith("internal error serving")]
        if errors:
            problems.append(f"the proxy logged an error: {_normalize(errors[0].getMessage())} "
                            f"{_exc_line(errors)}".rstrip())
        if s is None:
            if req.breaks_http and answer.error.startswith(("BrokenPipeError", "ConnectionResetError")):
                return problems  # refused by aiohttp's parser while the body was still on its way
            return [f"no answer ({answer.error.split(':')[0]})", *problems]
        anthropic_ok = req.route == "messages" or "/v1/messages" in req.path
        err = _error_shape(answer.body, anthropic_ok) if s >= 400 else None
        if s >= 400 and req.method != "HEAD" and err is None:
            plain_400 = s == 400 and answer.content_type.startswith("text/plain") and req.breaks_http
            if not plain_400:
                problems.append(f"a {s} whose body is not a JSON error")
        if s >= 500 and not (s == 501 and (err is not None and _not_offered(err) or req.method == "HEAD")):
            problems.append(f"status {s}" + (f" ({_exc_line(logs)})" if _exc_line(logs) else ""))
        for name, applies in (("invalid episode id", req.bad_episode and req.route in RECORDED),
                              ("admin route refused", req.admin in ("none", "wrong")),
                              ("admin route allowed", req.admin == "admin"),
                              ("write SQL refused", req.route == "sql" and req.admin == "admin"
                               and isinstance(req.payload, dict) and req.payload.get("sql") in SQL_WRITE),
                              (f"{req.route} 200 stream complete", s == 200 and req.method != "HEAD"
                               and answer.content_type.startswith("text/event-stream")),
                              ("HTTP parser limit", req.breaks_http)):
            if applies:
                self.checks[name] += 1
        if req.bad_episode and req.method == "POST" and req.route in RECORDED and s != 400:
            problems.append(f"an invalid episode id got {s}, not 400")
        elif req.bad_episode and err is not None and req.route in RECORDED and \
                not (err.get("code") == "invalid_episode_id" or "episode id" in err.get("message", "")):
            problems.append("an invalid episode id got a 400 that does not say so")
        if req.admin in ("none", "wrong") and (s != 401 or (err or {}).get("code") != "invalid_admin_token"):
            problems.append(f"an admin route without the admin token ({req.admin}) got {s}")
        if req.admin == "admin" and s == 401:
            problems.append("an admin route with the admin token got 401")
        if req.route == "sql" and req.admin == "admin" and s == 200 and isinstance(req.payload, dict) \
                and req.payload.get("sql") in SQL_WRITE:
            problems.append("SQL that writes ran")
        if req.route == "health" and req.method == "GET" and s != 200 and not req.breaks_http:
            problems.append(f"GET /health got {s}")
        if s == 200 and req.method != "HEAD":
            if answer.content_type.startswith("text/event-stream"):
                problem = _stream_problem(req.route, answer.body)
                if problem:
                    problems.append(problem)
            elif answer.content_type.startswith("application/json"):
                try:
                    orjson.loads(answer.body)
                except orjson.JSONDecodeError:
                    problems.append("a 200 whose JSON body does not parse")
        return problems

    def note(self, req: Req, body: bytes | None, answer: Answer, logs, problems: list[str]) -> None:
        for problem in problems:
            signature = problem.splitlines()[0][:200]
            if not signature.startswith("the proxy logged"):  # a log line may come a little after its request
                signature = f"{req.route or req.plan} {req.method}: {signature}"
            v = self.violations.setdefault(signature, Violation(signature))
            v.count += 1
            size = len(body or b"") + len(req.path)
            if size < v.size:
                shown = body if body is None or len(body) <= 600 else body[:600] + b"...(%d bytes)" % len(body)
                hdrs = [(name, self._resolve(value, [])) for name, value in req.headers]
                v.size = size
                v.request = (f"{req.method} {req.path[:300]}{'...' if len(req.path) > 300 else ''}\nheaders: "
                             f"{hdrs}\nencoding: {req.encoding} chunked: {req.chunked}\nbody: {shown!r}")
                v.answer = (f"{answer.status} {answer.content_type} {answer.body[:600]!r}" if answer.status
                            else answer.error)
                v.log = "\n".join(_render(r) for r in logs)[-4000:]

    def checked(self, req: Req) -> Answer:
        """Send, then the probes that follow some admin answers; in shrink mode, fail at once on a violation."""
        answer, problems = self.send(req)
        if answer.status == 200 and req.route == "weights" and req.admin == "admin":
            problems += self.probe_recording("weights", {}, restore_weights=True)
        if answer.status == 200 and req.route == "episodes" and req.admin == "admin":
            try:
                opened = orjson.loads(answer.body)
                if len(self.tokens) < 64:
                    self.tokens.append(opened["api_key"])
                problems += self.probe_recording("episodes", opened)
            except (orjson.JSONDecodeError, KeyError, TypeError):
                problems.append("a 200 from /harness/episodes without api_key")
                self.note(req, None, answer, [], problems[-1:])
        if answer.status == 200 and req.route == "responses" and answer.content_type.startswith("application/json"):
            rid = orjson.loads(answer.body).get("id")
            if isinstance(rid, str) and len(self.response_ids) < 64:
                self.response_ids.append(rid)
        firm = [p for p in problems if not p.startswith("the proxy logged")]  # a log line may come late
        if SHRINK and firm:
            raise AssertionError(f"{req}\n-> {answer.status} {answer.body[:600]!r}\n" + "\n".join(firm))
        return answer

    def admin_post(self, route: str, payload, plan: str = "probe") -> Answer:
        return self.send(Req(plan, "POST", f"/harness/{route}", [("Authorization", "Bearer " + ADMIN),
                                                                  ("Content-Type", "application/json")],
                             payload, route=route, admin="admin"))[0]

    def probe_recording(self, what: str, opened: dict, restore_weights: bool = False) -> list[str]:
        """After an admin route accepted a weight version or opened an episode: a call made now is recorded."""
        self.probe_n += 1
        episode = opened.get("episode_id") or f"probe-{self.probe_n}"
        hdrs = [("Content-Type", "application/json")]
        path = f"/e/{episode}/v1/chat/completions"
        if opened:
            hdrs.append(("Authorization", f"Bearer {opened['api_key']}"))
            path = "/v1/chat/completions"
        chat = Req("probe", "POST", path, hdrs, {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                   route="chat")
        count = {"sql": "SELECT (SELECT count(*) FROM episodes WHERE episode_id = ?), "
                        "(SELECT count(*) FROM calls WHERE episode_id = ?)", "params": [episode, episode]}
        problems = []
        before = _json(self.admin_post("sql", count).body).get("rows") or [[0, 0]]
        answer, _ = self.send(chat)
        rows = _json(self.admin_post("sql", count).body).get("rows")
        if answer.status != 200 or rows != [[1, before[0][1] + 1]]:
            what_did = "accepted a weight version" if what == "weights" else "opened an episode"
            problem = (f"/harness/{what} {what_did} (200), then a chat call got {answer.status} and the database "
                       f"holds (episodes, calls) = {rows} for its episode, {before} before the call")
            problems.append(problem)
            self.note(Req(what, "POST", f"/harness/{what}", route=what), None, answer,
                      self.trap.records[-5:], [problem])
        if restore_weights:
            self.admin_post("weights", {"version": 0})
        return problems


def _run_plan(fuzzer: Fuzzer, strategy, examples: int, explicit=()) -> str | None:
    def plan(req: Req) -> None:
        fuzzer.checked(req)

    test = given(strategy)(plan)
    for req in explicit:
        test = example(req)(test)
    test = settings(max_examples=examples, deadline=None, derandomize=True, database=None, print_blob=False,
                    suppress_health_check=list(HealthCheck),
                    phases=(Phase.explicit, Phase.generate, Phase.shrink) if SHRINK
                    else (Phase.explicit, Phase.generate))(test)
    try:
        test()
    except Exception as exc:  # shrink mode: the minimal failing request(s)
        parts = exc.exceptions if isinstance(exc, BaseExceptionGroup) else (exc,)
        return "\n".join(f"{type(e).__name__}: {e}" for e in parts)
    return None


def _json(body: bytes) -> dict:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    return obj if isinstance(obj, dict) else {}


def _final_checks(fuzzer: Fuzzer, proxy: RunningProxy) -> list[str]:
    problems = []
    thread = proxy.server._thread
    if thread is None or not thread.is_alive():
        problems.append("the proxy thread is not alive after the run")
    health, _ = fuzzer.send(Req("final", "GET", "/health", route="health"))
    if health.status != 200 or _json(health.body).get("status") != "ok":
        problems.append(f"GET /health after the run: {health.status} {health.body[:200]!r}")
    episode = f"fuzz-final-{uuid.uuid4().hex[:8]}"
    chat, _ = fuzzer.send(Req("final", "POST", f"/e/{episode}/v1/chat/completions",
                              [("Content-Type", "application/json")],
                              {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 4}, route="chat"))
    choices = _json(chat.body).get("choices") or [{}]
    if chat.status != 200 or not (choices[0].get("message") or {}).get("content"):
        problems.append(f"a normal chat call after the run: {chat.status} {chat.body[:200]!r}")
    found = fuzzer.admin_post("sql", {"sql": "SELECT count(*) FROM calls WHERE episode_id = ? AND status = 'ok'",
                                      "params": [episode]}, plan="final")
    if found.status != 200 or _json(found.body).get("rows") != [[1]]:
        problems.append(f"the chat call after the run is not recorded: {found.status} {found.body[:200]!r}")
    status, _ = fuzzer.send(Req("final", "GET", "/harness/status", [("Authorization", "Bearer " + ADMIN)],
                                route="status", admin="admin"))
    counters = _json(status.body)
    if counters.get("calls_spilled") != 0 or counters.get("last_error") is not None:
        problems.append(f"the recorder spilled calls or failed: calls_spilled={counters.get('calls_spilled')}, "
                        f"last_error={counters.get('last_error')!r}")
    return problems


@pytest.mark.filterwarnings("ignore:Generating overly large repr")
def test_fuzz_every_route(tmp_path):
    set_hypothesis_home_dir(tmp_path / "hypothesis")  # its caches go there, not into the repository
    trap = LogTrap()
    trap.install()
    upstream = SpiedUpstream()
    db = tmp_path / "fuzz.duckdb"
    # read_timeout_s under TIMEOUT_S: an engine that stalls is a 504, not a hang
    proxy = RunningProxy(upstream.url, db, max_body_bytes=MAX_BODY, read_timeout_s=4.0)
    fuzzer = Fuzzer(proxy, upstream, trap)
    shrunk: list[str] = []
    final: list[str] = []
    plan_seconds: dict[str, float] = {}
    started = time.perf_counter()
    try:
        for _ in range(2):  # episode tokens for the api-key variants
            answer = fuzzer.admin_post("episodes", {}, plan="setup")
            fuzzer.tokens.append(_json(answer.body)["api_key"])
        scale = sum(WEIGHTS.values())
        for name, strategy in PLANS.items():
            t0 = time.perf_counter()
            failure = _run_plan(fuzzer, strategy, max(1, round(TOTAL * WEIGHTS[name] / scale)), EXPLICIT.get(name, ()))
            plan_seconds[name] = round(time.perf_counter() - t0, 1)
            if failure:
                shrunk.append(f"[{name}] {failure}")
        final += _final_checks(fuzzer, proxy)
        fuzzer.close()
    finally:
        mark = len(trap.records)
        proxy.close()
        upstream.close()
        trap.remove()
        set_hypothesis_home_dir(None)
    seconds = time.perf_counter() - started
    late = [_render(r) for r in _errors(trap.records[mark:])]
    if late:
        final.append("errors logged while the proxy closed:\n" + "\n".join(late)[-3000:])
    total, ok = db_rows(db, "SELECT count(*), count(*) FILTER (WHERE status = 'ok') FROM calls")[0]
    if ok != fuzzer.llm_ok:
        final.append(f"{fuzzer.llm_ok} answers of recorded routes were 200, the database holds {ok} ok calls")
    spill = db.with_name(db.name + ".spill.jsonl")
    if spill.exists():
        final.append(f"the recorder spilled {len(spill.read_bytes().splitlines())} records to {spill.name}")

    figures = {"requests": fuzzer.sent, "seconds": round(seconds, 1), "requests_per_s": round(fuzzer.sent / seconds, 1),
               "status_histogram": dict(sorted(fuzzer.statuses.items())), "by_plan": dict(fuzzer.by_plan),
               "plan_seconds": plan_seconds, "wire_seconds": {k: round(v, 1) for k, v in fuzzer.wire_seconds.items()},
               "slowest_answer_s": round(fuzzer.slowest, 2),
               "route_status": dict(sorted(fuzzer.route_statuses.items())),
               "properties_checked": dict(sorted(fuzzer.checks.items())),
               "recorded_calls": total, "ok_calls": ok, "parser_rejects": fuzzer.parser_rejects,
               "engine_requests": len(upstream.paths),
               "violations": {v.signature: v.count for v in sorted(fuzzer.violations.values(),
                                                                    key=lambda v: v.signature)},
               "final_check_failures": final, "shrunk": shrunk}
    print("\nfuzz figures:", json.dumps(figures, indent=1, ensure_ascii=False))
    if REPORT:
        Path(REPORT).write_text(json.dumps(figures, indent=1, ensure_ascii=False))
    details = [f"== {v.signature} (x{v.count})\n{v.request}\n-> {v.answer}\n{v.log}"
               for v in sorted(fuzzer.violations.values(), key=lambda v: v.signature)]
    assert not (details or final or shrunk), "\n\n".join([*details, *final, *shrunk])[:60_000]
    assert fuzzer.sent >= TOTAL * 0.9, f"only {fuzzer.sent} of {TOTAL} requests were generated"
