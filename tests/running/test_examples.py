"""Every example agent, unmodified, through `harness run`: against the real engine (engine tier), and the tool loop
against a scripted engine that always asks for a tool (fast tier).
The tests on the real engine are in test_examples_engine.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import db_rows

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def harness_run(tmp_path: Path, upstream: str, example: str, *extra: str, agent: list[str] | None = None,
                limit: int = 3, repeat: int = 2) -> tuple[Path, dict]:
    run_dir = tmp_path / example
    target = ["--cmd", " ".join(agent)] if agent else [str(EXAMPLES / example / "agent.py")]
    out = subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", *target, "--data", str(EXAMPLES / example / "tasks.jsonl"),
         "--judge", "math", "--repeat", str(repeat), "--limit", str(limit), "--upstream", upstream,
         "--run-dir", str(run_dir), "--concurrency", "3", "--timeout", "240", *extra],
        capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mean reward" in out.stdout
    [report] = run_dir.glob("report-*.json")
    return run_dir / "harness.duckdb", json.loads(report.read_text())


def _episodes(db: Path) -> dict[str, list[tuple]]:
    """episode -> its calls (call_index, status, requested_model, role_key, stream), in order."""
    rows = db_rows(db, "SELECT o.episode_id, o.status, c.call_index, c.status, c.requested_model, c.role_key, "
                   "c.stream FROM episode_outcomes o JOIN calls c USING (episode_id) ORDER BY 1, 3")
    out: dict[str, list[tuple]] = {}
    for episode, outcome, *call in rows:
        assert outcome == "finished", (episode, outcome)
        out.setdefault(episode, []).append(tuple(call))
    return out


def test_math_agent_tool_loop_on_an_engine_that_always_calls_a_tool(upstream, tmp_path):
    upstream.script.tool_arguments = '{"expression": "6*7"}'  # a call of tool "lookup", which the agent lacks
    db, report = harness_run(tmp_path, upstream.url, "math_agent", limit=1, repeat=1)
    [(episode, calls)] = _episodes(db).items()
    assert len(calls) == 4  # the loop's cap
    last_request = json.loads(db_rows(db, "SELECT request FROM calls WHERE episode_id = ? AND call_index = 3",
                                      [episode])[0][0])
    tool_results = [m for m in last_request["messages"] if m["role"] == "tool"]
    assert len(tool_results) == 3 and all(m["content"].startswith("error") for m in tool_results)


# --- examples/arithmetic_agent: the real-model learning example (examples/train/arithmetic.yaml) -------------------


def _arithmetic_judge():
    from harness.running.judges import load_judge

    return load_judge(f"{EXAMPLES / 'arithmetic_agent' / 'judge.py'}:bare_number")


def test_the_arithmetic_judge_gives_full_reward_to_the_right_number_alone():
    judge, task = _arithmetic_judge(), {"id": "7+5", "question": "What is 7 + 5?", "answer": "12"}
    score = {text: judge.fn(task, text, [])["reward"] for text in
             ("12", " 12.\n", "7 + 5 = 12", "The answer is 12.", "13", "The answer is 13.", "", "twelve")}
    assert score["12"] == score[" 12.\n"] == 1.0
    assert all(score[t] < 1.0 for t in score if t.strip().rstrip(".") != "12")
    # right beats wrong at the same length; shorter beats longer when both are right; the equation stays below 1.0
    assert score["The answer is 12."] > score["The answer is 13."] and score["12"] > score["7 + 5 = 12"] > \
        score["The answer is 12."] > score["13"] > score[""] == 0.0
    assert score["7 + 5 = 12"] <= 0.8  # right scores >= 0.5, wrong <= 0.4: success_threshold 0.5 counts right answers
    assert min(score["The answer is 12."], score["7 + 5 = 12"]) >= 0.5 > 0.4 >= score["13"]


def test_the_arithmetic_validation_sums_are_held_out():
    """No pair of numbers in a validation sum appears, in either order, in a training sum."""
    def pairs(name: str) -> set[frozenset]:
        rows = [json.loads(line) for line in (EXAMPLES / "arithmetic_agent" / name).read_text().splitlines()]
        for row in rows:
            a, b = (int(x) for x in row["question"].removeprefix("What is ").rstrip("?").split(" + "))
            assert int(row["answer"]) == a + b and row["id"] == f"{a}+{b}"
        return {frozenset(row["id"].split("+")) for row in rows}

    train, validation = pairs("train.jsonl"), pairs("validation.jsonl")
    assert len(validation) >= 16 and len(train) >= 3 * len(validation)
    assert not train & validation
