"""Resource limits for code we run but do not own: agents and judges.

An agent is started through this module (`python -m harness.running.limits MEMORY_MB [--procs N] [--cpus X] --
cmd...`): it caps its own writable memory, moves itself into a process-count group (and a CPU-quota group, for a
sandboxed task's `cpus`) of its own, then execs the agent, which inherits them (no pre-exec hook in a threaded
parent). A judge worker caps its memory when it starts
(judge_pool.py). A process past its memory cap gets MemoryError / ENOMEM on allocation and usually exits:
its episode ends as crashed with its stderr, its judgement as an error.

Processes: a fork bomb is held by the kernel's pids controller, which binds root too (RLIMIT_NPROC does not, and
counts all of a user's processes). The wrapper makes the cgroup `harness-<pid>` under its own, with `pids.max`,
where the machine lets it (cgroup v1's pids hierarchy, or a v2 group that delegates pids); `release(pid)` kills
whatever is left in it, even processes that left the agent's process group, and removes it. Elsewhere a non-root
agent gets RLIMIT_NPROC (its user's processes now, plus N), and root gets no process cap, said in its log. Time
is capped elsewhere: the episode timeout kills the agent's whole process group, the judge timeout its worker.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
import time
from pathlib import Path

AGENT_MEMORY_MB = 8192  # generous: a Node agent with its V8 heap and a browser's share can need a few GB
JUDGE_MEMORY_MB = 8192
AGENT_MAX_PROCS = 512  # processes and threads (the pids controller counts both) of one agent and its children
_GROUP_PREFIX = "harness-"


def cap_memory(memory_mb: int | None) -> None:
    """Cap this process's writable memory (RLIMIT_DATA: its heap and its private writable mappings, anonymous
    mmap included, since Linux 4.7) at memory_mb, never above the cap it already has.

    Not RLIMIT_AS: that counts address space merely reserved, and V8 reserves gigabytes for WebAssembly memories
    (Node's fetch parses HTTP in Wasm) before it writes a page, so a 2 GiB RLIMIT_AS breaks every Node agent's
    fetch ("WebAssembly.instantiate(): Out of memory") while RLIMIT_DATA binds only what is written to."""
    if not memory_mb:
        return
    wanted = memory_mb * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (wanted, hard if hard != resource.RLIM_INFINITY else wanted))


def pids_root() -> Path | None:
    """The cgroup directory under which this process can make a pids-limited group, or None."""
    return cgroup_root("pids")


def cgroup_root(controller: str) -> Path | None:
    """The cgroup directory under which this process can make a group that `controller` (pids, cpu) limits, or
    None."""
    try:
        own = [line.rstrip("\n").split(":", 2) for line in open("/proc/self/cgroup")]
        mounts = [line.split() for line in open("/proc/self/mounts")]
    except OSError:
        return None
    for _, controllers, path in own:
        if controller in controllers.split(","):  # cgroup v1: the controller's hierarchy
            for _, point, fstype, options, *_ in mounts:
                if fstype == "cgroup" and controller in options.split(","):
                    root = Path(point) / path.lstrip("/")
                    return root if os.access(root, os.W_OK) else None
    for hierarchy, _, path in own:
        if hierarchy == "0":  # cgroup v2: only where this group hands the controller down
            for _, point, fstype, *_ in mounts:
                if fstype == "cgroup2":
                    root = Path(point) / path.lstrip("/")
                    with contextlib.suppress(OSError):
                        if controller in (root / "cgroup.subtree_control").read_text().split() and \
                                os.access(root, os.W_OK):
                            return root
    return None


def cap_processes(max_procs: int) -> str:
    """Hold this process and all it starts to `max_procs` processes; how (for the log)."""
    root = pids_root()
    if root is not None:
        group = root / f"{_GROUP_PREFIX}{os.getpid()}"
        if (failed := _join(group, {"pids.max": str(max_procs)})) is None:
            return f"pids cgroup {group}"
        reason = f"cannot use the pids cgroup {group}: {failed}"
    else:
        reason = "no writable pids cgroup"
    if os.geteuid() == 0:
        return f"no process cap ({reason}; RLIMIT_NPROC does not bind root)"
    mine = sum(1 for d in os.listdir("/proc") if d.isdigit() and _owner(d) == os.getuid())
    _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    wanted = mine + max_procs if hard == resource.RLIM_INFINITY else min(mine + max_procs, hard)
    resource.setrlimit(resource.RLIMIT_NPROC, (wanted, hard))
    return f"RLIMIT_NPROC {wanted} ({reason})"


def _owner(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def cap_cpus(cpus: float) -> str:
    """Hold this process and all it starts to `cpus` CPUs of time (a CFS quota in the cpu cgroup `harness-<pid>`),
    where the machine lets it; how (for the log)."""
    root = cgroup_root("cpu")
    if root is None:
        return "no CPU cap (no writable cpu cgroup)"
    group = root / f"{_GROUP_PREFIX}{os.getpid()}"
    period = 100_000
    quota = max(1000, int(cpus * period))
    v2 = (root / "cgroup.controllers").exists()  # cgroup v2 (its group may be the pids one, made already)
    settings = {"cpu.max": f"{quota} {period}"} if v2 else {"cpu.cfs_period_us": str(period),
                                                          "cpu.cfs_quota_us": str(quota)}
    if (failed := _join(group, settings)) is None:
        return f"cpu cgroup {group} ({cpus:g} CPUs)"
    return f"no CPU cap (cannot use the cpu cgroup {group}: {failed})"


def _join(group: Path, settings: dict[str, str]) -> OSError | None:
    """Make `group` (or use it), write its `settings`, move this process into it; the error, with the group removed
    when it is left empty, or None."""
    try:
        group.mkdir(exist_ok=True)
        for name, value in settings.items():
            (group / name).write_text(value)
        (group / "cgroup.procs").write_text(str(os.getpid()))
        return None
    except OSError as exc:
        with contextlib.suppress(OSError):
            group.rmdir()
        return exc


def release(pid: int, timeout_s: float = 5.0) -> None:
    """After an agent started through the wrapper has ended: kill what is left in its cgroups (if it got any: pids,
    cpu) and remove them."""
    deadline = time.monotonic() + timeout_s
    for root in dict.fromkeys(r for r in (pids_root(), cgroup_root("cpu")) if r is not None):
        _release_group(root / f"{_GROUP_PREFIX}{pid}", deadline)


def _release_group(group: Path, deadline: float) -> None:
    while group.exists():
        try:
            left = [int(p) for p in (group / "cgroup.procs").read_text().split()]
        except OSError:
            return
        for p in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        if not left:
            with contextlib.suppress(OSError):
                group.rmdir()
                return
        if time.monotonic() > deadline:
            return  # still dying; the next wrapper's sweep removes it
        time.sleep(0.01)


def _sweep(root: Path) -> None:
    """Remove the groups of agents that are gone, left by a runner that died before releasing them."""
    for group in root.glob(f"{_GROUP_PREFIX}*"):
        pid = group.name[len(_GROUP_PREFIX):]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():  # a live one may be a wrapper setting itself up
            with contextlib.suppress(OSError):
                group.rmdir()  # fails (and is kept) while anything still runs in it


def limited(command: list[str], memory_mb: int | None, max_procs: int | None = None,
            cpus: float | None = None) -> list[str]:
    """`command`, started under a memory cap, a process cap and a CPU cap (unchanged when all are None or 0)."""
    if not memory_mb and not max_procs and not cpus:
        return list(command)
    procs = ["--procs", str(int(max_procs))] if max_procs else []
    cpu = ["--cpus", f"{float(cpus):g}"] if cpus else []
    return [sys.executable, "-m", "harness.running.limits", str(int(memory_mb or 0)), *procs, *cpu, "--", *command]


def main(argv: list[str]) -> int:
    usage = "usage: python -m harness.running.limits MEMORY_MB [--procs N] [--cpus X] -- command [args...]"
    max_procs = cpus = None
    memory, rest = argv[:1], argv[1:]
    while len(rest) >= 2 and rest[0] in ("--procs", "--cpus"):
        if rest[0] == "--procs":
            max_procs = int(rest[1])
        else:
            cpus = float(rest[1])
        rest = rest[2:]
    if not memory or len(rest) < 2 or rest[0] != "--":
        print(usage, file=sys.stderr)
        return 2
    cap_memory(int(memory[0]))
    for controller, wanted in (("pids", max_procs), ("cpu", cpus)):
        if wanted and (root := cgroup_root(controller)) is not None:
            _sweep(root)
    if max_procs:
        how = cap_processes(max_procs)
        if how.startswith("no process cap"):
            print(f"harness.running.limits: {how}", file=sys.stderr)
    if cpus:
        how = cap_cpus(cpus)
        if how.startswith("no CPU cap"):
            print(f"harness.running.limits: {how}", file=sys.stderr)
    try:
        os.execvp(rest[1], rest[1:])
    except OSError as exc:
        print(f"could not start {rest[1]!r}: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
