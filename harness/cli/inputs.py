"""The inputs a config names, read as the run reads them first: its tasks (data.train, data.validation), its judge
(task_judge.judge) and its offline data (offline.data for `harness sft`, offline.run for `harness train
--from-run`). `harness train --check` lists their problems with the config's; `harness train` refuses them before
the policy is built or an engine starts, with the messages `harness run` gives for the same inputs.

What is read here is only what can be read without the network or a service: a task source that is a local file
or directory is read whole by the task reader (harness/running/tasks.py read_tasks), and a Python task function
(module:function, path.py:function) is imported and called, as the run does first; an environment service URL or
a Hugging Face Hub dataset is left to the run (said in the plan). A judge is imported by the judge loader
(harness/running/judges.py load_judge), which builds no engine: a rubric judge only checks its settings. A
recorded run is looked up read-only (no database file is created); chat records are tokenised with the model's
chat template when the model is here, else only read.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from trainer.config.checks import Mode
from trainer.config.keys import TrainConfig

__all__ = ["Inputs", "check_inputs", "progress"]


def progress(what: str) -> None:
    """One plain line on stderr before a phase that may take a while, on a terminal or not."""
    print(f"checking: {what}", file=sys.stderr, flush=True)


@dataclass
class Inputs:
    """What the inputs amount to (plan lines, as `--check` prints them) and what is wrong with them."""

    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def check_inputs(cfg: TrainConfig, mode: Mode, *, offline: bool = True, model_here: bool = True,
                 say: Callable[[str], None] = lambda what: None) -> Inputs:
    """The tasks, the judge and (with `offline`) the offline data of `cfg` for `mode`, each read as its reader
    reads it; `say` is told each phase before it starts. `model_here`: model.path is a local model directory
    (chat records are then tokenised as harness sft tokenises them)."""
    found = Inputs()
    serves = mode == "rl" or cfg.data.validation is not None
    d = cfg.data
    if mode == "rl" and d.train is not None:
        _tasks(found, "data.train", d.train, d.split, d.limit, say)
    if d.validation is not None:
        _tasks(found, "data.validation", d.validation, d.validation_split, d.validation_limit, say)
    if serves and cfg.task_judge.judge is not None:
        _judge(found, cfg.task_judge.judge, say)
    if offline and mode == "from_run" and cfg.offline.run:
        _recorded_run(found, cfg, say)
    if offline and mode == "sft" and cfg.offline.data:
        _chat_records(found, cfg, model_here, say)
    return found


def _tasks(found: Inputs, key: str, source: str, split: str, limit: int | None,
           say: Callable[[str], None]) -> None:
    from harness.running.tasks import TaskError, read_tasks, source_kind

    label = f"tasks        {key} {source}"
    if (kind := source_kind(source)) != "local":
        kind = "an environment service" if kind == "service" else "a Hub dataset"
        found.lines.append(f"{label}: not read by --check ({kind}: the run reads it when it starts)")
        return
    say(f"reading {key} {source}")
    try:
        tasks = read_tasks(source, split=split, limit=limit)
    except TaskError as exc:
        found.problems.append(f"{key}: {exc}")
        found.lines.append(f"{label}: can't be read")
        return
    if not tasks:
        limit_key = "data.limit" if key == "data.train" else "data.validation_limit"
        found.problems.append(f"{key} {source!r} has no tasks in split {split!r}" + (
            f": {limit_key} is 0, give a number > 0 or null" if limit == 0 else
            ": give a source with tasks, or the split they are in"))
        found.lines.append(f"{label}: no tasks")
        return
    found.lines.append(f"{label}: {len(tasks)} tasks in split {split!r}")


def _judge(found: Inputs, spec: str, say: Callable[[str], None]) -> None:
    from harness.running.judges import JudgeError, load_judge

    say(f"loading the judge {spec}")
    try:
        loaded = load_judge(spec)
    except JudgeError as exc:
        found.problems.append(f"task_judge.judge: {exc}")
        found.lines.append(f"judge        task_judge.judge {spec}: can't be loaded")
        return
    found.lines.append(f"judge        task_judge.judge {spec}: loaded ({loaded.name})")


def _recorded_run(found: Inputs, cfg: TrainConfig, say: Callable[[str], None]) -> None:
    from trainer.offline.data import database_of
    from trainer.offline.loop import check_data

    db = database_of(cfg)
    say(f"reading run {cfg.offline.run}'s episodes in {db} (read-only)")
    problem = check_data(cfg, "from_run")
    if problem is not None:
        found.problems.append(problem)
    found.lines.append(f"data         offline.run {cfg.offline.run} in {db}: "
                       f"{'can not be trained on' if problem else 'its episodes give samples to train'}")


def _chat_records(found: Inputs, cfg: TrainConfig, model_here: bool, say: Callable[[str], None]) -> None:
    from trainer.offline.chat_data import ChatDataError, read_chat_records

    o = cfg.offline
    if model_here:
        from trainer.offline.loop import check_data

        say(f"reading offline.data {o.data} and tokenising it with the model's chat template")
        problem = check_data(cfg, "sft")
    else:
        say(f"reading offline.data {o.data}")
        try:
            read_chat_records(o.data, split=o.split)
            problem = None
        except ChatDataError as exc:
            problem = str(exc)
    if problem is not None:
        found.problems.append(f"offline.data: {problem}")
    found.lines.append(f"data         offline.data {o.data}: "
                       f"{'can not be trained on' if problem else 'chat records to train'}")
