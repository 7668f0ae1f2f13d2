"""Several engines behind one proxy (proxy/upstreams.py): an episode's calls stay on one engine, new episodes spread
over the engines, and an engine that goes away mid-run hands its episodes to the others without the agent seeing
an error. The engines are scripted (real HTTP servers), so the test can stop one.
The tests on the real engine are in test_upstreams_engine.py."""

from __future__ import annotations

import pytest
from openai import OpenAI

from harness.running.vllm_server import placement
from proxy.upstreams import Engines
from tests.support import RunningProxy, ScriptedUpstream, db_rows


def _turns(proxy_url: str, episode: str, n: int) -> None:
    client = OpenAI(base_url=f"{proxy_url}/e/{episode}/v1", api_key="sk-x", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    for _ in range(n):
        reply = client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=4)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "more"}]


def test_episodes_stick_to_an_engine_and_move_when_it_goes_away(tmp_path):
    a, b = ScriptedUpstream(), ScriptedUpstream()
    proxy = RunningProxy(a.url, tmp_path / "rec.duckdb", more_upstreams=(b.url + "/v1",))
    try:
        for k in range(4):
            _turns(proxy.url, f"ep{k}", 2)
        assert len(a.engine.requests) == len(b.engine.requests) == 4  # two episodes each, both turns on one engine
        a.close()  # engine a goes away between turns
        for k in range(4):
            _turns(proxy.url, f"ep{k}", 1)  # a re-sent conversation: a's episodes continue on b
        _turns(proxy.url, "late", 2)
    finally:
        proxy.close()
        b.close()
    rows = db_rows(proxy.db_path, "SELECT episode_id, call_index, extra->>'engine', extra->'engine_failover', status "
                   "FROM calls ORDER BY episode_id, call_index")
    assert all(status == "ok" for *_, status in rows)  # the agents never saw the failure
    engine_of = {}
    for episode, index, engine, _, _ in rows:
        if index < 2:
            engine_of.setdefault(episode, set()).add(engine)
    assert all(len(engines) == 1 for engines in engine_of.values())  # affinity
    a_base, b_base = a.url, b.url
    moved = [(e, f) for e, i, engine, f, _ in rows if i == 2 and engine_of[e] == {a_base}]
    assert len(moved) == 2  # a's two episodes: the first call to find a down is retried on b (and says so), the
    assert [a_base in (f or "") for _, f in moved] == [True, False]  # next goes to b at once
    assert {engine for e, i, engine, *_ in rows if i == 2} == {b_base}
    assert {engine for e, _, engine, *_ in rows if e == "late"} == {b_base}


def test_a_server_error_fails_over_only_when_the_engine_is_sick(tmp_path):
    """A 500 from an engine whose /health fails (a dying vLLM) moves the call; a 500 from a healthy engine is the
    request's own trouble and reaches the agent."""
    a, b = ScriptedUpstream(), ScriptedUpstream()
    proxy = RunningProxy(a.url, tmp_path / "rec.duckdb", more_upstreams=(b.url,))
    try:
        client = OpenAI(base_url=f"{proxy.url}/e/ep-a/v1", api_key="sk-x", max_retries=0)
        ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        client.chat.completions.create(**ask)  # ep-a lives on a
        a.script.status = 500
        with pytest.raises(Exception, match="502"):
            client.chat.completions.create(**ask)  # a is healthy: its error is the answer
        a.script.healthy = False
        client.chat.completions.create(**ask)  # a is dying: b answers
    finally:
        proxy.close()
        a.close()
        b.close()
    rows = db_rows(proxy.db_path, "SELECT status, extra->>'engine', extra->'engine_failover' FROM calls "
                   "ORDER BY call_index")
    assert rows == [("ok", a.url, None), ("error", a.url, None), ("ok", b.url, f'["{a.url}"]')]


def test_one_engine_is_a_constant_and_all_down_still_tries():
    one = Engines(("http://e1",))
    assert one.pick("x") == "http://e1" and not one.mark_down("http://e1", "gone")
    two = Engines(("http://e1", "http://e2"), retry_after_s=60)
    assert [two.pick(f"ep{k}") for k in range(4)] == ["http://e1", "http://e2", "http://e1", "http://e2"]
    assert two.mark_down("http://e1", "refused") is True
    assert two.pick("ep0") == "http://e2" and two.episodes == {"http://e1": 1, "http://e2": 3}
    assert two.mark_down("http://e2", "refused") is False  # nothing left to retry on
    assert two.pick("new") == "http://e1"  # all down: the one down longest is tried anyway


def test_engines_started_side_by_side_get_their_own_part_of_the_machine():
    assert placement(0, 2, 0, [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert placement(1, 2, 0, [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    four = [placement(k, 2, 0, [0, 1, 2, 3])["VLLM_CPU_OMP_THREADS_BIND"] for k in range(2)]
    assert four == ["0", "1,2"]  # core 3 is left to the API servers, the proxy and the agents
    assert [placement(k, 3, 0, [4, 5])["VLLM_CPU_OMP_THREADS_BIND"] for k in range(3)] == ["4", "5", "4"]
    assert placement(1, 2, 2, [0, 1]) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert placement(1, 2, 1, [0, 1]) == {}  # one GPU for two engines: they share it
    with pytest.raises(ValueError, match="engine 2 of 2"):
        placement(2, 2, 0, [0, 1])
