"""One parse, one build: on every route a request takes through the proxy (plain chat and completions, an Azure
deployment URL, the Responses and Messages APIs, a frozen role, record-only mode) its body is parsed once and
serialised once for its upstream (plus once for the record where what is stored is not the bytes the agent sent:
a translated request, a model name added from the URL, a secret taken out), and every `Call` record, a refused
request's included, is built by `Capture.to_call`.

Counted by wrapping orjson: loads of a payload carrying a marker, and dumps of a whole request carrying it, by the
proxy's own code (the scripted engine parses what it is sent too: not counted).
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest

from proxy.forward import Capture
from proxy.roles import parse_rules
from proxy.scripted_engine import Script
from tests.support import RunningProxy, ScriptedUpstream, db_rows

MARK = "parse-once-marker-7f3a"
PROXY_DIR = str(Path(__file__).resolve().parents[2] / "proxy")
USER = {"role": "user", "content": f"say {MARK}"}
CHAT = {"model": "gpt-4o-mini", "messages": [USER], "max_tokens": 8}


class _Counts:
    """orjson.loads / orjson.dumps of the marked request by the proxy's code, counted while installed."""

    def __init__(self, monkeypatch):
        self.loads = self.dumps = 0
        real_loads, real_dumps = orjson.loads, orjson.dumps

        def loads(data):
            if _by_proxy() and MARK.encode() in (data.encode() if isinstance(data, str) else bytes(data)):
                self.loads += 1
            return real_loads(data)

        def dumps(obj, *args, **kwargs):
            out = real_dumps(obj, *args, **kwargs)
            if _by_proxy() and MARK.encode() in out and (b'"messages":' in out or b'"prompt":' in out):
                self.dumps += 1  # a whole request (continuity's hashing dumps single messages)
            return out

        monkeypatch.setattr(orjson, "loads", loads)
        monkeypatch.setattr(orjson, "dumps", dumps)

    def take(self) -> tuple[int, int]:
        out = (self.loads, self.dumps)
        self.loads = self.dumps = 0
        return out


def _by_proxy() -> bool:
    caller = sys._getframe(2).f_code.co_filename
    return caller.startswith(PROXY_DIR) and not caller.endswith("scripted_engine.py")


def _post(url: str, body: dict) -> int:
    request = urllib.request.Request(url, data=orjson.dumps(body), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code


@pytest.fixture
def fixed():
    up = ScriptedUpstream(Script(content="FIXED", model="fixed-model"))
    yield up
    up.close()


def test_each_route_parses_a_request_once_and_serialises_it_once_per_upstream(upstream, fixed, tmp_path,
                                                                               monkeypatch):
    rules = parse_rules({"critic": "model:critic-model"}, {"critic": fixed.url + "/v1"})
    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb", roles=rules)
    counts = _Counts(monkeypatch)
    base = proxy.url + "/e/{}/v1"
    routes = [  # (episode, path, body, (loads, dumps))
        ("chat", "/chat/completions", CHAT, (1, 1)),
        ("stream", "/chat/completions", {**CHAT, "stream": True}, (1, 1)),
        ("completions", "/completions", {"model": "m", "prompt": f"say {MARK}", "max_tokens": 8}, (1, 1)),
        ("secret", "/chat/completions", {**CHAT, "api_key": "sk-in-body"}, (1, 2)),  # the record: without it
        ("frozen", "/chat/completions", {**CHAT, "model": "critic-model"}, (1, 1)),
        ("responses", "/responses", {"model": "gpt-4o-mini", "input": USER["content"]}, (1, 2)),
        ("messages", "/messages", {**CHAT, "max_tokens": 8}, (1, 2)),
    ]
    try:
        for episode, path, body, expected in routes:
            assert _post(base.format(episode) + path, body) == 200, episode
            assert counts.take() == expected, episode
        body = {k: v for k, v in CHAT.items() if k != "model"}  # the URL names the model: recorded with it
        assert _post(proxy.url + "/e/azure/openai/deployments/dep-1/chat/completions", body) == 200
        assert counts.take() == (1, 2)
    finally:
        proxy.close()
    assert len(fixed.engine.requests) == 1 and len(upstream.engine.requests) == 7
    rows = dict(db_rows(proxy.db_path, "SELECT episode_id, request FROM calls"))
    assert orjson.loads(rows["azure"]) == {"model": "dep-1", **body}
    assert "sk-in-body" not in rows["secret"]


def test_record_only_parses_a_request_once_and_sends_it_as_sent(upstream, tmp_path, monkeypatch):
    proxy = RunningProxy(upstream.url + "/v1", tmp_path / "rec.duckdb", record_only=True, returns_token_ids=False,
                         token_exact=False)
    counts = _Counts(monkeypatch)
    try:
        assert _post(proxy.url + "/e/rec/v1/chat/completions", CHAT) == 200
        assert counts.take() == (1, 1)
    finally:
        proxy.close()
    assert upstream.engine.requests == [CHAT]


def test_a_refused_request_is_recorded_by_the_builder_of_every_call(upstream, tmp_path, monkeypatch):
    built = []
    to_call = Capture.to_call

    def counting(self, *args, **kwargs):
        call = to_call(self, *args, **kwargs)
        built.append(call.call_id)
        return call

    monkeypatch.setattr(Capture, "to_call", counting)
    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb", max_turns=1)
    try:
        url = proxy.url + "/e/{}/v1/chat/completions"
        assert _post(url.format("bad"), {"model": "m", "messages": "not a list"}) == 400
        assert _post(url.format("ok"), CHAT) == 200
        assert _post(url.format("ok"), CHAT) == 400  # past max_turns: refused
    finally:
        proxy.close()
    rows = db_rows(proxy.db_path, "SELECT call_id, episode_id, status, http_status, request, latency_ms, "
                   "extra->>'flags' IS NOT NULL FROM calls ORDER BY started_at")
    assert sorted(built) == sorted(r[0] for r in rows)
    assert [r[1:] for r in rows if r[3] == 400] == [("bad", "error", 400, "null", 0.0, False),
                                                    ("ok", "error", 400, "null", 0.0, True)]
