"""Summarise py-spy raw (collapsed) stacks recorded with --threads --full-filenames (line numbers kept).

    python -m bench.profile_stacks FILE [--top 25] [--query 'func@file' ...]   (files of bench/proxy_profile.py)

Self time: the innermost Python frame of a sample (C calls such as os.write, orjson.dumps, socket.send count in the
Python function calling them). Cumulative: samples whose stack holds the function at least once. Functions are
keyed by file and the line of their `def` (found with ast), shown as file:defline; percentages are of all the
process's samples (every thread; py-spy drops idle samples: a loop waiting in epoll, the recorder waiting).
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
from collections import Counter
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*):(?P<line>\d+)\)$")


@functools.cache
def _defs(path: str) -> list[tuple[int, int, int]]:
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            out.append((start, node.end_lineno, node.lineno))
    return out


def def_line(path: str, line: int) -> int:
    best = None
    for start, end, lineno in _defs(path):
        if start <= line <= end and (best is None or start >= best[0]):
            best = (start, lineno)
    return best[1] if best else line


def short(path: str) -> str:
    for marker in (f"{ROOT}/", "/site-packages/", "/lib/python3.11/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


IDLE = {("_worker", "concurrent/futures/thread.py"), ("Condition.wait", "threading.py"),
        ("EpollSelector.select", "selectors.py"), ("Event.wait", "threading.py")}  # blocking waits py-spy counts


def idle(frames) -> bool:
    return bool(frames) and any(frames[-1][0] == f and frames[-1][1].endswith(p) for f, p in IDLE)


def parse(path: str):
    """[(thread, [(func, file, line)], count)], blocking waits left out"""
    out = []
    for raw in Path(path).read_text().splitlines():
        stack, _, count = raw.rpartition(" ")
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1] if frames[0].startswith("thread") else "?"
        parsed = []
        for f in frames[1:]:
            m = FRAME.match(f)
            if m:
                parsed.append((m["func"], m["file"], int(m["line"])))
            else:
                parsed.append((f, "?", 0))
        if not idle(parsed):
            out.append((thread, parsed, int(count)))
    return out


def key(frame) -> str:
    func, file, line = frame
    return f"{func} ({short(file)}:{def_line(file, line)})"


def summarise(samples, top: int) -> str:
    total = sum(c for _, _, c in samples)
    threads = Counter()
    own, own_line, cum = Counter(), Counter(), Counter()
    for thread, frames, count in samples:
        threads[thread] += count
        if not frames:
            continue
        own[key(frames[-1])] += count
        f = frames[-1]
        own_line[f"{f[0]} ({short(f[1])}:{f[2]})"] += count
        for k in {key(fr) for fr in frames}:
            cum[k] += count
    lines = [f"samples: {total}; by thread: " + ", ".join(f"{t} {n / total:.1%}" for t, n in threads.most_common())]
    lines.append(f"\ntop {top} by own (self) time, % of all samples:")
    lines += [f"  {n / total:6.1%}  {k}" for k, n in own.most_common(top)]
    lines.append(f"\ntop {top} lines by own time:")
    lines += [f"  {n / total:6.1%}  {k}" for k, n in own_line.most_common(top)]
    lines.append(f"\ntop {top} by cumulative time (asyncio/aiohttp plumbing above the handler included):")
    lines += [f"  {n / total:6.1%}  {k}" for k, n in cum.most_common(top + 15)]
    return "\n".join(lines)


def share(samples, *needles: str, leaf: str | None = None) -> float:
    """Share of samples whose stack holds every needle (substring of a frame's func or 'func@file'), in that order,
    and (with `leaf`) whose innermost frame matches `leaf` (func name or func:line)."""
    total = hit = 0
    for _, frames, count in samples:
        total += count
        names = [f"{f[0]}@{short(f[1])}:{f[2]}" for f in frames]
        i = 0
        for name in names:
            if i < len(needles) and needles[i] in name:
                i += 1
        if i < len(needles):
            continue
        if leaf is not None and not (frames and leaf in names[-1]):
            continue
        hit += count
    return hit / total if total else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--query", action="append", default=[], help="needle[>needle...][|leaf]")
    args = ap.parse_args()
    samples = parse(args.file)
    print(summarise(samples, args.top))
    if args.query:
        print("\nqueries:")
    for q in args.query:
        path, _, leaf = q.partition("|")
        print(f"  {share(samples, *path.split('>'), leaf=leaf or None):6.1%}  {q}")


if __name__ == "__main__":
    main()
