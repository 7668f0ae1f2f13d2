"""Several engines behind one proxy (proxy/upstreams.py): an episode's calls stay on one engine, new episodes spread
over the engines, and an engine that goes away mid-run hands its episodes to the others without the agent seeing
an error. The engines are scripted (real HTTP servers), so the test can stop one."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from openai import OpenAI

from harness.running.vllm_server import placement, start_vllm
from proxy.upstreams import Engines
from tests.support import RunningProxy, ScriptedUpstream, db_rows
from trainer.weight_sync import WeightSync

ROOT = Path(__file__).resolve().parents[1]


def _turns(proxy_url: str, episode: str, n: int) -> None:
    client = OpenAI(base_url=f"{proxy_url}/e/{episode}/v1", api_key="sk-x", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    for _ in range(n):
        reply = client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=4)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "more"}]


def test_episodes_stick_to_an_engine_and_move_when_it_goes_away(tmp_path):
    a, b = ScriptedUpstream(), ScriptedUpstream()
    proxy = RunningProxy(a.url, tmp_path / "rec.duckdb", more_upstreams=(b.url + "/v1",))
    try:
        for k in range(4):
            _turns(proxy.url, f"ep{k}", 2)
        assert len(a.engine.requests) == len(b.engine.requests) == 4  # two episodes each, both turns on one engine
        a.close()  # engine a goes away between turns
        for k in range(4):
            _turns(proxy.url, f"ep{k}", 1)  # a re-sent conversation: a's episodes continue on b
        _turns(proxy.url, "late", 2)
    finally:
        proxy.close()
        b.close()
    rows = db_rows(proxy.db_path, "SELECT episode_id, call_index, extra->>'engine', extra->'engine_failover', status "
                   "FROM calls ORDER BY episode_id, call_index")
    assert all(status == "ok" for *_, status in rows)  # the agents never saw the failure
    engine_of = {}
    for episode, index, engine, _, _ in rows:
        if index < 2:
            engine_of.setdefault(episode, set()).add(engine)
    assert all(len(engines) == 1 for engines in engine_of.values())  # affinity
    a_base, b_base = a.url, b.url
    moved = [(e, f) for e, i, engine, f, _ in rows if i == 2 and engine_of[e] == {a_base}]
    assert len(moved) == 2  # a's two episodes: the first call to find a down is retried on b (and says so), the
    assert [a_base in (f or "") for _, f in moved] == [True, False]  # next goes to b at once
    assert {engine for e, i, engine, *_ in rows if i == 2} == {b_base}
    assert {engine for e, _, engine, *_ in rows if e == "late"} == {b_base}


def test_a_server_error_fails_over_only_when_the_engine_is_sick(tmp_path):
    """A 500 from an engine whose /health fails (a dying vLLM) moves the call; a 500 from a healthy engine is the
    request's own trouble and reaches the agent."""
    a, b = ScriptedUpstream(), ScriptedUpstream()
    proxy = RunningProxy(a.url, tmp_path / "rec.duckdb", more_upstreams=(b.url,))
    try:
        client = OpenAI(base_url=f"{proxy.url}/e/ep-a/v1", api_key="sk-x", max_retries=0)
        ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        client.chat.completions.create(**ask)  # ep-a lives on a
        a.script.status = 500
        with pytest.raises(Exception, match="502"):
            client.chat.completions.create(**ask)  # a is healthy: its error is the answer
        a.script.healthy = False
        client.chat.completions.create(**ask)  # a is dying: b answers
    finally:
        proxy.close()
        a.close()
        b.close()
    rows = db_rows(proxy.db_path, "SELECT status, extra->>'engine', extra->'engine_failover' FROM calls "
                   "ORDER BY call_index")
    assert rows == [("ok", a.url, None), ("error", a.url, None), ("ok", b.url, f'["{a.url}"]')]


def test_one_engine_is_a_constant_and_all_down_still_tries():
    one = Engines(("http://e1",))
    assert one.pick("x") == "http://e1" and not one.mark_down("http://e1", "gone")
    two = Engines(("http://e1", "http://e2"), retry_after_s=60)
    assert [two.pick(f"ep{k}") for k in range(4)] == ["http://e1", "http://e2", "http://e1", "http://e2"]
    assert two.mark_down("http://e1", "refused") is True
    assert two.pick("ep0") == "http://e2" and two.episodes == {"http://e1": 1, "http://e2": 3}
    assert two.mark_down("http://e2", "refused") is False  # nothing left to retry on
    assert two.pick("new") == "http://e1"  # all down: the one down longest is tried anyway


def test_engines_started_side_by_side_get_their_own_part_of_the_machine():
    assert placement(0, 2, 0, [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert placement(1, 2, 0, [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    four = [placement(k, 2, 0, [0, 1, 2, 3])["VLLM_CPU_OMP_THREADS_BIND"] for k in range(2)]
    assert four == ["0", "1,2"]  # core 3 is left to the API servers, the proxy and the agents
    assert [placement(k, 3, 0, [4, 5])["VLLM_CPU_OMP_THREADS_BIND"] for k in range(3)] == ["4", "5", "4"]
    assert placement(1, 2, 2, [0, 1]) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert placement(1, 2, 1, [0, 1]) == {}  # one GPU for two engines: they share it
    with pytest.raises(ValueError, match="engine 2 of 2"):
        placement(2, 2, 0, [0, 1])


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


@pytest.mark.engine
def test_the_second_engine_computes_on_its_own_core(engine, second):
    bound = [line for line in second.log_path.read_text(errors="replace").splitlines() if "core ids=" in line]
    assert bound and bound[0].endswith("core ids=[1]"), bound


@pytest.mark.engine
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


@pytest.mark.engine
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
        # B dies (SIGKILL, as a crash) once it has answered a call (its access log says so), most often with that
        # episode's next call in flight (the scripted test above moves a call deterministically)
        while run.poll() is None and _answered(second.log_path) == before:
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
