"""Transparent mode: agents that hard-code an LLM host (https://api.openai.com/v1, DashScope's compatible mode,
DeepSeek...) are recorded anyway, through an embedded mitmproxy in front of the agent process.

    agent --HTTPS_PROXY--> mitmproxy (proxy/mitm_addon.py) --http--> recording proxy /e/<episode>/v1 -> engine
                                 \\-- any other host: tunnelled untouched (or refused)

`Interceptor` starts the hop (in its own process, under a Python that has mitmproxy) and gives each episode its
environment: `HTTPS_PROXY` / `HTTP_PROXY` carrying the episode (as proxy credentials), `NO_PROXY` for loopback,
and trust in the per-installation CA through `SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`, `CURL_CA_BUNDLE` and
`NODE_EXTRA_CA_CERTS`. The CA lives in the harness home (`$HARNESS_HOME`, default ~/.harness) under `ca/`, with
mode 0600 files in a 0700 folder; its key is never printed, and the agents only ever see its certificate.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import ssl
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

_ADDON = Path(__file__).with_name("mitm_addon.py")
_REPO_MITM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-mitm" / "bin" / "python"
_LOOPBACK = "localhost,127.0.0.1,::1"


class TransparentError(RuntimeError):
    """Transparent mode cannot start; the message says what to do."""


def harness_home() -> Path:
    """Where per-installation state lives: $HARNESS_HOME, else ~/.harness."""
    return Path(os.environ.get("HARNESS_HOME") or Path.home() / ".harness").expanduser()


def mitm_python() -> str:
    """A Python that can import mitmproxy: $HARNESS_MITM_PYTHON, this one, or the repository's .venv-mitm."""
    chosen = os.environ.get("HARNESS_MITM_PYTHON")
    if chosen:
        if not shutil.which(chosen) and not Path(chosen).is_file():
            raise TransparentError(f"HARNESS_MITM_PYTHON={chosen!r} is not an executable Python")
        return chosen
    if importlib.util.find_spec("mitmproxy") is not None:
        return sys.executable
    if _REPO_MITM_PYTHON.is_file():
        return str(_REPO_MITM_PYTHON)
    raise TransparentError(
        "transparent mode needs mitmproxy, which this Python does not have: run `make install` in the harness "
        "repository (it creates .venv-mitm), or `pip install 'mitmproxy>=11'` into a Python of its own and set "
        "HARNESS_MITM_PYTHON to it (mitmproxy pins packages that vLLM's cannot share)")


@dataclass(frozen=True)
class TransparentOptions:
    llm_hosts: tuple[str, ...] = ()  # more LLM hosts, each "host" or "host/api-prefix" (default prefix /v1)
    refuse_other: bool = False  # refuse traffic to other hosts instead of tunnelling it untouched
    home: Path | None = None  # the harness home (default: harness_home())
    port: int = 0  # where the hop listens on 127.0.0.1 (0: a free port)

    def __post_init__(self):
        for spec in self.llm_hosts:
            host = spec.partition("/")[0]
            if not host or any(c in host for c in " @?#") or host.startswith(("http:", "https:")):
                raise ValueError(f"LLM host {spec!r} is not a host name: write it as llm.example.com or "
                                 "llm.example.com/api/v1, without a scheme")


class Interceptor:
    """The transparent hop for one run: `start(proxy_url)`, then `agent_env(episode, token)` per episode."""

    Error = TransparentError

    def __init__(self, options: TransparentOptions, log_path: Path | None = None):
        self.options = options
        self.log_path = log_path
        self.ca_dir = (options.home or harness_home()) / "ca"
        self.port: int | None = None
        self.ca_cert: Path | None = None
        self.trust_bundle: Path | None = None
        self._proc: subprocess.Popen | None = None
        self._secret = ""

    def start(self, proxy_url: str, timeout_s: float = 60.0, auth_token: str | None = None) -> Interceptor:
        """Start the hop in front of the proxy at `proxy_url`. With `auth_token` (a proxy that requires one), calls
        without an episode token carry it; it goes to the hop through its environment, never its command line."""
        python = mitm_python()
        self.ca_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.ca_dir, 0o700)
        command = [python, str(_ADDON), "--proxy", proxy_url, "--confdir", str(self.ca_dir),
                   "--port", str(self.options.port)]
        for spec in self.options.llm_hosts:
            command += ["--llm-host", spec]
        if self.options.refuse_other:
            command.append("--refuse-other")
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESS_MITM_")}
            self._secret = secrets.token_urlsafe(24)  # what agents without an episode show the hop
            env["HARNESS_MITM_SECRET"] = self._secret
            if auth_token:
                env["HARNESS_MITM_INJECT_KEY"] = auth_token
            self._proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                          start_new_session=True, env=env)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        try:
            line = _read_line(self._proc, timeout_s)
            ready = json.loads(line) if line else None
            if not isinstance(ready, dict):
                code = self._proc.poll()
                where = f"; see {self.log_path}" if self.log_path else ""
                raise TransparentError(f"the transparent hop ({python} {_ADDON.name}) did not start "
                                       f"(exit code {code}, said {line[:200]!r}){where}")
            self.port, self.ca_cert = int(ready["port"]), Path(ready["ca_cert"])
            self.trust_bundle = self._write_trust_bundle()
        except BaseException:
            self.close()
            raise
        return self

    def _write_trust_bundle(self) -> Path:
        """The system's CAs plus ours, so agents trust both the intercepted hosts and every tunnelled one."""
        parts = []
        system = _system_ca_file()
        if system is not None:
            parts.append(system.read_bytes().rstrip(b"\n") + b"\n")
        parts.append(self.ca_cert.read_bytes())
        path = self.ca_dir / "trust-bundle.pem"
        tmp = path.with_suffix(f".{os.getpid()}.{secrets.token_hex(4)}.tmp")  # runs sharing a home never collide
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(b"".join(parts))
        os.replace(tmp, path)
        os.chmod(path, 0o600)
        return path

    @property
    def proxy_address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def agent_env(self, episode_id: str | None = None, token: str | None = None) -> dict[str, str]:
        """The environment that sends an agent's LLM traffic through the hop; with an episode, its calls are
        recorded into that episode (the episode and its token ride along as proxy credentials)."""
        if self.port is None:
            raise TransparentError("the transparent hop is not started")
        if episode_id:
            auth = f"{quote(episode_id, safe='')}:{quote(token or '', safe='')}@"
        else:  # `harness serve`: no episode; the hop's secret says the agent is one of ours
            auth = f"harness:{quote(self._secret, safe='')}@"
        url = f"http://{auth}{self.proxy_address}"
        bundle, cert = str(self.trust_bundle), str(self.ca_cert)
        return {
            "HTTPS_PROXY": url, "HTTP_PROXY": url, "https_proxy": url, "http_proxy": url,
            "NO_PROXY": _LOOPBACK, "no_proxy": _LOOPBACK,
            "SSL_CERT_FILE": bundle, "REQUESTS_CA_BUNDLE": bundle, "CURL_CA_BUNDLE": bundle,
            "NODE_EXTRA_CA_CERTS": cert, "NODE_USE_ENV_PROXY": "1",
        }

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _read_line(proc: subprocess.Popen, timeout_s: float) -> bytes:
    """The hop's ready line, or b"" if it exits or stays silent past the timeout."""
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return out[0].strip() if out else b""


def _system_ca_file() -> Path | None:
    with contextlib.suppress(ImportError):
        import certifi

        return Path(certifi.where())
    for candidate in (ssl.get_default_verify_paths().cafile, "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None
