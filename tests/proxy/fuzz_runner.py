"""Sending and checking for tests/proxy/test_fuzz.py: the `Fuzzer` and the runs of its plans.

The Fuzzer sends each generated request to the proxy over a plain keep-alive http.client connection (resolving the
placeholders, rendering deep and huge payloads, clamping `n`, compressing and chunking as asked), judges the answer
against the properties listed in tests/proxy/test_fuzz.py, counts the figures and keeps each kind of violation with its
smallest example; after an admin route accepted a weight version or opened an episode, it probes that a call made
then is recorded. `_run_plan` runs one plan through Hypothesis (derandomized, no database; HARNESS_FUZZ_SHRINK=1 stops
at the first violation and shrinks it), `_final_checks` checks the proxy after the run.
"""

from __future__ import annotations

import gzip
import http.client
import os
import time
import uuid
import zlib
from collections import Counter

import orjson
from hypothesis import HealthCheck, Phase, example, given, settings

from tests.proxy.fuzz_checks import (
    Answer,
    LogTrap,
    SpiedUpstream,
    Violation,
    _error_shape,
    _errors,
    _escapes_v1,
    _exc_line,
    _is_llm_answer,
    _normalize,
    _not_offered,
    _parser_log,
    _render,
    _render_deep,
    _render_huge,
    _stream_problem,
)
from tests.proxy.fuzz_requests import SQL_WRITE
from tests.proxy.fuzz_strategies import ADMIN, MAX_N, PREV, RECORDED, TOKEN, Deep, Huge, Req
from tests.support import RunningProxy

SHRINK = os.environ.get("HARNESS_FUZZ_SHRINK", "") not in ("", "0")
TIMEOUT_S = 5.0  # per request: no answer within this is a hang (the scripted engine answers in milliseconds)


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
