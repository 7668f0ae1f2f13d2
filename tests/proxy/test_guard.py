"""Limits and the degenerate-output guard: the checks on hand-made completions, the proxy refusing an episode's
calls past max_turns (the scripted engine), every cut recorded on its calls (the `flags` view) and on every sample
it cut (samples.truncation); then, on the real engine, a scripted degenerate agent caught and normal episodes left
alone (`harness run --guard --guard-end-episode --max-turns`).
The tests on the real engine are in test_guard_engine.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest

from harness.core.merge import merge_episode
from harness.core.records import ENGINE, OK, Call, Choice
from proxy.guard import GuardConfig, flags_of, mean_surprisal, repeat_share
from tests.support import RunningProxy, db_rows

ROOT = Path(__file__).resolve().parents[2]


def _call(index: int, prompt: list[int], *choices: Choice, flags: list[dict] | None = None, status: str = OK,
          http_status: int = 200, error: str | None = None) -> Call:
    return Call(call_id=f"c{index}", run_id="run", episode_id="ep", call_index=index, endpoint="chat", stream=False,
                requested_model="m", served_model="p", role_key="r", system_hash="s", tools_hash=None,
                request=b"{}", response=b"{}", prompt_ids=list(prompt), choices=list(choices), token_source=ENGINE,
                status=status, http_status=http_status, error=error, started_at=0.0, latency_ms=1.0, ttft_ms=None,
                weight_version=0, extra={"flags": flags} if flags else {})


def _choice(index: int, ids: list[int] | None, finish: str = "stop", logprob: float = -2.0,
            text: str | None = None) -> Choice:
    logprobs = [logprob] * len(ids) if ids is not None else None
    return Choice(index, ids, logprobs, finish, text)


def test_repeat_share_and_mean_surprisal_by_hand():
    assert repeat_share([1, 2, 3, 4, 5, 6], 2) == 0.0  # 5 bigrams, all new
    assert repeat_share([1, 2, 1, 2, 1, 2], 2) == pytest.approx(1 - 2 / 5)  # (1,2) (2,1) then 3 repeats of them
    assert repeat_share([7] * 10, 4) == pytest.approx(1 - 1 / 7)  # 7 four-grams, one distinct
    assert repeat_share([1, 2], 4) == 0.0  # no n-gram at all
    assert mean_surprisal([-0.5, -1.5]) == pytest.approx(1.0) and mean_surprisal([]) == 0.0


def test_each_truncation_is_named_and_the_guard_flags_only_what_crosses_its_thresholds():
    loop = [5, 6] * 20  # 40 tokens, a two-token loop: 37 of its 37 four-grams after the first two repeat
    varied = list(range(100, 140))  # 40 tokens that never repeat
    call = _call(0, [1, 2], _choice(0, loop, "length"), _choice(1, varied, "length"), _choice(2, [9] * 10),
                 _choice(3, varied, "stop", logprob=-0.01), _choice(4, None, "stop", text=" ".join(["no"] * 40)))
    off = flags_of(call, max_tokens=40, guard=GuardConfig())
    assert off == [{"choice": 0, "kind": "truncated", "reason": "max_tokens", "value": 40, "threshold": 40},
                   {"choice": 1, "kind": "truncated", "reason": "max_tokens", "value": 40, "threshold": 40}]
    # cut short of max_tokens (or with none asked): the context was full
    assert [f["reason"] for f in flags_of(call, max_tokens=64, guard=GuardConfig())] == ["max_model_len"] * 2
    assert [f["reason"] for f in flags_of(call, max_tokens=None, guard=GuardConfig())] == ["max_model_len"] * 2
    on = GuardConfig(enabled=True, min_surprisal=0.1, length_cap=True)
    found = [(f["choice"], f["reason"]) for f in flags_of(call, 40, on) if f["kind"] == "degenerate"]
    assert found == [(0, "length_cap"), (0, "repetition"), (1, "length_cap"), (3, "low_surprisal"),
                     (4, "repetition")]  # 2: too short to judge; 4: text only, judged by its words
    [rep] = [f for f in flags_of(call, 40, on) if f["reason"] == "repetition" and f["choice"] == 0]
    assert rep["value"] == pytest.approx(1 - 2 / 37, abs=1e-4) and rep["threshold"] == 0.5
    refused = _call(1, [], status="error", http_status=400,
                    error="engine answered 400: This model's maximum context length is 512 tokens. However, ...")
    assert flags_of(refused, 8, GuardConfig()) == [{"choice": None, "kind": "truncated", "reason": "max_model_len",
                                                   "value": None, "threshold": None}]
    echo = Choice(0, varied, [None, *[-0.01] * 39], "stop", None)  # /v1/completions with echo: no first logprob
    assert [f["reason"] for f in flags_of(_call(2, [1], echo), None, on)] == ["low_surprisal"]
    with pytest.raises(ValueError, match="max_repeat 1.5"):
        GuardConfig(max_repeat=1.5)


def test_a_sample_lists_the_cuts_on_its_own_path_and_those_of_its_whole_episode():
    cut = {"choice": 1, "kind": "truncated", "reason": "max_tokens", "value": 2, "threshold": 2}
    c0 = _call(0, [1, 2], _choice(0, [10, 11]), _choice(1, [20, 21], "length"), flags=[cut])  # n=2: two branches
    c1 = _call(1, [1, 2, 10, 11, 3], _choice(0, [12]))
    merged = merge_episode([c0, c1])
    assert [(s.call_ids, s.truncation) for s in merged.samples] == [(["c0", "c1"], []), (["c0"], ["max_tokens"])]
    refused = _call(2, [], status="error", http_status=400, flags=[
        {"choice": None, "kind": "truncated", "reason": "max_turns", "value": 3, "threshold": 2}])
    merged = merge_episode([c0, c1, refused])
    assert [s.truncation for s in merged.samples] == [["max_turns"], ["max_tokens", "max_turns"]]
    # recorded before the proxy flagged calls: a reply that ran out is `length` (its cause was not recorded)
    old = _call(0, [1, 2], _choice(0, [10, 11], "length"))
    assert [s.truncation for s in merge_episode([old]).samples] == [["length"]]


def test_the_proxy_refuses_calls_past_max_turns_and_every_cut_is_in_sql(upstream, tmp_path):
    """Scripted engine: every completion is 8 tokens with finish_reason "length". Asked with max_tokens 8 that is a
    max_tokens cut; asked without, a context cut. The third call of an episode with max_turns 2 gets a 400, streamed
    or not, and the merged samples list both cuts."""
    proxy = RunningProxy(upstream.url, tmp_path / "h.duckdb", max_turns=2)
    try:
        client = openai.OpenAI(base_url=f"{proxy.url}/e/ep-a/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=8)
        client.chat.completions.create(model="gpt-4o-mini", messages=messages)
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match="max_turns 2") as err:
                client.chat.completions.create(model="gpt-4o-mini", messages=messages, stream=stream)
            assert err.value.code == "episode_ended"
        other = openai.OpenAI(base_url=f"{proxy.url}/e/ep-b/v1", api_key="x", max_retries=0)
        other.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=8)  # its own count
        loose = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0)  # no episode: never limited
        for _ in range(3):
            loose.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=8)
    finally:
        proxy.close()
    assert len(upstream.engine.requests) == 6  # the refused calls never reached the engine
    flags = db_rows(proxy.db_path, "SELECT episode_id, call_index, choice_index, kind, reason, value, threshold "
                    "FROM flags WHERE episode_id LIKE 'ep-%' ORDER BY episode_id, call_index")
    assert flags == [("ep-a", 0, 0, "truncated", "max_tokens", 8.0, 8.0),
                     ("ep-a", 1, 0, "truncated", "max_model_len", 8.0, None),
                     ("ep-a", 2, None, "truncated", "max_turns", 3.0, 2.0),
                     ("ep-a", 3, None, "truncated", "max_turns", 4.0, 2.0),
                     ("ep-b", 0, 0, "truncated", "max_tokens", 8.0, 8.0)]
    assert db_rows(proxy.db_path, "SELECT count(*) FROM calls WHERE status = 'error' AND http_status = 400") \
        == [(2,)]
    out = subprocess.run([sys.executable, "-m", "harness.cli", "merge", "--db", str(proxy.db_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    samples = db_rows(proxy.db_path, "SELECT episode_id, truncation FROM samples WHERE episode_id LIKE 'ep-%' "
                      "ORDER BY episode_id, sample_index")
    # ep-a's second call re-sends the first prompt (no reply appended): it is a sibling of the first, not its child
    assert samples == [("ep-a", ["max_tokens", "max_turns"]), ("ep-a", ["max_model_len", "max_turns"]),
                       ("ep-b", ["max_tokens"])]


def test_an_episode_the_guard_ended_is_still_ended_once_the_proxy_has_forgotten_it(upstream, tmp_path):
    """With room for one episode in memory, ep-a (ended by the guard: the scripted engine's tokens all have
    logprob -0.5, below min_surprisal 1) is forgotten while ep-b runs; when ep-a calls again, the proxy finds the
    finding in the store and still refuses it."""
    guard = GuardConfig(enabled=True, min_tokens=8, min_surprisal=1.0, end_episode=True)
    proxy = RunningProxy(upstream.url, tmp_path / "h.duckdb", guard=guard, max_episodes=1)

    def ask(episode: str):
        client = openai.OpenAI(base_url=f"{proxy.url}/e/{episode}/v1", api_key="x", max_retries=0)
        return client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])

    try:
        ask("ep-a")
        for _ in range(2):  # known, then forgotten and looked up again
            with pytest.raises(openai.BadRequestError, match=r"guard flagged call 0 \(low_surprisal\)") as err:
                ask("ep-a")
            assert err.value.code == "episode_ended"
            if _ == 0:
                ask("ep-b")
        forgotten = proxy.server.episodes_forgotten
    finally:
        proxy.close()
    assert forgotten >= 2  # ep-a when ep-b came, ep-b when ep-a came back
    assert len(upstream.engine.requests) == 2  # ep-a's first call and ep-b's
    assert db_rows(proxy.db_path, "SELECT episode_id, call_index, reason FROM flags ORDER BY ALL") == [
        ("ep-a", 0, "low_surprisal"), ("ep-a", 0, "max_model_len"), ("ep-a", 1, "guard"), ("ep-a", 2, "guard"),
        ("ep-b", 0, "low_surprisal"), ("ep-b", 0, "max_model_len")]  # every scripted answer ends by "length"


def test_limit_options_are_checked_with_what_to_do(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a", "prompt": "hi"}\n')
    for flags, message in ((["--max-turns", "0"], "--max-turns 0 must be a positive"),
                           (["--guard-end-episode"], "add --guard")):
        out = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(ROOT / "examples/simple_agent.py"),
                              "--data", str(tasks), "--upstream", "http://127.0.0.1:9", "--run-dir",
                              str(tmp_path / "r"), *flags], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and message in out.stderr, out.stderr
