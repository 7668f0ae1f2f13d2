"""The `harness` command: a few verbs, each with a --help that answers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from harness import __version__
from harness.cli import options
from harness.cli.export import add_parser as add_export_parser
from harness.cli.export import add_retokenize_parser
from harness.cli.models import add_model_parsers
from harness.cli.parsers import add_parser as add_parsers_parser
from harness.cli.parsers import quiet_vllm_info
from harness.cli.run import add_parser as add_run_parser
from harness.cli.serve import add_parser as add_serve_parser
from harness.cli.train import add_sft_parser, add_train_parser
from harness.viewer.app import add_parser as add_view_parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_vllm_info()  # every verb that imports vLLM in this process (its parsers): no "Triton not installed" INFO
    try:
        status = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `harness ... | head` closed the pipe: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not raise again
        return 141  # a shell's status for SIGPIPE


def build_parser() -> argparse.ArgumentParser:
    """The `harness` command line, every verb and option (tests/test_docs.py checks the docs' command lines on it)."""
    parser = argparse.ArgumentParser(
        prog="harness",
        description="Record unmodified LLM agents through an OpenAI-compatible proxy and train them with RL.",
    )
    parser.add_argument("--version", action="version", version=f"harness {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    add_serve_parser(verbs)
    add_run_parser(verbs)
    _add_judge(verbs)
    _add_merge(verbs)
    _add_sql(verbs)
    _add_roles(verbs)
    add_model_parsers(verbs)
    _add_doctor(verbs)
    add_parsers_parser(verbs)
    add_train_parser(verbs)
    add_sft_parser(verbs)
    add_view_parser(verbs)
    add_export_parser(verbs)
    add_retokenize_parser(verbs)
    return parser


# ---------------------------------------------------------------------------------------------------------------


def _add_judge(verbs) -> None:
    p = verbs.add_parser(
        "judge", help="re-score a stored run with a (new) judge, without re-running agents",
        description="Score every episode of a stored dataset run with JUDGE, offline: the agents are not run "
        "again. Judgements are added (nothing is overwritten) and a new report is stored and printed.",
    )
    p.add_argument("--judge", required=True, help="judge spec, as for harness run")
    p.add_argument("--run", dest="run_id", help="run id (default: the latest dataset run in the database)")
    p.add_argument("--db", type=Path, default=options.DEFAULT_RUN_DIR / "harness.duckdb",
                   help="DuckDB file (default: %(default)s)")
    p.add_argument("--success-threshold", type=float, default=1.0, help="reward that counts as a success")
    p.add_argument("--judge-timeout", type=float, default=60.0, help="seconds per judgement (default: 60)")
    p.set_defaults(func=_judge)


def _judge(args) -> int:
    import duckdb

    from harness.running.dataset import rejudge
    from harness.running.judges import JudgeError
    from harness.running.report import print_report
    from harness.store.database import SchemaVersionError

    if not args.db.is_file():
        print(f"error: no database at {str(args.db)!r}: pass --db PATH", file=sys.stderr)
        return 2
    try:
        run_id, report = asyncio.run(rejudge(args.db, args.run_id, args.judge,
                                             success_threshold=args.success_threshold, timeout_s=args.judge_timeout))
    except (JudgeError, ValueError, SchemaVersionError, duckdb.Error) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_report(report, run_id)
    return 0


def _add_merge(verbs) -> None:
    p = verbs.add_parser(
        "merge", help="(re)build training samples from recorded episodes (docs/schema.md: samples)",
        description="Merge each recorded episode's calls into training samples: calls that extend each other become "
        "one sequence whose mask marks exactly the engine-sampled tokens, and every new timeline gets a stored "
        "reason (merge_breaks). Earlier samples of those episodes are replaced; each sample's reward is its "
        "episode's latest judgement. `harness run` and `harness judge` merge by themselves: use this for episodes "
        "recorded with `harness serve` (stop the proxy first). Prints episodes, samples, merge ratio, drift rate "
        "and the reasons histogram.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--db", type=Path, help="DuckDB file (default: RUN_DIR/harness.duckdb)")
    where.add_argument("--run-dir", type=Path, default=options.DEFAULT_RUN_DIR,
                       help="run directory holding harness.duckdb (default: %(default)s)")
    p.add_argument("--run", dest="run_id", help="merge only this run's episodes (default: every episode in the file)")
    p.set_defaults(func=_merge)


def _merge(args) -> int:
    import duckdb

    from harness.core.merge import format_merge_summary
    from harness.store.database import SchemaVersionError
    from harness.store.samples import merge_database

    try:
        summary = merge_database(args.db or args.run_dir / "harness.duckdb", args.run_id)
    except (ValueError, SchemaVersionError, duckdb.Error) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_merge_summary(summary))
    return 0


# ---------------------------------------------------------------------------------------------------------------


def _add_sql(verbs) -> None:
    p = verbs.add_parser(
        "sql", help="read-only SQL over recorded rollouts (docs/schema.md)",
        description="Run a read-only query over the recorded rollouts. Works on a closed database file and while a "
        "proxy is recording into it (the query then goes through the proxy). Tables: runs, episodes, calls, "
        "choices, tasks, episode_outcomes, judgements, reports, samples, merge_breaks, episode_merges, metrics; "
        "views: completions, episode_summary, rewards, merge_metrics, merge_reasons, training_curve, roles, flags. "
        "See docs/schema.md. Exit code: 0 when the query ran, 1 when the query failed (an SQL error, or a statement "
        "that is not read-only), 2 on bad input (no database file, a file that is not a harness database).",
    )
    p.add_argument("query", help='e.g. "SELECT episode_id, count(*) FROM calls GROUP BY 1"')
    p.add_argument("--db", type=Path, default=options.DEFAULT_RUN_DIR / "harness.duckdb",
                   help="DuckDB file, or a folder: every .duckdb file under it read as one, e.g. a backbone: verl "
                   "run's <run>/verl with a file per worker (default: %(default)s)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--csv", action="store_true", help="print CSV")
    fmt.add_argument("--json", action="store_true", help="print a JSON list of row objects")
    p.add_argument("--max-rows", type=int, default=None, help="print at most this many rows")
    p.set_defaults(func=_sql)


def _sql(args) -> int:
    from harness.store.sql import DatabaseError, SqlError, print_table, run_sql, to_csv, to_json

    try:
        result = run_sql(args.db, args.query, max_rows=args.max_rows)
    except SqlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, DatabaseError) else 1
    if args.csv:
        sys.stdout.write(to_csv(result))
    elif args.json:
        print(to_json(result))
    else:
        print_table(result)
    return 0


