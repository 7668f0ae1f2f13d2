"""The request side of one call: check what the proxy touches, translate it for its upstream, fingerprint the role.

The body comes parsed (proxy/app.py parses it once); `read_request` checks it, takes secrets out of what is
stored and fingerprints the role, then one of two makes what goes upstream:

- `for_engine`: for our engine, `return_token_ids` and `logprobs` (so the recorder gets the engine's own ids),
  the served policy's model name, and training-time sampling overrides; what the agent asked for is kept in
  `Prepared` so the answer can be put back into the shape it expects (proxy/forward.py);
- `as_sent`: for an upstream that is not our engine (a frozen role's server, the API recorded in record-only mode),
  the agent's request with nothing added.

`prepare` is `read_request` then `for_engine`. The upstream body is serialised once per attempt, by proxy/app.py.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import orjson

from proxy.config import ProxyConfig, SamplingOverrides
from proxy.http_json import ApiError

CHAT = "chat"
COMPLETIONS = "completions"
_SECRET_KEYS = {"api_key", "apikey", "api-key", "authorization", "openai_api_key", "access_token", "password"}


@dataclass
class Prepared:
    """An agent request checked, and made what its upstream gets (`body`)."""

    endpoint: str
    stream: bool
    requested_model: str | None
    asked_logprobs: bool  # the agent asked for logprobs itself: keep them in its answer
    asked_token_ids: bool  # the agent asked for token ids itself: keep them in its answer
    record_request: bytes  # the request as stored (secrets removed)
    system_hash: str | None
    tools_hash: str | None
    role_key: str
    overrides: dict = field(default_factory=dict)  # sampling values replaced by config: {key: agent's value}
    body: dict | None = None  # what goes upstream, as a dict (serialised per attempt)
    agent_body: dict | None = None  # the agent's request as parsed, secrets removed: what `body` is made from


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _check_type(body: dict, key: str, types: tuple, what: str) -> None:
    value = body.get(key)
    if value is None:
        return
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ApiError(400, f"'{key}' must be {what}, got {type(value).__name__} {_short(value)}", param=key)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _validate(endpoint: str, body: dict) -> None:
    _check_type(body, "model", (str,), "a string")
    _check_type(body, "stream", (bool,), "a boolean")
    _check_type(body, "n", (int,), "an integer")
    _check_type(body, "max_tokens", (int,), "an integer")
    _check_type(body, "max_completion_tokens", (int,), "an integer")
    _check_type(body, "temperature", (int, float), "a number")
    _check_type(body, "top_p", (int, float), "a number")
    _check_type(body, "stream_options", (dict,), "an object")
    if body.get("n") is not None and body["n"] < 1:
        raise ApiError(400, f"'n' must be at least 1, got {body['n']}", param="n")
    if endpoint == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list of message objects", param="messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ApiError(
                    400, f"messages[{i}] must be an object with a string 'role', got {_short(message)}",
                    param=f"messages[{i}]",
                )
            calls = message.get("tool_calls")
            if calls is not None and not (isinstance(calls, list) and all(
                    isinstance(c, dict) and isinstance(c.get("function", {}), dict) for c in calls)):
                raise ApiError(400, f"messages[{i}].tool_calls must be a list of tool call objects (each with a "
                               f"'function' object), got {_short(calls)}", param=f"messages[{i}].tool_calls")
            if not isinstance(message.get("content"), (str, list, type(None))):
                raise ApiError(400, f"messages[{i}].content must be a string, a list of parts or null, got "
                               f"{_short(message['content'])}", param=f"messages[{i}].content")
        _check_type(body, "tools", (list,), "a list of tool objects")
        _check_type(body, "logprobs", (bool,), "a boolean")
    else:
        prompt = body.get("prompt")
        single = isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
        )
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            single = True
        if not single:
            raise ApiError(
                400, f"'prompt' must be one string or one list of token ids, got {_short(prompt)}; "
                "the recording proxy takes one prompt per request", param="prompt",
            )
        _check_type(body, "logprobs", (int,), "an integer")


def _fingerprint(endpoint: str, body: dict) -> tuple[str | None, str | None, str]:
    system_hash = tools_hash = None
    if endpoint == CHAT:
        for message in body["messages"]:
            if message.get("role") in ("system", "developer"):
                system_hash = _digest(orjson.dumps(message.get("content"), option=orjson.OPT_SORT_KEYS))
                break
        if body.get("tools"):
            tools_hash = _digest(orjson.dumps(body["tools"], option=orjson.OPT_SORT_KEYS))
    model = body.get("model") or ""
    role_key = _digest(f"{model}\0{system_hash or ''}\0{tools_hash or ''}".encode())
    return system_hash, tools_hash, role_key


def read_request(endpoint: str, body: dict, raw: bytes | None = None) -> Prepared:
    """One agent request, parsed (`body`): checked (ApiError 400 naming what is wrong), its secrets taken out,
    its role fingerprinted. Stored: `raw` (the bytes as sent) when no secret had to come out, else `body` as
    serialised. Its `body` is the agent's until `for_engine` or `as_sent` makes it what goes upstream."""
    _validate(endpoint, body)
    secrets_found = [k for k in body if k.lower() in _SECRET_KEYS]
    for key in secrets_found:
        del body[key]
    record_request = raw if raw is not None and not secrets_found else orjson.dumps(body)
    system_hash, tools_hash, role_key = _fingerprint(endpoint, body)
    logprobs = body.get("logprobs")
    return Prepared(
        endpoint=endpoint,
        stream=bool(body.get("stream")),
        requested_model=body.get("model"),
        asked_logprobs=bool(logprobs) if endpoint == CHAT else logprobs is not None,
        asked_token_ids=bool(body.get("return_token_ids")),
        record_request=record_request,
        system_hash=system_hash,
        tools_hash=tools_hash,
        role_key=role_key,
        body=body,
        agent_body=body,
    )


