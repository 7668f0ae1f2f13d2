"""Resource limits for code we run but do not own: agents and judges.

An agent is started through this module (`python -m harness.limits MEMORY_MB -- command...`): it caps its own
address space, then execs the agent, which inherits the cap (no pre-exec hook in a threaded parent). A judge
worker caps itself when it starts (harness/judge_pool.py). A process past its cap gets MemoryError / ENOMEM on
allocation and usually exits: its episode ends as crashed with its stderr, its judgement as an error. Time is
capped elsewhere: the episode timeout kills the agent's whole process group, the judge timeout its worker.
"""

from __future__ import annotations

import os
import resource
import sys

AGENT_MEMORY_MB = 8192  # generous: a Node agent reserves ~4 GB of address space before it allocates anything
JUDGE_MEMORY_MB = 8192


def cap_memory(memory_mb: int | None) -> None:
    """Cap this process's address space (RLIMIT_AS) at memory_mb, never above the cap it already has."""
    if not memory_mb:
        return
    wanted = memory_mb * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    resource.setrlimit(resource.RLIMIT_AS, (wanted, hard if hard != resource.RLIM_INFINITY else wanted))


def limited(command: list[str], memory_mb: int | None) -> list[str]:
    """`command`, started under a memory cap (unchanged when memory_mb is None or 0)."""
    if not memory_mb:
        return list(command)
    return [sys.executable, "-m", "harness.limits", str(int(memory_mb)), "--", *command]


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m harness.limits MEMORY_MB -- command [args...]", file=sys.stderr)
        return 2
    cap_memory(int(argv[0]))
    try:
        os.execvp(argv[2], argv[2:])
    except OSError as exc:
        print(f"could not start {argv[2]!r}: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
