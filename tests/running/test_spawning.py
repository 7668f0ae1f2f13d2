"""The loops that start agents (harness run's, the trainer's proxy thread) start them without running the parent's
Python code in the child. uvloop forks a child itself and runs the parent's at-fork handlers there: in a trainer
that has run torch and tokenizers, the agents then died of a segmentation fault before they started (seen in
tests/trainer/test_data_order_loop.py after other trainer tests). asyncio's loop starts them by CPython's
subprocess, which runs no Python code in the child. Each case runs in a process of its own, with an at-fork
handler that ends any child it runs in with exit code 99."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import asyncio, os, sys
from proxy.server import new_event_loop

os.register_at_fork(after_in_child=lambda: os._exit(99))  # what a library's at-fork handler may do to a child


async def main():
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "print('started')",
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    print(type(asyncio.get_running_loop()).__module__.split(".")[0], proc.returncode, out.decode().strip())


loop = new_event_loop(spawns=sys.argv[1] == "spawns")
loop.run_until_complete(main())
"""


def _spawn_with(kind: str, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT, kind], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env}, check=True)
    return done.stdout.strip()


@pytest.mark.parametrize("asked", ["", "uvloop", "asyncio"])
def test_a_loop_that_starts_agents_runs_no_python_in_the_child(asked):
    assert _spawn_with("spawns", HARNESS_EVENT_LOOP=asked) == "asyncio 0 started"


def test_uvloop_serves_the_plain_proxy_and_would_run_the_handler_in_the_child():
    pytest.importorskip("uvloop")
    assert _spawn_with("serve", HARNESS_EVENT_LOOP="") == "uvloop 99"  # why agents are not started on it
