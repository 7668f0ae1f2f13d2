"""Off-policy correction between the engine that sampled and the trainer: importance weights and rejection masks,
with verl's meaning (its `algorithm.rollout_correction`, trainer/ppo/rollout_corr_helper.py in verl 0.9).

The engine's logprobs (`engine`, recorded for every sampled token) and the trainer's old logprobs (`old`, the
policy the update starts from) differ by kernels and precision, and by whole weight versions when rollouts run
ahead. With `log_ratio = old - engine` (log pi_old / mu):

- importance weights, per token (`level="token"`, w_t = exp(log_ratio_t)) or per sequence (`"sequence"`, one weight
  exp(sum_t log_ratio_t) for every token of the row): truncated at an upper bound (TIS) or, given a lower bound
  too, zeroed outside [lower, upper] (IcePop); optionally divided by their batch mean;
- rejection masks, which drop tokens or whole sequences whose divergence is out of bounds: per token or per
  sequence (sum, mean or max over the row) of k1 = -log_ratio (bounds on mu / pi_old, lower and upper), k2 =
  log_ratio^2 / 2 or k3 = exp(log_ratio) - 1 - log_ratio (an upper bound); several options chained, a token kept
  only if every option keeps it.

Tensors are [B, T] over response tokens; `mask` 1 on the sampled tokens. Log-ratios are clamped to +-20 before
exp, a sequence's after its sum, as verl does. Means over tokens are verl's masked means (their denominator plus
1e-8), so the values equal verl's on the same tensors (tests/trainer/test_rollout_correction.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["IS_LEVELS", "RS_OPTIONS", "Correction", "RejectionOption", "importance_weights", "mismatch_metrics",
           "parse_bounds", "parse_rejection", "rejection_mask"]

IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
_LIMIT = 20.0  # log-ratios are clamped to this before exp


def _masked_sum(x: Tensor, mask: Tensor, dim: int | None = -1) -> Tensor:
    kept = torch.where(mask > 0, x, 0.0) * mask  # a NaN or inf off the mask never counts
    return kept.sum() if dim is None else kept.sum(dim)


def _masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    return _masked_sum(x, mask, dim) / ((mask.sum() if dim is None else mask.sum(dim)) + 1e-8)


def _number(raw, what: str) -> float:
    if isinstance(raw, bool):
        raise ValueError(f"{what} must be a number, got {raw!r}")
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, got {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive number, got {raw!r}")
    return value


def parse_bounds(raw, what: str = "threshold") -> tuple[float, float | None]:
    """(upper, lower or None) from a number (an upper bound) or "lower_upper" (both), e.g. 2.0 or "0.5_5.0"."""
    if isinstance(raw, str) and "_" in raw:
        low, _, high = raw.partition("_")
        lower, upper = _number(low, f"{what}'s lower bound"), _number(high, f"{what}'s upper bound")
        if lower > upper:
            raise ValueError(f"{what} {raw!r}: the lower bound {lower:g} is above the upper {upper:g}")
        return upper, lower
    return _number(raw, what), None


@dataclass(frozen=True)
class RejectionOption:
    """One rejection test: `option` (one of RS_OPTIONS) and its bounds on the statistic's own scale (k1: on
    mu / pi_old, the ratio; k2, k3: the divergence, upper only)."""

    option: str
    upper: float
    lower: float | None = None


def parse_rejection(options: str, thresholds) -> list[RejectionOption]:
    """verl's rollout_rs and rollout_rs_threshold: comma-separated options (repeats dropped) and one threshold
    for all of them or one per option; k1's is "lower_upper" or an upper bound U (lower 1/U), k2's and k3's an
    upper bound."""
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    if not names:
        raise ValueError(f"rejection options {options!r}: name at least one of {', '.join(RS_OPTIONS)}")
    unknown = [n for n in names if n not in RS_OPTIONS]
    if unknown:
        raise ValueError(f"unknown rejection option(s) {unknown}: choose from {', '.join(RS_OPTIONS)}")
    if thresholds is None:
        raise ValueError(f"rejection options {names} need thresholds: one for all, or one per option")
    raw = [t.strip() for t in thresholds.split(",") if t.strip()] if isinstance(thresholds, str) else [thresholds]
    if len(raw) not in (1, len(names)):
        raise ValueError(f"{len(raw)} rejection thresholds for {len(names)} options {names}: give one for all, or "
                         "one per option")
    out = []
    for name, threshold in zip(names, raw * len(names) if len(raw) == 1 else raw, strict=True):
        if name.endswith("k1"):
            upper, lower = parse_bounds(threshold, f"the {name} threshold")
            lower = 1.0 / upper if lower is None else lower
            if lower > upper:
                raise ValueError(f"the {name} threshold {threshold!r} gives the lower bound {lower:g} above the "
                                 f"upper {upper:g}: give lower_upper")
        else:
            if isinstance(threshold, str) and "_" in threshold:
                raise ValueError(f"the {name} threshold {threshold!r}: k2 and k3 take an upper bound only")
            upper, lower = _number(threshold, f"the {name} threshold"), None
        out.append(RejectionOption(name, upper, lower))
    return out


def importance_weights(old: Tensor, engine: Tensor, mask: Tensor, level: str, upper: float,
                       lower: float | None = None, batch_normalize: bool = False, *, measure: bool = True
                       ) -> tuple[Tensor, dict[str, float]]:
    """The importance weights pi_old / mu (detached, 0 off the mask): TIS (capped at `upper`) or, with `lower`,
    IcePop (0 outside [lower, upper]); per token or per sequence; optionally divided by their batch mean. Returns
    them with verl's IS metrics (unprefixed: rollout_is_mean, _ratio_fraction_high, ...); with measure=False
    without metrics, and without reading anything back to the host."""
    if level not in IS_LEVELS:
        raise ValueError(f"importance-sampling level {level!r}: choose from {', '.join(IS_LEVELS)}")
    with torch.no_grad():
        log_ratio = old - engine
        if level == "token":
            measured = log_ratio
            raw = log_ratio.clamp(-_LIMIT, _LIMIT).exp()
        else:
            measured = _masked_sum(log_ratio, mask).unsqueeze(-1)
            raw = measured.clamp(-_LIMIT, _LIMIT).exp().expand_as(log_ratio)
        raw = raw * mask
        if lower is None:
            weights = raw.clamp(max=upper)
        else:
            weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
        metrics = _is_metrics(weights, raw, measured, mask, level, upper, lower) if measure else {}
        if lower is not None and measure:
            metrics["rollout_is_oob_ratio"] = _masked_mean(((raw < lower) | (raw > upper)).float(), mask).item()
        if batch_normalize:
            if level == "token":
                mean = _masked_mean(weights, mask)
            else:
                rows = (mask.sum(-1) > 0).to(weights.dtype)
                mean = (_masked_mean(weights, mask, -1) * rows).sum() / rows.sum().clamp_min(1e-8)
            factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean))  # a mean of ~0: left as it is
            weights = weights / factor
            if measure:
                metrics["rollout_is_batch_norm_factor"] = factor.item()
        return weights, metrics


def _is_metrics(weights: Tensor, raw: Tensor, measured: Tensor, mask: Tensor, level: str, upper: float,
                lower: float | None) -> dict[str, float]:
    lower = 1.0 / upper if lower is None else lower
    m: dict[str, float] = {"rollout_is_mean": _masked_mean(weights, mask).item()}
    if level == "sequence":
        m["rollout_is_max"] = measured.max().clamp(max=_LIMIT).exp().item()
        m["rollout_is_min"] = measured.min().exp().item()
        m["rollout_is_ratio_fraction_high"] = (measured > math.log(upper)).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (measured < math.log(lower)).float().mean().item()
    else:
        m["rollout_is_ratio_fraction_high"] = _masked_mean((raw > upper).float(), mask).item()
        m["rollout_is_ratio_fraction_low"] = _masked_mean((raw < lower).float(), mask).item()
        on = mask.bool()
        m["rollout_is_max"] = weights.masked_fill(~on, float("-inf")).max().item()
        m["rollout_is_min"] = weights.masked_fill(~on, float("inf")).min().item()
    capped = weights.clamp(min=0.0, max=upper)
    mean = _masked_mean(capped, mask)
    m["rollout_is_std"] = (_masked_mean(capped.square(), mask) - mean.square()).clamp(min=0).sqrt().item() \
        if mask.sum() > 1 else 0.0
    m["rollout_is_eff_sample_size"] = 1.0 / _masked_mean((capped / (mean + 1e-8)).square(), mask).item()
    rows = _masked_mean(weights, mask, -1)
    m["rollout_is_seq_mean"] = rows.mean().item()
    m["rollout_is_seq_std"] = rows.std().item() if rows.numel() > 1 else 0.0
    m["rollout_is_seq_max"] = rows.max().item()
    m["rollout_is_seq_min"] = rows.min().item()
    m["rollout_is_seq_max_deviation"] = (rows - 1.0).abs().max().item()
    raw_rows = _masked_mean(raw, mask, -1)
    m["rollout_is_seq_fraction_high"] = (raw_rows > upper).float().mean().item()
    m["rollout_is_seq_fraction_low"] = (raw_rows < lower).float().mean().item()
    return m


def rejection_mask(old: Tensor, engine: Tensor, mask: Tensor, options: list[RejectionOption] | tuple, *,
                   measure: bool = True) -> tuple[Tensor, dict[str, float]]:
    """The mask with every token that an option rejects set to 0 (whole rows for sequence options), and verl's
    metrics: the shares rejected, rollout_rs_masked_fraction (tokens) and rollout_rs_seq_masked_fraction (rows with
    a token rejected), and per option its shares and its statistic's mean, extremes, spread and shares out of
    bounds (rollout_rs_<option>_mean, _max, _fraction_high, _seq_mean, ...); with measure=False without metrics,
    and without reading anything back to the host."""
    with torch.no_grad():
        s = (old - engine).clamp(-_LIMIT, _LIMIT)
        stats = {"k1": -s, "k2": 0.5 * s.square(), "k3": s.exp() - 1 - s}
        on = mask > 0
        rows = on.any(-1)
        keep_all = torch.ones_like(on)
        metrics: dict[str, float] = {}
        for opt in options:
            scope, _, kind = opt.option.rpartition("_")
            stat = stats[kind]
            per_row = None
            if scope == "token":
                value = stat
            elif scope == "seq_sum":
                per_row = _masked_sum(stat, mask)
            elif scope == "seq_mean":
                per_row = _masked_mean(stat, mask, -1)
            else:  # seq_max
                per_row = torch.where(on, stat, float("-inf")).max(-1).values
                per_row = torch.where(rows, per_row, 0.0)
            if per_row is not None:
                value = per_row.unsqueeze(-1).expand_as(stat)
            upper, lower = (math.log(opt.upper), math.log(opt.lower)) if kind == "k1" else (opt.upper, None)
            keep = value <= upper if lower is None else (value >= lower) & (value <= upper)
            keep = keep | ~on
            keep_all = keep_all & keep
            if not measure:
                continue
            name = f"rollout_rs_{opt.option}"
            metrics.update(_rs_metrics(name, value, per_row, mask, upper, lower))
            metrics[f"{name}_masked_fraction"] = _masked_mean((~keep).float(), mask).item()
            rejected_rows = (~keep & on).any(-1)
            metrics[f"{name}_seq_masked_fraction"] = \
                (rejected_rows & rows).float().sum().item() / max(rows.sum().item(), 1)
        if not measure:
            return (mask * keep_all).to(mask.dtype), metrics
        metrics["rollout_rs_masked_fraction"] = _masked_mean((~keep_all).float(), mask).item()
        metrics["rollout_rs_seq_masked_fraction"] = (~keep_all & on).any(-1).float().mean().item()
        return (mask * keep_all).to(mask.dtype), metrics


def _rs_metrics(name: str, value: Tensor, per_row: Tensor | None, mask: Tensor, upper: float,
                lower: float | None) -> dict[str, float]:
    """verl's statistics of one rejection option: `value` per token (a sequence option's broadcast over its row,
    `per_row` then its per-row values), `upper` and `lower` on the statistic's scale (k1: log)."""
    on, valid = mask.bool(), mask.sum(-1) > 0
    rows = (per_row if per_row is not None else _masked_mean(value, mask, -1))[valid]
    low = 0.0 if lower is None else lower
    m = {f"{name}_mean": _masked_mean(value, mask).item()}
    if per_row is not None and rows.numel():
        m[f"{name}_max"], m[f"{name}_min"] = rows.max().item(), rows.min().item()
        m[f"{name}_fraction_high"] = (rows > upper).float().mean().item()
        m[f"{name}_fraction_low"] = (rows < low).float().mean().item() if lower is not None else 0.0
    else:
        m[f"{name}_max"] = value.masked_fill(~on, float("-inf")).max().item()
        m[f"{name}_min"] = value.masked_fill(~on, float("inf")).min().item()
        m[f"{name}_fraction_high"] = _masked_mean((value > upper).float(), mask).item()
        m[f"{name}_fraction_low"] = _masked_mean((value < low).float(), mask).item() if lower is not None else 0.0
    if mask.sum() > 1:
        clamped = value.clamp(min=low, max=upper)
        mean = _masked_mean(clamped, mask)
        m[f"{name}_std"] = (_masked_mean(clamped.square(), mask) - mean.square()).clamp(min=0).sqrt().item()
    else:
        m[f"{name}_std"] = 0.0
    if rows.numel():
        m[f"{name}_seq_mean"] = rows.mean().item()
        m[f"{name}_seq_std"] = rows.std().item() if rows.numel() > 1 else 0.0
        m[f"{name}_seq_max"], m[f"{name}_seq_min"] = rows.max().item(), rows.min().item()
        m[f"{name}_seq_max_deviation"] = rows.abs().max().item()
        m[f"{name}_seq_fraction_high"] = (rows > upper).float().mean().item()
        if lower is not None:
            m[f"{name}_seq_fraction_low"] = (rows < low).float().mean().item()
    else:
        m.update(dict.fromkeys((f"{name}_seq_{key}" for key in ("mean", "std", "max", "min", "max_deviation",
                                                                  "fraction_high", "fraction_low")), 0.0))
    return m


