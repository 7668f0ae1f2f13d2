"""Token-exact continuity without an engine: matching an echoed conversation to the reply it continues, the
completions request it becomes, the chat answer a completions stream turns into, and the fallback when the
engine cannot render (a scripted engine without /tokenize)."""

from __future__ import annotations

import json
import uuid

import aiohttp
import pytest

from harness.core.records import OK, Call, Choice
from proxy.chat_answer import ChatAnswer
from proxy.continuity import Plan, Timelines, completions_body, prefix_hashes, unsupported
from proxy.tool_parsers import get_parser
from tests.support import RunningProxy, db_rows

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
BASE = [{"role": "system", "content": "You add."}, {"role": "user", "content": "1 and 2"}]
REPLY_CALLS = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"b": 2, "a": 1}'}}]


def _body(messages, **extra) -> dict:
    return {"model": "policy", "messages": messages, "tools": TOOLS, **extra}


def _call(episode: str, prompt: list[int], completion: list[int], *, text=None, tool_calls=None,
          finish="tool_calls") -> Call:
    return Call(uuid.uuid4().hex, "run", episode, 0, "chat", False, "m", "policy", "role", None, None, b"{}", None,
                prompt, [Choice(0, completion, [0.0] * len(completion), finish, text, tool_calls)], "engine", OK, 200,
                None, 0.0, 1.0, None, 0)


def _remembered(episode="ep") -> tuple[Timelines, Call]:
    timelines = Timelines()
    body = _body(BASE)
    call = _call(episode, [1, 2, 3], [7, 8, 9], tool_calls=REPLY_CALLS)
    timelines.remember(call, body, prefix_hashes(body))
    return timelines, call


@pytest.mark.parametrize("echo", [
    {"role": "assistant", "content": None, "tool_calls": REPLY_CALLS},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                                                         "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}]},
    {"role": "assistant", "content": [], "reasoning_content": "hm", "refusal": None, "tool_calls": REPLY_CALLS},
], ids=["as_sent", "compact_arguments", "sdk_fields"])
def test_an_echoed_reply_is_found_however_the_agent_serialises_it(echo):
    timelines, call = _remembered()
    messages = [*BASE, echo, {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    body = _body(messages)
    parent, index, fallback = timelines.find("ep", body, prefix_hashes(body))
    assert fallback is None and index == 2
    assert (parent.call_id, list(parent.prompt_ids), list(parent.completion_ids)) == (call.call_id, [1, 2, 3],
                                                                                     [7, 8, 9])


@pytest.mark.parametrize("change, reason", [
    (lambda m: m.__setitem__(2, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 5}'}}]}),
     "history_not_recorded"),
    (lambda m: m.__setitem__(0, {"role": "system", "content": "Other."}), "history_not_recorded"),
    (lambda m: m.pop(), "no_new_messages"),
], ids=["edited_reply", "changed_system", "nothing_new"])
def test_what_does_not_continue_a_reply_says_why(change, reason):
    timelines, _ = _remembered()
    messages = [*BASE, {"role": "assistant", "content": None, "tool_calls": REPLY_CALLS},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    change(messages)
    body = _body(messages)
    parent, _, fallback = timelines.find("ep", body, prefix_hashes(body))
    assert parent is None and fallback.reason == reason


def test_other_tools_model_or_episode_do_not_continue():
    timelines, _ = _remembered()
    messages = [*BASE, {"role": "assistant", "content": None, "tool_calls": REPLY_CALLS},
                {"role": "user", "content": "more"}]
    for body, episode in ((_body(messages, tools=[]), "ep"), ({**_body(messages), "model": "other"}, "ep"),
                          (_body(messages), "other-episode")):
        parent, _, fallback = timelines.find(episode, body, prefix_hashes(body))
        assert parent is None and fallback.reason in ("history_not_recorded", "no_earlier_call")


def test_the_least_recently_used_episodes_are_forgotten():
    timelines = Timelines(max_episodes=2)
    for episode in ("a", "b", "c"):
        body = _body(BASE)
        timelines.remember(_call(episode, [1], [2], text="x", finish="stop"), body, prefix_hashes(body))
    body = _body([*BASE, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}])
    assert timelines.find("a", body, prefix_hashes(body))[2].reason == "no_earlier_call"
    assert timelines.find("c", body, prefix_hashes(body))[2] is None


def test_unsupported_features_are_named():
    assert unsupported(_body(BASE)) is None
    assert unsupported(_body(BASE, tool_choice="auto")) is None
    assert unsupported(_body(BASE, response_format={"type": "json_object"})) == "response_format"
    assert unsupported(_body(BASE, tool_choice={"type": "function", "function": {"name": "add"}})) == "tool_choice"


def test_the_completions_request_keeps_sampling_and_always_caps_tokens():
    plan = Plan("token_exact", prompt_ids=[1, 2, 3], max_model_len=100)
    body = _body(BASE, temperature=0.5, top_p=0.9, seed=4, stop=["x"], n=2, logprobs=True, top_logprobs=3,
                 max_completion_tokens=7, stream=True, stream_options={"include_usage": True},
                 parallel_tool_calls=False, return_token_ids=True)
    out = completions_body(body, plan)
    assert out["prompt"] == [1, 2, 3] and out["max_tokens"] == 7 and out["logprobs"] == 3
    assert {k: out[k] for k in ("temperature", "top_p", "seed", "stop", "n", "stream")} == {
        "temperature": 0.5, "top_p": 0.9, "seed": 4, "stop": ["x"], "n": 2, "stream": True}
    assert out["add_special_tokens"] is False and out["return_token_ids"] is True
    assert out["skip_special_tokens"] is False  # tools offered: markers may be special tokens, as in vLLM
    for chat_only in ("messages", "tools", "max_completion_tokens", "top_logprobs", "parallel_tool_calls"):
        assert chat_only not in out
    assert completions_body(_body(BASE), plan)["max_tokens"] == 97  # unasked: all the room left, never 16


def _stream(texts: list[str], finish: str = "stop") -> list[dict]:
    chunks = []
    for k, text in enumerate(texts):
        last = k == len(texts) - 1
        chunks.append({"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "policy", "choices": [{
            "index": 0, "text": text, "finish_reason": finish if last else None, "token_ids": [100 + k],
            "prompt_token_ids": [1, 2] if k == 0 else None,
            "logprobs": {"tokens": [text], "token_logprobs": [-0.5], "top_logprobs": [{text: -0.5}]}}]})
    return chunks


