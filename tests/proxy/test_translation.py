"""What the proxy changes on the way to the engine and back, and how it attributes calls to episodes. The
scripted engine shows exactly what reached it."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from proxy import SamplingOverrides
from tests.support import RunningProxy, db_rows

SYSTEM = {"role": "system", "content": "You are a planner."}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture
def proxy(upstream, tmp_path):
    p = RunningProxy(upstream.url, tmp_path / "rec.duckdb")
    yield p
    p.close()


async def _post(url, body, headers=None):
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        if body.get("stream"):
            return [orjson.loads(line[6:]) for line in (await r.read()).split(b"\n\n")
                    if line.startswith(b"data: {")]
        return await r.json()


def _chat(**extra):
    return {"model": "gpt-4o-mini", "messages": [SYSTEM, {"role": "user", "content": "go"}], **extra}


async def test_engine_gets_ids_logprobs_and_the_served_model_agent_gets_its_own_shape(proxy, upstream):
    answer = await _post(proxy.url + "/v1/chat/completions", _chat())
    sent = upstream.engine.requests[-1]
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    assert sent["model"] == "scripted-model"
    assert answer["model"] == "gpt-4o-mini"
    assert answer["prompt_token_ids"] is None
    assert answer["choices"][0]["token_ids"] is None and answer["choices"][0]["logprobs"] is None
    kept = await _post(proxy.url + "/v1/chat/completions", _chat(logprobs=True, return_token_ids=True))
    assert kept["prompt_token_ids"] == list(range(100, 132))
    assert kept["choices"][0]["token_ids"] and kept["choices"][0]["logprobs"]["content"]


async def test_completions_get_logprobs_as_an_integer(proxy, upstream):
    answer = await _post(proxy.url + "/v1/completions", {"model": "x", "prompt": "Hello"})
    sent = upstream.engine.requests[-1]
    assert sent["logprobs"] == 0 and sent["return_token_ids"] is True
    assert answer["choices"][0]["logprobs"] is None and answer["choices"][0]["token_ids"] is None
    proxy.close()
    [(ids, lps)] = db_rows(proxy.db_path, "SELECT completion_ids, logprobs FROM choices")
    assert ids == list(range(1000, 1008)) and len(lps) == 8


async def test_sampling_overrides_replace_the_agents_values_and_are_recorded(upstream, tmp_path):
    overrides = SamplingOverrides(temperature=1.0, top_p=0.95, max_tokens_cap=16)
    p = RunningProxy(upstream.url, tmp_path / "o.duckdb", sampling=overrides)
    try:
        await _post(p.url + "/v1/chat/completions", _chat(temperature=0.1, max_tokens=500))
        sent = upstream.engine.requests[-1]
        assert (sent["temperature"], sent["top_p"], sent["max_tokens"]) == (1.0, 0.95, 16)
        await _post(p.url + "/v1/chat/completions", _chat(max_completion_tokens=8))
        sent = upstream.engine.requests[-1]
        assert sent["max_completion_tokens"] == 8 and "max_tokens" not in sent  # under the cap: kept
    finally:
        p.close()
    rows = db_rows(p.db_path, "SELECT extra FROM calls ORDER BY started_at")
    assert orjson.loads(rows[0][0])["sampling_overrides"] == {"temperature": 0.1, "top_p": None, "max_tokens": 500}
    assert orjson.loads(rows[1][0])["sampling_overrides"] == {"temperature": None, "top_p": None}
    with pytest.raises(ValueError, match="temperature"):
        SamplingOverrides(temperature=-1)


async def test_a_max_tokens_above_the_engines_context_is_the_context_and_recorded(upstream, tmp_path):
    """Claude Code asks max_tokens 128000 of any model; vLLM refuses a max_tokens above its whole context (and fits
    any other to the room the prompt leaves), so the proxy makes it the context its /v1/models says."""
    upstream.script.max_model_len = 4096
    p = RunningProxy(upstream.url, tmp_path / "o.duckdb", served_model="policy")
    try:
        await _post(p.url + "/v1/messages", {"model": "claude-sonnet-4-5", "max_tokens": 128000,
                                             "messages": [{"role": "user", "content": "hi"}]})
        assert upstream.engine.requests[-1]["max_tokens"] == 4096
        await _post(p.url + "/v1/chat/completions", _chat(max_completion_tokens=4000))
        assert upstream.engine.requests[-1]["max_completion_tokens"] == 4000  # within the context: as asked
    finally:
        p.close()
    rows = db_rows(p.db_path, "SELECT extra FROM calls ORDER BY call_index")
    assert orjson.loads(rows[0][0])["sampling_overrides"] == {"max_tokens": 128000}
    assert "sampling_overrides" not in orjson.loads(rows[1][0])


async def test_role_fingerprint_follows_model_system_prompt_and_tools(proxy):
    url = proxy.url + "/e/roles/v1/chat/completions"
    await _post(url, _chat())
    await _post(url, _chat(messages=[SYSTEM, {"role": "user", "content": "another task"}]))
    await _post(url, _chat(messages=[{"role": "system", "content": "You are a critic."},
                                     {"role": "user", "content": "go"}]))
    await _post(url, _chat(tools=TOOLS))
    await _post(url, {**_chat(), "model": "qwen-plus"})
    proxy.close()
    keys = db_rows(proxy.db_path, "SELECT role_key, system_hash, tools_hash FROM calls ORDER BY call_index")
    assert keys[0] == keys[1]  # same role, different task
    assert len({k[0] for k in keys}) == 4
    assert keys[2][1] != keys[0][1] and keys[3][2] is not None and keys[0][2] is None


async def test_episode_tokens_urls_and_default_attribute_calls_in_order(proxy):
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/harness/episodes", json={"meta": {"task": 7}},
                                                    headers=proxy.admin_headers) as r:
        opened = await r.json()
    assert opened["api_key"].startswith("hx-ep-") and opened["base_path"] == f"/e/{opened['episode_id']}/v1"
    by_token = {"Authorization": f"Bearer {opened['api_key']}"}
    await asyncio.gather(*[_post(proxy.url + "/v1/chat/completions", _chat(), by_token) for _ in range(12)])
    await asyncio.gather(*[_post(proxy.url + "/e/by-url/v1/chat/completions", _chat(stream=True))
                           for _ in range(5)])
    await _post(proxy.url + "/v1/chat/completions", _chat())
    proxy.close()
    rows = db_rows(proxy.db_path, "SELECT episode_id, list(call_index ORDER BY call_index) FROM calls GROUP BY 1")
    by_episode = dict(rows)
    assert by_episode[opened["episode_id"]] == list(range(12))
    assert by_episode["by-url"] == list(range(5))
    assert by_episode[f"{proxy.server.run_id}-default"] == [0]
    meta = db_rows(proxy.db_path, "SELECT source, meta FROM episodes WHERE episode_id = ?", [opened["episode_id"]])
    assert meta[0][0] == "api_key" and orjson.loads(meta[0][1]) == {"task": 7}


async def test_an_episode_goes_on_across_proxy_restarts(upstream, tmp_path):
    db = tmp_path / "restart.duckdb"
    for _ in range(2):
        p = RunningProxy(upstream.url, db)
        try:
            await _post(p.url + "/e/long-task/v1/chat/completions", _chat())
            await _post(p.url + "/e/long-task/v1/chat/completions", _chat())
        finally:
            p.close()
    rows = db_rows(db, "SELECT call_index FROM calls WHERE episode_id = 'long-task' ORDER BY call_index")
    assert [r[0] for r in rows] == [0, 1, 2, 3]
    assert db_rows(db, "SELECT count(*) FROM runs WHERE ended_at IS NOT NULL") == [(2,)]


async def test_weight_version_is_stamped_on_calls(proxy):
    await _post(proxy.url + "/e/w/v1/chat/completions", _chat())
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/harness/weights", json={"version": 3},
                                                    headers=proxy.admin_headers) as r:
        assert r.status == 200
    await _post(proxy.url + "/e/w/v1/chat/completions", _chat())
    proxy.close()
    assert db_rows(proxy.db_path, "SELECT weight_version FROM calls ORDER BY call_index") == [(0,), (3,)]


async def test_a_call_generating_while_new_weights_arrive_records_both_versions(proxy, upstream):
    """Asynchronous rollouts push weights while calls run: a call keeps the version it started with, and says
    which version arrived before it ended (its later tokens may come from those weights)."""
    upstream.script.chunk_delay_s = 0.05
    call = asyncio.create_task(_post(proxy.url + "/e/w/v1/chat/completions", _chat(stream=True)))
    await asyncio.sleep(0.15)
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/harness/weights", json={"version": 4},
                                                    headers=proxy.admin_headers) as r:
        assert r.status == 200
    await call
    upstream.script.chunk_delay_s = 0.0
    await _post(proxy.url + "/e/w/v1/chat/completions", _chat(stream=True))
    proxy.close()
    assert db_rows(proxy.db_path, "SELECT weight_version, extra->>'weights_changed_to' FROM calls "
                   "ORDER BY call_index") == [(0, "4"), (4, None)]


async def test_stream_n2_is_assembled_for_the_record(proxy, upstream):
    events = await _post(proxy.url + "/e/s/v1/chat/completions", _chat(stream=True, n=2,
                                                                        stream_options={"include_usage": True}))
    assert events[-1]["usage"]["completion_tokens"] == 16
    assert all(e["model"] == "gpt-4o-mini" for e in events)
    proxy.close()
    [(response, prompt_tokens, completion_tokens, ttft)] = db_rows(
        proxy.db_path, "SELECT response, prompt_tokens, completion_tokens, ttft_ms FROM calls")
    response = orjson.loads(response)
    assert [c["message"]["content"] for c in response["choices"]] == ["".join(f"w{t} " for t in range(1000, 1008))] * 2
    assert (prompt_tokens, completion_tokens) == (32, 16) and ttft is not None and ttft > 0


async def test_tool_calls_are_recorded_whole_streamed_or_not(proxy, upstream):
    upstream.script.tool_arguments = '{"word": "cat", "lang": "en"}'
    answer = await _post(proxy.url + "/e/tools/v1/chat/completions", _chat(tools=TOOLS))
    assert answer["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "lookup"
    events = await _post(proxy.url + "/e/tools/v1/chat/completions", _chat(tools=TOOLS, stream=True))
    assert sum(1 for e in events for c in e["choices"] if c["delta"].get("tool_calls")) > 2  # arrived in pieces
    proxy.close()
    rows = db_rows(proxy.db_path, "SELECT ch.tool_calls, ch.finish_reason, ch.text FROM calls JOIN choices ch "
                   "USING (call_id) ORDER BY call_index")
    plain, streamed = [(orjson.loads(r[0]), r[1], r[2]) for r in rows]
    function = {"name": "lookup", "arguments": '{"word": "cat", "lang": "en"}'}
    assert plain == ([{"id": "call_1_0", "type": "function", "function": function}], "tool_calls", None)
    assert streamed == ([{"id": "call_2_0", "type": "function", "function": function}], "tool_calls", None)


async def test_a_sampling_seed_gives_every_call_its_own_seed_the_same_after_a_restart(upstream, tmp_path):
    sent = {}
    for attempt in ("first", "restarted"):
        p = RunningProxy(upstream.url, tmp_path / f"{attempt}.duckdb", sampling=SamplingOverrides(seed=7))
        run_id = p.server.run_id
        try:
            for episode in ("a", "b"):
                for _ in range(2):  # the episode id carries the proxy run's prefix, as a trainer's episodes do
                    await _post(f"{p.url}/e/{run_id}-{episode}/v1/chat/completions", _chat(seed=123))
                    sent.setdefault(attempt, []).append(upstream.engine.requests[-1]["seed"])
        finally:
            p.close()
    assert sent["first"] == sent["restarted"]  # same episode and call: same seed, whatever the run
    assert len(set(sent["first"])) == 4  # every call its own
    rows = db_rows(tmp_path / "first.duckdb", "SELECT extra->'sampling_overrides'->>'seed' FROM calls")
    assert {r[0] for r in rows} == {"123"}  # the agent's own seed is kept in the record
