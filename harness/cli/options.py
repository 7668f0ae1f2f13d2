"""Flag groups shared by several `harness` verbs: the engine (run, serve), named roles (run, serve), record-only
(run, serve), transparent mode (run, serve), and the port a server listens on (serve, view)."""

from __future__ import annotations

import argparse
import errno
import functools
import os
import socket
from pathlib import Path

from proxy.parsing.native import check_reasoning_parser, check_tool_parser

DEFAULT_RUN_DIR = Path("runs")


def add_sampling_args(p) -> None:
    p.add_argument("--temperature", type=float, help="training-time override of the agents' temperature")
    p.add_argument("--top-p", type=float, help="training-time override of the agents' top_p")
    p.add_argument("--max-tokens-cap", type=int, help="cap on the agents' max_tokens (Claude Code asks for 128000: "
                   "cap it so the engine's context holds the prompt and the reply)")


def sampling(args):
    """The proxy's SamplingOverrides from add_sampling_args' options (ValueError for bad values)."""
    from proxy import SamplingOverrides

    return SamplingOverrides(args.temperature, args.top_p, args.max_tokens_cap)


def add_role_args(p) -> None:
    g = p.add_argument_group("roles (multi-agent apps: name roles, send frozen ones to a fixed model)")
    g.add_argument("--role", action="append", default=[], metavar="NAME=MATCH",
                   help="name a role: MATCH is model:NAME, system:REGEX or key:FINGERPRINT (as `harness roles` "
                   "prints it); the first match wins, e.g. --role critic=model:critic-model")
    g.add_argument("--role-upstream", action="append", default=[], metavar="NAME=URL",
                   help="send a named role's calls to this OpenAI-compatible server (a fixed model) instead of the "
                   "policy engine, e.g. --role-upstream critic=https://api.openai.com/v1")
    g.add_argument("--role-model", action="append", default=[], metavar="NAME=MODEL",
                   help="the model name sent to that upstream (default: the one the agent asked for)")
    g.add_argument("--role-key-env", action="append", default=[], metavar="NAME=ENV",
                   help="environment variable holding that upstream's API key (read at each call, never recorded)")


def role_rules(args):
    """The role rules --role and its kin give; with --trained, the trained run's own (and --role is refused)."""
    from proxy.roles import parse_assignments, parse_rules

    if run := trained(args):
        given = [flag for flag, value in (("--role", args.role), ("--role-upstream", args.role_upstream),
                                          ("--role-model", args.role_model), ("--role-key-env", args.role_key_env))
                 if value]
        if given:
            raise ValueError(f"{given[0]} with --trained: the run's roles are served as it trained them "
                             f"({run.run_dir / 'config.resolved.yaml'}, roles); drop {given[0]}")
        return run.roles
    return parse_rules(parse_assignments(args.role, "--role"), parse_assignments(args.role_upstream, "--role-upstream"),
                       parse_assignments(args.role_model, "--role-model"),
                       parse_assignments(args.role_key_env, "--role-key-env"))


def add_limit_args(p) -> None:
    g = p.add_argument_group("limits, the degenerate-output guard (docs/training.md; findings: the flags view) and "
                             "hosted tools")
    g.add_argument("--max-turns", type=int, metavar="N",
                   help="LLM calls an episode may make: the next gets a 400 (episode_ended) and the cut is recorded")
    g.add_argument("--guard", action="store_true",
                   help="flag completions that repeat themselves (share of repeated 4-grams over 0.5, 32 tokens "
                   "or more) as degenerate")
    g.add_argument("--guard-end-episode", action="store_true",
                   help="with --guard: a degenerate completion ends its episode (its later calls get a 400)")
    g.add_argument("--hosted-tools", choices=("leave_out", "refuse"), default="leave_out",
                   help="hosted tools a Responses call offers (web_search, file_search, ...; the engine runs none): "
                   "leave_out serves the call without them and records which (calls.extra.tools_left_out); refuse "
                   "answers 400 naming the tool (default: %(default)s)")


def engine_required(args) -> str | None:
    """The error when none of --model, --trained, --upstream is given, as argparse says it; None when one is."""
    if args.model is None and args.trained is None and not args.upstream:
        return "one of the arguments --model --trained --upstream is required"
    return None


def proxy_settings(args) -> dict:
    """ProxyConfig's max_turns, guard and hosted_tools from add_limit_args' options (ValueError for bad values),
    and with --trained its policy_models: each trained policy's calls go to its adapter from the first call."""
    from proxy.guard import GuardConfig

    if args.max_turns is not None and args.max_turns < 1:
        raise ValueError(f"--max-turns {args.max_turns} must be a positive number of calls per episode")
    if args.guard_end_episode and not args.guard:
        raise ValueError("--guard-end-episode acts on what the guard finds: add --guard")
    return {"max_turns": args.max_turns, "guard": GuardConfig(enabled=args.guard, end_episode=args.guard_end_episode),
            "hosted_tools": args.hosted_tools, "policy_models": run.policy_models if (run := trained(args)) else {}}


