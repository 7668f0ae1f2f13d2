"""Recorded episodes merged into stored training samples: after a run or a re-judge, and `harness merge` for
episodes recorded by `harness serve`. Each sample carries its episode's latest judgement as reward."""

from __future__ import annotations

from pathlib import Path

from harness.core.merge import Merged, merge_episode, summarise_merges
from harness.store.database import Store
from harness.store.live import discover


def merge_recorded(store: Store, run_id: str | None = None, *, chunk: int = 256) -> dict:
    """Merge every recorded episode of `run_id` (of every run when None) into samples stored under the episode's
    run, each with the episode's latest judgement as reward (None if not judged). Re-merging replaces what an
    earlier merge stored. Returns a summary: episodes, samples, merge ratio, drift rate, reasons histogram."""
    sql = "SELECT episode_id, run_id FROM episode_summary WHERE n_calls > 0"
    rows = store.query(sql + (" AND run_id = ?" if run_id else "") + " ORDER BY ALL", [run_id] if run_id else []).rows
    if run_id and not rows and not store.query("SELECT 1 FROM runs WHERE run_id = ? UNION ALL SELECT 1 FROM "
                                               "episode_summary WHERE run_id = ?", [run_id, run_id]).rows:
        raise ValueError(f"no run {run_id!r} in {store.path}: see `harness sql --db {store.path} "
                         '"SELECT run_id, started_at FROM runs"`')
    rewards = dict(store.query("SELECT episode_id, reward FROM judgements QUALIFY row_number() OVER "
                               "(PARTITION BY episode_id ORDER BY created_at DESC) = 1").rows)
    merged_all: list[Merged] = []
    for i in range(0, len(rows), chunk):  # a chunk's calls in memory at a time
        part = rows[i:i + chunk]
        calls = store.load_episodes_calls([episode_id for episode_id, _ in part])
        by_run: dict[str, list[tuple[str, Merged, float | None]]] = {}
        for episode_id, episode_run in part:
            merged = merge_episode(calls.get(episode_id, []))
            by_run.setdefault(episode_run, []).append((episode_id, merged, rewards.get(episode_id)))
            merged_all.append(merged)
        for episode_run, items in by_run.items():
            store.add_merged_episodes(episode_run, items)
    return summarise_merges(merged_all)


def merge_database(db_path: Path, run_id: str | None = None) -> dict:
    """`harness merge`: merge_recorded on a database file no proxy is recording into."""
    if not db_path.exists():
        raise ValueError(f"no database at {str(db_path)!r}: pass --db FILE or --run-dir DIR")
    live = discover(db_path)
    if live is not None:
        raise ValueError(f"a proxy ({live['url']}) is recording into {str(db_path)!r} and holds it open: stop it "
                         "(Ctrl-C), then run harness merge again")
    with Store.open(db_path) as store:
        return merge_recorded(store, run_id)
