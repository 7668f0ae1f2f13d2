"""Run an unmodified agent over a dataset: one subprocess per episode, wired to its own episode of the proxy.

For each task and repeat the agent gets:
- `OPENAI_BASE_URL` = its episode-scoped proxy URL, `OPENAI_API_KEY` = its episode token;
- the task as JSON on stdin and in `HARNESS_TASK`; its episode id in `HARNESS_EPISODE_ID`;
- in transparent mode, also the proxy and CA environment that sends hard-coded LLM hosts to the same episode
  (proxy/transparent.py).
Its answer is its stdout: the last line that is a JSON object with an "answer" field wins, else the last
non-empty line. Its stderr goes to `<run_dir>/episodes/<episode>.log`.

An agent that crashes, hangs or prints nothing is an episode with a failure cause, never a crashed run. Only
infrastructure failures (the engine unreachable) are retried, never a wrong answer.

Debug mode (`RunConfig.debug`; `harness run --debug`, `harness train --debug`) is for breakpoints in agent or judge
code, and changes only how episodes run, not what is recorded:
- one episode at a time, in order, whatever `concurrency` says;
- the agent shares the runner's terminal: its stdin is the runner's stdin, so the task is given in `HARNESS_TASK`
  only (an agent that reads its task from stdin waits for you to type it); its stderr and stdout are shown on the
  runner's stderr as they come (stderr still goes to the episode's log too, stdout is still parsed for the answer),
  with `PYTHONUNBUFFERED=1` unless the environment sets it; a `breakpoint()` in the agent talks to you there;
- the agent stays in the runner's process group, so Ctrl-C reaches it (and stops the run, as it always does);
  stopping the run kills the agent process itself, but no longer the children it started (a process group of its
  own would cut it off from the terminal); Ctrl-C reaches those too;
- nothing is timed out, neither episodes nor judgements: a breakpoint holds them for as long as you like;
- the judge runs in this process (`InProcessJudge`), so a breakpoint in judge code works too; a judge that raises
  is still an error judgement, but one that hangs or crashes the interpreter takes the run with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from harness.core.records import (
    CRASHED,
    FINISHED,
    INFRA_ERROR,
    INTERRUPTED,
    NO_OUTPUT,
    NOT_PREPARED,
    TIMED_OUT,
    EpisodeOutcome,
    Judgement,
    Task,
)
from harness.running import harbor
from harness.running.judge_pool import InProcessJudge, JudgePool
from harness.running.limits import AGENT_MAX_PROCS, AGENT_MEMORY_MB, limited, release
from harness.running.sandboxed import EpisodeSandboxes
from harness.running.tasks import TaskError, instance_for
from harness.running.terminal import Terminal
from harness.running.warm import WarmProcess, WarmStarter, script_of
from harness.sandbox import SandboxError
from proxy.server import ProxyServer

_UPSTREAM_TROUBLE = (502, 503, 504)
_STDERR_TAIL = 800
_SAFE_PART = re.compile(r"[A-Za-z0-9._:@+-]{1,64}")
_UNSAFE = re.compile(r"[^A-Za-z0-9._:@+-]")


@dataclass(frozen=True)
class RunConfig:
    command: list[str]  # the agent command, e.g. [sys.executable, "agent.py"]
    judge: str | None  # judge spec; None: record and report without rewards
    repeat: int = 1  # episodes per task (the GRPO group size)
    concurrency: int = 4  # episodes running at once
    timeout_s: float = 300.0  # per episode; the agent's whole process group is killed after it
    retries: int = 2  # extra attempts for infrastructure failures only
    judge_timeout_s: float = 60.0
    judge_workers: int = 2
    cwd: Path | None = None  # where agents run (default: the current directory)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for agents
    hidden_env: tuple[str, ...] = ()  # variables agents never see (e.g. a frozen role's upstream key)
    debug: bool = False  # one episode at a time, agent on the terminal, judge in this process, no timeouts
    memory_mb: int | None = AGENT_MEMORY_MB  # RLIMIT_DATA of each agent (harness/running/limits.py); None: none
    max_procs: int | None = AGENT_MAX_PROCS  # processes and threads of each agent with its children; None: none
    warm_start: bool = True  # `python agent.py` forks from an interpreter with the SDK imported (running/warm.py)
    sandbox: str | None = None  # each episode in a sandbox of this backend (harness/sandbox/: "bwrap"); Harbor tasks
    #                             always are (bwrap unless named); None: other tasks on the host
    sandbox_binds: tuple[str, ...] = ()  # more host paths a sandboxed agent needs, bound read-only at the same path
    blocked_commands: tuple[str, ...] = ()  # commands refused (and flagged) in a sandbox, e.g. ("git", "pip", "curl")
    oracle: bool = False  # Harbor tasks: each task's solution/solve.sh is the agent (checks the task set)
    keep_workspaces: bool = False  # keep each sandboxed episode's workspace under <run_dir>/workspaces/ after judging

    def __post_init__(self):
        for name in ("repeat", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout_s}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")


def episode_part(task_id: str) -> str:
    """A task id as it goes into episode ids (URLs, log file names): as is when it is made of letters, digits and
    `._:@+-` and short; else those characters with `_` for the others, and a digest of the original, so two
    tasks never share an id and no id names a path (`gsm8k/test/12` -> `gsm8k_test_12.3f9a0c21`)."""
    if _SAFE_PART.fullmatch(task_id) and task_id[0] not in "._":
        return task_id
    digest = hashlib.sha256(task_id.encode()).hexdigest()[:8]
    return f"{_UNSAFE.sub('_', task_id)[:64].lstrip('._')}.{digest}".lstrip(".")


def parse_answer(stdout: str) -> str | None:
    """The agent's answer: the last JSON line with an "answer" field, else the last non-empty line."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and "answer" in obj:
                answer = obj["answer"]
                return answer if isinstance(answer, str) or answer is None else json.dumps(answer)
    return lines[-1] if lines else None


