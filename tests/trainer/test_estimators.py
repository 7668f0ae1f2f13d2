"""trainer/maths/estimators.py against hand-computed cases and a plain-Python reference: GAE, the clipped value
loss, ReMax's baseline and the adaptive KL controller."""

from __future__ import annotations

import random

import pytest
import torch

from trainer.maths.estimators import (
    adaptive_kl_coef,
    gae_advantages,
    outcome_token_rewards,
    remax_advantages,
    value_loss,
)


def test_outcome_rewards_sit_on_each_row_s_last_trained_token():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 1]], dtype=torch.float32)
    out = outcome_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert out.tolist() == [[0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 3]]


def test_gae_by_hand_skips_tool_output_between_calls():
    # prompt, two sampled tokens, a tool result, one sampled token: the reward on the last
    mask = torch.tensor([[0, 1, 1, 0, 1]], dtype=torch.float32)
    rewards = torch.tensor([[0, 0, 0, 0, 1.0]])
    values = torch.tensor([[9.0, 0.5, 0.6, 9.0, 0.8]])  # 9: outside the mask, never read
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    # delta3 = 1 - 0.8 = 0.2; delta2 = 0.9*0.8 - 0.6 = 0.12; delta1 = 0.9*0.6 - 0.5 = 0.04
    # A3 = 0.2, A2 = 0.12 + 0.72*0.2 = 0.264, A1 = 0.04 + 0.72*0.264 = 0.23008
    assert adv[0].tolist() == pytest.approx([0, 0.23008, 0.264, 0, 0.2])
    assert ret[0].tolist() == pytest.approx([0, 0.73008, 0.864, 0, 1.0])
    # gamma = lam = 1: every token's advantage is the outcome minus its own value (Monte Carlo)
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    assert adv[0].tolist() == pytest.approx([0, 0.5, 0.4, 0, 0.2])
    assert ret[0].tolist() == pytest.approx([0, 1.0, 1.0, 0, 1.0])


def _reference_gae(rewards, values, mask, gamma, lam):
    """Plain Python: the trained tokens of each row as one trajectory."""
    adv = [[0.0] * len(r) for r in rewards]
    for b, row in enumerate(mask):
        steps = [t for t, m in enumerate(row) if m]
        running, next_value = 0.0, 0.0
        for t in reversed(steps):
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            running = delta + gamma * lam * running
            next_value = values[b][t]
            adv[b][t] = running
    return adv


def test_gae_matches_the_plain_python_reference_on_random_batches():
    rng = random.Random(0)
    for _ in range(20):
        b, t = rng.randint(1, 5), rng.randint(1, 12)
        mask = [[float(rng.random() < 0.6) for _ in range(t)] for _ in range(b)]
        rewards = [[rng.gauss(0, 1) if m else rng.gauss(0, 100) for m in row] for row in mask]
        values = [[rng.gauss(0, 1) for _ in range(t)] for _ in range(b)]
        gamma, lam = rng.choice([1.0, 0.99, 0.5]), rng.choice([1.0, 0.95, 0.0])
        got, _ = gae_advantages(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask), gamma, lam,
                                whiten=False)
        want = _reference_gae(rewards, values, mask, gamma, lam)
        assert got.tolist() == [pytest.approx(row, abs=1e-5) for row in want]


def test_gae_whitens_advantages_over_the_batch_s_trained_tokens():
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]], dtype=torch.float32)
    rewards = outcome_token_rewards(torch.tensor([1.0, 0.0]), mask)
    adv, _ = gae_advantages(rewards, torch.zeros_like(mask), mask)
    trained = adv[mask > 0]
    assert float(trained.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(trained.std()) == pytest.approx(1.0, abs=1e-4)
    assert adv[0, 0] == 0 and adv[1, 2] == 0
    flat, _ = gae_advantages(torch.zeros_like(mask), torch.zeros_like(mask), mask)
    assert flat.abs().sum() == 0  # nothing to normalise: 0, not NaN


def test_value_loss_by_hand_with_and_without_clipping():
    mask = torch.ones(1, 2)
    values, old, returns = torch.tensor([[0.0, 1.5]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0, 1.5]])
    # token 1: error (0 - 2)^2 = 4; clipped V = 1 - 0.2 = 0.8, (0.8 - 2)^2 = 1.44: the larger is 4 -> 2.0
    # token 2: error 0; clipped V = 1.2, (1.2 - 1.5)^2 = 0.09 -> 0.045, the clipped error is the larger
    loss, stats = value_loss(values, old, returns, mask, clip=0.2)
    assert float(loss) == pytest.approx((2.0 + 0.045) / 2)
    assert stats["critic/vf_clipfrac"] == pytest.approx(0.5)
    assert stats["critic/abs_error"] == pytest.approx(1.0)
    unclipped, _ = value_loss(values, old, returns, mask, clip=None)
    assert float(unclipped) == pytest.approx((2.0 + 0.0) / 2)
    masked, _ = value_loss(values, old, returns, torch.tensor([[1.0, 0.0]]), clip=0.2)
    assert float(masked) == pytest.approx(2.0)


def test_value_loss_gradient_moves_values_towards_returns():
    values = torch.tensor([[0.0, 3.0]], requires_grad=True)
    loss, _ = value_loss(values, values.detach(), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), clip=None)
    loss.backward()
    assert values.grad[0, 0] < 0 < values.grad[0, 1]


def test_remax_subtracts_the_greedy_reward():
    assert remax_advantages(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.5, 0.5, 0.5])).tolist() == [0.5, -0.5, 0.0]
    with pytest.raises(ValueError, match=r"\[B\]"):
        remax_advantages(torch.zeros(2), torch.zeros(3))


def test_adaptive_kl_coefficient_follows_the_measured_kl_proportionally_and_bounded():
    assert adaptive_kl_coef(0.1, kl=0.11, target=0.1, horizon=10, n_steps=1) == pytest.approx(0.1 * 1.01)
    assert adaptive_kl_coef(0.1, kl=0.5, target=0.1, horizon=10, n_steps=1) == pytest.approx(0.1 * 1.02)  # +20% cap
    assert adaptive_kl_coef(0.1, kl=0.0, target=0.1, horizon=10, n_steps=1) == pytest.approx(0.1 * 0.98)
    assert adaptive_kl_coef(0.1, kl=0.1, target=0.1, horizon=10, n_steps=4) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="target > 0"):
        adaptive_kl_coef(0.1, kl=0.1, target=0.0, horizon=10, n_steps=1)
