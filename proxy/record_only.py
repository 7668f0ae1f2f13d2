"""Record-only mode (`ProxyConfig.record_only`): what of the agent's request, besides its body, goes on to the API the
proxy is recording in front of. Every route that goes upstream (the recorded ones, /v1/models, the passthrough)
takes it from `forwarded()`:

- the agent's API key, in the header it came in: `Authorization: Bearer KEY`, or `api-key: KEY` (Azure OpenAI).
  The proxy's own tokens (auth_token, episode tokens) never go on: for them, or no key, the key in
  `upstream_key_env` is sent instead, in the same header;
- `OpenAI-Organization` and `OpenAI-Project`;
- the query string, byte for byte as the agent sent it (Azure's `?api-version=...`);
- an Azure deployment URL's path (`/openai/deployments/<name>/chat/completions`), on the upstream's host.

Neither key nor query string is recorded or logged. An error message built from an upstream URL goes through
`redact()` first, since some APIs take a key in the query (`?key=...`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from aiohttp import web
from yarl import URL

from proxy.state import CONFIG, EPISODES

_FORWARDED = ("OpenAI-Organization", "OpenAI-Project")


@dataclass(frozen=True)
class Forwarded:
    headers: dict[str, str] = field(default_factory=dict)
    query: str = ""  # the agent's query string as sent (still percent-encoded); "" for none
    deployment: str | None = None  # the Azure deployment the URL named (/openai/deployments/<name>/...)

    def url(self, url: str) -> str | URL:
        return with_query(url, self.query)


NOTHING = Forwarded()  # outside record-only mode: the engine is ours, nothing of the agent's goes along


def forwarded(request: web.Request, api_key: str | None) -> Forwarded:
    """What goes upstream with this request besides its body (`api_key`: the key it carries, state.request_key)."""
    config = request.app[CONFIG]
    if not config.record_only:
        return NOTHING
    own = api_key is None or api_key == config.auth_token or request.app[EPISODES].is_token(api_key)
    key = (os.environ.get(config.upstream_key_env) if config.upstream_key_env else None) if own else api_key
    headers = {k: v for k in _FORWARDED if (v := request.headers.get(k))}
    if key:
        bearer = request.headers.get("Authorization", "")[:7].lower() == "bearer "
        if not bearer and "api-key" in request.headers:  # Azure's header: the API may take no other
            headers["api-key"] = key
        else:
            headers["Authorization"] = f"Bearer {key}"
    return Forwarded(headers, request.rel_url.raw_query_string, request.match_info.get("deployment"))


def with_query(url: str, query: str) -> str | URL:
    """`url` with `query` appended exactly as given (a plain string URL would be re-quoted on the way out)."""
    return URL(f"{URL(url)}?{query}", encoded=True) if query else url


# A query parameter whose name is, or ends in, one of these words (after '-', '_' or '.') holds a secret:
# key, api_key, api-key, apikey, access_token, X-Amz-Signature, sig (Azure SAS), client_secret, password...
_SECRET_NAME = r"(?:[\w.~%-]*[-_.])?(?:key|apikey|token|secret|password|passwd|pwd|signature|sig|credential|auth)"
_SECRET_PARAM = re.compile(rf"(?i)([?&;]{_SECRET_NAME}=)[^&#\s'\"<>)]*")


def redact(text: str) -> str:
    """`text` (an error message that may quote an upstream URL) with every secret-looking query value removed."""
    return _SECRET_PARAM.sub(r"\1REDACTED", text)


def redact_bytes(raw: bytes) -> bytes:
    """`raw` (an upstream's error body) with secret-looking query values removed; unchanged when there are none."""
    text = raw.decode("utf-8", "replace")
    cleaned = redact(text)
    return raw if cleaned == text else cleaned.encode()
