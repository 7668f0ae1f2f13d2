"""A Qwen3-style reasoning agent under both choices of `reasoning_history`, against the real engine.

The Qwen3 template renders a reply's reasoning only while its tool loop lasts; at the next user message the
earlier reasoning is gone from the history it renders. Five calls: (think, call a tool), (think, answer), a new
user message, (think, call a tool), (think, answer), a new user message, (think, answer):
- as_rendered: a new sample at each new user message, served on the history as the template renders it (reason
  `template_drops_reasoning`), while the calls of one tool loop still merge: 3 samples;
- keep: every call continues token-exactly with the sampled reasoning in context: 1 sample.
Either way the agent gets `reasoning` apart from the content, and every sampled token, thinking included, is
trained (mask 1) exactly as sampled.
"""

from __future__ import annotations

import json
import re

import openai
import pytest

from harness.core.merge import DROPS_REASONING, FIRST_CALL, merge_episode
from harness.running.proxied import engine_parsing
from harness.store.database import Store
from tests.families import FAMILIES
from tests.families.talk import ask
from tests.support import RunningProxy

pytestmark = pytest.mark.engine

QWEN3 = FAMILIES["qwen3"]
# (user message before the call or None, the reply the model writes)
SCRIPT = [
    ("Add 1.", QWEN3.reply("add", {"a": 1})),
    (None, "It is 1."),
    ("Now add 2.", QWEN3.reply("add", {"a": 2})),
    (None, "It is 3."),
    ("Thanks.", "You are welcome."),
]


def _agent(url: str, bias: dict) -> list[dict]:
    client = openai.OpenAI(base_url=url, api_key="sk-test", max_retries=0)
    messages = [{"role": "system", "content": "You add numbers."}]
    answers = []
    for turn, (user, reply) in enumerate(SCRIPT):
        if user:
            messages.append({"role": "user", "content": user})
        answer = ask(client, messages, re.escape(f"<think>\nThought {turn}.\n</think>\n\n{reply}"), False, bias)
        answers.append(answer)
        message = {"role": "assistant", "content": answer["content"], "reasoning_content": answer["reasoning"]}
        if answer["calls"]:
            message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                                     for i, (n, a) in zip(answer["ids"], answer["calls"], strict=True)]
        messages.append(message)
        messages += [{"role": "tool", "tool_call_id": i, "content": "ok"} for i in answer["ids"]]
    return answers


@pytest.mark.parametrize(("choice", "samples"), [("as_rendered", 3), ("keep", 1)])
def test_reasoning_dropped_from_history_under_each_choice(qwen3_engine, tmp_path, choice, samples):
    engine, bias = qwen3_engine
    proxy = RunningProxy(engine.base_url, tmp_path / "rec.duckdb", served_model=engine.served_model,
                         reasoning_history=choice, **engine_parsing(engine))
    try:
        answers = _agent(f"{proxy.url}/e/agent/v1", bias)
    finally:
        proxy.close()
    for turn, answer in enumerate(answers):  # the agent sees the reasoning apart from the content
        assert answer["reasoning"].strip() == f"Thought {turn}."
        assert answer["reasoning_content"] == answer["reasoning"]  # the name DeepSeek's API and LangChain use
        assert "<think>" not in (answer["content"] or "")
    with Store.open(tmp_path / "rec.duckdb", read_only=True) as store:
        calls = store.load_calls("agent")
    served = [(c.extra["continuity"]["mode"], c.extra["continuity"].get("reason")) for c in calls]
    if choice == "as_rendered":
        assert served == [("chat", "no_earlier_call"), ("token_exact", None), ("chat", DROPS_REASONING),
                          ("token_exact", None), ("chat", DROPS_REASONING)], served
    else:
        assert served == [("chat", "no_earlier_call")] + [("token_exact", None)] * 4, served
    merged = merge_episode(calls)
    assert len(merged.samples) == samples
    assert [b.reason for b in merged.breaks] == [FIRST_CALL] + [DROPS_REASONING] * (samples - 1)
    assert merged.n_drift == 0
    trained = 0
    for call in calls:  # each call's sampled tokens, thinking included, are trained where they were sampled
        ids = call.choices[0].completion_ids
        sample = next(s for s in merged.samples if s.token_ids[len(call.prompt_ids):len(call.prompt_ids) + len(ids)]
                      == ids and s.token_ids[:len(call.prompt_ids)] == call.prompt_ids)
        assert set(sample.loss_mask[len(call.prompt_ids):len(call.prompt_ids) + len(ids)]) == {1}
        trained += len(ids)
    assert sum(sum(s.loss_mask) for s in merged.samples) == trained
    print(f"\n[reasoning_history {choice}] samples {len(merged.samples)}, trained tokens {trained}, "
          f"merge ratio {merged.merge_ratio:.2f}")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_enable_thinking_false_is_honoured_on_both_paths(qwen3_engine, tmp_path, stream):
    """The agent's chat_template_kwargs reach the template (an empty think block in the prompt) and the parser (no
    reasoning to split): the reply is all content, on the first call (chat) and the next (token-exact)."""
    engine, bias = qwen3_engine
    proxy = RunningProxy(engine.base_url, tmp_path / "rec.duckdb", served_model=engine.served_model,
                         **engine_parsing(engine))
    client = openai.OpenAI(base_url=f"{proxy.url}/e/quiet/v1", api_key="sk-test", max_retries=0)
    direct = openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="sk-test", max_retries=0)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    messages = [{"role": "user", "content": "Hi."}]
    try:
        for turn in range(2):
            answer = ask(client, messages, re.escape(f"Hello {turn}."), stream, bias, **off)
            assert (answer["content"], answer["reasoning"]) == (f"Hello {turn}.", None), answer
            same = ask(direct, messages, re.escape(f"Hello {turn}."), stream, bias, engine.served_model, **off)
            assert (same["content"], same["reasoning"]) == (answer["content"], answer["reasoning"])
            messages += [{"role": "assistant", "content": answer["content"]}, {"role": "user", "content": "More."}]
    finally:
        proxy.close()
    with Store.open(tmp_path / "rec.duckdb", read_only=True) as store:
        calls = store.load_calls("quiet")
    assert [c.extra["continuity"]["mode"] for c in calls] == ["chat", "token_exact"], [c.extra for c in calls]
    assert all(b'"enable_thinking":false' in c.request.replace(b" ", b"") for c in calls)  # recorded as sent
