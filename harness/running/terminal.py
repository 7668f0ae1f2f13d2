"""Debug mode's terminal (runner.py, RunConfig.debug): an agent on the runner's terminal, its output shown as it
comes and kept for the answer."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

_DRAIN_S = 1.0  # how long to read an exited agent's pipes, which a child it left running may hold open
_PDB_PROMPT = re.compile(rb"^(?:\(Pdb\) )+", re.MULTILINE)


class Terminal:
    """Debug mode: an agent on the runner's terminal. It inherits the runner's stdin and process group, so that a
    breakpoint and Ctrl-C reach it; its stdout and stderr are shown on the runner's stderr as they come (a pdb prompt,
    which ends in no newline, included), stdout kept for the answer and stderr written to the episode's log.

    The pipes are ours, not asyncio's: with asyncio's, `Process.wait()` lasts until every child the agent left
    running has closed them too, and in debug mode those children are not killed with a process group."""

    def __init__(self, log: BinaryIO):
        self._stdout = bytearray()
        self._sinks = (self._stdout.extend, log.write)
        self._relays: list[_Relay] = []

    async def start(self, command: list[str], *, env: dict[str, str], cwd: Path | None) -> asyncio.subprocess.Process:
        loop = asyncio.get_running_loop()
        write_ends = []
        try:
            for sink in self._sinks:
                read_end, write_end = os.pipe()
                write_ends.append(write_end)
                _, relay = await loop.connect_read_pipe(lambda sink=sink: _Relay(sink), open(read_end, "rb", 0))
                self._relays.append(relay)
            return await asyncio.create_subprocess_exec(*command, stdout=write_ends[0], stderr=write_ends[1],
                                                        env=env, cwd=cwd)
        except BaseException:
            self._close()
            raise
        finally:
            for end in write_ends:  # the agent has its own copies
                os.close(end)

    async def relay(self, proc: asyncio.subprocess.Process) -> bytes:
        """Wait for the agent to exit, read what is left in its pipes, and return its stdout."""
        try:
            await proc.wait()
            await asyncio.wait([r.ended for r in self._relays], timeout=_DRAIN_S)
        finally:
            self._close()
        return _PDB_PROMPT.sub(b"", bytes(self._stdout))  # pdb's prompt may start the line of the answer

    def _close(self) -> None:
        for relay in self._relays:
            relay.close()


class _Relay(asyncio.Protocol):
    """One of a debug agent's output pipes: what arrives goes to its sink and to the runner's stderr."""

    def __init__(self, sink: Callable[[bytes], object]):
        self.sink = sink
        self.ended = asyncio.get_running_loop().create_future()
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.sink(data)
        _echo(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended.done():
            self.ended.set_result(None)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _echo(data: bytes) -> None:
    """Write an agent's bytes to the runner's stderr as they are (through sys.stderr, so that capture works)."""
    sys.stderr.flush()
    buffer = getattr(sys.stderr, "buffer", None)
    if buffer is not None:
        buffer.write(data)
        buffer.flush()
    else:
        sys.stderr.write(data.decode("utf-8", "replace"))
        sys.stderr.flush()
