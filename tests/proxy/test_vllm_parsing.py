"""vLLM's own reply parsers run in the proxy (proxy/parsing/vllm.py): a token-exact answer becomes the message the
engine's chat endpoint would send, whole and streamed, with reasoning apart; replies that do not parse are flagged.
The engine tier checks the same against the engine itself (test_parsers_engine.py)."""

from __future__ import annotations

import json

import pytest

from harness.core.records import Call, Choice
from proxy.chat_answer import ChatAnswer
from proxy.parsing import reply_parsing
from proxy.parsing.native import NativeParsing

pytest.importorskip("vllm")

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
BODY = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    """Hermes tool calls and Qwen3 reasoning, as `--tool-call-parser hermes --reasoning-parser qwen3` parse them."""
    return reply_parsing("hermes", "qwen3", tokenizer=str(tiny_model_dir))


def _completion(text: str, ids: list[int], finish: str = "stop") -> dict:
    return {"id": "cmpl-1", "created": 1, "model": "policy", "usage": None, "choices": [{
        "index": 0, "text": text, "token_ids": ids, "finish_reason": finish, "prompt_token_ids": [1, 2],
        "logprobs": None}]}


def _chunks(tokenizer, text: str, finish: str = "stop") -> list[dict]:
    """`text` streamed a token at a time, each piece decoded the way vLLM's detokenizer grows the text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    out, before = [], ""
    for k, token in enumerate(ids):
        now = tokenizer.decode(ids[:k + 1], skip_special_tokens=False)
        out.append({"id": "cmpl-1", "created": 1, "model": "policy", "choices": [{
            "index": 0, "text": now[len(before):], "token_ids": [token], "logprobs": None,
            "finish_reason": finish if k == len(ids) - 1 else None, "prompt_token_ids": [1, 2] if k == 0 else None}]})
        before = now
    return out


def _assembled(chunks: list[dict]) -> dict:
    """What an OpenAI client makes of the chat chunks: content, reasoning, tool calls, the finish reason."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for ch in chunk["choices"]:
            d = ch["delta"]
            content += d.get("content") or ""
            reasoning += d.get("reasoning") or ""
            for c in d.get("tool_calls") or ():
                call = calls.setdefault(c["index"], {"name": "", "arguments": ""})
                call["name"] += (c.get("function") or {}).get("name") or ""
                call["arguments"] += (c.get("function") or {}).get("arguments") or ""
            finish = ch.get("finish_reason") or finish
    return {"content": content, "reasoning": reasoning, "calls": [calls[k] for k in sorted(calls)], "finish": finish}


def test_reasoning_content_and_a_tool_call_come_apart_whole_and_streamed(qwen3, tokenizer):
    text = "<think>\nI add 1 and 2.\n</think>\n\nLet me add.\n" + CALL
    ids = tokenizer.encode(text, add_special_tokens=False)
    request = qwen3.request(BODY)
    assert request.skip_special_tokens is False  # as vLLM's hermes parser asks of the chat endpoint
    whole = ChatAnswer(request).response(_completion(text, ids))["choices"][0]
    message = whole["message"]
    assert message["reasoning"] == "\nI add 1 and 2.\n"
    assert message["content"].strip() == "Let me add."
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}
    assert whole["finish_reason"] == "tool_calls"

    answer = ChatAnswer(qwen3.request(BODY))
    streamed = _assembled([c for chunk in _chunks(tokenizer, text) for c in answer.chunk(chunk)])
    assert streamed["reasoning"] == message["reasoning"]
    assert streamed["content"].strip() == message["content"].strip()
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"]] == [("add", {"a": 1, "b": 2})]
    assert streamed["finish"] == "tool_calls"


def test_no_tools_offered_keeps_the_call_text_as_content_and_still_splits_reasoning(qwen3, tokenizer):
    text = "<think>hm</think>" + CALL
    body = {k: v for k, v in BODY.items() if k != "tools"}
    message = ChatAnswer(qwen3.request(body)).response(
        _completion(text, tokenizer.encode(text, add_special_tokens=False)))["choices"][0]["message"]
    assert message["reasoning"] == "hm" and message["content"] == CALL and message["tool_calls"] == []


