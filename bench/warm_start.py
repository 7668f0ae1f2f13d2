"""Warm starts against cold ones (harness/running/warm.py), side by side: the same Python agent, which imports the
openai SDK, makes a client and prints its answer (no model call: what is measured is the start), started in a fresh
interpreter through the limits wrapper as the runner starts a cold agent, or forked from a warm starter. The arms
alternate in rounds so both see the same machine.

Per episode: wall time from spawn to exit (one at a time), and CPU: the cold agents' (and their wrapper's), reaped
by this process (RUSAGE_CHILDREN), against the warm ones', reaped by the starter (its children's CPU in
/proc/<starter>/stat). The starter's own start (its interpreter and `import openai`) is paid once per run and
given apart. Goal: warm CPU per episode <= 0.2x cold.

    .venv/bin/python bench/warm_start.py [--rounds 5] [--episodes 10] [--no-docs]

Writes its section of docs/BENCHMARKS.md (between the warm_start markers) unless --no-docs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from bench.docs_section import write_section  # noqa: E402
from harness.running.limits import AGENT_MAX_PROCS, AGENT_MEMORY_MB, limited  # noqa: E402
from harness.running.warm import WarmStarter  # noqa: E402

AGENT = """import json, os, sys
from openai import OpenAI
client = OpenAI()
task = json.loads(sys.stdin.read())
print(json.dumps({"answer": task["q"], "base_url": str(client.base_url)}))
"""
TICK = os.sysconf("SC_CLK_TCK")


def _reaped_cpu(pid: int) -> float:
    """CPU seconds of the children `pid` has reaped (cutime + cstime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / TICK


def _children_cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


async def cold(command: list[str], env: dict, cwd: Path, task: bytes) -> bytes:
    proc = await asyncio.create_subprocess_exec(*limited(command, AGENT_MEMORY_MB, AGENT_MAX_PROCS),
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.DEVNULL, env=env, cwd=cwd,
                                                start_new_session=True)
    out, _ = await proc.communicate(task)
    assert proc.returncode == 0, proc.returncode
    return out


async def warm(starter: WarmStarter, command: list[str], env: dict, cwd: Path, task: bytes) -> bytes:
    with open(os.devnull, "wb") as err:
        proc = await starter.spawn(command, env=env, cwd=cwd, stderr=err.fileno(), memory_mb=AGENT_MEMORY_MB,
                                   max_procs=AGENT_MAX_PROCS)
    out, _ = await proc.communicate(task)
    assert proc.returncode == 0, proc.returncode
    return out


async def measure(rounds: int, episodes: int, tmp: Path) -> dict:
    agent = tmp / "agent.py"
    agent.write_text(AGENT)
    command = [sys.executable, str(agent)]
    env = {**os.environ, "OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_API_KEY": "sk-bench"}
    t0, c0 = time.perf_counter(), _children_cpu()
    starter = await WarmStarter.start(env, tmp / "warm-starter.log")
    start_s = time.perf_counter() - t0
    try:
        fields = Path(f"/proc/{starter.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        start_cpu = (int(fields[11]) + int(fields[12])) / TICK
        wall = {"cold": [], "warm": []}
        cpu = {"cold": [], "warm": []}
        for r in range(rounds):
            for arm in (("cold", "warm") if r % 2 == 0 else ("warm", "cold")):
                c0 = _children_cpu() if arm == "cold" else _reaped_cpu(starter.proc.pid)
                for i in range(episodes):
                    task = f'{{"q": "r{r}-{i}"}}'.encode()
                    t0 = time.perf_counter()
                    out = await (cold(command, env, tmp, task) if arm == "cold"
                                 else warm(starter, command, env, tmp, task))
                    wall[arm].append(time.perf_counter() - t0)
                    assert f"r{r}-{i}".encode() in out and b"127.0.0.1:9" in out, out
                await asyncio.sleep(0.05)  # the last exit reaped
                c1 = _children_cpu() if arm == "cold" else _reaped_cpu(starter.proc.pid)
                cpu[arm].append((c1 - c0) / episodes)
    finally:
        await starter.close()
    return {"wall": wall, "cpu": cpu, "start_s": start_s, "start_cpu": start_cpu}


def render(m: dict, args, load: tuple[float, float]) -> str:
    import openai

    w = {k: statistics.median(v) * 1000 for k, v in m["wall"].items()}
    c = {k: statistics.mean(v) * 1000 for k, v in m["cpu"].items()}
    ratio = c["warm"] / c["cold"]
    n = len(m["wall"]["cold"])
    return "\n".join([
        "## warm_start",
        "",
        f"`.venv/bin/python bench/warm_start.py` on {time.strftime('%Y-%m-%d')}: `nproc` {os.cpu_count()}, Python "
        f"{platform.python_version()}, openai {openai.__version__}, {platform.machine()}; 1-minute load average "
        f"{load[0]:.1f} at the start, {load[1]:.1f} at the end.",
        f"Agent: Python, imports the openai SDK, makes a client, prints its answer (no model call). Cold: a fresh "
        f"interpreter through the limits wrapper, as the runner starts a cold agent; warm: forked from the warm "
        f"starter. {args.rounds} rounds x {args.episodes} episodes per arm, one at a time, the arms alternating. "
        f"Goal: warm CPU per episode <= 0.2x cold.",
        "",
        "| measurement | cold | warm | warm / cold | goal met |",
        "| --- | ---: | ---: | ---: | --- |",
        f"| CPU per episode (the agent, its wrapper), ms, mean of {args.rounds} rounds | {c['cold']:.0f} | "
        f"{c['warm']:.0f} | **{ratio:.2f}x** | {'yes' if ratio <= 0.2 else 'no'} |",
        f"| wall time per episode, spawn to exit, ms, median of {n} | {w['cold']:.0f} | {w['warm']:.0f} | "
        f"{w['warm'] / w['cold']:.2f}x | - |",
        f"| once per run: the starter's start (its interpreter and `import openai`) | - | {m['start_s'] * 1000:.0f} "
        f"ms wall, {m['start_cpu'] * 1000:.0f} ms CPU | - | - |",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="harness-warm-") as tmp:
        m = asyncio.run(measure(args.rounds, args.episodes, Path(tmp)))
    text = render(m, args, (load0, os.getloadavg()[0]))
    print(text)
    if not args.no_docs:
        write_section("warm_start", text)


if __name__ == "__main__":
    main()
