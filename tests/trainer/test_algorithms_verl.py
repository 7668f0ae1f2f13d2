"""trainer/maths/algorithms.py against verl's core_algos, where verl is installed: advantages, returns, KL, entropy,
aggregation and the policy loss on random batches."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from tests.trainer.test_algorithms import close, t
from trainer.maths.algorithms import (
    KL_KINDS,
    aggregate,
    entropy_from_logits,
    kl_penalty,
    outcome_advantages,
    policy_loss,
    reinforce_pp_returns,
)

needs_verl = pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed")


@pytest.fixture(scope="module")
def core_algos():
    from verl.trainer.ppo import core_algos

    return core_algos


class _ActorConfig(dict):
    """The keys verl's vanilla policy loss reads from an ActorConfig."""

    __getattr__ = dict.__getitem__


def _full_batch(rng: random.Random, b: int, n_t: int):
    """verl divides by every row's token count: every row keeps at least its first token."""
    mask = [[float(i == 0 or rng.random() < 0.8) for i in range(n_t)] for _ in range(b)]
    logp = [[-rng.expovariate(1.0) for _ in range(n_t)] for _ in range(b)]
    old = [[lp + rng.gauss(0, 0.5) for lp in row] for row in logp]
    return t(mask), t(logp), t(old)


@needs_verl
def test_advantages_agree_with_verl(core_algos):
    import numpy as np

    rng = random.Random(4)
    for _ in range(50):
        groups = [g for g in "abcd" for _ in range(rng.randint(2, 4))]  # verl keeps a lone sample's raw reward
        rewards = t([rng.choice([0.0, 0.5, 1.0, rng.gauss(0, 1)]) for _ in groups])
        token_rewards, mask = rewards.unsqueeze(-1), torch.ones(len(groups), 1, dtype=torch.float64)
        index = np.array(groups, dtype=object)
        verl = {
            "grpo": core_algos.compute_grpo_outcome_advantage(token_rewards.clone(), mask, index)[0],
            "grpo_no_std": core_algos.compute_grpo_outcome_advantage(
                token_rewards.clone(), mask, index, norm_adv_by_std_in_grpo=False
            )[0],
            "rloo": core_algos.compute_rloo_outcome_advantage(token_rewards.clone(), mask, index)[0],
            # one token per sequence: verl's token whitening is then our sequence whitening (up to its rsqrt(var+1e-8))
            "reinforce_pp_baseline": core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
                token_rewards.clone(), mask, index
            )[0],
            "reinforce_pp": core_algos.compute_reinforce_plus_plus_outcome_advantage(
                token_rewards.clone(), mask, config=_ActorConfig(gamma=1.0)
            )[0],
        }
        for estimator, expected in verl.items():
            close(outcome_advantages(rewards, groups, estimator), expected.squeeze(-1), 1e-4)


@needs_verl
def test_returns_kl_entropy_and_aggregation_agree_with_verl(core_algos):
    import verl.utils.torch_functional as verl_f

    rng = random.Random(5)
    for _ in range(50):
        mask, logp, old = _full_batch(rng, rng.randint(2, 6), rng.randint(2, 8))
        rewards = torch.where(mask > 0, torch.randn_like(logp), 0.0)
        verl_returns = core_algos.compute_reinforce_plus_plus_outcome_advantage(
            rewards, mask, config=_ActorConfig(gamma=0.9)
        )[0]
        close(reinforce_pp_returns(rewards, mask, gamma=0.9), verl_returns, 1e-4)
        for kind in KL_KINDS:
            close(kl_penalty(logp, old, kind), core_algos.kl_penalty(logp, old, kind), 1e-9)
        for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
            close(aggregate(logp, mask, mode), core_algos.agg_loss(logp, mask, mode), 1e-6)
        norm = core_algos.agg_loss(logp, mask, "seq-mean-token-sum-norm", loss_scale_factor=8)
        close(aggregate(logp, mask, "seq-mean-token-sum-norm", constant=8), norm, 1e-6)
    logits = torch.randn(2, 3, 17)
    close(entropy_from_logits(logits), verl_f.entropy_from_logits(logits), 1e-5)


@needs_verl
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_policy_loss_agrees_with_verl(core_algos, agg):
    rng = random.Random(agg)
    for _ in range(50):
        mask, logp, old = _full_batch(rng, rng.randint(2, 6), rng.randint(2, 8))
        adv = torch.randn_like(logp)
        config = _ActorConfig(
            clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, global_batch_info={}
        )
        verl_loss, verl_metrics = core_algos.compute_policy_loss_vanilla(old, logp, adv, mask, agg, config)
        loss, metrics = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg=agg)
        close(loss, verl_loss, 1e-6)
        assert metrics["clipfrac"] == pytest.approx(verl_metrics["actor/pg_clipfrac"], abs=1e-6)
        assert metrics["dual_clipfrac"] == pytest.approx(verl_metrics["actor/pg_clipfrac_lower"], abs=1e-6)
        assert metrics["approx_kl"] == pytest.approx(verl_metrics["actor/ppo_kl"], abs=1e-6)
