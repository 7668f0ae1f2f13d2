"""What `harness run` adds to an episode beyond the agent's own run time (spawn, wiring, recording, judge), at
concurrency 1 and 32, measured side by side in one run.

The agent is a small Python program that imports the openai SDK and makes two chat calls (the SDK's import and
teardown, most of a real agent's fixed cost, are in both arms). The engine is proxy/scripted_engine.py in a
process of its own. Two arms, alternating in rounds so that both see the same machine:

- direct: the agent spawned with `asyncio.create_subprocess_exec` (task on stdin, OPENAI_BASE_URL at the engine),
  at most `c` at once: the agent's own time;
- harness: the same episodes through `run_dataset` (running/dataset.py: proxy, recorder, DuckDB, judge `exact_match`).

Overhead per episode, c=1: the runner's episode slot (`Runner._episode`: open, spawn, agent, flush, read back,
judge, inserts) against the agent process spawned directly. The agent reports when its first line ran, when its
calls began and ended and when it printed its answer, which splits its run into start, imports, calls and exit;
imports are the same code in both arms and carry most of the noise, so the overhead is also given from the other
parts alone. c=32: throughput-normalised, (wall time from the first spawn to the last episode done) / N in each
arm, and as CPU: the CPU the harness adds per episode outside the agents (this process over the episodes, and the
judge workers) over the machine's cores, the wall time it costs a machine the agents saturate. What a run pays
once (proxy and DuckDB start, judge pool, report, stop) is reported apart. CPU used by other processes on the
machine is measured during each arm and printed. Harness steps are timed by wrapping harness functions in this
process (measurement only). Goal (from the issue): <= 50 ms per episode beyond the agent's own time.

Two side measurements: a judge worker's start with a light and with a heavy `__main__` (multiprocessing's
forkserver re-runs the main script in every worker until CPython's 2025 fix, gh-126631), and reading back and
judging a bigger episode (10 turns of a growing conversation) than the benchmark agent's, in a store of 500 and of
4,000 calls.

This module imports little at its top on purpose: judge workers re-run it, as they re-run `harness`'s entry
script in a real `harness run`.

    .venv/bin/python bench/episode_overhead.py [--quick] [--no-docs]

Writes its section of docs/BENCHMARKS.md (between the episode_overhead markers) unless --no-docs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import defaultdict
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.docs_section import DOCS, write_section  # noqa: E402
from bench.episode_side import bigger_episode, judge_worker_start  # noqa: E402
from bench.episode_timing import (  # noqa: E402
    BACKGROUND,
    EPISODES,
    JUDGE_CPU,
    Arm,
    CpuWindow,
    Episode,
    agent_report,
    install_wrappers,
)

GOAL_MS = 50.0
BUSY_CORES = 0.2  # other work above this, in cores, during an arm makes its wall times untrustworthy
CALLS = 2  # chat calls per episode

AGENT = textwrap.dedent('''
    import time
    T0 = time.time()
    import json, sys
    from openai import OpenAI
    task = json.loads(sys.stdin.read())
    client = OpenAI()
    t_calls = time.time()
    for _ in range(task["calls"]):
        client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": task["q"]}])
    t_calls_end = time.time()
    print(json.dumps({"answer": task["answer"], "t_start": T0, "t_calls": t_calls, "t_calls_end": t_calls_end,
                      "t_end": time.time()}), flush=True)
''')

ENGINE = textwrap.dedent('''
    import asyncio, sys
    sys.path.insert(0, sys.argv[1])
    from proxy.scripted_engine import ScriptedEngine

    async def main():
        print(await ScriptedEngine().start(), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
''')


# The steps of a harness episode, as timed by the wrappers (name: label). Indented ones are part of the one above.
STEPS = {
    "instance_for": "task instance (`instance_for`, in a thread)",
    "open": "open the episode (`Episodes.open`)",
    "episode_progress": "- of which the `episode_progress` query (in a thread)",
    "run_agent": "run the agent (`Runner._run_agent`)",
    "wiring": "- of which the wiring around it (environment, log file, parsing the answer)",
    "agent_process": "- of which the agent process, spawn to reaped",
    "spawn": "- - of which spawning it (`asyncio.create_subprocess_exec`, new session, stderr to a file)",
    "flush": "wait for the recorder (`Recorder.flush`, in a thread)",
    "episode_calls": "read the calls back (`Store.episode_calls`, in a thread)",
    "add_outcome": "insert the outcome (`Store.add_outcome`, in a thread)",
    "judge": "judge round trip (`JudgePool.judge`)",
    "add_judgements": "insert the judgement (`Store.add_judgements`, in a thread)",
    "rest": "rest: event loop and thread hand-offs, bookkeeping",
}
TOP_STEPS = ["instance_for", "open", "run_agent", "flush", "episode_calls", "add_outcome", "judge", "add_judgements"]
PHASES = {"start": "spawn to its first line", "imports": "imports and set-up", "calls": f"{CALLS} chat calls",
          "exit": "answer printed to reaped"}


# ---------------------------------------------------------------------------------------------------- the arms


def make_tasks(prefix: str, n: int):
    from harness.core.records import Task

    return [Task(f"{prefix}-{i}", {"q": f"what is {i} + 1?", "answer": str(i + 1), "calls": CALLS})
            for i in range(n)]


async def run_direct(tasks, concurrency: int, agent: list[str], engine_url: str, cwd: Path) -> Arm:
    """The agent's own time: spawned plainly, talking to the engine, `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)
    episodes: list[Episode] = []
    spawn: list[list[float]] = []

    async def one(task) -> None:
        async with gate:
            task_json = json.dumps(task.data)
            env = {**os.environ, "OPENAI_BASE_URL": f"{engine_url}/v1", "OPENAI_API_KEY": "direct",
                   "HARNESS_TASK": task_json, "HARNESS_EPISODE_ID": task.task_id}
            episode = Episode()
            start, episode.spawned, c0 = time.perf_counter(), time.time(), time.process_time()
            proc = await asyncio.create_subprocess_exec(*agent, stdin=asyncio.subprocess.PIPE,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.DEVNULL, env=env, cwd=cwd)
            spawn.append([time.perf_counter() - start, time.process_time() - c0])
            stdout, _ = await proc.communicate(task_json.encode())
            episode.reaped, episode.slot = time.time(), (start, time.perf_counter())
            if proc.returncode != 0:
                raise RuntimeError(f"the agent exited with code {proc.returncode} in the direct arm")
            episode.report = agent_report(stdout.decode())
            episodes.append(episode)

    with CpuWindow() as cpu:
        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one(t) for t in tasks))
        wall, own = time.perf_counter() - t0, time.process_time() - c0
    return Arm("direct", episodes, wall, wall, cpu.agents, cpu.tree, cpu.others_cores, own_cpu_s=own, spawn=spawn,
               switches=cpu.switches)


