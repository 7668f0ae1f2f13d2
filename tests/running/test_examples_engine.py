"""Every example agent, unmodified, through `harness run` against the real engine (AgentScope's ReAct agent too)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.core.merge import merge_episode
from harness.store.database import Store
from tests.running.test_examples import _episodes, harness_run
from tests.support import db_rows

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

AGENTS_PYTHON = ROOT / ".venv-agents" / "bin" / "python"  # agentscope lives apart from the harness (make install)


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
