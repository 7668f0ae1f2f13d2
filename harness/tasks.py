"""Task readers: turn whatever `--data` names into Task records, and hand each task to its agent.

One entry point, `read_tasks(source)`, so that `harness run`, the trainer and user scripts all accept the same
sources, told apart by their form:

    tasks.jsonl                            one JSON object per line
    data/  x.parquet  x.json  x.arrow      a Hugging Face `datasets` source (save_to_disk output or data files)
    org/name  org/name:config              a dataset on the Hugging Face Hub (needs the network, or its cache)
    http://host:port                       an environment service (docs/environments.md)
    module:function  path/to/file.py:function   a Python function that returns tasks

Environment services exist for tasks whose state lives outside the agent (a sandbox, a game, a database): each
episode gets an instance of its own (`instance_for`) and the service, not a local judge, says how well it went
(`evaluate_instance`). They are spoken to with stdlib urllib, synchronously: the core takes no extra dependency,
and the runner calls these from a worker thread.

`datasets` is an optional extra, imported only when a source needs it.
"""

from __future__ import annotations

import dataclasses
import http.client
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Iterable
from pathlib import Path

from harness.records import Task

__all__ = ["TaskError", "read_tasks", "instance_for", "evaluate_instance"]

ACCEPTED = (
    "a .jsonl file; a .parquet, .json or .arrow file; a directory saved with datasets' save_to_disk or holding "
    "data files; a Hugging Face Hub dataset name (org/name or org/name:config); an environment service URL "
    "(http://... or https://...); or a Python function as module:function or path/to/file.py:function"
)
# Suffixes that make a missing source read as a mistyped path rather than a Hub name.
_FILE_SUFFIXES = {".jsonl", ".json", ".parquet", ".arrow", ".csv", ".tsv", ".txt", ".gz", ".py"}
_FUNCTION_SPEC = re.compile(r"^(?P<module>[A-Za-z_][\w.]*|.+\.py):(?P<function>[A-Za-z_]\w*)$")
_HUB_NAME = re.compile(r"^(?P<name>[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?)(?::(?P<config>[\w.-]+))?$")
_HUB_PROBE_TIMEOUT_S = 3.0
# Data directories: the file formats read, how a file's name gives its split, and when to stop looking.
_DATA_FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}
_SHARD_NAME = re.compile(r"^(?P<split>\w+)-\d{5}-of-\d{5}\.")
_SPLIT_WORDS = {"train": "train", "training": "train", "validation": "validation", "valid": "validation",
                "dev": "validation", "val": "validation", "test": "test", "testing": "test", "eval": "test",
                "evaluation": "test"}
_MAX_DIR_ENTRIES = 10_000
_DATASET_BUILDERS = {k: v for k, v in _DATA_FILE_BUILDERS.items() if k != ".jsonl"}  # one file: .jsonl is ours


class TaskError(Exception):
    """A task source can't be read, or an environment service failed; the message says which and what to do."""


def read_tasks(source: str | os.PathLike, *, split: str = "train", limit: int | None = None) -> list[Task]:
    """The tasks of `split` in `source`, in source order, at most `limit` of them.

    A source that holds no tasks of `split` gives an empty list, except where the reader can name the splits it
    does hold: then a TaskError that lists them, since a typo in --split is the usual cause.
    """
    if limit is not None and limit < 0:
        raise TaskError(f"limit must be a number >= 0 (or None for all tasks), got {limit}")
    tasks = _read(os.fspath(source), split, limit)
    return tasks if limit is None else tasks[:limit]


def instance_for(task: Task, timeout_s: float = 30) -> dict:
    """The task object the agent is given.

    For a task of an environment service (its data carries "env_url") this creates a fresh instance, so that
    concurrent and repeated episodes of one task never share state; the agent gets the service's task object plus
    "instance_id" and "env_url", which it (and the judge) use to talk to that instance. Other tasks are given as
    they are.
    """
    env_url = task.data.get("env_url")
    if env_url is None:
        return task.data
    if not isinstance(env_url, str) or not env_url.startswith(("http://", "https://")):
        raise TaskError(f"task {task.task_id!r}: env_url must be an http(s) URL, got {env_url!r}")
    base = env_url.rstrip("/")
    url = f"{base}/instances"
    body = _http("POST", url, {"task_id": task.task_id}, timeout_s)
    instance_id = body.get("instance_id") if isinstance(body, dict) else None
    if isinstance(instance_id, bool) or not isinstance(instance_id, (str, int)) or instance_id == "":
        raise TaskError(f"POST {url} answered {_preview(body)}; expected an object with an \"instance_id\" string")
    service_task = body.get("task", {})
    if not isinstance(service_task, dict):
        raise TaskError(f"POST {url} answered a \"task\" that is {_kind(service_task)}; expected a JSON object")
    return {**service_task, "instance_id": str(instance_id), "env_url": base}