async def run_harness(tasks, concurrency: int, agent: list[str], engine_url: str, run_dir: Path, cwd: Path) -> Arm:
    """The same episodes through run_dataset: proxy, recorder, DuckDB, judge."""
    from harness.running.dataset import run_dataset
    from harness.running.runner import RunConfig
    from harness.running.vllm_server import attach

    EPISODES.clear()
    BACKGROUND.clear()
    JUDGE_CPU.clear()
    config = RunConfig(command=agent, judge="exact_match", concurrency=concurrency, timeout_s=300, retries=0,
                       cwd=cwd, warm_start=False)  # both arms start the agent cold: bench/warm_start.py is warm
    with CpuWindow() as cpu:
        t0 = time.perf_counter()
        _, report = await run_dataset(tasks, config, attach(engine_url), run_dir, progress=False)
        wall = time.perf_counter() - t0
    if report["episodes"] != len(tasks) or report["mean_reward"] != 1.0 or report["failures"]:
        raise RuntimeError(f"the harness arm did not run cleanly: {report}")
    episodes = list(EPISODES)
    phase = max(e.slot[1] for e in episodes) - min(e.slot[0] for e in episodes)
    own = max(e.slot_cpu[1] for e in episodes) - min(e.slot_cpu[0] for e in episodes)
    return Arm("harness", episodes, wall, phase, cpu.agents, cpu.tree, cpu.others_cores, own_cpu_s=own,
               judge_cpu_s=sum(JUDGE_CPU), background={k: list(v) for k, v in BACKGROUND.items()},
               switches=cpu.switches)


