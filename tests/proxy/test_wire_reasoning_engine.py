"""Reasoning through the Responses API and Anthropic Messages on the real engine: a Qwen3-style model served with
vLLM's qwen3 reasoning parser, its reply forced to think and then answer. The agent gets the thinking as a
`reasoning` item / `thinking` block and the answer as the message, whole and streamed, through the real SDKs;
a tool loop that echoes the reasoning item back continues token-exactly."""

from __future__ import annotations

import re

import anthropic
import openai
import pytest

from harness.core.merge import FIRST_CALL, merge_episode
from harness.running.proxied import engine_parsing
from harness.store.database import Store
from tests.families import FAMILIES
from tests.support import RunningProxy

pytestmark = pytest.mark.engine

QWEN3 = FAMILIES["qwen3"]
ADD = {"type": "function", "name": "add", "description": "Add a number to the running total.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}


def _forced(text: str, bias: dict) -> dict:
    return {"structured_outputs": {"regex": re.escape(text)}, "logit_bias": bias, "seed": 1}


def test_reasoning_reaches_responses_and_messages_agents(qwen3_engine, tmp_path):
    engine, bias = qwen3_engine
    proxy = RunningProxy(engine.base_url, tmp_path / "rec.duckdb", served_model=engine.served_model,
                         **engine_parsing(engine))
    reply = _forced("<think>\nI add.\n</think>\n\nIt is 3.", bias)
    try:
        oa = openai.OpenAI(base_url=f"{proxy.url}/e/rs/v1", api_key="sk-test", max_retries=0)
        ask = dict(model="gpt-5-mini", input="Add 1 and 2.", max_output_tokens=60, temperature=0.0, extra_body=reply)
        whole = oa.responses.create(**ask)
        events = list(oa.responses.create(stream=True, **ask))
        streamed = events[-1].response
        for resp in (whole, streamed):
            assert resp.status == "completed" and [i.type for i in resp.output] == ["reasoning", "message"], resp
            assert resp.output[0].content[0].text.strip() == "I add."
            assert resp.output_text.strip() == "It is 3."
        assert whole.usage.output_tokens_details.reasoning_tokens > 0  # vLLM's count, on the chat path
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert deltas == streamed.output[0].content[0].text
        assert [e.sequence_number for e in events] == list(range(len(events)))

        an = anthropic.Anthropic(base_url=f"{proxy.url}/e/an", api_key="sk-ant-test", max_retries=0)
        ask = dict(model="claude-haiku-4-5", max_tokens=60, extra_body={**reply, "temperature": 0.0},
                   messages=[{"role": "user", "content": "Add 1 and 2."}])
        whole = an.messages.create(**ask)
        with an.messages.stream(**ask) as stream:
            kinds = [e.type for e in stream]
            streamed = stream.get_final_message()
        assert "thinking" in kinds  # the SDK's own event for a thinking_delta
        for msg in (whole, streamed):
            assert [b.type for b in msg.content] == ["thinking", "text"], msg
            assert msg.content[0].thinking.strip() == "I add." and msg.content[1].text.strip() == "It is 3."
            assert msg.stop_reason == "end_turn"

        # a tool loop: the agent echoes the output items, the reasoning item with them
        first = oa.responses.create(model="gpt-5-mini", input="Add 2.", tools=[ADD], max_output_tokens=80,
                                    temperature=0.0,
                                    extra_body=_forced("<think>\nI call.\n</think>\n\n" + QWEN3.reply("add", {"a": 2}),
                                                       bias))
        assert [i.type for i in first.output] == ["reasoning", "function_call"], first.output
        result = {"type": "function_call_output", "call_id": first.output[1].call_id, "output": "3"}
        second = oa.responses.create(model="gpt-5-mini", tools=[ADD], max_output_tokens=60, temperature=0.0,
                                     input=[{"role": "user", "content": "Add 2."}, *first.output, result],
                                     extra_body=reply)
        assert second.output_text.strip() == "It is 3."
    finally:
        proxy.close()
    with Store.open(tmp_path / "rec.duckdb", read_only=True) as store:
        calls = store.load_calls("rs") + store.load_calls("an")
    assert [c.extra["wire"] for c in calls] == ["responses"] * 4 + ["messages"] * 2
    assert all(c.status == "ok" and c.choices[0].reasoning.strip() in ("I add.", "I call.") for c in calls)
    loop = calls[2:4]
    assert loop[1].extra["continuity"]["mode"] == "token_exact", loop[1].extra
    merged = merge_episode(loop)
    assert [b.reason for b in merged.breaks] == [FIRST_CALL] and merged.n_drift == 0
