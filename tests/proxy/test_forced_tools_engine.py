"""Forced tool calls (`tool_choice` "required" or a named function) served token-exactly, against the real engine.

vLLM's chat endpoint constrains a forced call's generation to a JSON schema of the tools and reads the call back
from that JSON; with vLLM's own parsers in the proxy (the engine's model directory known), the proxy puts the same
constraint on its /v1/completions call and reads the answer the same way, so a conversation with forced calls
stays one token-exact sample. The first call of each conversation goes through the chat endpoint on both sides
(the same prompt), so the agent's answer there must equal the engine's own.
"""

from __future__ import annotations

import json

import openai
import pytest

from harness.core.merge import FIRST_CALL, merge_episode
from harness.running.proxied import engine_parsing
from harness.store.database import Store
from tests.support import RunningProxy

pytestmark = pytest.mark.engine

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add a number to the running total.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
NAMED = {"type": "function", "function": {"name": "add"}}


def _ask(client, messages, choice, stream: bool, model: str = "gpt-4o-mini") -> dict:
    body = dict(model=model, messages=messages, tools=TOOLS, tool_choice=choice, temperature=0.0, seed=2,
                max_tokens=96, parallel_tool_calls=False)  # one call: the random model would write them on
    if not stream:
        c = client.chat.completions.create(**body).choices[0]
        return {"content": c.message.content, "finish": c.finish_reason,
                "calls": [(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls or ()]}
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **body):
        for c in chunk.choices:
            content += c.delta.content or ""
            for t in c.delta.tool_calls or ():
                slot = calls.setdefault(t.index, [t.id, "", ""])
                slot[1] += t.function.name or ""
                slot[2] += t.function.arguments or ""
            finish = c.finish_reason or finish
    return {"content": content or None, "finish": finish, "calls": [tuple(calls[k]) for k in sorted(calls)]}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_required_and_named_tool_calls_continue_token_exactly(engine, tmp_path, stream):
    proxy = RunningProxy(engine.base_url, tmp_path / "rec.duckdb", served_model=engine.served_model,
                         **engine_parsing(engine))
    client = openai.OpenAI(base_url=f"{proxy.url}/e/forced/v1", api_key="sk-test", max_retries=0)
    direct = openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="sk-test", max_retries=0)
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "Add a number."}]
    answers = []
    try:
        for turn, choice in enumerate(("required", NAMED, "none")):
            answer = _ask(client, messages, choice, stream)
            answers.append(answer)
            if turn == 0:  # the same prompt on both sides: the same answer, bar the call ids
                same = _ask(direct, messages, choice, stream, engine.served_model)
                assert [c[1:] for c in answer["calls"]] == [c[1:] for c in same["calls"]]
                assert answer["finish"] == same["finish"]
            calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                     for i, n, a in answer["calls"]]
            messages.append({"role": "assistant", "content": answer["content"], **({"tool_calls": calls} if calls
                                                                                   else {})})
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": "7"} for c in calls]
    finally:
        proxy.close()
    for answer in answers[:2]:  # a forced call of the tool, its arguments JSON (what the random model put there)
        assert [n for _, n, _ in answer["calls"]] == ["add"], answers
        json.loads(answer["calls"][0][2])
    assert answers[0]["finish"] == "tool_calls" and answers[1]["finish"] == "stop"  # vLLM: a named call "stops"
    assert answers[2]["calls"] == [] and answers[2]["finish"] in ("stop", "length")
    with Store.open(tmp_path / "rec.duckdb", read_only=True) as store:
        recorded = store.load_calls("forced")
    assert [c.extra["continuity"]["mode"] for c in recorded] == ["chat", "token_exact", "token_exact"], [
        c.extra["continuity"] for c in recorded]
    merged = merge_episode(recorded)
    assert [b.reason for b in merged.breaks] == [FIRST_CALL] and len(merged.samples) == 1
