"""`harness serve`: the engine (started or attached) with the recording proxy in front of it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from harness.cli import options
from harness.running.proxied import engine_parsing
from proxy.config import ProxyConfig


def add_parser(verbs) -> None:
    p = verbs.add_parser(
        "serve", help="start the engine (or attach to one) and the recording proxy",
        description="Start vLLM on a model (or attach to a running OpenAI-compatible server) and put the recording "
        "proxy in front of it. Point agents at the printed OPENAI_BASE_URL; every call lands in the DuckDB file.",
    )
    options.add_engine_args(p)
    p.add_argument("--run-dir", type=Path, default=options.DEFAULT_RUN_DIR, help="where logs go (default: %(default)s)")
    p.add_argument("--db", type=Path, help="DuckDB file to record into (default: RUN_DIR/harness.duckdb)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8400, help="proxy port; 0 picks a free one (default: %(default)s)")
    p.add_argument("--auth-token", default=os.environ.get("HARNESS_AUTH_TOKEN"),
                   help="api key agents must send; required when binding beyond loopback (env HARNESS_AUTH_TOKEN)")
    p.add_argument("--db-memory-mb", type=int, default=ProxyConfig.db_memory_mb,
                   help="DuckDB's memory cap in the proxy: recorded rows stay cached up to it (default: %(default)s)")
    p.add_argument("--strict-episodes", action="store_true",
                   help="refuse /e/<episode>/v1 calls for episodes not opened via POST /harness/episodes")
    options.add_sampling_args(p)
    options.add_record_only_args(p)
    options.add_role_args(p)
    options.add_transparent_args(p)
    options.add_limit_args(p)
    p.set_defaults(func=_serve)


def _serve(args) -> int:
    from harness.running.vllm_server import EngineError, start_or_attach
    from proxy.server import loop_kind, run, serve_forever

    try:
        loop_kind()  # a bad HARNESS_EVENT_LOOP, before anything starts
        engine_args = options.engine_args(args)  # refused before anything starts, record-only included
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.run_dir.mkdir(parents=True, exist_ok=True)
    db = args.db or args.run_dir / "harness.duckdb"
    if args.record_only or args.upstream_key_env:
        return _record_only(args, db)
    try:
        sampling = options.sampling(args)
        settings = options.proxy_settings(args)  # before an engine starts
        roles = options.role_rules(args)
        engine = start_or_attach(model=options.model(args), upstream=(args.upstream or [None])[0], run_dir=args.run_dir,
                                 max_model_len=args.max_model_len, extra_args=engine_args,
                                 **options.parsers(args))
    except (EngineError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, EngineError) else 2  # the engine failed; else bad input
    try:
        if not engine.returns_token_ids:
            print(f"note: {engine.base_url} returns no token ids: recording text only", file=sys.stderr)
        config = ProxyConfig(
            upstream_url=engine.base_url, db_path=db, served_model=engine.served_model,
            returns_token_ids=engine.returns_token_ids, host=args.host, port=args.port,
            auth_token=args.auth_token, auto_episodes=not args.strict_episodes, sampling=sampling,
            token_exact=not args.no_token_exact, **engine_parsing(engine), roles=roles,
            reasoning_history=args.reasoning_history,
            more_upstreams=tuple((args.upstream or [])[1:]), db_memory_mb=args.db_memory_mb, **settings,
        )

        interceptor = options.interceptor(args, args.run_dir)

        def ready(server):
            print(f"proxy ready: {server.url}/v1  (recording into {db})", file=sys.stderr)
            print(f"  export OPENAI_BASE_URL={server.url}/v1", file=sys.stderr)
            print(f"  per-episode: {server.url}/e/<episode>/v1   SQL: harness sql --db {db} \"SELECT ...\"",
                  file=sys.stderr)
            if interceptor is not None:
                try:
                    interceptor.start(server.url, auth_token=config.auth_token)
                except interceptor.Error as exc:
                    print(f"error: {exc}", file=sys.stderr)
                    raise SystemExit(1) from None
                print(f"transparent hop ready on {interceptor.proxy_address}: agents that hard-code an LLM host "
                      "are recorded with this environment:", file=sys.stderr)
                for key, value in interceptor.agent_env().items():
                    if key.isupper():
                        print(f"  export {key}={value}", file=sys.stderr)
            sys.stderr.flush()

        try:
            run(serve_forever(config, on_ready=ready))
        finally:
            if interceptor is not None:
                interceptor.close()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.stop()
    return 0


def _record_only(args, db: Path) -> int:
    """The proxy in front of an API that is not ours: no probe (it may want a key the proxy does not have), every
    call forwarded as sent."""
    from proxy.server import run, serve_forever

    if problem := options.record_only_error(args):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        config = ProxyConfig(
            upstream_url=args.upstream[0], db_path=db, returns_token_ids=False, token_exact=False,
            host=args.host, port=args.port, auth_token=args.auth_token, auto_episodes=not args.strict_episodes,
            db_memory_mb=args.db_memory_mb, roles=options.role_rules(args), record_only=True,
            upstream_key_env=args.upstream_key_env, **options.proxy_settings(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def ready(server):
        print(f"recording {config.upstream_base} as it is: {server.url}/v1  (into {db})", file=sys.stderr)
        print(f"  export OPENAI_BASE_URL={server.url}/v1   (agents keep their own API keys; none is stored)",
              file=sys.stderr)
        sys.stderr.flush()

    run(serve_forever(config, on_ready=ready))
    return 0


#
