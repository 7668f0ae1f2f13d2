"""Warm starts: Python agents forked from an interpreter that has already imported the openai SDK.

`python agent.py` pays for a fresh interpreter and for `import openai` (httpx, pydantic, anyio, the SDK's types)
in every episode: ~1 s of CPU on a quiet core here, ~1.7 s on a loaded one, more than a short agent's own work. A
warm starter is one process (`python -m harness.running.warm FD MODULE...`) started once with the agents' base
environment; it imports those modules and then forks one child per episode. The child becomes what
`python agent.py ARGS` would have been, as seen from the agent:

- its own session and process group (killed whole at the episode's end, as a cold agent is), under the same memory
  and process caps (harness/running/limits.py), in the episode's working directory and environment;
- stdin, stdout and stderr are the episode's pipes and log, passed over the socket (SCM_RIGHTS), made into
  sys.stdin/stdout/stderr as Python makes them (buffering and encoding of the starter, which shares the agents'
  PYTHON* and locale variables: an episode whose differ starts cold);
- `__name__ == "__main__"` (a module of that name in sys.modules), `__file__` (absolute), sys.argv as given,
  sys.path[0] = the script's directory (symlinks resolved), tracebacks that start at the script;
- the exit code: `sys.exit(...)`'s, 1 with the traceback on stderr for an uncaught exception, death by SIGINT
  for a KeyboardInterrupt; non-daemon threads are joined and atexit handlers run, as at interpreter exit.

What differs, and why it does not matter to an agent: the modules the starter imported are already in
`sys.modules` (their import-time state was made with the same environment, less the per-episode variables, which
the SDK reads when a client is made, not when it is imported); `random` is reseeded in every child (Python does that
at fork); the hash seed of `str` is the starter's, shared by its children. Anything else - `python -m`, `-c`, a
script not named *.py,
another interpreter, a non-Python command, debug mode - starts cold, as before. `rollout.warm_start: false` /
`harness run --cold-start` turns warm starts off.

The protocol (one SOCK_SEQPACKET pair, JSON messages): the starter says {"ready": [modules]}; each request
{"id", "argv", "env", "cwd", "memory_mb", "max_procs"} carries three descriptors (stdin, stdout, stderr) and is
answered {"id", "pid"} (or {"id", "error"}) once the child has its own session; when a child ends the starter says
{"exit": pid, "returncode": n} (negative: the signal that killed it). The starter exits when the socket closes.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from pathlib import Path

PRELOAD = ("openai",)
MAX_MESSAGE = 4 << 20  # a request (its environment holds the task) above this starts cold
_STARTUP_VARS = ("LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE")  # with PYTHON*: what an interpreter reads when it starts


def startup_env(env: dict[str, str]) -> dict[str, str]:
    """The variables that shape a Python interpreter as it starts: two environments that agree on them may share a
    warm starter."""
    return {k: v for k, v in env.items() if k.startswith("PYTHON") or k in _STARTUP_VARS}


def script_of(command: list[str], cwd: Path | str | None = None, python: str = sys.executable) -> str | None:
    """The script of `python SCRIPT ARGS...` run by this interpreter in `cwd`, else None (a warm start cannot stand
    in for it)."""
    if len(command) < 2 or command[1].startswith("-"):
        return None
    # the same bin directory: another venv's python is a link to the same binary, with other site-packages
    here, there = (os.path.dirname(os.path.abspath(p)) for p in (python, command[0]))
    try:
        same = here == there and os.path.samefile(command[0], python)
    except OSError:
        return None
    script = os.path.join(cwd or os.getcwd(), command[1])
    return script if same and script.endswith(".py") and os.path.isfile(script) else None


# ---------------------------------------------------------------------------------------------------------------
# The runner's side.
# ---------------------------------------------------------------------------------------------------------------


class WarmProcess:
    """A forked agent, as the runner uses an asyncio subprocess: pid, returncode, communicate, wait."""

    def __init__(self, pid: int, stdin: int, stdout: int, exited: asyncio.Future):
        self.pid = pid
        self._stdin, self._stdout, self._exited = stdin, stdout, exited

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    async def communicate(self, input: bytes = b"") -> tuple[bytes, None]:
        """Write `input` to the agent's stdin and close it, read its stdout to the end, wait for it to exit."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transports = []
        try:
            out_t, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                    open(self._stdout, "rb", 0))
            transports.append(out_t)
            in_t, in_p = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, open(self._stdin, "wb", 0))
            transports.append(in_t)
            writer = asyncio.StreamWriter(in_t, in_p, None, loop)

            async def feed() -> None:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    writer.write(input)
                    await writer.drain()
                writer.close()

            _, out = await asyncio.gather(feed(), reader.read())
            await self.wait()
            return out, None
        finally:
            for t in transports:
                t.close()