def for_engine(p: Prepared, config: ProxyConfig, served_model: str | None,
               sampling: SamplingOverrides | None = None, *, seed: int | None = None,
               max_model_len: int | None = None) -> Prepared:
    """`p` with `body` made the request our engine gets. `sampling` replaces the config's overrides (a trainer
    switches to validation sampling and back); `seed` replaces the agent's sampling seed (a trainer's
    reproducible rollouts). A max_tokens above the engine's whole context (`max_model_len`: Claude Code asks
    128000) becomes the context, which vLLM then fits to the room the prompt leaves, as it does for any max_tokens
    (it refuses only one above the context); the value asked is recorded with the other overrides."""
    body = p.body = dict(p.agent_body)
    if p.endpoint == CHAT:
        body["logprobs"] = True
    elif body.get("logprobs") is None:
        body["logprobs"] = 0
    if config.returns_token_ids:
        body["return_token_ids"] = True
    if served_model:
        body["model"] = served_model
    p.overrides = _apply_overrides(body, sampling or config.sampling)
    if max_model_len is not None:
        for key in ("max_tokens", "max_completion_tokens"):
            asked = body.get(key)
            if isinstance(asked, int) and asked > max_model_len:
                p.overrides.setdefault(key, asked)
                body[key] = max_model_len
    if seed is not None:
        p.overrides["seed"] = body.get("seed")
        body["seed"] = seed
    return p


def as_sent(p: Prepared, model: str | None) -> Prepared:
    """`p` with `body` made the request an upstream that is not our engine gets (a frozen role's fixed model, or
    any API in record-only mode): the agent's sampling, `model` (default: the agent's), and nothing the recorder
    would add (token ids, logprobs) unless the agent asked for it, since it may be any OpenAI-compatible server
    (reasoning models refuse logprobs)."""
    body = p.body = dict(p.agent_body)
    if not p.asked_logprobs:
        body.pop("logprobs", None)
    if not p.asked_token_ids:
        body.pop("return_token_ids", None)
    if model:
        body["model"] = model
    p.overrides = {}
    return p


def prepare(endpoint: str, body: dict, config: ProxyConfig, served_model: str | None,
            sampling: SamplingOverrides | None = None, *, seed: int | None = None,
            raw: bytes | None = None) -> Prepared:
    """One agent request, parsed, checked and made what our engine gets (`read_request`, then `for_engine`)."""
    return for_engine(read_request(endpoint, body, raw), config, served_model, sampling, seed=seed)


def _apply_overrides(body: dict, sampling: SamplingOverrides) -> dict:
    if not sampling.active:
        return {}
    replaced = {}
    for key, value in (("temperature", sampling.temperature), ("top_p", sampling.top_p)):
        if value is not None:
            replaced[key] = body.get(key)
            body[key] = value
    cap = sampling.max_tokens_cap
    if cap is not None:
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        asked = body.get(key)
        if asked is None or asked > cap:
            replaced[key] = asked
            body[key] = cap
    return replaced
