"""Judges: the built-ins on tricky answers, every spec form, specs that cannot load, and the pool that turns a judge
that raises, hangs or crashes into an error row instead of a dead run. The pool's workers are real processes; the
rubric judge talks to the scripted engine, a real HTTP server."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import time
import uuid
from fractions import Fraction

import pytest

from harness.running.judge_pool import JudgePool
from harness.running.judges import JudgeError, RubricJudge, load_judge, normalise_result, parse_verdict

JUDGES_SOURCE = textwrap.dedent('''
    import os
    import time


    def act(task, answer, calls):
        """Does what the task says, so one pool can meet every kind of judge failure."""
        do = task.get("do", "score")
        if do == "raise":
            raise RuntimeError(f"judge exploded on {task['answer']}")
        if do == "sleep":
            time.sleep(task["seconds"])
        if do == "exit":
            os._exit(3)
        if do == "hoard":
            hoard = bytearray(task["bytes"])  # noqa: F841
        if do == "return":
            return task["value"]
        if do == "where":
            return {"reward": 1.0, "flag": os.environ.get("HARNESS_TEST_FLAG"), "cwd": os.getcwd()}
        return {"reward": float(answer == task["answer"]), "pid": os.getpid(), "calls": len(calls)}


    class Counter:
        def __init__(self):
            self.seen = 0

        def __call__(self, task, answer, calls):
            self.seen += 1
            return {"reward": 0.5, "seen": self.seen}


    class NotAJudge:
        pass


    LIMIT = 42
''')


@pytest.fixture
def judge_module(tmp_path, monkeypatch):
    """A judge module with a unique name, importable (tmp_path on sys.path) and loadable as a file."""
    name = f"judges_{uuid.uuid4().hex[:8]}"
    path = tmp_path / f"{name}.py"
    path.write_text(JUDGES_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, path
    sys.modules.pop(name, None)


# ---------------------------------------------------------------------------------------------------- built-ins


@pytest.mark.parametrize(
    "reference, answer, reward",
    [
        ("She sold 48/2 = 24 clips in May.\n#### 1,234", "So the total is 1234.", 1.0),
        ("#### 1234", "The answer is 1,234", 1.0),
        ("5", "It costs $5.00.", 1.0),
        ("$5.00", "5", 1.0),
        ("0.75", "3/4", 1.0),
        ("3/4", "It is 0.75 of the cake", 1.0),
        ("\\frac{3}{4}", "so the answer is \\boxed{\\frac{3}{4}}", 1.0),
        ("-7", "The temperature fell to -7 degrees.", 1.0),
        ("7", "The temperature fell to -7 degrees.", 0.0),
        ("#### 18", "9 + 9 = 18, so \\boxed{18}; check: 20 - 2 = 18", 1.0),
        ("42", "not 42... final answer: 43", 0.0),
        ("1000000", "1e6", 1.0),
        (42, "42", 1.0),
        ("0.1", "0.10000001", 1.0),
        ("0.1", "0.1001", 0.0),
        (["12", "twelve"], "12", 1.0),
    ],
)
def test_math_judge_compares_numbers_not_text(reference, answer, reward):
    assert load_judge("math")({"answer": reference}, answer, [])[0] == reward


def test_math_judge_without_a_number_in_the_answer_scores_zero():
    math = load_judge("math")
    assert math({"answer": "#### 42"}, "I could not work it out.", []) == (0.0, {"expected": 42.0, "got": None})
    assert math({"answer": "42"}, None, [])[0] == 0.0


def test_builtin_judge_on_a_task_without_reference_raises_naming_the_keys():
    with pytest.raises(ValueError, match="no reference answer.*answer, expected, reference, target.*prompt"):
        load_judge("math").fn({"prompt": "2+2?"}, "4", [])
    with pytest.raises(ValueError, match="contains no number"):
        load_judge("math").fn({"answer": "four"}, "4", [])


@pytest.mark.parametrize(
    "task, answer, reward",
    [
        ({"answer": "Paris"}, "  paris. ", 1.0),
        ({"answer": "New  York"}, "new york\n", 1.0),
        ({"expected": "ＡＢＣ"}, "abc", 1.0),
        ({"target": ["Paris", "Paris, France"]}, "paris, france", 1.0),
        ({"answer": "Paris"}, "Paris, France", 0.0),
        ({"answer": "Paris"}, None, 0.0),
    ],
)
def test_exact_match_ignores_case_whitespace_width_and_final_period(task, answer, reward):
    assert load_judge("exact_match")(task, answer, [])[0] == reward


@pytest.mark.parametrize(
    "reference, answer, score",
    [
        ("the cat sat", "A cat sat down", 0.8),  # 2 shared tokens of 3 predicted and 2 expected
        ("Denver Broncos", "The Denver Broncos!", 1.0),
        ("Denver Broncos", "Carolina Panthers", 0.0),
        (["x y", "cat sat"], "cat sat down", 0.8),
        ("Broncos", None, 0.0),
    ],
)
def test_f1_is_squad_token_f1(reference, answer, score):
    assert load_judge("f1")({"answer": reference}, answer, [])[0] == pytest.approx(score)


def test_substring_finds_the_reference_anywhere_ignoring_case():
    sub = load_judge("substring")
    assert sub({"answer": "Paris"}, "The capital is PARIS.", [])[0] == 1.0
    assert sub({"answer": "Paris"}, "Lyon", [])[0] == 0.0
    with pytest.raises(ValueError, match="empty"):
        sub.fn({"answer": " "}, "anything", [])


# ---------------------------------------------------------------------------------------------------- loading


def test_builtin_short_names_normalise_to_their_module_spec():
    for short in ("exact_match", "math", "substring", "f1"):
        judge = load_judge(short)
        assert judge.name == f"harness.judges:{short}"
        assert load_judge(judge.name).code_hash == judge.code_hash
    hashes = {load_judge(s).code_hash for s in ("exact_match", "math", "substring", "f1")}
    assert len(hashes) == 4 and all(len(h) == 16 for h in hashes)


def test_every_spec_form_loads(judge_module, tmp_path, monkeypatch):
    name, path = judge_module
    task = {"answer": "42"}
    assert load_judge(f"{name}:act")(task, "42", [{}])[0] == 1.0
    assert load_judge(f"{path}:act")(task, "41", [])[0] == 0.0
    monkeypatch.chdir(tmp_path)
    relative = load_judge(f"./{path.name}:act")
    assert relative.name == f"{path.name}:act"  # relative to the current directory, normalised
    for spec in (f"{name}:Counter", f"{name}->Counter", f"{path}:Counter"):
        counter = load_judge(spec)  # a class is instantiated once: its state carries over calls
        assert counter.name.endswith(":Counter") and "->" not in counter.name
        assert counter(task, "x", []) == (0.5, {"seen": 1})
        assert counter(task, "x", []) == (0.5, {"seen": 2})


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_module_xyz:judge", "no module named 'no_such_module_xyz'"),
        ("{mod}:missing", "has no attribute 'missing'; it defines Counter, NotAJudge, act"),
        ("{mod}:LIMIT", "names a int"),
        ("{mod}:NotAJudge", "instances of NotAJudge are not callable"),
        ("{mod}->NotAJudge", "instances of NotAJudge are not callable"),
        ("no/such/file.py:act", "does not exist"),
        ("exactmatch", "not a built-in judge"),
        ("math:", "not a built-in judge"),
    ],
)
def test_a_spec_that_cannot_load_raises_naming_the_spec(judge_module, spec, message):
    spec = spec.format(mod=judge_module[0])
    with pytest.raises(JudgeError, match=message) as caught:
        load_judge(spec)
    assert repr(spec) in str(caught.value)


def test_a_judge_file_that_fails_to_import_raises_naming_the_file(tmp_path):
    broken = tmp_path / "broken_judge.py"
    broken.write_text("def judge(task, answer, calls):\n    return 1 +\n")
    with pytest.raises(JudgeError, match="broken_judge.py.*SyntaxError"):
        load_judge(f"{broken}:judge")
    with pytest.raises(JudgeError, match="empty"):
        load_judge("  ")


def test_code_hash_follows_the_judge_source(tmp_path):
    path = tmp_path / "versioned.py"
    path.write_text("def judge(task, answer, calls):\n    return 1.0\n")
    first = load_judge(f"{path}:judge").code_hash
    path.write_text("def judge(task, answer, calls):\n    return 0.0\n")
    changed = load_judge(f"{path}:judge")
    assert changed.code_hash != first
    assert changed({}, None, []) == (0.0, {})  # the new code runs, not a cached module
    path.write_text("def judge(task, answer, calls):\n    return 1.0\n")
    assert load_judge(f"{path}:judge").code_hash == first


@pytest.mark.parametrize(
    "value, expected",
    [
        (True, (1.0, {})),
        (False, (0.0, {})),
        (3, (3.0, {})),
        (Fraction(1, 4), (0.25, {})),
        ({"reward": True, "why": "right", "ids": (1, 2)}, (1.0, {"why": "right", "ids": [1, 2]})),
    ],
)
def test_normalise_accepts_numbers_bools_and_reward_dicts(value, expected):
    assert normalise_result("j", value) == expected


@pytest.mark.parametrize(
    "value, message",
    [
        ("1.0", r"'1.0' \(str\)"),
        (None, r"None \(NoneType\)"),
        (float("nan"), "a reward of nan"),
        ({"score": 1}, "a dict without a 'reward' key"),
        ({"reward": "high"}, r"\{'reward': 'high'\} \(dict\)"),
        ([1.0], r"\[1.0\] \(list\)"),
    ],
)
def test_normalise_rejects_what_is_not_a_reward_naming_the_judge(value, message):
    with pytest.raises(JudgeError, match=rf"^judge my\.judge:score returned {message}"):
        normalise_result("my.judge:score", value)


# ---------------------------------------------------------------------------------------------------- the pool


@pytest.fixture
def act_spec(judge_module):
    return f"{judge_module[1]}:act"


async def test_pool_scores_with_the_judge_it_was_given(act_spec):
    async with JudgePool(act_spec, workers=2, timeout_s=10) as pool:
        j = await pool.judge("ep-1", {"answer": "42"}, "42", [{"call_index": 0}, {"call_index": 1}])
        assert (j.episode_id, j.reward, j.error, j.judge) == ("ep-1", 1.0, None, pool.name)
        assert j.judge_hash == load_judge(act_spec).code_hash
        assert j.details["calls"] == 2 and j.details["pid"] in pool.worker_pids != [os.getpid()]
        assert (await pool.judge("ep-2", {"answer": "42"}, "41", [])).reward == 0.0


async def test_pool_turns_a_raising_judge_into_an_error_row(act_spec):
    async with JudgePool(act_spec, workers=1, timeout_s=10) as pool:
        pids = pool.worker_pids
        j = await pool.judge("ep", {"do": "raise", "answer": "7"}, "7", [])
        assert j.reward is None
        assert j.error == f"judge {pool.name} raised RuntimeError: judge exploded on 7"
        assert "RuntimeError" in j.details["traceback"]
        assert (await pool.judge("ep", {"answer": "7"}, "7", [])).reward == 1.0
        assert pool.worker_pids == pids  # a judge that raises does not cost its worker


async def test_pool_kills_a_judge_past_its_timeout_and_replaces_the_worker(act_spec):
    async with JudgePool(act_spec, workers=1, timeout_s=0.5) as pool:
        await pool.judge("warm", {"answer": "1"}, "1", [])
        pids = pool.worker_pids
        started = time.monotonic()
        j = await pool.judge("ep", {"do": "sleep", "seconds": 60, "answer": "1"}, "1", [])
        assert time.monotonic() - started < 30
        assert (j.reward, j.error) == (None, f"judge {pool.name} timed out after 0.5 s")
        assert pool.worker_pids != pids
        again = await pool.judge("ep", {"answer": "1"}, "1", [])
        assert (again.reward, again.error) == (1.0, None)
        assert again.details["pid"] in pool.worker_pids


async def test_pool_workers_run_under_a_memory_cap(act_spec):
    """A judge that allocates past the cap (harness/running/limits.py: JUDGE_MEMORY_MB) gets a MemoryError at once: an
    error row, not a machine out of memory. This process has no such cap: the worker's is what refuses."""
    import resource

    from harness.running.limits import JUDGE_MEMORY_MB

    size = (JUDGE_MEMORY_MB + 1024) << 20
    soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
    assert soft == resource.RLIM_INFINITY or soft > size
    async with JudgePool(act_spec, workers=1, timeout_s=30) as pool:
        j = await pool.judge("ep", {"do": "hoard", "bytes": size, "answer": "1"}, "1", [])
        assert j.reward is None and "MemoryError" in j.error
        assert (await pool.judge("ep", {"answer": "1"}, "1", [])).reward == 1.0