class WarmStarter:
    """One warm starter process and its children, on the running event loop."""

    def __init__(self, proc: asyncio.subprocess.Process, sock: socket.socket, preloaded: list[str]):
        self.proc, self.preloaded = proc, preloaded
        self._sock = sock
        self._env: dict[str, str] = {}
        self._next = 0
        self._spawning: dict[int, asyncio.Future] = {}
        self._exits: dict[int, asyncio.Future] = {}
        self._early: dict[int, int] = {}  # exits that came before their spawn's answer was handled
        self._abandoned: set[int] = set()  # requests whose caller gave up (cancelled): their child is killed
        self._reader: asyncio.Task | None = None
        self.died: str | None = None  # why the starter is gone, once it is

    @classmethod
    async def start(cls, env: dict[str, str], log_path: Path, preload: tuple[str, ...] = PRELOAD) -> WarmStarter:
        """Start a starter with the agents' base environment; its own stderr goes to `log_path`."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for s in (ours, theirs):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE + 4096)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, MAX_MESSAGE + 4096)
        try:
            with open(log_path, "ab") as log:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "harness.running.warm", str(theirs.fileno()), *preload,
                    pass_fds=(theirs.fileno(),), env=env, stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL, stderr=log, start_new_session=True)
        finally:
            theirs.close()
        ours.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            hello = await loop.sock_recv(ours, 65536)
            if not hello:
                raise RuntimeError(f"the warm starter exited before it was ready (see {log_path})")
            starter = cls(proc, ours, json.loads(hello)["ready"])
        except BaseException:
            ours.close()
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        starter._env = startup_env(env)
        starter._reader = asyncio.create_task(starter._read())
        return starter

    def takes(self, command: list[str], env: dict[str, str], cwd: Path | None = None) -> bool:
        """Whether this starter can stand in for `command` in `env`, run in `cwd`."""
        return self.died is None and startup_env(env) == self._env and script_of(command, cwd) is not None

    async def spawn(self, command: list[str], *, env: dict[str, str], cwd: Path | None, stderr: int,
                    memory_mb: int | None, max_procs: int | None) -> WarmProcess:
        """Fork `command` (a `python SCRIPT ...` that `takes` accepted); OSError when it could not start."""
        self._next += 1
        ident = self._next
        message = json.dumps({"id": ident, "argv": command[1:], "env": env, "cwd": str(cwd or os.getcwd()),
                              "memory_mb": memory_mb, "max_procs": max_procs}).encode()
        if len(message) > MAX_MESSAGE:
            raise OSError(f"the episode's environment is {len(message)} bytes, above the warm starter's "
                          f"{MAX_MESSAGE}")
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        loop = asyncio.get_running_loop()
        spawned = self._spawning[ident] = loop.create_future()
        sent = False
        try:
            await self._send(message, [in_r, out_w, stderr])
            sent = True
            pid = await spawned
        except BaseException:
            if sent and not spawned.done():
                self._abandoned.add(ident)  # the child may be forked yet: it is killed as soon as it is
            os.close(in_w)
            os.close(out_r)
            raise
        finally:
            if ident not in self._abandoned:
                self._spawning.pop(ident, None)
            os.close(in_r)
            os.close(out_w)
        exited = self._exits.setdefault(pid, loop.create_future())
        if pid in self._early:
            exited.set_result(self._early.pop(pid))
        return WarmProcess(pid, in_w, out_r, exited)

    async def _send(self, message: bytes, fds: list[int]) -> None:
        loop = asyncio.get_running_loop()
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        while True:
            if self.died is not None:
                raise OSError(f"the warm starter is gone: {self.died}")
            try:
                self._sock.sendmsg([message], ancillary)
                return
            except BlockingIOError:
                ready = loop.create_future()
                loop.add_writer(self._sock, lambda f=ready: f.done() or f.set_result(None))
                try:
                    await ready
                finally:
                    loop.remove_writer(self._sock)
            except OSError as exc:
                raise OSError(f"the warm starter is gone: {exc}") from exc

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await loop.sock_recv(self._sock, 65536):
                msg = json.loads(data)
                if "exit" in msg:
                    future = self._exits.pop(msg["exit"], None)  # a run that never stops forks without end
                    if future is None:
                        self._early[msg["exit"]] = msg["returncode"]
                    elif not future.done():
                        future.set_result(msg["returncode"])
                elif msg["id"] in self._abandoned:
                    self._abandoned.discard(msg["id"])
                    self._spawning.pop(msg["id"], None)
                    if "pid" in msg:
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.killpg(msg["pid"], signal.SIGKILL)
                elif (future := self._spawning.get(msg["id"])) is not None and not future.done():
                    if "pid" in msg:
                        future.set_result(msg["pid"])
                    else:
                        future.set_exception(OSError(msg["error"]))
        except (OSError, ValueError) as exc:
            self.died = f"its socket failed: {exc}"
        finally:
            await self.proc.wait()
            self.died = self.died or f"it exited with code {self.proc.returncode}"
            for future in self._spawning.values():
                if not future.done():
                    future.set_exception(OSError(f"the warm starter is gone: {self.died}"))
            for pid, future in self._exits.items():  # its children would run on, unwatched: they end with it
                if not future.done():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
                    future.set_result(-signal.SIGKILL)

    async def close(self) -> None:
        """Stop the starter: it exits when its socket closes (its children, if any are left, are killed with it)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await self._reader
        self._sock.close()
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()


