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
from proxy.continuity import Plan, Timelines, completions_body, first_edit, prefix_hashes, unsupported
from proxy.parsing.native import NativeParsing
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


@pytest.mark.parametrize("echo, normalised", [
    ({"role": "assistant", "content": None, "tool_calls": REPLY_CALLS}, None),
    ({"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "add", "arguments": '{"a":1,"b":2}'}}]}, [{"message": 2, "kind": "tool_arguments"}]),
    ({"role": "assistant", "content": [], "reasoning_content": "hm", "refusal": None, "tool_calls": REPLY_CALLS},
     None),
], ids=["as_sent", "compact_arguments", "sdk_fields"])
def test_an_echoed_reply_is_found_however_the_agent_serialises_it(echo, normalised):
    timelines, call = _remembered()
    messages = [*BASE, echo, {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    body = _body(messages)
    found = timelines.find("ep", body, prefix_hashes(body))
    assert found.fallback is None and found.reply_index == 2
    parent = found.parent
    assert (parent.call_id, list(parent.prompt_ids), list(parent.completion_ids)) == (call.call_id, [1, 2, 3],
                                                                                     [7, 8, 9])
    assert found.notes.get("normalised") == normalised


@pytest.mark.parametrize("change, reason", [
    (lambda m: m.__setitem__(2, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 5}'}}]}),
     "reply_edited"),
    (lambda m: m.__setitem__(0, {"role": "system", "content": "Other."}), "history_not_recorded"),
    (lambda m: m.pop(), "no_new_messages"),
], ids=["edited_reply", "changed_system", "nothing_new"])
def test_what_does_not_continue_a_reply_says_why(change, reason):
    timelines, _ = _remembered()
    messages = [*BASE, {"role": "assistant", "content": None, "tool_calls": REPLY_CALLS},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    change(messages)
    body = _body(messages)
    found = timelines.find("ep", body, prefix_hashes(body))
    assert found.parent is None and found.fallback.reason == reason


def test_other_tools_model_or_episode_do_not_continue():
    timelines, _ = _remembered()
    messages = [*BASE, {"role": "assistant", "content": None, "tool_calls": REPLY_CALLS},
                {"role": "user", "content": "more"}]
    for body, episode in ((_body(messages, tools=[]), "ep"), ({**_body(messages), "model": "other"}, "ep"),
                          (_body(messages), "other-episode")):
        found = timelines.find(episode, body, prefix_hashes(body))
        assert found.parent is None and found.fallback.reason in ("history_not_recorded", "no_earlier_call")


def test_the_least_recently_used_episodes_are_forgotten():
    timelines = Timelines(max_episodes=2)
    for episode in ("a", "b", "c"):
        body = _body(BASE)
        timelines.remember(_call(episode, [1], [2], text="x", finish="stop"), body, prefix_hashes(body))
    body = _body([*BASE, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}])
    assert timelines.find("a", body, prefix_hashes(body)).fallback.reason == "no_earlier_call"
    assert timelines.find("c", body, prefix_hashes(body)).fallback is None


def test_an_episode_that_never_ends_keeps_a_bounded_set_of_the_prefixes_it_saw():
    """The default episode takes every call that names none, for as long as the proxy runs."""
    timelines = Timelines(max_seen_prefixes=10)
    for i in range(40):
        body = _body([*BASE, {"role": "user", "content": f"task {i}"}])
        timelines.remember(_call("default", [1], [2], text="x", finish="stop"), body, prefix_hashes(body))
    seen = timelines._episodes["default"].seen_prefixes
    assert 0 < len(seen) <= 10 + len(BASE) + 2
    for task, matched in ((39, len(BASE) + 1), (0, len(BASE))):  # the latest prefixes still tell; the first not
        body = _body([*BASE, {"role": "user", "content": f"task {task}"}, {"role": "user", "content": "more"}])
        found = timelines.find("default", body, prefix_hashes(body))
        assert found.fallback.reason == "history_not_recorded"
        assert found.fallback.detail["first_unmatched_message"] == matched


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
    out = completions_body(body, plan, _hermes())
    assert out["prompt"] == [1, 2, 3] and out["max_tokens"] == 7 and out["logprobs"] == 3
    assert {k: out[k] for k in ("temperature", "top_p", "seed", "stop", "n", "stream")} == {
        "temperature": 0.5, "top_p": 0.9, "seed": 4, "stop": ["x"], "n": 2, "stream": True}
    assert out["add_special_tokens"] is False and out["return_token_ids"] is True
    assert out["skip_special_tokens"] is False  # tools offered: markers may be special tokens, as in vLLM
    for chat_only in ("messages", "tools", "max_completion_tokens", "top_logprobs", "parallel_tool_calls"):
        assert chat_only not in out
    assert completions_body(_body(BASE), plan, _hermes())["max_tokens"] == 97  # unasked: all the room left, never 16


def _hermes(tools: bool = True):
    """The proxy's own Hermes parsing for a request that offers a tool (or none)."""
    return NativeParsing("hermes", None).request({"tools": [{"type": "function"}]} if tools else {})


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
    answer = ChatAnswer(_hermes())
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
    answer = ChatAnswer(_hermes())
    out = [c for chunk in _stream(["a <tool", "box"], finish="length") for c in answer.chunk(chunk)]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in out[1:]) == "a <toolbox"
    assert out[-1]["choices"][0]["finish_reason"] == "length"


def test_a_whole_answer_has_the_chat_shape_with_only_the_first_call_when_not_parallel():
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n' * 2
    obj = {"id": "cmpl-9", "created": 5, "model": "policy", "usage": {"prompt_tokens": 2}, "choices": [{
        "index": 0, "text": text, "finish_reason": "stop", "token_ids": [5, 6], "prompt_token_ids": [1, 2],
        "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0], "top_logprobs": [{"a": -1.0, "c": -3.0},
                                                                                            {"b": -2.0}]}}]}
    out = ChatAnswer(_hermes(), top_logprobs=1, parallel_tool_calls=False).response(obj)
    choice = out["choices"][0]
    assert out["object"] == "chat.completion" and out["prompt_token_ids"] == [1, 2]
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
    assert choice["message"]["content"] is None
    assert choice["logprobs"]["content"][0]["top_logprobs"] == [{"token": "a", "logprob": -1.0, "bytes": [97]}]
    plain = ChatAnswer(_hermes(tools=False)).response(obj)["choices"][0]
    assert plain["message"]["content"] == text and plain["finish_reason"] == "stop"


def test_a_call_sent_again_with_the_same_messages_is_a_resend():
    """Qwen Code retries a call whose reply was cut off with the identical prompt: that is a resend of the call,
    not a history the proxy failed to keep (history_not_recorded with every message matched)."""
    timelines = Timelines()
    body = _body(BASE)
    first = _call("ep", [1, 2, 3], [7, 8], text="It is", finish="length")  # cut off by max_tokens
    timelines.remember(first, body, prefix_hashes(body))
    again = _body([dict(m) for m in BASE])
    found = timelines.find("ep", again, prefix_hashes(again))
    assert found.parent is None and found.notes == {}
    assert found.fallback.reason == "resend" and found.fallback.detail == {"earlier_call": first.call_id}
    assert found.fallback.record() == {"mode": "chat", "reason": "resend", "earlier_call": first.call_id}
    # the same messages under another tool list, or in another episode, or one message more: no resend
    other_tools = _body(BASE, tools=[])
    assert timelines.find("ep", other_tools, prefix_hashes(other_tools)).fallback.reason == "history_not_recorded"
    assert timelines.find("other", again, prefix_hashes(again)).fallback.reason == "no_earlier_call"
    longer = _body([*BASE, {"role": "user", "content": "and 3?"}])
    found = timelines.find("ep", longer, prefix_hashes(longer))
    assert found.fallback.reason == "history_not_recorded"
    assert found.fallback.detail == {"first_unmatched_message": len(BASE)}


def test_a_resend_names_the_latest_call_it_repeats():
    timelines = Timelines()
    body = _body(BASE)
    calls = [_call("ep", [1, 2, 3], [7 + k], text=f"r{k}", finish="length") for k in range(2)]
    for call in calls:
        timelines.remember(call, body, prefix_hashes(body))
    found = timelines.find("ep", body, prefix_hashes(body))
    assert found.fallback.reason == "resend" and found.fallback.detail["earlier_call"] == calls[1].call_id


async def test_a_resent_call_through_the_proxy_is_recorded_as_a_resend_and_merges_as_a_sibling(upstream, tmp_path):
    """The retry as it happens: the same request twice through the proxy (the scripted engine cuts the reply off,
    finish_reason length). The record says resend, naming the first call; the merger puts both on one prompt."""
    from harness.core.merge import merge_episode
    from harness.store.database import Store

    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb")
    url = f"{proxy.url}/e/ep/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(2):
                async with session.post(url, json={"model": "m", "messages": BASE, "max_tokens": 8}) as r:
                    assert r.status == 200 and (await r.json())["choices"][0]["finish_reason"] == "length"
    finally:
        proxy.close()
    rows = db_rows(tmp_path / "rec.duckdb", "SELECT call_id, extra->'continuity' FROM calls ORDER BY call_index")
    (first_id, first), (_, second) = [(call_id, json.loads(c)) for call_id, c in rows]
    assert first == {"mode": "chat", "reason": "no_earlier_call"}
    assert second == {"mode": "chat", "reason": "resend", "earlier_call": first_id}
    with Store.open(tmp_path / "rec.duckdb", read_only=True) as store:
        merged = merge_episode(store.load_calls("ep"))
    assert [b.reason for b in merged.breaks] == ["first_call", "n_branch"]


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
    assert timelines.find("a", body, prefix_hashes(body)).fallback.reason == "no_earlier_call"
    assert timelines.find("b", body, prefix_hashes(body)).fallback is None
    old = _body([*BASE, {"role": "user", "content": "turn 0"}, {"role": "assistant", "content": "r0"},
                 {"role": "user", "content": "next"}])
    assert timelines.find("b", old, prefix_hashes(old)).fallback.reason == "history_not_recorded"


# --- replies the agent tidied or edited --------------------------------------------------------------------------

SAID = "Sure.\n\nThe sum  is 3.\n"  # a reply as the model wrote it, and as the agent received it


def _said(episode="ep") -> tuple[Timelines, Call]:
    timelines = Timelines()
    body = _body(BASE)
    call = _call(episode, [1, 2, 3], [7, 8, 9], text=SAID, finish="stop")
    timelines.remember(call, body, prefix_hashes(body))
    return timelines, call


def _echo(timelines: Timelines, *history: dict, episode="ep"):
    body = _body([*BASE, *history, {"role": "user", "content": "next"}])
    return timelines.find(episode, body, prefix_hashes(body))


@pytest.mark.parametrize("tidied", [
    "Sure.\n\nThe sum  is 3.",  # trailing newline removed
    SAID.strip(),
    "Sure.\nThe sum  is 3.\n",  # "\n\n" -> "\n"
    "Sure.\n\nThe sum is 3.\n",  # "  " -> " "
    " ".join(SAID.split()),  # every run collapsed to one space, ends stripped
    "\n  Sure.\t\n\nThe sum is 3.   ",
], ids=["trailing_newline", "stripped", "blank_line", "double_space", "collapsed", "other_whitespace"])
def test_a_reply_with_tidied_whitespace_continues_and_says_so(tidied):
    timelines, call = _said()
    found = _echo(timelines, {"role": "assistant", "content": tidied})
    assert found.fallback is None and found.parent.call_id == call.call_id and found.reply_index == 2
    assert found.notes == {"normalised": [{"message": 2, "kind": "whitespace"}]}


def test_a_reply_as_received_continues_with_nothing_normalised():
    timelines, call = _said()
    found = _echo(timelines, {"role": "assistant", "content": SAID})
    assert found.fallback is None and found.parent.call_id == call.call_id and found.notes == {}


def test_reserialised_arguments_and_tidied_text_are_both_recorded():
    timelines = Timelines()
    body = _body(BASE)
    call = _call("ep", [1, 2, 3], [7, 8, 9], text="Adding.\n", tool_calls=REPLY_CALLS)
    timelines.remember(call, body, prefix_hashes(body))
    echo = {"role": "assistant", "content": "Adding.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}]}
    found = _echo(timelines, echo)
    assert found.fallback is None and found.parent.call_id == call.call_id
    assert found.notes["normalised"] == [{"message": 2, "kind": "whitespace"}, {"message": 2, "kind": "tool_arguments"}]


def _two_turns(second_text: str):
    """The episode of _said() with a second call answered `second_text`: (timelines, first call, second call)."""
    timelines, first = _said()
    body = _body([*BASE, {"role": "assistant", "content": SAID}, {"role": "user", "content": "and 4?"}])
    second = _call("ep", [1, 2, 3, 7, 8, 9, 4], [10, 11], text=second_text, finish="stop")
    timelines.remember(second, body, prefix_hashes(body))
    return timelines, first, second


def test_every_remembered_reply_that_came_back_tidied_is_listed():
    """An agent that tidies its history late (the older replies only) still continues; each tidied reply is named."""
    timelines, first, second = _two_turns("It is 7. ")
    found = _echo(timelines, {"role": "assistant", "content": SAID.strip()}, {"role": "user", "content": "and 4?"},
                  {"role": "assistant", "content": "It is 7."})
    assert found.fallback is None and found.parent.call_id == second.call_id and found.reply_index == 4
    assert found.notes["normalised"] == [{"message": 2, "kind": "whitespace"}, {"message": 4, "kind": "whitespace"}]


@pytest.mark.parametrize("edited, char", [
    ("Sure.\n\nThe sum", 14),  # truncated: differs where its last word ends
    ("Sure.\n\nThe total  is 3.\n", 11),  # a word changed: "sum" -> "total" from its first letter
    ("Sure.\n\nThe sum  is 4.\n", 19),
    ("Sure. The sum is 3. Done.", 20),  # tidied and extended: the first extra word
    ("Sure.\n\nThesum is 3.", 10),  # two words joined: not whitespace only
], ids=["truncated", "word", "digit", "extended", "joined"])
def test_a_reply_whose_words_changed_is_reply_edited_with_where(edited, char):
    timelines, call = _said()
    found = _echo(timelines, {"role": "assistant", "content": edited})
    assert found.parent is None and found.fallback.reason == "reply_edited"
    assert found.notes == {"edited": {"message": 2, "char": char, "parent_call": call.call_id}}


def test_an_edited_tool_call_names_the_call():
    timelines, call = _remembered()
    echo = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 5}'}}]}
    found = _echo(timelines, echo, {"role": "tool", "tool_call_id": "call_1", "content": "6"})
    assert found.fallback.reason == "reply_edited"
    assert found.notes["edited"] == {"message": 2, "tool_call": 0, "parent_call": call.call_id}


def test_an_edited_later_reply_continues_the_earlier_one_and_says_where():
    """The agent truncated its second reply: the first still continues token-exactly, the edit is noted."""
    timelines, first, second = _two_turns("It is 7, I think.")
    found = _echo(timelines, {"role": "assistant", "content": SAID}, {"role": "user", "content": "and 4?"},
                  {"role": "assistant", "content": "It is 7."})
    assert found.fallback is None and found.parent.call_id == first.call_id and found.reply_index == 2
    assert found.notes == {"edited": {"message": 4, "char": 7, "parent_call": second.call_id}}


@pytest.mark.parametrize("index, message", [
    (0, {"role": "system", "content": "You add. "}),
    (1, {"role": "user", "content": "1  and 2"}),
], ids=["system", "user"])
def test_whitespace_changed_outside_replies_is_another_history(index, message):
    timelines, _ = _said()
    history = [*BASE, {"role": "assistant", "content": SAID}, {"role": "user", "content": "next"}]
    history[index] = message
    body = _body(history)
    found = timelines.find("ep", body, prefix_hashes(body))
    assert found.parent is None and found.fallback.reason == "history_not_recorded" and found.notes == {}


def test_a_changed_tool_result_is_another_history_not_an_edit():
    timelines, first = _remembered()
    found = _echo(timelines, {"role": "assistant", "content": None, "tool_calls": REPLY_CALLS},
                  {"role": "tool", "tool_call_id": "call_1", "content": "3 "})
    assert found.fallback is None  # the reply itself continues: the tool result is rendered as context...
    body = _body([*BASE, {"role": "assistant", "content": None, "tool_calls": REPLY_CALLS},
                  {"role": "tool", "tool_call_id": "call_1", "content": "3"}])
    second = _call("ep", [1, 2, 3, 7, 8, 9, 5], [6], text="3", finish="stop")
    timelines.remember(second, body, prefix_hashes(body))
    later = _echo(timelines, {"role": "assistant", "content": None, "tool_calls": REPLY_CALLS},
                  {"role": "tool", "tool_call_id": "call_1", "content": "3 "}, {"role": "assistant", "content": "3"})
    assert later.parent.call_id == first.call_id and "edited" not in later.notes  # ...and never matches it


async def test_the_proxy_records_tidied_and_edited_replies_queryable_in_sql(upstream, tmp_path):
    """Through the proxy and the store: the notes reach calls.extra whatever serves the call (here the scripted
    engine has no /tokenize, so chat rendering), and the documented queries find them."""
    upstream.script.content = SAID
    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb")
    url = f"{proxy.url}/e/ep/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json={"model": "m", "messages": BASE}) as r:
                reply = (await r.json())["choices"][0]["message"]
            assert reply["content"] == SAID
            for content in (SAID.strip(), "Sure."):
                body = {"model": "m", "messages": [*BASE, {**reply, "content": content}, {"role": "user",
                                                                                           "content": "again"}]}
                async with session.post(url, json=body) as r:
                    assert r.status == 200
    finally:
        proxy.close()
    db = tmp_path / "rec.duckdb"
    records = [json.loads(r[0]) for r in db_rows(db, "SELECT extra->'continuity' FROM calls ORDER BY call_index")]
    assert records[1]["reason"] == "render_failed" and records[1]["normalised"] == [{"message": 2,
                                                                                      "kind": "whitespace"}]
    assert records[2]["reason"] == "reply_edited" and records[2]["edited"]["message"] == 2
    assert records[2]["edited"]["char"] == 5 and "normalised" not in records[2]
    assert db_rows(db, _documented_query("docs/proxy.md", "Tidied replies, by kind:")) == [("whitespace", 1, 1)]
    edited = db_rows(db, _documented_query("docs/proxy.md", "Edited replies and the new timelines they started"))
    assert edited == [("ep", 2, 2, 5, None)]  # not merged yet: no break row


def _documented_query(doc: str, title: str) -> str:
    """The SQL a doc shows under a title: the docs' queries must run as written."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / doc).read_text()
    return text.split(title, 1)[1].split("```sql\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("sent, sampled, at", [
    ("a b", "a  b\n", None), ("", " \n", None), ("ab", "a b", 1), ("a", "a b", 1), ("a b c", "a b", 4),
    ("", "a", 0), ("x", "", 0), ("  hello wor", "hello world", 11),
])
def test_first_edit_skips_whitespace(sent, sampled, at):
    assert first_edit(sent, sampled) == at