@dataclass
class EpisodeSlot:
    """One planned episode: which task, which sample of its group."""

    task: Task
    repeat_index: int
    episode_id: str


def model_env(proxy_url: str, episode_id: str, api_key: str) -> dict[str, str]:
    """Where an episode's agent finds its model: the episode's proxy URL and token, as the OpenAI SDKs read them
    (OPENAI_*) and as their Azure clients do (AZURE_OPENAI_*: AzureOpenAI calls Azure's deployment URLs under it)."""
    return {"OPENAI_BASE_URL": f"{proxy_url}/e/{episode_id}/v1", "OPENAI_API_KEY": api_key,
            "AZURE_OPENAI_ENDPOINT": f"{proxy_url}/e/{episode_id}", "AZURE_OPENAI_API_KEY": api_key}


def plan_episodes(run_id: str, tasks: list[Task], repeat: int) -> list[EpisodeSlot]:
    """`repeat` episodes of each task. A task given twice (a training batch larger than its dataset) gets twice as
    many: its repeat indices go on from the first time, so episode ids stay distinct and it is one group."""
    slots, given = [], Counter()
    for t in tasks:
        first = given[t.task_id] * repeat
        given[t.task_id] += 1
        slots += [EpisodeSlot(t, r, f"{run_id}-{episode_part(t.task_id)}-{r}") for r in range(first, first + repeat)]
    return slots


