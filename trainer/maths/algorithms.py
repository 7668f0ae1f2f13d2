"""The arithmetic of a policy update: advantages, KL penalties, entropy, the clipped policy loss and how it is averaged.

Small pure torch functions, so each can be pinned by a test and the training loop can read top to bottom.
Tensors are [B, T], right-padded; `mask` is a float [B, T] with 1 on the tokens the engine sampled (the tokens we
train) and 0 on prompt, tool output and padding. A value where `mask` is 0 never changes a result, even NaN or inf
(positions are selected with `torch.where`, not multiplied by the mask). Losses are to be minimised.

verl's `core_algos` is the reference the tests compare against; where this module departs from it, on purpose:

- A group of one, and a group whose rewards are all equal, get advantage 0 under every group-baseline estimator
  (verl gives a lone sample its raw reward). Such a group has no contrast: there is nothing to learn from it, and a
  reward-shaped nudge would push the policy towards whatever it happened to sample.
- `reinforce_pp` and `reinforce_pp_baseline` whiten over sequences (each counts once); verl whitens the advantages
  broadcast over tokens, so long sequences weigh more in its mean and std.
- `seq-mean-*` modes and `episode-mean` average over rows (episodes) that have at least one token, as verl 0.9 does.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from harness.core.records import Sample

__all__ = [
    "AGG_MODES",
    "POLICY_METRICS",
    "ESTIMATORS",
    "KL_KINDS",
    "add_policy_metrics",
    "aggregate",
    "call_reward_tokens",
    "entropy_bonus",
    "entropy_from_logits",
    "kl_in_reward",
    "kl_penalty",
    "outcome_advantages",
    "outcome_reward_tokens",
    "policy_loss",
    "policy_metric_values",
    "reinforce_pp_returns",
    "token_advantages",
    "token_weights",
    "truncated_importance_weights",
]

ESTIMATORS = ("grpo", "grpo_no_std", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
KL_KINDS = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "episode-mean")

# exp() of a log-ratio beyond this overflows float16/bfloat16 ranges long before it matters: far past any clip range.
_LOG_RATIO_LIMIT = 20.0


# ---------------------------------------------------------------------------------------------------------- advantages


def outcome_advantages(
    rewards: Tensor, groups: Sequence[Hashable], estimator: str = "grpo", eps: float = 1e-6
) -> Tensor:
    """One advantage per sequence [B] from one outcome reward per sequence [B].

    `groups[i]` is the task of sequence i's episode: the episodes of one task form a GRPO group. Several sequences
    of one episode (a multi-role or branching episode) share its reward and its group.

    - grpo (Shao et al. 2024, DeepSeekMath): A = (r - mean_g) / (std_g + eps), std_g the *unbiased* group std
      (Bessel-corrected, like `torch.std` and verl).
    - grpo_no_std, drgrpo (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A = r - mean_g. Dr.GRPO also
      drops GRPO's 1/|o| length normalisation: pair it with aggregate(mode="seq-mean-token-sum-norm", constant=the
      max response length), not token-mean.
    - rloo (Ahmadian et al. 2024): A = r - mean of the *other* members of the group = n/(n-1) * (r - mean_g).
    - reinforce_pp (Hu 2025, REINFORCE++): no group baseline; r whitened over the batch, (r - mean_B) / (std_B + eps).
      `groups` is not used.
    - reinforce_pp_baseline (REINFORCE++-baseline): r - mean_g, then whitened over the batch.

    Groups of one and zero-variance groups (all rewards exactly equal) get 0 under every estimator but reinforce_pp,
    exactly rather than up to rounding (see the module docstring). They still count, as zeros, in the batch statistics
    of reinforce_pp_baseline, as in verl. A batch (reinforce_pp*) with fewer than two sequences or zero spread gets 0.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of: {', '.join(ESTIMATORS)}")
    rewards = _check_rewards(rewards)
    if estimator == "reinforce_pp":
        return _whiten(rewards, eps)
    group_id, n_groups = _group_ids(groups, len(rewards))
    mean, std, size, has_contrast = _group_stats(rewards, group_id, n_groups)
    centred = rewards - mean
    if estimator == "grpo":
        advantages = centred / (std + eps)
    elif estimator in ("grpo_no_std", "drgrpo"):
        advantages = centred
    elif estimator == "rloo":
        advantages = centred * size / (size - 1).clamp(min=1)
    else:  # reinforce_pp_baseline
        advantages = _whiten(torch.where(has_contrast, centred, 0.0), eps)
    return torch.where(has_contrast, advantages, 0.0)


