"""trainer/maths/rollout_correction.py equals verl's rollout_corr_helper on the same tensors: every importance-
sampling level and bound (TIS, IcePop, batch-normalised), every rejection option alone and chained, the masks, and
the metrics both report (the off-policy mismatch metrics, the IS metrics, the shares rejected)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from trainer.maths.rollout_correction import (
    IS_LEVELS,
    RS_OPTIONS,
    Correction,
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
    assert sorted(ours) == sorted(theirs)  # every metric verl reports, and no other
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


# ---------------------------------------------------------------------------------------------- the whole correction


@needs_verl
@pytest.mark.parametrize("settings", [
    {"rollout_is": "token", "rollout_is_threshold": 2.0},
    {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0", "rollout_rs": "seq_mean_k3",
     "rollout_rs_threshold": 0.045},
    {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True,
     "rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": "0.7_1.4,0.18"},
    {"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.7_1.4"},
    {}])
def test_a_correction_equals_verl_s_unified_function(settings):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    old, engine, mask = _batch(5, spread=0.1)
    old = torch.nan_to_num(old)
    proto, theirs_mask, theirs = compute_rollout_correction_and_rejection_mask(old, engine, mask, **settings)
    ours_w, ours_mask, ours = _correction(settings).apply(old, engine, mask)
    assert (ours_w is None) == (proto is None)
    if proto is not None:
        assert torch.allclose(ours_w, proto.batch["rollout_is_weights"], atol=1e-6)
    assert torch.equal(ours_mask, theirs_mask)
    assert sorted(ours) == sorted(theirs)
    assert "rollout_corr/kl" in ours and ("rollout_rs" not in settings or "rollout_corr/rollout_rs_masked_fraction"
                                           in ours)
    _close(ours, theirs)


def _correction(settings: dict) -> Correction:
    upper, lower = parse_bounds(settings.get("rollout_is_threshold", 2.0))
    reject = settings.get("rollout_rs")
    return Correction(settings.get("rollout_is"), upper, lower, settings.get("rollout_is_batch_normalize", False),
                      tuple(parse_rejection(reject, settings["rollout_rs_threshold"])) if reject else ())


def test_the_loop_s_correction_is_the_whole_batch_s_per_row_and_per_lag():
    """trainer/rl/correction.py's `correct_rows`: the step's rows padded into one batch, corrected once (as verl does
    before the advantages): each row gets its share of the batch's weights and mask, a row nothing rejected keeps
    its mask (None), and with lags the mismatch of each lag's rows alone."""
    from harness.core.records import Sample
    from trainer.rl.correction import correct_rows

    old, engine, mask = _batch(5, spread=0.1)
    old = torch.nan_to_num(old)
    lengths = mask.sum(-1).int().tolist()
    rows = []
    for i, n in enumerate(lengths):  # a two-token prompt, then the row's sampled tokens
        rows.append(Sample(f"e{i}", "r", ["c"], [0], list(range(n + 2)), [0, 0] + [1] * n,
                           [0.0, 0.0] + engine[i, :n].tolist()))
    old_rows = [torch.cat([torch.zeros(2), old[i, :n]]) for i, n in enumerate(lengths)]
    correction = _correction({"rollout_is": "token", "rollout_is_threshold": "0.5_5.0", "rollout_rs": "seq_mean_k3",
                              "rollout_rs_threshold": 0.0045})
    lags = [i % 2 for i in range(len(rows))]
    masks, weights, metrics = correct_rows(rows, old_rows, correction, lags)

    want_w, want_mask, want = correction.apply(old, engine, mask)
    for i, n in enumerate(lengths):
        assert torch.equal(weights[i], torch.cat([torch.zeros(2), want_w[i, :n]]))
        kept = [0, 0] + want_mask[i, :n].int().tolist()
        assert masks[i] == (None if kept == rows[i].loss_mask else kept)
    assert any(m is None for m in masks) and any(m is not None for m in masks)  # some rows rejected, some kept
    for key, value in want.items():  # the rows sit two prompt tokens later: float32 sums in another order
        assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert sorted(k for k in metrics if "/lag" not in k) == sorted([*want, "rollout_corr/rollout_is_q05",
                                                                    "rollout_corr/rollout_is_q50",
                                                                    "rollout_corr/rollout_is_q95"])
    on = want_w[mask > 0].double()
    for q in (5, 50, 95):
        assert metrics[f"rollout_corr/rollout_is_q{q:02d}"] == pytest.approx(on.quantile(q / 100).item(), abs=1e-6)
    assert metrics["rollout_corr/rollout_is_q05"] < metrics["rollout_corr/rollout_is_q95"]
    for lag in (0, 1):
        idx = [i for i in range(len(rows)) if lags[i] == lag]
        alone = mismatch_metrics(old[idx], engine[idx], mask[idx])
        assert metrics[f"rollout_corr/lag{lag}/kl"] == pytest.approx(alone["kl"], abs=1e-6)
        assert metrics[f"rollout_corr/lag{lag}/tokens"] == mask[idx].sum().item()
        assert metrics[f"rollout_corr/lag{lag}/rollout_rs_masked_fraction"] == pytest.approx(
            1 - want_mask[idx].sum().item() / mask[idx].sum().item(), abs=1e-6)


