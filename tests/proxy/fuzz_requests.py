"""Hypothesis strategies for tests/proxy/test_fuzz.py, part 2: the request kinds, the explicit examples and the plans.

Each plan draws one kind of request: a recorded route (chat, completions, responses, messages) with a generated body,
anything as the body of a recorded or admin POST route (raw), the passthrough under /v1/, /v1/models, /health, the
admin routes with and without the admin token, and requests odd at the HTTP level (protocol). EXPLICIT holds the
earlier findings, sent on every run before the generated requests. The building blocks are in fuzz_strategies.py.
"""

from __future__ import annotations

from urllib.parse import quote

from hypothesis import strategies as st

from tests.proxy.fuzz_strategies import (
    _CLEAN_INVALID,
    _VALID_EPISODE,
    ADMIN,
    AGENT_AUTH,
    BODIES,
    DEEP,
    ENCODING,
    EXTRA_HEADERS,
    INTS,
    JSON,
    JUNK,
    LATIN1,
    LEAF,
    LINE_LIMIT,
    LLM_PATHS,
    MAX_BODY,
    MODEL,
    RECORDED,
    TEXT,
    TOKEN,
    Deep,
    Huge,
    Req,
    _with,
    episode_prefix,
    headers,
    mutated,
)


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
