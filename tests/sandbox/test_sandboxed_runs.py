"""Any tasks, each episode in a sandbox (`harness run --sandbox bwrap`, `rollout.sandbox: bwrap`): a real openai SDK
agent against the scripted engine through the proxy, judged as on the host; the agent works in its private
workspace, which is gone once it is judged; an agent that hangs is cut at the timeout with its sandbox."""

from __future__ import annotations

import json
import sys
import textwrap

from harness.core.records import Task
from harness.running.dataset import run_dataset
from harness.running.runner import RunConfig
from harness.running.vllm_server import attach
from tests.support import db_rows

AGENT = textwrap.dedent('''
    import json, os, sys, time
    from openai import OpenAI
    task = json.loads(sys.stdin.read())
    if task.get("hang"):
        time.sleep(3600)
    if task.get("die"):  # the sandbox dies under it: its relay, the agent's parent, killed
        import signal
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(3600)
    OpenAI().chat.completions.create(model="qwen-plus", messages=[{"role": "user", "content": task["q"]}])
    open("scratch.txt", "w").write("mine")
    print(json.dumps({"answer": json.dumps({"sum": str(task["a"] + task["b"]), "cwd": os.getcwd(),
                                            "home": os.environ["HOME"], "files": sorted(os.listdir("."))})}))
''')

JUDGE = textwrap.dedent('''
    import json
    def judge(task, answer, calls):
        got = json.loads(answer)
        return {"reward": float(got["sum"] == task["answer"] and got["cwd"] == "/app" and got["files"] ==
                                ["scratch.txt"]), "got": got}
''')


async def test_ordinary_tasks_run_sandboxed_and_are_judged_as_on_the_host(upstream, tmp_path):
    agent, judge = tmp_path / "agent.py", tmp_path / "judge.py"
    agent.write_text(AGENT)
    judge.write_text(JUDGE)
    tasks = [Task(f"t{i}", {"q": "add", "a": i, "b": 1, "answer": str(i + 1)}) for i in range(3)]
    config = RunConfig(command=[sys.executable, str(agent)], judge=f"{judge}:judge", repeat=2, concurrency=3,
                       timeout_s=600, sandbox="bwrap")
    run_id, report = await run_dataset(tasks, config, attach(upstream.url), tmp_path / "run", progress=False)
    db = tmp_path / "run" / "harness.duckdb"
    rows = db_rows(db, "SELECT status, sandbox->>'backend', sandbox->>'workdir', sandbox->>'workspace' "
                   "FROM episode_outcomes")
    assert len(rows) == 6 and {r[:3] for r in rows} == {("finished", "bwrap", "/app")}
    assert report["mean_reward"] == 1.0 and report["sandbox_flags"] == {}
    assert not any((tmp_path / "run" / "workspaces" / r[3].rsplit("/", 1)[-1]).exists() for r in rows)
    [(calls,)] = db_rows(db, "SELECT count(*) FROM calls WHERE run_id = ? AND status = 'ok'", [run_id])
    assert calls == 6
    [(details,)] = db_rows(db, "SELECT details FROM judgements LIMIT 1")
    assert json.loads(details)["got"]["home"] == "/root"

    hang = [Task("hang", {"q": "add", "a": 1, "b": 1, "answer": "2", "hang": True})]
    cut = RunConfig(command=[sys.executable, str(agent)], judge=f"{judge}:judge", timeout_s=3, sandbox="bwrap")
    await run_dataset(hang, cut, attach(upstream.url), tmp_path / "hang", progress=False)
    [(status, error)] = db_rows(tmp_path / "hang" / "harness.duckdb", "SELECT status, error FROM episode_outcomes")
    assert status == "timeout" and "3 s episode timeout" in error  # the agent never ends on its own


async def test_a_sandbox_that_dies_is_an_episode_with_a_cause_and_the_run_goes_on(upstream, tmp_path):
    agent, judge = tmp_path / "agent.py", tmp_path / "judge.py"
    agent.write_text(AGENT)
    judge.write_text(JUDGE)
    tasks = [Task("dies", {"q": "add", "a": 1, "b": 1, "answer": "2", "die": True}),
             Task("lives", {"q": "add", "a": 2, "b": 1, "answer": "3"})]
    config = RunConfig(command=[sys.executable, str(agent)], judge=f"{judge}:judge", concurrency=2, timeout_s=600,
                       sandbox="bwrap")
    _, report = await run_dataset(tasks, config, attach(upstream.url), tmp_path / "run", progress=False)
    rows = dict((r[0], r[1:]) for r in db_rows(tmp_path / "run" / "harness.duckdb",
                                               "SELECT task_id, status, exit_code, error FROM episode_outcomes"))
    assert rows["lives"][0] == "finished"
    status, exit_code, error = rows["dies"]
    assert status == "crashed" and exit_code != 0 and "exited with code" in error, rows["dies"]
    assert report["failures"]["crashed"] == 1 and report["episodes"] == 2  # (its judge, given no answer, fails too)
