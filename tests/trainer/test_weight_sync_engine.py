"""Weight sync into the real engine: after a push it decodes greedily as transformers does on the new weights."""

from __future__ import annotations

import pytest

from tests.support import RunningProxy, db_rows  # noqa: E402
from trainer.model.weight_sync import WeightSync  # noqa: E402

torch = pytest.importorskip("torch")


PROMPTS = ["Hello there.", "List three colors.", "What is 2 + 2?"]


NEW_TOKENS = 16


def _prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in PROMPTS]


def _engine_greedy(engine, prompts: list[list[int]]) -> list[list[int]]:
    import openai

    client = openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="unused", max_retries=0)
    out = []
    for ids in prompts:
        r = client.completions.create(model=engine.served_model, prompt=ids, max_tokens=NEW_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        out.append(r.model_dump()["choices"][0]["token_ids"])
    return out


def _transformers_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for ids in prompts:
            prompt = torch.tensor([ids])
            generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                       max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, use_cache=True)
            out.append(generated[0, len(ids):].tolist())
    return out


IN_FLIGHT_TOKENS = 300


def _stream_started(engine):
    """A streamed completion that has started (its first chunk arrived) and is far from done."""
    import openai

    client = openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model=engine.served_model, prompt="Once upon a time", stream=True,
                                       max_tokens=IN_FLIGHT_TOKENS, temperature=1.0, seed=5,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices and first.choices[0].finish_reason is None
    return stream


def _stream_finished(stream) -> tuple[str | None, int]:
    finish, tokens = None, 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return finish, tokens


def _perturbed(model, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Every weight plus seeded noise of its own scale: enough to change which token is most likely."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, w in model.state_dict().items():
        scale = w.std() if w.numel() > 1 else w.abs()
        state[name] = w + torch.randn(w.shape, generator=generator) * scale
    return state


def test_after_a_push_the_engine_is_greedy_like_transformers_on_the_new_weights(engine, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from trainer.model.policy import load_policy

    model = load_policy(tiny_model_dir).eval()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = _prompt_ids(AutoTokenizer.from_pretrained(tiny_model_dir))
    before = _engine_greedy(engine, prompts)
    assert before == _transformers_greedy(model, prompts)

    proxy = RunningProxy(engine.base_url, tmp_path / "rec.duckdb", served_model=engine.served_model)
    sync = WeightSync(engine.base_url, tmp_path / "weights", proxy_url=proxy.url,
                      proxy_admin_token=proxy.config.admin_token, model_dir=tiny_model_dir)
    import openai

    agent = openai.OpenAI(base_url=f"{proxy.url}/e/sync/v1", api_key="unused", max_retries=0)

    def agent_call():
        agent.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)

    try:
        agent_call()
        model.load_state_dict(_perturbed(model))
        in_flight = _stream_started(engine)
        timings = sync.push(model, version=1)
        assert _stream_finished(in_flight) == ("length", IN_FLIGHT_TOKENS)  # held during the swap, not dropped
        print("weight sync (tiny model):", {k: round(v * 1000, 1) for k, v in timings.items() if k.endswith("_s")},
              "ms")
        after = _engine_greedy(engine, prompts)
        agent_call()
        assert after == _transformers_greedy(model, prompts)
        assert after != before

        model.load_state_dict(original)
        sync.push(model, version=2)
        assert _engine_greedy(engine, prompts) == before
        agent_call()
    finally:
        proxy.close()
        # The engine is shared by the session: serve the original model directory again, whatever happened.
        WeightSync(engine.base_url, tmp_path / "restore").load(tiny_model_dir, version=0)
    versions = db_rows(tmp_path / "rec.duckdb", "SELECT weight_version FROM calls WHERE episode_id = 'sync' "
                                                 "ORDER BY call_index")
    assert versions == [(0,), (1,), (2,)]


def test_the_engine_reloads_a_push_cast_to_bfloat16_and_written_in_shards(engine, tiny_model_dir, tmp_path):
    """A push in another dtype than the engine's float32, in several files with their index: the engine casts it on
    load, and decodes greedily as transformers does on the pushed (bfloat16-rounded) weights."""
    from transformers import AutoTokenizer

    from trainer.model.policy import load_policy

    model = load_policy(tiny_model_dir).eval()
    prompts = _prompt_ids(AutoTokenizer.from_pretrained(tiny_model_dir))
    before = _engine_greedy(engine, prompts)
    model.load_state_dict(_perturbed(model, seed=99))
    sync = WeightSync(engine.base_url, tmp_path / "weights", model_dir=tiny_model_dir, dtype=torch.bfloat16,
                      max_shard_bytes=400_000)
    try:
        sync.push(model, version=1)
        weights_dir = tmp_path / "weights" / "v000001"
        assert len(list(weights_dir.glob("model-*-of-*.safetensors"))) > 2
        assert (weights_dir / "model.safetensors.index.json").is_file()
        after = _engine_greedy(engine, prompts)
        model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
        assert after == _transformers_greedy(model, prompts)
        assert after != before
    finally:
        WeightSync(engine.base_url, tmp_path / "restore").load(tiny_model_dir, version=0)
    assert _engine_greedy(engine, prompts) == before
