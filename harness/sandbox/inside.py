"""What runs inside a sandbox, first: the standard library only, run as `python -IS inside.py ...` (no site, no
venv, nothing of the host's but the interpreter), so it needs nothing bound into the sandbox but itself.

    inside.py relay HOST:PORT=SOCKET [HOST:PORT=SOCKET ...] -- command args...
        Listen on each HOST:PORT of the sandbox's own network namespace, relay every connection to the unix
        SOCKET bound into it (the proxy's), then run the command and exit as it exits (128 + N for a signal N).
        The listeners exist before the command starts: an agent never races them. This process is the
        command's parent; when it exits, bubblewrap's init ends, and the kernel kills all that is left in the
        sandbox's PID namespace.
    inside.py shim NAME args...
        A blocked command (bound over the real one): report the attempt on the events socket, refuse, exit 126.

Events go to /run/harness/events.sock, one JSON object per line; the host side (bwrap.py) records them as the
episode's sandbox flags. A sandboxed process can write to that socket too: an event is a finding to look at, not
proof; what the sandbox enforces (read-only mounts, no network namespace, dropped capabilities) needs no event.
"""

import json
import os
import signal
import socket
import sys
import threading

EVENTS = "/run/harness/events.sock"
BLOCKED_EXIT = 126


def report(event: dict) -> None:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(EVENTS)
            s.sendall(json.dumps(event).encode() + b"\n")
    except OSError:
        pass  # the host side is gone: the episode is ending anyway


def _copy(src: socket.socket, dst: socket.socket, ends: list) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        ends.append(1)
        if len(ends) == 2:  # both directions done
            src.close()
            dst.close()


def _serve(listener: socket.socket, target: str) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(target)
        except OSError:
            conn.close()
            upstream.close()
            continue
        ends: list = []
        for a, b in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=_copy, args=(a, b, ends), daemon=True).start()


def relay(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: inside.py relay HOST:PORT=SOCKET ... -- command args...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    routes, command = argv[:cut], argv[cut + 1:]
    listeners = []
    for route in routes:
        address, _, target = route.partition("=")
        host, _, port = address.rpartition(":")
        listener = socket.create_server((host, int(port)), backlog=128)
        listeners.append((listener, target))
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(command[0], command)
        except OSError as exc:
            print(f"could not start {command[0]!r} in the sandbox: {exc}", file=sys.stderr)
        os._exit(127)
    for listener, target in listeners:
        threading.Thread(target=_serve, args=(listener, target), daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda n, _f: os.kill(pid, n))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def shim(name: str, args: list[str]) -> int:
    report({"kind": "blocked_command", "command": name, "argv": [name, *args][:16]})
    print(f"{name}: blocked in this sandbox (the task's blocked commands; harness)", file=sys.stderr)
    return BLOCKED_EXIT


def main(argv: list[str]) -> int:
    if argv[:1] == ["relay"]:
        return relay(argv[1:])
    if argv[:1] == ["shim"] and len(argv) >= 2:
        return shim(argv[1], argv[2:])
    print("usage: inside.py relay ... | shim NAME args...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
