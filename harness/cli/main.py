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
from harness.cli.serve import add_parser as add_serve_parser
from harness.cli.train import add_sft_parser, add_train_parser
from harness.running.limits import AGENT_MAX_PROCS, AGENT_MEMORY_MB
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
    _add_run(verbs)
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


def _add_run(verbs) -> None:
    p = verbs.add_parser(
        "run", help="run an unmodified agent over a dataset, judge every episode, report",
        description="Run AGENT once per task and repeat, each run an episode of its own: the agent gets "
        "OPENAI_BASE_URL and OPENAI_API_KEY for its episode, and its task as JSON on stdin and in HARNESS_TASK. "
        "Its answer is its stdout (the last JSON line with an \"answer\" field, else the last non-empty line). "
        "Every call is recorded into RUN_DIR/harness.duckdb; the judge scores each episode; a report is "
        "printed, stored and written to RUN_DIR/report-<run>.json.",
    )
    p.add_argument("agent", nargs="?", type=Path, help="the agent's Python file (run with this Python)")
    p.add_argument("--cmd", help='any agent command instead, e.g. "node agent.js" (split like a shell would)')
    p.add_argument("--data", required=True,
                   help="tasks: a .jsonl file, a datasets dir or .parquet/.json file, a Harbor task dir or a dir of "
                   "them (run sandboxed, judged by their tests/test.sh), an environment service URL, or "
                   "module:function")
    p.add_argument("--agent", dest="preset", choices=["oracle"],
                   help="a built-in agent instead of AGENT: `oracle` runs each Harbor task's solution/solve.sh, to "
                   "check that every task of a set scores 1 before training on it (no engine is started)")
    p.add_argument("--sandbox", choices=["bwrap", "none"],
                   help="run each episode in a sandbox (docs/sandboxes.md): bwrap (bubblewrap: no network but the "
                   "proxy, the host's toolchain read-only, a private workspace); Harbor tasks always run in one "
                   "(default: bwrap for Harbor tasks, none for others)")
    p.add_argument("--sandbox-bind", action="append", default=[], metavar="PATH",
                   help="a host path a sandboxed agent needs (its install), bound read-only at the same path; "
                   "repeatable (this Python's venv and the files the command names are bound already)")
    p.add_argument("--blocked-commands", default="", metavar="CMD,CMD",
                   help="commands refused in the sandbox, each attempt flagged on the episode, e.g. git,pip,curl")
    p.add_argument("--keep-workspaces", action="store_true",
                   help="keep each sandboxed episode's workspace in RUN_DIR/workspaces/ after it is judged")
    p.add_argument("--split", default="train", help="dataset split (default: %(default)s)")
    p.add_argument("--limit", type=_at_least_one("--limit"), metavar="N", help="use only the first N tasks")
    p.add_argument("--judge", help="judge: a built-in (exact_match, math, substring, f1, rubric, env), "
                   "module:function, module:Class or path.py:name")
    p.add_argument("--repeat", type=int, default=1, help="episodes per task, the GRPO group size (default: 1)")
    p.add_argument("--concurrency", type=int, default=4, help="episodes at once (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per episode (default: %(default)s)")
    p.add_argument("--retries", type=int, default=2,
                   help="extra attempts when the engine was unreachable, never for wrong answers (default: 2)")
    p.add_argument("--success-threshold", type=float, default=1.0,
                   help="reward that counts as a success for success rate and pass@k (default: %(default)s)")
    p.add_argument("--judge-timeout", type=float, default=60.0, help="seconds per judgement (default: 60)")
    p.add_argument("--run-dir", type=Path, default=options.DEFAULT_RUN_DIR,
                   help="where the run goes (default: %(default)s)")
    p.add_argument("--agent-memory-mb", type=int, default=AGENT_MEMORY_MB,
                   help="address-space cap of each agent process in MB; 0: none (default: %(default)s)")
    p.add_argument("--agent-max-procs", type=int, default=AGENT_MAX_PROCS,
                   help="processes and threads of each agent with all it starts; 0: none (default: %(default)s)")
    p.add_argument("--cold-start", action="store_true",
                   help="start every episode's Python agent in a fresh interpreter; by default it forks from one that "
                   "has imported the openai SDK (~1 s of CPU less per episode)")
    options.add_sampling_args(p)
    p.add_argument("--debug", action="store_true",
                   help="one episode at a time, the agent on this terminal (stdin, stdout and stderr; its task only in "
                   "HARNESS_TASK), the judge in this process, no timeouts: breakpoints in agent or judge code work")
    options.add_engine_args(p, required=False)  # the oracle agent needs none
    options.add_role_args(p)
    options.add_record_only_args(p)
    options.add_transparent_args(p)
    options.add_limit_args(p)
    p.set_defaults(func=_run)