def test_a_streamed_tool_call_is_held_back_and_sent_whole():
    answer = ChatAnswer(get_parser("hermes"))
    pieces = ["Sure", ". <tool", '_call>\n{"name": "add", ', '"arguments": {"a":1}}\n</tool_call>']
    out = [c for chunk in _stream(pieces) for c in answer.chunk(chunk)]
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert out[0]["prompt_token_ids"] == [1, 2] and out[0]["id"] == "chatcmpl-1"
    deltas = [c["choices"][0]["delta"] for c in out[1:]]
    assert "".join(d.get("content", "") for d in deltas) == "Sure. "
    assert deltas[1] == {"content": ". "}  # "<tool" held back: it may start a tool call
    (call,) = deltas[-1]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert out[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["choices"][0]["token_ids"] for c in out[1:]] == [[100], [101], [102], [103]]
    assert all(c["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.5 for c in out[1:])


def test_held_back_text_that_is_no_tool_call_is_sent_at_the_end():
    answer = ChatAnswer(get_parser("hermes"))
    out = [c for chunk in _stream(["a <tool", "box"], finish="length") for c in answer.chunk(chunk)]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in out[1:]) == "a <toolbox"
    assert out[-1]["choices"][0]["finish_reason"] == "length"


def test_a_whole_answer_has_the_chat_shape_with_only_the_first_call_when_not_parallel():
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n' * 2
    obj = {"id": "cmpl-9", "created": 5, "model": "policy", "usage": {"prompt_tokens": 2}, "choices": [{
        "index": 0, "text": text, "finish_reason": "stop", "token_ids": [5, 6], "prompt_token_ids": [1, 2],
        "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0], "top_logprobs": [{"a": -1.0, "c": -3.0},
                                                                                            {"b": -2.0}]}}]}
    out = ChatAnswer(get_parser("hermes"), top_logprobs=1, parallel_tool_calls=False).response(obj)
    choice = out["choices"][0]
    assert out["object"] == "chat.completion" and out["prompt_token_ids"] == [1, 2]
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
    assert choice["message"]["content"] is None
    assert choice["logprobs"]["content"][0]["top_logprobs"] == [{"token": "a", "logprob": -1.0, "bytes": [97]}]
    plain = ChatAnswer(None).response(obj)["choices"][0]
    assert plain["message"]["content"] == text and plain["finish_reason"] == "stop"


async def test_an_engine_that_cannot_render_falls_back_to_chat_and_says_why(upstream, tmp_path):
    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb")
    url = f"{proxy.url}/e/ep/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json={"model": "m", "messages": BASE}) as r:
                first = await r.json()
            reply = first["choices"][0]["message"]
            body = {"model": "m", "messages": [*BASE, reply, {"role": "user", "content": "again"}]}
            async with session.post(url, json=body) as r:
                assert r.status == 200
                second = await r.json()
    finally:
        proxy.close()
    assert second["object"] == "chat.completion"
    rows = db_rows(tmp_path / "rec.duckdb", "SELECT extra->'continuity' FROM calls ORDER BY call_index")
    modes = [json.loads(r[0]) for r in rows]
    assert modes[0] == {"mode": "chat", "reason": "no_earlier_call"}
    assert modes[1]["mode"] == "chat" and modes[1]["reason"] == "render_failed" and "/tokenize" in modes[1]["error"]


def test_memory_is_bounded_by_ids_held_and_replies_per_episode():
    timelines = Timelines(max_tokens=20, max_parents=2)
    for episode in ("a", "b"):
        for turn in range(3):
            body = _body([*BASE, {"role": "user", "content": f"turn {turn}"}])
            timelines.remember(_call(episode, [1] * 4, [2] * 2, text=f"r{turn}", finish="stop"), body,
                               prefix_hashes(body))
    # Each reply holds 6 ids; "a" kept its 2 latest replies (12 ids), then "b" pushed the total past 20: "a" went.
    assert timelines.tokens == 12
    body = _body([*BASE, {"role": "user", "content": "turn 2"}, {"role": "assistant", "content": "r2"},
                  {"role": "user", "content": "next"}])
    assert timelines.find("a", body, prefix_hashes(body))[2].reason == "no_earlier_call"
    assert timelines.find("b", body, prefix_hashes(body))[2] is None
    old = _body([*BASE, {"role": "user", "content": "turn 0"}, {"role": "assistant", "content": "r0"},
                 {"role": "user", "content": "next"}])
    assert timelines.find("b", old, prefix_hashes(old))[2].reason == "history_not_recorded"
