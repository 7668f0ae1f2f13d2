"""The Responses wire with the tools coding agents send (Codex CLI's request, as it ships): a `namespace` tool's
functions offered flat and answered under their namespace, a `custom` (free-form) tool offered as a function of
one string and answered as a custom tool call, hosted tools left out of the prompt and recorded as left out (or
refused, when the proxy is told to), and `store: false` / `include` / `reasoning` / `prompt_cache_key` /
`client_metadata` accepted. Driven through the scripted engine, which shows exactly what reached it."""

from __future__ import annotations

import json

import aiohttp
import orjson
import pytest

from tests.support import RunningProxy, db_rows

SHELL = {"type": "function", "name": "exec_command", "description": "Run a command.", "strict": False,
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "spawn_agent", "description": "Start a sub-agent.", "strict": False,
     "parameters": {"type": "object", "properties": {"message": {"type": "string"}}}},
    {"type": "function", "name": "wait_agent", "description": "Wait for one.", "strict": False,
     "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}}]}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: \"*** Begin Patch\" /(.|\\n)*/"}}
HOSTED = [{"type": "web_search", "external_web_access": False}, {"type": "tool_search", "execution": "client"}]


def codex_request(**more) -> dict:
    """A request shaped as Codex CLI 0.171 sends its first turn (the prompt and tool texts are ours)."""
    return {"model": "gpt-5-codex", "stream": False, "store": False, "tool_choice": "auto",
            "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "0193-session", "client_metadata": {"originator": "codex_exec"},
            "tools": [SHELL, AGENTS, PATCH, *HOSTED],
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Code."}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix it."}]}],
            **more}


@pytest.fixture
def proxy(upstream, tmp_path):
    p = RunningProxy(upstream.url, tmp_path / "rec.duckdb")
    yield p
    p.close()


async def _post(url: str, body: dict) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/responses", json=body) as r:
        return r.status, await r.read()


def _events(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]


async def test_codex_tools_reach_the_engine_as_functions_and_hosted_ones_are_left_out_and_recorded(proxy, upstream):
    status, raw = await _post(proxy.url, codex_request())
    assert status == 200, raw
    sent = upstream.engine.requests[-1]
    names = [t["function"]["name"] for t in sent["tools"]]
    assert names == ["exec_command", "multi_agent_v1__spawn_agent", "multi_agent_v1__wait_agent", "apply_patch"]
    patch = sent["tools"][-1]["function"]
    assert patch["parameters"] == {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
    assert "Edit files with a patch." in patch["description"] and "*** Begin Patch" in patch["description"]
    assert not {"store", "include", "reasoning", "prompt_cache_key", "client_metadata"} & set(sent)
    proxy.close()
    [(extra,)] = db_rows(proxy.db_path, "SELECT extra FROM calls")
    assert orjson.loads(extra)["tools_left_out"] == ["web_search", "tool_search"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_namespaced_function_is_answered_under_its_namespace(proxy, upstream, stream):
    upstream.script.tool_name, upstream.script.tool_arguments = "multi_agent_v1__spawn_agent", '{"message": "go"}'
    status, raw = await _post(proxy.url, codex_request(stream=stream))
    assert status == 200, raw
    if stream:
        events = _events(raw)
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        final = next(e["response"] for e in events if e["type"] == "response.completed")
        assert [e["item"]["name"] for e in events if e["type"] == "response.output_item.added"] == ["spawn_agent"]
    else:
        final = orjson.loads(raw)
        done = final["output"]
    for items in (done, final["output"]):
        (call,) = items
        assert (call["type"], call["name"], call["namespace"]) == ("function_call", "spawn_agent", "multi_agent_v1")
        assert json.loads(call["arguments"]) == {"message": "go"} and call["call_id"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_custom_tool_is_answered_as_a_custom_tool_call_with_its_input(proxy, upstream, stream):
    upstream.script.tool_name = "apply_patch"
    upstream.script.tool_arguments = json.dumps({"input": "*** Begin Patch\n*** End Patch"})
    status, raw = await _post(proxy.url, codex_request(stream=stream))
    assert status == 200, raw
    if stream:
        events = _events(raw)
        assert not [e for e in events if e["type"] == "response.function_call_arguments.delta"]
        assert [e["input"] for e in events if e["type"] == "response.custom_tool_call_input.done"] == [
            "*** Begin Patch\n*** End Patch"]
        (call,) = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    else:
        (call,) = orjson.loads(raw)["output"]
    assert (call["type"], call["name"], call["input"]) == ("custom_tool_call", "apply_patch",
                                                           "*** Begin Patch\n*** End Patch")


async def test_the_history_codex_sends_back_becomes_the_calls_the_model_wrote(proxy, upstream):
    """store: false, the whole history resent: namespaced calls and custom tool calls read back under the names and
    arguments they were offered with, their outputs as tool messages."""
    history = [
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Plan."}], "content": None,
         "encrypted_content": None},
        {"type": "function_call", "id": "fc_1", "status": "completed", "name": "spawn_agent",
         "namespace": "multi_agent_v1", "arguments": '{"message": "go"}', "call_id": "call_a"},
        {"type": "function_call_output", "id": "fco_1", "call_id": "call_a", "output": "agent 7"},
        {"type": "custom_tool_call", "id": "ctc_1", "status": "completed", "name": "apply_patch",
         "input": "*** Begin Patch", "call_id": "call_b"},
        {"type": "custom_tool_call_output", "call_id": "call_b", "output": "Done!"},
    ]
    body = codex_request()
    body["input"] += history
    status, raw = await _post(proxy.url, body)
    assert status == 200, raw
    messages = upstream.engine.requests[-1]["messages"]
    assert messages[2:] == [
        {"role": "assistant", "content": None, "reasoning": "Plan.", "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "multi_agent_v1__spawn_agent", "arguments": '{"message": "go"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "agent 7"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_b", "type": "function",
             "function": {"name": "apply_patch", "arguments": '{"input": "*** Begin Patch"}'}}]},
        {"role": "tool", "tool_call_id": "call_b", "content": "Done!"},
    ]


async def test_hosted_tools_are_refused_by_name_when_the_proxy_is_told_to(upstream, tmp_path):
    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb", hosted_tools="refuse")
    try:
        status, raw = await _post(proxy.url, codex_request())
    finally:
        proxy.close()
    err = orjson.loads(raw)["error"]
    assert status == 400 and err["param"] == "tools[3]" and err["code"] == "unsupported_value"
    assert "web_search" in err["message"] and "--hosted-tools leave_out" in err["message"]  # the setting that allows it
    [(http_status, error)] = db_rows(proxy.db_path, "SELECT http_status, error FROM calls")
    assert http_status == 400 and error == err["message"]  # refused, and recorded with the reason
    assert "--hosted-tools leave_out" in err["message"] and not upstream.engine.requests
    [(call_status, extra)] = db_rows(proxy.db_path, "SELECT status, extra FROM calls")
    assert call_status == "error" and orjson.loads(extra) == {"wire": "responses"}


def test_hosted_tools_takes_two_choices():
    from proxy.config import ProxyConfig

    with pytest.raises(ValueError, match="hosted_tools 'drop'.*leave_out.*refuse"):
        ProxyConfig(upstream_url="http://127.0.0.1:1", hosted_tools="drop")