async def measure(args, agent: list[str], engine_url: str, tmp: Path) -> tuple[dict[int, dict[str, list[Arm]]], Arm]:
    """The arms by concurrency and kind, and the warm-up harness run."""
    arms: dict[int, dict[str, list[Arm]]] = {1: defaultdict(list), 32: defaultdict(list)}
    # Warm-up, not counted: the page cache, the judge forkserver (a `harness run` starts one per run; the side
    # measurement times that), the first DuckDB file.
    await run_direct(make_tasks("warm-direct", 1), 1, agent, engine_url, tmp)
    warm = await run_harness(make_tasks("warm-harness", 2), 1, agent, engine_url, tmp / "run-warm", tmp)
    print(f"  warm-up: first harness run {warm.wall_s - warm.phase_s:.2f} s outside its episodes", flush=True)
    for concurrency, n, rounds in [(1, args.c1_n, args.c1_rounds), (32, args.c32_n, args.c32_rounds)]:
        for r in range(rounds):
            for kind in ("direct", "harness") if r % 2 == 0 else ("harness", "direct"):
                tasks = make_tasks(f"{kind}-c{concurrency}-r{r}", n)
                if kind == "direct":
                    arm = await run_direct(tasks, concurrency, agent, engine_url, tmp)
                else:
                    arm = await run_harness(tasks, concurrency, agent, engine_url,
                                            tmp / f"run-c{concurrency}-r{r}", tmp)
                arms[concurrency][kind].append(arm)
                print(f"  c={concurrency:<2} round {r + 1}/{rounds} {kind:>7}: {n} episodes, {arm.wall_s:5.1f} s "
                      f"({arm.phase_s / n * 1000:6.1f} ms/episode); others used {arm.others_cores:.2f} cores",
                      flush=True)
    return arms, warm


# ---------------------------------------------------------------------------------------------------- report


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _se(values) -> float:
    values = list(values)
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")


def summarise(arms: dict[int, dict[str, list[Arm]]]) -> dict:
    out = {}
    cores = os.cpu_count() or 1
    for concurrency, by_kind in arms.items():
        direct, harness_arms = by_kind["direct"], by_kind["harness"]
        d_eps = [e for a in direct for e in a.episodes]
        h_eps = [e for a in harness_arms for e in a.episodes]
        n_d, n_h = len(d_eps), len(h_eps)
        s = {"n": (n_d, n_h), "runs": len(harness_arms)}
        s["direct_agent"] = (_mean(e.agent_ms for e in d_eps), _se(e.agent_ms for e in d_eps))
        s["harness_agent"] = (_mean(e.agent_ms for e in h_eps), _se(e.agent_ms for e in h_eps))
        s["slot"] = (_mean(e.slot_ms for e in h_eps), _se(e.slot_ms for e in h_eps))
        s["phases"] = {k: (statistics.median(e.phases_ms()[k] for e in d_eps),
                           statistics.median(e.phases_ms()[k] for e in h_eps)) for k in PHASES}
        for e in h_eps:
            e.wall["wiring"] = e.wall["run_agent"] - e.wall["agent_process"]
            e.wall["rest"] = e.slot_ms / 1000 - sum(e.wall[k] for k in TOP_STEPS)
            e.cpu["rest"] = e.slot_cpu[1] - e.slot_cpu[0] - sum(e.cpu[k] for k in TOP_STEPS)
        s["steps"] = {k: (_mean(e.wall[k] * 1000 for e in h_eps), statistics.median(e.wall[k] * 1000 for e in h_eps),
                          _mean(e.cpu[k] * 1000 for e in h_eps)) for k in STEPS}
        s["slot_cpu"] = _mean((e.slot_cpu[1] - e.slot_cpu[0]) * 1000 for e in h_eps)
        outside = s["slot"][0] - s["harness_agent"][0]  # the slot outside the agent process, measured directly
        s["outside_agent"] = outside
        s["robust"] = outside + sum(s["phases"][k][1] - s["phases"][k][0] for k in ("start", "calls", "exit"))
        s["raw"] = (s["slot"][0] - s["direct_agent"][0], (s["slot"][1] ** 2 + s["direct_agent"][1] ** 2) ** 0.5)
        s["per_ep"] = (sum(a.phase_s for a in direct) / n_d * 1000, sum(a.phase_s for a in harness_arms) / n_h * 1000)
        s["round_diffs"] = [(h.phase_s / len(h.episodes) - d.phase_s / len(d.episodes)) * 1000
                            for d, h in zip(direct, harness_arms, strict=True)]
        s["fixed_s"] = [a.wall_s - a.phase_s for a in harness_arms]
        s["agent_cpu"] = (sum(a.agent_cpu_s for a in direct) / n_d * 1000,
                          sum(a.agent_cpu_s for a in harness_arms) / n_h * 1000)
        s["switches"] = (sum(a.switches for a in direct) / n_d, sum(a.switches for a in harness_arms) / n_h)
        s["own_cpu"] = (sum(a.own_cpu_s for a in direct) / n_d * 1000,
                        sum(a.own_cpu_s + a.judge_cpu_s for a in harness_arms) / n_h * 1000)
        s["judge_cpu"] = sum(a.judge_cpu_s for a in harness_arms) / n_h * 1000
        s["extra_cpu_wall"] = (s["own_cpu"][1] - s["own_cpu"][0]) / cores
        background: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for a in harness_arms:
            for k, (w, c) in a.background.items():
                background[k][0] += w * 1000 / n_h
                background[k][1] += c * 1000 / n_h
        s["background"] = dict(background)
        spawns = [x for a in direct for x in a.spawn]
        s["direct_spawn"] = (_mean(w * 1000 for w, _ in spawns), _mean(c * 1000 for _, c in spawns))
        s["others"] = (_mean(a.others_cores for a in direct), _mean(a.others_cores for a in harness_arms))
        out[concurrency] = s
    return out


