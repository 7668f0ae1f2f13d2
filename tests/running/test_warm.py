"""Warm starts (harness/running/warm.py): a Python agent forked from a starter that imported the openai SDK is, as
the agent sees it, what `python agent.py` started cold is. Each test runs the same script both ways, cold through
the limits wrapper as the runner starts it, and compares what the script saw and did: stdout, stderr, exit code."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import pytest_asyncio

from harness.core.records import Task
from harness.running.dataset import run_dataset
from harness.running.limits import limited, pids_root
from harness.running.runner import RunConfig
from harness.running.vllm_server import attach
from harness.running.warm import WarmStarter, script_of, startup_env
from tests.support import db_rows

PROBE = textwrap.dedent('''
    import atexit, json, os, resource, sys, threading, time
    preloaded = "openai" in sys.modules
    task = sys.stdin.read()
    def later():
        time.sleep(0.3)
        print("thread: done", flush=True)
    threading.Thread(target=later).start()  # not a daemon: the interpreter waits for it at exit
    atexit.register(lambda: print("atexit: ran", flush=True))
    cgroup = open("/proc/self/cgroup").read()
    print(json.dumps({
        "argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0], "cwd": os.getcwd(),
        "main_file": sys.modules["__main__"].__file__, "stdin": task, "env": os.environ.get("PROBE_VAR"),
        "api_key_env": sorted(k for k in os.environ if k.startswith("OPENAI")),
        "rlimit_data": resource.getrlimit(resource.RLIMIT_DATA), "own_session": os.getsid(0) == os.getpid(),
        "own_group": os.getpgrp() == os.getpid(), "pids_group": f"harness-{os.getpid()}" in cgroup,
        "stdout": [sys.stdout.encoding, sys.stdout.errors, sys.stdout.line_buffering, sys.stdout.write_through,
                   type(sys.stdout.buffer).__name__],
        "stderr": [sys.stderr.encoding, sys.stderr.errors, sys.stderr.line_buffering, sys.stderr.write_through,
                   type(sys.stderr.buffer).__name__],
        "stdin_enc": [sys.stdin.encoding, sys.stdin.errors],
    }))
    print("to stderr", file=sys.stderr)
    mode = json.loads(task)["mode"]
    if mode == "raise":
        def deeper():
            raise ValueError("boom")
        deeper()
    if mode == "interrupt":
        raise KeyboardInterrupt
    if mode == "message":
        sys.exit("giving up: no tool")
    sys.exit(3)
''')


@pytest_asyncio.fixture(loop_scope="function")  # the starter's reader task runs on the test's loop
async def starter(tmp_path):
    s = await WarmStarter.start(dict(os.environ), tmp_path / "warm-starter.log")
    yield s
    await s.close()


async def _both(starter: WarmStarter, tmp_path: Path, mode: str, memory_mb=1024, max_procs=64):
    """The probe run cold (the limits wrapper, as the runner starts a cold agent) and warm: (rc, stdout, stderr)."""
    (tmp_path / "work").mkdir(exist_ok=True)
    script = tmp_path / "work" / "probe.py"
    script.write_text(PROBE)
    command = [sys.executable, "probe.py", "--flag", "x y"]  # relative: resolved in the episode's directory
    env = {**os.environ, "PROBE_VAR": "episode-7", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}
    task = json.dumps({"mode": mode}).encode()
    out = {}
    for how in ("cold", "warm"):
        with open(tmp_path / f"{how}.err", "wb") as err:
            if how == "cold":
                proc = await asyncio.create_subprocess_exec(
                    *limited(command, memory_mb, max_procs), stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE, stderr=err, env=env, cwd=tmp_path / "work",
                    start_new_session=True)
            else:
                assert starter.takes(command, env, tmp_path / "work")
                proc = await starter.spawn(command, env=env, cwd=tmp_path / "work", stderr=err.fileno(),
                                           memory_mb=memory_mb, max_procs=max_procs)
            stdout, _ = await proc.communicate(task)
        out[how] = (proc.returncode, stdout.decode(), (tmp_path / f"{how}.err").read_text())
    return out


async def test_the_probe_sees_the_same_interpreter_cold_and_warm(starter, tmp_path):
    """argv, __main__, __file__, sys.path[0], cwd, environment, stdin, caps, session, stdio; thread joined and
    atexit run at exit; exit code."""
    out = await _both(starter, tmp_path, "exit")
    (cold_rc, cold_out, cold_err), (warm_rc, warm_out, warm_err) = out["cold"], out["warm"]
    assert warm_rc == cold_rc == 3
    assert warm_err == cold_err == "to stderr\n"
    cold_lines, warm_lines = cold_out.splitlines(), warm_out.splitlines()
    assert cold_lines[1:] == warm_lines[1:] == ["thread: done", "atexit: ran"]
    cold, warm = json.loads(cold_lines[0]), json.loads(warm_lines[0])
    assert warm == cold, {k: (cold[k], warm.get(k)) for k in cold if cold[k] != warm.get(k)}
    assert cold["argv"] == ["probe.py", "--flag", "x y"] and cold["name"] == "__main__"
    assert cold["file"] == str(tmp_path / "work" / "probe.py") == cold["main_file"]
    assert cold["rlimit_data"] == [1024 << 20, 1024 << 20] and cold["own_session"] and cold["own_group"]
    assert cold["pids_group"] == (pids_root() is not None)


@pytest.mark.parametrize("mode", ["raise", "interrupt", "message"])
async def test_an_agent_that_fails_fails_the_same_way(starter, tmp_path, mode):
    """An uncaught exception: exit 1 and the traceback from the agent's own frames; a KeyboardInterrupt: death by
    SIGINT; sys.exit("...") : the message and exit 1."""
    out = await _both(starter, tmp_path, mode)
    assert out["warm"] == out["cold"]
    rc, _, err = out["cold"]
    assert rc == {"raise": 1, "interrupt": -signal.SIGINT, "message": 1}[mode]
    if mode == "raise":
        line = PROBE.splitlines().index("    deeper()") + 1
        assert err.splitlines()[2] == f'  File "{tmp_path / "work" / "probe.py"}", line {line}, in <module>'
        assert err.rstrip().endswith("ValueError: boom")


async def test_commands_a_warm_start_cannot_stand_in_for_start_cold(starter, tmp_path):
    agent = tmp_path / "agent.py"
    agent.write_text("print(1)\n")
    env = dict(os.environ)
    assert starter.takes([sys.executable, str(agent)], env)
    assert script_of([sys.executable, "agent.py"], tmp_path) == str(agent)
    assert not starter.takes([sys.executable, "-m", "agent"], env)
    assert not starter.takes([sys.executable, "-c", "print(1)"], env)
    assert not starter.takes(["/bin/sh", str(agent)], env)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "other")], check=True)
    other = tmp_path / "other" / "bin" / "python"
    assert os.path.samefile(other, sys.executable)  # a link to the same binary, with its own site-packages
    assert not starter.takes([str(other), str(agent)], env)
    assert not starter.takes([sys.executable, str(tmp_path / "missing.py")], env)
    assert not starter.takes([sys.executable, str(agent)], {**env, "PYTHONPATH": str(tmp_path)})
    assert not starter.takes([sys.executable, str(agent)], {**env, "LC_ALL": "C"})
    assert startup_env({"PYTHONHASHSEED": "0", "HOME": "/root", "LANG": "C.UTF-8"}) == {
        "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}


async def test_when_the_starter_dies_its_agents_die_with_it_and_nothing_more_starts_warm(starter, tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import pathlib, time\nprint('up', flush=True)\npathlib.Path('up').touch()\ntime.sleep(600)\n")
    with open(tmp_path / "err", "wb") as err:
        proc = await starter.spawn([sys.executable, str(script)], env=dict(os.environ), cwd=tmp_path,
                                   stderr=err.fileno(), memory_mb=None, max_procs=None)
    reading = asyncio.ensure_future(proc.communicate(b""))
    while not (tmp_path / "up").exists():
        await asyncio.sleep(0.05)
    starter.proc.kill()
    stdout, _ = await reading
    assert proc.returncode == -signal.SIGKILL and stdout == b"up\n"
    for _ in range(600):  # SIGKILL is sent; on a busy machine the process may take a moment to be gone
        if not _alive(proc.pid):
            break
        await asyncio.sleep(0.05)
    assert not _alive(proc.pid)
    assert starter.died and not starter.takes([sys.executable, str(script)], dict(os.environ))
    with pytest.raises(OSError, match="warm starter is gone"):
        await starter.spawn([sys.executable, str(script)], env=dict(os.environ), cwd=tmp_path, stderr=2,
                            memory_mb=None, max_procs=None)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_a_run_starts_its_agents_warm_unless_told_not_to(upstream, tmp_path):
    """Through the runner: with warm starts (the default) the agent finds the SDK imported before its first line;
    with warm_start=False (`harness run --cold-start`, `rollout.warm_start: false`) it does not. Both finish."""
    agent = tmp_path / "agent.py"
    agent.write_text('import json, sys\npreloaded = "openai" in sys.modules\nimport openai\n'
                     'print(json.dumps({"answer": str(preloaded)}))\n')
    tasks = [Task(f"t{i}", {"q": "x", "answer": "True"}) for i in range(3)]
    for warm in (True, False):
        config = RunConfig(command=[sys.executable, str(agent)], judge="exact_match", concurrency=3,
                           warm_start=warm)
        await run_dataset(tasks, config, attach(upstream.url), tmp_path / f"run-{warm}", progress=False)
        rows = db_rows(tmp_path / f"run-{warm}" / "harness.duckdb", "SELECT status, answer FROM episode_outcomes")
        assert rows == [("finished", str(warm))] * 3, (warm, rows)
    assert (tmp_path / "run-True" / "warm-starter.log").exists()
    assert not (tmp_path / "run-False" / "warm-starter.log").exists()
