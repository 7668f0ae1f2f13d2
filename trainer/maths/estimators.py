"""The arithmetic of the estimators that need more than a group of outcome rewards: GAE with a critic's values,
the critic's clipped value loss, ReMax's greedy baseline, and the KL coefficient controllers for KL-in-reward.

Small pure torch functions, pinned by hand-computed cases in tests/trainer/test_estimators.py, as
trainer/maths/algorithms.py's are. Tensors are [B, T], right-padded; `mask` is 1 on the tokens the engine sampled. As
there, a value where `mask` is 0 never changes a result, and positions outside the mask (a merged sample's tool
output, the next prompt) are not steps of the trajectory: the recursion passes over them, so the outcome reward at
the end reaches every call.

Departures from verl's `core_algos`, on purpose:
- `gae_advantages` treats masked-out positions as absent (neither a reward, a value nor a discount step); verl 0.9's
  GAE does the same for multi-turn samples, older versions discounted across tool output.
- `adaptive_kl_coef` is Ziegler et al.'s proportional controller, as verl's AdaptiveKLController, written as a pure
  function of the current coefficient so the loop can checkpoint it as a number.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.maths.algorithms import aggregate

__all__ = ["adaptive_kl_coef", "gae_advantages", "outcome_token_rewards", "remax_advantages", "value_loss",
           "value_token_losses"]


def outcome_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Each sequence's outcome reward [B] on its last trained token, 0 elsewhere [B, T] (a row without a trained
    token gets nothing)."""
    if rewards.dim() != 1 or mask.dim() != 2 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards must be [B] and mask [B, T]; got {tuple(rewards.shape)} and {tuple(mask.shape)}")
    valid = mask > 0
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(valid, positions, -1).max(-1).values
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=mask.device)
    rows = (last >= 0).nonzero().squeeze(-1)
    out[rows, last[rows]] = rewards[rows]
    return out


def gae_advantages(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0,
                   eps: float = 1e-6, whiten: bool = True) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over the trained tokens: (advantages, returns).

    For the trained tokens k = 1..n of a row: delta_k = r_k + gamma V_{k+1} - V_k (V_{n+1} = 0), A_k = delta_k +
    gamma lam A_{k+1}, returns R_k = A_k + V_k (the critic's regression target). `values[b, t]` is the critic's value
    of the state in which token t was sampled (aligned like the logprobs of trainer/model/policy.py). With `whiten`, the
    advantages are whitened over all trained tokens of the batch (unbiased std), as verl does; the returns are not.
    0 outside the mask.
    """
    for name, x in (("token_rewards", token_rewards), ("values", values)):
        if x.shape != mask.shape or mask.dim() != 2:
            raise ValueError(f"{name} and mask must both be [B, T]; got {tuple(x.shape)} and {tuple(mask.shape)}")
    valid = mask > 0
    with torch.no_grad():
        values = torch.where(valid, values, 0.0)
        advantages = torch.zeros_like(token_rewards)
        next_value = torch.zeros_like(token_rewards[:, 0])
        running = torch.zeros_like(token_rewards[:, 0])
        for t in reversed(range(token_rewards.shape[1])):
            delta = token_rewards[:, t] + gamma * next_value - values[:, t]
            gae = delta + gamma * lam * running
            running = torch.where(valid[:, t], gae, running)
            next_value = torch.where(valid[:, t], values[:, t], next_value)
            advantages[:, t] = torch.where(valid[:, t], gae, 0.0)
        returns = torch.where(valid, advantages + values, 0.0)
        if whiten:
            flat = advantages[valid]
            spread = flat.numel() > 1 and bool(flat.max() != flat.min())
            advantages = torch.zeros_like(advantages)
            if spread:
                advantages[valid] = (flat - flat.mean()) / (flat.std() + eps)
    return advantages, returns


def value_token_losses(values: Tensor, old_values: Tensor, returns: Tensor,
                       clip: float | None = 0.5) -> tuple[Tensor, Tensor]:
    """Per-token 0.5 (V - R)^2 with PPO's value clipping (the larger of the clipped and unclipped errors, V clipped
    to old_V +- clip; None: no clipping), not masked; and where the clipped error was the larger (bool [B, T]). For a
    caller that weighs tokens itself (the critic's gradient accumulation)."""
    error = (values - returns).square()
    if clip is None:
        return 0.5 * error, torch.zeros_like(error, dtype=torch.bool)
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    clipped_error = (clipped - returns).square()
    return 0.5 * torch.maximum(error, clipped_error), clipped_error > error


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None = 0.5,
               mode: str = "token-mean") -> tuple[Tensor, dict[str, float]]:
    """The critic's loss: value_token_losses aggregated over the trained tokens as trainer.loss_agg_mode says
    (seq-mean-token-sum-norm by the batch's width); and its metrics: the fraction of tokens whose clipped error was
    the larger, and the mean |V - R|."""
    valid = mask > 0
    per_token, clipped = value_token_losses(values, old_values, returns, clip)
    loss = aggregate(per_token, mask, mode, constant=float(mask.shape[1]) if mode == "seq-mean-token-sum-norm"
                     else None)
    n = valid.sum().clamp(min=1)
    clipfrac = torch.where(valid, clipped.float(), 0.0).sum() / n
    abs_error = torch.where(valid, (values - returns).abs(), 0.0).sum() / n
    return loss, {"critic/vf_clipfrac": float(clipfrac), "critic/abs_error": float(abs_error.detach())}


def remax_advantages(rewards: Tensor, baselines: Tensor) -> Tensor:
    """ReMax (Li et al. 2023): each sequence's reward minus its task's greedy-decoding reward, both [B]. No
    normalisation: the greedy episode is the baseline, so a task whose samples all match it gets 0."""
    if rewards.shape != baselines.shape or rewards.dim() != 1:
        raise ValueError(f"rewards and baselines must both be [B]; got {tuple(rewards.shape)} and "
                         f"{tuple(baselines.shape)}")
    return rewards - baselines


def adaptive_kl_coef(coef: float, kl: float, target: float, horizon: int, n_steps: int) -> float:
    """The next KL coefficient of the adaptive controller (Ziegler et al. 2019): coef x (1 + e n_steps / horizon)
    with e = clip(kl / target - 1, -0.2, 0.2): raised while the measured KL is above `target`, lowered below it."""
    if target <= 0 or horizon <= 0:
        raise ValueError(f"the adaptive KL controller needs target > 0 and horizon > 0; got {target}, {horizon}")
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)