def test_the_engines_hermes_and_the_proxys_own_agree_through_the_chat_answer(tiny_model_dir, tokenizer):
    """On text the proxy's own Hermes parser reads, vLLM's gives the same message (content, names, arguments)."""
    theirs = reply_parsing("hermes", None, tokenizer=str(tiny_model_dir))
    ours = NativeParsing("hermes", None)
    texts = ["plain", CALL, "Sure.\n" + CALL + "\n" + CALL, '<tool_call>{"name":"add","arguments":{"a":1}}</tool_call>',
             '<tool_call>\n{"name": "add", "argu', "x <tool_call>not json</tool_call>", CALL + " trailing"]
    for text in texts:
        obj = _completion(text, tokenizer.encode(text, add_special_tokens=False))
        a = ChatAnswer(theirs.request(BODY)).response(obj)["choices"][0]
        b = ChatAnswer(ours.request(BODY)).response(obj)["choices"][0]
        assert a["message"]["content"] == b["message"]["content"], text
        assert [c["function"] for c in a["message"]["tool_calls"]] == [
            c["function"] for c in b["message"]["tool_calls"]]
        assert a["finish_reason"] == b["finish_reason"], text


def test_only_the_first_call_without_parallel_tool_calls(qwen3, tokenizer):
    text = CALL + "\n" + CALL.replace('"a": 1', '"a": 5')
    body = {**BODY, "parallel_tool_calls": False}
    whole = ChatAnswer(qwen3.request(body), parallel_tool_calls=False).response(
        _completion(text, tokenizer.encode(text, add_special_tokens=False)))
    assert len(whole["choices"][0]["message"]["tool_calls"]) == 1
    answer = ChatAnswer(qwen3.request(body), parallel_tool_calls=False)
    streamed = _assembled([c for chunk in _chunks(tokenizer, text) for c in answer.chunk(chunk)])
    assert [json.loads(c["arguments"])["a"] for c in streamed["calls"]] == [1]


def _recorded(tokenizer, text: str, *, tool_calls=None, content=None) -> Call:
    ids = tokenizer.encode(text, add_special_tokens=False)
    choice = Choice(index=0, completion_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop",
                    text=content if content is not None else text, tool_calls=tool_calls)
    return Call(call_id="c", run_id="r", episode_id="e", call_index=0, endpoint="chat", stream=False,
                requested_model="policy", served_model="policy", role_key="k", system_hash=None, tools_hash=None,
                request=b"{}", response=None, prompt_ids=[1], choices=[choice], token_source="engine", status="ok",
                http_status=200, error=None, started_at=0.0, latency_ms=1.0, ttft_ms=None, weight_version=0)


@pytest.mark.parametrize("parsing", ["vllm", "native"])
def test_a_malformed_tool_call_and_unclosed_reasoning_are_flagged(parsing, qwen3, tokenizer):
    """The agent gets the text as content, as vLLM gives it; the call says why no tool call came out."""
    p = qwen3 if parsing == "vllm" else NativeParsing("hermes", None)
    bad = 'Let me.\n<tool_call>\n{"name": "add", "arguments": {"a": 1\n</tool_call>'
    reasons = [f["reason"] for f in p.flags(BODY, _recorded(tokenizer, bad))]
    assert reasons == ["tool_call_unparsed"]
    good = _recorded(tokenizer, CALL, tool_calls=[{"id": "x", "type": "function", "function": {}}], content="")
    assert p.flags(BODY, good) == []
    assert p.flags({k: v for k, v in BODY.items() if k != "tools"}, _recorded(tokenizer, bad)) == []  # no tools
    if parsing == "vllm":
        (f,) = p.flags(BODY, _recorded(tokenizer, "<think>and on and on"))
        assert (f["choice"], f["kind"], f["reason"]) == (0, "parse", "reasoning_unclosed")