def evaluate_instance(env_url: str, instance_id: str, answer: str | None, timeout_s: float = 30) -> dict:
    """Ask the environment service how well `answer` did on its instance: {"reward": float, "details": {...}}."""
    url = f"{env_url.rstrip('/')}/instances/{urllib.parse.quote(str(instance_id), safe='')}/evaluate"
    body = _http("POST", url, {"answer": answer}, timeout_s)
    reward = body.get("reward") if isinstance(body, dict) else None
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise TaskError(f"POST {url} answered {_preview(body)}; expected an object with a finite number \"reward\"")
    details = body.get("details") or {}
    if not isinstance(details, dict):
        raise TaskError(f"POST {url} answered \"details\" that are {_kind(details)}; expected a JSON object")
    return {"reward": float(reward), "details": details}


# ---------------------------------------------------------------------------------------------------------------
# Which reader


def _read(source: str, split: str, limit: int | None) -> list[Task]:
    if not source.strip():
        raise TaskError(f"no task source given (got {source!r}). Accepted: {ACCEPTED}")
    if source.startswith(("http://", "https://")):
        return _read_service(source, split)
    path = Path(source).expanduser()
    if path.is_dir():
        return _read_dataset_dir(path, split, limit)
    if path.is_file():
        if path.suffix == ".jsonl":
            return _read_jsonl(path, split)
        if path.suffix in _DATASET_BUILDERS:
            return _read_dataset_file(path, split, limit)
        raise TaskError(f"can't read tasks from {path}: files ending in {path.suffix or '(no suffix)'!r} are not a "
                        f"task format. Accepted: {ACCEPTED}")
    if match := _FUNCTION_SPEC.match(source):
        return _read_function(match["module"], match["function"], source, split)
    if path.suffix in _FILE_SUFFIXES or source.startswith(("/", ".", "~")):
        raise TaskError(f"no such file or directory: {path}")
    if "://" not in source and (match := _HUB_NAME.match(source)):
        return _read_hub(match["name"], match["config"], split, limit)
    raise TaskError(f"can't tell what kind of task source {source!r} is. Accepted: {ACCEPTED}")


# ---------------------------------------------------------------------------------------------------------------
# Records into tasks, the same rules for every source


def _task_id(obj: dict, fallback: str | None, where: str) -> str:
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


def _split_of(obj: dict, where: str, default: str = "train") -> str:
    value = obj.get("split")
    if value is None:
        return default
    if not isinstance(value, str) or not value:
        raise TaskError(f"{where}: \"split\" must be a non-empty string, got {value!r}")
    return value


class _UniqueIds:
    """Remembers where each task id was first seen, so a duplicate can name both places."""

    def __init__(self, source: str):
        self.source = source
        self.first: dict[str, str] = {}

    def add(self, task_id: str, place: str) -> None:
        if task_id in self.first:
            raise TaskError(f"{self.source}: task id {task_id!r} is used twice, on {self.first[task_id]} and on "
                            f"{place}; task ids must be unique")
        self.first[task_id] = place


def _no_such_split(source: str, split: str, present: Iterable[str]) -> TaskError:
    names = ", ".join(repr(s) for s in sorted(present)) or "none"
    return TaskError(f"{source} has no tasks in split {split!r} (its splits: {names}); pass one of those as split")


# ---------------------------------------------------------------------------------------------------------------
# JSONL


