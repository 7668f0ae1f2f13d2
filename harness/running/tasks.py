"""Task readers: turn whatever `--data` names into Task records, and hand each task to its agent.

One entry point, `read_tasks(source)`, so that `harness run`, the trainer and user scripts all accept the same
sources, told apart by their form:

    tasks.jsonl                            one JSON object per line
    data/  x.parquet  x.json  x.arrow      a Hugging Face `datasets` source (save_to_disk output or data files)
    tasks/  tasks/fix-bug/                 Harbor tasks: a dir of task dirs, or one (harness/running/harbor.py)
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
import sys
import urllib.error
import urllib.parse
import urllib.request
import zlib
from pathlib import Path

from harness.core.records import Task
from harness.running import harbor
from harness.running.task_records import (
    DATASET_BUILDERS,
    TaskError,
    UniqueIds,
    no_such_split,
    split_of,
    task_id_of,
)

__all__ = ["TaskError", "read_tasks", "source_kind", "instance_for", "evaluate_instance"]

ACCEPTED = (
    "a .jsonl file; a .parquet, .json or .arrow file; a directory saved with datasets' save_to_disk or holding "
    "data files; a Harbor task directory (instruction.md, task.toml, tests/test.sh) or a directory of them; a "
    "Hugging Face Hub dataset name (org/name or org/name:config); an environment service URL "
    "(http://... or https://...); or a Python function as module:function or path/to/file.py:function"
)
# Suffixes that make a missing source read as a mistyped path rather than a Hub name.
_FILE_SUFFIXES = {".jsonl", ".json", ".parquet", ".arrow", ".csv", ".tsv", ".txt", ".gz", ".py"}
_FUNCTION_SPEC = re.compile(r"^(?P<module>[A-Za-z_][\w.]*|.+\.py):(?P<function>[A-Za-z_]\w*)$")
_HUB_NAME = re.compile(r"^(?P<name>[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?)(?::(?P<config>[\w.-]+))?$")



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


def source_kind(source: str) -> str:
    """Where `read_tasks` reads `source` from, told apart in the order `_read` tells them apart: "service" (an
    environment service URL), "hub" (a Hugging Face Hub dataset name), or "local" (a file, a directory, a Python
    task function, or a source it refuses at once without the network)."""
    if source.startswith(("http://", "https://")):
        return "service"
    path = Path(source).expanduser()
    if path.exists() or _FUNCTION_SPEC.match(source) or path.suffix in _FILE_SUFFIXES or source.startswith(
            ("/", ".", "~")):
        return "local"
    return "hub" if "://" not in source and _HUB_NAME.match(source) else "local"


def _read(source: str, split: str, limit: int | None) -> list[Task]:
    from harness.running import hf_tasks  # `datasets` itself only when a source needs it

    if not source.strip():
        raise TaskError(f"no task source given (got {source!r}). Accepted: {ACCEPTED}")
    if source.startswith(("http://", "https://")):
        return _read_service(source, split)
    path = Path(source).expanduser()
    if path.is_dir() and (harbor.is_task_dir(path) or harbor.is_task_set(path)):
        return harbor.read_harbor(path, split)
    if path.is_dir():
        return hf_tasks.read_dataset_dir(path, split, limit)
    if path.is_file():
        if path.suffix == ".jsonl":
            return _read_jsonl(path, split)
        if path.suffix in DATASET_BUILDERS:
            return hf_tasks.read_dataset_file(path, split, limit)
        raise TaskError(f"can't read tasks from {path}: files ending in {path.suffix or '(no suffix)'!r} are not a "
                        f"task format. Accepted: {ACCEPTED}")
    if match := _FUNCTION_SPEC.match(source):
        return _read_function(match["module"], match["function"], source, split)
    if path.suffix in _FILE_SUFFIXES or source.startswith(("/", ".", "~")):
        raise TaskError(f"no such file or directory: {path}")
    if "://" not in source and (match := _HUB_NAME.match(source)):
        return hf_tasks.read_hub(match["name"], match["config"], split, limit)
    raise TaskError(f"can't tell what kind of task source {source!r} is. Accepted: {ACCEPTED}")


# ---------------------------------------------------------------------------------------------------------------
# JSONL


def _read_jsonl(path: Path, split: str) -> list[Task]:
    tasks: list[Task] = []
    ids = UniqueIds(str(path))
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
            task_id = task_id_of(obj, f"line-{n}", where)
            ids.add(task_id, f"line {n}")
            task_split = split_of(obj, where)
            splits.add(task_split)
            if task_split == split:
                tasks.append(Task(task_id=task_id, data=obj, split=split))
    if not tasks and splits:
        raise no_such_split(str(path), split, splits)
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
    ids = UniqueIds(list_url)
    for i, item in enumerate(items):
        where = f"GET {list_url} tasks[{i}]"
        if not isinstance(item, dict):
            raise TaskError(f"{where} is {_kind(item)}; expected an object with a \"task_id\"")
        task_id = task_id_of(item, None, where)
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
    ids = UniqueIds(spec)
    for i, item in enumerate(items):
        where = f"{spec!r} item {i}"
        if isinstance(item, Task):
            task = dataclasses.replace(item, split=split) if takes_split else item
        elif isinstance(item, dict):
            item_split = split if takes_split else split_of(item, where)
            task = Task(task_id=task_id_of(item, f"item-{i}", where), data=item, split=item_split)
        else:
            raise TaskError(f"{where} is {_kind(item)}; return dicts or harness.core.records.Task objects")
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


def _preview(value: object) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 200 else text[:200] + "..."
