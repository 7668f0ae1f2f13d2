"""`harness export --records tokens` of a run on the real engine: its records are the engine's sampled tokens."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.store.test_export import _export
from tests.support import TERSE, db_rows


def test_token_records_of_a_run_on_the_real_engine_are_its_sampled_tokens(engine, tmp_path):
    """Through vLLM serving the tiny model: the exported tokens under mask 1 are exactly the ids the engine
    sampled, call by call, with its logprobs."""
    out = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(TERSE / "agent.py"), "--data",
                          str(TERSE / "tasks.jsonl"), "--limit", "2", "--judge", f"{TERSE / 'judge.py'}:terse",
                          "--repeat", "2", "--upstream", engine.base_url, "--run-dir", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    db = tmp_path / "r" / "harness.duckdb"
    (run_id,), = db_rows(db, "SELECT DISTINCT run_id FROM episode_outcomes")
    rl = tmp_path / "rl.jsonl"
    done = _export(db, "--run", run_id, "--records", "tokens", "--out", str(rl))
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in rl.read_text().splitlines()]
    assert len(records) == db_rows(db, "SELECT count(*) FROM samples")[0][0] > 0
    for record in records:
        sampled = db_rows(db, "SELECT ch.completion_ids, ch.logprobs FROM calls c JOIN choices ch USING (call_id) "
                          "WHERE c.call_id IN (SELECT unnest(call_ids) FROM samples WHERE sample_id = ?) "
                          "ORDER BY c.call_index", [record["sample_id"]])
        trained = [t for t, m in zip(record["token_ids"], record["loss_mask"], strict=True) if m]
        assert trained == [t for ids, _ in sampled for t in ids]
        assert [lp for lp, m in zip(record["logprobs"], record["loss_mask"], strict=True) if m] == \
            pytest.approx([lp for _, lps in sampled for lp in lps])