def _read_jsonl(path: Path, split: str) -> list[Task]:
    tasks: list[Task] = []
    ids = _UniqueIds(str(path))
    splits: set[str] = set()
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskError(f"{where}: not valid JSON ({exc.msg}: column {exc.colno})") from None
            except ValueError as exc:  # bytes that are not UTF-8
                raise TaskError(f"{where}: not valid JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise TaskError(f"{where}: expected a JSON object ({{...}}), got {_kind(obj)}")
            task_id = _task_id(obj, f"line-{n}", where)
            ids.add(task_id, f"line {n}")
            task_split = _split_of(obj, where)
            splits.add(task_split)
            if task_split == split:
                tasks.append(Task(task_id=task_id, data=obj, split=split))
    if not tasks and splits:
        raise _no_such_split(str(path), split, splits)
    return tasks


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face datasets


def _datasets():
    try:
        import datasets
    except ImportError:
        raise TaskError("reading this task source needs the 'datasets' package: pip install 'harness[data]'") from None
    return datasets


def _read_dataset_dir(path: Path, split: str, limit: int | None) -> list[Task]:
    ds = _datasets()
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return _dataset_tasks(ds.load_from_disk(str(path)), split, limit, str(path))
    by_split = _data_files_by_split(path)
    if split not in by_split:
        raise _no_such_split(str(path), split, by_split)
    files = by_split[split]
    builders = {_DATA_FILE_BUILDERS[f.suffix] for f in files}
    if len(builders) > 1:
        raise TaskError(f"{path}: split {split!r} mixes file formats ({', '.join(sorted(builders))}); "
                        "keep one format per split")
    builder = builders.pop()
    try:
        loaded = ds.load_dataset(builder, data_files={split: [str(f) for f in files]}, split=split)
    except Exception as exc:
        raise TaskError(f"{path}: the {split!r} files can't be read as {builder} ({_why(exc)})") from exc
    # As a DatasetDict: the files chose the split, so a "split" column does not select again.
    return _dataset_tasks(ds.DatasetDict({split: loaded}), split, limit, str(path))


def _data_files_by_split(path: Path) -> dict[str, list[Path]]:
    """A directory's data files by split, the way the Hugging Face Hub lays them out and names them.

    We look ourselves rather than let `datasets` glob the directory: pointed at a project root by mistake, its
    recursive glob walks .venv and .git for minutes before it finds nothing. Here the search stops two levels down
    (train/part-0.parquet, data/train/x.parquet), skips hidden and __dunder__ entries, and gives up on huge trees.
    """
    files: list[Path] = []
    seen = 0
    level = [path]
    for _depth in range(3):
        deeper = []
        for folder in level:
            for entry in sorted(os.scandir(folder), key=lambda e: e.name):
                seen += 1
                if seen > _MAX_DIR_ENTRIES:
                    raise TaskError(f"{path} holds more than {_MAX_DIR_ENTRIES} files and folders: it doesn't look "
                                    "like a dataset directory; point at the dataset's own folder")
                if entry.name.startswith((".", "__")):
                    continue
                if entry.is_dir():
                    deeper.append(Path(entry.path))
                elif Path(entry.name).suffix in _DATA_FILE_BUILDERS:
                    files.append(Path(entry.path))
        level = deeper
    if not files:
        raise TaskError(f"{path} is a directory, but neither one saved with datasets' save_to_disk nor one holding "
                        f"data files ({', '.join(sorted(_DATA_FILE_BUILDERS))}) in it or two levels down")
    by_split: dict[str, list[Path]] = {}
    for file in sorted(files):
        by_split.setdefault(_split_of_file(file.relative_to(path)), []).append(file)
    return by_split


def _split_of_file(relative: Path) -> str:
    """Hub conventions: "<split>-00000-of-00003.parquet" names its split outright; otherwise a split word in the
    folder or file name (train, training, validation, valid, dev, val, test, testing, eval, evaluation) decides;
    files with none are "train"."""
    if match := _SHARD_NAME.match(relative.name):
        return match["split"]
    for word in re.split(r"[-._ 0-9/]+", relative.with_suffix("").as_posix().lower()):
        if word in _SPLIT_WORDS:
            return _SPLIT_WORDS[word]
    return "train"


def _read_dataset_file(path: Path, split: str, limit: int | None) -> list[Task]:
    ds = _datasets()
    builder = _DATASET_BUILDERS[path.suffix]
    try:
        loaded = ds.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:
        raise TaskError(f"{path} can't be read as {builder} ({_why(exc)})") from exc
    return _dataset_tasks(loaded, split, limit, str(path))


def _read_hub(name: str, config: str | None, split: str, limit: int | None) -> list[Task]:
    """A Hub dataset. The Hub is probed first: offline, datasets would retry for ~20 s before saying so."""
    ds = _datasets()
    offline = getattr(ds.config, "HF_HUB_OFFLINE", getattr(ds.config, "HF_DATASETS_OFFLINE", False))  # old: 2nd
    label = f"{name}:{config}" if config else name
    use_local = "pass a local path instead (a .jsonl, .parquet, .json or .arrow file, or a save_to_disk directory)"
    if not offline and (reason := _hub_unreachable(ds.config.HF_ENDPOINT)):
        raise TaskError(f"{label!r} is not a local file or directory, and the Hugging Face Hub "
                        f"({ds.config.HF_ENDPOINT}) can't be reached from this machine ({reason}): it looks offline; "
                        f"{use_local}, or set HF_HUB_OFFLINE=1 to read the Hub's local cache")
    try:
        loaded = ds.load_dataset(name, config, split=split)
    except (ConnectionError, FileNotFoundError) as exc:
        why = ("offline mode is on (HF_HUB_OFFLINE) and it is not in the local cache" if offline
               else "it is not a local path and the Hub has no such dataset (or it is private or gated)")
        raise TaskError(f"can't load dataset {label!r}: {why} ({type(exc).__name__}: {exc}); {use_local}") from exc
    except ValueError as exc:  # unknown split, missing config name, ...
        raise TaskError(f"can't load split {split!r} of Hub dataset {label!r}: {exc}") from exc
    return _dataset_tasks(loaded, split, limit, label)


def _hub_unreachable(endpoint: str) -> str | None:
    """Why a TCP connection to the Hub fails; None when it succeeds, or when a proxy is set (then we can't tell)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    parts = urllib.parse.urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname or "", port), timeout=_HUB_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        return f"{parts.hostname}:{port}: {exc.strerror or exc}"
    return None


def _dataset_tasks(loaded, split: str, limit: int | None, source: str) -> list[Task]:
    """Rows into tasks. A DatasetDict is picked by split; a single Dataset is one split unless it has a "split"
    column, which then selects rows the way a JSONL line's "split" field does."""
    if isinstance(loaded, dict):  # a DatasetDict
        if split not in loaded:
            raise _no_such_split(source, split, loaded.keys())
        table, by_column = loaded[split], False
    else:
        table, by_column = loaded, "split" in loaded.column_names
        own = str(loaded.split) if loaded.split else "train"
        if not by_column and own != split:
            raise TaskError(f"{source} holds one split, {own!r}, and no \"split\" column to select {split!r} by; "
                            f"pass split={own!r}, or give a source with a {split!r} split")
        if not by_column and limit is not None:
            table = table.select(range(min(limit, len(table))))
    tasks: list[Task] = []
    ids = _UniqueIds(source)
    splits: set[str] = set()
    for i, row in enumerate(table):
        where = f"{source} row {i}"
        if by_column:
            splits.add(row_split := _split_of(row, where))
            if row_split != split:
                continue
        task_id = _task_id(row, f"row-{i}", where)
        ids.add(task_id, f"row {i}")
        tasks.append(Task(task_id=task_id, data=row, split=split))
        if limit is not None and len(tasks) >= limit:
            break
    if not tasks and splits:
        raise _no_such_split(source, split, splits)
    return tasks


# ---------------------------------------------------------------------------------------------------------------
# Environment services (docs/environments.md)


def _read_service(url: str, split: str) -> list[Task]:
    base = url.rstrip("/")
    list_url = f"{base}/tasks?{urllib.parse.urlencode({'split': split})}"
    body = _http("GET", list_url)
    items = body.get("tasks") if isinstance(body, dict) else None
    if not isinstance(items, list):
        raise TaskError(f"GET {list_url} answered {_preview(body)}; expected {{\"tasks\": [...]}}")
    tasks: list[Task] = []
    ids = _UniqueIds(list_url)
    for i, item in enumerate(items):
        where = f"GET {list_url} tasks[{i}]"
        if not isinstance(item, dict):
            raise TaskError(f"{where} is {_kind(item)}; expected an object with a \"task_id\"")
        task_id = _task_id(item, None, where)
        ids.add(task_id, f"tasks[{i}]")
        tasks.append(Task(task_id=task_id, data={**item, "env_url": base}, split=split))
    return tasks


def _http(method: str, url: str, payload: object = None, timeout_s: float = 30) -> object:
    """One JSON request; every failure becomes a TaskError naming the URL and what the service said."""
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Accept": "application/json"}
    if data is not None:
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        raise TaskError(f"{method} {url} answered HTTP {exc.code}: {_service_message(exc)}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            raise TaskError(f"{method} {url} got no answer within {timeout_s:g} s") from None
        raise TaskError(f"{method} {url} failed ({reason}); is the environment service running there?") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise TaskError(f"{method} {url} answered something that is not JSON: {raw[:200]!r}") from None


def _service_message(exc: urllib.error.HTTPError) -> str:
    """The service's {"error": "..."} message (or an OpenAI-style {"error": {"message": ...}}), else its text."""
    raw = exc.read()
    try:
        error = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):
        error = error.get("message")
    if isinstance(error, str) and error:
        return error
    text = raw.decode("utf-8", "replace").strip()[:300]
    return text or exc.reason or "(empty body)"


# ---------------------------------------------------------------------------------------------------------------
# Python functions


def _read_function(module_ref: str, function_name: str, spec: str, split: str) -> list[Task]:
    """Tasks from `function(split=split)`, or `function()`.

    A function that takes the split is trusted to return that split's tasks; one that takes no arguments returns
    all of them, and each dict's "split" field (or Task.split) selects, as in a JSONL file.
    """
    function = _load_function(module_ref, function_name, spec)
    takes_split = _takes_split(function, spec)
    try:
        items = list(function(split=split) if takes_split else function())
    except TaskError:
        raise
    except Exception as exc:
        raise TaskError(f"task function {spec!r} raised {type(exc).__name__}: {exc}") from exc
    tasks: list[Task] = []
    ids = _UniqueIds(spec)
    for i, item in enumerate(items):
        where = f"{spec!r} item {i}"
        if isinstance(item, Task):
            task = dataclasses.replace(item, split=split) if takes_split else item
        elif isinstance(item, dict):
            item_split = split if takes_split else _split_of(item, where)
            task = Task(task_id=_task_id(item, f"item-{i}", where), data=item, split=item_split)
        else:
            raise TaskError(f"{where} is {_kind(item)}; return dicts or harness.records.Task objects")
        if task.split == split:
            ids.add(task.task_id, f"item {i}")
            tasks.append(task)
    return tasks


def _load_function(module_ref: str, function_name: str, spec: str):
    if module_ref.endswith(".py"):
        module = _import_file(Path(module_ref).expanduser(), spec)
    else:
        try:
            module = importlib.import_module(module_ref)
        except ModuleNotFoundError as exc:
            if exc.name and (module_ref == exc.name or module_ref.startswith(exc.name + ".")):
                raise TaskError(f"{spec!r}: no module named {module_ref!r}; install it or put it on sys.path, or "
                                "name its file instead (path/to/file.py:function)") from None
            raise TaskError(f"{spec!r}: importing {module_ref} raised ModuleNotFoundError: {exc}") from exc
        except Exception as exc:
            raise TaskError(f"{spec!r}: importing {module_ref} raised {type(exc).__name__}: {exc}") from exc
    function = getattr(module, function_name, None)
    if function is None:
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise TaskError(f"{spec!r}: {module_ref} has no {function_name!r} (its functions: "
                        f"{', '.join(found) or 'none'})")
    if not callable(function):
        raise TaskError(f"{spec!r}: {function_name} is {_kind(function)}, not a function")
    return function


def _import_file(path: Path, spec: str):
    if not path.is_file():
        raise TaskError(f"{spec!r}: no such file: {path}")
    # A name of its own per file, registered while it runs: dataclasses and pickling look modules up by name.
    stem = re.sub(r"\W", "_", path.stem)
    name = f"_harness_tasks_{stem}_{zlib.crc32(str(path.resolve()).encode()):08x}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise TaskError(f"{spec!r}: running {path} raised {type(exc).__name__}: {exc}") from exc
    return module


def _takes_split(function, spec: str) -> bool:
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # no signature to read (some builtins): assume the documented call
        return True
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if any(p.name != "split" for p in required):
        raise TaskError(f"{spec!r} must take a `split` keyword argument or no arguments; its signature is "
                        f"{inspect.signature(function)}")
    return any(p.name == "split" or p.kind is p.VAR_KEYWORD for p in params)


# ---------------------------------------------------------------------------------------------------------------


def _kind(value: object) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    if type(value) in names:
        return names[type(value)]
    return "a number" if isinstance(value, (int, float)) else f"of type {type(value).__name__}"


def _why(exc: BaseException) -> str:
    """The innermost cause: datasets wraps the useful message ("missing field x") in a generic one."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}"


def _preview(value: object) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 200 else text[:200] + "..."
