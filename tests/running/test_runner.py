"""Dataset runs end to end against the scripted engine: agents are real subprocesses using the real openai SDK,
the proxy and DuckDB are real; only the engine's answers are scripted. Agents that crash, hang or print nothing
are episodes with a cause, never a crashed run."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.core.records import Task
from harness.running.dataset import rejudge, run_dataset
from harness.running.limits import pids_root
from harness.running.runner import RunConfig, parse_answer
from harness.running.vllm_server import attach
from tests.support import db_rows

AGENT = textwrap.dedent('''
    import json, os, sys
    from openai import OpenAI
    task = json.loads(sys.stdin.read())
    assert task == json.loads(os.environ["HARNESS_TASK"])
    client = OpenAI()
    for turn in range(task.get("calls", 1)):
        client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": task["q"]}])
    mode = task.get("mode")
    if mode == "hog":
        hoard = bytearray(task["bytes"])
    if mode == "bomb":  # children that leave the process group, each writing its pid, until fork fails
        open(task["pidfile"] + ".agent", "w").write(str(os.getpid()))  # its pids group is harness-<this pid>
        forked = 0
        for _ in range(task["children"]):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                os.setsid()
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1), os.dup2(devnull, 2)
                with open(task["pidfile"], "a") as f:
                    f.write(f"{os.getpid()}\\n")
                import time
                time.sleep(120)
                os._exit(0)
            forked += 1
        print(json.dumps({"answer": str(forked)}))
        sys.exit(0)
    if mode == "crash":
        raise SystemExit("boom: the agent gave up")
    if mode == "hang":
        import subprocess, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(task["pidfile"], "w").write(str(child.pid))
        time.sleep(600)
    if mode == "silent":
        sys.exit(0)
    print("thinking...")
    print(json.dumps({"answer": str(task["a"] + task["b"])}))
''')


@pytest.fixture
def agent(tmp_path):
    path = tmp_path / "agent.py"
    path.write_text(AGENT)
    return [sys.executable, str(path)]


def _tasks(*specs) -> list[Task]:
    return [Task(f"t{i}", {"q": "add", "a": i, "b": 1, "answer": str(i + 1), **spec}) for i, spec in enumerate(specs)]


def test_parse_answer_rule():
    assert parse_answer('log\n{"answer": "42"}\n') == "42"
    assert parse_answer('{"answer": 42}\nthe end\n') == "42"  # the JSON answer line wins over a later line
    assert parse_answer("first\n\nlast line  \n\n") == "last line"
    assert parse_answer('{"answer": {"x": 1}}') == '{"x": 1}'
    assert parse_answer("") is None and parse_answer("\n \n") is None


async def test_failures_are_episodes_with_a_cause(upstream, agent, tmp_path):
    """Agents that finish, crash or print nothing run with a timeout no load reaches; the agent meant to hang runs
    alone under a short one, so only it can be cut off."""
    tasks = _tasks({}, {"mode": "crash"}, {"mode": "silent"}, {"a": 5, "calls": 2, "answer": "6"})
    config = RunConfig(command=agent, judge="exact_match", concurrency=4, timeout_s=600)
    run_id, report = await run_dataset(tasks, config, attach(upstream.url), tmp_path / "run", progress=False)
    rows = db_rows(tmp_path / "run" / "harness.duckdb",
                   "SELECT task_id, status, answer, error, exit_code, log_path FROM episode_outcomes ORDER BY task_id")
    by_task = {r[0]: r[1:] for r in rows}
    assert by_task["t0"][:2] == ("finished", "1") and by_task["t3"][:2] == ("finished", "6")
    assert by_task["t1"][0] == "crashed" and "boom: the agent gave up" in by_task["t1"][2]
    assert by_task["t2"][0] == "no_output"
    assert "boom" in open(by_task["t1"][4]).read()  # stderr went to the episode's log
    assert report["failures"] == {"crashed": 1, "no_output": 1}
    assert report["episodes"] == 4 and report["pass_at_k"]["pass@1"] == 0.5  # t0 and t3 answered right
    calls = db_rows(tmp_path / "run" / "harness.duckdb",
                    "SELECT e.meta->>'task_id', count(c.call_id) FROM episodes e LEFT JOIN calls c USING (episode_id) "
                    "WHERE e.run_id = ? GROUP BY 1 ORDER BY 1", [run_id])
    assert dict(calls) == {"t0": 1, "t1": 1, "t2": 1, "t3": 2}

    pidfile = tmp_path / "child.pid"
    hang = [Task("hang", {"q": "add", "a": 1, "b": 1, "answer": "2", "mode": "hang", "pidfile": str(pidfile)})]
    timeout_s = 4.0
    while True:  # the timeout is meant to cut this agent; it doubles while load kept it from reaching its hang
        run_dir = tmp_path / f"hang-{timeout_s:g}"
        hang_config = RunConfig(command=agent, judge="exact_match", timeout_s=timeout_s)
        hang_run, hang_report = await run_dataset(hang, hang_config, attach(upstream.url), run_dir, progress=False)
        if pidfile.exists() or timeout_s >= 256:
            break
        timeout_s *= 2
    [(status, error, exit_code)] = db_rows(run_dir / "harness.duckdb",
                                           "SELECT status, error, exit_code FROM episode_outcomes")
    assert status == "timeout" and "episode timeout" in error and exit_code is None  # killed: no exit code
    assert hang_report["failures"] == {"timeout": 1}
    child = int(pidfile.read_text())
    for _ in range(50):  # the hanging agent's child died with its process group
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the hanging agent's child {child} outlived the episode timeout")
    assert db_rows(run_dir / "harness.duckdb", "SELECT count(*) FROM calls WHERE run_id = ?", [hang_run]) == [(1,)]


async def test_any_task_id_runs_and_no_episode_file_leaves_the_run_directory(upstream, agent, tmp_path):
    """Task ids come from datasets: slashes, spaces, `..`, unicode. Episodes still get valid ids (a digest keeps
    them apart), their logs stay in <run>/episodes/, and the outcomes keep the task ids as written."""
    ids = ["gsm8k/test/12", "../../../escape", "a b", "a_b", "héllo", ".hidden", "x" * 200]
    tasks = [Task(task_id, {"q": "add", "a": k, "b": 1, "answer": str(k + 1)}) for k, task_id in enumerate(ids)]
    config = RunConfig(command=agent, judge="exact_match", concurrency=4, timeout_s=60)
    run_dir = tmp_path / "nested" / "run"
    _, report = await run_dataset(tasks, config, attach(upstream.url), run_dir, progress=False)
    rows = db_rows(run_dir / "harness.duckdb", "SELECT task_id, episode_id, status, log_path FROM episode_outcomes")
    assert sorted(r[0] for r in rows) == sorted(ids) and {r[2] for r in rows} == {"finished"}
    assert len({r[1] for r in rows}) == len(ids)  # "a b" and "a_b" stay apart
    for _, _, _, log_path in rows:
        assert Path(log_path).resolve().parent == (run_dir / "episodes").resolve()
    assert not (tmp_path / "escape-0.log").exists() and report["mean_reward"] == 1.0


async def test_agents_run_under_a_memory_cap(upstream, agent, tmp_path):
    """An agent that allocates past its cap (RunConfig.memory_mb, harness/running/limits.py) fails its episode with the
    MemoryError in its cause; the same agent without the cap finishes: the cap is what stopped it."""
    task = _tasks({"mode": "hog", "bytes": 1 << 30})
    capped = RunConfig(command=agent, judge="exact_match", timeout_s=60, memory_mb=512)
    await run_dataset(task, capped, attach(upstream.url), tmp_path / "capped", progress=False)
    [(status, error)] = db_rows(tmp_path / "capped" / "harness.duckdb", "SELECT status, error FROM episode_outcomes")
    assert status == "crashed" and "MemoryError" in error
    free = RunConfig(command=agent, judge="exact_match", timeout_s=60, memory_mb=None)
    await run_dataset(task, free, attach(upstream.url), tmp_path / "free", progress=False)
    assert db_rows(tmp_path / "free" / "harness.duckdb", "SELECT status FROM episode_outcomes") == [("finished",)]


async def test_a_fork_bomb_is_held_to_its_process_cap_and_nothing_outlives_the_episode(upstream, agent, tmp_path):
    """An agent forks children that leave its process group (setsid) until fork fails. Its pids cgroup
    (running/limits.py, RunConfig.max_procs) stops it near the cap, root or not; when the episode ends every child is
    killed, escaped ones included, and the cgroup is removed."""
    root = pids_root()
    if root is None:
        pytest.skip("this machine offers no writable pids cgroup (the process cap then falls back to RLIMIT_NPROC)")
    pidfile = tmp_path / "children.txt"
    task = _tasks({"mode": "bomb", "children": 400, "pidfile": str(pidfile)})
    config = RunConfig(command=agent, judge="exact_match", timeout_s=60, max_procs=40)
    await run_dataset(task, config, attach(upstream.url), tmp_path / "run", progress=False)
    [(status, answer)] = db_rows(tmp_path / "run" / "harness.duckdb", "SELECT status, answer FROM episode_outcomes")
    assert status == "finished" and 0 < int(answer) < 40, (status, answer)  # the agent's threads count too
    children = [int(p) for p in pidfile.read_text().split()]
    assert len(children) == int(answer)

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    assert not [p for p in children if alive(p)]
    agent_pid = (tmp_path / "children.txt.agent").read_text()
    assert not (root / f"harness-{agent_pid}").exists()  # this agent's group (other runs on the machine have theirs)


async def test_32_concurrent_episodes_each_get_one_episode_row_and_their_calls(upstream, agent, tmp_path):
    tasks = [Task(f"t{i}", {"q": "add", "a": i, "b": 1, "calls": 2, "answer": str(i + 1)}) for i in range(8)]
    config = RunConfig(command=agent, judge="exact_match", repeat=4, concurrency=32, timeout_s=120)
    run_id, report = await run_dataset(tasks, config, attach(upstream.url), tmp_path / "run", progress=False)
    db = tmp_path / "run" / "harness.duckdb"
    episodes = db_rows(db, "SELECT episode_id, meta->>'task_id', (meta->>'repeat_index')::INT FROM episodes "
                       "WHERE run_id = ? AND source = 'runner'", [run_id])
    assert len(episodes) == 32 and len({e[0] for e in episodes}) == 32
    assert sorted((t, r) for _, t, r in episodes) == sorted((f"t{i}", r) for i in range(8) for r in range(4))
    calls = dict(db_rows(db, "SELECT episode_id, list(call_index ORDER BY call_index) FROM calls "
                         "WHERE run_id = ? GROUP BY 1", [run_id]))
    assert set(calls) == {e[0] for e in episodes} and all(v == [0, 1] for v in calls.values())
    assert report["mean_reward"] == 1.0 and report["pass_at_k"]["pass@4"] == 1.0
    assert db_rows(db, "SELECT count(*), count(reward) FROM rewards WHERE run_id = ?", [run_id]) == [(32, 32)]


async def test_infrastructure_failures_are_retried_wrong_answers_are_not(upstream, agent, tmp_path):
    upstream.script.status = 503  # the engine is overloaded: the agent's SDK call fails
    tasks = _tasks({"answer": "wrong"})
    config = RunConfig(command=agent, judge="exact_match", retries=1, timeout_s=60)
    run_id, report = await run_dataset(tasks, config, attach(upstream.url), tmp_path / "run", progress=False)
    rows = db_rows(tmp_path / "run" / "harness.duckdb",
                   "SELECT attempt, status FROM episode_outcomes WHERE run_id = ? ORDER BY attempt", [run_id])
    assert rows == [(1, "infra_error"), (2, "infra_error")]
    assert report["failures"] == {"infra_error": 1} and report["judged"] == 0
    upstream.script.status = 200
    run_id, report = await run_dataset(tasks, config, attach(upstream.url), tmp_path / "run2", progress=False)
    rows = db_rows(tmp_path / "run2" / "harness.duckdb", "SELECT attempt, status, answer FROM episode_outcomes")
    assert rows == [(1, "finished", "1")] and report["mean_reward"] == 0.0  # wrong, and not retried


JUDGES = textwrap.dedent('''
    def raising(task, answer, calls):
        raise RuntimeError("this judge is broken")

    def by_calls(task, answer, calls):
        return {"reward": float(len(calls)), "n_calls": len(calls),
                "all_ok": all(c["status"] == "ok" for c in calls)}
''')


async def test_a_raising_judge_is_an_error_row_and_a_stored_run_can_be_rejudged(upstream, agent, tmp_path):
    judges = tmp_path / "my_judges.py"
    judges.write_text(JUDGES)
    tasks = _tasks({"calls": 2}, {"calls": 3})
    config = RunConfig(command=agent, judge=f"{judges}:raising", repeat=2)
    run_id, report = await run_dataset(tasks, config, attach(upstream.url), tmp_path / "run", progress=False)
    db = tmp_path / "run" / "harness.duckdb"
    rows = db_rows(db, "SELECT reward, error FROM judgements")
    assert len(rows) == 4 and all(r[0] is None and "this judge is broken" in r[1] for r in rows)
    assert report["failures"] == {"judge_error": 4} and report["mean_reward"] is None

    _, rejudged = await rejudge(db, None, f"{judges}:by_calls", success_threshold=3)
    assert rejudged["mean_reward"] == 2.5 and rejudged["pass_at_k"]["pass@1"] == 0.5
    latest = db_rows(db, "SELECT task_id, reward FROM rewards WHERE judge LIKE '%by_calls' ORDER BY task_id")
    assert latest == [("t0", 2.0), ("t0", 2.0), ("t1", 3.0), ("t1", 3.0)]
    assert db_rows(db, "SELECT count(*) FROM judgements") == [(8,)]  # added, nothing overwritten
    assert db_rows(db, "SELECT count(*) FROM reports WHERE run_id = ?", [run_id]) == [(2,)]
    details = db_rows(db, "SELECT details FROM judgements WHERE reward IS NOT NULL LIMIT 1")[0][0]
    assert json.loads(details) in ({"n_calls": 2, "all_ok": True}, {"n_calls": 3, "all_ok": True})


def test_cli_run_and_judge(upstream, agent, tmp_path):
    data = tmp_path / "tasks.jsonl"
    data.write_text("\n".join(json.dumps({"id": f"q{i}", "q": "add", "a": i, "b": 2, "answer": str(i + 2)})
                              for i in range(3)) + "\n")
    cli = [sys.executable, "-m", "harness.cli"]
    run_dir = tmp_path / "run"
    out = subprocess.run(cli + ["run", agent[1], "--data", str(data), "--judge", "exact_match", "--repeat", "2",
                                "--upstream", upstream.url, "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "mean reward" in out.stdout and "pass@2" in out.stdout
    reports = list(run_dir.glob("report-*.json"))
    assert len(reports) == 1 and json.loads(reports[0].read_text())["mean_reward"] == 1.0
    again = subprocess.run(cli + ["judge", "--db", str(run_dir / "harness.duckdb"), "--judge", "substring"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    bad = data.with_name("bad.jsonl")
    bad.write_text('{"id": 1}\n{oops\n')
    out = subprocess.run(cli + ["run", agent[1], "--data", str(bad), "--upstream", upstream.url],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "line 2" in out.stderr
    out = subprocess.run(cli + ["run", agent[1], "--data", str(data), "--judge", "no_such_module:fn",
                                "--upstream", upstream.url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no_such_module" in out.stderr


def test_cli_run_caps_agent_memory(upstream, agent, tmp_path):
    """`harness run --agent-memory-mb` reaches every agent: the hog fails with a MemoryError under 512 MB."""
    data = tmp_path / "hog.jsonl"
    data.write_text(json.dumps({"id": "hog", "q": "hi", "mode": "hog", "bytes": 1 << 30, "answer": "x"}) + "\n")
    out = subprocess.run([sys.executable, "-m", "harness.cli", "run", agent[1], "--data", str(data), "--judge",
                          "exact_match", "--upstream", upstream.url, "--run-dir", str(tmp_path / "run"),
                          "--agent-memory-mb", "512"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    [(status, error)] = db_rows(tmp_path / "run" / "harness.duckdb", "SELECT status, error FROM episode_outcomes")
    assert status == "crashed" and "MemoryError" in error


ENV_AGENT = textwrap.dedent('''
    import json, re, sys
    from openai import OpenAI
    task = json.loads(sys.stdin.read())
    assert task["instance_id"] and task["env_url"]  # the runner created this episode's instance
    OpenAI().chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])
    a, op, b = re.match(r"What is (-?[\\d.]+) (plus|minus|times|divided by) (-?[\\d.]+)", task["prompt"]).groups()
    ops = {"plus": "+", "minus": "-", "times": "*", "divided by": "/"}
    print(json.dumps({"answer": f"The answer is {eval(a + ops[op] + b):g}"}))
''')


async def test_environment_service_tasks_get_an_instance_and_are_scored_by_the_service(upstream, env_url,
                                                                                     tmp_path):
    from harness.running.tasks import read_tasks

    agent = tmp_path / "env_agent.py"
    agent.write_text(ENV_AGENT)
    tasks = read_tasks(env_url, split="validation")
    config = RunConfig(command=[sys.executable, str(agent)], judge="env", repeat=2)
    run_id, report = await run_dataset(tasks, config, attach(upstream.url), tmp_path / "run", progress=False)
    assert report["episodes"] == 6 and report["failures"] == {}
    assert report["mean_reward"] == 1.0
    instances = db_rows(tmp_path / "run" / "harness.duckdb",
                        "SELECT count(DISTINCT meta->'task'->>'instance_id') FROM episodes WHERE run_id = ?", [run_id])
    assert instances == [(6,)]


def test_ctrl_c_stops_cleanly_and_keeps_what_was_recorded(upstream, agent, tmp_path):
    data = tmp_path / "tasks.jsonl"
    lines = [{"id": "fast", "q": "add", "a": 1, "b": 1, "answer": "2"}]
    lines += [{"id": f"slow{i}", "q": "add", "a": 1, "b": 1, "mode": "hang", "pidfile": str(tmp_path / f"{i}.pid")}
              for i in range(3)]
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "harness.cli", "run", agent[1], "--data", str(data), "--judge", "exact_match",
               "--concurrency", "2", "--upstream", upstream.url, "--run-dir", str(run_dir)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (tmp_path / "0.pid").exists() and time.time() < deadline:  # a slow episode is under way
        time.sleep(0.1)
    time.sleep(2.0)  # the fast episode finishes meanwhile, even on a loaded machine; the slow ones hang until stopped
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "mean reward" in out
    rows = dict(db_rows(run_dir / "harness.duckdb", "SELECT task_id, status FROM episode_outcomes"))
    assert rows["fast"] == "finished" and rows["slow0"] == "interrupted"
    assert "slow2" not in rows  # never started
    assert db_rows(run_dir / "harness.duckdb", "SELECT count(*) FROM calls")[0][0] >= 2


DEBUG_AGENT = textwrap.dedent('''
    import json, os, select, sys, time
    from openai import OpenAI
    task = json.loads(os.environ["HARNESS_TASK"])  # in debug mode the task comes here only
    stdin = os.fstat(0)
    waiting = select.select([0], [], [], 0)[0]
    on_stdin = os.read(0, 65536).decode() if waiting else ""
    start = time.time()
    OpenAI().chat.completions.create(model="m", messages=[{"role": "user", "content": task["q"]}])
    time.sleep(0.3)
    print(f"agent {task['a']} speaks on stderr", file=sys.stderr)
    print(f"agent {task['a']} thinks on stdout")
    with open(task["trace"], "a") as f:
        f.write(json.dumps({"a": task["a"], "start": start, "end": time.time(), "on_stdin": on_stdin,
                            "stdin": [stdin.st_dev, stdin.st_ino]}) + "\\n")
    print(json.dumps({"answer": str(task["a"] + task["b"])}))
''')

DEBUG_JUDGES = textwrap.dedent('''
    import os

    def with_pid(task, answer, calls):
        return {"reward": float(answer == task["answer"]), "pid": os.getpid()}

    def raising(task, answer, calls):
        raise RuntimeError("this judge is broken")
''')


@pytest.fixture
def debug_files(tmp_path):
    agent, judges = tmp_path / "debug_agent.py", tmp_path / "debug_judges.py"
    agent.write_text(DEBUG_AGENT)
    judges.write_text(DEBUG_JUDGES)
    return [sys.executable, str(agent)], judges


async def test_debug_mode_runs_episodes_one_by_one_on_the_terminal_and_judges_in_process(upstream, debug_files,
                                                                                         tmp_path, capfd):
    agent, judges = debug_files
    trace = tmp_path / "trace.jsonl"
    tasks = _tasks(*({"trace": str(trace)} for _ in range(3)))
    config = RunConfig(command=agent, judge=f"{judges}:with_pid", concurrency=4, debug=True)
    run_id, report = await run_dataset(tasks, config, attach(upstream.url), tmp_path / "run", progress=False)
    assert report["episodes"] == 3 and report["mean_reward"] == 1.0  # stdout was still read for the answer
    err = capfd.readouterr().err
    assert all(f"agent {i} speaks on stderr" in err and f"agent {i} thinks on stdout" in err for i in range(3))
    runs = sorted((json.loads(line) for line in trace.read_text().splitlines()), key=lambda r: r["start"])
    assert [r["a"] for r in runs] == [0, 1, 2]  # in order, and one at a time:
    assert all(before["end"] <= after["start"] for before, after in itertools.pairwise(runs))
    mine = os.fstat(0)
    assert all(r["stdin"] == [mine.st_dev, mine.st_ino] and r["on_stdin"] == "" for r in runs)  # the runner's stdin
    db = tmp_path / "run" / "harness.duckdb"
    details = [json.loads(d) for (d,) in db_rows(db, "SELECT details FROM judgements")]
    assert [d["pid"] for d in details] == [os.getpid()] * 3  # the judge ran in this process
    logs = [path for (path,) in db_rows(db, "SELECT log_path FROM episode_outcomes ORDER BY task_id")]
    assert "agent 1 speaks on stderr" in open(logs[1]).read()  # stderr still reached the episode's log


async def test_debug_mode_turns_a_raising_judge_into_an_error_judgement(upstream, debug_files, tmp_path):
    agent, judges = debug_files
    tasks = _tasks({"trace": str(tmp_path / "trace.jsonl")})
    config = RunConfig(command=agent, judge=f"{judges}:raising", repeat=2, debug=True)
    _, report = await run_dataset(tasks, config, attach(upstream.url), tmp_path / "run", progress=False)
    rows = db_rows(tmp_path / "run" / "harness.duckdb", "SELECT reward, error, details FROM judgements")
    assert len(rows) == 2 and all(r[0] is None and "this judge is broken" in r[1] for r in rows)
    assert "RuntimeError" in json.loads(rows[0][2])["traceback"]
    assert report["failures"] == {"judge_error": 2}


def test_cli_run_debug_shows_the_agent_on_the_terminal(upstream, debug_files, tmp_path):
    agent, judges = debug_files
    data = tmp_path / "tasks.jsonl"
    data.write_text("\n".join(json.dumps({"id": f"q{i}", "q": "add", "a": i, "b": 2, "answer": str(i + 2),
                                          "trace": str(tmp_path / "trace.jsonl")}) for i in range(3)) + "\n")
    out = subprocess.run([sys.executable, "-m", "harness.cli", "run", agent[1], "--data", str(data), "--limit", "2",
                          "--judge", f"{judges}:with_pid", "--debug", "--upstream", upstream.url,
                          "--run-dir", str(tmp_path / "run")],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "agent 0 speaks on stderr" in out.stderr and "agent 1 thinks on stdout" in out.stderr
    assert "agent 2" not in out.stderr and "mean reward" in out.stdout  # --limit still applies