def _run(args) -> int:
    import shlex

    import duckdb

    from harness.running.judges import JudgeError
    from harness.running.runner import RunConfig
    from harness.running.tasks import TaskError, read_tasks
    from harness.running.vllm_server import Engine, EngineError, start_or_attach
    from harness.sandbox import SandboxError
    from harness.store.database import SchemaVersionError, check_database
    from proxy.server import loop_kind

    if args.preset == "oracle":
        return _run_oracle(args)
    if problem := options.engine_required(args):
        print(f"harness run: error: {problem}", file=sys.stderr)
        return 2
    if args.agent is None and args.cmd is None:
        print("error: no agent given: give the agent's Python file (harness run agent.py --data ...), or any "
              "command with --cmd \"COMMAND\"", file=sys.stderr)
        return 2
    if args.agent is not None and args.cmd is not None:
        print(f"error: both an agent file ({str(args.agent)!r}) and --cmd {args.cmd!r} given: give one of them",
              file=sys.stderr)
        return 2
    if args.agent is not None and not args.agent.is_file():
        print(f"error: agent {str(args.agent)!r} is not a file", file=sys.stderr)
        return 2
    command = [sys.executable, str(args.agent.resolve())] if args.agent else shlex.split(args.cmd)
    try:
        loop_kind()  # a bad HARNESS_EVENT_LOOP is named before anything starts
        engine_args = options.engine_args(args)
        tasks = read_tasks(args.data, split=args.split, limit=args.limit)
        if not tasks:
            raise TaskError(f"{args.data!r} has no tasks in split {args.split!r}")
        config = RunConfig(command=command, judge=args.judge, repeat=args.repeat, concurrency=args.concurrency,
                           timeout_s=args.timeout, retries=args.retries, judge_timeout_s=args.judge_timeout,
                           debug=args.debug, memory_mb=args.agent_memory_mb or None,
                           max_procs=args.agent_max_procs or None, warm_start=not args.cold_start,
                           **_sandbox_settings(args, tasks))
        sampling = options.sampling(args)
        if args.judge:
            from harness.running.judges import load_judge

            load_judge(args.judge)
        if problem := options.record_only_error(args):
            raise ValueError(problem)
        interceptor, roles = options.interceptor(args, args.run_dir), options.role_rules(args)
        settings = options.proxy_settings(args)
        check_database(args.run_dir / "harness.duckdb")  # a file the run could not record into, before any engine
        if args.record_only:  # a hosted API: nothing to probe (it may want a key), every call goes on as sent
            engine = Engine(args.upstream[0].rstrip("/").removesuffix("/v1"), "", returns_token_ids=False)
        else:
            engine = start_or_attach(model=options.model(args), upstream=(args.upstream or [None])[0],
                                     run_dir=args.run_dir, max_model_len=args.max_model_len,
                                     extra_args=engine_args, **options.parsers(args))
    except (TaskError, JudgeError, EngineError, ValueError, SchemaVersionError, duckdb.IOException,
            SandboxError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return _run_tasks(args, tasks, config, engine, sampling=sampling, interceptor=interceptor, roles=roles,
                      settings=settings)[0]


def _sandbox_settings(args, tasks) -> dict:
    """RunConfig's sandbox fields from `harness run`'s options; the sandbox backend checked usable here, and
    Harbor tasks refused a run on the host."""
    from harness.running import harbor
    from harness.sandbox import open_backend

    harbor_tasks = [t.task_id for t in tasks if harbor.is_harbor(t)]
    if harbor_tasks and args.sandbox == "none":
        raise ValueError(f"--sandbox none: Harbor tasks ({', '.join(harbor_tasks[:3])}...) run only in a sandbox, "
                         "where the agent cannot see their tests; leave --sandbox out (bwrap) or give --sandbox bwrap")
    if harbor_tasks and args.judge:
        raise ValueError(f"--judge {args.judge}: Harbor tasks are judged by their own tests/test.sh; leave --judge "
                         "out")
    sandbox = None if args.sandbox in (None, "none") else args.sandbox
    if sandbox or harbor_tasks:
        open_backend(sandbox or "bwrap")  # bwrap missing: one line saying how to install it
    blocked = tuple(c.strip() for c in args.blocked_commands.split(",") if c.strip())
    for path in args.sandbox_bind:
        if not Path(path).exists():
            raise ValueError(f"--sandbox-bind {path}: no such file or directory")
    return {"sandbox": sandbox, "sandbox_binds": tuple(str(Path(p).resolve()) for p in args.sandbox_bind),
            "blocked_commands": blocked, "keep_workspaces": args.keep_workspaces}


def _run_oracle(args) -> int:
    """`harness run --agent oracle`: every Harbor task's solution/solve.sh as its agent, no engine (it makes no
    calls); the report says which tasks' oracles do not score 1."""
    from harness.running import harbor
    from harness.running.runner import RunConfig
    from harness.running.tasks import TaskError, read_tasks
    from harness.running.vllm_server import Engine
    from harness.sandbox import SandboxError

    if args.agent is not None or args.cmd is not None:
        print("error: --agent oracle runs each task's solution/solve.sh: give no AGENT file and no --cmd",
              file=sys.stderr)
        return 2
    try:
        tasks = read_tasks(args.data, split=args.split, limit=args.limit)
        if not tasks:
            raise TaskError(f"{args.data!r} has no tasks in split {args.split!r}")
        if others := [t.task_id for t in tasks if not harbor.is_harbor(t)]:
            raise TaskError(f"--agent oracle runs Harbor tasks' solution/solve.sh; {args.data!r} holds other tasks "
                            f"({', '.join(others[:3])})")
        config = RunConfig(command=list(harbor.ORACLE_COMMAND), judge=None, repeat=args.repeat,
                           concurrency=args.concurrency, timeout_s=args.timeout, retries=0,
                           memory_mb=args.agent_memory_mb or None, max_procs=args.agent_max_procs or None,
                           oracle=True, **_sandbox_settings(args, tasks))
    except (TaskError, ValueError, SandboxError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine = Engine("http://127.0.0.1:9", "oracle", returns_token_ids=False)  # never called: the oracle asks nothing
    status, run_id = _run_tasks(args, tasks, config, engine, sampling=None, interceptor=None, roles=(),
                                settings=options.proxy_settings(args))
    if status == 0:
        from harness.store.database import Store

        store = Store.open(args.run_dir / "harness.duckdb", read_only=True)
        try:
            rows = store.query("SELECT o.task_id, o.status, j.reward, coalesce(j.error, o.error) FROM "
                               "episode_outcomes o LEFT JOIN judgements j USING (episode_id) WHERE o.run_id = ? "
                               "ORDER BY 1", [run_id]).rows
        finally:
            store.close()
        failing = [r for r in rows if r[2] != 1.0]
        for task_id, outcome, reward, why in failing:
            print(f"oracle: task {task_id!r} scored {reward} ({outcome}): {why or 'its tests failed'}",
                  file=sys.stderr)
        print(f"oracle: {len(rows) - len(failing)} of {len(rows)} tasks score 1", file=sys.stderr)
        status = 1 if failing else 0
    return status


def _run_tasks(args, tasks, config, engine, *, sampling, interceptor, roles, settings) -> tuple[int, str | None]:
    """Run `tasks` on the proxy's loop, print the report; (exit status, run id)."""
    from harness.running.dataset import run_dataset
    from harness.running.report import print_report
    from proxy.server import run as run_on_proxy_loop

    try:
        print(f"running {len(tasks)} tasks x {args.repeat} against {engine.base_url}", file=sys.stderr)
        run_id, report = run_on_proxy_loop(run_dataset(
            tasks, config, engine, args.run_dir, success_threshold=args.success_threshold, sampling=sampling,
            token_exact=not args.no_token_exact, reasoning_history=args.reasoning_history, progress=not args.debug,
            interceptor=interceptor, roles=roles, more_upstreams=tuple((args.upstream or [])[1:]),
            record_only=args.record_only, upstream_key_env=args.upstream_key_env, proxy_settings=settings),
            spawns=True)  # the runner starts the agents on the proxy's loop
    except options.hop_errors(interceptor) as exc:  # the transparent hop could not start
        print(f"error: {exc}", file=sys.stderr)
        return 1, None
    finally:
        engine.stop()
    print_report(report, run_id)
    print(f"recorded into {args.run_dir / 'harness.duckdb'}; report: {args.run_dir / f'report-{run_id}.json'}",
          file=sys.stderr)
    if report.get("interrupted"):
        print("interrupted: the report covers the episodes that ran; everything recorded was kept", file=sys.stderr)
        return 130, run_id
    return 0, run_id


def _at_least_one(option: str):
    """An argparse type for a count that must be 1 or more: 0 or less is refused naming the option (exit 2)."""
    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: give {option} N, N >= 1") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{value} is less than 1: give {option} N, N >= 1, or leave it out "
                                             "for every task")
        return value
    return count


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
