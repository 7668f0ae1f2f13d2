"""trainer/maths/rollout_correction.py equals verl's rollout_corr_helper on the same tensors: every importance-
sampling level and bound (TIS, IcePop, batch-normalised), every rejection option alone and chained, the masks, and
the metrics both report (the off-policy mismatch metrics, the IS metrics, the shares rejected)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from trainer.maths.rollout_correction import (
    IS_LEVELS,
    RS_OPTIONS,
    importance_weights,
    mismatch_metrics,
    parse_bounds,
    parse_rejection,
    rejection_mask,
)

needs_verl = pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed")


def _batch(seed: int, spread: float = 0.3, b: int = 12, t: int = 20):
    """Trainer and engine logprobs of a batch of right-padded rows (no empty row), the engine off by `spread`."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    engine = old + spread * torch.randn(b, t, generator=g)
    lengths = torch.randint(3, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    old = torch.where(mask > 0, old, float("nan"))  # off the mask: never counted
    return old, engine, mask


def _close(ours: dict, theirs: dict):
    for key in sorted(ours):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key


@needs_verl
@pytest.mark.parametrize("level,threshold,normalize", [
    (level, threshold, normalize) for level in IS_LEVELS for threshold in (2.0, "1.5", "0.5_5.0", "0.8_1.2")
    for normalize in (False, True)])
def test_importance_weights_equal_verl_s(level, threshold, normalize):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    old, engine, mask = _batch(3, spread=0.2 if level == "token" else 0.05)
    old = torch.nan_to_num(old)
    theirs_w, theirs = compute_rollout_correction_weights(old - engine, mask, rollout_is=level,
                                                          rollout_is_threshold=threshold,
                                                          rollout_is_batch_normalize=normalize)
    upper, lower = parse_bounds(threshold)
    ours_w, ours = importance_weights(old, engine, mask, level, upper, lower, batch_normalize=normalize)
    assert torch.allclose(ours_w, theirs_w, atol=1e-6) and not ours_w.requires_grad
    assert sorted(ours) == sorted(theirs)
    _close(ours, theirs)


# bounds that reject some of _batch(5)'s tokens or rows and keep others, per statistic
_SOME = {"token_k1": "0.7_1.4", "seq_sum_k1": "0.7_1.4", "seq_mean_k1": "0.95_1.05", "token_k2": 0.02,
         "token_k3": 0.02, "seq_sum_k2": 0.5, "seq_sum_k3": 0.5, "seq_mean_k2": 0.045, "seq_mean_k3": 0.045,
         "seq_max_k2": 0.18, "seq_max_k3": 0.18}


@needs_verl
@pytest.mark.parametrize("options,thresholds", [
    *_SOME.items(), ("seq_mean_k1", 1.05), ("token_k1,seq_mean_k3", "0.8_1.25,0.045"),
    ("seq_sum_k2,seq_max_k3,token_k3", 0.5)])
def test_rejection_masks_equal_verl_s(options, thresholds):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    old, engine, mask = _batch(5)
    old = torch.nan_to_num(old)
    theirs_mask, theirs = compute_rollout_rejection_mask(old - engine, mask, rollout_rs=options,
                                                         rollout_rs_threshold=thresholds)
    ours_mask, ours = rejection_mask(old, engine, mask, parse_rejection(options, thresholds))
    assert torch.equal(ours_mask, theirs_mask)
    assert 0 < ours["rollout_rs_masked_fraction"] < 1  # some kept, some rejected: the test can tell
    _close(ours, theirs)


@needs_verl
@pytest.mark.parametrize("seed,spread", [(0, 0.01), (1, 0.3), (2, 2.0)])
def test_mismatch_metrics_equal_verl_s(seed, spread):
    from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics

    old, engine, mask = _batch(seed, spread)
    theirs = compute_offpolicy_metrics(torch.nan_to_num(old), engine, mask)
    ours = mismatch_metrics(old, engine, mask)  # NaN off the mask: never counted
    assert sorted(ours) == sorted(theirs)
    _close(ours, theirs)


@pytest.mark.parametrize("raw,message", [
    ("1.5_0.5", "lower bound 1.5 is above the upper 0.5"), (0, "positive"), ("x", "must be a number"),
    (True, "must be a number"), ("0.5_", "upper bound must be a number")])
def test_bad_bounds_are_named(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_bounds(raw)


@pytest.mark.parametrize("options,thresholds,message", [
    ("token_k4", 1.0, "unknown rejection option"), ("", 1.0, "name at least one"),
    ("token_k2", None, "need thresholds"), ("token_k1,token_k2", "1.2,0.1,3", "3 rejection thresholds for 2"),
    ("token_k2", "0.1_0.5", "upper bound only"), ("seq_mean_k1", 0.5, "lower bound 2 above the upper 0.5")])
def test_bad_rejection_options_are_named(options, thresholds, message):
    with pytest.raises(ValueError, match=message):
        parse_rejection(options, thresholds)


def test_every_option_has_bounds_in_the_equality_test():
    assert sorted(_SOME) == sorted(RS_OPTIONS)


def test_chained_options_keep_a_token_only_if_every_option_keeps_it():
    old, engine, mask = _batch(7)
    old = torch.nan_to_num(old)
    singles = [rejection_mask(old, engine, mask, parse_rejection(o, t))[0]
               for o, t in (("token_k1", "0.8_1.25"), ("seq_max_k2", 0.3))]
    chained, metrics = rejection_mask(old, engine, mask, parse_rejection("token_k1,seq_max_k2", "0.8_1.25,0.3"))
    assert torch.equal(chained, singles[0] * singles[1])
    assert metrics["rollout_rs_masked_fraction"] == pytest.approx(
        1 - chained.sum().item() / mask.sum().item(), abs=1e-6)
