"""What the proxy's handlers share: the run's state, the application keys, and who is asking (the API key)."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from harness.store.database import Store
from harness.store.recorder import Recorder
from proxy.config import ProxyConfig, SamplingOverrides
from proxy.continuity import Timelines
from proxy.engine_client import EngineClient
from proxy.episodes import Episodes
from proxy.http_json import ApiError
from proxy.parsing.native import ReplyParsing
from proxy.upstreams import Engines
from proxy.wire.common import ConversationStore


@dataclass
class RunState:
    run_id: str
    served_model: str | None  # the engine's model name for the default policy's calls (None: the agent's name)
    # The engine's model name for each policy that has its own (one LoRA adapter per trained role, set by POST
    # /harness/weights with "policy"); a policy not here is served under `served_model`.
    policy_models: dict[str, str] = field(default_factory=dict)
    weight_version: int = 0  # set by the trainer after each weight sync (of the default policy, with several)
    policy_versions: dict[str, int] = field(default_factory=dict)  # the version of each policy with its own name
    warned_no_ids: bool = False  # said once that the engine returns no token ids
    timelines: Timelines | None = None  # token-exact continuity (None: off, or the engine returns no ids)
    sampling: SamplingOverrides | None = None  # the overrides in force; starts as the config's, a trainer may swap it
    max_model_len: int | None = None  # the engine's context, as its /v1/models said at start (None: not said)
    parsing: ReplyParsing | None = None
    # Calls the proxy only forwards (GET /v1/models, pass-through routes): "METHOD /v1/route" -> {engine status or
    # "unreachable": count}, shown by GET /harness/status; none of them is recorded.
    forwarded: dict[str, dict[str, int]] = field(default_factory=dict)

    def engine_model(self, policy: str) -> str | None:
        """The engine's model name `policy`'s calls go to now: its own once a trainer set one, else the default
        policy's (a policy whose first adapter is not pushed yet is served as the default one is)."""
        return self.policy_models.get(policy, self.served_model)

    def version_of(self, policy: str) -> int:
        """The weight version `policy`'s calls are sampled with now: each policy's adapter is pushed on its own, so
        a call is stamped with its own policy's version, never with one pushed for another policy a moment
        earlier."""
        return self.policy_versions.get(policy, self.weight_version)


CONFIG = web.AppKey("config", ProxyConfig)
STATE = web.AppKey("state", RunState)
STORE = web.AppKey("store", Store)
RECORDER = web.AppKey("recorder", Recorder)
EPISODES = web.AppKey("episodes", Episodes)
SESSION = web.AppKey("session", aiohttp.ClientSession)
ENGINE_CLIENT = web.AppKey("engine_client", EngineClient)  # the policy engine's calls (proxy/engine_client.py)
ENGINES = web.AppKey("engines", Engines)
RESPONSES = web.AppKey("responses", ConversationStore)  # the latest responses, for previous_response_id


def request_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("api-key") or request.headers.get("x-api-key") or None  # x-api-key: Anthropic SDK


def check_agent_auth(request: web.Request, api_key: str | None) -> None:
    """The agent's key against the proxy's auth token (when it has one) or an episode's token: a 401 otherwise."""
    token = request.app[CONFIG].auth_token
    if token and api_key != token and not request.app[EPISODES].is_token(api_key):
        raise ApiError(401, "missing or wrong api key: this proxy requires its auth token or an episode token",
                       code="invalid_api_key")
