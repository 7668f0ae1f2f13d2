"""A run of agents behind the recording proxy, wired once for `harness run` and the trainer: the proxy's config
from the engine it fronts, the keys agents are never given, and what each agent gets from transparent mode's hop
(proxy/transparent.py), when one stands in front of the proxy.

    engine -> proxy_config -> ProxyServer -> the hop (optional) -> Runner(agents_config, proxy=server,
                                                                          episode_env=agent_env(hop))
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from harness.running.runner import RunConfig
from harness.running.vllm_server import Engine
from proxy.config import ProxyConfig
from proxy.roles import key_env_names


def proxy_config(engine: Engine, run_dir: Path, **options) -> ProxyConfig:
    """The proxy in front of `engine`, recording into `run_dir/harness.duckdb`, on a free port, parsing replies as
    the engine does; `options` are ProxyConfig's other keys (sampling, roles, limits...)."""
    return ProxyConfig(upstream_url=engine.base_url, served_model=engine.served_model or None,
                       returns_token_ids=engine.returns_token_ids, db_path=run_dir / "harness.duckdb", port=0,
                       **engine_parsing(engine), **options)


def engine_parsing(engine: Engine) -> dict:
    """ProxyConfig's reply-parsing keys for `engine`: its parsers, and its model's tokenizer."""
    return {"tool_parser": engine.tool_parser, "reasoning_parser": engine.reasoning_parser,
            "tokenizer": engine.model_dir}


def agents_config(run: RunConfig, proxy: ProxyConfig) -> RunConfig:
    """How agents run behind `proxy`: never given the keys the proxy uses upstream (frozen roles', record-only's)."""
    hidden = (*key_env_names(proxy.roles), *([proxy.upstream_key_env] if proxy.upstream_key_env else []))
    return replace(run, hidden_env=(*run.hidden_env, *hidden))


def agent_env(interceptor):
    """The environment each episode's agent gets from the hop (HTTPS_PROXY, the CA...), or None without one."""
    return interceptor.agent_env if interceptor is not None else None