async def test_pool_recovers_when_a_judge_kills_its_worker(act_spec):
    async with JudgePool(act_spec, workers=1, timeout_s=10) as pool:
        j = await pool.judge("ep", {"do": "exit", "answer": "1"}, "1", [])
        assert (j.reward, j.error) == (None, f"judge {pool.name} crashed its worker process (exit code 3)")
        assert (await pool.judge("ep", {"answer": "1"}, "1", [])).reward == 1.0


@pytest.mark.parametrize(
    "value, message",
    [("abc", "returned 'abc' (str)"), (None, "returned None"), (float("nan"), "reward of nan"),
     ({"score": 1}, "without a 'reward' key")],
)
async def test_pool_turns_a_bad_return_value_into_an_error_row(act_spec, value, message):
    async with JudgePool(act_spec, workers=1, timeout_s=10) as pool:
        j = await pool.judge("ep", {"do": "return", "value": value, "answer": "1"}, "1", [])
        assert j.reward is None and j.error.startswith(f"judge {pool.name} ") and message in j.error
        assert (await pool.judge("ep", {"answer": "1"}, "1", [])).reward == 1.0


async def test_pool_spreads_concurrent_episodes_over_its_workers(act_spec):
    async with JudgePool(act_spec, workers=2, timeout_s=10) as pool:
        task = {"do": "sleep", "seconds": 0.2, "answer": "1"}
        done = await asyncio.gather(*(pool.judge(f"ep{i}", task, "1", []) for i in range(4)))
        assert [j.reward for j in done] == [1.0] * 4
        assert {j.details["pid"] for j in done} == set(pool.worker_pids)
        assert len(set(pool.worker_pids)) == 2


