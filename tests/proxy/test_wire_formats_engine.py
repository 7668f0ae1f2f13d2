"""The Responses API and Anthropic Messages on the real engine: a tool round trip merges into one sample."""

from __future__ import annotations

import json

import pytest

from harness.core.merge import FIRST_CALL, merge_episode
from harness.store.database import Store
from tests.proxy.test_wire_formats import _an, _oa
from tests.support import RunningProxy

FN_TOOL = {"type": "function", "name": "lookup", "description": "Look a word up.",
           "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}
AN_TOOL = {"name": "lookup", "description": "Look a word up.", "input_schema": FN_TOOL["parameters"]}

TOOL_CALL = r'<tool_call>\n\{"name":"lookup","arguments":\{"word":"(cat|dog)"\}\}\n</tool_call>'


def _engine_proxy(engine, path) -> RunningProxy:
    return RunningProxy(engine.base_url, path, served_model=engine.served_model)


def _load(db_path, episode):
    with Store.open(db_path, read_only=True) as store:
        return store.load_calls(episode)


def _check_merged(calls) -> None:
    """The calls carry the engine's ids and merge into one sequence whose sampled tokens are exactly theirs."""
    for call in calls:
        assert call.status == "ok" and call.extra["wire"] in ("responses", "messages"), (call.status, call.error)
        assert call.prompt_ids and call.choices[0].completion_ids
        assert len(call.choices[0].logprobs) == len(call.choices[0].completion_ids)
    assert calls[1].extra["continuity"]["mode"] == "token_exact", calls[1].extra
    merged = merge_episode(calls)
    assert [b.reason for b in merged.breaks] == [FIRST_CALL]
    (sample,) = merged.samples
    assert sample.token_ids == calls[-1].prompt_ids + calls[-1].choices[0].completion_ids
    for call in calls:
        start, ids = len(call.prompt_ids), call.choices[0].completion_ids
        assert sample.token_ids[start:start + len(ids)] == ids
        assert sample.loss_mask[start:start + len(ids)] == [1] * len(ids)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_responses_on_the_engine_tool_round_trip_merges(engine, tmp_path, stream):
    proxy = _engine_proxy(engine, tmp_path / "rec.duckdb")
    client = _oa(proxy, "resp")
    forced = {"structured_outputs": {"regex": TOOL_CALL}}
    common = dict(model="gpt-4.1-mini", instructions="You look words up.", tools=[FN_TOOL], temperature=0.0)

    def ask(first: bool, **kw):
        if not stream:
            return client.responses.create(**common, **kw)
        # create(stream=True): the events as they come; the answer is in the last one (response.completed, or
        # response.incomplete for the second turn, cut off at 6 tokens as OpenAI would say)
        events = list(client.responses.create(stream=True, **common, **kw))
        if first:
            assert any(e.type == "response.function_call_arguments.delta" for e in events)
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type == f"response.{events[-1].response.status}"
        return events[-1].response

    try:
        first = ask(True, input="Look up a word.", max_output_tokens=40, extra_body=forced)
        (call,) = [o for o in first.output if o.type == "function_call"]
        assert call.name == "lookup" and json.loads(call.arguments)["word"] in ("cat", "dog")
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "a small animal"}
        if stream:  # by previous_response_id
            second = ask(False, previous_response_id=first.id, input=[result], max_output_tokens=6)
        else:  # the whole conversation sent again, the output items echoed
            second = ask(False, input=[{"role": "user", "content": "Look up a word."}, *first.output, result],
                         max_output_tokens=6)
        assert second.status in ("completed", "incomplete") and second.usage.output_tokens >= 1
        text = second.output_text
    finally:
        proxy.close()
    calls = _load(tmp_path / "rec.duckdb", "resp")
    assert len(calls) == 2
    _check_merged(calls)
    assert text == (calls[1].choices[0].text or "")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_messages_on_the_engine_tool_round_trip_merges(engine, tmp_path, stream):
    proxy = _engine_proxy(engine, tmp_path / "rec.duckdb")
    client = _an(proxy, "msgs")
    forced = {"structured_outputs": {"regex": TOOL_CALL}, "temperature": 0.0}  # this SDK has no temperature
    common = dict(model="claude-haiku-4-5", system="You look words up.", tools=[AN_TOOL])

    def ask(first: bool, **kw):
        if not stream:
            return client.messages.create(**common, **kw)
        if first:  # create(stream=True): the raw events, assembled here
            events = list(client.messages.create(stream=True, **common, **kw))
            start, blocks = events[0].message, [e.content_block for e in events if e.type == "content_block_start"]
            args = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                           and e.delta.type == "input_json_delta")
            for block in blocks:
                if block.type == "tool_use":
                    block.input = json.loads(args)
            return start.model_copy(update={"content": blocks, "stop_reason": events[-2].delta.stop_reason})
        with client.messages.stream(**common, **kw) as s:
            list(s)
            return s.get_final_message()

    try:
        messages = [{"role": "user", "content": "Look up a word."}]
        first = ask(True, messages=messages, max_tokens=40, extra_body=forced)
        assert first.stop_reason == "tool_use"
        (use,) = [b for b in first.content if b.type == "tool_use"]
        assert use.name == "lookup" and use.input["word"] in ("cat", "dog")
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "a small animal"}]}]
        second = ask(False, messages=messages, max_tokens=6, extra_body={"temperature": 0.0})
        assert second.stop_reason in ("end_turn", "max_tokens") and second.usage.input_tokens > 0
        text = "".join(b.text for b in second.content if b.type == "text")
        count = client.messages.count_tokens(model="claude-haiku-4-5", messages=messages)  # forwarded, unrecorded
    finally:
        proxy.close()
    calls = _load(tmp_path / "rec.duckdb", "msgs")
    assert len(calls) == 2 and count.input_tokens > 0
    _check_merged(calls)
    assert text == (calls[1].choices[0].text or "")
