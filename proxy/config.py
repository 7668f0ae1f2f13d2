"""Proxy configuration: one typed section, each key with its default and what it is for."""

from __future__ import annotations

import ipaddress
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from proxy.guard import GuardConfig
from proxy.parsing.native import check_reasoning_parser, check_tool_parser
from proxy.roles import DEFAULT_POLICY, RoleRule, policy_names


@dataclass(frozen=True)
class SamplingOverrides:
    """Training-time sampling that replaces what the agent asked for (None: keep the agent's value)."""

    temperature: float | None = None  # e.g. 1.0 so the policy explores during RL
    top_p: float | None = None
    max_tokens_cap: int | None = None  # upper bound on max_tokens / max_completion_tokens
    seed: int | None = None  # seeds every call (from this, the episode and the call index): reproducible rollouts

    def __post_init__(self):
        if self.temperature is not None and not 0 <= self.temperature <= 10:
            raise ValueError(f"sampling temperature {self.temperature!r} is out of range: use 0..10")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p {self.top_p!r} is out of range: use a value in (0, 1]")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError(f"sampling max_tokens_cap {self.max_tokens_cap!r} must be a positive integer")

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.temperature, self.top_p, self.max_tokens_cap))  # seed: per call


@dataclass(frozen=True)
class ProxyConfig:
    upstream_url: str  # the engine's base URL, e.g. http://127.0.0.1:8000 (with or without /v1)
    more_upstreams: tuple[str, ...] = ()  # more engines of the same policy (proxy/upstreams.py: affinity, failover)
    db_path: Path = Path("runs/harness.duckdb")  # the DuckDB file the proxy writes (single writer)
    served_model: str | None = None  # the engine's model name; None: asked from the engine at start
    returns_token_ids: bool = True  # ask the engine for token ids (vLLM); False records text only
    host: str = "127.0.0.1"  # bind address; anything but loopback requires auth_token
    port: int = 8400  # 0 picks a free port
    auth_token: str | None = None  # when set, every /v1 call must carry it (or an episode token) as api key
    admin_token: str = field(default_factory=lambda: "hx-admin-" + secrets.token_urlsafe(24))  # for /harness/*
    auto_episodes: bool = True  # /e/<episode>/v1 with an unseen episode id opens it; False: 404 unknown episode
    max_body_bytes: int = 32 * 1024 * 1024  # larger request bodies get a 413
    connect_timeout_s: float = 10.0  # connecting to the engine
    read_timeout_s: float = 600.0  # longest wait for the next byte from the engine
    sampling: SamplingOverrides = field(default_factory=SamplingOverrides)
    db_memory_mb: int = 512  # DuckDB's memory cap in the proxy: recorded rows are cached up to it, then evicted
    # The recorder writes once this many calls wait (a DuckDB row group: written straight to the file, no WAL)...
    record_batch: int = 2048
    record_delay_s: float = 0.2  # ...or this long after the oldest unflushed call
    token_exact: bool = True  # build continued conversations' prompts from recorded ids (proxy/continuity.py)
    # How generated text becomes reasoning, content and tool calls on the token-exact path (proxy/parsing/native.py):
    # the names the engine was started with (vLLM's --tool-call-parser / --reasoning-parser), and the model's
    # directory, whose tokenizer vLLM's own parsers need (None: the proxy's own parsers, Hermes only).
    tool_parser: str = "hermes"
    reasoning_parser: str | None = None
    tokenizer: str | None = None
    # A reply's reasoning that the template leaves out of the history it renders (proxy/continuity.py):
    # "as_rendered" starts a new timeline on the rendered history, "keep" continues with the sampled reasoning.
    reasoning_history: str = "as_rendered"
    # Hosted tools in a Responses call (web_search, file_search, ...: the engine runs none): "leave_out" serves the
    # call without them and records which (calls.extra.tools_left_out); "refuse" answers 400 naming the tool.
    hosted_tools: str = "leave_out"
    max_episodes: int = 65536  # episodes whose call numbering is kept in memory; older ones are looked up again
    continuity_episodes: int = 4096  # episodes whose replies are kept in memory for token-exact continuation...
    continuity_tokens: int = 32_000_000  # ...and the ids they may hold together (4 bytes each)
    roles: tuple[RoleRule, ...] = ()  # named roles; a frozen one's calls go to its own upstream (proxy/roles.py)
    # policy -> the engine's model name its calls go to from the start (harness run --trained: a trained run's
    # adapters, loaded with the engine); the default policy's is served_model's. A trainer moves them later
    # (POST /harness/weights); a policy not named is served as the default one.
    policy_models: dict[str, str] = field(default_factory=dict)
    # Record-only, in front of any OpenAI-compatible API (a hosted one): each request goes upstream as the agent sent
    # it (its model name, its sampling, nothing added), with the agent's API key, which is never stored; the proxy's
    # own tokens (auth_token, episode tokens) are not forwarded: `upstream_key_env` names the variable holding the
    # key sent instead (e.g. for agents `harness run` starts, which carry episode tokens).
    record_only: bool = False
    upstream_key_env: str | None = None
    # Limits and the degenerate-output guard (proxy/guard.py): an episode's calls past max_turns are refused (400
    # episode_ended), as are the later calls of an episode the guard ended; what was cut is flagged on its calls.
    max_turns: int | None = None
    guard: GuardConfig = field(default_factory=GuardConfig)

    def __post_init__(self):
        for url in (self.upstream_url, *self.more_upstreams):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"upstream_url {url!r} must start with http:// or https://")
        if not _is_loopback(self.host) and not self.auth_token:
            raise ValueError(
                f"binding to {self.host!r} exposes the proxy beyond this machine: set an auth token "
                "(--auth-token or HARNESS_AUTH_TOKEN), or bind to 127.0.0.1"
            )
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"max_turns {self.max_turns!r} must be a positive number of calls per episode, or None")
        if self.db_memory_mb < 16:
            raise ValueError(f"db_memory_mb {self.db_memory_mb!r} is too small for DuckDB: give at least 16 (MB)")
        if self.continuity_episodes < 1 or self.continuity_tokens < 1 or self.max_episodes < 1:
            raise ValueError(f"continuity_episodes {self.continuity_episodes!r}, continuity_tokens "
                             f"{self.continuity_tokens!r} and max_episodes {self.max_episodes!r} must be positive "
                             "integers")
        if self.record_only and self.auth_token and not self.upstream_key_env:
            raise ValueError("record-only mode with an auth token: agents send the proxy's token, so their own API "
                             "keys cannot reach the upstream; name the variable holding the key to send instead "
                             "(--upstream-key-env NAME), or drop the auth token (loopback only)")
        if self.record_only and (self.more_upstreams or self.roles):
            raise ValueError("record-only mode forwards every call to one upstream as sent: drop the other "
                             "upstreams and the role rules")
        check_tool_parser(self.tool_parser)
        if self.reasoning_history not in ("as_rendered", "keep"):
            raise ValueError(f"reasoning_history {self.reasoning_history!r}: use as_rendered (train on the history "
                             "as the template renders it) or keep (keep the sampled reasoning in context)")
        check_reasoning_parser(self.reasoning_parser)
        if self.hosted_tools not in ("leave_out", "refuse"):
            raise ValueError(f"hosted_tools {self.hosted_tools!r}: use leave_out (serve a Responses call without the "
                             "hosted tools it offers, recording which) or refuse (answer it 400)")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes {self.max_body_bytes!r} is too small: use at least 1024")
        known = policy_names(self.roles)
        for policy, model in self.policy_models.items():
            if policy not in known:
                raise ValueError(f"policy_models names policy {policy!r}, which serves no role of this proxy (its "
                                 f"policies: {', '.join(map(repr, known))}): give a role rule that policy")
            if not (isinstance(model, str) and 0 < len(model) <= 256):
                raise ValueError(f"policy_models[{policy!r}] {model!r} must be the engine's model name for that "
                                 "policy (1-256 characters)")

    @property
    def default_model(self) -> str | None:
        """The engine's model name for the default policy's calls (None: asked from the engine at start)."""
        return self.policy_models.get(DEFAULT_POLICY, self.served_model)

    @property
    def upstream_base(self) -> str:
        """The engine URL without a trailing /v1 or slash."""
        return _base(self.upstream_url)

    @property
    def engine_bases(self) -> tuple[str, ...]:
        """Every engine's URL without a trailing /v1 or slash, the first one first, none twice."""
        return tuple(dict.fromkeys(_base(u) for u in (self.upstream_url, *self.more_upstreams)))


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
