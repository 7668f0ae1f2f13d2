"""New policy weights into the running engine: the one seam between the trainer and vLLM.

A push is:

    write   safetensors in the engine's dtype, shard by shard, + the model's config files into a temp dir,
            renamed into place when complete
    pause   POST /pause?mode=keep             requests in flight freeze, new ones queue (skipped if absent)
    reload  POST /collective_rpc              {"method": "reload_weights", "kwargs": {"weights_path": DIR}}
    reset   POST /reset_prefix_cache?reset_running_requests=true
                                              cached prefixes were computed with the old weights; frozen
                                              requests are preempted and recompute their KV with the new ones
    notify  POST <proxy>/harness/weights      {"version": v}: every later call is recorded with version v
    resume  POST /resume

The proxy hears of the new version before the engine resumes, so a call recorded with version v never saw
weights older than v (a call that was in flight during the swap keeps the version it started with, and may
have sampled its last tokens with the new weights). Resume runs whatever failed before it: a failed push never
leaves the engine paused.

With LoRA (`adapter=NAME`, trainer/model/lora.py) a push writes only the adapter, and the swap is:

    load    POST /v1/load_lora_adapter        {"lora_name": "NAME-v000042", "lora_path": DIR}: a new name per version
    notify  POST <proxy>/harness/weights      {"version": v, "model": "NAME-v000042"}: calls go to it from now on
    unload  POST /v1/unload_lora_adapter      the names older than the newest `keep`

No pause and no cache reset: a call keeps the adapter it started with (the one its version names), and cached
prefixes are keyed by adapter. The newest `keep` versions stay loaded (2, or K + 2 with asynchronous rollouts:
trainer.model.lora.adapters_in_use), so a call the proxy sent just before the notify, or one still generating on an
older version, still finds its adapter.

The reload routes exist when the server runs with VLLM_SERVER_DEV_MODE=1 (running/vllm_server.py's start_vllm sets it).
The engine's model must have untied input and output embeddings: with tied ones vLLM's reload_weights keeps the old
output layer. A tied model is trained tied and served untied (trainer/model/tied.py): a push writes its output
layer out.

The weights are written once per push, in the engine's dtype (`dtype`: what vLLM would cast them to on load,
so the engine ends up with the same bits; `engine_dtype` says which), in shards of at most `max_shard_bytes` with
the index transformers writes; reload_weights reads either layout. Each shard is cast and brought to the CPU only
while it is written, so a push needs one shard of host memory besides what it is given. Given the FSDP-sharded
model itself, it gathers one tensor at a time on the device (every other rank runs `follow_push` meanwhile) and
the full float32 state never exists on the host: a push of a 1.5B model in bfloat16 then needs one shard (1 GiB by
default) of host memory, where a gathered float32 state dict is 6 GB before anything is written.

Pure stdlib HTTP (urllib, no environment proxies: HTTP(S)_PROXY may point at our own recording proxy).
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.model.checkpoint import fsync_path
from trainer.model.files import copy_model_files, gathered, write_weights
from trainer.model.lora import save_adapter
from trainer.model.tied import untied

__all__ = ["WeightSync", "WeightSyncError", "engine_dtype", "follow_push"]

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_DEV_MODE_HINT = ("start the engine with VLLM_SERVER_DEV_MODE=1 (start_vllm does), or attach to one "
                  "that was")


class WeightSyncError(RuntimeError):
    """A push failed; the message names the URL, what it answered, and what to do."""


class WeightSync:
    """Pushes weights to the engines serving the policy (and tells one recording proxy the new weight version)."""

    def __init__(self, engine_url: str, work_dir: str | Path, proxy_url: str | None = None,
                 proxy_admin_token: str | None = None, timeout_s: float = 600.0, *,
                 model_dir: str | Path | None = None, keep: int = 2, more_engine_urls: tuple[str, ...] = (),
                 adapter: str | None = None, dtype: torch.dtype | None = None, max_shard_bytes: int = 2**30,
                 peft_adapter: str | None = None, policy: str | None = None) -> None:
        """`work_dir` receives one weights directory per version (`v000042/`), the newest `keep` kept (the
        engine reads from the newest; with LoRA, the newest `keep` adapters also stay loaded, for calls still
        generating on them: asynchronous rollouts keep K + 2). `model_dir` is the model the engine started from:
        its config and tokenizer files are copied next to the weights; without it, a pushed model's config is
        saved instead.
        `timeout_s` bounds each HTTP call (a reload of a large model can take minutes). With `more_engine_urls`,
        every phase runs on every engine before the next phase starts: all are paused before any reloads, and the
        proxy hears of the new version only once all serve it.
        `dtype` is the engine's (`engine_dtype`): full weights are written in it (None: in their own, as the
        trainer holds them), in files of at most `max_shard_bytes`, the most host memory a push adds.
        With several policies (roles.policies) each has its own sync: `peft_adapter` names the adapter of the
        trainer's model it writes, `adapter` the base of the engine's names for it, and the proxy hears the new
        name as `policy`'s (its calls go there).
        """
        if keep < 1:
            raise ValueError(f"keep must be at least 1 (the weights the engine serves), got {keep!r}")
        if (proxy_url is None) != (proxy_admin_token is None):
            raise ValueError("give both proxy_url and proxy_admin_token (the proxy's admin token), or neither")
        self.engine_urls = tuple(dict.fromkeys(u.rstrip("/").removesuffix("/v1") for u in (engine_url,
                                                                                            *more_engine_urls)))
        self.proxy_url = proxy_url.rstrip("/").removesuffix("/v1") if proxy_url else None
        self.proxy_admin_token = proxy_admin_token
        self.timeout_s = timeout_s
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.keep = keep
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.work_dir.glob(".tmp-*"):  # left by a writer that crashed: never read by an engine
            shutil.rmtree(stale, ignore_errors=True)
        self.can_pause: bool | None = None  # None until the engine was asked: False if it has no /pause
        self.adapter = adapter  # LoRA: the adapter's base name; None: full weights
        self.peft_adapter = peft_adapter  # which adapter of a model with several; None: its only one
        self.policy = policy  # the policy whose calls the proxy sends to this adapter; None: the default one
        self.dtype = dtype  # full weights are written in it; None: as they come
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes!r}")
        self.max_shard_bytes = max_shard_bytes
        self._adapter_names: list[str] = []  # the version names this sync loaded, oldest first

    # ------------------------------------------------------------------------------------------------ public

    def push(self, weights: torch.nn.Module | Mapping[str, torch.Tensor], version: int, *,
             state: Mapping[str, torch.Tensor] | None = None) -> dict[str, float]:
        """Write `weights` (a model, also FSDP-sharded, or a full state dict; with LoRA the peft model, and `state`
        its full state when its parameters are shards), load them into the engine as `version`, and return the
        seconds each phase took (write_s, pause_s, reload_s, reset_s, notify_s, resume_s, total_s; with LoRA also
        unload_s, the adapter two versions old unloaded) and the bytes written. With an FSDP-sharded model on
        several ranks this is a collective: the main rank pushes while every other one runs `follow_push`."""
        started = time.perf_counter()
        weights_dir, written = self.write(weights, version, state=state)
        write_s = time.perf_counter() - started
        timings = self.load(weights_dir, version)
        self._prune(keep_also=weights_dir)
        return {"write_s": write_s, **timings, "total_s": time.perf_counter() - started, "bytes": float(written)}

    def write(self, weights: torch.nn.Module | Mapping[str, torch.Tensor], version: int, *,
              state: Mapping[str, torch.Tensor] | None = None) -> tuple[Path, int]:
        """Write a complete weights directory for `version` atomically; return it and the bytes of weights.

        Everything goes into a temp dir first, renamed into place once complete: a crash leaves either no
        directory for `version` or a complete one.
        """
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version must be a non-negative integer, got {version!r}")
        target = self.work_dir / f"v{version:06d}"
        tmp = self.work_dir / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            if self.adapter is not None:
                save_adapter(weights, tmp, dict(state) if state is not None else None, self.peft_adapter)
                files = [tmp / "adapter_model.safetensors"]
            else:
                state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
                self._write_configs(tmp, getattr(weights, "config", None))  # before the first (collective) gather
                files = write_weights(tmp, untied(state), max_shard_bytes=self.max_shard_bytes, dtype=self.dtype)
            for file in files:
                fsync_path(file)
            if target.exists():  # the same version again (a resumed run, a restore): swap the old one out
                old = self.work_dir / f".tmp-old-{target.name}-{uuid.uuid4().hex[:8]}"
                target.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target, sum((target / f.name).stat().st_size for f in files if f.suffix == ".safetensors")

    def served_name(self, version: int) -> str:
        """With LoRA: the model name the engine serves `version`'s adapter under."""
        return f"{self.adapter}-v{version:06d}"

    def load(self, weights_dir: str | Path, version: int) -> dict[str, float]:
        """Swap the engine onto the weights in `weights_dir` (any complete model directory) and record
        `version` in the proxy; return the seconds per phase. The engine is resumed whatever fails."""
        weights_dir = Path(weights_dir).resolve()
        if self.adapter is not None:
            return self._load_adapter(weights_dir, version)
        timings = {"pause_s": 0.0, "reload_s": 0.0, "reset_s": 0.0, "notify_s": 0.0, "resume_s": 0.0}
        clock = time.perf_counter()

        def lap(phase: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            timings[phase] = now - clock
            clock = now

        paused: list[str] = []
        try:
            for url in self.engine_urls:
                if self._pause(url):
                    paused.append(url)
            lap("pause_s")
            for url in self.engine_urls:
                self._engine(url, "/collective_rpc", {"method": "reload_weights",
                                                      "kwargs": {"weights_path": str(weights_dir)}},
                             what="reload weights")
            lap("reload_s")
            for url in self.engine_urls:
                answer = self._engine(url, "/reset_prefix_cache?reset_running_requests=true", {},
                                      what="reset the prefix cache")
                if isinstance(answer, dict) and answer.get("success") is False:
                    raise WeightSyncError(f"POST {url}/reset_prefix_cache answered success=false: cached prefixes "
                                          "of the old weights may still be served; retry the push")
            lap("reset_s")
            self._notify_proxy(version)
            lap("notify_s")
        except BaseException:
            self._resume(paused)  # never leave an engine paused; the first failure is the one to report
            raise
        failed = self._resume(paused)
        if paused:
            lap("resume_s")
        if failed is not None:
            raise failed
        return timings

    def _load_adapter(self, adapter_dir: Path, version: int) -> dict[str, float]:
        started = time.perf_counter()
        name = self.served_name(version)
        for url in self.engine_urls:
            self._unload(url, name)  # the same version again (a resumed run, a restore): load it afresh
            self._engine(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir)},
                         what=f"load the LoRA adapter {name!r} (is the engine started with --enable-lora and "
                         "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1? trainer/model/lora.py engine_args)")
        self._adapter_names = [n for n in self._adapter_names if n != name] + [name]
        reload_s = time.perf_counter() - started
        self._notify_proxy(version, model=name)
        notify_s = time.perf_counter() - started - reload_s
        while len(self._adapter_names) > self.keep:  # older ones stay for calls already on their way
            old = self._adapter_names.pop(0)
            for url in self.engine_urls:
                self._unload(url, old)
        return {"pause_s": 0.0, "reload_s": reload_s, "reset_s": 0.0, "notify_s": notify_s, "resume_s": 0.0,
                "unload_s": time.perf_counter() - started - reload_s - notify_s}

    def _unload(self, url: str, name: str) -> None:
        status, answer = _post(url + "/v1/unload_lora_adapter", {"lora_name": name}, self.timeout_s, None)
        if status not in (200, 404) and not (status == 400 and "not found" in _shown(answer).lower()):
            raise WeightSyncError(f"POST {url}/v1/unload_lora_adapter answered HTTP {status} for {name!r}: "
                                  f"{_shown(answer)}")

    # ------------------------------------------------------------------------------------------------ engine

    def _resume(self, paused: list[str]) -> WeightSyncError | None:
        """Resume every paused engine, even when one of them fails to; the first failure, if any."""
        failed = None
        for url in paused:
            try:
                self._engine(url, "/resume", {}, what="resume generation")
            except WeightSyncError as exc:
                failed = failed or exc
        return failed

    def _pause(self, url: str) -> bool:
        """Pause with mode=keep where the engine has /pause (vLLM >= 0.12 in dev mode); whether it paused."""
        if self.can_pause is False:
            return False
        try:
            self._engine(url, "/pause?mode=keep", {}, what="pause generation")
        except _NotFound:
            self.can_pause = False  # an older engine: reload without holding requests
            return False
        self.can_pause = True
        return True

    def _engine(self, url: str, route: str, body: dict, *, what: str) -> Any:
        status, answer = _post(url + route, body, self.timeout_s, None)
        if status == 404:
            if route.startswith("/pause"):
                raise _NotFound(route)
            raise WeightSyncError(f"POST {url}{route} answered HTTP 404: the engine has no route to {what}; "
                                  f"{_DEV_MODE_HINT}")
        if status != 200:
            raise WeightSyncError(f"POST {url}{route} answered HTTP {status} trying to {what}: "
                                  f"{_shown(answer)}; see the engine's log")
        return answer

    def _notify_proxy(self, version: int, model: str | None = None) -> None:
        if self.proxy_url is None:
            return
        url = f"{self.proxy_url}/harness/weights"
        body = {"version": version} if model is None else {"version": version, "model": model}
        if model is not None and self.policy is not None:
            body["policy"] = self.policy
        status, answer = _post(url, body, self.timeout_s, self.proxy_admin_token)
        if status == 401:
            raise WeightSyncError(f"POST {url} answered HTTP 401: the admin token is wrong (it is in the run's "
                                  "proxy.json); the engine serves the new weights but calls are recorded with the "
                                  "old version")
        if status != 200:
            raise WeightSyncError(f"POST {url} answered HTTP {status}: {_shown(answer)}; the engine serves the new "
                                  "weights but calls are recorded with the old version")

    # ------------------------------------------------------------------------------------------------ files

    def _write_configs(self, out: Path, config) -> None:
        if self.model_dir is not None:
            if not (self.model_dir / "config.json").is_file():
                raise FileNotFoundError(f"model_dir {str(self.model_dir)!r} has no config.json: give the model "
                                        "directory the engine was started from")
            copy_model_files(self.model_dir, out)
        elif config is not None:
            config.save_pretrained(out)
        else:
            raise ValueError("pushing a bare state dict needs model_dir (the model the engine started from) for "
                             "its config files; give WeightSync(model_dir=...) or push the model itself")
        written = json.loads((out / "config.json").read_text(encoding="utf-8"))
        if written.get("tie_word_embeddings", False):
            raise ValueError("the engine's model ties its input and output embeddings (tie_word_embeddings: true): "
                             "vLLM's reload_weights would keep the old output layer; give model_dir the untied view "
                             "the engine serves (trainer/model/tied.py engine_view)")

    def _prune(self, keep_also: Path) -> None:
        versions = sorted((p for p in self.work_dir.glob("v*") if p.is_dir() and p.name[1:].isdigit()),
                          key=lambda p: int(p.name[1:]))
        for old in versions[:-self.keep]:
            if old != keep_also:
                shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- other ranks