class Runner:
    """Runs the episodes of one run against a started proxy, records outcomes, judges them."""

    def __init__(self, config: RunConfig, *, run_id: str, proxy: ProxyServer, run_dir: Path,
                 on_episode: Callable[[EpisodeOutcome, Judgement | None], None] | None = None,
                 episode_env: Callable[[str, str], dict[str, str]] | None = None,
                 judge_pool: JudgePool | InProcessJudge | None = None, warm: WarmStarter | None = None):
        self.config = config
        self.run_id = run_id
        self.proxy = proxy  # a started proxy, whose loop this runner runs on: episodes, store, recorder
        self.store = proxy.store
        self.log_dir = run_dir / "episodes"
        self.on_episode = on_episode
        self.episode_env = episode_env  # (episode_id, api_key) -> more environment (transparent mode's hop)
        self.shared_judges = judge_pool  # the caller's pool, used and left open; None: one of our own per run()
        self.shared_warm = warm  # the caller's warm starter, used and left open; None: one of our own per run()
        self._warm: WarmStarter | None = None
        self.sandboxes = EpisodeSandboxes(config, proxy, run_dir)  # where sandboxed episodes run
        self.outcomes: list[EpisodeOutcome] = []
        self.judgements: list[Judgement] = []
        self.judge_s = 0.0  # seconds spent waiting for judges, summed over episodes (they overlap agents' runs)
        self._stopping = asyncio.Event()
        self._running: set[asyncio.subprocess.Process | WarmProcess] = set()

    def plan(self, tasks: list[Task]) -> list[EpisodeSlot]:
        return plan_episodes(self.run_id, tasks, self.config.repeat)

    @property
    def stopped(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        """Stop starting episodes and end the running ones (their outcomes say interrupted)."""
        self._stopping.set()
        for proc in list(self._running):
            self._kill(proc)

    async def run(self, tasks: list[Task]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self.store.add_tasks, self.run_id, tasks)
        slots = self.plan(tasks)
        gate = asyncio.Semaphore(1 if self.config.debug else self.config.concurrency)
        sandboxed = await self.sandboxes.start(tasks)  # before anything that needs closing: it may refuse
        pool = self.shared_judges or self._judge_pool()
        hosted = len(slots) - sandboxed * self.config.repeat
        self._warm = self.shared_warm or (await start_warm(self.config, self.log_dir.parent) if hosted > 1
                                          else None)  # a starter costs an interpreter with the SDK imported
        try:
            async def one(slot: EpisodeSlot) -> None:
                async with gate:
                    if not self._stopping.is_set():
                        await self._episode(slot, pool)

            await asyncio.gather(*(one(s) for s in slots))
        finally:
            if pool is not None and pool is not self.shared_judges:
                pool.close()
            if self._warm is not None and self._warm is not self.shared_warm:
                await self._warm.close()
            self._warm = None

    def _judge_pool(self) -> JudgePool | InProcessJudge | None:
        if self.config.judge is None:
            return None
        if self.config.debug:
            return InProcessJudge(self.config.judge)
        return JudgePool(self.config.judge, workers=self.config.judge_workers, timeout_s=self.config.judge_timeout_s)

    async def _not_prepared(self, slot: EpisodeSlot, why: str) -> None:
        outcome = EpisodeOutcome(slot.episode_id, self.run_id, slot.task.task_id, slot.repeat_index, 1, NOT_PREPARED,
                                 None, None, why, time.time(), 0.0, None)
        await asyncio.to_thread(self.store.add_outcome, outcome)
        self.outcomes.append(outcome)
        if self.on_episode is not None:
            self.on_episode(outcome, None)

    async def _episode(self, slot: EpisodeSlot, pool: JudgePool | InProcessJudge | None) -> None:
        if harbor.is_harbor(slot.task):
            why = slot.task.data[harbor.KEY]["not_prepared"]
            if why is None and self.config.oracle and not (
                    Path(slot.task.data[harbor.KEY]["path"]) / "solution" / "solve.sh").is_file():
                why = f"task {slot.task.task_id!r}: it has no solution/solve.sh for the oracle agent"
            if why is not None:
                return await self._not_prepared(slot, why)
        elif self.config.oracle:
            return await self._not_prepared(slot, f"task {slot.task.task_id!r} is not a Harbor task: the oracle "
                                                  "agent runs Harbor tasks' solution/solve.sh")
        attempt = 1
        while True:
            episode_id = slot.episode_id if attempt == 1 else f"{slot.episode_id}-retry{attempt - 1}"
            try:
                agent_task = (harbor.agent_task(slot.task) if harbor.is_harbor(slot.task)
                              else await asyncio.to_thread(instance_for, slot.task))
            except TaskError as exc:  # the environment service is down: not the agent's fault
                outcome = EpisodeOutcome(episode_id, self.run_id, slot.task.task_id, slot.repeat_index, attempt,
                                         INFRA_ERROR, None, None, str(exc), time.time(), 0.0, None)
                agent_task, calls = slot.task.data, []
            else:
                meta = {"task_id": slot.task.task_id, "repeat_index": slot.repeat_index, "attempt": attempt,
                        "task": agent_task}
                opened = await self.proxy.open_episode(episode_id, meta)
                outcome = await self._run_agent(slot, episode_id, attempt, agent_task, opened["api_key"])
                await asyncio.to_thread(self.proxy.flush)
                calls = await asyncio.to_thread(self.store.episode_calls, episode_id)
            if outcome.status != FINISHED and any(c["http_status"] in _UPSTREAM_TROUBLE or c["engine_fault"]
                                                  for c in calls):
                outcome = replace(outcome, status=INFRA_ERROR,
                                   error=f"the engine was unreachable during the episode; {outcome.error}")
            await asyncio.to_thread(self.store.add_outcome, outcome)  # every attempt is kept
            if outcome.status == INFRA_ERROR and attempt <= self.config.retries and not self._stopping.is_set():
                await self.sandboxes.forget(episode_id)  # the retry gets a fresh one
                attempt += 1
                await asyncio.sleep(min(2.0 ** attempt, 10.0))
                continue
            break
        self.outcomes.append(outcome)  # the last attempt stands for the slot
        judgement = None
        if harbor.is_harbor(slot.task) and outcome.status not in (INFRA_ERROR, INTERRUPTED, NOT_PREPARED):
            started = time.perf_counter()
            judgement = await self.sandboxes.verify(slot.task, episode_id,
                                                    self.log_dir / f"{episode_id}.verifier.log")
            self.judge_s += time.perf_counter() - started
        elif pool is not None and outcome.status not in (INFRA_ERROR, INTERRUPTED):
            started = time.perf_counter()
            judgement = await pool.judge(episode_id, agent_task, outcome.answer, calls)
            self.judge_s += time.perf_counter() - started
        if judgement is not None:
            await asyncio.to_thread(self.store.add_judgements, [judgement])
            self.judgements.append(judgement)
        await self.sandboxes.forget(episode_id)
        if self.on_episode is not None:
            self.on_episode(outcome, judgement)

    async def _run_agent(self, slot: EpisodeSlot, episode_id: str, attempt: int, agent_task: dict,
                         api_key: str) -> EpisodeOutcome:
        task_json, debug = json.dumps(agent_task), self.config.debug
        sandboxed, is_harbor = self.sandboxes.wanted(slot.task), harbor.is_harbor(slot.task)
        env = {**({"PYTHONUNBUFFERED": "1"} if debug else {}),
               **(self.sandboxes.env() if sandboxed else base_env(self.config)),
               **model_env(self.proxy.url, episode_id, api_key), "HARNESS_TASK": task_json,
               "HARNESS_EPISODE_ID": episode_id}
        if self.episode_env is not None:
            env.update(self.episode_env(episode_id, api_key))
        for name in self.config.hidden_env:  # the hop's environment may name them too
            env.pop(name, None)
        log_path = self.log_dir / f"{episode_id}.log"
        timeout_s = slot.task.data[harbor.KEY]["agent_timeout_s"] if is_harbor else self.config.timeout_s
        started, t0 = time.time(), time.perf_counter()
        status, error, exit_code, stdout = FINISHED, None, None, b""
        box, sandbox = None, None
        with open(log_path, "wb") as log:
            terminal = Terminal(log) if debug and not sandboxed else None
            try:
                proc = None
                if sandboxed:
                    box, sandbox = await self.sandboxes.open(slot.task, episode_id)
                    proc = await box.exec(self.sandboxes.command(), env=env, stdin=asyncio.subprocess.PIPE,
                                          stdout=asyncio.subprocess.PIPE, stderr=log)
                elif terminal is not None:
                    proc = await terminal.start(self.config.command, env=env, cwd=self.config.cwd)
                elif self._warm is not None and self._warm.takes(self.config.command, env, self.config.cwd):
                    with contextlib.suppress(OSError):  # the starter is gone: this episode starts cold
                        proc = await self._warm.spawn(self.config.command, env=env, cwd=self.config.cwd,
                                                      stderr=log.fileno(), memory_mb=self.config.memory_mb,
                                                      max_procs=self.config.max_procs)
                if proc is None:  # a session (and process group) of its own, killed whole when the episode ends
                    proc = await asyncio.create_subprocess_exec(
                        *limited(self.config.command, self.config.memory_mb, self.config.max_procs),
                        stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.PIPE, stderr=log, env=env, cwd=self.config.cwd,
                        start_new_session=True,
                    )
            except (OSError, SandboxError, TaskError) as exc:
                if box is not None:
                    await box.close()
                if isinstance(exc, TaskError):  # the task's workspace could not be made
                    return EpisodeOutcome(episode_id, self.run_id, slot.task.task_id, slot.repeat_index, attempt,
                                          NOT_PREPARED, None, None, str(exc), started, 0.0, str(log_path), sandbox)
                return EpisodeOutcome(episode_id, self.run_id, slot.task.task_id, slot.repeat_index, attempt,
                                      CRASHED, None, None, f"could not start {self.config.command[0]!r}"
                                      f"{' in its sandbox' if sandboxed else ''}: {exc}", started, 0.0,
                                      str(log_path), sandbox)
            self._running.add(proc)
            try:
                if terminal is not None:
                    stdout = await terminal.relay(proc)  # no timeout: a breakpoint may hold the agent for long
                else:
                    stdout, _ = await asyncio.wait_for(proc.communicate(task_json.encode()),
                                                       None if debug else timeout_s)
                exit_code = proc.returncode
            except TimeoutError:
                status, error = TIMED_OUT, f"the agent ran past the {timeout_s:g} s episode timeout" + (
                    " ([agent] timeout_sec)" if is_harbor else "")
            finally:
                self._kill(proc)  # a finished agent may still have children running
                await proc.wait()
                if self.config.max_procs and terminal is None:  # and some may have left its process group
                    await asyncio.to_thread(release, proc.pid)
                self._running.discard(proc)
                if box is not None:
                    closing = time.perf_counter()
                    await box.close()
                    sandbox["close_ms"] = (time.perf_counter() - closing) * 1000.0
                    sandbox["flags"] += box.flags
        duration_ms = (time.perf_counter() - t0) * 1000.0
        answer = parse_answer(stdout.decode("utf-8", "replace"))
        if status == FINISHED:
            if self._stopping.is_set() and exit_code is not None and exit_code < 0:
                status, error = INTERRUPTED, "the run was stopped while the agent was running"
            elif exit_code != 0:
                status, error = CRASHED, f"the agent exited with code {exit_code}: {_tail(log_path)}"
            elif answer is None and not is_harbor:  # a Harbor task's outcome is its workspace
                status, error = NO_OUTPUT, "the agent exited 0 but printed nothing on stdout"
        return EpisodeOutcome(episode_id, self.run_id, slot.task.task_id, slot.repeat_index, attempt, status,
                              exit_code, answer, error, started, duration_ms, str(log_path), sandbox)

    def _kill(self, proc: asyncio.subprocess.Process | WarmProcess) -> None:
        """Kill an agent and everything it started (its process group); in debug mode the agent shares the
        runner's process group, so only the agent itself is killed."""
        if self.config.debug:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        else:
            _kill_group(proc)


def base_env(config: RunConfig) -> dict[str, str]:
    """What every agent of `config` gets before its episode's own variables: ours, the config's, less the hidden."""
    env = {**os.environ, **config.env}
    for name in config.hidden_env:
        env.pop(name, None)
    return env


async def start_warm(config: RunConfig, run_dir: Path) -> WarmStarter | None:
    """A warm starter for the agents of `config` (running/warm.py), when they are `python agent.py` run by this
    interpreter and warm starts are on; None otherwise, or when it fails to start (the agents then start cold)."""
    if not config.warm_start or config.debug or script_of(config.command, config.cwd) is None:
        return None
    try:
        return await WarmStarter.start(base_env(config), run_dir / "warm-starter.log")
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"harness: agents start cold: the warm starter did not start ({exc})", file=sys.stderr)
        return None


def _kill_group(proc: asyncio.subprocess.Process | WarmProcess) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(path: Path) -> str:
    """The end of an agent's stderr: whole lines up to _STDERR_TAIL characters, and the last line (a traceback's
    exception, which names its type) whole even when it is longer."""
    try:
        text = path.read_bytes()[-4 * _STDERR_TAIL:].decode("utf-8", "replace").strip()
    except OSError:
        return "(no log)"
    kept: list[str] = []
    for line in reversed(text.splitlines()):
        if kept and sum(map(len, kept)) + len(line) > _STDERR_TAIL:
            break
        kept.append(line)
    return " | ".join(reversed(kept)) if kept else "(stderr was empty)"

