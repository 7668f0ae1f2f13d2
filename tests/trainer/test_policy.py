"""The trainer's view of samples: padded batches, micro-batches by a token budget, and per-token logprobs that
equal the engine's for the completions the engine recorded (real vLLM, real proxy, real DuckDB, real merge).
The tests on the real engine are in test_policy_engine.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from harness.core.records import Sample  # noqa: E402
from trainer.model.policy import collate, load_policy, micro_batches, token_logprobs  # noqa: E402


def sample(episode: str, n_prompt: int, n_sampled: int, first_id: int = 10) -> Sample:
    ids = list(range(first_id, first_id + n_prompt + n_sampled))
    mask = [0] * n_prompt + [1] * n_sampled
    return Sample(episode, "role", ["c"], [0], ids, mask, [-0.25 * m for m in mask])


# --- collate and micro-batches (fast) --------------------------------------------------------------------------------


def test_collate_pads_right_and_keeps_masks_logprobs_and_episodes():
    samples = [sample("ep-b", 2, 3), sample("ep-a", 1, 1, first_id=50), sample("ep-b", 3, 1)]
    batch = collate(samples, pad_id=0, episode_ids=["ep-a", "ep-b"])
    assert batch.token_ids.tolist() == [[10, 11, 12, 13, 14], [50, 51, 0, 0, 0], [10, 11, 12, 13, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0], [0, 0, 0, 1, 0]]
    assert batch.engine_logprobs.tolist() == [[0, 0, -0.25, -0.25, -0.25], [0, -0.25, 0, 0, 0], [0, 0, 0, -0.25, 0]]
    assert batch.episode_index.tolist() == [1, 0, 1]
    assert batch.sample_index == [0, 1, 2] and batch.n_tokens == 11
    assert (batch.token_ids.dtype, batch.loss_mask.dtype, batch.engine_logprobs.dtype) == (
        torch.long, torch.float32, torch.float32)
    assert collate(samples, pad_id=0).episode_index.tolist() == [0, 1, 0]  # numbered by first appearance


def test_collate_carries_a_micro_batch_s_indices_and_names_bad_samples():
    samples = [sample("e", 2, 2), sample("e", 1, 4), sample("e", 3, 1)]
    picked = [2, 0]
    assert collate([samples[i] for i in picked], pad_id=0, indices=picked).sample_index == [2, 0]
    with pytest.raises(ValueError, match="at least one sample"):
        collate([], pad_id=0)
    broken = Sample("ep-x", "role", [], [], [1, 2, 3], [0, 1], [0.0, -1.0])
    with pytest.raises(ValueError, match=r"'ep-x'.*3 token ids but 2 mask values"):
        collate([broken], pad_id=0)
    with pytest.raises(ValueError, match="'ep-y', which is not in"):
        collate([sample("ep-y", 1, 1)], pad_id=0, episode_ids=["ep-z"])
    with pytest.raises(ValueError, match="first token as sampled"):
        collate([Sample("e", "r", [], [], [1, 2], [1, 1], [-1.0, -1.0])], pad_id=0)


def test_micro_batches_fit_the_token_budget_longest_first_and_cover_every_sample_once():
    lengths = [5, 30, 12, 12, 7, 3, 40]
    samples = [sample("e", n - 1, 1) for n in lengths]
    batches = micro_batches(samples, max_tokens=36)
    assert sorted(i for b in batches for i in b) == list(range(len(samples)))
    assert batches[0] == [6]  # 40 tokens: over the budget, alone
    for b in batches:
        width = max(lengths[i] for i in b)
        assert len(b) == 1 or len(b) * width <= 36
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)
    assert batches == [[6], [1], [2, 3, 4], [0, 5]]
    assert micro_batches(samples, max_tokens=10_000) == [[6, 1, 2, 3, 4, 0, 5]]
    with pytest.raises(ValueError, match="positive"):
        micro_batches(samples, max_tokens=0)


# --- logprobs on the tiny model (fast) ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_policy(tiny_model_dir)


def _reference(model, batch, temperature):
    """log_softmax over the model's full logits / temperature, the plain way."""
    with torch.no_grad():
        logits = model(input_ids=batch.token_ids, attention_mask=batch.attention_mask).logits.float() / temperature
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    chosen = logp.gather(-1, batch.token_ids[:, 1:, None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    pad = torch.zeros(len(batch.token_ids), 1)
    mask = batch.attention_mask.float()
    return torch.cat([pad, chosen], 1) * mask, torch.cat([pad, entropy], 1) * mask


def test_chunked_logprobs_and_entropy_equal_the_full_logits_ones(policy):
    assert policy.training and policy.config.use_cache is False
    samples = [sample("a", 3, 6, first_id=100), sample("b", 2, 2, first_id=700), sample("a", 5, 9, first_id=40)]
    batch = collate(samples, pad_id=0)
    for temperature in (1.0, 0.7):
        logprobs, entropy = token_logprobs(policy, batch, temperature, with_entropy=True, chunk_tokens=4)
        want_logprobs, want_entropy = _reference(policy, batch, temperature)
        assert torch.allclose(logprobs, want_logprobs, atol=1e-5)
        assert torch.allclose(entropy, want_entropy, atol=1e-4)
        masked, none = token_logprobs(policy, batch, temperature, loss_only=True)
        assert none is None
        assert torch.allclose(masked, want_logprobs * batch.loss_mask, atol=1e-5)
    greedy, _ = token_logprobs(policy, batch, 0.0)  # temperature 0: vLLM reports the unscaled logprobs
    assert torch.allclose(greedy, _reference(policy, batch, 1.0)[0], atol=1e-5)


def test_gradients_through_checkpointed_chunks_equal_the_plain_ones(policy):
    batch = collate([sample("a", 3, 6, first_id=100), sample("b", 2, 2, first_id=700)], pad_id=0)
    policy.zero_grad()
    logprobs, _ = token_logprobs(policy, batch, 0.7, chunk_tokens=3)
    (logprobs * batch.loss_mask).sum().backward()
    chunked = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()
    logits = policy(input_ids=batch.token_ids, attention_mask=batch.attention_mask).logits.float() / 0.7
    plain = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.token_ids[:, 1:, None])[..., 0]
    (plain * batch.loss_mask[:, 1:]).sum().backward()
    for name, p in policy.named_parameters():
        assert torch.allclose(chunked[name], p.grad, atol=1e-4), name
    policy.zero_grad()


def test_activations_kept_in_cpu_memory_give_the_same_gradients(policy):
    """model.activation_offload: what the backward needs waits in CPU memory (torch's save_on_cpu); the arithmetic
    is the same. (On this CPU-only machine the tensors were in CPU memory already: the path is what is tested.)"""
    batch = collate([sample("a", 3, 6, first_id=100), sample("b", 2, 2, first_id=700)], pad_id=0)
    grads, seen = [], []
    for offload in (False, True):
        policy.zero_grad()
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, seen=packed: seen.append(1) or t, lambda t: t):
            logprobs, _ = token_logprobs(policy, batch, 0.7, loss_only=True, offload_activations=offload)
        (logprobs * batch.loss_mask).sum().backward()
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters()})
        seen.append(len(packed))
    assert seen[0] > 0 and seen[1] < seen[0] / 2  # offloaded: save_on_cpu's own hooks took the decoder's tensors
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name
    policy.zero_grad()


# --- parity with the engine (engine tier) ----------------------------------------------------------------------------
