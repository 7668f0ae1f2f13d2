"""`harness view` (harness/viewer/app.py): its JSON API over a run recorded by `harness run` (the unmodified two-turn
terse agent through the proxy, against the scripted engine, a real HTTP server), on the closed file and while a live
proxy holds it. The page itself is driven in a real browser in tests/viewer/test_browser_engine.py."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import requests
from openai import OpenAI

from harness.store.database import Store
from harness.viewer.app import Viewer, create_app
from tests.support import BackgroundApp, RunningProxy, ScriptedUpstream, db_rows, record_terse_run


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    up = ScriptedUpstream()
    try:
        db = record_terse_run(up.url, tmp_path_factory.mktemp("view") / "run")
    finally:
        up.close()
    [(run_id,)] = db_rows(db, "SELECT run_id FROM runs")
    with Store.open(db) as store:  # what the trainer logs per step
        for step, reward in ((1, 0.2), (2, 0.5), (3, 0.7)):
            store.add_metrics(run_id, step, {"reward/mean": reward, "actor/kl": step / 100,
                                             "update/computed_ratio": 1 + step, "time/train_s": step / 10,
                                             "rollout_corr/kl": step / 1000,
                                             "rollout_corr/rollout_rs_masked_fraction": step / 20})
    return db, run_id


@pytest.fixture(scope="module")
def view(recorded):
    db, run_id = recorded
    app = BackgroundApp(create_app(Viewer(db)))
    yield app.url, db, run_id
    app.close()


def get(url: str, **params):
    resp = requests.get(url, params=params, timeout=30)
    return resp.status_code, resp.json()


def test_runs_and_curves(view):
    url, db, run_id = view
    status, body = get(f"{url}/api/runs")
    assert status == 200
    [run] = body["runs"]
    [(mean,)] = db_rows(db, "SELECT avg(reward) FROM rewards")
    assert (run["run_id"], run["episodes"], run["calls"], run["steps"]) == (run_id, 32, 64, 3)
    assert run["mean_reward"] == pytest.approx(mean)
    status, curves = get(f"{url}/api/runs/{run_id}/curves")
    assert curves["steps"] == [1, 2, 3]
    assert curves["series"]["reward_mean"] == [0.2, 0.5, 0.7] and curves["series"]["kl"] == [0.01, 0.02, 0.03]
    assert curves["series"]["entropy"] == [None, None, None]
    assert curves["series"]["computed_ratio"] == [2, 3, 4] and curves["series"]["update_s"] == [0.1, 0.2, 0.3]
    assert curves["series"]["mismatch_kl"] == [0.001, 0.002, 0.003]
    assert curves["series"]["rejected_share"] == [0.05, 0.1, 0.15]


def test_episodes_filter_sort_and_page(view):
    url, db, run_id = view
    _, body = get(f"{url}/api/runs/{run_id}/episodes", task="q01")
    assert body["total"] == 2 and {e["task_id"] for e in body["episodes"]} == {"q01"}
    assert body["facets"]["statuses"] == ["finished"]
    _, body = get(f"{url}/api/runs/{run_id}/episodes", sort="reward", order="desc", limit=5)
    rewards = [e["reward"] for e in body["episodes"]]
    assert body["total"] == 32 and len(rewards) == 5 and rewards == sorted(rewards, reverse=True)
    [(best,)] = db_rows(db, "SELECT max(reward) FROM rewards")
    assert rewards[0] == pytest.approx(best)
    _, page2 = get(f"{url}/api/runs/{run_id}/episodes", sort="task_id", order="asc", limit=5, offset=5)
    _, all_ = get(f"{url}/api/runs/{run_id}/episodes", sort="task_id", order="asc", limit=100)
    assert [e["episode_id"] for e in page2["episodes"]] == [e["episode_id"] for e in all_["episodes"][5:10]]
    cut = sorted(rewards)[2]
    _, body = get(f"{url}/api/runs/{run_id}/episodes", min_reward=cut)
    [(n,)] = db_rows(db, "SELECT count(*) FROM rewards WHERE reward >= ?", [cut])
    assert body["total"] == n and all(e["reward"] >= cut for e in body["episodes"])
    _, body = get(f"{url}/api/runs/{run_id}/episodes", status="crashed")
    assert body == {"total": 0, "episodes": [], "facets": body["facets"]}
    status, body = get(f"{url}/api/runs/{run_id}/episodes", sort="'; DROP TABLE calls; --")
    assert status == 400 and "sort" in body["error"]["message"]
    status, body = get(f"{url}/api/runs/{run_id}/episodes", limit="-3")
    assert status == 400 and "limit must be a non-negative integer" in body["error"]["message"]
    assert body == {"error": {"message": body["error"]["message"], "type": "invalid_request_error",  # the proxy's shape
                              "param": "limit", "code": "invalid_value"}}


def test_an_episode_whole(view):
    url, db, run_id = view
    episode_id = f"{run_id}-q02-1"
    status, body = get(f"{url}/api/episodes/{episode_id}")
    assert status == 200 and body["episode"]["task_id"] == "q02"
    assert body["episode"]["judge_details"]["replies"] == 2
    calls = body["calls"]
    assert [c["call_index"] for c in calls] == [0, 1]
    assert calls[0]["request"]["messages"][1]["content"] == "What is the capital of France?"
    assert calls[0]["choices"][0]["text"] == calls[0]["response"]["choices"][0]["message"]["content"]
    # the scripted engine's 8-token replies run into the terse agent's max_tokens 8: each call and sample says so
    assert [c["flags"] for c in calls] == [[{"choice": 0, "kind": "truncated", "reason": "max_tokens", "value": 8,
                                             "threshold": 8}]] * 2
    assert {tuple(s["truncation"]) for s in body["samples"]} == {("max_tokens",)}
    stored = db_rows(db, "SELECT sample_index, token_ids, loss_mask, logprobs FROM samples WHERE episode_id = ? "
                     "ORDER BY sample_index", [episode_id])
    assert len(body["samples"]) == len(stored) > 0
    for sample, (index, ids, mask, logprobs) in zip(body["samples"], stored, strict=True):
        assert sample["sample_index"] == index
        assert [t["id"] for t in sample["tokens"]] == ids and [t["mask"] for t in sample["tokens"]] == mask
        assert [t["logprob"] for t in sample["tokens"]] == pytest.approx(logprobs)
    [(n_breaks,)] = db_rows(db, "SELECT count(*) FROM merge_breaks WHERE episode_id = ?", [episode_id])
    assert len(body["breaks"]) == n_breaks
    status, body = get(f"{url}/api/episodes/no-such-episode")
    assert status == 404 and "no episode 'no-such-episode'" in body["error"]["message"]


def test_sql_box_is_read_only(view):
    url, _, run_id = view
    resp = requests.post(f"{url}/api/sql", json={"sql": "SELECT count(*) AS n FROM calls"}, timeout=30).json()
    assert resp["columns"] == ["n"] and resp["rows"] == [[64]]
    resp = requests.post(f"{url}/api/sql", json={"sql": "DELETE FROM calls"}, timeout=30)
    assert resp.status_code == 400 and "read-only" in resp.json()["error"]["message"].lower()
    resp = requests.post(f"{url}/api/sql", data=b"nope", headers={"Content-Type": "application/json"}, timeout=30)
    assert resp.status_code == 400
    resp = requests.post(f"{url}/api/sql", data=b'{"sql": "SELECT 1"}', headers={"Content-Type": "text/plain"},
                         timeout=30)  # what a cross-site form could send
    assert resp.status_code == 415
    resp = requests.get(f"{url}/api/runs", headers={"Host": "attacker.example:8500"}, timeout=30)
    assert resp.status_code == 403 and "127.0.0.1 or localhost" in resp.json()["error"]["message"]
    resp = requests.get(f"{url}/api/no-such-route", timeout=30)
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
    host, port = url.removeprefix("http://").split(":")
    for target in ("/static/../viewer.py", "/static/%2e%2e/viewer.py", "/static/..%2fviewer.py",
                   "/static/%2e%2e%2f%2e%2e%2fpyproject.toml"):  # raw request lines: nothing normalises them first
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
            answer = b"".join(iter(lambda: sock.recv(65536), b""))
        assert answer.split(b" ", 2)[1] in (b"403", b"404"), (target, answer[:200])
        assert b"def " not in answer and b"[project]" not in answer, target  # no file outside harness/viewer/static/


def test_a_live_run_shows_new_calls(tmp_path):
    """While a proxy holds the file, the viewer reads through it: calls made after the page opened appear."""
    up = ScriptedUpstream()
    proxy = RunningProxy(up.url, tmp_path / "live.duckdb")
    app = BackgroundApp(create_app(Viewer(tmp_path / "live.duckdb")))
    try:
        client = OpenAI(base_url=f"{proxy.url}/e/live-1/v1", api_key="sk-x", max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        count = lambda: requests.post(f"{app.url}/api/sql", json={"sql": "SELECT count(*) FROM calls"},  # noqa: E731
                                      timeout=30).json()["rows"][0][0]
        assert count() == 1
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}])
        assert count() == 2
        [run] = requests.get(f"{app.url}/api/runs", timeout=30).json()["runs"]
        assert run["calls"] == 2
    finally:
        app.close()
        proxy.close()
        up.close()


def test_cli_help_and_a_missing_database(tmp_path):
    out = subprocess.run([sys.executable, "-m", "harness.cli", "view", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--tokenizer" in out.stdout and "127.0.0.1" in out.stdout
    out = subprocess.run([sys.executable, "-m", "harness.cli", "view", "--db", str(tmp_path / "none.duckdb")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "no database at" in out.stderr
