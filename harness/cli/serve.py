"""`harness serve`: the engine (started or attached) with the recording proxy in front of it."""

from __future__ import annotations

import errno
import os
import re
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
    p.add_argument("--port", type=options.port_number, default=8400,
                   help="proxy port; 0 picks a free one (default: %(default)s)")
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
    from proxy.server import loop_kind

    try:
        loop_kind()  # a bad HARNESS_EVENT_LOOP, before anything starts
        engine_args = options.engine_args(args)  # refused before anything starts, record-only included
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    db = args.db or args.run_dir / "harness.duckdb"
    if args.record_only or args.upstream_key_env:
        return _record_only(args, db)
    try:
        sampling = options.sampling(args)
        settings = options.proxy_settings(args)  # before an engine starts
        roles = options.role_rules(args)
        parsers = options.parsers(args)
        interceptor = options.interceptor(args, args.run_dir)  # --llm-host without --transparent, say
        # the proxy's own checks of these flags (a host beyond loopback without a token, ...), before an engine
        # starts: the engine's address comes later
        ProxyConfig(upstream_url="http://127.0.0.1", db_path=db, host=args.host, port=args.port,
                    auth_token=args.auth_token, db_memory_mb=args.db_memory_mb, roles=roles, **settings, **parsers)
        if problem := _start_error(args, db):  # what would stop the proxy, found before an engine starts for minutes
            print(f"error: {problem}", file=sys.stderr)
            return 2
        engine = start_or_attach(model=options.model(args), upstream=(args.upstream or [None])[0], run_dir=args.run_dir,
                                 max_model_len=args.max_model_len, extra_args=engine_args, **parsers)
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
            return _run_proxy(config, ready)
        finally:
            if interceptor is not None:
                interceptor.close()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.stop()


def _record_only(args, db: Path) -> int:
    """The proxy in front of an API that is not ours: no probe (it may want a key the proxy does not have), every
    call forwarded as sent."""
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
    if problem := _start_error(args, db):
        print(f"error: {problem}", file=sys.stderr)
        return 2

    def ready(server):
        print(f"recording {config.upstream_base} as it is: {server.url}/v1  (into {db})", file=sys.stderr)
        print(f"  export OPENAI_BASE_URL={server.url}/v1   (agents keep their own API keys; none is stored)",
              file=sys.stderr)
        sys.stderr.flush()

    return _run_proxy(config, ready)


def _run_proxy(config: ProxyConfig, ready) -> int:
    """Serve until stopped. A port or a database another process took since `_start_error` looked is one line,
    not a traceback."""
    import duckdb

    from harness.store.database import SchemaVersionError
    from proxy.server import run, serve_forever

    try:
        run(serve_forever(config, on_ready=ready))
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            raise
        print(f"error: {options.bind_failure(config.host, config.port, exc)}", file=sys.stderr)
        return 2
    except duckdb.IOException as exc:
        print(f"error: {_held(config.db_path, exc) or exc}", file=sys.stderr)
        return 2
    except SchemaVersionError as exc:  # the file changed since _start_error looked
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _start_error(args, db: Path) -> str | None:
    """What would stop the proxy once the engine is up, or None: a run directory that cannot be made, a port in
    use, a database file another process holds or that is not a database."""
    try:
        args.run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"--run-dir {str(args.run_dir)!r} cannot be made ({exc.strerror}): give a folder you can write"
    return options.listen_error(args.host, args.port) or _db_error(db)


def _db_error(db: Path) -> str | None:
    """Why the proxy could not open `db` read-write, found by opening it for a moment as the store does (ATTACH with
    its row group size, so a write-ahead log it replays is written as the store writes): DuckDB lets one process
    hold a file, and the store would only open it after the engine started."""
    import duckdb

    from harness.store.database import ROW_GROUP_SIZE

    if not db.exists():
        return None
    if db.is_dir():
        return f"--db {str(db)!r} is a folder: give the path of a database file (new or recorded into before)"
    con = duckdb.connect(":memory:")
    try:
        quoted = "'" + str(db).replace("'", "''") + "'"
        con.execute(f"ATTACH {quoted} AS probe (ROW_GROUP_SIZE {ROW_GROUP_SIZE})")
    except duckdb.Error as exc:
        return _held(db, exc) or (f"{str(db)!r} is not a database harness can record into ({exc}): pass --db a "
                                  "harness database, or a new path")
    finally:
        con.close()
    from harness.store.database import SchemaVersionError, check_database

    try:  # another application's file, or a newer harness's: refused as the store would, nothing written
        check_database(db)
    except SchemaVersionError as exc:
        return str(exc)
    return None


def _held(db: Path, exc: Exception) -> str | None:
    """The one line for a database another process holds (DuckDB's lock error names its pid), or None for another
    error."""
    if "lock" not in str(exc).lower():
        return None
    pid = re.search(r"\(PID (\d+)\)", str(exc))
    by = f" (pid {pid.group(1)})" if pid else ""
    return f"{db} is held by another process{by}: stop it, or pass --run-dir/--db elsewhere"


#
