"""The OpenAI Responses API and Anthropic Messages on the proxy: translated into chat calls (recorded with the
engine's token ids, `extra.wire` set) and back into the format the agent spoke, whole or streamed. The fast tier
drives the scripted engine, which shows exactly what reached it; the engine tier drives the real vLLM with the real
`openai` and `anthropic` SDKs. The tests on the real engine are in test_wire_formats_engine.py."""

from __future__ import annotations

import json

import aiohttp
import anthropic
import openai
import orjson
import pytest
from aiohttp import web

from tests.support import BackgroundApp, RunningProxy, db_rows

FN_TOOL = {"type": "function", "name": "lookup", "description": "Look a word up.",
           "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in FN_TOOL.items() if k != "type"}}
AN_TOOL = {"name": "lookup", "description": "Look a word up.", "input_schema": FN_TOOL["parameters"]}
SCRIPTED_TEXT = "".join(f"w{t} " for t in range(1000, 1008))


@pytest.fixture
def proxy(upstream, tmp_path):
    p = RunningProxy(upstream.url, tmp_path / "rec.duckdb")
    yield p
    p.close()


def _oa(proxy, episode: str | None = None) -> openai.OpenAI:
    base = f"{proxy.url}/e/{episode}/v1" if episode else f"{proxy.url}/v1"
    return openai.OpenAI(base_url=base, api_key="sk-test", max_retries=0)


def _an(proxy, episode: str | None = None, api_key: str = "sk-ant-test") -> anthropic.Anthropic:
    base = f"{proxy.url}/e/{episode}" if episode else proxy.url
    return anthropic.Anthropic(base_url=base, api_key=api_key, max_retries=0)


async def _raw(url: str, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        return r.status, await r.read()


def _sse(raw: bytes) -> list[tuple[str | None, dict]]:
    """(event name, data) of each SSE event."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines.get("event"), json.loads(lines["data"])))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Responses: the request.
# ---------------------------------------------------------------------------------------------------------------


async def test_responses_request_becomes_the_chat_request(proxy, upstream):
    body = {
        "model": "gpt-4.1-mini", "instructions": "Be terse.", "max_output_tokens": 20, "temperature": 0.5,
        "top_p": 0.9, "store": False, "metadata": {"k": "v"}, "tools": [FN_TOOL],
        "tool_choice": {"type": "function", "name": "lookup"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Look "},
                                                             {"type": "input_text", "text": "up cat"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
            {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"word":"cat"}'},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call_output", "call_id": "c1", "output": "a small animal"},
            {"role": "user", "content": "and?"},
        ],
    }
    status, raw = await _raw(proxy.url + "/v1/responses", body)
    assert status == 200, raw
    sent = upstream.engine.requests[-1]
    assert sent["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Look up cat"},
        {"role": "assistant", "content": "Sure.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"word":"cat"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a small animal"},
        {"role": "user", "content": "and?"},
    ]
    assert sent["tools"] == [CHAT_TOOL]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}
    assert sent["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True}}
    assert (sent["max_tokens"], sent["temperature"], sent["top_p"], sent["parallel_tool_calls"]) == (20, 0.5, 0.9,
                                                                                                     False)
    assert sent["model"] == "scripted-model" and sent["return_token_ids"] is True and sent["logprobs"] is True
    assert not {"input", "instructions", "store", "metadata", "text", "max_output_tokens"} & set(sent)

    await _raw(proxy.url + "/v1/responses", {"model": "m", "input": "hi", "stream": True})
    sent = upstream.engine.requests[-1]
    assert sent["messages"] == [{"role": "user", "content": "hi"}]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}

    # Codex's compaction request: tool_choice "auto" and no tools, which the Responses API takes and chat engines
    # refuse ("When using `tool_choice`, `tools` must be set"): nothing to choose from, so it is left out.
    await _raw(proxy.url + "/v1/responses", {"model": "m", "input": "sum it up", "tool_choice": "auto",
                                             "tools": [], "parallel_tool_calls": False})
    sent = upstream.engine.requests[-1]
    assert "tool_choice" not in sent and "tools" not in sent


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "m"}, 400, "input"),
    ({"model": "m", "input": 7}, 400, "input"),
    ({"model": "m", "input": [{"type": "telepathy"}]}, 400, "input[0].type"),
    ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_text"}]}]}, 400, "input[0].content[0].text"),
    ({"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input[0].call_id"),
    ({"model": "m", "input": "x", "tools": [{"type": "function"}]}, 400, "tools[0].name"),
    ({"model": "m", "input": "x", "tool_choice": 3}, 400, "tool_choice"),
    ({"model": "m", "input": "x", "max_output_tokens": "ten"}, 400, "max_output_tokens"),
    ({"model": "m", "input": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, 400,
     "text.format.schema"),
    ({"model": "m", "input": "x", "previous_response_id": "resp_never"}, 400, "previous_response_id"),
    ({"model": "m", "input": "x", "tools": [{"type": "namespace", "name": "n"}]}, 400, "tools[0].tools"),
    ({"model": "m", "input": "x", "tools": [{"type": "custom"}]}, 400, "tools[0].name"),
    ({"model": "m", "input": [{"type": "custom_tool_call", "call_id": "c", "name": "t"}]}, 400, "input[0].input"),
    ({"model": "m", "input": "x", "background": True}, 400, "background"),
    ({"model": "m", "input": [{"type": "web_search_call", "id": "w"}]}, 400, "input[0]"),
])
async def test_responses_refuses_bad_input_and_unoffered_features_with_a_400_by_name(proxy, upstream, body, status,
                                                                                    param):
    before = len(upstream.engine.requests)
    got, raw = await _raw(proxy.url + "/v1/responses", body)
    err = orjson.loads(raw)["error"]
    assert got == status and err["param"] == param, err
    assert param.split("[")[0].split(".")[0] in err["message"] or err["code"] == "unsupported_value"
    assert len(upstream.engine.requests) == before
    proxy.close()
    [(endpoint, call_status, extra)] = db_rows(proxy.db_path, "SELECT endpoint, status, extra FROM calls")
    assert (endpoint, call_status, orjson.loads(extra)) == ("chat", "error", {"wire": "responses"})


# ---------------------------------------------------------------------------------------------------------------
# Responses: the answer, whole and streamed, through the openai SDK.
# ---------------------------------------------------------------------------------------------------------------


def test_responses_whole_answer_text_and_function_call(proxy, upstream):
    client = _oa(proxy)
    resp = client.responses.create(model="gpt-4.1-mini", input="hi", max_output_tokens=8)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == "gpt-4.1-mini"
    assert resp.output_text == SCRIPTED_TEXT
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (32, 8, 40)

    upstream.script.tool_arguments = '{"word": "cat"}'
    resp = client.responses.create(model="gpt-4.1-mini", input="look up cat", tools=[FN_TOOL])
    assert resp.status == "completed" and resp.output_text == ""
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "lookup" and json.loads(call.arguments) == {"word": "cat"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    proxy.close()
    rows = db_rows(proxy.db_path, "SELECT c.endpoint, c.extra->>'wire', c.request, c.response, c.prompt_ids, "
                   "h.completion_ids, h.logprobs FROM calls c JOIN choices h USING (call_id) ORDER BY c.call_index")
    for endpoint, wire, request, response, prompt_ids, ids, lps in rows:
        assert (endpoint, wire) == ("chat", "responses")
        assert "messages" in orjson.loads(request) and orjson.loads(response)["object"] == "chat.completion"
        assert prompt_ids == list(range(100, 132)) and ids == list(range(1000, 1008)) and len(lps) == 8


def test_responses_stream_events_parse_in_the_sdk(proxy, upstream):
    client = _oa(proxy)
    events = list(client.responses.create(model="gpt-4.1-mini", input="hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-5:] == ["response.output_text.delta", "response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # cut off at 8 tokens, as OpenAI says
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 8 and "".join(deltas) == SCRIPTED_TEXT  # one event per engine chunk: incremental
    final = events[-1].response
    assert final.output_text == SCRIPTED_TEXT and final.status == "incomplete" and final.usage.output_tokens == 8
    assert final.id == events[0].response.id

    upstream.script.tool_arguments = '{"word": "cat"}'
    with client.responses.stream(model="gpt-4.1-mini", input="look up cat", tools=[FN_TOOL]) as stream:
        seen = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in seen and "response.function_call_arguments.done" in seen
    (call,) = final.output
    assert call.type == "function_call" and call.name == "lookup" and json.loads(call.arguments) == {"word": "cat"}
    assert final.status == "completed"


async def test_responses_stream_never_shows_chat_chunks_and_breaks_off_with_an_error_event(upstream, tmp_path):
    p = RunningProxy(upstream.url, tmp_path / "r.duckdb")
    try:
        status, raw = await _raw(p.url + "/v1/responses", {"model": "m", "input": "hi", "stream": True})
        events = _sse(raw)
        assert status == 200 and all(name == data["type"] and name.startswith("response.") for name, data in events)
        assert b"chat.completion" not in raw and b"[DONE]" not in raw
        upstream.script.break_stream_after = 3
        status, raw = await _raw(p.url + "/v1/responses", {"model": "m", "input": "hi", "stream": True})
        names = [name for name, _ in _sse(raw)]
        assert names[-2:] == ["error", "response.failed"] and "response.completed" not in names
    finally:
        p.close()
    rows = db_rows(p.db_path, "SELECT status, error FROM calls ORDER BY call_index")
    assert rows[0] == ("ok", None) and rows[1][0] == "error" and "broke off" in rows[1][1]


async def test_responses_engine_errors_keep_their_status(upstream, tmp_path):
    upstream.script.status = 400
    p = RunningProxy(upstream.url, tmp_path / "r.duckdb")
    try:
        status, raw = await _raw(p.url + "/v1/responses", {"model": "m", "input": "hi"})
        assert status == 400 and "scripted failure 400" in orjson.loads(raw)["error"]["message"]
    finally:
        p.close()


def test_previous_response_id_continues_the_conversation(proxy, upstream):
    client = _oa(proxy, "conv")
    upstream.script.tool_arguments = '{"word": "cat"}'
    first = client.responses.create(model="m", instructions="Be terse.", input="look up cat", tools=[FN_TOOL])
    (call,) = first.output
    upstream.script.tool_arguments = None
    second = client.responses.create(model="m", instructions="Be terse.", previous_response_id=first.id,
                                     tools=[FN_TOOL],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "a small animal"}])
    assert upstream.engine.requests[-1]["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "look up cat"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "lookup", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "a small animal"},
    ]
    assert second.previous_response_id == first.id
    # streamed answers are remembered too, text included; instructions are not carried over
    third = list(client.responses.create(model="m", previous_response_id=second.id, input="more", stream=True))
    client.responses.create(model="m", previous_response_id=third[-1].response.id, input="again")
    sent = upstream.engine.requests[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "assistant", "user", "assistant", "user"]
    assert sent[3]["content"] == SCRIPTED_TEXT and sent[5]["content"] == SCRIPTED_TEXT
    with pytest.raises(openai.BadRequestError, match="resp_gone"):
        client.responses.create(model="m", previous_response_id="resp_gone", input="x")


# ---------------------------------------------------------------------------------------------------------------
# Anthropic Messages.
# ---------------------------------------------------------------------------------------------------------------


async def test_messages_request_becomes_the_chat_request(proxy, upstream):
    body = {
        "model": "claude-sonnet-4-5", "max_tokens": 30, "temperature": 0.2, "top_p": 0.8, "top_k": 5,
        "stop_sequences": ["END"], "metadata": {"user_id": "u"},
        "system": [{"type": "text", "text": "Be terse."}, {"type": "text", "text": "Use tools."}],
        "tools": [AN_TOOL], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "look up cat"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "Sure."},
                                              {"type": "tool_use", "id": "t1", "name": "lookup",
                                               "input": {"word": "cat"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "a small animal"}]},
                                         {"type": "text", "text": "and?"}]},
            {"role": "system", "content": [{"type": "text", "text": "Now 12:00."}]},  # as Claude Code sends one
        ],
    }
    status, raw = await _raw(proxy.url + "/v1/messages", body)
    assert status == 200, raw
    sent = upstream.engine.requests[-1]
    assert sent["messages"] == [
        {"role": "system", "content": "Be terse.\nUse tools."},
        {"role": "user", "content": "look up cat"},
        {"role": "assistant", "content": "Sure.", "reasoning": "hm", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "lookup", "arguments": '{"word":"cat"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "a small animal"},
        {"role": "user", "content": "and?"},
        {"role": "system", "content": "Now 12:00."},
    ]
    assert sent["tools"] == [{"type": "function", "function": {"name": "lookup", "parameters": AN_TOOL[
        "input_schema"], "description": "Look a word up."}}]
    assert sent["tool_choice"] == "required" and sent["parallel_tool_calls"] is False
    assert (sent["max_tokens"], sent["temperature"], sent["top_p"], sent["top_k"], sent["stop"]) == (
        30, 0.2, 0.8, 5, ["END"])
    assert sent["model"] == "scripted-model" and sent["return_token_ids"] is True
    answer = orjson.loads(raw)
    assert answer["type"] == "message" and answer["model"] == "claude-sonnet-4-5"
    assert answer["id"].startswith("msg_") and answer["content"] == [{"type": "text", "text": SCRIPTED_TEXT}]
    assert answer["stop_reason"] == "max_tokens" and answer["usage"] == {"input_tokens": 32, "output_tokens": 8}


@pytest.mark.parametrize(("body", "status", "where"), [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens"),
    ({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens"),
    ({"model": "m", "max_tokens": 5, "messages": []}, 400, "messages"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": 7}]}, 400, "messages[0].content"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t",
                                                                                "name": "f", "input": {}}]}]},
     400, "messages[0].content[0].type"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]},
     400, "tools[0].input_schema"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tool_choice": {"type": "sometimes"}}, 400, "tool_choice.type"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "server tool"),
])
async def test_messages_errors_have_anthropics_shape(proxy, upstream, body, status, where):
    got, raw = await _raw(proxy.url + "/v1/messages", body)
    err = orjson.loads(raw)
    assert got == status and err["type"] == "error", err
    assert err["error"]["type"] == ("invalid_request_error" if status == 400 else "api_error")
    assert where in err["error"]["message"]
    assert not upstream.engine.requests


def test_messages_whole_and_streamed_through_the_anthropic_sdk(proxy, upstream):
    client = _an(proxy, "an")
    msg = client.messages.create(model="claude-haiku-4-5", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert msg.content[0].text == SCRIPTED_TEXT and msg.stop_reason == "max_tokens" and msg.role == "assistant"
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (32, 8) and msg.model == "claude-haiku-4-5"

    events = list(client.messages.create(model="claude-haiku-4-5", max_tokens=8, stream=True,
                                         messages=[{"role": "user", "content": "hi"}]))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[0].message.usage.input_tokens == 32
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == SCRIPTED_TEXT
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 8

    upstream.script.tool_arguments = '{"word": "cat"}'
    msg = client.messages.create(model="m", max_tokens=8, tools=[AN_TOOL],
                                 messages=[{"role": "user", "content": "look up cat"}])
    (block,) = msg.content
    assert block.type == "tool_use" and block.name == "lookup" and block.input == {"word": "cat"}
    assert msg.stop_reason == "tool_use"
    with client.messages.stream(model="m", max_tokens=8, tools=[AN_TOOL],
                                messages=[{"role": "user", "content": "look up cat"}]) as stream:
        final = stream.get_final_message()
    (block,) = final.content
    assert block.type == "tool_use" and block.input == {"word": "cat"} and final.stop_reason == "tool_use"
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model="m", max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    proxy.close()
    rows = db_rows(proxy.db_path, "SELECT endpoint, stream, status, extra->>'wire', response FROM calls "
                   "WHERE episode_id = 'an' ORDER BY call_index")
    assert [r[:4] for r in rows] == [("chat", False, "ok", "messages"), ("chat", True, "ok", "messages"),
                                     ("chat", False, "ok", "messages"), ("chat", True, "ok", "messages"),
                                     ("chat", False, "error", "messages")]
    assert orjson.loads(rows[3][4])["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "lookup"


async def test_messages_auth_by_x_api_key_and_stream_errors(upstream, tmp_path):
    p = RunningProxy(upstream.url, tmp_path / "a.duckdb", auth_token="sk-proxy")
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    try:
        status, raw = await _raw(p.url + "/v1/messages", body, {"x-api-key": "wrong"})
        assert status == 401 and orjson.loads(raw)["error"]["type"] == "authentication_error"
        status, raw = await _raw(p.url + "/v1/messages", body, {"x-api-key": "sk-proxy"})
        events = _sse(raw)
        assert status == 200 and [n for n, _ in events][:2] == ["message_start", "ping"]
        assert all(name == data["type"] for name, data in events) and b"chat.completion" not in raw
        upstream.script.break_stream_after = 3
        status, raw = await _raw(p.url + "/v1/messages", body, {"x-api-key": "sk-proxy"})
        name, data = _sse(raw)[-1]
        assert name == "error" and data["type"] == "error" and "broke off" in data["error"]["message"]
        upstream.script.break_stream_after, upstream.script.status = None, 503
        status, raw = await _raw(p.url + "/v1/messages", body, {"x-api-key": "sk-proxy"})
        assert status == 503 and orjson.loads(raw)["error"]["type"] == "api_error"
    finally:
        p.close()


JUNK = (None, 7, 2.5, True, "x", [], [1], {}, {"type": 1}, [{"type": "text"}], [{"role": 3}], [[]])


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_junk_in_any_field_is_a_4xx_never_a_5xx(proxy, path):
    base = ({"model": "m", "input": "hi"} if path.endswith("responses") else
            {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    fields = ["model", "input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "stream",
              "previous_response_id", "parallel_tool_calls", "temperature", "metadata", "messages", "system",
              "max_tokens", "stop_sequences", "top_k", "output_config", "seed"]
    async with aiohttp.ClientSession() as s:
        for field in fields:
            for junk in JUNK:
                body = {**base, field: junk}
                for item in ({"role": "user", "content": junk}, {"type": "function_call_output", "output": junk,
                                                                 "call_id": "c"}):
                    for candidate in (body, {**base, "input": [item]}, {**base, "messages": [item]}):
                        async with s.post(proxy.url + path, json=candidate) as r:
                            assert r.status in (200, 400), (candidate, r.status, await r.text())


# ---------------------------------------------------------------------------------------------------------------
# Endpoints the proxy does not record.
# ---------------------------------------------------------------------------------------------------------------


async def test_endpoints_the_engine_lacks_are_501_never_500(proxy, upstream):
    async with aiohttp.ClientSession() as s:
        for path in ("/v1/embeddings", "/e/ep/v1/audio/speech", "/v1/images/generations"):
            async with s.post(proxy.url + path, json={"model": "m", "input": "x"}) as r:
                err = (await r.json())["error"]
                assert r.status == 501 and err["code"] == "not_implemented", err
                assert upstream.url in err["message"] and path.split("/v1")[1] in err["message"]
        async with s.get(proxy.url + "/v1/files") as r:
            assert r.status == 501
        async with s.post(proxy.url + "/v1/models") as r:  # a route of ours, the wrong method
            assert r.status == 405
    proxy.close()
    assert db_rows(proxy.db_path, "SELECT count(*) FROM calls") == [(0,)]


async def test_the_engine_s_other_routes_are_forwarded_unrecorded(tmp_path):
    async def embeddings(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"object": "list", "data": [{"embedding": [0.5], "index": 0}],
                                  "model": body["model"], "q": request.query.get("x")})

    async def listed(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "policy"}]})

    app = web.Application()
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", listed)
    engine = BackgroundApp(app)
    p = RunningProxy(engine.url, tmp_path / "f.duckdb")
    try:
        async with aiohttp.ClientSession() as s, s.post(p.url + "/v1/embeddings?x=1",
                                                        json={"model": "text-embedding-3-small"}) as r:
            assert r.status == 200 and await r.json() == {"object": "list", "data": [{"embedding": [0.5], "index": 0}],
                                                          "model": "policy", "q": "1"}
    finally:
        p.close()
        engine.close()
    assert db_rows(p.db_path, "SELECT count(*) FROM calls") == [(0,)]


# ---------------------------------------------------------------------------------------------------------------
# Engine tier: the real vLLM, the real SDKs, token ids in DuckDB, two-turn conversations merged token-exactly.
# ---------------------------------------------------------------------------------------------------------------
