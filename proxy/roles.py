"""Named roles: which calls of a (multi-agent) app belong to which role, and where a frozen role's calls go.

Every call already carries a fingerprint (`role_key`: the requested model name, the system prompt and the tool
set); `harness roles` lists the fingerprints a run saw. A `RoleRule` gives a role a name by one of three matches,
the first rule that matches a call wins:

    model:gpt-4o-mini        the model name the agent asked for, exactly
    system:^You review       a regular expression searched in the system (or developer) prompt
    key:3f2a9c0d1e4b5a67     the fingerprint itself, as `harness roles` prints it

A rule with an `upstream` sends its role's calls to that OpenAI-compatible server (a fixed model) instead of the
policy engine; they are recorded all the same (with that server's token ids if it returns them), stamped with
the role's name, and the trainer never trains on them.

Every other role is served by a policy: the role's own (`policy`, e.g. one LoRA adapter per trained role of a
planner-executor app) or the default one, `DEFAULT_POLICY`, which also serves the calls no rule matches. The proxy
sends a policy's calls to the engine under that policy's current model name (a trainer sets it with
`POST /harness/weights {"policy": ..., "model": ...}`), and records the role and the policy with each call
(`calls.role`, `calls.policy`), so each policy trains on its own calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_KINDS = ("model", "system", "key")
DEFAULT_POLICY = "policy"  # the policy that serves calls whose role names none, and calls no rule matches
_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # role and policy names: they become parts of engine model and metric names


def is_policy_name(name: object) -> bool:
    """A policy name is letters, digits, '_', '-' and '.': it becomes part of the engine's model names
    (`planner-v000003`) and of metric names, where anything else would need quoting."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class RoleRule:
    name: str  # the role's name, e.g. "solver"
    match: str  # "model:NAME", "system:REGEX" or "key:FINGERPRINT"
    upstream: str | None = None  # base URL (as an OpenAI SDK takes it) of a fixed model for this role's calls
    upstream_model: str | None = None  # the model name sent to that upstream; None: the one the agent asked for
    upstream_key_env: str | None = None  # environment variable holding that upstream's API key (never recorded)
    policy: str | None = None  # the policy that serves and trains this role's calls; None: DEFAULT_POLICY

    def __post_init__(self):
        if not self.name or not _NAME.fullmatch(self.name):
            raise ValueError(f"role name {self.name!r} must be letters, digits, '_', '-' or '.'")
        if self.policy is not None and not is_policy_name(self.policy):
            raise ValueError(f"role {self.name!r}: policy name {self.policy!r} must be letters, digits, '_', '-' or "
                             "'.' (it becomes part of the engine's model names and of metric names)")
        if self.policy is not None and self.upstream is not None:
            raise ValueError(f"role {self.name!r} has an upstream ({self.upstream}) and a policy ({self.policy!r}): "
                             "a frozen role is served by its fixed model and never trained; give it one or the other")
        kind, sep, value = self.match.partition(":")
        if not sep or kind not in _KINDS or not value:
            raise ValueError(f"role {self.name!r}: match {self.match!r} must be model:NAME, system:REGEX or "
                             "key:FINGERPRINT (as `harness roles` prints it)")
        if kind == "system":
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"role {self.name!r}: system regex {value!r} does not compile: {exc}") from None
        if self.upstream is not None and not self.upstream.startswith(("http://", "https://")):
            raise ValueError(f"role {self.name!r}: upstream {self.upstream!r} must start with http:// or https://")

    @property
    def kind(self) -> str:
        return self.match.partition(":")[0]

    @property
    def value(self) -> str:
        return self.match.partition(":")[2]

    def upstream_url(self, route: str) -> str:
        """The URL of `route` ("chat/completions") at the upstream, a base URL as an OpenAI SDK takes it
        (https://api.openai.com/v1, .../compatible-mode/v1, .../v1beta/openai): the route is appended as it is."""
        return f"{self.upstream.rstrip('/')}/{route}"

    def matches(self, requested_model: str | None, system_prompt: str | None, role_key: str) -> bool:
        kind, value = self.kind, self.value
        if kind == "model":
            return requested_model == value
        if kind == "key":
            return role_key == value
        return system_prompt is not None and re.search(value, system_prompt) is not None


def parse_rules(matches: dict[str, str], upstreams: dict[str, str] | None = None,
                upstream_models: dict[str, str] | None = None,
                upstream_key_envs: dict[str, str] | None = None, *,
                policies: dict[str, str] | None = None) -> tuple[RoleRule, ...]:
    """Rules from name -> match mappings (config files and command lines), in the order given; `policies`: role
    name -> the policy that serves it. An upstream or a policy for a role with no match is a mistake: it is
    named."""
    upstreams, upstream_models, upstream_key_envs = upstreams or {}, upstream_models or {}, upstream_key_envs or {}
    policies = policies or {}
    for what, mapping in (("an upstream", upstreams), ("an upstream model", upstream_models),
                          ("an upstream key", upstream_key_envs), ("a policy", policies)):
        unknown = sorted(set(mapping) - set(matches))
        if unknown:
            raise ValueError(f"role {unknown[0]!r} has {what} but no match: add it to the role matches, e.g. "
                             f"{unknown[0]}=model:NAME")
    return tuple(RoleRule(name, spec, upstreams.get(name), upstream_models.get(name), upstream_key_envs.get(name),
                          policies.get(name)) for name, spec in matches.items())


def policy_of(role: RoleRule | None) -> str:
    """The policy that serves a call of `role` (None: no rule matched) when it goes to the policy engine."""
    return DEFAULT_POLICY if role is None or role.policy is None else role.policy


def policy_names(rules: tuple[RoleRule, ...]) -> tuple[str, ...]:
    """Every policy that serves calls under `rules`: the default first, then the roles' own, in rule order."""
    return tuple(dict.fromkeys([DEFAULT_POLICY, *(r.policy for r in rules if r.policy is not None)]))


def key_env_names(rules: tuple[RoleRule, ...]) -> tuple[str, ...]:
    """The environment variables that hold frozen roles' upstream keys: agents are never given them."""
    return tuple(r.upstream_key_env for r in rules if r.upstream_key_env)


def parse_assignments(items: list[str], what: str) -> dict[str, str]:
    """["solver=model:gpt-4o-mini", ...] (command-line flags) -> {"solver": "model:gpt-4o-mini"}."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ValueError(f"{what} {item!r} must look like NAME=VALUE, e.g. solver=model:gpt-4o-mini")
        out[name.strip()] = value.strip()
    return out


def system_prompt(body: dict) -> str | None:
    """The text of a chat request's first system or developer message (content parts joined)."""
    for message in body.get("messages") or ():
        if isinstance(message, dict) and message.get("role") in ("system", "developer"):
            content = message.get("content")
            if isinstance(content, list):
                return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
            return content if isinstance(content, str) else None
    return None


def find_role(rules: tuple[RoleRule, ...], requested_model: str | None, body: dict | None,
              role_key: str) -> RoleRule | None:
    if not rules:
        return None
    prompt = system_prompt(body) if body is not None else None
    return next((r for r in rules if r.matches(requested_model, prompt, role_key)), None)
