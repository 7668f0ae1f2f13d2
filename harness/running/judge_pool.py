"""JudgePool: run a judge in worker processes, so judge code can neither hang nor crash the run.

Each worker is a long-lived process that loads the judge once, then scores one episode at a time, talking to the
pool over a pipe (pickled tuples). A judge that raises, returns something that is not a reward, runs past the
timeout (its worker is killed and replaced) or kills its worker becomes a Judgement with reward None and the
reason in `error`. Only a spec that cannot be loaded raises, once, from the constructor: a typo fails the run at
its start, not every episode.

Workers start through multiprocessing's "forkserver" (a clean, thread-free process, so a replacement costs a fork,
not a fresh interpreter; "spawn" where there is none). They take the parent's environment, working directory and
sys.path as they were when the pool was made, ignore Ctrl-C (the parent closes the pool), and write their stdout
to stderr, so that a judge's prints never mix into the run's output.

`InProcessJudge` is the same interface without the processes, for debug runs: the judge is called in this process
(in a thread, so that the event loop keeps serving), so a breakpoint in judge code stops in your terminal. A judge
that raises or returns something that is not a reward is still an error judgement, but nothing else is contained:
no timeout can be enforced (a thread cannot be killed, and a breakpoint must be allowed to wait), a judge that
hangs holds the run, one that kills its process (os._exit, a segfault) ends the run, and its prints go to stdout.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from harness.core.records import Judgement
from harness.running.judges import JudgeError, LoadedJudge, load_judge, normalise_result
from harness.running.limits import JUDGE_MEMORY_MB, cap_memory

__all__ = ["InProcessJudge", "JudgePool"]

_PIPE_CHUNK = 64 * 1024  # a job bigger than this is written from a thread, so the event loop never waits on it
_STOP = b""  # tells a worker to exit


@dataclass
class _Slot:
    """One worker place in the pool; its process is replaced when it dies or is killed."""

    process: BaseProcess | None = None
    conn: Connection | None = None
    code_hash: str | None = None  # reported by the worker once it has loaded the judge; None until then
    waiter: asyncio.Future | None = None  # set while a judgement waits for this worker's answer


class _WorkerLost(Exception):
    """The worker timed out, died or could not start; the message is the judgement's error."""


