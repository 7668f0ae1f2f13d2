"""`harness run`: an unmodified agent over a dataset (or `--agent oracle` over Harbor tasks), judged and reported."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.cli import options
from harness.running.limits import AGENT_MAX_PROCS, AGENT_MEMORY_MB


def add_parser(verbs) -> None:
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
                   help="writable-memory cap (RLIMIT_DATA) of each agent process in MB; 0: none (default: %(default)s)")
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
