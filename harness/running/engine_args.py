"""The extra vLLM arguments a user gives the engine harness starts: `--engine-args` on `harness serve` and `harness
run`, `rollout.engine.extra_args` for `harness train`. They are appended as they are to the command line
`start_vllm` builds (vllm_server.engine_command), after one check, the same for all three verbs: the flags harness
sets itself, which the proxy and the trainer rely on, are refused with the harness setting to use instead, and a
`--gpu-memory-utilization` must be a share in (0, 1].

Pure stdlib: the CLI and trainer/config/checks.py import it without torch.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Literal

__all__ = ["OWNED_FLAGS", "Where", "check_engine_args", "gpu_memory_share", "split_engine_args"]

# Where the arguments were given; it picks the words of the errors (a harness option, or a config key).
Where = Literal["--engine-args", "rollout.engine.extra_args"]

# The flags engine_command sets from harness's own settings: given again, the engine would disagree with the proxy
# or the trainer. Each: why harness owns it (or ""), then what to use instead on the command line (harness serve
# and run) and in a training config ("" where there is nothing to use).
OWNED_FLAGS: dict[str, tuple[str, str, str]] = {
    "--model": ("", "use the --model option", "set model.path"),
    "--served-model-name": ("the model's directory name or Hub id; the proxy sends every call to it, whatever "
                            "model the agent names", "", ""),
    "--host": ("127.0.0.1, behind the proxy", "to run the engine your way, start it yourself and give --upstream URL",
               "to run the engine your way, start it yourself and set rollout.engine.url"),
    "--port": ("a free port, behind the proxy", "to run the engine your way, start it yourself and give --upstream "
               "URL", "to run the engine your way, start it yourself and set rollout.engine.url"),
    "--max-model-len": ("", "use the --max-model-len option", "set rollout.engine.max_model_len"),
    "--enable-auto-tool-choice": ("", "use the --tool-parser option", "set rollout.tool_parser"),
    "--tool-call-parser": ("", "use the --tool-parser option", "set rollout.tool_parser"),
    "--reasoning-parser": ("", "use the --reasoning-parser option", "set rollout.reasoning_parser"),
    "--logprobs-mode": ("processed_logprobs: the logprobs after temperature, which the trainer recomputes", "", ""),
    "--api-key": ("none: harness and its proxy call the engine without one, on 127.0.0.1 only", "", ""),
}


def split_engine_args(texts: Sequence[str]) -> list[str]:
    """The arguments of each `--engine-args STRING`, split like a shell splits them, in order; a ValueError names a
    string a shell could not split (an open quote)."""
    args = []
    for text in texts:
        try:
            args += shlex.split(text)
        except ValueError as exc:
            raise ValueError(f"--engine-args {text!r}: {exc}: check its quotes") from None
    return args


def check_engine_args(args: object, where: Where) -> list[str]:
    """`args` as extra vLLM arguments for start_vllm (a list of strings, one command-line token each, `--flag
    value` or `--flag=value`), or a one-line ValueError that names the flag and what to use instead."""
    if isinstance(args, str) or not isinstance(args, (list, tuple)):
        raise ValueError(f"{where} must be a list of vLLM's command-line arguments, one string each, e.g. "
                         f"['--max-num-seqs', '64'], got {args!r}")
    for arg in args:
        if not isinstance(arg, str):
            raise ValueError(f"{where}: {arg!r} is not a string: give each of vLLM's arguments as text, e.g. "
                             f"'{arg}'")
        owned = OWNED_FLAGS.get(_flag(arg))
        if owned is not None:
            why, cli, config = owned
            instead = cli if where == "--engine-args" else config
            raise ValueError(f"{where}: harness sets {_flag(arg)} itself{f' ({why})' if why else ''}"
                             f"{f': {instead} instead' if instead else ''}")
    gpu_memory_share(args, where)
    return list(args)


def gpu_memory_share(args: Sequence[str], where: Where) -> float | None:
    """The share of its GPU's memory that `--gpu-memory-utilization` in `args` gives the engine (the last one wins,
    as in vLLM), None without one; a ValueError for a value that is not a number in (0, 1]."""
    share = None
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if _flag(name) != "--gpu-memory-utilization":
            continue
        better = "; better, set rollout.engine.gpu_memory_utilization" if where != "--engine-args" else ""
        if not eq and i + 1 == len(args):
            raise ValueError(f"{where}: --gpu-memory-utilization needs a value, the engine's share of its GPU's "
                             f"memory in (0, 1], e.g. 0.8{better}")
        value = value if eq else args[i + 1]
        try:
            share = float(value)
        except ValueError:
            share = None
        if share is None or not 0 < share <= 1:
            raise ValueError(f"{where}: --gpu-memory-utilization {value!r} must be a number in (0, 1], the engine's "
                             f"share of its GPU's memory, e.g. 0.8{better}")
    return share


def _flag(arg: str) -> str:
    """The flag an argument names, as vLLM reads it (`--max_model_len=8` is `--max-model-len`); "" for a value."""
    if not arg.startswith("--"):
        return ""
    name = arg.partition("=")[0]
    head, dot, rest = name[2:].partition(".")  # vLLM: dashes for underscores up to the first dot
    return "--" + head.replace("_", "-") + dot + rest
