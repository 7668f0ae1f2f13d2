"""A run's sandboxed episodes (harness/sandbox/): which tasks run in one, their workspaces, the command and
environment an agent gets there, the record that goes into `episode_outcomes.sandbox`, and a Harbor task's
verifier. The runner (runner.py) asks this for each episode; the sandbox itself is the backend's."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from harness.core.records import Judgement, Task
from harness.running import harbor
from harness.sandbox import SandboxSpec, host_env, open_backend
from proxy.server import ProxyServer

if TYPE_CHECKING:
    from harness.running.runner import RunConfig


class EpisodeSandboxes:
    """The sandboxes of one run's episodes, each over a fresh workspace under `<run_dir>/workspaces/`, removed once
    the episode is judged (unless `keep_workspaces`)."""

    def __init__(self, config: RunConfig, proxy: ProxyServer, run_dir: Path):
        self.config, self.proxy, self.root = config, proxy, run_dir / "workspaces"
        self.backend = None  # opened by start(), when a task runs sandboxed
        self._workspaces: dict[str, Path] = {}  # a sandboxed episode's workspace, until it is forgotten

    def wanted(self, task: Task) -> bool:
        return self.config.sandbox is not None or harbor.is_harbor(task)

    async def start(self, tasks: list[Task]) -> int:
        """Open the backend when any of `tasks` runs sandboxed (it may refuse: bwrap missing); how many do."""
        sandboxed = sum(map(self.wanted, tasks))
        if sandboxed and self.backend is None:
            self.backend = await asyncio.to_thread(open_backend, self.config.sandbox or "bwrap")
        return sandboxed

    def env(self) -> dict[str, str]:
        """What a sandboxed agent gets before its episode's own variables: of the host's environment only what
        harness.sandbox.host_env lets through (no keys, no tokens), then the run's own, less the hidden."""
        env = {**host_env(os.environ), **self.config.env}
        for name in self.config.hidden_env:
            env.pop(name, None)
        return env

    def command(self) -> list[str]:
        """A sandboxed episode's command: the oracle's, or the agent's with the files it names made absolute (the
        sandbox starts it in the workspace)."""
        if self.config.oracle:
            return list(harbor.ORACLE_COMMAND)
        cwd = Path(self.config.cwd or Path.cwd())
        return [arg if os.path.isabs(arg) or (i == 0 and "/" not in arg) or not (cwd / arg).is_file()
                else str((cwd / arg).resolve()) for i, arg in enumerate(self.config.command)]

    async def open(self, task: Task, episode_id: str):
        """The episode's sandbox over a fresh workspace (a Harbor task's environment copied in) and the record of
        it that goes into `episode_outcomes.sandbox`."""
        workspace = self._workspaces[episode_id] = self.root / episode_id
        await asyncio.to_thread(shutil.rmtree, workspace, True)
        opening = time.perf_counter()
        more = {"binds": (*agent_binds(self.command(), self.config.cwd), *self.config.sandbox_binds),
                "blocked": self.config.blocked_commands, "max_procs": self.config.max_procs}
        mounts = {}
        if harbor.is_harbor(task):
            flags = await asyncio.to_thread(harbor.prepare, task, workspace)
            spec = harbor.spec_of(task, **more)
            if spec.memory_mb is None:
                spec = replace(spec, memory_mb=self.config.memory_mb)
            if self.config.oracle:
                scratch = self._oracle_dir(episode_id)
                await asyncio.to_thread(shutil.rmtree, scratch, True)
                scratch.mkdir(parents=True)
                mounts = await asyncio.to_thread(harbor.oracle_mounts, task, scratch)
        else:
            flags, spec = [], SandboxSpec(memory_mb=self.config.memory_mb, **more)
        host, port = self.proxy.url.removeprefix("http://").rsplit(":", 1)
        box = await self.backend.open(spec, workspace, proxy=(await self.proxy.unix_socket(), host, int(port)),
                                      mounts=mounts)
        record = {"backend": self.backend.name, "workdir": spec.workdir, "workspace": str(workspace),
                  "flags": flags, "open_ms": (time.perf_counter() - opening) * 1000.0, "close_ms": None}
        return box, record

    async def verify(self, task: Task, episode_id: str, log_path: Path) -> Judgement | None:
        """A Harbor task's verifier over the workspace the episode left; None when it left none."""
        workspace = self._workspaces.get(episode_id)
        if workspace is None:
            return None
        return await harbor.verify(task, episode_id, workspace, self.backend, self.env(), log_path,
                                   memory_mb=self.config.memory_mb, max_procs=self.config.max_procs)

    async def forget(self, episode_id: str) -> None:
        """Remove a sandboxed episode's workspace (and the oracle's copy of its solution), unless they are kept."""
        workspace = self._workspaces.pop(episode_id, None)
        if workspace is not None and not self.config.keep_workspaces:
            for path in (workspace, self._oracle_dir(episode_id)):
                await asyncio.to_thread(shutil.rmtree, path, True)

    def _oracle_dir(self, episode_id: str) -> Path:
        return self.root / f"{episode_id}.oracle"


def agent_binds(command: list[str], cwd: Path | str | None) -> list[str]:
    """What a sandboxed agent needs of the host, bound read-only: this Python's venv when the command runs it, and
    each file the command names (its script), or the node_modules a named file lives in (a CLI's install).
    Directories are bound only when named in `sandbox_binds`: a checkout may hold what the agent must not see."""
    binds = []
    for i, arg in enumerate(command):
        if i == 0 and "/" not in arg:
            continue
        path = Path(arg) if os.path.isabs(arg) else Path(cwd or Path.cwd()) / arg
        if not path.is_file():
            continue
        binds.append(os.path.abspath(path))
        real = Path(os.path.realpath(path))
        modules = next((p for p in real.parents if p.name == "node_modules"), None)
        binds.append(str(modules) if modules is not None else str(real))
    if command and os.path.dirname(command[0]) == os.path.dirname(sys.executable):
        binds.append(sys.prefix)
    return list(dict.fromkeys(binds))