async def test_pool_gives_workers_the_environment_and_directory_it_was_made_in(judge_module, tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_TEST_FLAG", "on")
    monkeypatch.chdir(tmp_path)
    async with JudgePool(f"{judge_module[1].name}:act", workers=1) as pool:  # a relative path
        j = await pool.judge("ep", {"do": "where"}, None, [])
        assert (j.reward, j.error, j.details) == (1.0, None, {"flag": "on", "cwd": str(tmp_path)})
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        monkeypatch.chdir(elsewhere)
        monkeypatch.setenv("HARNESS_TEST_FLAG", "changed")
        await pool.judge("ep", {"do": "exit"}, None, [])  # its replacement starts after the move
        j = await pool.judge("ep", {"do": "where"}, None, [])
        assert (j.reward, j.error, j.details) == (1.0, None, {"flag": "on", "cwd": str(tmp_path)})


async def test_pool_sends_episodes_larger_than_a_pipe_buffer(act_spec):
    calls = [{"call_index": i, "request": {"messages": [{"role": "user", "content": "x" * 20_000}]}}
             for i in range(50)]
    async with JudgePool(act_spec, workers=1) as pool:
        j = await pool.judge("ep", {"answer": "1"}, "1", calls)
        assert (j.reward, j.details["calls"]) == (1.0, 50)


def test_pool_with_a_bad_spec_fails_at_construction(judge_module):
    with pytest.raises(JudgeError, match="no module named 'no_such_module_xyz'"):
        JudgePool("no_such_module_xyz:judge")
    with pytest.raises(JudgeError, match="not callable"):
        JudgePool(f"{judge_module[0]}:NotAJudge")
    with pytest.raises(ValueError, match="workers must be a whole number >= 1, got 0"):
        JudgePool("math", workers=0)


async def test_pool_close_stops_its_workers_and_is_idempotent(act_spec):
    pool = JudgePool(act_spec, workers=2)
    await pool.judge("ep", {"answer": "1"}, "1", [])
    pids = pool.worker_pids
    pool.close()
    pool.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="closed"):
        await pool.judge("ep", {"answer": "1"}, "1", [])