def token_advantages(seq_adv: Tensor, mask: Tensor) -> Tensor:
    """Every trained token of a sequence gets its sequence's advantage: outcome supervision. 0 outside the mask."""
    if seq_adv.dim() != 1 or mask.dim() != 2 or seq_adv.shape[0] != mask.shape[0]:
        raise ValueError(f"seq_adv must be [B] and mask [B, T]; got {tuple(seq_adv.shape)} and {tuple(mask.shape)}")
    return torch.where(mask > 0, seq_adv.unsqueeze(-1), 0.0)


def _check_rewards(rewards: Tensor) -> Tensor:
    rewards = torch.as_tensor(rewards).detach()
    if rewards.dim() != 1:
        raise ValueError(f"rewards must hold one scalar per sequence, shape [B]; got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    bad = (~torch.isfinite(rewards)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"reward of sequence {i} is {rewards[i].item()}: leave unjudged or failed episodes out of "
            "the batch, or give them a finite reward, before computing advantages"
        )
    return rewards


def _group_ids(groups: Sequence[Hashable], n: int) -> tuple[Tensor, int]:
    if len(groups) != n:
        raise ValueError(f"groups has {len(groups)} entries for {n} rewards: give each sequence its task (group)")
    ids: dict[Hashable, int] = {}
    return torch.tensor([ids.setdefault(g, len(ids)) for g in groups], dtype=torch.long), len(ids)


def _group_stats(rewards: Tensor, group_id: Tensor, n_groups: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per sequence: its group's mean, unbiased std, size, and whether the group has two different rewards."""
    group_id = group_id.to(rewards.device)
    zeros = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device)
    size = zeros.index_add(0, group_id, torch.ones_like(rewards))
    mean = zeros.index_add(0, group_id, rewards) / size
    deviation = rewards - mean[group_id]
    var = zeros.index_add(0, group_id, deviation * deviation) / (size - 1).clamp(min=1)
    high = zeros.scatter_reduce(0, group_id, rewards, "amax", include_self=False)
    low = zeros.scatter_reduce(0, group_id, rewards, "amin", include_self=False)
    has_contrast = (size > 1) & (high > low)
    return mean[group_id], var.sqrt()[group_id], size[group_id], has_contrast[group_id]


def _whiten(x: Tensor, eps: float) -> Tensor:
    """(x - mean) / (std + eps) over all of x, unbiased std; 0 where there is no spread to normalise."""
    if x.numel() < 2 or bool(x.max() == x.min()):
        return torch.zeros_like(x)
    return (x - x.mean()) / (x.std() + eps)


def _masked_whiten(x: Tensor, valid: Tensor, eps: float) -> Tensor:
    """_whiten over the valid positions only; 0 elsewhere."""
    out = torch.zeros_like(x)
    out[valid] = _whiten(x[valid], eps)
    return out


# ------------------------------------------------------------------------------- token rewards (KL in reward, per call)


def outcome_reward_tokens(rewards: Tensor, mask: Tensor) -> Tensor:
    """[B, T] token rewards with each sequence's outcome reward on its last trained token, 0 elsewhere.

    The starting point of the token-reward path (REINFORCE++ with KL in the reward): outcome_reward_tokens ->
    kl_in_reward -> reinforce_pp_returns. Rows without a trained token get no reward.
    """
    rewards = _check_rewards(rewards)
    valid = mask > 0
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(valid, positions, -1).amax(-1)
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=mask.device)
    rows = (last >= 0).nonzero().squeeze(-1)
    out[rows, last[rows]] = rewards.to(mask.device)[rows]
    return out


