"""The transparent hop: an embedded mitmproxy that sends calls to known LLM hosts to the recording proxy.

Runs in its own process, under a Python that has mitmproxy (it pins packages that vLLM's cannot share); it
imports nothing of ours, only the standard library and mitmproxy. proxy/transparent.py starts it and gives
the agent its environment. What it does with each connection:

- CONNECT to a known LLM host (e.g. api.openai.com:443): TLS is terminated with a certificate for that host,
  signed by the per-installation CA in --confdir (created here, 0600), and each request in it is rewritten to
  http://<proxy>/e/<episode>/v1/<rest> (the host's own API prefix, e.g. /compatible-mode/v1, is replaced).
  No DNS lookup and no connection to the real host is ever made.
- The episode comes from the proxy credentials the agent's HTTPS_PROXY carries (http://<episode>:<token>@...);
  the agent's own API key is replaced by the episode token, so a real key never reaches the recorder. Agents of
  `harness serve --transparent` show the hop's secret instead (harness:<secret>): their calls go to the run's
  default episode with the proxy's auth token, if it has one ($HARNESS_MITM_SECRET, $HARNESS_MITM_INJECT_KEY).
  Proxy credentials are never passed on to any host.
- Any other host: tunnelled untouched (TLS is not opened), or refused with a 403 under --refuse-other.
- Answers from the proxy are streamed through as they arrive (SSE is never buffered).

On start it prints one JSON line to stdout: {"port": <listening port>, "ca_cert": <path of the CA certificate>}.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import json
import os
import re
import sys
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from mitmproxy import ctx, http
from mitmproxy.options import Options
from mitmproxy.tools.dump import DumpMaster

# host -> the path prefixes its OpenAI-compatible (or Anthropic) API lives under, longest first.
KNOWN_HOSTS: dict[str, tuple[str, ...]] = {
    "api.openai.com": ("/v1",),
    "dashscope.aliyuncs.com": ("/compatible-mode/v1", "/api/v1"),
    "dashscope-intl.aliyuncs.com": ("/compatible-mode/v1", "/api/v1"),
    "api.deepseek.com": ("/v1", ""),
    "api.anthropic.com": ("/v1",),
}
_CA_NAME = "mitmproxy-ca-cert.pem"  # the certificate only; mitmproxy-ca.pem beside it holds the private key
_AGENT_KEY_HEADERS = ("authorization", "x-api-key", "api-key")


def parse_host_spec(spec: str) -> tuple[str, tuple[str, ...]]:
    """'llm.example.com' or 'llm.example.com/openai/v1' -> (host, prefixes)."""
    host, _, path = spec.strip().partition("/")
    if not host or not re.fullmatch(r"[A-Za-z0-9.-]+(:\d+)?", host):
        raise ValueError(f"LLM host {spec!r} is not a host name: use e.g. llm.example.com or llm.example.com/api/v1")
    return host.lower(), (("/" + path.rstrip("/")) if path else "/v1",)


def _episode_auth(headers) -> tuple[str, str] | None:
    """(episode, token) from a Proxy-Authorization: Basic header, None if absent or unreadable."""
    value = headers.get("Proxy-Authorization", "")
    scheme, _, encoded = value.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, _, password = base64.b64decode(encoded.strip(), validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return (unquote(user), unquote(password)) if user else None


class Rewrite:
    """The addon: rewrite LLM calls to the recording proxy, leave everything else alone (or refuse it)."""

    def __init__(self, proxy_url: str, hosts: dict[str, tuple[str, ...]], refuse_other: bool, inject_key: str | None,
                 secret: str | None, ready_out):
        target = urlsplit(proxy_url)
        self.scheme, self.host, self.port = target.scheme, target.hostname, target.port or 80
        self.base_path = target.path.rstrip("/")
        self.hosts = hosts
        self.refuse_other = refuse_other
        self.inject_key = inject_key  # the proxy's own auth token, for agents that show the hop's secret
        self.secret = secret
        self.episodes: dict[str, tuple[str, str]] = {}  # client connection id -> (episode, token)
        self.ready_out = ready_out

    def running(self) -> None:
        addrs = ctx.master.addons.get("proxyserver").listen_addrs()
        ca = Path(ctx.options.confdir).expanduser() / _CA_NAME
        print(json.dumps({"port": addrs[0][1], "ca_cert": str(ca)}), file=self.ready_out, flush=True)
        os.dup2(2, 1)  # from now on mitmproxy's own messages go to the log, never into the pipe no one reads

    def _prefixes(self, host: str, port: int | None = None) -> tuple[str, ...] | None:
        host = host.lower()
        return self.hosts.get(f"{host}:{port}") or self.hosts.get(host)

    def http_connect(self, flow: http.HTTPFlow) -> None:
        auth = _episode_auth(flow.request.headers)
        if auth is not None:
            self.episodes[flow.client_conn.id] = auth
        if self.refuse_other and self._prefixes(flow.request.host, flow.request.port) is None:
            flow.response = _refusal(flow.request.host)

    def client_disconnected(self, client) -> None:
        self.episodes.pop(client.id, None)

    def request(self, flow: http.HTTPFlow) -> None:
        auth = self.episodes.get(flow.client_conn.id) or _episode_auth(flow.request.headers)
        flow.request.headers.pop("Proxy-Authorization", None)  # the episode's credentials go nowhere else
        host = flow.request.pretty_host
        prefixes = self._prefixes(host, flow.request.port)
        if prefixes is None:
            if self.refuse_other:
                flow.response = _refusal(host)
            return
        path = flow.request.path
        for prefix in prefixes:
            if path == prefix or path.startswith(prefix + "/") or path.startswith(prefix + "?") or prefix == "":
                rest = path[len(prefix):]
                break
        else:
            flow.response = http.Response.make(
                404, json.dumps({"error": {"message": f"harness transparent mode: {host}{path} is not an API path "
                                           f"it knows for {host} (expected it under {' or '.join(prefixes)})",
                                           "type": "invalid_request_error", "code": "unknown_path"}}),
                {"Content-Type": "application/json"})
            return
        for name in _AGENT_KEY_HEADERS:
            flow.request.headers.pop(name, None)
        episode_path, key = "", None
        if auth is not None and self.secret and auth == ("harness", self.secret):
            key = self.inject_key  # an agent of `harness serve --transparent`: the run's default episode
        elif auth is not None:
            episode_path, key = f"/e/{quote(auth[0], safe='')}", auth[1] or None
        if key:
            flow.request.headers["Authorization"] = f"Bearer {key}"
        flow.request.headers["X-Harness-Original-Host"] = host
        flow.request.scheme, flow.request.host, flow.request.port = self.scheme, self.host, self.port
        flow.request.path = f"{self.base_path}{episode_path}/v1{rest}"

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.request.host == self.host and flow.request.port == self.port:
            flow.response.stream = True  # every answer of ours goes through as it arrives, SSE above all


def _refusal(host: str) -> http.Response:
    return http.Response.make(
        403, f"harness transparent mode refuses traffic to {host}: it is not a known LLM host "
        "(add it with --llm-host, or drop --refuse-other to tunnel it untouched)\n".encode(),
        {"Content-Type": "text/plain"})


async def _serve(args, hosts) -> None:
    opts = Options(listen_host="127.0.0.1", listen_port=args.port, confdir=args.confdir)
    master = DumpMaster(opts, with_termlog=True, with_dumper=False)
    # Everything not a known LLM host is tunnelled untouched: TLS to it is never opened.
    allow = [rf"^{re.escape(h.split(':')[0])}(:\d+)?$" for h in hosts]
    master.options.update(connection_strategy="lazy", upstream_cert=False, allow_hosts=allow, termlog_verbosity="warn")
    master.addons.add(Rewrite(args.proxy, hosts, args.refuse_other, os.environ.get("HARNESS_MITM_INJECT_KEY"),
                              os.environ.get("HARNESS_MITM_SECRET"), sys.stdout))
    await master.run()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxy", required=True, help="the recording proxy's URL, e.g. http://127.0.0.1:8400")
    parser.add_argument("--confdir", required=True, help="where the CA lives (created with mode 0600)")
    parser.add_argument("--port", type=int, default=0, help="listening port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--llm-host", action="append", default=[], help="another LLM host[/api-prefix]")
    parser.add_argument("--refuse-other", action="store_true", help="refuse other hosts instead of tunnelling")
    args = parser.parse_args(argv)
    hosts = dict(KNOWN_HOSTS)
    try:
        hosts.update(parse_host_spec(spec) for spec in args.llm_host)
    except ValueError as exc:
        parser.error(str(exc))
    os.umask(0o077)  # the CA's private key and everything beside it: this user only
    Path(args.confdir).mkdir(parents=True, exist_ok=True, mode=0o700)
    asyncio.run(_serve(args, hosts))


if __name__ == "__main__":
    main()
