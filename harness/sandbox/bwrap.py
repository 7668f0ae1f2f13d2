"""The bubblewrap sandbox (Debian's `bubblewrap`; `make install` installs it): Linux namespaces, no daemon, no image.

What a process in it sees:
- the host's toolchain read-only: /usr and the /bin, /lib... links or directories beside it, the parts of /etc that
  programs read (users, hosts, certificates, the dynamic linker's cache, alternatives; not shadow, not ssh keys),
  and `SandboxSpec.binds` (the agent's own install: a venv, node_modules) at their host paths;
- its workspace, writable, at `spec.workdir` (a host directory the caller owns: it outlives the sandbox), HOME
  (/root) writable and private, a private /tmp, /proc and /dev of its own; everything else is read-only, the root
  included (`--remount-ro /`): a write anywhere else fails with EROFS;
- a network namespace of its own, loopback only: the host's ports are not there. The proxy is: a relay inside
  (inside.py) listens at the proxy's own address and port and carries each connection to the proxy's unix socket,
  bound in, so the agent's OPENAI_BASE_URL is the usual one and nothing else on the host answers;
- PID, IPC, UTS, cgroup and user namespaces of its own, every capability dropped (uid 0 without privileges), a
  session of its own; when the command it runs exits, the PID namespace ends and the kernel kills what is left.
Limits: each process's writable memory (RLIMIT_DATA), and the processes and CPU time of all of them together, by
harness/running/limits.py around bwrap (cgroups where the machine lets them).
Blocked commands are shims bound over the real ones and put first on PATH: each attempt is refused (exit 126) and
flagged. They stop the easy way (`git log`, `pip install`), not a determined one (a copy of the binary, python -m
pip): what must not be reachable is kept out of the sandbox instead, as tests and solutions are.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.running.limits import limited, release
from harness.sandbox import SandboxError, SandboxSpec, flag

INSIDE = Path(__file__).with_name("inside.py")
RUN = "/run/harness"
HOME = "/root"
_TOP_LEVEL = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# What programs read from /etc; the rest of it (shadow, ssh host keys, the host's own configuration) stays out.
_ETC = ("passwd", "group", "hosts", "host.conf", "nsswitch.conf", "resolv.conf", "localtime", "timezone",
        "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl", "ca-certificates",
        "ca-certificates.conf", "mime.types", "protocols", "services", "os-release", "debian_version",
        "bash.bashrc", "profile", "inputrc", "gitconfig", "python3", "python3.11")
_MAX_FLAGS = 200
_INSTALL = ("bubblewrap (bwrap) is not installed: on Debian or Ubuntu `apt-get install bubblewrap` (`make install` "
            "does it), on Fedora `dnf install bubblewrap`; or run without a sandbox")


class Bubblewrap:
    """The backend: checks once that bwrap is there and can make namespaces here."""

    name = "bwrap"

    def __init__(self):
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxError(_INSTALL)
        try:
            probe = subprocess.run([self.bwrap, "--ro-bind", "/", "/", "--unshare-all", "--die-with-parent",
                                    "--cap-drop", "ALL", "true"], capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            raise SandboxError(f"{self.bwrap} did not make a sandbox within 120 s on this machine") from None
        if probe.returncode != 0:
            raise SandboxError(f"bubblewrap cannot make a sandbox on this machine: {probe.stderr.strip()} "
                               "(it needs user namespaces, or root)")

    async def open(self, spec: SandboxSpec, workspace: Path, *, proxy: tuple[str, str, int] | None = None,
                   mounts: dict[str, tuple[Path, bool]] | None = None) -> BwrapSandbox:
        """A sandbox over `workspace` (made if missing). `proxy`: (unix socket, host, port) the relay serves inside;
        `mounts`: more host directories, {path inside: (host path, writable)} (a verifier's /tests, /logs)."""
        if proxy is not None and proxy[1] not in ("127.0.0.1", "localhost", "0.0.0.0"):
            raise SandboxError(f"the proxy listens on {proxy[1]}: a sandbox, whose network is its own loopback, "
                               "reaches a proxy on 127.0.0.1 or 0.0.0.0 only (ProxyConfig.host)")
        box = BwrapSandbox(self.bwrap, spec, Path(workspace), proxy, dict(mounts or {}))
        await box._start()
        return box


class BwrapSandbox:
    def __init__(self, bwrap: str, spec: SandboxSpec, workspace: Path, proxy: tuple[str, str, int] | None,
                 mounts: dict[str, tuple[Path, bool]]):
        self.bwrap, self.spec, self.workspace, self.proxy, self.mounts = bwrap, spec, workspace, proxy, mounts
        self.flags: list[dict] = []
        self.flags_dropped = 0
        self._dir = Path(tempfile.mkdtemp(prefix="hx-box-"))  # short: unix socket paths are at most 107 bytes
        self._run = self._dir / "run"  # /run/harness inside, read-only
        self._home = self._dir / "home"
        self._events: asyncio.AbstractServer | None = None
        self._procs: list[asyncio.subprocess.Process] = []
        self._closed = False

    async def _start(self) -> None:
        try:
            await self._make()
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise

    async def _make(self) -> None:
        self.workspace.mkdir(parents=True, exist_ok=True)
        (self._run / "bin").mkdir(parents=True)
        self._home.mkdir()
        shutil.copy(INSIDE, self._run / "inside.py")
        if self.proxy is not None:
            (self._run / "proxy.sock").touch()  # where the proxy's socket is bound
        python = _interpreter()
        for name in self.spec.blocked:
            shim = self._run / "bin" / name
            shim.write_text(f"#!{python} -IS\nimport sys\nsys.path.insert(0, {RUN!r})\nimport inside\n"
                            f"sys.exit(inside.shim({name!r}, sys.argv[1:]))\n")
            shim.chmod(0o755)
        self._events = await asyncio.start_unix_server(self._on_event, path=str(self._run / "events.sock"))

    # ------------------------------------------------------------------------------------------------ the seam

    async def exec(self, command: list[str], *, env: dict[str, str], stdin=None, stdout=None, stderr=None,
                   cwd: str | None = None) -> asyncio.subprocess.Process:
        """Start `command` in the sandbox (a session of its own on the host: kill its group to stop it)."""
        if self._closed:
            raise SandboxError("this sandbox is closed")
        inside_env = {**env, **self.spec.env, "HOME": HOME}
        inside_env.pop("TMPDIR", None)  # a host path
        inside_env["PATH"] = f"{RUN}/bin:{inside_env.get('PATH') or '/usr/local/bin:/usr/bin:/bin'}"
        argv = self.argv(command, cwd=cwd or self.spec.workdir, path=inside_env["PATH"])
        proc = await asyncio.create_subprocess_exec(
            *limited(argv, self.spec.memory_mb, self.spec.max_procs, self.spec.cpus), stdin=stdin, stdout=stdout,
            stderr=stderr, env=inside_env, cwd=self._dir, start_new_session=True)
        self._procs.append(proc)
        return proc

    def put(self, source: Path, dest: str) -> None:
        """Copy a host file or directory to `dest`, a path in the workspace (never through a link there)."""
        target = self._host_path(dest)
        if target.is_symlink():
            raise SandboxError(f"{dest!r} is a link in the sandbox's workspace: not written through")
        target.parent.mkdir(parents=True, exist_ok=True)
        if Path(source).is_dir():
            shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(source, target)

    def get(self, path: str, limit: int = 64 << 20) -> bytes:
        """The bytes of a file in the workspace (at most `limit`)."""
        fd = os.open(self._host_path(path), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            return f.read(limit)

    async def close(self) -> None:
        """Kill everything still running in the sandbox, release its cgroups, remove its own files (the workspace
        stays)."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self._procs:
            await proc.wait()
            if self.spec.max_procs or self.spec.cpus:
                await asyncio.to_thread(release, proc.pid)
        if self._events is not None:
            self._events.close()
            await self._events.wait_closed()
        await asyncio.to_thread(shutil.rmtree, self._dir, True)
        await asyncio.to_thread(strip_setid, self.workspace)

    # ------------------------------------------------------------------------------------------------ inside

    def argv(self, command: list[str], *, cwd: str, path: str) -> list[str]:
        """The bwrap command line that runs `command` in this sandbox."""
        a = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
             "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
        for top in _TOP_LEVEL:
            p = Path("/") / top
            if p.is_symlink():
                a += ["--symlink", os.readlink(p), str(p)]
            elif p.is_dir():
                a += ["--ro-bind", str(p), str(p)]
        for name in _ETC:
            if os.path.lexists(f"/etc/{name}"):
                a += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
        a += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", str(self._home), HOME]
        bound = [h for h in dict.fromkeys([sys.base_prefix, *self.spec.binds])
                 if os.path.exists(h) and not _under(h, "/usr")]
        for host in bound:
            a += ["--ro-bind", host, host]
        a += ["--ro-bind", str(self._run), RUN]
        if self.proxy is not None:
            a += ["--ro-bind", self.proxy[0], f"{RUN}/proxy.sock"]
        a += ["--bind", str(self.workspace), self.spec.workdir]
        for inside, (host, writable) in self.mounts.items():
            a += ["--bind" if writable else "--ro-bind", str(host), inside]
        for name in self.spec.blocked:  # over the real command too, wherever PATH would find it
            for found in _found(name, path, ["/usr", *bound]):
                a += ["--ro-bind", str(self._run / "bin" / name), found]
        # The root and /proc read-only: uid 0 inside is the host's root without capabilities, and procfs lets a
        # file's owner write what only capabilities guard elsewhere (sysctls, /proc/sysrq-trigger).
        a += ["--remount-ro", "/", "--remount-ro", "/proc", "--chdir", cwd, _interpreter(), "-IS",
              f"{RUN}/inside.py", "relay"]
        if self.proxy is not None:
            a.append(f"{self.proxy[1]}:{self.proxy[2]}={RUN}/proxy.sock")
        return [*a, "--", *command]

    def _host_path(self, path: str) -> Path:
        """The host path of `path` in the workspace, refused when it (or a link on the way) leads out of it: what
        runs inside may have made any name a link to a host file."""
        workdir = self.spec.workdir.rstrip("/")
        if not (path == workdir or path.startswith(workdir + "/")):
            raise SandboxError(f"{path!r} is not in the sandbox's workspace ({workdir})")
        rel = os.path.normpath(path[len(workdir):].lstrip("/") or ".")
        root = os.path.realpath(self.workspace)
        host = os.path.join(self.workspace, rel)
        if rel.split(os.sep)[0] == ".." or not _under(os.path.realpath(host), root):
            raise SandboxError(f"{path!r} leads out of the sandbox's workspace ({workdir})")
        return Path(host)

    async def _on_event(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await _line(reader):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(event, dict) or not isinstance(event.get("kind"), str):
                    continue
                if len(self.flags) >= _MAX_FLAGS:
                    self.flags_dropped += 1
                    continue
                details = {k: v for k, v in event.items() if k != "kind" and isinstance(v, (str, int, list))}
                self.flags.append(flag(event["kind"], **details))
        finally:
            writer.close()


async def _line(reader: asyncio.StreamReader) -> bytes:
    """The next event line; b"" at the end or for a line past the reader's limit (64 KiB): the connection ends."""
    try:
        return await reader.readline()
    except (ValueError, asyncio.LimitOverrunError):
        return b""


def _interpreter() -> str:
    """This Python's own binary (not a venv's link to it): the relay runs on it with -IS, needing only its prefix."""
    return os.path.realpath(sys.executable)


def strip_setid(workspace: Path) -> None:
    """Clear the set-user-ID and set-group-ID bits of every file in `workspace`: what runs inside is the host's
    root without capabilities, so a setuid file it makes would be a root one on the host once the sandbox is gone."""
    for dirpath, dirnames, filenames in os.walk(workspace):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                mode = os.lstat(path).st_mode
                if mode & (stat.S_ISUID | stat.S_ISGID) and not stat.S_ISLNK(mode):
                    os.chmod(path, stat.S_IMODE(mode) & ~(stat.S_ISUID | stat.S_ISGID))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _found(name: str, path: str, roots: list[str]) -> list[str]:
    """Where `name` is on PATH, as real paths under `roots` (what the sandbox binds from the host)."""
    out: list[str] = []
    for d in path.split(":"):
        candidate = os.path.join(d, name)
        if d and not d.startswith(RUN) and os.path.isfile(candidate):
            real = os.path.realpath(candidate)
            if real not in out and any(_under(real, r) for r in roots):
                out.append(real)
    return out
