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
- no status >= 500, except a 501 whose error says the endpoint is not offered by the engine (502/503/504 would mean
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

Layout (in tests/proxy/): fuzz_strategies.py (the request model, junk values, headers, bodies) and fuzz_requests.py
(the request kinds, explicit examples, plans) generate the requests; fuzz_checks.py (answers, violations, log trap,
spied engine, judging helpers) and fuzz_runner.py (the Fuzzer, a plan's run, the final checks)
send and judge them; this module sizes the plans, runs them and reports.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hypothesis.configuration import set_hypothesis_home_dir

from tests.proxy.fuzz_checks import LogTrap, SpiedUpstream, _errors, _render
from tests.proxy.fuzz_requests import EXPLICIT, PLANS
from tests.proxy.fuzz_runner import Fuzzer, _final_checks, _json, _run_plan
from tests.proxy.fuzz_strategies import MAX_BODY
from tests.support import RunningProxy, db_rows

TOTAL = int(os.environ.get("HARNESS_FUZZ_REQUESTS", "3000"))
REPORT = os.environ.get("HARNESS_FUZZ_REPORT")

# Share of the generated requests per plan.
WEIGHTS = {"chat": 0.19, "completions": 0.08, "responses": 0.12, "messages": 0.12, "raw": 0.12, "passthrough": 0.09,
           "models": 0.03, "health": 0.02, "sql": 0.06, "episodes": 0.03, "weights": 0.02, "status": 0.02,
           "protocol": 0.10}


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