@needs_verl
@pytest.mark.parametrize("loss", ["reinforce", "ppo_clip"])
def test_bypass_mode_weights_and_masks_against_the_weights_being_trained(tiny_model_dir, loss):
    """trainer.correction.mode bypass: the engine's logprobs are old; the importance weights and the rejection mask
    are verl's, taken between the logprobs of the weights being trained and the engine's (verl's bypass loss),
    inside the update. reinforce: the gradient of -A x logprob x weight over the kept tokens; ppo_clip: the PPO
    loss against the engine's logprobs over the kept tokens (the weights only measured)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    from harness.core.records import Sample
    from trainer.config import load_config
    from trainer.maths import algorithms as algo
    from trainer.model.fsdp import init_distributed
    from trainer.model.policy import collate, load_policy, micro_batches, padded, token_logprobs
    from trainer.rl.update import mini_batch

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "examples/train/terse.yaml", [
        "model.path=/nowhere", "trainer.layout=padded", "trainer.micro_batch_tokens=40", "rollout.temperature=0.7",
        "trainer.correction.mode=bypass", f"trainer.correction.loss={loss}", "trainer.correction.level=token",
        "trainer.correction.threshold=0.5_5.0", "trainer.correction.reject=token_k1",
        "trainer.correction.reject_threshold=0.85_1.2"])
    dist = init_distributed(device="cpu")
    model = load_policy(tiny_model_dir)
    model.eval()
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 3), (13, 4), (10, 5), (16, 3), (9, 2), (12, 6)]  # (tokens, prompt tokens)
    plain = [Sample(f"e{i}", "r", ["c"], [0], torch.randint(5, 200, (n,), generator=g).tolist(),
                    [0] * p + [1] * (n - p), [0.0] * n) for i, (n, p) in enumerate(shapes)]
    batch = collate(plain, 0)
    mask = batch.loss_mask
    with torch.no_grad():
        trained, _ = token_logprobs(model, batch, 0.7, loss_only=True)
    engine = (trained + 0.15 * torch.randn(trained.shape, generator=g)) * mask  # the engine sampled a bit otherwise
    rows = [Sample(r.episode_id, "r", ["c"], [0], r.token_ids, r.loss_mask, engine[i, :len(r.token_ids)].tolist())
            for i, r in enumerate(plain)]
    advantages = [0.5, -1.0, 0.25, 1.0, -0.5, 0.75]
    weights = algo.token_weights(rows, cfg.trainer.loss_agg_mode)
    assert len(micro_batches(rows, 40)) >= 2
    old = [torch.tensor(r.logprobs) for r in rows]

    stats, _ = mini_batch(model, rows, advantages, old, [None] * len(rows), weights, rows[0], 0, cfg, dist)
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    batch = collate(rows, 0)
    logprobs, _ = token_logprobs(model, batch, 0.7, loss_only=True)
    proto, kept, theirs = compute_rollout_correction_and_rejection_mask(
        logprobs.detach(), batch.engine_logprobs, mask, rollout_is="token", rollout_is_threshold="0.5_5.0",
        rollout_rs="token_k1", rollout_rs_threshold="0.85_1.2")
    assert 0 < theirs["rollout_corr/rollout_rs_masked_fraction"] < 0.5
    adv = torch.tensor(advantages)[:, None] * mask
    if loss == "reinforce":
        losses = -adv * logprobs * proto.batch["rollout_is_weights"]
    else:
        losses, _ = algo.ppo_token_losses(logprobs, batch.engine_logprobs, adv, clip_low=cfg.trainer.clip_low,
                                          clip_high=cfg.trainer.clip_high, dual_clip=cfg.trainer.dual_clip)
    (losses * padded(weights, mask) * kept).sum().backward()
    for a, b in zip(ours, [p.grad for p in model.parameters()], strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    for key in ("kl", "k3_kl", "rollout_rs_masked_fraction", "rollout_is_mean"):
        assert stats[f"rollout_corr/{key}"].item() == pytest.approx(theirs[f"rollout_corr/{key}"], rel=1e-4), key