async def test_closing_the_pool_ends_judgements_in_flight_and_waiting(act_spec):
    pool = JudgePool(act_spec, workers=1, timeout_s=60)
    busy = asyncio.create_task(pool.judge("busy", {"do": "sleep", "seconds": 60, "answer": "1"}, "1", []))
    waiting = asyncio.create_task(pool.judge("waiting", {"answer": "1"}, "1", []))
    await asyncio.sleep(0.5)
    pool.close()
    j = await asyncio.wait_for(busy, 10)
    assert (j.reward, j.error) == (None, f"judge {pool.name} was stopped: the pool was closed while it was judging")
    with pytest.raises(RuntimeError, match="was closed"):
        await asyncio.wait_for(waiting, 10)


async def test_pool_overhead_per_judgement(capsys):
    """Prints the cost of a judgement through the pool next to the same judge called in-process."""
    n = 500
    task = {"answer": "#### 1,234"}
    calls = [{"call_index": i, "status": "ok", "request": {"messages": [{"role": "user", "content": "q" * 2000}]},
              "response": {"choices": [{"message": {"content": "a" * 2000}}]}, "prompt_tokens": 500,
              "completion_tokens": 500} for i in range(8)]
    judge = load_judge("math")
    started = time.perf_counter()
    for _ in range(n):
        judge(task, "1234", calls)
    direct_ms = (time.perf_counter() - started) / n * 1000
    async with JudgePool("math", workers=2) as pool:
        await asyncio.gather(pool.judge("warm", task, "1234", calls), pool.judge("warm", task, "1234", calls))
        started = time.perf_counter()
        for _ in range(n):
            j = await pool.judge("ep", task, "1234", calls)
        sequential_ms = (time.perf_counter() - started) / n * 1000
        started = time.perf_counter()
        done = await asyncio.gather(*(pool.judge("ep", task, "1234", calls) for _ in range(n)))
        concurrent_ms = (time.perf_counter() - started) / n * 1000
    assert j.reward == 1.0 and all(d.reward == 1.0 for d in done)
    with capsys.disabled():
        print(f"\n[judge overhead] math judge, 8 calls of ~4 KB each: in-process {direct_ms:.3f} ms, through "
              f"JudgePool {sequential_ms:.3f} ms sequential, {concurrent_ms:.3f} ms each with {n} concurrent "
              f"(pool overhead ~{sequential_ms - direct_ms:.3f} ms per judgement)")


