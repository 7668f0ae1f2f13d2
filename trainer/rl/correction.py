"""The step's off-policy correction (trainer.correction; the maths in trainer/maths/rollout_correction.py, verl's):
decoupled, once per step on the whole batch before the advantages, as verl runs it; bypass, the measures each
micro-batch of the update takes against the weights being trained (trainer/rl/update.py's `mini_batch`)."""

from __future__ import annotations

import dataclasses
import math

import torch

from harness.core.records import Sample
from trainer.maths.rollout_correction import Correction, mismatch_metrics
from trainer.model.policy import padded
from trainer.rl.experience import Experience

__all__ = ["bypass_keys", "bypass_measures", "correct_rows", "correct_step", "still_trained"]


def correct_step(experience: Experience, old: list[torch.Tensor], correction: Correction, lags: list[int] | None):
    """`correct_rows` over the step's samples, the rejected tokens taken out of their loss masks: (the experience
    so masked, each row's importance weights or None, the `rollout_corr/` metrics, each sample's sampled tokens
    before the masks, or None when nothing was rejected)."""
    masks, weights, metrics = correct_rows(experience.samples, old, correction, lags)
    if all(m is None for m in masks):
        return experience, weights, metrics, None
    sampled = [sum(r.loss_mask) for r in experience.samples]
    samples = [r if m is None else dataclasses.replace(r, loss_mask=m)
               for r, m in zip(experience.samples, masks, strict=True)]
    experience = dataclasses.replace(experience, samples=samples)
    return experience, weights, metrics, sampled


def still_trained(experience: Experience, keep: list[int], sampled: list[int] | None) -> tuple[list[int], dict]:
    """The positions in `keep` whose rows have a token left after the rejection masks, and the step's counts: rows
    rejected whole, samples trained, and the response lengths as sampled (`sampled`, from `correct_step`)."""
    live = [j for j, i in enumerate(keep) if any(experience.samples[i].loss_mask)]
    metrics = {"rollout_corr/rows_rejected": len(keep) - len(live), "samples/trained": len(live)}
    if sampled is not None and keep:
        lengths = [sampled[i] for i in keep]
        metrics.update({"response/length_mean": sum(lengths) / len(lengths), "response/length_max": max(lengths)})
    return live, metrics


def correct_rows(rows: list[Sample], old: list[torch.Tensor], correction: Correction, lags: list[int] | None = None):
    """The decoupled correction over the step's rows at once (verl's compute_rollout_correction_and_rejection_mask,
    before the advantages): per row its loss mask less the rejected tokens (None: unchanged) and its importance
    weights (None without a level), and the `rollout_corr/` metrics: the engine/trainer mismatch always, and
    with `lags` (per row, how many weight versions behind the trained ones it was sampled) the mismatch of each
    lag under `rollout_corr/lag<k>/`."""
    none = [None] * len(rows)
    if not any(any(r.loss_mask) for r in rows):
        return none, none, {}
    mask = padded([torch.tensor(r.loss_mask, dtype=torch.float32) for r in rows],
                  torch.zeros(len(rows), max(len(r.token_ids) for r in rows)))
    old_lp = padded(old, mask)
    engine = padded([torch.tensor(r.logprobs, dtype=torch.float32) for r in rows], mask)
    weights, kept, metrics = correction.apply(old_lp, engine, mask)
    sizes = [len(r.token_ids) for r in rows]
    masks = none if not correction.reject else [
        None if torch.equal(kept[i, :n], mask[i, :n]) else kept[i, :n].int().tolist() for i, n in enumerate(sizes)]
    per_row = none if weights is None else [weights[i, :n] for i, n in enumerate(sizes)]
    if weights is not None:  # the weights' spread, beyond verl's mean/std/extremes: their 5/50/95% quantiles
        on = weights[mask > 0].double().sort().values  # (torch.quantile refuses more than 2^24 values)
        for q in (5, 50, 95):
            at = q / 100 * (len(on) - 1)
            low, high = on[math.floor(at)], on[math.ceil(at)]
            metrics[f"rollout_corr/rollout_is_q{q:02d}"] = (low + (high - low) * (at - math.floor(at))).item()
    for lag in sorted(set(lags or ())):
        idx = [i for i, k in enumerate(lags) if k == lag]
        tokens = mask[idx].sum()
        if not tokens:
            continue
        found = mismatch_metrics(old_lp[idx], engine[idx], mask[idx])
        found = {key: found[key] for key in ("kl", "k3_kl", "log_ppl_abs_diff", "chi2_token")}
        found["tokens"] = tokens.item()
        if correction.reject:
            found["rollout_rs_masked_fraction"] = 1.0 - (kept[idx].sum() / tokens).item()
        metrics.update({f"rollout_corr/lag{lag}/{key}": value for key, value in found.items()})
    return masks, per_row, metrics


def bypass_keys(correction: Correction) -> tuple[str, ...]:
    """What a micro-batch measures in bypass mode (`bypass_measures`), unprefixed."""
    return ("kl", "k3_kl") + (("rollout_is_mean",) if correction.level else ()) + \
        (("rollout_rs_masked_fraction",) if correction.reject else ())


def bypass_measures(correction: Correction, logprobs, engine, mask, kept, weights) -> dict:
    """With mode bypass, what a micro-batch measures (token means over its sampled tokens, on the device, float64):
    the engine/trainer KL estimators, the importance weights' mean and the share rejected."""
    count = mask.sum().clamp_min(1.0)
    log_ratio = (logprobs - engine).clamp(-20.0, 20.0)
    values = {"kl": ((engine - logprobs) * mask).sum() / count,
              "k3_kl": ((log_ratio.exp() - log_ratio - 1) * mask).sum() / count}
    if correction.level:
        values["rollout_is_mean"] = (weights * mask).sum() / count
    if correction.reject:
        values["rollout_rs_masked_fraction"] = ((mask - kept) * mask).sum() / count
    return {key: values[key].double() for key in bypass_keys(correction)}