def _verdict(ok: bool, others: tuple[float, float]) -> str:
    """Goal met or not, for a wall-time row: only when nothing else took a share of the machine during the arms."""
    if max(others) > BUSY_CORES:
        return f"(other work used {max(others):.1f} cores: rerun)"
    return "yes" if ok else "**no**"


def render(s: dict, warm: Arm, side: dict, args, load: tuple[float, float], machine: str) -> str:
    c1, c32 = s[1], s[32]
    cores = os.cpu_count() or 1
    yes = {True: "yes", False: "**no**"}
    command = "bench/episode_overhead.py" + (" --quick" if args.quick else "")
    fixed = c1["fixed_s"] + c32["fixed_s"]
    light, heavy, big = side["pool"]["light"], side["pool"]["heavy"], side["big"]
    bg1, bg32 = c1["background"], c32["background"]
    wall32 = c32["per_ep"][1] - c32["per_ep"][0]
    se32 = f" +- {_se(c32['round_diffs']):.0f}" if len(c32["round_diffs"]) > 1 else ""
    lines = [
        "## episode_overhead",
        "",
        f"`.venv/bin/python {command}` on {date.today()}: {machine}; 1-minute load average {load[0]:.1f} at the "
        f"start, {load[1]:.1f} at the end. Other work on the machine used {c1['others'][0]:.2f} / "
        f"{c1['others'][1]:.2f} cores during the c=1 direct / harness arms, {c32['others'][0]:.2f} / "
        f"{c32['others'][1]:.2f} at c=32 (the arms alternate, so both see it).",
        f"Agent: Python, imports the openai SDK, {CALLS} chat calls to the scripted engine (its own process), prints "
        "a JSON answer. Direct: the agent spawned with asyncio, nothing else. Harness: `run_dataset`, judge "
        f"exact_match. Settings: c=1 {args.c1_rounds} rounds x {args.c1_n} episodes per arm; c=32 "
        f"{args.c32_rounds} rounds x {args.c32_n} episodes per arm; one warm-up run first, not counted. "
        f"Goal: <= {GOAL_MS:g} ms per episode beyond the agent's own time.",
        "",
        "| measurement | direct (agent's own time) | harness | overhead per episode | goal met |",
        "| --- | ---: | ---: | ---: | --- |",
        f"| c=1 episode, mean ms ({c1['n'][0]} / {c1['n'][1]} episodes; +- standard error) "
        f"| {c1['direct_agent'][0]:.0f} +- {c1['direct_agent'][1]:.0f} | {c1['slot'][0]:.0f} +- {c1['slot'][1]:.0f} "
        f"| {c1['raw'][0]:+.1f} +- {c1['raw'][1]:.0f} | - |",
        "| c=1 leaving out the agent's imports (same code in both arms, most of the noise): the slot outside the "
        "agent process + the differences in the agent's start, calls and exit (medians), ms "
        f"| - | {c1['outside_agent']:.1f} outside the agent process | **{c1['robust']:+.1f}** "
        f"| {_verdict(c1['robust'] <= GOAL_MS, c1['others'])} |",
        f"| c=32 wall time / episode, ms ({c32['n'][0]} / {c32['n'][1]} episodes; overhead +- standard error of "
        f"the rounds' differences: {', '.join(f'{d:+.0f}' for d in c32['round_diffs'])}) | {c32['per_ep'][0]:.1f} "
        f"| {c32['per_ep'][1]:.1f} | {wall32:+.1f}{se32} | {_verdict(wall32 <= GOAL_MS, c32['others'])} |",
        "| c=32 CPU / episode outside the agents, ms (direct: the spawner; harness: runner, proxy, recorder, DuckDB "
        f"over the episodes, and the judge workers); overhead: the extra over {cores} cores, the wall time it costs "
        f"a saturated machine | {c32['own_cpu'][0]:.1f} | {c32['own_cpu'][1]:.1f} | **{c32['extra_cpu_wall']:+.1f}** "
        f"| {yes[c32['extra_cpu_wall'] <= GOAL_MS]} |",
        f"| c=1: the same CPU measure | {c1['own_cpu'][0]:.1f} | {c1['own_cpu'][1]:.1f} "
        f"| {(c1['own_cpu'][1] - c1['own_cpu'][0]):+.1f} ms CPU | - |",
        "| once per run: `run_dataset` outside its episodes (proxy and DuckDB start, judge pool, report, stop), s "
        f"| - | {statistics.median(fixed):.2f} median; {warm.wall_s - warm.phase_s:.2f} for the first run in a "
        "process (starts the judge forkserver) | - | - |",
        "",
        "Where a harness episode's slot goes (ms per episode; wall time of each call, waiting included; CPU: this "
        "process's CPU during the step, all its threads, so at c=1 it includes the proxy and recorder work "
        "running meanwhile):",
        "",
        "| step | c=1 mean | c=1 median | c=1 CPU | c=32 mean |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key, label in STEPS.items():
        mean, med, cpu = c1["steps"][key]
        cpu_cell = "-" if key in ("wiring", "agent_process") else f"{cpu:.1f}"  # not measured apart
        lines.append(f"| {label} | {mean:.1f} | {med:.1f} | {cpu_cell} | {c32['steps'][key][0]:.1f} |")
    db1 = sum(c1["steps"][k][2] for k in ("episode_progress", "episode_calls", "add_outcome", "add_judgements"))
    lock32 = c32["steps"]["open"][0] - c32["steps"]["episode_progress"][0]
    lines += [
        f"| **the episode slot, all of it** | **{c1['slot'][0]:.1f}** | - | **{c1['slot_cpu']:.1f}** "
        f"| **{c32['slot'][0]:.1f}** |",
        "",
        f"Reading it: at c=1 the harness's CPU ({c1['slot_cpu']:.0f} ms an episode: the recorder's two small "
        f"writes {bg1['recorder'][1]:.0f}, the runner's four DuckDB round trips {db1:.0f}, the proxy "
        f"{bg1['proxy'][1]:.0f}) mostly runs on the other core while the agent runs, so it costs wall time only "
        f"on a busy machine. At c=32 the {cores} cores are saturated by the agents, so waits there are queueing "
        f"for CPU and threads, not work: `Episodes.open` waits {lock32:.0f} ms beyond its `episode_progress` query "
        "(for a thread of asyncio's default executor, shared by every to_thread call, `Recorder.flush` waits "
        "included, and for the event loop), and so do the other to_thread steps. The c=32 "
        "wall times move by a few per cent between runs with the agents' own CPU (below), which is as large as the "
        "harness's share; the CPU row is the stable measure of what the harness adds.",
        "",
        "Work outside the slots, per episode (wall / CPU ms, c=1 | c=32): the proxy's handler for the "
        f"{CALLS} calls {bg1['proxy'][0]:.1f} / {bg1['proxy'][1]:.1f} | {bg32['proxy'][0]:.1f} / "
        f"{bg32['proxy'][1]:.1f}; the recorder's writes (its thread) {bg1['recorder'][0]:.1f} / "
        f"{bg1['recorder'][1]:.1f} | {bg32['recorder'][0]:.1f} / {bg32['recorder'][1]:.1f}. Judge workers' CPU: "
        f"{c1['judge_cpu']:.1f} | {c32['judge_cpu']:.1f}. The direct arm's spawn: {c1['direct_spawn'][0]:.1f} / "
        f"{c1['direct_spawn'][1]:.1f} | {c32['direct_spawn'][0]:.1f} / {c32['direct_spawn'][1]:.1f}.",
        "The agent's own run as it reported it (medians, ms, direct / harness; c=1 | c=32): "
        + "; ".join(f"{label} {c1['phases'][k][0]:.1f} / {c1['phases'][k][1]:.1f} | "
                    f"{c32['phases'][k][0]:.0f} / {c32['phases'][k][1]:.0f}" for k, label in PHASES.items())
        + f". Agent CPU per episode: c=1 {c1['agent_cpu'][0]:.0f} / {c1['agent_cpu'][1]:.0f}, c=32 "
        f"{c32['agent_cpu'][0]:.0f} / {c32['agent_cpu'][1]:.0f} (times preempted per agent: c=1 "
        f"{c1['switches'][0]:.0f} / {c1['switches'][1]:.0f}, c=32 {c32['switches'][0]:.0f} / "
        f"{c32['switches'][1]:.0f}).",
        "",
        f"Judge pool start in a fresh program (2 workers, to the first 2 judgements done): with a light `__main__` "
        f"(like the `harness` entry script) {light['ctor_ms'] + light['first_ms']:.0f} ms, "
        f"{_mean(light['worker_cpu_s']) * 1000:.0f} ms CPU per worker; with `import harness.running.dataset` at the "
        f"top of `__main__` (a script or trainer calling run_dataset) {heavy['ctor_ms'] + heavy['first_ms']:.0f} ms, "
        f"{_mean(heavy['worker_cpu_s']) * 1000:.0f} ms CPU per worker: before CPython's fix (gh-126631, 2025) "
        "the forkserver's `__main__` preload does nothing and every worker, replacements included, re-runs the "
        "main script.",
        f"A bigger episode ({big['turns']} turns, each request the whole conversation so far; "
        f"{big['json_kb']:.0f} kB of request + response JSON): `Store.episode_calls` "
        + ", ".join(f"{ms:.1f} ms in a store of {n:,} calls" for n, ms in big["episode_calls_ms"].items())
        + f" (this benchmark's runs hold under 100 calls); judge round trip {big['judge_ms']:.1f} ms "
        f"({big['job_kb']:.0f} kB pickled to the worker), with a judge (exact_match) that never reads the calls.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer episodes (under a minute)")
    parser.add_argument("--c1-n", type=int, help="episodes per arm per round at c=1 (default 5, quick 2)")
    parser.add_argument("--c1-rounds", type=int, help="rounds at c=1 (default 4, quick 2)")
    parser.add_argument("--c32-n", type=int, help="episodes per arm per round at c=32 (default 40, quick 32)")
    parser.add_argument("--c32-rounds", type=int, help="rounds at c=32 (default 3, quick 1)")
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    for name, (full, quick) in {"c1_n": (5, 2), "c1_rounds": (4, 2), "c32_n": (40, 32), "c32_rounds": (3, 1)}.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)

    install_wrappers()
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(ROOT)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        engine_url = engine.stdout.readline().strip()
        if not engine_url.startswith("http"):
            raise RuntimeError(f"the scripted engine did not start (it said {engine_url!r})")
        with tempfile.TemporaryDirectory() as folder:
            tmp = Path(folder)
            (tmp / "agent.py").write_text(AGENT)
            agent = [sys.executable, str(tmp / "agent.py")]
            arms, warm = asyncio.run(measure(args, agent, engine_url, tmp))
            print("  side measurements: judge pool start, a bigger episode", flush=True)
            side = {"pool": judge_worker_start(tmp), "big": asyncio.run(bigger_episode(tmp))}
    finally:
        engine.kill()
        engine.wait()
    load = (load0, os.getloadavg()[0])
    import duckdb
    import openai

    machine = (f"`nproc` {os.cpu_count()}, Python {platform.python_version()}, openai {openai.__version__}, "
               f"DuckDB {duckdb.__version__}, {platform.machine()}")
    text = render(summarise(arms), warm, side, args, load, machine)
    print(text)
    print(f"(took {time.perf_counter() - t0:.0f} s)")
    if not args.no_docs:
        write_section("episode_overhead", text)
        print(f"updated {DOCS}")


if __name__ == "__main__":
    main()
