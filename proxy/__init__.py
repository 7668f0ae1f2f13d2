"""The recording proxy: an OpenAI-compatible front for the engine that records every call."""

from proxy.app import create_app
from proxy.config import ProxyConfig, SamplingOverrides
from proxy.server import ProxyServer, discover, serve_forever

__all__ = ["ProxyConfig", "ProxyServer", "SamplingOverrides", "create_app", "discover", "serve_forever"]
