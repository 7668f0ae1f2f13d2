"""Task readers for Hugging Face `datasets` sources: save_to_disk directories, data files, Hub names.

Part of `harness.running.tasks.read_tasks`, which dispatches here; `datasets` is an optional extra, imported only when a
source needs it. Directories are scanned by hand (two levels, hidden entries skipped), because `load_dataset` on
an arbitrary directory walks everything below it, .venv and .git included.
"""

from __future__ import annotations

import os
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

from harness import install_hint
from harness.core.records import Task
from harness.running.task_records import (
    DATA_FILE_BUILDERS,
    DATASET_BUILDERS,
    TaskError,
    UniqueIds,
    innermost_cause,
    no_such_split,
    split_of,
    task_id_of,
)

_HUB_PROBE_TIMEOUT_S = 3.0
_SHARD_NAME = re.compile(r"^(?P<split>\w+)-\d{5}-of-\d{5}\.")
_SPLIT_WORDS = {"train": "train", "training": "train", "validation": "validation", "valid": "validation",
                "dev": "validation", "val": "validation", "test": "test", "testing": "test", "eval": "test",
                "evaluation": "test"}
_MAX_DIR_ENTRIES = 10_000



def _datasets():
    try:
        import datasets
    except ImportError:
        raise TaskError(f"reading this task source needs the 'datasets' package: {install_hint('data')}") from None
    return datasets


def read_dataset_dir(path: Path, split: str, limit: int | None) -> list[Task]:
    ds = _datasets()
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return _dataset_tasks(ds.load_from_disk(str(path)), split, limit, str(path))
    by_split = _data_files_by_split(path)
    if split not in by_split:
        raise no_such_split(str(path), split, by_split)
    files = by_split[split]
    builders = {DATA_FILE_BUILDERS[f.suffix] for f in files}
    if len(builders) > 1:
        raise TaskError(f"{path}: split {split!r} mixes file formats ({', '.join(sorted(builders))}); "
                        "keep one format per split")
    builder = builders.pop()
    try:
        loaded = ds.load_dataset(builder, data_files={split: [str(f) for f in files]}, split=split)
    except Exception as exc:
        raise TaskError(f"{path}: the {split!r} files can't be read as {builder} ({innermost_cause(exc)})") from exc
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
                elif Path(entry.name).suffix in DATA_FILE_BUILDERS:
                    files.append(Path(entry.path))
        level = deeper
    if not files:
        raise TaskError(f"{path} is a directory, but neither one saved with datasets' save_to_disk nor one holding "
                        f"data files ({', '.join(sorted(DATA_FILE_BUILDERS))}) in it or two levels down")
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


def read_dataset_file(path: Path, split: str, limit: int | None) -> list[Task]:
    ds = _datasets()
    builder = DATASET_BUILDERS[path.suffix]
    try:
        loaded = ds.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:
        raise TaskError(f"{path} can't be read as {builder} ({innermost_cause(exc)})") from exc
    return _dataset_tasks(loaded, split, limit, str(path))


def read_hub(name: str, config: str | None, split: str, limit: int | None) -> list[Task]:
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
            raise no_such_split(source, split, loaded.keys())
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
    ids = UniqueIds(source)
    splits: set[str] = set()
    for i, row in enumerate(table):
        where = f"{source} row {i}"
        if by_column:
            splits.add(row_split := split_of(row, where))
            if row_split != split:
                continue
        task_id = task_id_of(row, f"row-{i}", where)
        ids.add(task_id, f"row {i}")
        tasks.append(Task(task_id=task_id, data=row, split=split))
        if limit is not None and len(tasks) >= limit:
            break
    if not tasks and splits:
        raise no_such_split(source, split, splits)
    return tasks
