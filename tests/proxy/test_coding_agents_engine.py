"""Coding CLIs, unmodified, on the real engine (Codex CLI and Claude Code here; opencode, mini-swe-agent and aider
over Harbor tasks in their sandboxes below): vLLM serving the tiny model with a 32k context (their
prompts are 18k and 24k tokens of its vocabulary), whose replies a logits processor forces to the tool calls a
coding task needs (tests/forcing.py); everything else is real: the engine's template, ids and logprobs, the
proxy's token-exact continuity over the history each CLI resends, and the merge. Each CLI runs its shell tool twice
and finishes with exit 0; its three calls merge into one sample with no drift."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from harness.core.merge import COMPACTION, FIRST_CALL, SUB_AGENT, TOOLS_CHANGED, merge_episode
from harness.running.tiny_model import build_tiny_model
from harness.running.vllm_server import start_vllm
from harness.store.database import Store
from proxy import SamplingOverrides
from tests.proxy.test_coding_agents import BIN, CODING_AGENTS, _codex_home, _installed
from tests.support import LONG_TESTS, RunningProxy, db_rows
from trainer.model.weight_sync import WeightSync

ROOT = Path(__file__).resolve().parents[2]
TASKS = CODING_AGENTS / "tasks.jsonl"
TERSE_YAML = ROOT / "examples" / "train" / "terse.yaml"
# What the scripted model does for each task, in the file's order: two shell commands, then a closing word. The last
# task's edit is wrong on purpose, so its check fails and its judgement is 0.
# CI runs one of the four (CI time: each episode prefills a CLI's 18k-token prompt on CPU; the failing one runs in the
# fast tier, against the scripted engine); make test-long runs all four.
IN_CI = ("hello-file",)
SOLUTIONS = {"hello-file": ["echo hello > out.txt", "cat out.txt"],
             "fix-greeting": ["sed -i s/helo/hello/ greet.py", "python3 greet.py"],
             "count-lines": ["wc -l < data.txt > count.txt", "cat count.txt"],
             "add-function": ["printf 'def add(a, b):\\n    return a - b\\n' >> calc.py", "cat calc.py"]}


# The Harbor tasks of examples/harbor_tasks, done by a CLI in its sandbox: the commands each one runs. CI runs one task
# per CLI (HARBOR_IN_CI); make test-long runs every task with each.
HARBOR_TASKS = ROOT / "examples" / "harbor_tasks"
HARBOR_SOLUTIONS = {"hello-file": ["echo 'hello, harbor' > greeting.txt", "cat greeting.txt"],
                    "fix-failing-test": ["sed -i 's/(len(values) + 1)/len(values)/' mathutils.py",
                                         "python3 -m unittest -q test_mathutils"],
                    "write-script": ["printf '#!/bin/sh\\nwc -w < \"$1\"\\n' > wordcount.sh && chmod +x wordcount.sh",
                                     "./wordcount.sh data/sample.txt"],
                    "edit-config": ["sed -i '0,/port = 8000/s//port = 8088/' conf/server.ini", "cat conf/server.ini"]}
# aider has no shell tool: it applies the files its one reply writes whole (write-script needs a chmod it cannot do).
AIDER_EDITS = {"hello-file": "greeting.txt\n```\nhello, harbor\n```",
               "fix-failing-test": 'mathutils.py\n```python\ndef mean(values):\n    """The arithmetic mean of a '
                                   'non-empty list of numbers."""\n    return sum(values) / len(values)\n```',
               "edit-config": "conf/server.ini\n```ini\n[http]\nhost = 127.0.0.1\nport = 8088\n\n[log]\nlevel = info\n"
                              "port = 514\n```"}
# Qwen Code calls through Node's own fetch, whose HTTP parser is WebAssembly: it is the CLI that proves the tasks'
# memory_mb caps writable memory (RLIMIT_DATA), not address space, which V8 reserves by the gigabyte for Wasm.
HARBOR_IN_CI = {"codex": ("hello-file",), "claude": ("fix-failing-test",), "opencode": ("edit-config",),
                "qwen": ("hello-file",), "mini": ("write-script",), "aider": ("fix-failing-test",)}
