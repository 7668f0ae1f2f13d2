"""Reasoning through the translated wire formats (proxy/wire/responses.py, proxy/wire/messages.py), on the scripted
engine: a chat answer's `reasoning` (what vLLM's reasoning parser splits out) reaches a Responses agent as a
`reasoning` item and an Anthropic agent as a `thinking` block, whole and streamed, read by the real SDKs; and what
the agents send back (reasoning items, thinking blocks) becomes the assistant message's `reasoning`. The same on
the real engine with a Qwen3 reasoning parser: test_wire_reasoning_engine.py."""

from __future__ import annotations

import json

import anthropic
import openai
import orjson
import pytest
from openai.types.responses import ResponseReasoningItem, ResponseReasoningTextDeltaEvent

from proxy.wire.responses import _usage
from tests.support import RunningProxy, db_rows

FN_TOOL = {"type": "function", "name": "lookup", "description": "Look a word up.",
           "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}
AN_TOOL = {"name": "lookup", "description": "Look a word up.", "input_schema": FN_TOOL["parameters"]}
SCRIPTED_TEXT = "".join(f"w{t} " for t in range(1000, 1008))
THOUGHT = "The user says hi. I answer in kind."
PIECES = ["The ", "user ", "says ", "hi. ", "I ", "answer ", "in ", "kind."]  # as the scripted engine streams it


@pytest.fixture
def proxy(upstream, tmp_path):
    upstream.script.reasoning = THOUGHT
    p = RunningProxy(upstream.url, tmp_path / "rec.duckdb")
    yield p
    p.close()


def _oa(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/e/rs/v1", api_key="sk-test", max_retries=0)


def _an(proxy) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{proxy.url}/e/an", api_key="sk-ant-test", max_retries=0)


# ---------------------------------------------------------------------------------------------------------------
# Responses.
# ---------------------------------------------------------------------------------------------------------------


def test_responses_whole_answer_has_a_reasoning_item_first(proxy, upstream):
    client = _oa(proxy)
    resp = client.responses.create(model="m", input="hi")
    reasoning, message = resp.output
    assert isinstance(reasoning, ResponseReasoningItem) and reasoning.id.startswith("rs_")
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", THOUGHT)]
    assert reasoning.summary == [] and reasoning.status == "completed"
    assert message.type == "message" and resp.output_text == SCRIPTED_TEXT  # the reasoning is not in the text
    assert resp.usage.output_tokens_details.reasoning_tokens == 0  # the scripted engine counts none

    upstream.script.tool_arguments = '{"word": "cat"}'
    resp = client.responses.create(model="m", input="look up cat", tools=[FN_TOOL])
    assert [i.type for i in resp.output] == ["reasoning", "function_call"] and resp.status == "completed"
    assert resp.output[0].content[0].text == THOUGHT and json.loads(resp.output[1].arguments) == {"word": "cat"}

    upstream.script.tool_arguments, upstream.script.content = None, ""  # cut off while still thinking
    resp = client.responses.create(model="m", input="hi")
    (reasoning,) = resp.output
    assert reasoning.type == "reasoning" and reasoning.status == "incomplete" and resp.status == "incomplete"


def test_responses_stream_sends_openais_reasoning_events(proxy, upstream):
    client = _oa(proxy)
    events = list(client.responses.create(model="m", input="hi", stream=True))
    kinds = [e.type for e in events]
    n = len(PIECES)
    assert kinds[:4 + n + 3] == ["response.created", "response.in_progress", "response.output_item.added",
                                 "response.content_part.added", *["response.reasoning_text.delta"] * n,
                                 "response.reasoning_text.done", "response.content_part.done",
                                 "response.output_item.done"]
    assert kinds[4 + n + 3:4 + n + 6] == ["response.output_item.added", "response.content_part.added",
                                          "response.output_text.delta"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, part = events[2], events[3]
    assert added.item.type == "reasoning" and added.item.status == "in_progress" and added.output_index == 0
    assert part.part.type == "reasoning_text" and part.item_id == added.item.id
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert all(isinstance(e, ResponseReasoningTextDeltaEvent) for e in deltas)
    assert [e.delta for e in deltas] == PIECES and {(e.item_id, e.output_index, e.content_index) for e in deltas} == {
        (added.item.id, 0, 0)}
    text_done = events[4 + n]
    assert text_done.text == THOUGHT and text_done.item_id == added.item.id
    item_done = events[4 + n + 2]
    assert item_done.item.type == "reasoning" and item_done.item.status == "completed"
    assert item_done.item.content[0].text == THOUGHT and item_done.item.id == added.item.id
    assert events[4 + n + 3].output_index == 1 and events[4 + n + 3].item.type == "message"
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == SCRIPTED_TEXT
    assert final.output[0].content[0].text == THOUGHT

    upstream.script.tool_arguments = '{"word": "cat"}'
    with client.responses.stream(model="m", input="look up cat", tools=[FN_TOOL]) as stream:
        assert "response.reasoning_text.done" in [e.type for e in stream]
        final = stream.get_final_response()
    assert [i.type for i in final.output] == ["reasoning", "function_call"] and final.status == "completed"
    assert final.output[0].content[0].text == THOUGHT and json.loads(final.output[1].arguments) == {"word": "cat"}


def test_responses_reasoning_items_become_the_assistant_reasoning(proxy, upstream):
    client = _oa(proxy)
    client.responses.create(model="m", input=[
        {"role": "user", "content": "go"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "summary"}],
         "content": [{"type": "reasoning_text", "text": "Think "}, {"type": "reasoning_text", "text": "one."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Only "},
                                                         {"type": "summary_text", "text": "a summary."}]},
        {"type": "function_call", "call_id": "c2", "name": "lookup", "arguments": "{}"},
        {"type": "reasoning", "id": "rs_3", "summary": [], "content": [{"type": "reasoning_text", "text": "More."}]},
        {"type": "function_call", "call_id": "c3", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": "ok"},
        {"type": "function_call_output", "call_id": "c3", "output": "ok"},
        {"type": "reasoning", "id": "rs_4", "summary": [], "encrypted_content": "opaque"},  # nothing to render
        {"type": "message", "role": "assistant", "content": "Done."},
        {"type": "reasoning", "id": "rs_5", "summary": [{"type": "summary_text", "text": "lost"}]},
        {"role": "user", "content": "and?"},  # reasoning before anything but an assistant turn is dropped
    ])
    call = {"type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    assert upstream.engine.requests[-1]["messages"] == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Sure.", "reasoning": "Think one.", "tool_calls": [{"id": "c1", **call}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "assistant", "content": None, "reasoning": "Only \n\na summary.\n\nMore.",
         "tool_calls": [{"id": "c2", **call}, {"id": "c3", **call}]},
        {"role": "tool", "tool_call_id": "c2", "content": "ok"},
        {"role": "tool", "tool_call_id": "c3", "content": "ok"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "and?"},
    ]
    with pytest.raises(openai.BadRequestError, match=r"input\[0\]\.content\[0\]"):
        client.responses.create(model="m", input=[{"type": "reasoning", "id": "r", "summary": [],
                                                   "content": [{"type": "output_text", "text": "x"}]}])


def test_responses_reasoning_comes_back_as_sent_echoed_or_by_previous_response_id(proxy, upstream):
    """An agent echoes the output items (the reasoning item with them), or continues by previous_response_id:
    either way the engine gets the reply with its reasoning, as a chat agent would send it."""
    client = _oa(proxy)
    upstream.script.tool_arguments = '{"word": "cat"}'
    first = client.responses.create(model="m", input="look up cat", tools=[FN_TOOL])
    upstream.script.tool_arguments = None
    result = {"type": "function_call_output", "call_id": first.output[1].call_id, "output": "a small animal"}
    client.responses.create(model="m", tools=[FN_TOOL], input=[
        {"role": "user", "content": "look up cat"}, *[i.model_dump(exclude_none=True) for i in first.output], result])
    echoed = upstream.engine.requests[-1]["messages"]
    client.responses.create(model="m", tools=[FN_TOOL], previous_response_id=first.id, input=[result])
    assert upstream.engine.requests[-1]["messages"] == echoed
    assert echoed[1] == {"role": "assistant", "content": None, "reasoning": THOUGHT, "tool_calls": [
        {"id": first.output[1].call_id, "type": "function",
         "function": {"name": "lookup", "arguments": '{"word": "cat"}'}}]}


def test_responses_usage_counts_reasoning_tokens_only_as_the_engine_does():
    assert _usage({"prompt_tokens": 3, "completion_tokens": 9})["output_tokens_details"] == {"reasoning_tokens": 0}
    usage = _usage({"prompt_tokens": 3, "completion_tokens": 9, "completion_tokens_details": {"reasoning_tokens": 6}})
    assert usage["output_tokens_details"] == {"reasoning_tokens": 6} and usage["output_tokens"] == 9


# ---------------------------------------------------------------------------------------------------------------
# Anthropic Messages.
# ---------------------------------------------------------------------------------------------------------------


def test_messages_answer_has_a_thinking_block_first(proxy, upstream):
    client = _an(proxy)
    msg = client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    thinking, text = msg.content
    assert isinstance(thinking, anthropic.types.ThinkingBlock)
    assert (thinking.thinking, thinking.signature) == (THOUGHT, "") and text.text == SCRIPTED_TEXT

    events = list(client.messages.create(model="m", max_tokens=8, stream=True,
                                         messages=[{"role": "user", "content": "hi"}]))
    kinds = [e.type for e in events]
    n = len(PIECES)
    assert kinds[:n + 4] == ["message_start", "content_block_start", *["content_block_delta"] * n,
                             "content_block_stop", "content_block_start"]
    start, stop, text_start = events[1], events[n + 2], events[n + 3]
    assert start.index == 0 and start.content_block.type == "thinking" and start.content_block.thinking == ""
    assert [e.delta.type for e in events[2:n + 2]] == ["thinking_delta"] * n
    assert [e.delta.thinking for e in events[2:n + 2]] == PIECES and {e.index for e in events[2:n + 2]} == {0}
    assert stop.index == 0 and text_start.index == 1 and text_start.content_block.type == "text"
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.index == 1) == SCRIPTED_TEXT

    upstream.script.tool_arguments = '{"word": "cat"}'
    with client.messages.stream(model="m", max_tokens=8, tools=[AN_TOOL],
                                messages=[{"role": "user", "content": "look up cat"}]) as stream:
        final = stream.get_final_message()
    thinking, tool = final.content
    assert thinking.type == "thinking" and thinking.thinking == THOUGHT and thinking.signature == ""
    assert tool.type == "tool_use" and tool.input == {"word": "cat"} and final.stop_reason == "tool_use"

    # the agent sends the reply back as it came: its thinking becomes the assistant message's reasoning
    result = {"type": "tool_result", "tool_use_id": tool.id, "content": "a small animal"}
    client.messages.create(model="m", max_tokens=8, tools=[AN_TOOL], messages=[
        {"role": "user", "content": "look up cat"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
        {"role": "user", "content": [result]}])
    assert upstream.engine.requests[-1]["messages"][1] == {
        "role": "assistant", "content": None, "reasoning": THOUGHT,
        "tool_calls": [{"id": tool.id, "type": "function", "function": {"name": "lookup",
                                                                         "arguments": '{"word":"cat"}'}}]}
    proxy.close()
    rows = db_rows(proxy.db_path, "SELECT response FROM calls WHERE episode_id = 'an' ORDER BY call_index")
    assert orjson.loads(rows[0][0])["choices"][0]["message"]["reasoning"] == THOUGHT  # recorded in chat form


def test_messages_thinking_blocks_become_the_assistant_reasoning(proxy, upstream):
    client = _an(proxy)
    client.messages.create(model="m", max_tokens=8, messages=[
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "First.", "signature": "sig"},
                                          {"type": "redacted_thinking", "data": "opaque"},
                                          {"type": "text", "text": "Hm."},
                                          {"type": "thinking", "thinking": "Second.", "signature": "sig"},
                                          {"type": "text", "text": " Yes."}]},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "opaque"},
                                          {"type": "text", "text": "No."}]},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Only thought.", "signature": ""}]},
        {"role": "user", "content": "well?"},
    ])
    assert upstream.engine.requests[-1]["messages"] == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Hm. Yes.", "reasoning": "First.\n\nSecond."},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "No."},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "", "reasoning": "Only thought."},
        {"role": "user", "content": "well?"},
    ]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[1\]\.content\[0\]\.thinking"):
        client.messages.create(model="m", max_tokens=8, messages=[
            {"role": "user", "content": "go"}, {"role": "assistant", "content": [{"type": "thinking"}]}])
