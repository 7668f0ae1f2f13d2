"""Every example agent, unmodified, through `harness run`: against the real engine (engine tier), and the tool loop
against a scripted engine that always asks for a tool (fast tier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.core.merge import merge_episode
from harness.store.database import Store
from tests.support import db_rows

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
AGENTS_PYTHON = ROOT / ".venv-agents" / "bin" / "python"  # agentscope lives apart from the harness (make install)


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


@pytest.mark.engine
@pytest.mark.parametrize("example, calls", [("math_agent", (1, 4)), ("http_agent", (2, 2)),
                                            ("multi_agent", (3, 3))])
def test_example_runs_unmodified_on_the_engine(engine, tmp_path, example, calls):
    db, report = harness_run(tmp_path, engine.base_url, example)
    episodes = _episodes(db)
    assert len(episodes) == 6 and report["episodes"] == 6 and report["judged"] == 6
    for episode_calls in episodes.values():
        assert calls[0] <= len(episode_calls) <= calls[1]
        assert all(c[1] == "ok" for c in episode_calls)
    assert db_rows(db, "SELECT count(*) FROM choices JOIN calls USING (call_id) WHERE token_source = 'engine' "
                   "AND len(completion_ids) = len(logprobs) AND len(completion_ids) > 0")[0][0] == sum(
                       len(v) for v in episodes.values())
    if example == "multi_agent":  # solver, critic, solver: two roles told apart without annotations
        for episode_calls in episodes.values():
            models = [c[2] for c in episode_calls]
            keys = [c[3] for c in episode_calls]
            assert models == ["gpt-4o-mini", "critic-model", "gpt-4o-mini"]
            assert keys[0] == keys[2] != keys[1]
    if example == "http_agent":
        assert all(not c[4] for v in episodes.values() for c in v)
    if example == "math_agent":
        # The first call must call the calculator; only a reply cut off mid-call (max_tokens) ends an episode there.
        assert sum(len(v) >= 2 for v in episodes.values()) >= 2
        _check_one_sequence_per_episode(db, episodes)


def _check_one_sequence_per_episode(db: Path, episodes: dict) -> None:
    """Token-exact continuity: each episode's calls extend each other and merge into one sequence whose ids are
    the recorded ids and whose mask marks exactly the sampled tokens."""
    with Store.open(db, read_only=True) as store:
        for episode in episodes:
            calls = store.load_calls(episode)
            assert [c.extra["continuity"]["mode"] for c in calls][1:] == ["token_exact"] * (len(calls) - 1)
            merged = merge_episode(calls)
            (sample,) = merged.samples
            assert [b.reason for b in merged.breaks] == ["first_call"]
            last = calls[-1]
            assert sample.token_ids == last.prompt_ids + last.choices[0].completion_ids
            mask = [0] * len(sample.token_ids)
            for call in calls:
                ids = call.choices[0].completion_ids
                start = len(call.prompt_ids)
                assert sample.token_ids[start:start + len(ids)] == ids
                mask[start:start + len(ids)] = [1] * len(ids)
            assert sample.loss_mask == mask
            stored = store.query("SELECT token_ids, loss_mask, reward FROM samples WHERE episode_id = ?",
                                 [episode]).rows
            assert [(list(t), list(m)) for t, m, _ in stored] == [(sample.token_ids, sample.loss_mask)]
            assert stored[0][2] is not None  # the reward slot holds the episode's judgement
        [(ratio, drift)] = store.query("SELECT merge_ratio, drift_rate FROM merge_metrics").rows
        assert ratio > 1.0 and drift == 0.0


@pytest.mark.engine
def test_agentscope_react_agent_runs_unmodified(engine, tmp_path):
    if not AGENTS_PYTHON.exists():
        if os.environ.get("CI"):
            raise AssertionError(f"{AGENTS_PYTHON} is missing: `make install` creates it")
        pytest.skip("agentscope's venv is missing (make install creates .venv-agents)")
    agent = [str(AGENTS_PYTHON), str(EXAMPLES / "agentscope_agent" / "agent.py")]
    db, report = harness_run(tmp_path, engine.base_url, "agentscope_agent", agent=agent, limit=2)
    episodes = _episodes(db)
    assert len(episodes) == 4 and report["judged"] == 4
    for episode_calls in episodes.values():
        assert 1 <= len(episode_calls) <= 4
        assert all(c[1] == "ok" and c[4] for c in episode_calls)  # AgentScope always streams


def test_math_agent_tool_loop_on_an_engine_that_always_calls_a_tool(upstream, tmp_path):
    upstream.script.tool_arguments = '{"expression": "6*7"}'  # a call of tool "lookup", which the agent lacks
    db, report = harness_run(tmp_path, upstream.url, "math_agent", limit=1, repeat=1)
    [(episode, calls)] = _episodes(db).items()
    assert len(calls) == 4  # the loop's cap
    last_request = json.loads(db_rows(db, "SELECT request FROM calls WHERE episode_id = ? AND call_index = 3",
                                      [episode])[0][0])
    tool_results = [m for m in last_request["messages"] if m["role"] == "tool"]
    assert len(tool_results) == 3 and all(m["content"].startswith("error") for m in tool_results)