def add_record_only_args(p) -> None:
    g = p.add_argument_group("record-only (in front of a hosted API: docs/export.md)")
    g.add_argument("--record-only", action="store_true",
                   help="in front of any OpenAI-compatible API (a hosted one, given by --upstream): forward each call "
                   "as the agent sent it (its model name, sampling and API key; the key is never stored) and record "
                   "it, as text where the API gives no token ids")
    g.add_argument("--upstream-key-env", metavar="NAME",
                   help="with --record-only: the environment variable holding the API key sent upstream for calls "
                   "that carry the proxy's own token or no key (agents harness run starts carry episode tokens)")


def record_only_error(args) -> str | None:
    """What is wrong with the record-only flags given with the others, or None."""
    if args.upstream_key_env and not args.record_only:
        return "--upstream-key-env goes with --record-only"
    if not args.record_only:
        return None
    if not args.upstream or len(args.upstream) > 1:
        return "--record-only needs exactly one --upstream URL: the API to record, e.g. https://api.openai.com/v1"
    if args.upstream_key_env and not os.environ.get(args.upstream_key_env):
        return f"--upstream-key-env {args.upstream_key_env}: that environment variable is not set"
    ours = [flag for flag, value in (("--temperature", args.temperature), ("--top-p", getattr(args, "top_p", None)),
                                     ("--max-tokens-cap", getattr(args, "max_tokens_cap", None)))
            if value is not None] + (["--transparent"] if args.transparent else [])
    if ours:
        return (f"{', '.join(ours)}: --record-only forwards each call as the agent sent it; drop "
                f"{'it' if len(ours) == 1 else 'them'}")
    return None


def add_transparent_args(p) -> None:
    g = p.add_argument_group("transparent mode (agents that hard-code an LLM host)")
    g.add_argument("--transparent", action="store_true",
                   help="put an embedded mitmproxy in front of the agents: calls to known LLM hosts (api.openai.com, "
                   "DashScope compatible mode, DeepSeek, api.anthropic.com, and --llm-host) are recorded like "
                   "calls to OPENAI_BASE_URL; other hosts are tunnelled untouched")
    g.add_argument("--llm-host", action="append", default=[], metavar="HOST[/PREFIX]",
                   help="one more LLM host to intercept, with its API prefix (default /v1), "
                   "e.g. llm.corp.example/api/v1")
    g.add_argument("--refuse-other-hosts", action="store_true",
                   help="with --transparent: refuse traffic to any other host instead of tunnelling it")


def hop_errors(interceptor) -> tuple[type[Exception], ...]:
    return (interceptor.Error,) if interceptor is not None else ()


def interceptor(args, run_dir: Path):
    """The transparent hop the flags ask for (not started), or None."""
    if not args.transparent:
        if args.llm_host or args.refuse_other_hosts:
            raise ValueError("--llm-host and --refuse-other-hosts need --transparent")
        return None
    from proxy.transparent import Interceptor, TransparentOptions

    options = TransparentOptions(llm_hosts=tuple(args.llm_host), refuse_other=args.refuse_other_hosts)
    return Interceptor(options, log_path=run_dir / "transparent.log")