def _add_roles(verbs) -> None:
    p = verbs.add_parser(
        "roles", help="the roles found in recorded calls: model name, system prompt, tools (docs/schema.md: roles)",
        description="List the roles of the recorded calls, most calls first: a role is what the agent asked for "
        "(model name), its system prompt and its tool set, so the agents of a multi-agent app show apart without "
        "annotations. Each with its counts and an example call. Works on a closed file and live, like harness sql. "
        "Exit code: 0 when listed, 2 on bad input (no database file, a file that is not a harness database, a --run "
        "with no calls).",
    )
    p.add_argument("--db", type=Path, default=options.DEFAULT_RUN_DIR / "harness.duckdb",
                   help="DuckDB file (default: %(default)s)")
    p.add_argument("--run", dest="run_id", help="only this run's roles (default: every run's)")
    p.add_argument("--json", action="store_true", help="print a JSON list of row objects")
    p.set_defaults(func=_roles)


def _roles(args) -> int:
    from harness.store.database import QueryResult
    from harness.store.sql import SqlError, print_table, run_sql, to_json

    try:
        result = run_sql(args.db, "SELECT * FROM roles ORDER BY run_id, calls DESC, role_key")
    except SqlError as exc:  # the query is ours: what fails is the database given
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.run_id is not None:  # filtered here, not spliced into the SQL
        run = result.columns.index("run_id")
        rows = [row for row in result.rows if row[run] == args.run_id]
        if not rows and not any(row[run] == args.run_id for row in result.rows):
            runs = sorted({row[run] for row in result.rows})
            print(f"error: no calls of run {args.run_id!r} in {args.db}; runs with calls: {', '.join(runs) or 'none'}",
                  file=sys.stderr)
            return 2
        result = QueryResult(result.columns, result.types, rows, False)
    if args.json:
        print(to_json(result))
    else:
        print_table(result)
    return 0


# ---------------------------------------------------------------------------------------------------------------


def _add_doctor(verbs) -> None:
    p = verbs.add_parser(
        "doctor", help="check a model's chat template and tool parser for what breaks merging (docs/doctor.md)",
        description="Check, offline, that the model's chat template only appends over multi-turn conversations with "
        "tool calls and tool results, that earlier assistant turns come back as the model wrote them, that the "
        "tool-call parser reads back what the template renders, where the template puts a reply's reasoning (and "
        "so which --reasoning-history fits), and that an assistant turn ends on a stop token. "
        "One line per check (ok, warn, FAIL); exit 0 when nothing FAILs, 1 otherwise, 2 on bad input. A template "
        "with no tool-call format at all (SmolLM2's) is a warn, since the model still drives agents without tools, "
        "and a FAIL when tools are asked for (--tools, or --tool-parser given).",
    )
    p.add_argument("--model", required=True, help="model directory (tokenizer and chat template), or a Hugging Face "
                   "id: its tokenizer, template and config files only (no weights), from the local cache, else "
                   "downloaded")
    p.add_argument("--tool-parser", help="tool-call parser, a name vLLM's --tool-call-parser takes (hermes, "
                   "qwen3_xml, llama3_json, mistral, pythonic, deepseek_v3, glm45, kimi_k2, ...; default: hermes); "
                   "naming one means the agents use tools, as --tools does")
    p.add_argument("--tools", action="store_true", help="the agents use tools: a template with no tool-call format "
                   "FAILs (without this or --tool-parser it is a warn: the model suits agents without tools)")
    p.add_argument("--reasoning-parser", help="reasoning parser of a reasoning model, a name vLLM's "
                   "--reasoning-parser takes (qwen3, deepseek_r1, glm45, ...)")
    p.add_argument("--chat-template", type=Path, help="a Jinja template file to check instead of the model's own")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_doctor)


def _doctor(args) -> int:
    import json

    from harness.cli.doctor import DoctorError, diagnose, format_report
    from harness.running.hub import ModelNotFoundError, local_model

    try:
        model = (args.model if Path(args.model).exists()  # a directory of tokenizer files is enough here
                 else local_model(args.model, "--model", files="tokenizer"))  # a Hub id: those files, no weights
        report = diagnose(model, tool_parser=args.tool_parser or "hermes", chat_template=args.chat_template,
                          reasoning_parser=args.reasoning_parser, tools=args.tools or args.tool_parser is not None,
                          say=lambda line: print(line, file=sys.stderr, flush=True))
    except (DoctorError, ModelNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json(), indent=2, ensure_ascii=False) if args.json else format_report(report))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
