"""`harness parsers`: vLLM's tool-call and reasoning parsers, with the model families each is for, and with --model
the ones that load with that model's tokenizer. The names are what `--tool-parser` / `--reasoning-parser`
(`rollout.tool_parser` / `rollout.reasoning_parser`) take; `harness doctor` then checks one against the model's
chat template."""

from __future__ import annotations

import json
import logging
import sys

from harness import install_hint
from proxy.parsing.families import REASONING_PARSER_FAMILIES, TOOL_PARSER_FAMILIES

__all__ = ["add_parser"]


def add_parser(verbs) -> None:
    p = verbs.add_parser(
        "parsers", help="list the tool-call and reasoning parsers, with the model families each is for",
        description="List the names --tool-parser and --reasoning-parser take (vLLM's --tool-call-parser and "
        "--reasoning-parser), each with the model families it is for. With --model, only those that load with that "
        "model's tokenizer (vLLM checks a parser's tokens against it); then `harness doctor --model M --tool-parser "
        "NAME` checks that a parser reads back the turns the model's chat template writes.",
    )
    p.add_argument("--model", help="a model directory, or a Hugging Face id (its tokenizer files only): list only the "
                   "parsers that load with its tokenizer")
    p.add_argument("--json", action="store_true", help='print {"tool": {name: families}, "reasoning": {...}}')
    p.set_defaults(func=_parsers)


def _parsers(args) -> int:
    quiet_vllm_info()
    tools, reasonings = dict(TOOL_PARSER_FAMILIES), dict(REASONING_PARSER_FAMILIES)
    if args.model is not None:
        try:
            loading = _loading(args.model)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        tools = {k: v for k, v in tools.items() if k in loading[0]}
        reasonings = {k: v for k, v in reasonings.items() if k in loading[1]}
    if args.json:
        print(json.dumps({"tool": tools, "reasoning": reasonings}, indent=2, ensure_ascii=False))
        return 0
    which = f" that load with the tokenizer of {args.model}" if args.model else ""
    for title, table in ((f"tool parsers{which} (--tool-parser, rollout.tool_parser)", tools),
                         (f"reasoning parsers{which} (--reasoning-parser, rollout.reasoning_parser)", reasonings)):
        print(f"{title}:")
        width = max((len(name) for name in table), default=0)
        for name, families in table.items():
            print(f"  {name:<{width}}  {families}")
        if not table:
            print("  none")
    return 0


def _loading(model: str) -> tuple[list[str], list[str]]:
    """The parsers that load with `model`'s tokenizer; a ValueError without vLLM or for a model that is not there."""
    from harness.running.hub import local_model
    from proxy.parsing import vllm_available

    directory = local_model(model, "--model", files="tokenizer")
    if not vllm_available():
        raise ValueError("--model needs vLLM installed here, whose parsers are checked against the tokenizer: "
                         f"{install_hint('engine')}, or leave --model out to list every parser")
    from proxy.parsing.vllm import loading_parsers

    return loading_parsers(directory)


def _no_vllm_info(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or not record.name.startswith("vllm")


def quiet_vllm_info() -> None:
    """Leave vLLM's INFO lines out of this command's log (importing it on CPU says Triton is missing; loading a tool
    parser says auto tool choice is on): they say nothing to someone checking parsers or a template. One filter
    object, so calling this again (main() in one process, as the tests do) adds nothing."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(_no_vllm_info)