def call_reward_tokens(seq_len: int, call_spans: Sequence[tuple[int, int, float]], at: str = "spread") -> Tensor:
    """Per-call rewards (or advantages) of one sequence on its calls' completion tokens: a [seq_len] tensor.

    `call_spans` holds (start, end, value) per call, [start, end) the positions of the call's completion in the
    sequence. at="spread" puts the value on every completion token (per-call advantages, added to the outcome's
    token advantages); at="last" puts it on the call's last token only (per-call rewards, for reinforce_pp_returns,
    which carries each call's reward back over the tokens before it).

    How outcome and per-call rewards combine: outcome rewards are the default and per-call rewards come only from a
    judge that returns them. With a group estimator the loop normalises per-call rewards like outcomes
    (outcome_advantages over calls) and adds call_reward_tokens(..., at="spread") to token_advantages(outcome); with
    REINFORCE++ it adds call_reward_tokens(..., at="last") to outcome_reward_tokens, and the returns do the rest.
    """
    if at not in ("spread", "last"):
        raise ValueError(f"at must be 'spread' or 'last'; got {at!r}")
    out = torch.zeros(seq_len)
    covered = torch.zeros(seq_len, dtype=torch.bool)
    for start, end, value in call_spans:
        if not 0 <= start < end <= seq_len:
            raise ValueError(f"call span ({start}, {end}) is empty or outside a sequence of {seq_len} tokens")
        if covered[start:end].any():
            raise ValueError(f"call span ({start}, {end}) overlaps an earlier call's span")
        covered[start:end] = True
        if at == "spread":
            out[start:end] = value
        else:
            out[end - 1] = value
    return out


def kl_in_reward(rewards_token: Tensor, kl: Tensor, coef: float, mask: Tensor | None = None) -> Tensor:
    """r_t - coef * kl_t: the KL to the reference as a per-token reward penalty (InstructGPT, REINFORCE++).

    The alternative to a KL loss term: the penalty then flows through the returns and the advantage whitening
    instead of the gradient directly. Use kl from kl_penalty(old_logprobs, ref_logprobs, "k1"), as verl does.
    With `mask`, positions outside it are 0; reinforce_pp_returns ignores them either way.
    """
    out = rewards_token - coef * kl
    return out if mask is None else torch.where(mask > 0, out, 0.0)


