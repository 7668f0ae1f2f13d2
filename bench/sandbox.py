"""What a bubblewrap sandbox costs an episode (harness/sandbox/bwrap.py), side by side with starting the same command
on the host as the runner does (through the limits wrapper, a session of its own).

- one at a time: the same short command (`sh -c 'echo ok > out.txt'`) started, waited for and cleaned up, on the host
  and in a sandbox (open: its directories, shims and events socket; exec: bwrap and the relay; close: the kill, the
  cgroups, its files). The arms alternate in rounds so both see the same machine;
- at once: N episodes running together, each a sandbox whose command sleeps --hold seconds, against the same on
  the host: how many sandboxes a second this machine opens and closes, and what they add to a held episode;
- the share of an episode: the sandbox's overhead (twice: the agent's and the verifier's) against the wall time of
  the oracle episodes of examples/harbor_tasks, each run as `harness run --agent oracle` runs it.

    .venv/bin/python bench/sandbox.py [--rounds 5] [--episodes 10] [--concurrency 1,4,16] [--no-docs]

Writes its section of docs/BENCHMARKS.md (between the sandbox markers) unless --no-docs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from bench.docs_section import write_section  # noqa: E402
from harness.running.limits import AGENT_MAX_PROCS, AGENT_MEMORY_MB, limited, release  # noqa: E402
from harness.sandbox import SandboxSpec, open_backend  # noqa: E402

COMMAND = ["sh", "-c", "echo ok > out.txt"]
SPEC = SandboxSpec(memory_mb=AGENT_MEMORY_MB, max_procs=AGENT_MAX_PROCS)


async def host(workspace: Path, command: list[str]) -> None:
    workspace.mkdir(parents=True, exist_ok=True)
    proc = await asyncio.create_subprocess_exec(*limited(command, AGENT_MEMORY_MB, AGENT_MAX_PROCS), cwd=workspace,
                                                start_new_session=True)
    await proc.wait()
    await asyncio.to_thread(release, proc.pid)


async def sandboxed(backend, workspace: Path, command: list[str]) -> None:
    box = await backend.open(SPEC, workspace)
    try:
        proc = await box.exec(command, env=dict(os.environ))
        await proc.wait()
    finally:
        await box.close()


async def one_at_a_time(backend, rounds: int, episodes: int, tmp: Path) -> dict:
    wall = {"host": [], "sandbox": []}
    for r in range(rounds):
        for arm in ("host", "sandbox") if r % 2 == 0 else ("sandbox", "host"):
            for e in range(episodes):
                ws = tmp / f"{arm}-{r}-{e}"
                t0 = time.perf_counter()
                await (host(ws, COMMAND) if arm == "host" else sandboxed(backend, ws, COMMAND))
                wall[arm].append(time.perf_counter() - t0)
                assert (ws / "out.txt").read_text() == "ok\n"
    return wall


async def at_once(backend, n: int, hold_s: float, tmp: Path) -> dict:
    out = {}
    for arm in ("host", "sandbox"):
        command = ["sh", "-c", f"sleep {hold_s}; echo ok > out.txt"]
        t0 = time.perf_counter()
        await asyncio.gather(*(host(tmp / f"{arm}-{n}-{i}", command) if arm == "host"
                               else sandboxed(backend, tmp / f"{arm}-{n}-{i}", command) for i in range(n)))
        out[arm] = time.perf_counter() - t0
    return out


def oracle_episodes(tmp: Path) -> list[float]:
    """Wall time of each oracle episode of examples/harbor_tasks (agent sandbox only: duration_ms) and the run's
    total, through the CLI."""
    run_dir = tmp / "oracle"
    subprocess.run([sys.executable, "-m", "harness.cli", "run", "--agent", "oracle", "--data",
                    str(ROOT / "examples" / "harbor_tasks"), "--concurrency", "1", "--run-dir", str(run_dir)],
                   capture_output=True, text=True, check=False)
    import duckdb

    with duckdb.connect(str(run_dir / "harness.duckdb"), read_only=True) as con:
        return [r[0] / 1000 for r in con.execute(
            "SELECT duration_ms FROM episode_outcomes WHERE status = 'finished'").fetchall()]


def render(single: dict, crowd: dict, episodes: list[float], args, load: tuple[float, float]) -> str:
    h, s = (statistics.median(single[k]) * 1000 for k in ("host", "sandbox"))
    overhead = s - h
    rows = [f"| {n} at once, each held {args.hold:g} s | {c['host']:.2f} s | {c['sandbox']:.2f} s | "
            f"{c['sandbox'] / c['host']:.2f}x | {n / c['sandbox']:.1f} |" for n, c in crowd.items()]
    mean_episode = statistics.mean(episodes) * 1000 if episodes else float("nan")
    return "\n".join([
        "## sandbox",
        "",
        f"`.venv/bin/python bench/sandbox.py` on {time.strftime('%Y-%m-%d')}: `nproc` {os.cpu_count()}, "
        f"{platform.machine()}, bubblewrap {_bwrap_version()}; 1-minute load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end. The same command on the host (through the limits wrapper, as the runner starts "
        f"an agent) and in a sandbox (open, exec, close); {args.rounds} rounds x {args.episodes} episodes per arm, "
        "one at a time, the arms alternating.",
        "",
        "| measurement | host | sandbox | sandbox / host | sandboxes a second |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| one episode, start to cleaned up, median of {len(single['host'])} | {h:.0f} ms | {s:.0f} ms | "
        f"{s / h:.2f}x | {1000 / s:.1f} |",
        *rows,
        "",
        f"The sandbox adds **{overhead:.0f} ms** to an episode's start and end; an episode of a Harbor task has two "
        f"(the agent's and the verifier's), {2 * overhead:.0f} ms: {2 * overhead / (2 * overhead + 30000):.1%} of a "
        f"30 s coding-CLI episode, {2 * overhead / (2 * overhead + 300000):.2%} of a 5 min one. The oracle episodes "
        f"of examples/harbor_tasks (solve.sh, a few shell commands) take {mean_episode:.0f} ms each, their sandbox "
        "included.",
    ])


def _bwrap_version() -> str:
    done = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, check=False)
    return done.stdout.split()[-1] if done.returncode == 0 and done.stdout.split() else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--concurrency", default="1,4,16", help="episodes at once, comma-separated")
    parser.add_argument("--hold", type=float, default=2.0, help="seconds each episode at once holds its sandbox")
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    backend = open_backend("bwrap")
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="harness-sandbox-bench-") as tmp:
        single = asyncio.run(one_at_a_time(backend, args.rounds, args.episodes, Path(tmp)))
        crowd = {n: asyncio.run(at_once(backend, n, args.hold, Path(tmp)))
                 for n in map(int, args.concurrency.split(","))}
        episodes = oracle_episodes(Path(tmp))
    text = render(single, crowd, episodes, args, (load0, os.getloadavg()[0]))
    print(text)
    if not args.no_docs:
        write_section("sandbox", text)


if __name__ == "__main__":
    main()