def mismatch_metrics(old: Tensor, engine: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the engine's logprobs are from the trainer's (verl's off-policy metrics, unprefixed): the two
    perplexities, the KL estimators, the log-perplexity gap per sequence, chi-squared per token and sequence."""
    with torch.no_grad():
        log_ratio = old - engine
        trainer_row, engine_row = _masked_mean(old, mask, -1), _masked_mean(engine, mask, -1)
        gap = engine_row - trainer_row
        m = {"training_ppl": (-trainer_row).exp().mean().item(), "training_log_ppl": (-trainer_row).mean().item(),
             "kl": _masked_mean(engine - old, mask).item(),
             "k3_kl": _masked_mean(log_ratio.exp() - log_ratio - 1, mask).item(),
             "rollout_ppl": (-engine_row).exp().mean().item(), "rollout_log_ppl": (-engine_row).mean().item(),
             "log_ppl_diff": gap.mean().item(), "log_ppl_abs_diff": gap.abs().mean().item(),
             "log_ppl_diff_max": gap.max().item(), "log_ppl_diff_min": gap.min().item(),
             "ppl_ratio": gap.exp().mean().item()}
        clamped = log_ratio.clamp(-_LIMIT, _LIMIT)
        m["chi2_token"] = (_masked_mean(clamped.exp().square(), mask) - 1.0).item()
        row_sum = _masked_sum(log_ratio, mask).clamp(-_LIMIT, _LIMIT)
        m["chi2_seq"] = ((2 * row_sum).exp().mean() - 1.0).item()
        return m


@dataclass(frozen=True)
class Correction:
    """A run's correction, parsed: importance weights at `level` (None: none) with their bounds, the rejection
    options, and the mode: decoupled (old is the trainer's at the rollout weights) or bypass (old is the engine's;
    the PPO clip against it, or with `reinforce` the policy gradient weighted by the importance weights)."""

    level: str | None = None
    upper: float = 2.0
    lower: float | None = None
    batch_normalize: bool = False
    reject: tuple[RejectionOption, ...] = ()
    bypass: bool = False
    reinforce: bool = False

    @property
    def corrects(self) -> bool:
        """Whether anything accounts for the engine/trainer difference (the async rule wants one)."""
        return self.level is not None or bool(self.reject) or self.bypass

    def apply(self, old: Tensor, engine: Tensor, mask: Tensor, *, measure: bool = True
              ) -> tuple[Tensor | None, Tensor, dict[str, float]]:
        """verl's compute_rollout_correction_and_rejection_mask: the importance weights (None without a level), the
        mask less the rejected tokens, and the metrics (the mismatch metrics always; prefixed `rollout_corr/`)."""
        metrics: dict[str, float] = {}
        weights = None
        if self.level is not None:
            weights, found = importance_weights(old, engine, mask, self.level, self.upper, self.lower,
                                                self.batch_normalize, measure=measure)
            metrics.update(found)
        kept = mask
        if self.reject:
            kept, found = rejection_mask(old, engine, mask, self.reject, measure=measure)
            metrics.update(found)
        if measure:
            metrics.update(mismatch_metrics(old, engine, mask))
        return weights, kept, {f"rollout_corr/{k}": v for k, v in metrics.items()}
