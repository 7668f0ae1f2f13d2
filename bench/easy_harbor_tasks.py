"""Easy Harbor tasks a 135M model can do in one shell command, with held-out ones: for bench/coding_agent_learns.py.

    .venv/bin/python bench/easy_harbor_tasks.py DIR [--train 24] [--test 8]

Four kinds (make a file with a word in it, make a directory, rename a file, delete a file), each verified by its own
tests/test.sh with partial credit (the file made but with other words in it: 0.5), each with an oracle. The test
tasks (`[metadata] split = "test"`) use names and words no training task uses.
"""

from __future__ import annotations

import argparse
import itertools
import random
import shutil
from pathlib import Path

TRAIN_NAMES = ["notes", "hello", "report", "todo", "result", "draft", "list", "data", "log", "summary", "memo",
               "plan"]
TRAIN_WORDS = ["apple", "river", "green", "seven", "cloud", "stone", "music", "light", "table", "paper", "ocean",
               "tiger"]
TEST_NAMES = ["answer", "output", "record", "ticket"]
TEST_WORDS = ["lemon", "piano", "silver", "forest"]

TOML = """version = "1.0"

[metadata]
category = "{kind}"
split = "{split}"

[agent]
timeout_sec = 180

[verifier]
timeout_sec = 30
"""
DOCKERFILE = "FROM debian:bookworm-slim\nWORKDIR /app\n{copy}"


def _task(kind: str, name: str, word: str, other: str) -> tuple[str, dict[str, str], str, str]:
    """(instruction, the workspace's files, test.sh's check, the oracle's command) of one task."""
    if kind == "write":
        return (f"Create a file named {name}.txt in the current directory that contains the word {word}.", {},
                f'got=$(tr -s "[:space:]" " " < {name}.txt 2>/dev/null | sed "s/^ //; s/ $//")\n'
                f'if [ "$got" = "{word}" ]; then r=1; elif [ -f {name}.txt ]; then r=0.5; else r=0; fi',
                f"echo {word} > {name}.txt")
    if kind == "mkdir":
        return (f"Create a directory named {name} in the current directory.", {},
                f"if [ -d {name} ]; then r=1; elif [ -e {name} ]; then r=0.5; else r=0; fi", f"mkdir {name}")
    if kind == "rename":
        return (f"Rename the file {name}.txt in the current directory to {other}.txt.", {f"{name}.txt": f"{word}\n"},
                f'if [ -f {other}.txt ] && [ ! -e {name}.txt ] && [ "$(cat {other}.txt)" = "{word}" ]; then r=1\n'
                f"elif [ -f {other}.txt ]; then r=0.5; else r=0; fi", f"mv {name}.txt {other}.txt")
    if kind == "delete":
        return (f"Delete the file {name}.txt in the current directory, and keep {other}.txt.",
                {f"{name}.txt": f"{word}\n", f"{other}.txt": "keep me\n"},
                f"if [ ! -e {name}.txt ] && [ -f {other}.txt ]; then r=1; elif [ ! -e {name}.txt ]; then r=0.5\n"
                "else r=0; fi", f"rm {name}.txt")
    raise ValueError(f"unknown task kind {kind!r}")


KINDS = ("write", "mkdir", "rename", "delete")


def write_task(root: Path, task_id: str, split: str, kind: str, name: str, word: str, other: str) -> None:
    instruction, files, check, oracle = _task(kind, name, word, other)
    d = root / task_id
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution").mkdir()
    (d / "instruction.md").write_text(instruction + "\n")
    (d / "task.toml").write_text(TOML.format(kind=kind, split=split))
    for path, text in files.items():
        (d / "environment" / path).write_text(text)
    copy = "".join(f"COPY {path} {path}\n" for path in files)
    (d / "environment" / "Dockerfile").write_text(DOCKERFILE.format(copy=copy))
    (d / "tests" / "test.sh").write_text(f"#!/bin/bash\ncd /app\n{check}\necho $r > /logs/verifier/reward.txt\n")
    (d / "solution" / "solve.sh").write_text(f"#!/bin/bash\n{oracle}\n")
    for script in (d / "tests" / "test.sh", d / "solution" / "solve.sh"):
        script.chmod(0o755)


def make_tasks(root: Path, train: int = 24, test: int = 8, seed: int = 0) -> Path:
    """`train` training tasks and `test` held-out ones (the kinds in turn) in root, made afresh."""
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    rng = random.Random(seed)
    for split, count, names, words in (("train", train, TRAIN_NAMES, TRAIN_WORDS),
                                       ("test", test, TEST_NAMES, TEST_WORDS)):
        pairs = list(itertools.permutations(names, 2))
        rng.shuffle(pairs)
        for i in range(count):
            kind = KINDS[i % len(KINDS)]
            name, other = pairs[i % len(pairs)]
            write_task(root, f"{split}-{i:02d}-{kind}", split, kind, name, rng.choice(words), other)
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--train", type=int, default=24)
    parser.add_argument("--test", type=int, default=8)
    args = parser.parse_args()
    print(make_tasks(args.dir, args.train, args.test))


if __name__ == "__main__":
    main()
