"""Records into tasks, the same rules for every task source (harness/running/tasks.py, harness/running/hf_tasks.py):
ids, splits, duplicate ids, and the errors that name where a task came from."""

from __future__ import annotations

from collections.abc import Iterable

# Data directories: the file formats read, how a file's name gives its split, and when to stop looking.
DATA_FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}
DATASET_BUILDERS = {k: v for k, v in DATA_FILE_BUILDERS.items() if k != ".jsonl"}  # one file: .jsonl is ours


class TaskError(Exception):
    """A task source can't be read, or an environment service failed; the message says which and what to do."""


def task_id_of(obj: dict, fallback: str | None, where: str) -> str:
    """The task's own id ("id", else "task_id"), else the fallback (its position in the source)."""
    for key in ("id", "task_id"):
        if key in obj:
            value = obj[key]
            if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
                raise TaskError(f"{where}: {key!r} must be a non-empty string or an integer, got {value!r}")
            return str(value)
    if fallback is None:
        raise TaskError(f"{where}: has no \"task_id\"; every task needs one")
    return fallback


def split_of(obj: dict, where: str, default: str = "train") -> str:
    value = obj.get("split")
    if value is None:
        return default
    if not isinstance(value, str) or not value:
        raise TaskError(f"{where}: \"split\" must be a non-empty string, got {value!r}")
    return value


class UniqueIds:
    """Remembers where each task id was first seen, so a duplicate can name both places."""

    def __init__(self, source: str):
        self.source = source
        self.first: dict[str, str] = {}

    def add(self, task_id: str, place: str) -> None:
        if task_id in self.first:
            raise TaskError(f"{self.source}: task id {task_id!r} is used twice, on {self.first[task_id]} and on "
                            f"{place}; task ids must be unique")
        self.first[task_id] = place


def no_such_split(source: str, split: str, present: Iterable[str]) -> TaskError:
    names = ", ".join(repr(s) for s in sorted(present)) or "none"
    return TaskError(f"{source} has no tasks in split {split!r} (its splits: {names}); pass one of those as split")


def innermost_cause(exc: BaseException) -> str:
    """The innermost cause: datasets wraps the useful message ("missing field x") in a generic one."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}"