# ---------------------------------------------------------------------------------------------------- rubric


@pytest.fixture
def judge_model(upstream, monkeypatch):
    """The scripted engine as the judge model, configured the way a user would: by environment variables."""
    monkeypatch.setenv("HARNESS_JUDGE_BASE_URL", upstream.url + "/v1")
    monkeypatch.setenv("HARNESS_JUDGE_MODEL", "grader-model")
    monkeypatch.delenv("HARNESS_JUDGE_API_KEY", raising=False)
    return upstream


QUESTION = {"prompt": "What is 6 times 7?", "answer": "42", "rubric": "Full marks only for 42."}


def test_rubric_judge_scores_a_json_verdict(judge_model):
    judge_model.script.content = '{"score": 8, "reason": "good"}'
    rubric = load_judge("rubric")
    assert rubric.name == "harness.judges:RubricJudge"
    reward, details = rubric(QUESTION, "It is 42.", [])
    assert reward == pytest.approx(0.8)
    assert details == {"score": 8.0, "reason": "good", "passed": True, "judge_model": "grader-model"}
    sent = judge_model.engine.requests[-1]
    assert sent["model"] == "grader-model"
    prompt = sent["messages"][-1]["content"]
    assert all(part in prompt for part in ("What is 6 times 7?", "Full marks only for 42.", "It is 42.", "0 (worst)"))


