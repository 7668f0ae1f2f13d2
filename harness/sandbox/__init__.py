"""Sandboxes: where an episode's agent runs when what the model writes must not reach the host (coding and
terminal agents, Harbor tasks).

One narrow seam, so that other backends (a container runtime, a cloud sandbox, Harbor's own environments) plug in
where bubblewrap does:

    backend = open_backend("bwrap")                      # checks the backend is usable, once per run
    box = await backend.open(spec, workspace, proxy=..., mounts={"/tests": (path, False)})
    proc = await box.exec(command, env=..., stdin=PIPE, stdout=PIPE, stderr=log)   # an asyncio Process
    box.put(host_path, "/app/file"); box.get("/app/out.txt")
    await box.close()                                   # every process in it gone; box.flags says what it saw

`SandboxSpec` is what a task asks for: the working directory (its workspace), environment, limits, and the
commands it refuses. The workspace is a host directory given by the caller; it outlives the sandbox, so that a
verifier can run over it in a fresh one (harness/running/harbor.py).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field

__all__ = ["SandboxError", "SandboxSpec", "BACKENDS", "open_backend", "flag", "workdir_problem", "host_env"]

BACKENDS = {"bwrap": "harness.sandbox.bwrap:Bubblewrap"}


class SandboxError(RuntimeError):
    """A sandbox that cannot be made here (its backend missing or refused), with what to do about it."""


@dataclass(frozen=True)
class SandboxSpec:
    workdir: str = "/app"  # the workspace's path inside, and where commands start
    env: dict[str, str] = field(default_factory=dict)  # the task's environment (a Dockerfile's ENV), under exec's
    binds: tuple[str, ...] = ()  # host paths bound read-only at the same path (the agent's own install)
    blocked: tuple[str, ...] = ()  # commands refused inside, each attempt flagged (e.g. git, pip, curl)
    cpus: float | None = None  # CPU time, in CPUs
    memory_mb: int | None = None  # writable memory of each process (RLIMIT_DATA)
    max_procs: int | None = None  # processes and threads, all of them together

    def __post_init__(self):
        if problem := workdir_problem(self.workdir):
            raise SandboxError(problem)
        if self.cpus is not None and self.cpus <= 0:
            raise SandboxError(f"cpus must be positive, got {self.cpus}")


# Where a sandbox keeps its own things: a workspace may be none of them, nor under one.
RESERVED = ("/proc", "/dev", "/run", "/tmp", "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
            "/root", "/tests", "/logs", "/solution")
# What of the host's environment a sandboxed command gets (with what the caller sets for it): no keys, no tokens,
# no host paths but PATH.
HOST_ENV = ("PATH", "LANG", "LANGUAGE", "TERM", "TZ", "COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR")


def workdir_problem(workdir: str) -> str | None:
    """Why `workdir` cannot be a sandbox's workspace, or None."""
    norm = os.path.normpath(workdir) if workdir.startswith("/") else workdir
    if not norm.startswith("/") or norm == "/" or any(norm == r or norm.startswith(r + "/") for r in RESERVED):
        return (f"workdir {workdir!r} cannot be a sandbox's workspace: give an absolute path of its own, e.g. /app "
                f"(not / and not in {', '.join(RESERVED)})")
    return None


def host_env(env: dict[str, str]) -> dict[str, str]:
    """The part of a host environment a sandboxed command may see: HOST_ENV and the locale (LC_*)."""
    return {k: v for k, v in env.items() if k in HOST_ENV or k.startswith("LC_")}


def flag(reason: str, **details) -> dict:
    """One finding of a sandbox, as it goes into `episode_outcomes.sandbox.flags` (docs/schema.md)."""
    return {"kind": "sandbox", "reason": reason, **details}


def open_backend(name: str):
    """The backend called `name` (a key of BACKENDS, or module:Class), checked usable here."""
    spec = BACKENDS.get(name, name)
    module_name, _, class_name = spec.partition(":")
    if not class_name:
        raise SandboxError(f"unknown sandbox {name!r}: give one of {', '.join(BACKENDS)} or module:Class")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise SandboxError(f"sandbox {name!r}: cannot load {spec} ({exc})") from None
    return cls()