def reinforce_pp_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ token advantages: discounted returns-to-go over the trained tokens, whitened over the batch.

    G_t = sum over trained s >= t of gamma^(k) r_s, k the number of trained tokens from t to s. Positions outside the
    mask (a merged multi-turn sample's tool output and next prompt) are skipped: they neither add reward nor count a
    discount step, so the outcome reward at the end reaches every call's tokens. verl 0.9 carries the return the
    same way. Then (G - mean) / (std + eps) over all trained tokens (unbiased std); 0 outside the mask.
    Runs a Python loop over T: cheap next to a forward pass, and done once per batch under no_grad.
    """
    _check_same_shape(token_rewards, mask, "token_rewards")
    valid = mask > 0
    with torch.no_grad():
        returns = torch.zeros_like(token_rewards)
        running = torch.zeros_like(token_rewards[:, 0])
        for t in reversed(range(token_rewards.shape[1])):
            running = torch.where(valid[:, t], token_rewards[:, t] + gamma * running, running)
            returns[:, t] = running
        return _masked_whiten(returns, valid, eps)


# ------------------------------------------------------------------------------------------------ KL, entropy, weights


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' logprobs (Schulman 2020, "Approximating KL").

    - k1 / "kl": logp - ref. Unbiased, high variance, can be negative.
    - k2 / "mse": 0.5 * (logp - ref)^2. Biased, low variance; its gradient is the true KL's gradient in expectation.
    - k3 / "low_var_kl": exp(ref - logp) - (ref - logp) - 1 >= 0. Unbiased, low variance. As in verl, ref - logp is
      clamped to [-20, 20] and the result to [-10, 10], so a token far off the reference cannot blow up the loss
      (and gets no gradient past the clamp).
    - "abs": |logp - ref|.
    Not masked: aggregate() applies the mask.
    """
    diff = logprobs - ref_logprobs
    if kind in ("k1", "kl"):
        return diff
    if kind in ("k2", "mse"):
        return 0.5 * diff.square()
    if kind in ("k3", "low_var_kl"):
        log_ratio = (-diff).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
        return (log_ratio.exp() - log_ratio - 1).clamp(-10.0, 10.0)
    if kind == "abs":
        return diff.abs()
    raise ValueError(f"unknown KL kind {kind!r}; choose one of: {', '.join(KL_KINDS)}")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of each position's next-token distribution: [..., V] -> [...], in float32.

    H = logsumexp(z) - sum softmax(z) * z, which never takes the log of a probability that underflowed to 0.
    Pass the logits already divided by the sampling temperature, so this is the entropy of what the engine samples.
    """
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def entropy_bonus(
    entropy: Tensor,
    mask: Tensor,
    coef: float,
    mode: str = "token-mean",
    episode_index: Tensor | None = None,
    constant: float | None = None,
) -> Tensor:
    """The term to add to the loss for an entropy bonus: -coef * aggregate(entropy). Negative, so minimising the loss
    raises entropy; aggregated like the policy loss so the two stay on one scale."""
    return -coef * aggregate(entropy, mask, mode, episode_index, constant)


def truncated_importance_weights(
    trainer_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor, cap: float = 2.0
) -> Tensor:
    """TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training").

    The engine samples with its own kernels, so its probabilities differ from the trainer's at the same weights: the
    update is slightly off-policy. w = min(pi_trainer_old / pi_engine, cap) = min(exp(trainer_old - engine), cap)
    corrects it per token, truncated so a rare token cannot dominate. Detached (a weight, not a path for gradient);
    0 outside the mask. Pass as policy_loss(importance_weights=...).
    """
    if cap <= 0:
        raise ValueError(f"cap must be positive; got {cap}")
    _check_same_shape(trainer_logprobs, mask, "trainer_logprobs")
    _check_same_shape(engine_logprobs, mask, "engine_logprobs")
    with torch.no_grad():
        weights = (trainer_logprobs - engine_logprobs).clamp(max=math.log(cap)).exp()
        return torch.where(mask > 0, weights, 0.0)


# --------------------------------------------------------------------------------------------------------- aggregation


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    episode_index: Tensor | None = None,
    constant: float | None = None,
) -> Tensor:
    """Average per-token values [B, T] over the trained tokens into one scalar; the mode decides who weighs what.

    - token-mean: sum / number of tokens. Every token weighs the same, so long sequences dominate (DAPO's choice).
    - seq-mean-token-mean: mean over sequences of each sequence's token mean (original GRPO: 1/G sum 1/|o| sum).
    - seq-mean-token-sum: mean over sequences of each sequence's token sum.
    - seq-mean-token-sum-norm: mean over sequences of token sum / `constant` (Dr.GRPO: `constant` = the max
      response length, a number that does not depend on the batch, so no length bias; verl 0.9 does the same).
    - episode-mean: mean over the tokens of each episode (all its rows together), then mean over episodes; several
      sequences of one episode count as one, so an episode with many calls or branches does not dominate.
      `episode_index` [B] gives each row's episode (any integers).
    Rows (episodes) without a trained token are left out of the means; an empty batch gives 0.
    """
    _check_same_shape(values, mask, "values")
    valid = mask > 0
    masked = torch.where(valid, values, 0.0)
    if mode == "token-mean":
        return masked.sum() / valid.sum().clamp(min=1)
    row_sum = masked.sum(-1)
    row_tokens = valid.sum(-1)
    n_rows = (row_tokens > 0).sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        return (row_sum / row_tokens.clamp(min=1)).sum() / n_rows
    if mode == "seq-mean-token-sum":
        return row_sum.sum() / n_rows
    if mode == "seq-mean-token-sum-norm":
        if constant is None or constant <= 0:
            raise ValueError(f"seq-mean-token-sum-norm needs constant > 0 (the max response length); got {constant}")
        return row_sum.sum() / n_rows / constant
    if mode == "episode-mean":
        episode = _episode_ids(episode_index, values.shape[0], values.device)
        n_episodes = int(episode.max()) + 1 if len(episode) else 0
        zeros = torch.zeros(n_episodes, dtype=row_sum.dtype, device=values.device)
        episode_sum = zeros.index_add(0, episode, row_sum)
        episode_tokens = zeros.index_add(0, episode, row_tokens.to(row_sum.dtype))
        return (episode_sum / episode_tokens.clamp(min=1)).sum() / (episode_tokens > 0).sum().clamp(min=1)
    raise ValueError(f"unknown aggregation mode {mode!r}; choose one of: {', '.join(AGG_MODES)}")


def token_weights(rows: list[Sample], mode: str) -> list[torch.Tensor]:
    """Each trained token's weight in the mini-batch's loss, so that sum(weight x per-token loss) over all its rows
    (however they are split into micro-batches and ranks) is aggregate(loss, mode) of the mini-batch.
    seq-mean-token-sum-norm divides by the mini-batch's longest sample (Dr.GRPO's constant)."""
    masks = [torch.tensor(r.loss_mask, dtype=torch.float32) for r in rows]
    n_tokens = [float(m.sum()) for m in masks]
    trained = [i for i, n in enumerate(n_tokens) if n > 0]
    if mode == "token-mean":
        return [m / max(sum(n_tokens), 1.0) for m in masks]
    if mode == "seq-mean-token-mean":
        return [m / (max(n, 1.0) * max(len(trained), 1)) for m, n in zip(masks, n_tokens, strict=True)]
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        constant = float(max(len(r.token_ids) for r in rows)) if mode == "seq-mean-token-sum-norm" else 1.0
        return [m / (max(len(trained), 1) * constant) for m in masks]
    if mode == "episode-mean":
        per_episode: dict[str, float] = {}
        for r, n in zip(rows, n_tokens, strict=True):
            per_episode[r.episode_id] = per_episode.get(r.episode_id, 0.0) + n
        episodes = sum(1 for n in per_episode.values() if n > 0)
        return [m / (max(per_episode[r.episode_id], 1.0) * max(episodes, 1)) for m, r in zip(masks, rows, strict=True)]
    raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of: {', '.join(AGG_MODES)}")


def _episode_ids(episode_index: Tensor | None, n: int, device: torch.device) -> Tensor:
    if episode_index is None:
        raise ValueError("mode 'episode-mean' needs episode_index: one episode id per row")
    episode_index = torch.as_tensor(episode_index, device=device)
    if episode_index.shape != (n,):
        raise ValueError(f"episode_index must be [B] = [{n}]; got shape {tuple(episode_index.shape)}")
    return torch.unique(episode_index, return_inverse=True)[1]


def _check_same_shape(values: Tensor, mask: Tensor, name: str) -> None:
    if mask.dim() != 2 or values.shape != mask.shape:
        raise ValueError(f"{name} and mask must both be [B, T]; got {tuple(values.shape)} and {tuple(mask.shape)}")


# --------------------------------------------------------------------------------------------------------- policy loss


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    episode_index: Tensor | None = None,
    importance_weights: Tensor | None = None,
    constant: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped surrogate (Schulman et al. 2017), per token, aggregated with aggregate(agg): (loss, metrics).

    With rho = exp(logp - old) (log-ratio clamped to [-20, 20], as verl):
        loss_t = max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high))
    Separate low and high ranges are DAPO's clip-higher (Yu et al. 2025): a larger clip_high lets unlikely good
    tokens grow. With dual_clip = c > 1 (Ye et al. 2020, "Mastering complex control in MOBA games"), for A < 0 the
    loss is also capped at c |A|: a token whose ratio has exploded cannot drag the update with an unbounded loss.
    importance_weights (e.g. TIS) multiply each token's loss, detached. old_logprobs and advantages are detached.
    The gradient is 0 wherever a clip is active and outside the mask.

    Metrics, over the trained tokens whatever `agg`: clipfrac_low (A < 0, rho < 1 - clip_low), clipfrac_high
    (A > 0, rho > 1 + clip_high), clipfrac (their sum), dual_clipfrac (A < 0, rho > c), approx_kl (mean of
    old - logp: k1 of KL(old || new), verl's ppo_kl), ratio_mean, ratio_max. All 0 when there is no trained token.
    """
    for name, tensor in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages)):
        _check_same_shape(tensor, mask, name)
    if not 0 <= clip_low < 1 or clip_high < 0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0; got clip_low={clip_low}, clip_high={clip_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (it caps the loss at dual_clip * |A|); got {dual_clip}")
    losses, log_ratio = ppo_token_losses(logprobs, old_logprobs, advantages, clip_low=clip_low,
                                         clip_high=clip_high, dual_clip=dual_clip)
    if importance_weights is not None:
        _check_same_shape(importance_weights, mask, "importance_weights")
        losses = losses * importance_weights.detach()
    loss = aggregate(losses, mask, agg, episode_index, constant)
    return loss, policy_metrics(log_ratio, advantages.detach(), mask, clip_low, clip_high, dual_clip)


def ppo_token_losses(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, clip_low: float = 0.2,
                     clip_high: float = 0.2, dual_clip: float | None = None) -> tuple[Tensor, Tensor]:
    """The per-token losses policy_loss aggregates (same formula, not masked), and the detached log-ratios.
    For a caller that weighs tokens itself (the loop's gradient accumulation across micro-batches and ranks)."""
    advantages = advantages.detach()
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = log_ratio.exp()
    losses = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_low, 1 + clip_high))
    if dual_clip is not None:
        losses = torch.where(advantages < 0, torch.minimum(losses, -advantages * dual_clip), losses)
    return losses, log_ratio.detach()