def test_gpt_oss_is_served_by_the_engines_chat_endpoint(tmp_path, tiny_model_dir, upstream):
    """gpt-oss speaks harmony, which vLLM renders and parses with openai_harmony by token ids: the proxy has no
    template render or text parser that follows it, so token-exact continuity is off for it (and for it only)."""
    import shutil

    import openai

    from harness.store.database import Store
    from proxy.parsing import harmony
    from tests.support import RunningProxy

    oss = tmp_path / "gpt-oss"
    shutil.copytree(tiny_model_dir, oss)
    config = json.loads((oss / "config.json").read_text())
    (oss / "config.json").write_text(json.dumps({**config, "model_type": "gpt_oss"}))
    assert harmony(str(oss)) and not harmony(str(tiny_model_dir)) and not harmony(None)
    for model, exact in ((oss, False), (tiny_model_dir, True)):
        proxy = RunningProxy(upstream.url, tmp_path / f"{model.name}.duckdb", tokenizer=str(model))
        try:
            client = openai.OpenAI(base_url=f"{proxy.url}/e/ep/v1", api_key="sk-test", max_retries=0)
            messages = [{"role": "user", "content": "hi"}]
            reply = client.chat.completions.create(model="m", messages=messages).choices[0].message
            client.chat.completions.create(model="m", messages=[
                *messages, {"role": "assistant", "content": reply.content}, {"role": "user", "content": "more"}])
        finally:
            proxy.close()
        with Store.open(tmp_path / f"{model.name}.duckdb", read_only=True) as store:
            calls = store.load_calls("ep")
        assert [("continuity" in c.extra) for c in calls] == [exact, exact], [c.extra for c in calls]


def test_reasoning_tokens_are_counted_in_usage_as_the_chat_endpoint_counts_them(qwen3, tokenizer):
    text = "<think>\nI add 1 and 2.\n</think>\n\nIt is 3."
    ids = tokenizer.encode(text, add_special_tokens=False)
    thinking = len(tokenizer.encode("<think>\nI add 1 and 2.\n</think>", add_special_tokens=False))
    obj = {**_completion(text, ids), "usage": {"prompt_tokens": 2, "completion_tokens": len(ids)}}
    usage = ChatAnswer(qwen3.request(BODY)).response(obj)["usage"]
    assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] <= thinking
    answer = ChatAnswer(qwen3.request(BODY))
    chunks = _chunks(tokenizer, text)
    chunks.append({"id": "cmpl-1", "created": 1, "model": "policy", "choices": [], "usage": obj["usage"]})
    streamed = [c for chunk in chunks for c in answer.chunk(chunk)][-1]["usage"]
    assert streamed["completion_tokens_details"] == usage["completion_tokens_details"]
    plain = ChatAnswer(NativeParsing("hermes", None).request(BODY)).response(obj)["usage"]
    assert "completion_tokens_details" not in plain  # no reasoning parser: nothing counted, as vLLM


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    from tests.families import FAMILIES

    root = tmp_path_factory.mktemp("families")
    return {name: (family, family.build(root / name)) for name, family in FAMILIES.items()}


def _pieces(tokenizer, text: str, size: int) -> list[dict]:
    """`text` streamed `size` tokens a piece, as a busy engine coalesces them, each piece's text what it adds."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    out, before = [], ""
    for start in range(0, len(ids), size):
        now = tokenizer.decode(ids[:start + size], skip_special_tokens=False)
        last = start + size >= len(ids)
        out.append({"id": "cmpl-1", "created": 1, "model": "policy", "choices": [{
            "index": 0, "text": now[len(before):], "token_ids": ids[start:start + size], "logprobs": None,
            "finish_reason": "stop" if last else None, "prompt_token_ids": [1, 2] if start == 0 else None}]})
        before = now
    return out


def test_every_family_streams_the_same_message_however_many_tokens_a_piece_carries(family_models):
    """A busy engine sends several tokens in one stream piece; vLLM's streaming parsers are written for one, and
    some garble a call then (Mistral's arguments lose their start, on the engine's own chat endpoint too). The proxy
    hands its parser one token at a time: every family's streamed message is its whole message, at any piece size."""
    from transformers import AutoTokenizer

    for name, (family, model) in family_models.items():
        parsing = reply_parsing(family.tool_parser, family.reasoning_parser, tokenizer=str(model))
        tokenizer = AutoTokenizer.from_pretrained(model)
        text = family.reply("add", {"a": 2, "b": 30})
        ids = tokenizer.encode(text, add_special_tokens=False)
        whole = ChatAnswer(parsing.request(BODY)).response(_completion(text, ids))["choices"][0]["message"]
        expected = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["tool_calls"]]
        assert expected == [("add", {"a": 2, "b": 30})], (name, whole)
        for size in (1, 2, 3, 5, len(ids)):
            answer = ChatAnswer(parsing.request(BODY))
            streamed = _assembled([c for chunk in _pieces(tokenizer, text, size) for c in answer.chunk(chunk)])
            got = [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"]]
            assert got == expected, (name, size, streamed)
            assert (streamed["content"] or "").strip() == (whole["content"] or "").strip(), (name, size, streamed)
            assert streamed["finish"] == "tool_calls", (name, size)
