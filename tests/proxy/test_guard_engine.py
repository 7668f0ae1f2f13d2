"""The degenerate-output guard on the real engine: degenerate episodes end, normal ones go on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import db_rows

ROOT = Path(__file__).resolve().parents[2]

def test_the_guard_ends_degenerate_episodes_and_leaves_normal_ones_alone(engine, tmp_path):
    """Four tasks, two of them degenerate (a pinned token), each episode four calls: the guard flags the degenerate
    replies (repetition), ends their episodes at once (the next call is refused, the agent fails), and flags
    nothing of the normal ones, which max_turns 3 cuts at their fourth call instead. Every cut is on its samples."""
    agent = ROOT / "tests/agents/degenerate.py"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"Tell me about {i}.", "degenerate": i % 2 == 1})
                             + "\n" for i in range(4)))
    out = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(agent), "--data", str(tasks),
                          "--upstream", engine.base_url, "--run-dir", str(tmp_path / "run"), "--max-turns", "3",
                          "--guard", "--guard-end-episode", "--concurrency", "4"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    db = tmp_path / "run" / "harness.duckdb"
    by_task = dict(db_rows(db, "SELECT o.task_id, list(f.reason || ':' || f.kind ORDER BY f.call_index, f.reason) "
                           "FROM episode_outcomes o JOIN flags f USING (episode_id) GROUP BY 1"))
    for task in ("t1", "t3"):  # the degenerate: its one reply cut at max_tokens and flagged, then refused
        assert by_task[task] == ["max_tokens:truncated", "repetition:degenerate", "guard:truncated"], by_task
    for task in ("t0", "t2"):  # the normal: no degenerate finding; refused at the fourth call
        assert "repetition:degenerate" not in by_task[task] and by_task[task][-1] == "max_turns:truncated", by_task
    status = dict(db_rows(db, "SELECT task_id, status FROM episode_outcomes"))
    assert status == {"t0": "crashed", "t1": "crashed", "t2": "crashed", "t3": "crashed"}  # each got a 400
    calls = dict(db_rows(db, "SELECT o.task_id, count(*) FILTER (WHERE c.status = 'ok') FROM episode_outcomes o "
                         "JOIN calls c USING (episode_id) GROUP BY 1"))
    assert calls == {"t0": 3, "t1": 1, "t2": 3, "t3": 1}
    # every sample that a cut call or choice is on says so
    missing = db_rows(db, """
        SELECT s.sample_id, f.reason FROM samples s JOIN flags f ON f.episode_id = s.episode_id
        WHERE f.kind = 'truncated' AND (f.choice_index IS NULL OR list_contains(s.call_ids, f.call_id))
          AND NOT list_contains(s.truncation, f.reason)""")
    assert missing == []
    assert db_rows(db, "SELECT count(*) FROM samples WHERE len(truncation) = 0") == [(0,)]
    [report] = [json.loads(p.read_text()) for p in (tmp_path / "run").glob("report-*.json")]
    flagged = report["flagged_episodes"]
    assert (flagged["degenerate:repetition"], flagged["truncated:guard"], flagged["truncated:max_turns"]) == (2, 2, 2)
    assert "episodes flagged" in out.stdout
