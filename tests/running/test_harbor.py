"""Harbor tasks (harness/running/harbor.py): the example set read and checked with its oracle through
`harness run --agent oracle` (real sandboxes, real DuckDB), the Dockerfile instructions the bubblewrap sandbox
honours and the ones it refuses, bad task dirs, and the verifier's reward files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.core.records import Task
from harness.running import harbor
from harness.running.dataset import run_dataset
from harness.running.runner import RunConfig
from harness.running.tasks import TaskError, read_tasks
from harness.running.vllm_server import attach
from tests.support import db_rows

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "harbor_tasks"


def _harness(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, cwd=cwd)


def _task_dir(root: Path, name: str = "t", *, dockerfile: str | None = "FROM x\nWORKDIR /app\n",
              test_sh: str = "echo 1 > /logs/verifier/reward.txt\n", toml: str = "", files: dict | None = None,
              solve: str | None = None) -> Path:
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "instruction.md").write_text(f"do {name}\n")
    (d / "tests" / "test.sh").write_text(test_sh)
    if toml:
        (d / "task.toml").write_text(toml)
    if dockerfile is not None:
        (d / "environment").mkdir()
        (d / "environment" / "Dockerfile").write_text(dockerfile)
    for rel, text in (files or {}).items():
        (d / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / "environment" / rel).write_text(text)
    if solve is not None:
        (d / "solution").mkdir()
        (d / "solution" / "solve.sh").write_text(solve)
    return d


def test_the_oracle_scores_every_example_task_it_can_prepare_and_names_the_one_it_cannot(tmp_path):
    result = _harness("run", "--agent", "oracle", "--data", str(EXAMPLES), "--run-dir", str(tmp_path / "run"),
                      cwd=tmp_path)
    assert result.returncode == 1, result.stderr  # one task is refused, so not every oracle scores 1
    assert "oracle: 4 of 5 tasks score 1" in result.stderr
    assert "needs-install" in result.stderr and "RUN pip install" in result.stderr
    rows = db_rows(tmp_path / "run" / "harness.duckdb",
                   "SELECT o.task_id, o.status, j.judge, j.reward, o.error, o.sandbox->>'workdir' "
                   "FROM episode_outcomes o LEFT JOIN judgements j USING (episode_id) ORDER BY 1")
    by_task = {r[0]: r[1:] for r in rows}
    assert set(by_task) == {"edit-config", "fix-failing-test", "hello-file", "needs-install", "write-script"}
    for name in ("edit-config", "fix-failing-test", "hello-file", "write-script"):
        assert by_task[name][:3] == ("finished", harbor.JUDGE, 1.0), (name, by_task[name])
    assert by_task["edit-config"][4] == "/srv/app"  # ENV APP_HOME then WORKDIR $APP_HOME
    status, judge, _, error, _ = by_task["needs-install"]
    assert status == "not_prepared" and judge is None
    assert "Dockerfile:3" in error and "needs a sandbox backend that builds images" in error
    [(details,)] = db_rows(tmp_path / "run" / "harness.duckdb",
                           "SELECT j.details FROM judgements j JOIN episode_outcomes o USING (episode_id) "
                           "WHERE o.task_id = 'write-script'")
    assert json.loads(details)["rewards"] == {"cases_passed": 3, "executable": 1}  # reward.json's other names


async def test_a_wrong_oracle_scores_0_and_a_verifier_without_reward_is_an_error(upstream, tmp_path):
    root = tmp_path / "tasks"
    _task_dir(root, "wrong", test_sh="[ -f /app/x ] && echo 1 > /logs/verifier/reward.txt || "
              "echo 0 > /logs/verifier/reward.txt\n", solve="touch y\n")
    _task_dir(root, "silent", test_sh="exit 0\n", solve="true\n")
    _task_dir(root, "nan", test_sh="echo many > /logs/verifier/reward.txt\n", solve="true\n")
    _task_dir(root, "slow", test_sh="sleep 600\n", toml="[verifier]\ntimeout_sec = 1\n", solve="true\n")
    _task_dir(root, "link", test_sh="ln -s /etc/hostname /logs/verifier/reward.txt\n", solve="true\n")
    config = RunConfig(command=list(harbor.ORACLE_COMMAND), judge=None, oracle=True, timeout_s=600)
    await run_dataset(read_tasks(root), config, attach(upstream.url), tmp_path / "run", progress=False)
    rows = db_rows(tmp_path / "run" / "harness.duckdb",
                   "SELECT o.task_id, j.reward, j.error FROM episode_outcomes o JOIN judgements j USING (episode_id)")
    by_task = {r[0]: r[1:] for r in rows}
    assert by_task["wrong"] == (0.0, None)
    assert by_task["silent"][0] is None and "wrote no /logs/verifier/reward.txt or reward.json" in by_task["silent"][1]
    assert by_task["nan"][0] is None and "'many'" in by_task["nan"][1] and "expected one number" in by_task["nan"][1]
    assert by_task["slow"][0] is None and "verifier's 1 s timeout" in by_task["slow"][1]
    assert by_task["link"][0] is None and "reward.txt is not a plain file" in by_task["link"][1]  # not followed


def test_the_dockerfile_instructions_the_sandbox_honours(tmp_path):
    d = _task_dir(tmp_path, "t", dockerfile=(
        "# a comment\nFROM python:3.11-slim AS base\nARG NAME=proj\nENV A=1 B=\"two words\"\nENV OLD legacy form\n"
        "WORKDIR /work\nWORKDIR $NAME\nCOPY a.txt ./\nCOPY dir/ sub/\nADD b.txt c.txt ./many/\nCOPY *.md ./docs/\n"
        "USER root\nEXPOSE 80\nCMD [\"bash\"]\n"),
        files={"a.txt": "a", "b.txt": "b", "c.txt": "c", "dir/x.txt": "x", "one.md": "1", "two.md": "2"},
        toml="[agent]\ntimeout_sec = 30\n[verifier]\ntimeout_sec = 20\n[environment]\ncpus = 1.5\nmemory_mb = 1024\n"
             "[metadata]\nsplit = \"test\"\n")
    assert read_tasks(d) == []  # its split is test
    [task] = read_tasks(d, split="test")
    h = task.data[harbor.KEY]
    assert h["workdir"] == "/work/proj" and h["env"] == {"A": "1", "B": "two words", "OLD": "legacy form"}
    assert (h["agent_timeout_s"], h["verifier_timeout_s"], h["cpus"], h["memory_mb"]) == (30, 20, 1.5, 1024)
    assert h["image"] == "python:3.11-slim AS base" and set(h["ignored"]) == {"EXPOSE", "CMD"}
    workspace = tmp_path / "ws"
    assert harbor.prepare(task, workspace) == []
    files = sorted(str(p.relative_to(workspace)) for p in workspace.rglob("*") if p.is_file())
    assert files == ["a.txt", "docs/one.md", "docs/two.md", "many/b.txt", "many/c.txt", "sub/x.txt"]
    assert harbor.agent_task(task) == {"task_id": "t", "prompt": "do t"}  # nothing of where the task lives


@pytest.mark.parametrize("line, why", [
    ("RUN apt-get install -y git", "RUN changes the image"),
    ("FROM other", "a multi-stage build"),
    ("COPY --from=builder /out ./", "a copy from another stage"),
    ("ADD https://example.com/x.tar ./", "ADD of a URL"),
    ("ADD a.tar.gz ./", "ADD of an archive"),
    ("USER agent", "another user than root"),
    ("COPY a.txt /etc/a.txt", "outside the workdir /app"),
    ("COPY ../secret ./", "outside the build context"),
    ("COPY missing.txt ./", "not in the build context"),
    ("WORKDIR /tests", "cannot be a sandbox's workspace"),
    ("ONBUILD RUN make", "ONBUILD changes the image"),
])
def test_a_dockerfile_the_sandbox_cannot_honour_refuses_its_task_naming_the_line(tmp_path, line, why):
    (tmp_path / "secret").write_text("s")
    _task_dir(tmp_path / "set", "bad", dockerfile=f"FROM x\nWORKDIR /app\n{line}\n",
              files={"a.txt": "a", "a.tar.gz": "z"})
    _task_dir(tmp_path / "set", "good")
    tasks = {t.task_id: t for t in read_tasks(tmp_path / "set")}
    assert tasks["good"].data[harbor.KEY]["not_prepared"] is None
    problem = tasks["bad"].data[harbor.KEY]["not_prepared"]
    assert why in problem and "task 'bad'" in problem and "environment/Dockerfile" in problem, problem
    with pytest.raises(TaskError, match=why):  # the task dir given alone: a clear error at once
        read_tasks(tmp_path / "set" / "bad")


def test_bad_task_dirs_are_clear_errors_naming_the_task_and_the_file(tmp_path):
    (tmp_path / "no-instruction" / "tests").mkdir(parents=True)
    (tmp_path / "no-instruction" / "task.toml").write_text("")
    _task_dir(tmp_path, "no-tests")
    (tmp_path / "no-tests" / "tests" / "test.sh").unlink()
    _task_dir(tmp_path, "bad-toml", toml="[agent\ntimeout_sec = 3\n")
    _task_dir(tmp_path, "bad-timeout", toml="[agent]\ntimeout_sec = \"soon\"\n")
    for name, says in [("no-instruction", "instruction.md is missing"), ("no-tests", "tests/test.sh is missing"),
                       ("bad-toml", "task.toml does not parse as TOML"),
                       ("bad-timeout", "[agent] timeout_sec = 'soon': expected a positive number")]:
        with pytest.raises(TaskError) as caught:
            read_tasks(tmp_path / name)
        assert f"task {name!r}" in str(caught.value) and says in str(caught.value), caught.value
    problems = {t.task_id: t.data[harbor.KEY]["not_prepared"] for t in read_tasks(tmp_path)}
    assert set(problems) == {"no-instruction", "no-tests", "bad-toml", "bad-timeout"} and all(problems.values())


@pytest.mark.parametrize("name, text, reward, details", [
    ("reward.txt", " 0.75\n", 0.75, {}),
    ("reward.json", '{"reward": 0.5, "style": 1}', 0.5, {"rewards": {"style": 1}}),
    ("reward.json", '{"passed": 1}', 1.0, {}),
    ("reward.json", '{"reward": 1, "role_rewards": {"coder": 1, "reviewer": 0}}', 1.0,
     {"role_rewards": {"coder": 1.0, "reviewer": 0.0}}),
])
def test_reward_files(tmp_path, name, text, reward, details):
    (tmp_path / name).write_text(text)
    assert harbor.read_reward(tmp_path, "t", 0) == (reward, details)


@pytest.mark.parametrize("name, text, says", [
    ("reward.txt", "nan", "expected one number"),
    ("reward.json", "[1]", "expected an object of named numbers"),
    ("reward.json", '{"a": 1, "b": 2}', 'say which is the reward with a "reward" entry'),
    ("reward.json", '{"reward": "high"}', "reward not a number"),
    ("reward.json", "{", "is not JSON"),
])
def test_bad_reward_files_are_errors_naming_the_task(tmp_path, name, text, says):
    (tmp_path / name).write_text(text)
    with pytest.raises(TaskError, match="task 't'") as caught:
        harbor.read_reward(tmp_path, "t", 0)
    assert says in str(caught.value)


def test_harbor_tasks_refuse_a_run_on_the_host_and_another_judge(tmp_path):
    for extra, says in [(["--sandbox", "none"], "run only in a sandbox"),
                        (["--judge", "exact_match"], "judged by their own tests/test.sh")]:
        result = _harness("run", "--cmd", "true", "--upstream", "http://127.0.0.1:9", "--data",
                          str(EXAMPLES / "hello-file"), "--run-dir", str(tmp_path / "run"), *extra, cwd=tmp_path)
        assert result.returncode == 2 and says in result.stderr, result.stderr


def test_without_bwrap_the_error_says_how_to_install_it(tmp_path):
    result = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--agent", "oracle", "--data",
                             str(EXAMPLES / "hello-file"), "--run-dir", str(tmp_path / "run")],
                            capture_output=True, text=True, cwd=tmp_path,
                            env={**os.environ, "PATH": str(tmp_path)})
    assert result.returncode == 2 and "apt-get install bubblewrap" in result.stderr, result.stderr


def test_the_oracle_needs_harbor_tasks(tmp_path):
    data = tmp_path / "tasks.jsonl"
    data.write_text(json.dumps({"id": "x", "prompt": "p"}) + "\n")
    result = _harness("run", "--agent", "oracle", "--data", str(data), "--run-dir", str(tmp_path / "run"),
                      cwd=tmp_path)
    assert result.returncode == 2 and "runs Harbor tasks' solution/solve.sh" in result.stderr, result.stderr


def test_a_task_object_is_harbor_only_with_its_key():
    assert not harbor.is_harbor(Task("t", {"prompt": "p"}))



def test_the_easy_task_set_of_the_real_model_bench_scores_its_oracle_1_and_partial_work_less(tmp_path):
    """bench/easy_harbor_tasks.py (what bench/coding_agent_learns.py trains SmolLM2 on): held-out tasks in a split of
    their own, with names no training task uses; each kind's oracle scores 1, partial work 0.5 and none 0."""
    from bench.easy_harbor_tasks import KINDS, TEST_NAMES, TRAIN_NAMES, make_tasks, write_task

    tasks = make_tasks(tmp_path / "tasks", train=4, test=4)
    assert [t.task_id for t in read_tasks(str(tasks))] == [f"train-{i:02d}-{k}" for i, k in enumerate(KINDS)]
    assert [t.task_id for t in read_tasks(str(tasks), split="test")] == [f"test-{i:02d}-{k}"
                                                                         for i, k in enumerate(KINDS)]
    assert not set(TEST_NAMES) & set(TRAIN_NAMES)
    partial = {"write": "echo notes notes > notes.txt", "mkdir": "touch notes", "rename": "cp notes.txt plan.txt",
               "delete": "rm notes.txt plan.txt"}
    for variant, want in (("oracle", 1.0), ("partial", 0.5), ("none", 0.0)):
        for kind in KINDS:
            write_task(tmp_path / variant, kind, "train", kind, "notes", "apple", "plan")
            if variant != "oracle":
                command = partial[kind] if variant == "partial" else "true"
                (tmp_path / variant / kind / "solution" / "solve.sh").write_text(f"#!/bin/bash\n{command}\n")
        result = _harness("run", "--agent", "oracle", "--data", str(tmp_path / variant), "--run-dir",
                          str(tmp_path / f"run-{variant}"), cwd=tmp_path)
        rewards = dict(db_rows(tmp_path / f"run-{variant}" / "harness.duckdb", "SELECT o.task_id, j.reward FROM "
                               "episode_outcomes o JOIN judgements j USING (episode_id)"))
        assert rewards == dict.fromkeys(KINDS, want), (variant, result.stderr[-2000:])
