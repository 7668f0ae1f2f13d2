"""The trainer's logprobs agree with the engine's on recorded completions."""

from __future__ import annotations

import pytest

from trainer.model.policy import collate, load_policy, token_logprobs  # noqa: E402

torch = pytest.importorskip("torch")

PARITY_TOLERANCE = 1e-3  # max abs difference between trainer and engine logprobs (issue 5)


def _record(proxy_url: str, episode: str, temperature: float, multi_turn: bool) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{proxy_url}/e/{episode}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "Name three cities and a number."}]
    first = client.chat.completions.create(model="policy", messages=messages, n=1 if multi_turn else 2,
                                           temperature=temperature, max_tokens=24, seed=11)
    if multi_turn:
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Now the weather there."}]
        client.chat.completions.create(model="policy", messages=messages, temperature=temperature, max_tokens=24,
                                       seed=12)


def test_trainer_logprobs_match_the_engine_s_on_recorded_completions(engine, tiny_model_dir, tmp_path):
    from harness.core.merge import merge_episode
    from harness.store.database import Store
    from tests.support import RunningProxy

    episodes = {"parity-t0.7": (0.7, False), "parity-t1.0": (1.0, False), "parity-turns-t0.7": (0.7, True)}
    proxy = RunningProxy(engine.base_url, tmp_path / "rec.duckdb", served_model=engine.served_model)
    try:
        for episode, (temperature, multi_turn) in episodes.items():
            _record(proxy.url, episode, temperature, multi_turn)
    finally:
        proxy.close()
    with Store.open(tmp_path / "rec.duckdb", read_only=True) as store:
        merged = {e: merge_episode(store.load_calls(e)) for e in episodes}
    assert [len(m.samples) for m in merged.values()] == [2, 2, 1]  # n=2 branches; two turns merge into one
    (two_turns,) = merged["parity-turns-t0.7"].samples
    assert len(two_turns.call_ids) == 2

    model = load_policy(tiny_model_dir, dtype=torch.float32)
    worst = 0.0
    for episode, (temperature, _) in episodes.items():
        batch = collate(merged[episode].samples, pad_id=0)
        with torch.no_grad():
            logprobs, _ = token_logprobs(model, batch, temperature, loss_only=True)
        assert batch.loss_mask.sum() > 0
        diff = ((logprobs - batch.engine_logprobs) * batch.loss_mask).abs().max().item()
        print(f"{episode}: {int(batch.loss_mask.sum())} sampled tokens, max |trainer - engine| logprob {diff:.2e}")
        worst = max(worst, diff)
    assert worst <= PARITY_TOLERANCE