def follow_push(model: torch.nn.Module) -> None:
    """What every rank but the main one runs while the main one pushes the FSDP-sharded `model` (`WeightSync.push(
    model, ...)`): this rank's part of gathering each tensor, in the order the push writes them. A collective."""
    for tensor in untied(model.state_dict()).values():
        gathered(tensor.detach())


# ---------------------------------------------------------------------------------------------- engine dtype

_VLLM_DTYPES = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16, "float": torch.float32,
                "float32": torch.float32}  # vLLM's --dtype names; "auto" reads the model's config


def engine_dtype(model_dir: str | Path, engine_args: Sequence[str] = (), *, gpu: bool) -> torch.dtype:
    """The dtype in which a vLLM engine that harness starts (running/vllm_server.py start_vllm) on the model at
    `model_dir` holds its weights: a push written in it loads with the bits vLLM's own cast would give.

    `--dtype` in `engine_args` (the extra arguments start_vllm appends; the last one wins); else, without a GPU,
    float32 (start_vllm's CPU recipe); else vLLM's "auto": the dtype config.json names (`dtype` or `torch_dtype`,
    or its `text_config`'s), float32 or none as bfloat16. On GPUs older than Ampere vLLM's auto takes float16
    instead; a bfloat16 push still loads there, cast by the engine.
    """
    said = None
    for i, arg in enumerate(engine_args):
        if arg == "--dtype" and i + 1 < len(engine_args):
            said = engine_args[i + 1]
        elif arg.startswith("--dtype="):
            said = arg.split("=", 1)[1]
    if said is not None and said.lower() != "auto":
        if said.lower() not in _VLLM_DTYPES:
            raise ValueError(f"the engine's --dtype {said!r} is not one of vLLM's: auto, {', '.join(_VLLM_DTYPES)}")
        return _VLLM_DTYPES[said.lower()]
    if said is None and not gpu:
        return torch.float32
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    text = config.get("text_config") or {}
    named = next((c[key] for c in (config, text) for key in ("dtype", "torch_dtype") if c.get(key)), None)
    dtype = _VLLM_DTYPES.get(str(named).removeprefix("torch."), torch.float32)
    return torch.bfloat16 if dtype == torch.float32 else dtype


# ---------------------------------------------------------------------------------------------- helpers


class _NotFound(Exception):
    pass


def _post(url: str, body: dict, timeout_s: float, token: str | None) -> tuple[int, Any]:
    """POST JSON; (HTTP status, parsed JSON or raw text). Unreachable servers raise WeightSyncError."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with _DIRECT.open(request, timeout=timeout_s) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (OSError, ValueError) as exc:
        raise WeightSyncError(f"POST {url} failed: {exc}; is the server running there?") from None
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def _shown(answer: Any) -> str:
    return repr(answer if not isinstance(answer, str | bytes) else answer[:300])[:300]
