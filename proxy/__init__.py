"""The recording proxy: an OpenAI-compatible front for the engine that records every call.

The path of one call: `app.py` (routes) -> `episodes.py` (which episode) -> `request.py` (check, translate) ->
`forward.py` (to the engine and back, the Call built) -> the store's recorder. `server.py` is the front door for
code that runs a proxy (`ProxyServer`). Importing a submodule (a parser, the config) loads only that submodule:
the names below are loaded when first used.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"ProxyConfig": "proxy.config", "SamplingOverrides": "proxy.config", "ProxyServer": "proxy.server",
            "serve_forever": "proxy.server", "create_app": "proxy.app"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'proxy' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