POLICY_METRICS = ("clipfrac", "clipfrac_low", "clipfrac_high", "dual_clipfrac", "approx_kl", "ratio_mean",
                  "ratio_max")


def policy_metrics(
    log_ratio: Tensor, advantages: Tensor, mask: Tensor, clip_low: float, clip_high: float, dual_clip: float | None
) -> dict[str, float]:
    """policy_loss's metrics (see there) from the log-ratios ppo_token_losses returns."""
    values = policy_metric_values(log_ratio, advantages, mask, clip_low, clip_high, dual_clip)
    return dict(zip(POLICY_METRICS, values.tolist(), strict=True))


def add_policy_metrics(total: Tensor, values: Tensor, share: float) -> Tensor:
    """Running policy metrics over the micro-batches of a mini-batch: each micro-batch's means weighted by its
    share of the trained tokens, its ratio_max a maximum (so neither depends on how the samples were split)."""
    out = total + values * share
    out[-1] = torch.maximum(total[-1], values[-1])
    return out


def policy_metric_values(
    log_ratio: Tensor, advantages: Tensor, mask: Tensor, clip_low: float, clip_high: float, dual_clip: float | None
) -> Tensor:
    """policy_metrics as one float64 tensor [7] in the order of POLICY_METRICS, where the inputs are: nothing is
    read back to the host (for a loop that reads its metrics once per mini-batch)."""
    valid = mask > 0
    n = valid.sum().clamp(min=1).double()
    ratio = log_ratio.exp()

    def fraction(condition: Tensor) -> Tensor:
        return (condition & valid).sum() / n

    low = fraction((advantages < 0) & (ratio < 1 - clip_low))
    high = fraction((advantages > 0) & (ratio > 1 + clip_high))
    dual = fraction((advantages < 0) & (ratio > dual_clip)) if dual_clip is not None else torch.zeros_like(low)
    approx_kl = torch.where(valid, -log_ratio, 0.0).sum() / n
    ratio_mean = torch.where(valid, ratio, 0.0).sum() / n
    # 0 without a trained token (ratios are positive, so the masked max is 0 then too)
    ratio_max = torch.where(valid, ratio, 0.0).max() if ratio.numel() else torch.zeros_like(low)
    return torch.stack([v.double() for v in (low + high, low, high, dual, approx_kl, ratio_mean, ratio_max)])