# ---------------------------------------------------------------------------------------------------------------
# The starter's side: `python -m harness.running.warm FD MODULE...`.
# ---------------------------------------------------------------------------------------------------------------


def _serve(sock: socket.socket) -> None:
    """Fork a child per request and report every exit, until the runner closes the socket (or is gone)."""
    with contextlib.suppress(ConnectionError):
        _loop(sock)


def _loop(sock: socket.socket) -> None:
    import selectors

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD wakes the selector
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is sock:
                try:
                    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE + 4096, 3)
                except InterruptedError:
                    continue
                if not data:
                    return
                _spawn(sock, json.loads(data), fds, (sock.fileno(), wake_r, wake_w))
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
        while True:  # reap every child that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock.send(json.dumps({"exit": pid, "returncode": os.waitstatus_to_exitcode(status)}).encode())


def _spawn(sock: socket.socket, request: dict, fds: list[int], ours: tuple[int, ...]) -> None:
    ready_r, ready_w = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        for fd in (*fds, ready_r, ready_w):
            os.close(fd)
        sock.send(json.dumps({"id": request["id"], "error": f"fork failed: {exc}"}).encode())
        return
    if pid == 0:
        os.close(ready_r)
        _child(request, fds, ready_w, ours)  # never returns
    os.close(ready_w)
    os.read(ready_r, 1)  # the child has its own session (or is dead): a kill of its group now reaches it
    os.close(ready_r)
    for fd in fds:
        os.close(fd)
    sock.send(json.dumps({"id": request["id"], "pid": pid}).encode())


def _child(request: dict, fds: list[int], ready_w: int, ours: tuple[int, ...]) -> None:
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        os.write(ready_w, b"1")
        os.close(ready_w)
        for fd in ours:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        code = _become(request)
    except BaseException:  # noqa: BLE001 - the child must never return into the starter's loop
        with contextlib.suppress(BaseException):
            import traceback

            traceback.print_exc()
    finally:
        os._exit(code)


def _become(request: dict) -> int:
    """Turn this forked child into `python SCRIPT ARGS`; its exit code."""
    import atexit
    import importlib.machinery
    import io
    import threading
    import types

    from harness.running.limits import _sweep, cap_memory, cap_processes, pids_root

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    cap_memory(request["memory_mb"])
    if request["max_procs"]:
        root = pids_root()
        if root is not None:
            _sweep(root)
        how = cap_processes(request["max_procs"])
        if how.startswith("no process cap"):
            print(f"harness.running.limits: {how}", file=sys.__stderr__)
    for name, fd, mode in (("stdin", 0, "r"), ("stdout", 1, "w"), ("stderr", 2, "w")):
        like = getattr(sys, f"__{name}__")  # made by this interpreter at its start, in the agents' startup env
        raw = io.FileIO(fd, mode, closefd=False)
        binary = raw if isinstance(like.buffer, io.FileIO) else (io.BufferedReader(raw) if mode == "r"
                                                                 else io.BufferedWriter(raw))
        stream = io.TextIOWrapper(binary, encoding=like.encoding, errors=like.errors,
                                  line_buffering=like.line_buffering, write_through=like.write_through)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    script, *args = request["argv"]
    path = os.path.abspath(script)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    main = types.ModuleType("__main__")
    main.__file__, main.__loader__ = path, importlib.machinery.SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    code = 0
    try:
        with io.open_code(path) as f:
            source = f.read()
        exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        _print_exception()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback, exit 1
        _print_exception()
        code = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()  # non-daemon threads are joined, as at interpreter exit
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:
            code = code or 120
        except BaseException:  # noqa: BLE001
            pass
    if code == -signal.SIGINT:  # as the interpreter ends on an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _print_exception() -> None:
    """The traceback as `python agent.py` prints it: from the agent's frames, without ours."""
    import traceback

    exc = sys.exc_info()[1]
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)


def main(argv: list[str]) -> int:
    sock = socket.socket(fileno=int(argv[0]))
    loaded = []
    for name in argv[1:]:
        try:
            __import__(name)
            loaded.append(name)
        except Exception as exc:  # noqa: BLE001 - a module that does not import is just not preloaded
            print(f"harness.running.warm: not preloaded: {name}: {exc!r}", file=sys.stderr)
    sock.send(json.dumps({"ready": loaded}).encode())
    _serve(sock)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