# Each CLI's shell tool (its name and the argument holding the command), as the CLI declares it.
SHELL_TOOLS = {"codex": ("exec_command", "cmd"), "claude": ("Bash", "command"), "opencode": ("bash", "command"),
               "qwen": ("run_shell_command", "command"), "mini": ("bash", "command")}
# "File /app/mathutils.py has not been read in this session. Use the read_file tool first": Qwen Code's answer to
# a `sed -i` of a file it has not read (its read_file takes an absolute path).
QWEN_READS = {"fix-failing-test": "/app/mathutils.py"}
AGENTS_VENV = ROOT / ".venv-agents"  # mini-swe-agent (make install: examples/coding_agents/requirements.txt)
AIDER_VENV = ROOT / ".venv-aider"  # aider (make install: examples/coding_agents/requirements-aider.txt)


def _harbor_replies(agent: str, name: str) -> list[str]:
    """What the forced model replies to `agent` on Harbor task `name`: the task's two commands through the CLI's
    shell tool, then its closing reply (mini-swe-agent's is its submit command); aider's one reply is the edit."""
    if agent == "aider":
        return [AIDER_EDITS[name]]
    tool, key = SHELL_TOOLS[agent]
    calls = [_call(tool, {key: c, **({"description": "Run it"} if agent == "claude" else {})})
             for c in HARBOR_SOLUTIONS[name]]
    if agent == "qwen" and name in QWEN_READS:  # Qwen Code refuses a shell edit of a file it has not read
        calls.insert(0, _call("read_file", {"file_path": QWEN_READS[name]}))
    return [*calls, _call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}) if agent == "mini"
            else "done"]


CONTEXT = 32768


