"""engine.log, as harness writes and reads it: each engine start appends its part after a header line, and a
start that is still waiting shows the engine's latest word from it."""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["last_log_line", "log_header"]


def log_header(args: Sequence[str]) -> str:
    """The line that opens an engine's part of engine.log: `harness serve` and `harness run` (and every restart)
    append to the same file, each part saying when, by which command, and what was started."""
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    by = " ".join(["harness", *sys.argv[1:2]]) if sys.argv[1:2] else Path(sys.argv[0]).name
    model = args[args.index("--model") + 1] if "--model" in args else "?"
    return f"\n===== {when}: `{by}` (pid {os.getpid()}) starts vLLM on {model} =====\n"


_LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\)\s*)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+[\d-]+ [\d:.]+\s+"
                         r"(\[[^\]]*\]\s*)?")  # "(APIServer pid=7) INFO 12-02 00:12:34 [api_server.py:1] "
_SHOWN_CHARS = 100


def last_log_line(text: str) -> str:
    """The engine's latest word in `text` (its log): the last non-empty line, or the last state of a progress bar
    redrawn with carriage returns, without vLLM's level, date and source prefix; shortened to _SHOWN_CHARS."""
    for line in reversed(text.splitlines()):
        line = next((part for part in reversed(line.split("\r")) if part.strip()), "")
        line = _LOG_PREFIX.sub("", line.strip()).strip()
        if line:
            return line if len(line) <= _SHOWN_CHARS else line[:_SHOWN_CHARS - 1] + "…"
    return ""
