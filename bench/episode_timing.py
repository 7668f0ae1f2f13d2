"""What bench/episode_overhead.py times inside a harness episode: per-episode records, wrappers around the
runner's steps (installed for measurement only), and CPU accounting for this process, its children and the machine.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------------------------- records


@dataclass
class Episode:
    """One episode as measured (perf_counter for the slot, time.time for the agent process)."""

    spawned: float = 0.0  # unix time just before the agent was spawned
    reaped: float = 0.0  # unix time the agent process was reaped
    report: dict = field(default_factory=dict)  # what the agent printed: t_start, t_calls, t_calls_end, t_end
    wall: dict = field(default_factory=lambda: defaultdict(float))  # harness step -> seconds
    cpu: dict = field(default_factory=lambda: defaultdict(float))  # harness step -> this process's CPU seconds
    slot: tuple[float, float] = (0.0, 0.0)  # perf_counter at the slot's start and end
    slot_cpu: tuple[float, float] = (0.0, 0.0)  # process_time at the slot's start and end

    @property
    def agent_ms(self) -> float:
        return (self.reaped - self.spawned) * 1000

    @property
    def slot_ms(self) -> float:
        return (self.slot[1] - self.slot[0]) * 1000

    def phases_ms(self) -> dict[str, float]:
        r = self.report
        return {"start": (r["t_start"] - self.spawned) * 1000, "imports": (r["t_calls"] - r["t_start"]) * 1000,
                "calls": (r["t_calls_end"] - r["t_calls"]) * 1000, "exit": (self.reaped - r["t_end"]) * 1000}


@dataclass
class Arm:
    """One batch of episodes run one way at one concurrency."""

    kind: str  # "direct" or "harness"
    episodes: list[Episode]
    wall_s: float  # the whole call: for the harness, run_dataset from start to return
    phase_s: float  # first spawn (slot start) to the last episode done
    agent_cpu_s: float  # CPU of the agents (this process's reaped children)
    tree_cpu_s: float  # CPU of everything this benchmark runs: this process, the engine, agents, judge workers
    others_cores: float  # CPU used by processes outside this benchmark, in cores, during the arm
    own_cpu_s: float = 0.0  # this process's CPU over the episodes (harness: runner, proxy, recorder, DuckDB)
    judge_cpu_s: float = 0.0  # CPU of the judge workers
    background: dict = field(default_factory=dict)  # step -> [wall, CPU] seconds, outside the slots
    spawn: list = field(default_factory=list)  # direct: [wall, CPU] seconds of each create_subprocess_exec
    switches: int = 0  # involuntary context switches of the agents


# ----------------------------------------------------------------------------------------- measurement wrappers

_CURRENT: contextvars.ContextVar[Episode | None] = contextvars.ContextVar("episode", default=None)
EPISODES: list[Episode] = []  # harness episodes as their slots end
BACKGROUND: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # work outside the slots: [wall, CPU] s
JUDGE_CPU: list[float] = []  # CPU seconds of each judge worker, read as its pool closes


def _add(step: str, wall: float, cpu: float) -> None:
    episode = _CURRENT.get()  # asyncio.to_thread copies the context into its thread
    if episode is not None:
        episode.wall[step] += wall
        episode.cpu[step] += cpu


def _add_background(step: str, wall: float, cpu: float) -> None:
    BACKGROUND[step][0] += wall
    BACKGROUND[step][1] += cpu


def _time_sync(owner, name: str, step: str, add=_add) -> None:
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            add(step, time.perf_counter() - t0, time.process_time() - c0)

    setattr(owner, name, timed)


def _time_async(owner, name: str, step: str, add=_add) -> None:
    original = getattr(owner, name)

    async def timed(*args, **kwargs):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return await original(*args, **kwargs)
        finally:
            add(step, time.perf_counter() - t0, time.process_time() - c0)

    setattr(owner, name, timed)


def install_wrappers() -> None:
    """Wrap the harness functions an episode goes through with timers; the harness code itself is unchanged."""
    import psutil

    import harness.running.runner
    import proxy.app
    from harness.running.judge_pool import JudgePool
    from harness.running.runner import Runner
    from harness.store.database import Store
    from harness.store.recorder import Recorder
    from proxy.episodes import Episodes

    for owner, name, step in [(harness.running.runner, "instance_for", "instance_for"),
                              (Store, "episode_progress", None),
                              (Recorder, "flush", None), (Store, "episode_calls", None), (Store, "add_outcome", None),
                              (Store, "add_judgements", None)]:
        _time_sync(owner, name, step or name)
    for owner, name, step in [(Episodes, "open", "open"), (Runner, "_run_agent", "run_agent"),
                              (JudgePool, "judge", "judge"), (asyncio, "create_subprocess_exec", "spawn")]:
        _time_async(owner, name, step)
    # Work that belongs to no slot: the proxy's handler (aiohttp's task) and the recorder's writes (its thread).
    _time_async(proxy.app, "_llm_call", "proxy", _add_background)
    _time_sync(Recorder, "_write", "recorder", _add_background)

    close = JudgePool.close

    def close_reading_cpu(self):
        for pid in self.worker_pids:
            try:
                JUDGE_CPU.append(sum(psutil.Process(pid).cpu_times()[:2]))
            except psutil.Error:
                pass
        close(self)

    JudgePool.close = close_reading_cpu

    run_agent = Runner._run_agent

    async def agent_times(self, *args, **kwargs):
        outcome = await run_agent(self, *args, **kwargs)
        episode = _CURRENT.get()
        episode.spawned = outcome.started_at
        episode.reaped = outcome.started_at + outcome.duration_ms / 1000
        episode.wall["agent_process"] += outcome.duration_ms / 1000
        return outcome

    Runner._run_agent = agent_times

    episode_slot = Runner._episode

    async def timed_episode(self, slot, pool):
        episode = Episode()
        token = _CURRENT.set(episode)
        episode.slot_cpu, episode.slot = (time.process_time(), 0.0), (time.perf_counter(), 0.0)
        try:
            return await episode_slot(self, slot, pool)
        finally:
            episode.slot = (episode.slot[0], time.perf_counter())
            episode.slot_cpu = (episode.slot_cpu[0], time.process_time())
            _CURRENT.reset(token)
            EPISODES.append(episode)

    Runner._episode = timed_episode

    parse_answer = harness.running.runner.parse_answer

    def keep_report(stdout: str):
        _CURRENT.get().report = agent_report(stdout)
        return parse_answer(stdout)

    harness.running.runner.parse_answer = keep_report


def agent_report(stdout: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"the agent printed no report: {stdout[-300:]!r}")


# ---------------------------------------------------------------------------------------------------- CPU


def _tree_cpu() -> float:
    """CPU seconds of this process, its reaped children and its live descendants (with their reaped ones)."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:4])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:4])
        except psutil.Error:
            pass
    return total


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _children_switches() -> int:
    """Involuntary context switches of the reaped children: how often the agents were preempted."""
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_nivcsw


def _machine_busy() -> float:
    import psutil

    t = psutil.cpu_times()  # guest time is already in user time; steal counts as someone else's
    return sum(getattr(t, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))


class CpuWindow:
    """CPU used during a block: by the agents, by this benchmark's whole tree, and by everything else."""

    def __enter__(self):
        self.t0, self.agents0, self.tree0, self.busy0 = time.perf_counter(), _children_cpu(), _tree_cpu(), \
            _machine_busy()
        self.switches0 = _children_switches()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t0
        self.agents = _children_cpu() - self.agents0
        self.switches = _children_switches() - self.switches0
        self.tree = _tree_cpu() - self.tree0
        self.others_cores = max(0.0, _machine_busy() - self.busy0 - self.tree) / wall
