"""The `harness` command: a few verbs, each with a --help that answers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from harness import __version__

DEFAULT_RUN_DIR = Path("runs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="harness",
        description="Record unmodified LLM agents through an OpenAI-compatible proxy and train them with RL.",
    )
    parser.add_argument("--version", action="version", version=f"harness {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    _add_serve(verbs)
    _add_sql(verbs)
    _add_tiny_model(verbs)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


# ---------------------------------------------------------------------------------------------------------------


def _add_serve(verbs) -> None:
    p = verbs.add_parser(
        "serve", help="start the engine (or attach to one) and the recording proxy",
        description="Start vLLM on a model (or attach to a running OpenAI-compatible server) and put the recording "
        "proxy in front of it. Point agents at the printed OPENAI_BASE_URL; every call lands in the DuckDB file.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="model directory to serve with vLLM (started as a subprocess)")
    src.add_argument("--upstream", help="URL of an engine already running, e.g. http://127.0.0.1:8000")
    p.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR, help="where logs go (default: %(default)s)")
    p.add_argument("--db", type=Path, help="DuckDB file to record into (default: RUN_DIR/harness.duckdb)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8400, help="proxy port; 0 picks a free one (default: %(default)s)")
    p.add_argument("--auth-token", default=os.environ.get("HARNESS_AUTH_TOKEN"),
                   help="api key agents must send; required when binding beyond loopback (env HARNESS_AUTH_TOKEN)")
    p.add_argument("--max-model-len", type=int, default=2048, help="engine context length (default: %(default)s)")
    p.add_argument("--strict-episodes", action="store_true",
                   help="refuse /e/<episode>/v1 calls for episodes not opened via POST /harness/episodes")
    p.add_argument("--temperature", type=float, help="training-time override of the agents' temperature")
    p.add_argument("--top-p", type=float, help="training-time override of the agents' top_p")
    p.add_argument("--max-tokens-cap", type=int, help="cap on the agents' max_tokens")
    p.set_defaults(func=_serve)


def _serve(args) -> int:
    from harness.engine import EngineError, attach, start_vllm
    from proxy import ProxyConfig, SamplingOverrides, serve_forever

    args.run_dir.mkdir(parents=True, exist_ok=True)
    db = args.db or args.run_dir / "harness.duckdb"
    try:
        sampling = SamplingOverrides(args.temperature, args.top_p, args.max_tokens_cap)
        if args.model is not None:
            if not args.model.is_dir():
                print(f"error: --model {str(args.model)!r} is not a directory (build one: harness tiny-model DIR)",
                      file=sys.stderr)
                return 2
            print(f"starting vLLM on {args.model} (log: {args.run_dir / 'engine.log'}) ...", file=sys.stderr)
            engine = start_vllm(args.model, args.run_dir, max_model_len=args.max_model_len)
        else:
            engine = attach(args.upstream)
    except (EngineError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        if not engine.returns_token_ids:
            print(f"note: {engine.base_url} returns no token ids: recording text only", file=sys.stderr)
        config = ProxyConfig(
            upstream_url=engine.base_url, db_path=db, served_model=engine.served_model,
            returns_token_ids=engine.returns_token_ids, host=args.host, port=args.port,
            auth_token=args.auth_token, auto_episodes=not args.strict_episodes, sampling=sampling,
        )

        def ready(server):
            print(f"proxy ready: {server.url}/v1  (recording into {db})", file=sys.stderr)
            print(f"  export OPENAI_BASE_URL={server.url}/v1", file=sys.stderr)
            print(f"  per-episode: {server.url}/e/<episode>/v1   SQL: harness sql --db {db} \"SELECT ...\"",
                  file=sys.stderr)
            sys.stderr.flush()

        asyncio.run(serve_forever(config, on_ready=ready))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.stop()
    return 0


# ---------------------------------------------------------------------------------------------------------------


def _add_sql(verbs) -> None:
    p = verbs.add_parser(
        "sql", help="read-only SQL over recorded rollouts (docs/schema.md)",
        description="Run a read-only query over the recorded rollouts. Works on a closed database file and while a "
        "proxy is recording into it (the query then goes through the proxy). Tables: runs, episodes, calls, "
        "choices; views: completions, episode_summary. See docs/schema.md.",
    )
    p.add_argument("query", help='e.g. "SELECT episode_id, count(*) FROM calls GROUP BY 1"')
    p.add_argument("--db", type=Path, default=DEFAULT_RUN_DIR / "harness.duckdb",
                   help="DuckDB file (default: %(default)s)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--csv", action="store_true", help="print CSV")
    fmt.add_argument("--json", action="store_true", help="print a JSON list of row objects")
    p.add_argument("--max-rows", type=int, default=None, help="print at most this many rows")
    p.set_defaults(func=_sql)


def _sql(args) -> int:
    from harness.sql import SqlError, print_table, run_sql, to_csv, to_json

    try:
        result = run_sql(args.db, args.query, max_rows=args.max_rows)
    except SqlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.csv:
        sys.stdout.write(to_csv(result))
    elif args.json:
        print(to_json(result))
    else:
        print_table(result)
    return 0


# ---------------------------------------------------------------------------------------------------------------


def _add_tiny_model(verbs) -> None:
    p = verbs.add_parser(
        "tiny-model", help="build a tiny random Qwen2-style model offline (tests, demo)",
        description="Build a small random-weight Qwen2-architecture model with a locally trained byte-level BPE "
        "tokenizer and a chat template with tool calls. Deterministic per seed; needs the train extra.",
    )
    p.add_argument("out", type=Path, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.set_defaults(func=_tiny_model)


def _tiny_model(args) -> int:
    try:
        from harness.tiny_model import build_tiny_model
    except ImportError as exc:
        print(f"error: tiny-model needs torch and transformers ({exc}); pip install 'harness[train]'",
              file=sys.stderr)
        return 1
    path = build_tiny_model(args.out, seed=args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