def test_rubric_judge_falls_back_to_a_score_line(judge_model):
    judge_model.script.content = "The answer misses the point.\nScore: 3\nReason: wrong number"
    reward, details = load_judge("rubric")(QUESTION, "It is 41.", [])
    assert reward == pytest.approx(0.3)
    assert (details["score"], details["passed"], details["reason"]) == (3.0, False, "wrong number")


def test_rubric_judge_clips_to_its_scale_and_skips_missing_answers(judge_model):
    judge_model.script.content = '{"score": 15, "reason": "generous"}'
    rubric = RubricJudge(min_score=1, max_score=5)
    assert rubric(QUESTION, "42", [])["reward"] == 1.0
    asked = len(judge_model.engine.requests)
    assert rubric(QUESTION, None, [])["reward"] == 0.0
    assert len(judge_model.engine.requests) == asked  # no answer, no call to the judge model


@pytest.mark.parametrize(
    "text, verdict",
    [
        ('{"score": 7, "reason": "ok"}', (7.0, "ok")),
        ('```json\n{"score": 6.5, "reason": "fenced"}\n```', (6.5, "fenced")),
        ('Here is my verdict: {"score": "9", "reason": "text score"}', (9.0, "text score")),
        ("**Score:** 4/10", (4.0, "**Score:** 4/10")),
    ],
)
def test_parse_verdict(text, verdict):
    assert parse_verdict(text) == verdict


async def test_rubric_judge_in_the_pool_uses_the_configured_model(judge_model):
    judge_model.script.content = '{"score": 8, "reason": "good"}'
    async with JudgePool("rubric", workers=1, timeout_s=30) as pool:
        j = await pool.judge("ep", QUESTION, "42", [])
        assert (j.reward, j.error, j.details["passed"]) == (pytest.approx(0.8), None, True)
        judge_model.script.content = "I refuse to grade this."
        j = await pool.judge("ep", QUESTION, "42", [])
        assert j.reward is None and "holds no score" in j.error


def test_rubric_judge_without_a_judge_model_names_the_variable(monkeypatch):
    monkeypatch.delenv("HARNESS_JUDGE_BASE_URL", raising=False)
    monkeypatch.setenv("HARNESS_JUDGE_MODEL", "grader-model")
    with pytest.raises(JudgeError, match="HARNESS_JUDGE_BASE_URL"):
        load_judge("rubric")
    with pytest.raises(JudgeError, match="HARNESS_JUDGE_BASE_URL"):
        JudgePool("rubric")
    monkeypatch.setenv("HARNESS_JUDGE_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.delenv("HARNESS_JUDGE_MODEL")
    with pytest.raises(JudgeError, match="HARNESS_JUDGE_MODEL"):
        load_judge("rubric")
