"""The proxy's front door (proxy/server.py's ProxyServer): what code that runs a proxy needs of it, without its app
keys; and docs/proxy.md's example of it, run as written against the scripted engine."""

from __future__ import annotations

import re
from pathlib import Path

import openai
import pytest

from proxy import ProxyConfig, ProxyServer, SamplingOverrides
from tests.support import db_rows

DOC = Path(__file__).resolve().parents[2] / "docs" / "proxy.md"


@pytest.fixture
def server(upstream, tmp_path):
    s = ProxyServer(ProxyConfig(upstream_url=upstream.url, db_path=tmp_path / "rec.duckdb", port=0,
                                sampling=SamplingOverrides(temperature=0.5)))
    s.start_in_thread()
    yield s
    s.stop_thread()


def _ask(base_url: str, api_key: str = "unused") -> None:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}],
                                   temperature=1.0)


def test_an_opened_episode_is_served_and_its_calls_are_in_the_store_after_a_flush(server):
    opened = server.call(server.open_episode("ep-front", {"task": "t1"}))
    assert opened["episode_id"] == "ep-front"
    _ask(f"{server.url}/v1", opened["api_key"])
    server.flush()
    rows = server.store.query("SELECT episode_id, call_index FROM calls WHERE run_id = ?", [server.run_id]).rows
    assert rows == [("ep-front", 0)]
    meta = server.store.query("SELECT meta->>'task' FROM episodes WHERE episode_id = 'ep-front'").rows
    assert meta == [("t1",)]


def test_use_sampling_swaps_the_overrides_and_none_restores_the_config(server, upstream):
    assert server.sampling == SamplingOverrides(temperature=0.5)
    server.use_sampling(SamplingOverrides(temperature=0.0))
    _ask(f"{server.url}/v1")
    server.use_sampling(None)
    assert server.sampling == SamplingOverrides(temperature=0.5)
    _ask(f"{server.url}/v1")
    assert [r["temperature"] for r in upstream.engine.requests] == [0.0, 0.5]


def test_the_weight_version_is_the_one_calls_are_recorded_with(server):
    import json
    import urllib.request

    assert server.weight_version == 0
    request = urllib.request.Request(f"{server.url}/harness/weights", data=json.dumps({"version": 3}).encode(),
                                     headers={"Authorization": f"Bearer {server.config.admin_token}",
                                              "Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=10).read()
    assert server.weight_version == 3
    _ask(f"{server.url}/v1")
    server.flush()
    assert server.store.query("SELECT weight_version FROM calls").rows == [(3,)]


def test_the_docs_example_runs_as_written(upstream, tmp_path, monkeypatch):
    text = DOC.read_text()
    section = text[text.index("## From Python: the front door"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "http://127.0.0.1:8000" in code and "runs/x/harness.duckdb" in code
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "x").mkdir(parents=True)
    namespace: dict = {}
    exec(compile(code.replace("http://127.0.0.1:8000", upstream.url), str(DOC), "exec"), namespace)
    assert namespace["opened"]["episode_id"] == "ep-1"
    assert namespace["rows"] == [(0,)]  # no call was made
    assert db_rows(tmp_path / "runs" / "x" / "harness.duckdb", "SELECT episode_id FROM episodes") == [("ep-1",)]


async def _loop_type() -> type:
    import asyncio

    return type(asyncio.get_running_loop())


def test_the_proxy_runs_on_uvloop_unless_asked_for_asyncio_and_records_on_either(upstream, tmp_path, monkeypatch):
    import asyncio

    import uvloop

    seen = {}
    for asked in ("", "asyncio", "uvloop"):
        monkeypatch.setenv("HARNESS_EVENT_LOOP", asked)
        s = ProxyServer(ProxyConfig(upstream_url=upstream.url, db_path=tmp_path / f"rec-{asked}.duckdb", port=0))
        s.start_in_thread()
        try:
            seen[asked] = s.call(_loop_type())
            _ask(f"{s.url}/v1")
            s.flush()
            assert s.store.query("SELECT count(*) FROM calls WHERE status = 'ok'").rows == [(1,)]
        finally:
            s.stop_thread()
    assert seen[""] is uvloop.Loop and seen["uvloop"] is uvloop.Loop
    assert issubclass(seen["asyncio"], asyncio.BaseEventLoop) and not issubclass(seen["asyncio"], uvloop.Loop)


@pytest.mark.parametrize("verb", ["serve", "run"])
def test_an_event_loop_that_is_neither_is_named_before_anything_starts(verb, tmp_path, monkeypatch, capsys):
    from harness.cli.main import main

    monkeypatch.setenv("HARNESS_EVENT_LOOP", "trio")
    argv = {"serve": ["serve", "--upstream", "http://127.0.0.1:9", "--run-dir", str(tmp_path / "run")],
            "run": ["run", "--cmd", "true", "--data", str(tmp_path / "missing.jsonl"), "--upstream",
                    "http://127.0.0.1:9", "--run-dir", str(tmp_path / "run")]}[verb]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: HARNESS_EVENT_LOOP='trio' is not an event loop: set uvloop or asyncio, or unset it "
                       "(uvloop when installed)")
    assert not (tmp_path / "run" / "harness.duckdb").exists()