def add_engine_args(p, *, required: bool = True) -> None:
    """The engine options; `required=False` where a command can run without one (`harness run --agent oracle`),
    which then says itself that one is needed (`engine_required`)."""
    src = p.add_mutually_exclusive_group(required=required)
    src.add_argument("--model", help="model to serve with vLLM (started as a subprocess): a model directory, or a "
                     "Hugging Face id such as Qwen/Qwen2.5-1.5B-Instruct, taken from the local cache or downloaded "
                     "into it")  # a str, not a Path: Path("./org/name") would drop the "./" that makes it a path
    src.add_argument("--trained", type=Path, metavar="RUN_DIR",
                     help="serve what the harness train run in RUN_DIR (<logging.run_dir>/<experiment_name>) trained: "
                     "its model, its adapter, or one adapter per policy (roles.policies), each role's calls sent to "
                     "its policy's under the run's own role rules; calls record the adapter as served_model "
                     "(<policy>-lora-<run>)")
    src.add_argument("--upstream", action="append", metavar="URL",
                     help="URL of an engine already running, e.g. http://127.0.0.1:8000; repeat it for several "
                     "engines serving the same model (an episode stays on one; a failed engine's calls move on)")
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="context length of an engine started with --model, prompt and completion together, as "
                   "harness train's rollout.engine.max_model_len (default: %(default)s)")
    p.add_argument("--engine-args", action="append", default=[], metavar="STRING",
                   help="more vLLM command-line arguments for the engine started with --model, split like a shell "
                   "splits them and appended to its command line, as harness train's rollout.engine.extra_args, e.g. "
                   "--engine-args \"--gpu-memory-utilization 0.8 --tensor-parallel-size 2\"; repeatable. Write one "
                   "flag alone as --engine-args=--enforce-eager. Flags harness sets itself (--model, --port, "
                   "--max-model-len, --tool-call-parser, ...) are refused with the option to use instead")
    p.add_argument("--no-token-exact", action="store_true",
                   help="render every chat call with the engine's chat template instead of continuing conversations "
                   "from the recorded token ids (docs/proxy.md: token-exact continuity)")
    p.add_argument("--tool-parser", default="hermes", metavar="NAME",
                   help="how the model writes tool calls: a name vLLM's --tool-call-parser takes (hermes: Qwen2.5, "
                   "Qwen3, Hermes; qwen3_xml: Qwen3-Coder; llama3_json; mistral; pythonic; deepseek_v3; glm45; "
                   "kimi_k2; ...). The engine is started with it and the proxy parses token-exact answers with it "
                   "(default: %(default)s; docs/proxy.md lists them)")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="how the model writes its reasoning: a name vLLM's --reasoning-parser takes (qwen3, "
                   "deepseek_r1, glm45, ...); answers then carry it as `reasoning`, apart from the content "
                   "(default: none)")
    p.add_argument("--reasoning-history", default="as_rendered", choices=("as_rendered", "keep"),
                   help="when the chat template leaves a reply's reasoning out of the history it renders (Qwen3, at "
                   "a new user message): as_rendered starts a new sample on the history as rendered, so the model "
                   "is trained on what it is served; keep continues token-exactly with the sampled reasoning kept "
                   "(one sample per episode; docs/proxy.md) (default: %(default)s)")


def engine_args(args) -> list[str]:
    """The extra vLLM arguments --engine-args gives, checked as train's rollout.engine.extra_args are (a ValueError
    names a flag harness sets itself, or engine arguments for an engine already running)."""
    from harness.running.engine_args import check_engine_args, split_engine_args

    if args.engine_args and args.upstream:
        raise ValueError("--engine-args go to the engine harness starts with --model; with --upstream the engine "
                         "is already running: start it with them yourself, or drop --engine-args")
    given = check_engine_args(split_engine_args(args.engine_args), "--engine-args")
    run = trained(args)
    return [*run.engine_args(), *given] if run else given  # the user's flags last: a --max-loras of theirs wins


def model(args) -> str | None:
    """The model the engine starts on: --model, or the model --trained's run serves (None: --upstream)."""
    run = trained(args)
    return run.model if run else args.model


def trained(args):
    """The trained run --trained names (harness/cli/trained.py Trained), read once; None without --trained.
    A ValueError names what the run lacks."""
    path = getattr(args, "trained", None)
    return None if path is None else _read_trained(str(path))


@functools.lru_cache(maxsize=4)
def _read_trained(path: str):
    from harness.cli.trained import read_trained

    return read_trained(path)


def parsers(args) -> dict:
    """The engine's reply parsers from --tool-parser and --reasoning-parser (a ValueError names a bad one)."""
    return {"tool_parser": check_tool_parser(args.tool_parser),
            "reasoning_parser": check_reasoning_parser(args.reasoning_parser)}


def port_number(text: str) -> int:
    """argparse's type for --port: a TCP port, 0 for a free one; anything else is refused at parse time, naming
    the value (the socket layer's OverflowError, raised once the server starts, names none)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number: give 1-65535, or 0 for a free one") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number: give 1-65535, or 0 for a free one")
    return port


def listen_error(host: str, port: int) -> str | None:
    """Why a server could not listen on `host` port `port`, or None. Found by binding each address `host` resolves
    to for a moment, as asyncio's create_server binds them (SO_REUSEADDR; IPv6 sockets IPv6-only), so a verb
    refuses a taken port before it spends minutes starting an engine."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"--host {host!r} is not an address of this machine ({exc.strerror}): give one, e.g. 127.0.0.1"
    for family, kind, proto, _, address in dict.fromkeys(addresses):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                return bind_failure(host, port, exc)
    return None


def bind_failure(host: str, port: int, exc: OSError) -> str:
    """One line for a server's failed bind, naming the address and what to do (also for a bind that fails after
    listen_error passed: another process took the port in between)."""
    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is in use (another process listens on it): pass --port N or stop the other "
                "process")
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"--host {host} is not an address of this machine: give one it has, e.g. 127.0.0.1 or 0.0.0.0"
    if exc.errno == errno.EACCES:
        return f"port {port} on {host} needs privileges this user lacks: pass --port N above 1023"
    return f"cannot listen on {host} port {port} ({exc.strerror or exc}): pass another --host or --port"
