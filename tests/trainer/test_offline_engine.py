"""Rejection-sampling fine-tuning on a run recorded on the real engine raises the demo's reward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support import TERSE, db_rows, long_run
from tests.trainer.test_offline import _cli, _metric, _record
from trainer.model.weight_sync import WeightSync

TERSE_YAML = Path(__file__).resolve().parents[2] / "examples" / "train" / "terse.yaml"

def _likelier(db: Path, run_id: str, before: Path, after: Path) -> dict[str, float]:
    """Mean change of the sampled tokens' logprob from `before` to `after`, over the episodes above their task's
    mean reward (better) and below it (worse)."""
    from harness.store.database import Store
    from trainer.model.policy import collate, load_policy, token_logprobs

    rows = db_rows(db, "WITH r AS (SELECT episode_id, o.task_id, arg_max(j.reward, j.created_at) reward FROM "
                   "judgements j JOIN episode_outcomes o USING (episode_id) GROUP BY ALL) SELECT episode_id, "
                   "reward - avg(reward) OVER (PARTITION BY task_id) FROM r")
    side = {e: "better" if a > 1e-9 else "worse" if a < -1e-9 else None for e, a in rows}
    with Store.open(db, read_only=True) as store:
        samples = [s for s in store.load_samples(run_id) if side[s.episode_id]]
    models = [load_policy(path).eval() for path in (before, after)]
    change: dict[str, list[float]] = {"better": [], "worse": []}
    with torch.no_grad():
        for sample in samples:
            batch = collate([sample], 0)
            lp = [token_logprobs(m, batch, 1.0, loss_only=True)[0] for m in models]
            change[side[sample.episode_id]].append(float(((lp[1] - lp[0]) * batch.loss_mask).sum()
                                                         / batch.loss_mask.sum()))
    return {k: sum(v) / len(v) for k, v in change.items()}


@long_run  # two minutes of learning: make test-long (from-run training itself is in tests/trainer/test_offline.py)
def test_rejection_sampling_fine_tuning_on_a_recorded_run_raises_the_demo_reward(engine, tiny_model_dir, tmp_path):
    """The demo task (examples/terse_agent) recorded on vLLM serving the tiny model; `--from-run` SFT on its
    rewarded episodes, validated by the agent on the same engine before and after (fixed seeds): the loss on the
    kept episodes falls and the judge's reward rises. Then pg on the whole run: the first step's ratio is 1 (the
    trainer agrees with vLLM's stored logprobs), and the update makes the better episodes' tokens likelier than the
    worse ones'."""
    db, run_id = _record(tmp_path / "rec", engine.base_url, f"{TERSE / 'judge.py'}:terse", limit=16, repeat=4)
    rewards = sorted(r for r, in db_rows(db, "SELECT reward FROM judgements"))
    threshold = rewards[int(0.8 * len(rewards))]  # the best 20%
    common = (f"--from-run={run_id}", f"--db={db}", f"--set=rollout.engine.url={engine.base_url}",
              "--set=rollout.seed=0", "--set=trainer.seed=0")
    try:
        sft = _cli("train", tiny_model_dir, tmp_path / "sft", *common, f"--where=reward >= {threshold}",
                   "--set=offline.epochs=20", "--set=offline.batch_size=4", "--set=trainer.lr=3e-3",
                   f"--set=data.validation={TERSE / 'tasks.jsonl'}", "--set=data.validation_split=train",
                   "--set=rollout.validation.n=2", "--set=rollout.validation.temperature=1.0",
                   "--set=trainer.val_before_train=true", "--set=trainer.test_freq=1000", timeout=900)
        assert sft.returncode == 0, sft.stderr[-3000:]
    finally:
        WeightSync(engine.base_url, tmp_path / "restore").load(tiny_model_dir, 0)  # the session engine as it was
    nll, reward = _metric(tmp_path / "sft", "offline/data_nll"), _metric(tmp_path / "sft", "val/reward_mean")
    first, last = min(nll), max(nll)
    assert nll[last] < 0.8 * nll[first]
    assert sorted(reward) == [0, last]
    assert reward[last] > reward[0] + 0.05, reward  # measured: 0.27 -> 0.37

    pg = _cli("train", tiny_model_dir, tmp_path / "pg", *common, "--set=offline.loss=pg", "--set=offline.epochs=2",
              "--set=offline.batch_size=16", "--set=trainer.lr=1e-3")
    assert pg.returncode == 0, pg.stderr[-3000:]
    assert _metric(tmp_path / "pg", "actor/ratio_mean")[1] == pytest.approx(1.0, abs=1e-3)
    assert _metric(tmp_path / "pg", "logprob/behaviour_mean_abs_diff")[1] < 1e-3
    gain = _likelier(db, run_id, tiny_model_dir, tmp_path / "pg" / "offline" / "hf")
    assert gain["better"] > gain["worse"], gain
