"""The OpenAPI description the proxy ships (proxy/openapi.py, served at GET /openapi.json): it names exactly the
routes the proxy serves, and schemathesis, generating requests from it (valid ones, and invalid ones: wrong
types, missing fields, broken patterns), finds every answer documented: no 5xx of the proxy's own (a 501 only for
an API the engine does not offer), each status and content type the description lists for its route, each JSON
body matching its schema. Afterwards the proxy is healthy and every call it answered 200 is in the database once.

HARNESS_SCHEMATHESIS_EXAMPLES sets the examples per route and mode (CI: 40; `make soak`: 300). The figures go to
HARNESS_SCHEMATHESIS_REPORT when set (docs/RELIABILITY.md quotes them).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter

import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from proxy.openapi import openapi
from tests.support import RunningProxy, db_rows

EXAMPLES = int(os.environ.get("HARNESS_SCHEMATHESIS_EXAMPLES", "40"))
REPORT = os.environ.get("HARNESS_SCHEMATHESIS_REPORT")
CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]
RECORDED = ("/chat/completions", "/completions", "/responses", "/messages")


def test_the_description_names_exactly_the_routes_the_proxy_serves(upstream, tmp_path):
    proxy = RunningProxy(upstream.url, tmp_path / "routes.duckdb")
    try:
        served = {(r.method, r.resource.canonical) for r in proxy.server.app.router.routes() if r.method != "HEAD"}
        got = requests.get(proxy.url + "/openapi.json", timeout=10)
    finally:
        proxy.close()
    assert got.status_code == 200 and got.json() == json.loads(json.dumps(openapi()))
    described = {(method.upper(), path) for path, ops in got.json()["paths"].items() for method in ops}
    passthrough = {("GET", "/v1/{tail}"), ("POST", "/v1/{tail}"), ("GET", "/e/{episode}/v1/{tail}"),
                   ("POST", "/e/{episode}/v1/{tail}")}
    assert served - passthrough == described - {("POST", "/v1/embeddings")}  # the passthrough, by an example
    schemathesis.openapi.from_dict(got.json())  # a valid OpenAPI document (it raises otherwise)


def _fuzz(op, mode: GenerationMode, url: str, session: requests.Session, headers: dict, tally: Counter) -> None:
    """EXAMPLES generated requests of one operation in one mode, each answer checked against the description."""

    @given(case=op.as_strategy(mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), print_blob=False)
    def run(case):
        response = case.call(base_url=url, session=session, headers=headers, timeout=15)
        status = response.status_code
        tally[status] += 1
        not_offered = status == 501 and op.path == "/v1/embeddings"  # documented: an API the engine lacks
        ours = status >= 500 and not not_offered
        assert not ours, f"{op.label} ({mode.value}): {status} {response.text[:500]}"
        case.validate_response(response, checks=CHECKS, headers=headers)
        if status == 200 and op.path.endswith(RECORDED):  # a 200 stream may still end with an error event
            stream = response.headers.get("content-type", [""])[0].startswith("text/event-stream")
            broken = stream and any(line.startswith((b"data: {\"error\"", b"event: error"))
                                    for line in response.content.splitlines())
            tally["recorded_error_200" if broken else "recorded_ok"] += 1

    try:
        run()
    except Unsatisfiable:
        if mode is GenerationMode.POSITIVE:
            raise  # a route with nothing to break (no body, no parameters) has no invalid requests


def test_schemathesis_finds_every_answer_documented(upstream, tmp_path):
    random.seed(0)  # schemathesis draws some choices from the global generator: the same requests in any session
    upstream.script.completion_tokens = 4
    proxy = RunningProxy(upstream.url, tmp_path / "schema.duckdb", read_timeout_s=5.0)
    tally: Counter = Counter()
    started = time.monotonic()
    try:
        # every stream read to its end (by default schemathesis hangs up after 20 events: the call is cancelled)
        schema = schemathesis.openapi.from_dict(requests.get(proxy.url + "/openapi.json", timeout=10).json(),
                                                config=SchemathesisConfig.from_dict({"max-stream-events": 100_000}))
        admin = {"Authorization": f"Bearer {proxy.config.admin_token}"}
        session = requests.Session()
        operations = [result.ok() for result in schema.get_all_operations()]
        for op in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                _fuzz(op, mode, proxy.url, session, admin if op.path.startswith("/harness/") else {}, tally)
        answer = session.post(proxy.url + "/v1/chat/completions", timeout=15,
                              json={"messages": [{"role": "user", "content": "still there?"}]})
        assert answer.status_code == 200, answer.text
        tally["recorded_ok"] += 1
    finally:
        proxy.close()
    recorded_ok, recorded_error = tally.pop("recorded_ok"), tally.pop("recorded_error_200", 0)
    figures = {"requests": sum(tally.values()), "seconds": round(time.monotonic() - started, 1),
               "examples_per_route_and_mode": EXAMPLES, "operations": len(operations),
               "status_histogram": {str(k): v for k, v in sorted(tally.items())}}
    print("schemathesis figures:", json.dumps(figures, indent=1))
    if REPORT:
        with open(REPORT, "w") as f:
            json.dump(figures, f, indent=1)
    assert tally[200] > 0 and sum(c for s, c in tally.items() if 400 <= s < 500) > 0, tally
    db = tmp_path / "schema.duckdb"
    rows = db_rows(db, "SELECT count(*) FILTER (WHERE status = 'ok'), count(DISTINCT call_id) FILTER (WHERE status = "
                   "'ok'), count(*) FILTER (WHERE status = 'error' AND http_status = 200) FROM calls")
    not_ok = db_rows(db, "SELECT status, http_status, endpoint, stream, left(error, 300) FROM calls "
                     "WHERE status <> 'ok' AND (http_status = 200 OR status = 'cancelled')")
    assert rows == [(recorded_ok, recorded_ok, recorded_error)], (rows, recorded_ok, recorded_error, not_ok)