def _call(name: str, arguments: dict) -> str:
    """A Hermes tool call, as the tiny model's template writes one."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


REPLIES = {  # per agent: two shell calls, then the answer
    "codex": [_call("exec_command", {"cmd": "echo hello > out.txt"}), _call("exec_command", {"cmd": "cat out.txt"}),
              "done: out.txt says hello"],
    "claude": [_call("Bash", {"command": "echo hello > out.txt", "description": "Write it"}),
               _call("Bash", {"command": "cat out.txt", "description": "Show it"}), "done: out.txt says hello"],
}


@pytest.fixture(scope="module")
def forced_engine(tmp_path_factory):
    """The tiny model with a 32k context, served by vLLM with the forcing processor; (engine, model, replies file)."""
    root = tmp_path_factory.mktemp("long")
    model = build_tiny_model(root / "tiny-32k", seed=0)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    replies = root / "replies.json"
    engine = start_vllm(model, root / "engine", max_model_len=CONTEXT,
                        extra_args=["--logits-processors", "tests.forcing:ScriptedReplies"],
                        env={"HARNESS_SCRIPTED_REPLIES": str(replies), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                             "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    yield engine, model, replies
    engine.stop()


def _recording(engine, model: Path, tmp_path: Path) -> tuple[Path, RunningProxy]:
    """A proxy in front of the forced engine, recording into tmp_path/rec.duckdb. Claude Code asks for max_tokens
    128000, more than the whole context: capped, as its README says to serve it."""
    db = tmp_path / "rec.duckdb"
    return db, RunningProxy(engine.base_url, db, served_model=engine.served_model, tokenizer=str(model),
                            sampling=SamplingOverrides(max_tokens_cap=512))


@pytest.mark.parametrize("agent", ["codex", "claude"])
def test_a_coding_cli_on_the_real_engine_merges_into_one_sample(agent, forced_engine, tmp_path):
    _installed(agent)
    engine, model, replies = forced_engine
    replies.write_text(json.dumps(REPLIES[agent]))
    db, proxy = _recording(engine, model, tmp_path)
    scratch, home = tmp_path / "scratch", tmp_path / "home"
    scratch.mkdir()
    home.mkdir()
    try:
        command, settings = _cli(agent, proxy, tmp_path, "write hello into out.txt and show it")
        done = subprocess.run(command, cwd=scratch, capture_output=True, text=True, timeout=600,
                              stdin=subprocess.DEVNULL, **settings)
    finally:
        proxy.close()
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    assert json.loads(replies.read_text()) == []  # every scripted reply was asked for
    assert (scratch / "out.txt").read_text() == "hello\n"
    assert "done: out.txt says hello" in done.stdout
    with Store.open(db) as store:
        calls = store.load_calls(agent)
        merged = merge_episode(calls)
    assert [c.status for c in calls] == ["ok", "ok", "ok"]
    assert all(c.prompt_ids and c.choices[0].completion_ids for c in calls)  # the engine's own ids
    modes = [(c.extra.get("continuity") or {}).get("mode") for c in calls]
    assert modes[1:] == ["token_exact", "token_exact"], [c.extra.get("continuity") for c in calls]
    (sample,) = merged.samples
    assert merged.n_drift == 0 and sample.call_ids == [c.call_id for c in calls]
    for call in calls:  # every reply trained exactly as sampled
        start, ids = len(call.prompt_ids), call.choices[0].completion_ids
        assert sample.token_ids[start:start + len(ids)] == ids and set(sample.loss_mask[start:start + len(ids)]) == {1}


TASK = "Count the TODO lines in notes.txt and say how many there are."
PROMPT = "count the TODOs in notes.txt with a sub-agent"
# Parent and sub-agent may ask at once, so each reply names whose it is: the parent's prompt holds the user's PROMPT,
# the sub-agent's only the TASK it was handed.
PARENT, CHILD = {"when": PROMPT}, {"unless": PROMPT}
SUB_AGENT_REPLIES = {
    "codex": [
        {**PARENT, "reply": _call("multi_agent_v1__spawn_agent", {"message": TASK})},
        {**PARENT, "fill": {"id": r'"agent_id": ?"([^"]+)"'},
         "reply": _call("multi_agent_v1__wait_agent", {"targets": ["{id}"], "timeout_ms": 600000})},
        {**PARENT, "reply": "done: the sub-agent counted them"},
        {**CHILD, "reply": _call("exec_command", {"cmd": "grep -c TODO notes.txt"})},
        {**CHILD, "reply": "notes.txt has 2 TODO lines"}],
    "claude": [
        {**PARENT, "reply": _call("Agent", {"description": "Count TODOs", "prompt": TASK,
                                            "subagent_type": "general-purpose", "run_in_background": False})},
        {**PARENT, "reply": "done: the sub-agent counted them"},
        {**CHILD, "reply": _call("Bash", {"command": "grep -c TODO notes.txt", "description": "Count them"})},
        {**CHILD, "reply": "notes.txt has 2 TODO lines"}],
}


@pytest.mark.parametrize("agent", ["codex", "claude"])
def test_a_coding_clis_sub_agent_is_its_own_timeline_linked_to_the_call_that_started_it(agent, forced_engine,
                                                                                     tmp_path):
    """Codex's spawn_agent (then wait_agent) and Claude Code's Agent tool: the sub-agent's calls reach the same
    episode with their own system prompt and tools; they merge into a sample of their own, whose first call names
    the parent's call and tool call (merge_breaks.reason sub_agent), and the parent's calls into another; no drift."""
    _installed(agent)
    engine, model, replies = forced_engine
    replies.write_text(json.dumps(SUB_AGENT_REPLIES[agent]))
    db, proxy = _recording(engine, model, tmp_path)
    scratch, home = tmp_path / "scratch", tmp_path / "home"
    scratch.mkdir()
    home.mkdir()
    (scratch / "notes.txt").write_text("TODO: tests\nfine\nTODO: docs\n")
    try:
        command, settings = _cli(agent, proxy, tmp_path, PROMPT)
        done = subprocess.run(command, cwd=scratch, capture_output=True, text=True, timeout=600,
                              stdin=subprocess.DEVNULL, **settings)
    finally:
        proxy.close()
    asked = db_rows(db, "SELECT call_index, http_status, request->'$.messages[0].content', choices.text FROM calls "
                    "LEFT JOIN choices USING (call_id) ORDER BY call_index")
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:], replies.read_text(), asked)
    assert json.loads(replies.read_text()) == [], asked  # every scripted reply was asked for, each by its own agent
    assert "done: the sub-agent counted them" in done.stdout
    with Store.open(db) as store:
        calls = store.load_calls(agent)
        merged = merge_episode(calls)
    assert all(c.status == "ok" and c.prompt_ids and c.choices[0].completion_ids for c in calls), calls
    spawn = calls[0]
    (tool_call,) = spawn.choices[0].tool_calls
    children = [c for c in calls if PROMPT not in c.request.decode()]
    assert len(calls) == (5 if agent == "codex" else 4) and len(children) == 2
    assert [(b.call_id, b.reason) for b in merged.breaks] == [(spawn.call_id, FIRST_CALL),
                                                              (children[0].call_id, SUB_AGENT)]
    link = merged.breaks[1]
    assert (link.parent_call_id, link.parent_tool_call_id) == (spawn.call_id, tool_call["id"])
    parents = [c.call_id for c in calls if c not in children]
    assert sorted(s.call_ids for s in merged.samples) == sorted([parents, [c.call_id for c in children]])
    assert merged.n_drift == 0
    outputs = [m["content"] for m in orjson.loads(calls[-1].request)["messages"] if m["role"] == "tool"]
    assert any("2 TODO lines" in o for o in outputs), outputs  # the sub-agent's answer reached its parent


def _cli(agent: str, proxy: RunningProxy, tmp_path: Path, prompt: str) -> tuple[list[str], dict]:
    """The CLI's command line for `prompt` and its settings (environment), pointed at the proxy's episode `agent`."""
    if agent == "codex":
        command = [str(BIN / "codex"), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                   "--disable", "plugins", prompt]
        env = {"CODEX_HOME": str(_codex_home(tmp_path, f"{proxy.url}/e/{agent}/v1")), "HARNESS_KEY": "sk-any"}
    else:
        home = tmp_path / "home"
        home.mkdir(exist_ok=True)
        command = [str(BIN / "claude"), "-p", prompt, "--dangerously-skip-permissions"]
        env = {"HOME": str(home), "ANTHROPIC_BASE_URL": f"{proxy.url}/e/{agent}", "ANTHROPIC_API_KEY": "sk-any",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "IS_SANDBOX": "1"}
    return command, {"env": {**os.environ, **env}}


@pytest.mark.parametrize("agent", ["codex"])
def test_harness_run_judges_a_coding_cli_on_the_real_engine_and_trains_on_the_run(agent, forced_engine,
                                                                                 tmp_path):
    """The tasks of examples/coding_agents through `harness run` (each in its own scratch repository, judged by its
    check: all but add-function solved, that one solved wrongly on purpose; CI runs IN_CI's two), then one
    `--from-run` update on the passing episodes' engine tokens. One CLI is enough here (CI time):
    examples/coding_agents/coding_agent.py drives both the same way, and Claude Code on the real engine is the two
    tests above."""
    _installed(agent)
    engine, model, replies = forced_engine
    call = (lambda c: _call("exec_command", {"cmd": c})) if agent == "codex" else (
        lambda c: _call("Bash", {"command": c, "description": "Run it"}))
    tasks = [t for t in map(json.loads, TASKS.read_text().splitlines()) if LONG_TESTS or t["id"] in IN_CI]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    solutions = {t["id"]: SOLUTIONS[t["id"]] for t in tasks}
    replies.write_text(json.dumps([r for commands in solutions.values() for r in (*map(call, commands), "done")]))
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--cmd",
                           f"{sys.executable} {CODING_AGENTS / 'coding_agent.py'} {agent}", "--data",
                           str(tmp_path / "tasks.jsonl"),
                           "--judge", "exact_match", "--upstream", engine.base_url, "--concurrency", "1",
                           "--max-tokens-cap", "512", "--timeout", "300", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(replies.read_text()) == []
    db = run_dir / "harness.duckdb"
    rewards = dict(db_rows(db, "SELECT e.task_id, j.reward FROM episode_outcomes e JOIN judgements j USING "
                           "(episode_id)"))
    want = {"hello-file": 1.0, "fix-greeting": 1.0, "count-lines": 1.0, "add-function": 0.0}
    assert rewards == {name: want[name] for name in solutions}
    assert db_rows(db, "SELECT count(*), bool_and(prompt_ids IS NOT NULL) FROM calls WHERE status = 'ok'") == [
        (3 * len(solutions), True)]
    passed = sum(want[name] == 1.0 for name in solutions)
    (run_id,), = db_rows(db, "SELECT DISTINCT run_id FROM episode_outcomes")
    trained = subprocess.run([sys.executable, "-m", "harness.cli", "train", str(TERSE_YAML),
                              f"--set=model.path={model}", f"--set=logging.run_dir={tmp_path / 'train'}",
                              "--set=experiment_name=coding", "--set=logging.console=false",
                              "--set=logging.curve_png=false", f"--from-run={run_id}", f"--db={db}",
                              "--where=reward >= 1", f"--set=offline.batch_size={passed}"],
                             capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    metrics = dict(db_rows(tmp_path / "train" / "coding" / "harness.duckdb",
                           "SELECT name, value FROM metrics WHERE name IN ('offline/episodes', 'offline/samples')"))
    assert metrics == {"offline/episodes": passed, "offline/samples": passed}  # each passing episode one sample


@pytest.mark.parametrize("agent", list(HARBOR_IN_CI))
def test_a_coding_cli_in_its_sandbox_solves_harbor_tasks_on_the_real_engine(agent, forced_engine, tmp_path):
    """A coding agent, unmodified, through `harness run` over Harbor tasks: each episode in its bubblewrap sandbox
    (the agent's install bound read-only, the proxy its only way out), the verifier's reward stored, every call
    recorded with the engine's ids. The npm CLIs (Codex, Claude Code, opencode, Qwen Code) call their shell tools;
    mini-swe-agent (PyPI, through litellm) ends by its own submit command; aider writes the files in its reply."""
    if agent in ("mini", "aider"):
        install = AGENTS_VENV if agent == "mini" else AIDER_VENV
        assert (install / "bin" / agent).exists(), f"no {agent} in {install.name}: `make install`"
    else:
        _installed(agent)
        install = CODING_AGENTS / "node_modules"
    engine, model, replies = forced_engine
    solvable = AIDER_EDITS if agent == "aider" else HARBOR_SOLUTIONS
    names = sorted(n for n in solvable if LONG_TESTS or n in HARBOR_IN_CI[agent])  # the order they run in
    for name in names:
        shutil.copytree(HARBOR_TASKS / name, tmp_path / "tasks" / name)
    replies.write_text(json.dumps([r for n in names for r in _harbor_replies(agent, n)]))
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--cmd",
                           f"{sys.executable} {CODING_AGENTS / 'coding_agent.py'} {agent}", "--data",
                           str(tmp_path / "tasks"), "--sandbox-bind", str(install),
                           "--upstream", engine.base_url, "--concurrency", "1", "--max-tokens-cap", "512",
                           "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(replies.read_text()) == []
    db = run_dir / "harness.duckdb"
    rows = db_rows(db, "SELECT o.task_id, o.status, o.sandbox->>'backend', j.judge, j.reward FROM episode_outcomes o "
                   "JOIN judgements j USING (episode_id) ORDER BY 1")
    assert rows == [(n, "finished", "bwrap", "harbor:tests/test.sh", 1.0) for n in sorted(names)], rows
    assert db_rows(db, "SELECT count(*), bool_and(prompt_ids IS NOT NULL) FROM calls WHERE status = 'ok'") == [
        (sum(len(_harbor_replies(agent, n)) for n in names), True)]


def test_harness_train_over_harbor_tasks_with_a_sandboxed_cli(forced_engine, tmp_path):
    """The closed loop over a Harbor task: `harness train`, two steps of two Codex episodes each in its sandbox,
    judged by the task's tests/test.sh. The first step's second episode writes the wrong file on purpose, so its
    verifier's 0 beside the other's 1 gives GRPO an advantage to train on; the new weights reach the engine."""
    _installed("codex")
    engine, model, replies = forced_engine
    shutil.copytree(HARBOR_TASKS / "hello-file", tmp_path / "tasks" / "hello-file")
    call = lambda c: _call("exec_command", {"cmd": c})  # noqa: E731
    right, wrong = HARBOR_SOLUTIONS["hello-file"], ["echo 'hello, world' > greeting.txt", "cat greeting.txt"]
    replies.write_text(json.dumps([r for commands in (right, wrong, right, right)
                                   for r in (*map(call, commands), "done")]))
    config = tmp_path / "harbor.yaml"
    config.write_text(json.dumps({"harness": {
        "experiment_name": "harbor", "model": {"path": str(model)}, "data": {"train": str(tmp_path / "tasks")},
        "rollout": {"command": f"{sys.executable} {CODING_AGENTS / 'coding_agent.py'} codex",
                    "sandbox_binds": [str(CODING_AGENTS / "node_modules")], "num_repeat": 2, "batch_size": 1,
                    "concurrency": 1, "timeout_s": 600, "max_tokens": 512, "engine": {"url": engine.base_url}},
        "trainer": {"total_steps": 2, "lr": 1e-3, "micro_batch_tokens": CONTEXT, "warmup_steps": 0,
                    "test_freq": 0, "save_freq": 0},
        "logging": {"run_dir": str(tmp_path / "runs"), "console": False, "curve_png": False}}}))
    try:
        done = subprocess.run([sys.executable, "-m", "harness.cli", "train", str(config)], capture_output=True,
                              text=True, timeout=1800)
    finally:
        WeightSync(engine.base_url, tmp_path / "restore").load(model, 0)  # the module's engine as it was
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(replies.read_text()) == []
    db = tmp_path / "runs" / "harbor" / "harness.duckdb"
    rewards = db_rows(db, "SELECT o.run_id, o.sandbox->>'backend', j.judge, j.reward FROM episode_outcomes o "
                      "JOIN judgements j USING (episode_id) ORDER BY o.run_id, o.repeat_index")
    assert [r[1:] for r in rewards] == [("bwrap", "harbor:tests/test.sh", reward) for reward in (1.0, 0.0, 1.0, 1.0)]
    means = db_rows(db, "SELECT step, value FROM metrics WHERE name = 'reward/mean' ORDER BY step")
    assert [v for _, v in means] == [0.5, 1.0]  # the verifier's rewards are what GRPO trained on
    [(grad,)] = db_rows(db, "SELECT max(value) FROM metrics WHERE name = 'actor/grad_norm' AND step = 1")
    assert grad > 0  # the first step's advantage moved the policy


COMPACT_SUMMARY = ("The user asked to write hello into out.txt and show it. I wrote it with echo and showed it with "
                   "cat; out.txt says hello, and nothing is left to do.")
ASKS_SUMMARY = "create a detailed summary of the conversation"  # Claude Code's summary request


def test_claude_codes_compaction_is_its_own_timeline_linked_to_the_summary_call(forced_engine, tmp_path):
    """Claude Code compacts a session (`/compact`, as its auto-compaction does near the context's end): a request
    to summarise the history, then a conversation that goes on from the summary. The summary call continues the
    task's timeline; the one after it is a `compaction` break naming the summary call, merged apart."""
    _installed("claude")
    engine, model, replies = forced_engine
    task = [_call("Bash", {"command": "echo hello > out.txt", "description": "Write it"}),
            _call("Bash", {"command": "cat out.txt", "description": "Show it"}), "done: out.txt says hello"]
    summary = f"<analysis>\nWhat was asked and done.\n</analysis>\n\n<summary>\n{COMPACT_SUMMARY}\n</summary>"
    replies.write_text(json.dumps([*({"unless": ASKS_SUMMARY, "reply": r} for r in task),
                                   {"when": ASKS_SUMMARY, "reply": summary},
                                   {"unless": ASKS_SUMMARY, "reply": "done, again"}]))
    db, proxy = _recording(engine, model, tmp_path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    try:
        command, settings = _cli("claude", proxy, tmp_path, "write hello into out.txt and show it")
        for prompt, more in ((None, []), ("/compact", ["--continue"]), ("say it is done", ["--continue"])):
            argv = command if prompt is None else [command[0], "-p", prompt, *more, "--dangerously-skip-permissions"]
            done = subprocess.run(argv, cwd=scratch, capture_output=True, text=True, timeout=600,
                                  stdin=subprocess.DEVNULL, **settings)
            assert done.returncode == 0, (prompt, done.stdout[-2000:], done.stderr[-3000:])
    finally:
        proxy.close()
    assert json.loads(replies.read_text()) == []
    with Store.open(db) as store:
        calls = store.load_calls("claude")
    merged = merge_episode(calls)
    summary_call = next(c for c in calls if c.choices and COMPACT_SUMMARY in (c.choices[0].text or ""))
    [compaction] = [b for b in merged.breaks if b.reason == COMPACTION]
    assert compaction.parent_call_id == summary_call.call_id
    after = next(c for c in calls if c.call_id == compaction.call_id)
    assert after.call_index > summary_call.call_index and after.choices[0].text == "done, again"
    by_call = {cid: s for s in merged.samples for cid in s.call_ids}
    assert by_call[summary_call.call_id] is by_call[calls[0].call_id]  # the summary ends the task's timeline
    assert by_call[after.call_id] is not by_call[calls[0].call_id]  # the compacted one merges apart


ASKS_CHECKPOINT = "CONTEXT CHECKPOINT COMPACTION"  # Codex's summary request (its local compaction prompt)


def test_codexs_auto_compaction_is_its_own_timeline_linked_to_the_summary_call(forced_engine, tmp_path):
    """Codex compacts on its own past `model_auto_compact_token_limit` (lowered here to 1000 tokens, under the first
    prompt): after the first tool call it asks for a handoff summary (without tools), then goes on from a history
    whose user message carries the summary: a `compaction` break naming the summary call, merged apart; every call
    holds the engine's ids."""
    _installed("codex")
    engine, model, replies = forced_engine
    replies.write_text(json.dumps([
        {"unless": ASKS_CHECKPOINT, "reply": _call("exec_command", {"cmd": "echo hello > out.txt"})},
        {"when": ASKS_CHECKPOINT, "reply": COMPACT_SUMMARY},
        {"unless": ASKS_CHECKPOINT, "reply": "done, after the summary"}]))
    db, proxy = _recording(engine, model, tmp_path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    try:
        command, settings = _cli("codex", proxy, tmp_path, "write hello into out.txt")
        config = Path(settings["env"]["CODEX_HOME"]) / "config.toml"
        config.write_text("model_auto_compact_token_limit = 1000\n" + config.read_text())  # a top-level key
        done = subprocess.run(command, cwd=scratch, capture_output=True, text=True, timeout=600,
                              stdin=subprocess.DEVNULL, **settings)
    finally:
        proxy.close()
    asked = db_rows(db, "SELECT call_index, http_status, choices.text FROM calls LEFT JOIN choices USING (call_id) "
                    "ORDER BY call_index")
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:], asked)
    assert json.loads(replies.read_text()) == [], asked
    assert (scratch / "out.txt").read_text() == "hello\n"
    with Store.open(db) as store:
        calls = store.load_calls("codex")
    assert len(calls) == 3 and all(c.status == "ok" and c.prompt_ids and c.choices[0].completion_ids for c in calls)
    merged = merge_episode(calls)
    first, summary_call, after = calls
    assert ASKS_CHECKPOINT in summary_call.request.decode() and summary_call.choices[0].text == COMPACT_SUMMARY
    assert COMPACT_SUMMARY in after.request.decode() and after.choices[0].text == "done, after the summary"
    # Codex asks for its summary without tools, so that call's prompt is no extension of the task's (the template
    # renders the tools first): a timeline of its own; the one after it goes on from the summary.
    assert [(b.call_id, b.reason, b.parent_call_id) for b in merged.breaks] == [
        (first.call_id, FIRST_CALL, None), (summary_call.call_id, TOOLS_CHANGED, None),
        (after.call_id, COMPACTION, summary_call.call_id)]
    assert [s.call_ids for s in merged.samples] == [[first.call_id], [summary_call.call_id], [after.call_id]]
    assert merged.n_drift == 0
