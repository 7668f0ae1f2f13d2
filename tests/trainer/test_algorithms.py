"""Advantages, KL, entropy, aggregation and the policy loss: hand-computed small cases (the arithmetic in comments),
then random batches against a reference written here in plain Python loops (against verl's core_algos:
test_algorithms_verl.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from trainer.maths.algorithms import (
    AGG_MODES,
    ESTIMATORS,
    KL_KINDS,
    aggregate,
    call_reward_tokens,
    entropy_bonus,
    entropy_from_logits,
    kl_in_reward,
    kl_penalty,
    outcome_advantages,
    outcome_reward_tokens,
    policy_loss,
    reinforce_pp_returns,
    token_advantages,
    truncated_importance_weights,
)


def t(rows, dtype=torch.float64) -> torch.Tensor:
    return torch.as_tensor(rows, dtype=dtype)


def close(actual, expected, tol=1e-5) -> None:
    assert torch.allclose(torch.as_tensor(actual, dtype=torch.float64), t(expected), atol=tol, rtol=0), actual


# ----------------------------------------------------------------------------------------------- hand-computed cases

# Group a = [1, 0, 0], b = [2, 4], c = [5] alone, d = [3, 3] without contrast.
REWARDS = [1.0, 0.0, 0.0, 2.0, 4.0, 5.0, 3.0, 3.0]
GROUPS = ["a", "a", "a", "b", "b", "c", "d", "d"]
# a: mean 1/3, deviations (2/3, -1/3, -1/3), unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3, std 0.577350
# b: mean 3, deviations (-1, 1), unbiased var 2 / 1 = 2, std 1.414214; c and d: 0
HAND_ADVANTAGES = {
    "grpo": [0.666667 / 0.577350, -0.577350, -0.577350, -0.707107, 0.707107, 0, 0, 0],
    "grpo_no_std": [2 / 3, -1 / 3, -1 / 3, -1, 1, 0, 0, 0],
    "drgrpo": [2 / 3, -1 / 3, -1 / 3, -1, 1, 0, 0, 0],
    # r - mean(others): 1 - (0+0)/2 = 1, 0 - (1+0)/2 = -0.5; 2 - 4 = -2, 4 - 2 = 2
    "rloo": [1, -0.5, -0.5, -2, 2, 0, 0, 0],
    # centred (2/3, -1/3, -1/3, -1, 1, 0, 0, 0): mean 0, unbiased var (6/9 + 2) / 7 = 8/21, std 0.617213
    "reinforce_pp_baseline": [1.080123, -0.540062, -0.540062, -1.620185, 1.620185, 0, 0, 0],
}


@pytest.mark.parametrize("estimator", sorted(HAND_ADVANTAGES))
def test_group_estimators_match_hand_computed_values(estimator):
    close(outcome_advantages(t(REWARDS), GROUPS, estimator), HAND_ADVANTAGES[estimator])


def test_reinforce_pp_whitens_over_the_batch_and_ignores_groups():
    # [0, 1, 2, 5]: mean 2, deviations (-2, -1, 0, 3), unbiased var 14/3, std 2.160247
    expected = [-0.925820, -0.462910, 0.0, 1.388730]
    close(outcome_advantages(t([0, 1, 2, 5]), ["a", "a", "b", "b"], "reinforce_pp"), expected)
    close(outcome_advantages(t([0, 1, 2, 5]), ["a", "b", "c", "d"], "reinforce_pp"), expected)
    # a batch without spread (or of one sequence) has nothing to whiten: exactly 0, not (1e-16 - 0) / (0 + eps)
    assert outcome_advantages(t([0.7, 0.7, 0.7]), "abc", "reinforce_pp").tolist() == [0.0, 0.0, 0.0]
    assert outcome_advantages(t([3.0]), "a", "reinforce_pp").tolist() == [0.0]


@pytest.mark.parametrize("estimator", [e for e in ESTIMATORS if e != "reinforce_pp"])
def test_no_contrast_gives_zero_advantage_exactly(estimator):
    # (0.7 + 0.7 + 0.7) / 3 is 0.7 + 1.1e-16 in float64: r - mean is not 0, and only the rule makes the result 0
    rewards = t([0.7, 0.7, 0.7, 7.0])
    advantages = outcome_advantages(rewards, ["a", "a", "a", "lone"], estimator)
    assert advantages.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_token_advantages_fill_trained_tokens_only():
    mask = t([[0, 1, 1, 0], [1, 0, 1, 1]])
    assert token_advantages(t([2.0, -1.0]), mask).tolist() == [[0, 2, 2, 0], [-1, 0, -1, -1]]


def test_kl_kinds_match_hand_computed_values():
    logp, ref = t([[-1.0, -2.0, -1.0]]), t([[-1.5, -1.0, 14.0]])  # logp - ref = (0.5, -1, -15)
    close(kl_penalty(logp, ref, "k1"), [[0.5, -1.0, -15.0]])
    close(kl_penalty(logp, ref, "abs"), [[0.5, 1.0, 15.0]])
    close(kl_penalty(logp, ref, "k2"), [[0.125, 0.5, 112.5]])  # 0.5 * (0.25, 1, 225)
    # ref - logp = (-0.5, 1, 15): e^-0.5 + 0.5 - 1 = 0.106531, e - 1 - 1 = 0.718282, e^15 - 16 clamped to 10
    close(kl_penalty(logp, ref, "k3"), [[0.106531, 0.718282, 10.0]])
    for alias, kind in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        assert torch.equal(kl_penalty(logp, ref, alias), kl_penalty(logp, ref, kind))


# Three rows; 99 marks padding. Rows 0 and 1 are one episode.
VALUES = [[1, 2, 3, 99], [4, 99, 99, 99], [10, 20, 99, 99]]
MASK = [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]]
HAND_AGGREGATES = {
    "token-mean": 40 / 6,  # (1+2+3 + 4 + 10+20) / 6 tokens
    "seq-mean-token-mean": 7.0,  # (6/3 + 4/1 + 30/2) / 3 = (2 + 4 + 15) / 3
    "seq-mean-token-sum": 40 / 3,  # (6 + 4 + 30) / 3
    "seq-mean-token-sum-norm": 40 / 3 / 4,  # constant 4
    "episode-mean": 8.75,  # episode 0: (1+2+3+4) / 4 = 2.5, episode 1: 30 / 2 = 15; (2.5 + 15) / 2
}


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_modes_match_hand_computed_values(mode):
    value = aggregate(t(VALUES), t(MASK), mode, episode_index=torch.tensor([5, 5, 2]), constant=4)
    close(value, HAND_AGGREGATES[mode])
    # a row with no trained token, in an episode of its own, changes nothing
    padded = aggregate(t(VALUES + [[7] * 4]), t(MASK + [[0] * 4]), mode, torch.tensor([5, 5, 2, 9]), constant=4)
    close(padded, HAND_AGGREGATES[mode])


# (log ratio, advantage) per token, clip_low 0.2, clip_high 0.28, dual clip 3; the last token is padding.
CASES = [
    (0.0, 1.0),  # rho 1: -1
    (math.log(1.5), 1.0),  # rho 1.5 > 1.28, A > 0: clipped high, -1.28
    (math.log(0.5), 1.0),  # rho 0.5, A > 0: unclipped, max(-0.5, -0.8) = -0.5
    (math.log(0.5), -1.0),  # rho 0.5 < 0.8, A < 0: clipped low, max(0.5, 0.8) = 0.8
    (math.log(2.0), -1.0),  # rho 2, A < 0: max(2, 1.28) = 2, under the dual cap 3
    (math.log(4.0), -1.0),  # rho 4, A < 0: max(4, 1.28) = 4, dual clip: min(4, 3) = 3
    (5.0, 7.0),  # padding
]


def _case_tensors():
    logp = t([[-1.0 + lr for lr, _ in CASES]]).requires_grad_()
    old = torch.full_like(logp, -1.0)
    advantages = t([[a for _, a in CASES]])
    return logp, old, advantages, t([[1, 1, 1, 1, 1, 1, 0]])


def test_policy_loss_clips_and_dual_clips_like_the_hand_computation():
    logp, old, advantages, mask = _case_tensors()
    loss, metrics = policy_loss(logp, old, advantages, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    close(loss, (-1 - 1.28 - 0.5 + 0.8 + 2 + 3) / 6)  # 3.02 / 6
    expected = {
        "clipfrac": 2 / 6,
        "clipfrac_low": 1 / 6,
        "clipfrac_high": 1 / 6,
        "dual_clipfrac": 1 / 6,
        "approx_kl": -math.log(3) / 6,  # -(ln 1 + ln 1.5 + ln .5 + ln .5 + ln 2 + ln 4) / 6 = -ln 3 / 6
        "ratio_mean": 9.5 / 6,  # (1 + 1.5 + .5 + .5 + 2 + 4) / 6
        "ratio_max": 4.0,
    }
    assert metrics == pytest.approx(expected, abs=1e-6)
    loss.backward()
    # d loss / d logp = (d loss_t / d rho) * rho / 6: -1/6; 0 (clipped); -0.5/6; 0 (clipped); 2/6; 0 (dual); 0 (pad)
    close(logp.grad, [[-1 / 6, 0, -0.5 / 6, 0, 2 / 6, 0, 0]])


def test_policy_loss_without_dual_clip_and_with_importance_weights():
    logp, old, advantages, mask = _case_tensors()
    loss, metrics = policy_loss(logp, old, advantages, mask, clip_low=0.2, clip_high=0.28)
    close(loss, (3.02 + 1) / 6)  # the last token keeps its loss of 4
    assert metrics["dual_clipfrac"] == 0.0
    weights = t([[1, 1, 1, 1, 0.5, 1, 0]]).requires_grad_()  # halves the rho = 2 token: 2 -> 1
    loss, _ = policy_loss(logp, old, advantages, mask, clip_low=0.2, clip_high=0.28, importance_weights=weights)
    close(loss, (3.02 + 1 - 1) / 6)
    loss.backward()
    assert weights.grad is None  # a weight, not a path for the gradient


def test_truncated_importance_weights_match_hand_computed_values():
    trainer, engine = t([[-1.0, -1.0, -1.0, -3.0]]), t([[-1.5, -0.5, -2.0, -1.0]])
    # exp(0.5) = 1.648721, exp(-0.5) = 0.606531, exp(1) = 2.718 capped to 2, padding 0
    weights = truncated_importance_weights(trainer.requires_grad_(), engine, t([[1, 1, 1, 0]]), cap=2.0)
    close(weights, [[1.648721, 0.606531, 2.0, 0.0]])
    assert not weights.requires_grad


def test_reinforce_pp_returns_skip_untrained_tokens_then_whiten():
    rewards = t([[0, 5, 0, 1], [2, 0, 9, 9]])  # 5 and 9 sit on untrained positions: ignored
    mask = t([[1, 0, 1, 1], [1, 1, 0, 0]])
    # gamma 0.5. Row 0: G3 = 1, G2 = 0 + .5 * 1 = .5, position 1 skipped, G0 = 0 + .5 * .5 = .25. Row 1: G1 = 0, G0 = 2
    # valid returns (.25, .5, 1, 2, 0): mean .75, deviations (-.5, -.25, .25, 1.25, -.75), unbiased var 2.5 / 4
    std = math.sqrt(0.625)
    expected = [[-0.5 / std, 0, -0.25 / std, 0.25 / std], [1.25 / std, -0.75 / std, 0, 0]]
    close(reinforce_pp_returns(rewards, mask, gamma=0.5), expected)


def test_token_rewards_outcome_on_last_token_and_kl_subtracted():
    mask = t([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    rewards = outcome_reward_tokens(t([3.0, 4.0, 5.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 3, 0], [0] * 5, [5, 0, 0, 0, 0]]
    kl = t([[0.1, 0.2, 9.0, 0.3, 9.0], [9.0] * 5, [0.5, 9, 9, 9, 9]])
    close(kl_in_reward(rewards, kl, 0.5, mask), [[-0.05, -0.1, 0, 2.85, 0], [0] * 5, [4.75, 0, 0, 0, 0]])


def test_call_rewards_spread_over_or_end_each_calls_completion():
    spans = [(1, 3, 0.5), (5, 7, -1.0)]
    assert call_reward_tokens(8, spans).tolist() == [0, 0.5, 0.5, 0, 0, -1, -1, 0]
    assert call_reward_tokens(8, spans, at="last").tolist() == [0, 0, 0.5, 0, 0, 0, -1, 0]
    with pytest.raises(ValueError, match=r"\(2, 4\) overlaps"):
        call_reward_tokens(8, [(1, 3, 1.0), (2, 4, 1.0)])
    with pytest.raises(ValueError, match="outside a sequence of 8"):
        call_reward_tokens(8, [(6, 9, 1.0)])


def test_entropy_is_stable_and_matches_its_definition():
    # uniform over 4: ln 4; one logit 1000 above the rest: ~0, and finite
    close(entropy_from_logits(t([[0.0, 0.0, 0.0, 0.0], [1000.0, 0.0, 0.0, 0.0]])), [math.log(4), 0.0])
    logits = torch.randn(3, 5, 11, dtype=torch.float64)
    p = torch.softmax(logits, -1)
    close(entropy_from_logits(logits), -(p * p.log()).sum(-1))
    mask = t([[1, 1, 0, 0, 0]] * 3)
    entropy = entropy_from_logits(logits)
    close(entropy_bonus(entropy, mask, 0.01), -0.01 * aggregate(entropy, mask))


def test_mistakes_name_the_value_to_fix():
    with pytest.raises(ValueError, match="'gpro'.*grpo"):
        outcome_advantages(t([1.0, 0.0]), ["a", "a"], "gpro")
    with pytest.raises(ValueError, match="sequence 1 is nan"):
        outcome_advantages(t([1.0, float("nan")]), ["a", "a"])
    with pytest.raises(ValueError, match="1 entries for 2 rewards"):
        outcome_advantages(t([1.0, 0.0]), ["a"])
    with pytest.raises(ValueError, match="'k4'"):
        kl_penalty(t([[0.0]]), t([[0.0]]), "k4")
    with pytest.raises(ValueError, match="'seq-mean'"):
        aggregate(t([[0.0]]), t([[1.0]]), "seq-mean")
    with pytest.raises(ValueError, match="episode_index"):
        aggregate(t([[0.0]]), t([[1.0]]), "episode-mean")
    with pytest.raises(ValueError, match="constant > 0"):
        aggregate(t([[0.0]]), t([[1.0]]), "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="got 0.5"):
        policy_loss(t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1.0]]), dual_clip=0.5)


# -------------------------------------------------------------------- the reference, in plain Python loops, and random


def ref_advantages(rewards, groups, estimator, eps=1e-6):
    def whiten(xs):
        if len(xs) < 2 or max(xs) == min(xs):
            return [0.0] * len(xs)
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
        return [(x - mean) / (std + eps) for x in xs]

    if estimator == "reinforce_pp":
        return whiten(rewards)
    out, contrast = [], []
    for i, r in enumerate(rewards):
        members = [j for j in range(len(rewards)) if groups[j] == groups[i]]
        values = [rewards[j] for j in members]
        n, mean = len(values), sum(values) / len(values)
        contrast.append(n > 1 and max(values) > min(values))
        if not contrast[-1]:
            out.append(0.0)
        elif estimator == "grpo":
            out.append((r - mean) / (math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) + eps))
        elif estimator == "rloo":
            out.append(r - sum(rewards[j] for j in members if j != i) / (n - 1))
        else:  # grpo_no_std, drgrpo, reinforce_pp_baseline
            out.append(r - mean)
    if estimator == "reinforce_pp_baseline":
        out = [a if c else 0.0 for a, c in zip(whiten(out), contrast, strict=True)]
    return out


def ref_aggregate(values, mask, mode, episodes=None, constant=None):
    rows = [[v for v, m in zip(vr, mr, strict=True) if m] for vr, mr in zip(values, mask, strict=True)]
    if mode == "token-mean":
        tokens = [v for row in rows for v in row]
        return sum(tokens) / max(len(tokens), 1)
    if mode == "episode-mean":
        per_episode = {}
        for row, e in zip(rows, episodes, strict=True):
            per_episode.setdefault(e, []).extend(row)
        means = [sum(vs) / len(vs) for vs in per_episode.values() if vs]
        return sum(means) / max(len(means), 1)
    rows = [row for row in rows if row]
    if mode == "seq-mean-token-mean":
        per_row = [sum(row) / len(row) for row in rows]
    elif mode == "seq-mean-token-sum":
        per_row = [sum(row) for row in rows]
    else:
        per_row = [sum(row) / constant for row in rows]
    return sum(per_row) / max(len(per_row), 1)


def ref_policy_loss(logp, old, adv, mask, clip_low, clip_high, dual_clip, weights):
    """Per token by cases: for A >= 0 the pessimistic bound is -A min(rho, 1 + high); for A < 0 it is
    |A| max(rho, 1 - low), capped at c |A| by the dual clip."""
    losses, counts, log_ratios, ratios = [], dict.fromkeys(("low", "high", "dual"), 0), [], []
    for b in range(len(logp)):
        row = []
        for i in range(len(logp[b])):
            lr = min(max(logp[b][i] - old[b][i], -20.0), 20.0)
            rho, a = math.exp(lr), adv[b][i]
            if a >= 0:
                loss = -a * min(rho, 1 + clip_high)
            else:
                loss = -a * max(rho, 1 - clip_low)
                if dual_clip is not None:
                    loss = min(loss, -a * dual_clip)
            row.append(loss * (weights[b][i] if weights else 1.0))
            if mask[b][i]:
                counts["low"] += a < 0 and rho < 1 - clip_low
                counts["high"] += a > 0 and rho > 1 + clip_high
                counts["dual"] += dual_clip is not None and a < 0 and rho > dual_clip
                log_ratios.append(lr)
                ratios.append(rho)
        losses.append(row)
    n = max(len(ratios), 1)
    metrics = {
        "clipfrac": (counts["low"] + counts["high"]) / n,
        "clipfrac_low": counts["low"] / n,
        "clipfrac_high": counts["high"] / n,
        "dual_clipfrac": counts["dual"] / n,
        "approx_kl": -sum(log_ratios) / n,
        "ratio_mean": sum(ratios) / n,
        "ratio_max": max(ratios, default=0.0),
    }
    return losses, metrics


def ref_kl(d, kind):
    """d = logp - ref."""
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return abs(d)
    if kind in ("k2", "mse"):
        return 0.5 * d * d
    return min(math.exp(-d) + d - 1, 10.0)  # k3 of ref - logp = -d: e^-d - (-d) - 1


def random_batch(rng: random.Random):
    """A random right-padded batch: some rows empty, logprob shifts wide enough to hit every clip case."""
    b, n_t = rng.randint(1, 7), rng.randint(1, 6)
    lengths = [rng.randint(0, n_t) for _ in range(b)]
    mask = [[float(i < n and rng.random() < 0.85) for i in range(n_t)] for n in lengths]
    logp = [[-rng.expovariate(1.0) for _ in range(n_t)] for _ in range(b)]
    old = [[lp + rng.choice([0.0, rng.gauss(0, 0.2), rng.gauss(0, 1.5)]) for lp in row] for row in logp]
    adv = [[rng.choice([0.0, rng.gauss(0, 1)]) for _ in range(n_t)] for _ in range(b)]
    return mask, logp, old, adv, [rng.randrange(3) for _ in range(b)]


N_RANDOM = 200  # random batches per test


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_advantages_agree_with_the_reference_on_random_batches(estimator):
    rng = random.Random(estimator)
    for _ in range(N_RANDOM):
        n = rng.randint(1, 12)
        rewards = [rng.choice([0.0, 1.0, 0.5, rng.gauss(0, 2)]) for _ in range(n)]
        groups = [rng.choice("abcde") for _ in range(n)]
        close(outcome_advantages(t(rewards), groups, estimator), ref_advantages(rewards, groups, estimator), 1e-9)


def test_aggregate_kl_and_tis_agree_with_the_reference_on_random_batches():
    rng = random.Random(1)
    for _ in range(N_RANDOM):
        mask, logp, old, _, episodes = random_batch(rng)
        values = [[rng.gauss(0, 3) for _ in row] for row in mask]
        for mode in AGG_MODES:
            got = aggregate(t(values), t(mask), mode, torch.tensor(episodes), constant=3.0)
            close(got, ref_aggregate(values, mask, mode, episodes, 3.0), 1e-9)
        for kind in KL_KINDS:
            expected = [
                [ref_kl(lp - o, kind) for lp, o in zip(*rows, strict=True)] for rows in zip(logp, old, strict=True)
            ]
            close(kl_penalty(t(logp), t(old), kind), expected, 1e-9)
        weights = [
            [min(math.exp(lp - o), 2.0) * m for lp, o, m in zip(*rows, strict=True)]
            for rows in zip(logp, old, mask, strict=True)
        ]
        close(truncated_importance_weights(t(logp), t(old), t(mask), cap=2.0), weights, 1e-9)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_policy_loss_and_metrics_agree_with_the_reference_on_random_batches(agg):
    rng = random.Random(agg)
    for _ in range(N_RANDOM):
        mask, logp, old, adv, episodes = random_batch(rng)
        clip_low, clip_high = rng.choice([0.2, 0.1]), rng.choice([0.2, 0.28])
        dual_clip = rng.choice([None, 3.0, 1.5])
        weights = rng.choice([None, [[rng.uniform(0, 2) for _ in row] for row in mask]])
        clips = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, agg=agg, constant=5.0)
        importance_weights = None if weights is None else t(weights)
        loss, metrics = policy_loss(
            t(logp),
            t(old),
            t(adv),
            t(mask),
            **clips,
            episode_index=torch.tensor(episodes),
            importance_weights=importance_weights,
        )
        losses, expected = ref_policy_loss(logp, old, adv, mask, clip_low, clip_high, dual_clip, weights)
        close(loss, ref_aggregate(losses, mask, agg, episodes, 5.0), 1e-9)
        assert metrics == pytest.approx(expected, abs=1e-9)


def test_gradient_is_zero_where_clipped_and_outside_the_mask():
    rng = random.Random(2)
    for _ in range(N_RANDOM):
        mask, logp, old, adv, _ = random_batch(rng)
        logp_t = t(logp).requires_grad_()
        loss, _ = policy_loss(logp_t, t(old), t(adv), t(mask), clip_low=0.2, clip_high=0.28, dual_clip=3.0)
        loss.backward()
        for b, row in enumerate(mask):
            for i, m in enumerate(row):
                rho, a = math.exp(logp[b][i] - old[b][i]), adv[b][i]
                clipped = (a > 0 and rho > 1.28) or (a < 0 and (rho < 0.8 or rho > 3.0)) or a == 0
                if not m or clipped:
                    assert logp_t.grad[b, i] == 0, (b, i, rho, a)
                else:
                    assert logp_t.grad[b, i] != 0, (b, i, rho, a)


def _nan_outside(mask):
    pad = t(mask) == 0
    return lambda rows: torch.where(pad, float("nan"), t(rows))


def test_padding_values_never_change_results():
    rng = random.Random(3)
    for _ in range(N_RANDOM):
        mask, logp, old, adv, episodes = random_batch(rng)
        garbage = _nan_outside(mask)

        for agg in AGG_MODES:
            kwargs = dict(dual_clip=3.0, agg=agg, episode_index=torch.tensor(episodes), constant=4.0)
            clean, clean_metrics = policy_loss(t(logp), t(old), t(adv), t(mask), **kwargs)
            dirty, dirty_metrics = policy_loss(garbage(logp), garbage(old), garbage(adv), t(mask), **kwargs)
            assert torch.equal(clean, dirty) and clean_metrics == dirty_metrics
        assert torch.equal(
            truncated_importance_weights(garbage(logp), t(old), t(mask)),
            truncated_importance_weights(t(logp), t(old), t(mask)),
        )
        rewards = [[rng.gauss(0, 1) for _ in row] for row in mask]
        assert torch.equal(reinforce_pp_returns(garbage(rewards), t(mask)), reinforce_pp_returns(t(rewards), t(mask)))