class JudgePool:
    """Score episodes with one judge in `workers` processes; `await pool.judge(...)` never raises for the judge's
    failures. Use as `async with JudgePool(spec) as pool:` or call `close()`."""

    def __init__(self, spec: str, *, workers: int = 2, timeout_s: float = 60, startup_timeout_s: float = 120):
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"JudgePool workers must be a whole number >= 1, got {workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"JudgePool timeout_s must be > 0 seconds, got {timeout_s!r}")
        loaded = load_judge(spec)  # a bad spec raises JudgeError here, before any worker starts
        self.name, self.code_hash = loaded.name, loaded.code_hash
        self.timeout_s, self.startup_timeout_s = float(timeout_s), float(startup_timeout_s)
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        self._ctx = multiprocessing.get_context(method)
        if method == "forkserver":  # no effect if this process's forkserver already runs
            self._ctx.set_forkserver_preload(["__main__", __name__])
        self._setup = (self.name, os.getcwd(), dict(os.environ), list(sys.path))
        self._closed = False
        self._slots = [_Slot() for _ in range(workers)]
        self._idle: asyncio.Queue[_Slot] = asyncio.Queue()
        for slot in self._slots:
            self._start(slot)
            self._idle.put_nowait(slot)

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the live workers."""
        return [s.process.pid for s in self._slots if s.process is not None]

    async def judge(self, episode_id: str, task: dict, answer: str | None, calls: list[dict]) -> Judgement:
        """Score one episode on the next idle worker. A judge failure gives reward None and the reason in error."""
        if self._closed:
            raise RuntimeError(f"JudgePool({self.name!r}) is closed")
        slot = await self._idle.get()
        try:
            if self._closed:  # closed while this judgement waited for a worker
                raise RuntimeError(f"JudgePool({self.name!r}) was closed")
            code_hash = self.code_hash
            try:
                if slot.process is None:
                    self._start(slot)
                reward, details, error = await self._score(slot, task, answer, calls)
                code_hash = slot.code_hash or code_hash  # the code the worker actually ran
            except _WorkerLost as lost:
                reward, details, error = None, {}, str(lost)
                self._replace(slot)
            except BaseException:  # cancelled mid-judgement: the worker's state is unknown
                self._replace(slot)
                raise
        finally:
            self._idle.put_nowait(slot)  # after close, so that the next waiter wakes and sees it
        return Judgement(episode_id=episode_id, judge=self.name, judge_hash=code_hash, reward=reward,
                         details=details, error=error, created_at=time.time())

    async def _score(self, slot: _Slot, task: dict, answer: str | None, calls: list[dict]):
        if slot.code_hash is None:
            try:
                async with asyncio.timeout(self.startup_timeout_s):
                    kind, value = await self._receive(slot)
            except TimeoutError:
                late = f"judge {self.name}: its worker did not start within {self.startup_timeout_s:g} s"
                raise _WorkerLost(late) from None
            if kind != "ready":
                raise _WorkerLost(f"judge {self.name} could not be loaded in its worker: {value}")
            slot.code_hash = value
        try:
            job = pickle.dumps((task, answer, calls), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            return None, {}, f"the episode could not be sent to judge {self.name}: {type(e).__name__}: {e}"
        try:
            async with asyncio.timeout(self.timeout_s):
                if len(job) <= _PIPE_CHUNK:
                    slot.conn.send_bytes(job)
                else:
                    await asyncio.to_thread(slot.conn.send_bytes, job)
                kind, *rest = await self._receive(slot)
        except TimeoutError:
            raise _WorkerLost(f"judge {self.name} timed out after {self.timeout_s:g} s") from None
        return _unpack(kind, rest)

    async def _receive(self, slot: _Slot) -> tuple:
        conn, process = slot.conn, slot.process
        try:
            if not conn.poll():
                loop = asyncio.get_running_loop()
                slot.waiter = readable = loop.create_future()
                fd = conn.fileno()
                loop.add_reader(fd, _wake, readable)
                try:
                    await readable
                finally:
                    loop.remove_reader(fd)
                    slot.waiter = None
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            if self._closed:
                raise _WorkerLost(f"judge {self.name} was stopped: the pool was closed while it was judging") from None
            process.join(5)
            code = process.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            raise _WorkerLost(f"judge {self.name} crashed its worker process ({how})") from None

    def _start(self, slot: _Slot) -> None:
        mine, theirs = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=_serve, args=(theirs, *self._setup), name="harness-judge", daemon=True)
        try:
            process.start()
        finally:
            theirs.close()  # the worker's end lives in the worker only, so its death reads as EOF here
        slot.process, slot.conn, slot.code_hash = process, mine, None

    def _stop(self, slot: _Slot) -> None:
        if slot.waiter is not None:  # a judgement waits on this worker: let it see the pipe close
            slot.waiter.get_loop().call_soon_threadsafe(_wake, slot.waiter)
        if slot.process is not None:
            if slot.process.is_alive():
                slot.process.kill()
            slot.process.join(5)
            slot.conn.close()
        slot.process, slot.conn, slot.code_hash = None, None, None

    def _replace(self, slot: _Slot) -> None:
        """Kill the slot's worker and start a fresh one now, so that it is warm for the next episode; if that
        fails, the next judge() on this slot tries again and reports the failure as its error."""
        self._stop(slot)
        if not self._closed:
            try:
                self._start(slot)
            except Exception:
                self._stop(slot)

    def close(self) -> None:
        """Stop the workers: idle ones are asked to exit (and killed after 2 s), busy ones are killed at once, their
        judgements ending as error rows; judgements still waiting for a worker raise RuntimeError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        idle = [s for s in self._slots if s.process is not None and s.waiter is None]
        for slot in idle:
            try:
                slot.conn.send_bytes(_STOP)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for slot in idle:
            slot.process.join(max(0.0, deadline - time.monotonic()))
        for slot in self._slots:
            self._stop(slot)

    async def __aenter__(self) -> JudgePool:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class InProcessJudge:
    """Score episodes with one judge called in this process, one at a time, for debugging (see the module's
    docstring for what it cannot contain). Same interface as JudgePool: `await judge(...)`, `close()`, `async with`."""

    def __init__(self, spec: str):
        self._judge = load_judge(spec)  # a bad spec raises JudgeError here, as for the pool
        self.name, self.code_hash = self._judge.name, self._judge.code_hash
        self._turn = asyncio.Lock()  # one judgement at a time, so that two breakpoints never wait at once
        self._closed = False

    async def judge(self, episode_id: str, task: dict, answer: str | None, calls: list[dict]) -> Judgement:
        """Score one episode. A judge failure gives reward None and the reason in error; no timeout applies."""
        if self._closed:
            raise RuntimeError(f"InProcessJudge({self.name!r}) is closed")
        async with self._turn:
            kind, *rest = await asyncio.to_thread(_score_one, self._judge, task, answer, calls)
        reward, details, error = _unpack(kind, rest)
        return Judgement(episode_id=episode_id, judge=self.name, judge_hash=self.code_hash, reward=reward,
                         details=details, error=error, created_at=time.time())

    def close(self) -> None:
        self._closed = True

    async def __aenter__(self) -> InProcessJudge:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


def _unpack(kind: str, rest: list) -> tuple:
    """(reward, details, error) from what `_score_one` returned."""
    return (rest[0], rest[1], None) if kind == "ok" else (None, rest[1], rest[0])


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


# ---------------------------------------------------------------------------------------------------- worker


def _serve(conn: Connection, spec: str, cwd: str, env: dict, path: list[str]) -> None:
    """A worker's life: load the judge, say "ready" (or why not), then answer jobs until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cap_memory(JUDGE_MEMORY_MB)  # a judge that allocates without end fails its judgement, not the machine
    os.dup2(2, 1)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    try:
        judge = load_judge(spec)
    except BaseException as e:
        conn.send_bytes(pickle.dumps(("failed", f"{type(e).__name__}: {e}")))
        return
    conn.send_bytes(pickle.dumps(("ready", judge.code_hash)))
    while True:
        try:
            job = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if job == _STOP:
            return
        conn.send_bytes(pickle.dumps(_score_one(judge, *pickle.loads(job)), protocol=pickle.HIGHEST_PROTOCOL))


def _score_one(judge: LoadedJudge, task: dict, answer: str | None, calls: list[dict]) -> tuple:
    """("ok", reward, details) or ("error", message, details)."""
    try:
        value = judge.fn(task, answer, calls)
    except BaseException as e:  # SystemExit too: a judge must not end its worker
        message = f"judge {judge.name} raised {type(e).__name__}: {e}"
        return "error", message[:2000], {"traceback": traceback.format_exc()[-4000:]}
    try:
        reward, details = normalise_result(judge.name, value)
    except JudgeError as e:
        return "error", str(e), {}
    return "ok", reward, details
