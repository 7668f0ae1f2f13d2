"""Transparent mode on the real engine: `harness run --transparent` records a black-box agent with engine ids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support import db_rows

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "examples" / "blackbox_agent" / "agent.py"

def test_harness_run_transparent_records_a_black_box_agent_with_engine_ids(engine, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{k}", "question": f"{k} + 1?", "answer": str(k + 1),
                                         "vendor": vendor}) + "\n"
                             for k, vendor in enumerate(["openai", "dashscope"])))
    env = {**os.environ, "HARNESS_HOME": str(tmp_path / "home")}
    done = subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", str(AGENT), "--data", str(tasks), "--transparent",
         "--upstream", engine.base_url, "--run-dir", str(tmp_path / "run"), "--judge", "exact_match"],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = db_rows(tmp_path / "run" / "harness.duckdb",
                   "SELECT requested_model, stream, token_source, len(prompt_ids) > 0, "
                   "len(completion_ids) = len(logprobs) FROM calls JOIN choices USING (call_id) "
                   "ORDER BY requested_model, stream")
    assert rows == [("gpt-4o-mini", False, "engine", True, True), ("gpt-4o-mini", True, "engine", True, True),
                    ("qwen-plus", False, "engine", True, True), ("qwen-plus", True, "engine", True, True)]
    merged = db_rows(tmp_path / "run" / "harness.duckdb", "SELECT count(*) FROM samples")
    assert merged[0][0] >= 2
