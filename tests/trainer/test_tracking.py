"""Where training metrics go: DuckDB (always), the curve PNG, and swanlab (local) / wandb (offline) when enabled."""

from __future__ import annotations

import pytest

from harness.store.database import Store
from trainer.rl.tracking import Tracker


def test_metrics_reach_duckdb_the_curve_and_the_offline_trackers(tmp_path, monkeypatch):
    import swanlab  # noqa: F401 - the track extra, which make install brings
    import wandb  # noqa: F401
    monkeypatch.setenv("WANDB_SILENT", "true")
    store = Store.open(tmp_path / "harness.duckdb")
    try:
        tracker = Tracker(store, "run-1", tmp_path, project="p", experiment="e", config={"trainer": {"lr": 0.1}},
                          console=True, curve_png=True, swanlab=True, wandb=True)
        assert [name for name, _ in tracker.backends] == ["swanlab", "wandb"]
        for step in (1, 2):
            tracker.log(step, {"reward/mean": 0.1 * step, "actor/kl": None, "actor/entropy": 7.0 - step,
                               "response/length_mean": float("nan")})
        tracker.close()
        rows = store.query("SELECT step, name, value FROM metrics ORDER BY step, name").rows
        curve = store.query("SELECT step, reward_mean, kl, entropy FROM training_curve ORDER BY step").rows
    finally:
        store.close()
    assert ("actor/kl" in {r[1] for r in rows}) and all(v is None for _, n, v in rows if n == "actor/kl")
    assert [r for r in rows if r[1] == "response/length_mean"] == [(1, "response/length_mean", None),
                                                                  (2, "response/length_mean", None)]
    assert curve == [(1, pytest.approx(0.1), None, 6.0), (2, pytest.approx(0.2), None, 5.0)]
    assert (tmp_path / "curve.png").stat().st_size > 1000
    assert any((tmp_path / "swanlab").rglob("*")), "swanlab wrote nothing in local mode"
    assert any(p.name.startswith("offline-run") for p in (tmp_path / "wandb").iterdir())


def test_a_broken_tracker_is_switched_off_not_fatal(tmp_path, caplog):
    store = Store.open(tmp_path / "harness.duckdb")
    try:
        tracker = Tracker(store, "run-1", tmp_path, project="p", experiment="e", config={}, console=False,
                          curve_png=False)

        class Broken:
            def log(self, metrics, step):
                raise RuntimeError("disk full")

            def finish(self):
                raise RuntimeError("still full")

        tracker.backends.append(("broken", Broken()))
        tracker.log(1, {"reward/mean": 0.5})
        tracker.log(2, {"reward/mean": 0.6})
        tracker.close()
        assert tracker.backends == []
        assert store.query("SELECT count(*) FROM metrics").rows == [(2,)]
    finally:
        store.close()
    assert "broken logging failed and is now off: disk full" in caplog.text
