"""Harbor tasks (terminal-bench 2's format, read by SkyRL, rLLM, Tinker and verifiers): a directory per task,

    instruction.md      the prompt the agent is given
    task.toml           [agent] timeout_sec, [verifier] timeout_sec, [environment] cpus / memory_mb, [metadata]
    environment/        a Dockerfile and the files it copies into the task's workspace
    tests/test.sh       the verifier: run over the final workspace, it writes /logs/verifier/reward.txt (a number)
                        or reward.json (named numbers: "reward", others into the judgement's details,
                        "role_rewards" as the judge protocol's)
    solution/solve.sh   the oracle (`harness run --agent oracle` checks that every task scores 1 with it)

`read_harbor(path)` reads one task dir or a directory of them into Tasks; `prepare` makes an episode's workspace;
`verify` runs tests/test.sh in a fresh sandbox over the workspace the agent left (it never saw tests/ or
solution/) and turns the reward file into a Judgement.

The bubblewrap sandbox builds no image: the host's toolchain stands in for the Dockerfile's FROM. It honours
WORKDIR, ENV, ARG (defaults), COPY and ADD of local files and directories into the workdir, `USER root`; it ignores
what only a container's run time reads (LABEL, EXPOSE, CMD, ENTRYPOINT, VOLUME, HEALTHCHECK, STOPSIGNAL, SHELL,
MAINTAINER); anything else (RUN, a second FROM, COPY --from, ADD of a URL or an archive, another USER, a
destination outside the workdir) refuses the task, naming the line and that it needs a backend that builds images.
A task of a set that cannot be prepared is not run; its episode says why (status not_prepared).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import stat
import tempfile
import time
import tomllib
from pathlib import Path

from harness.core.records import Judgement, Task
from harness.running.task_records import TaskError, UniqueIds
from harness.sandbox import SandboxError, SandboxSpec, flag, workdir_problem

KEY = "harbor"  # Task.data[KEY]: what the runner needs of a Harbor task (never given to the agent)
JUDGE = "harbor:tests/test.sh"
DEFAULT_WORKDIR = "/app"
DEFAULT_AGENT_TIMEOUT_S = 600.0
DEFAULT_VERIFIER_TIMEOUT_S = 600.0
HONOURED = "FROM (the host's toolchain stands in for its image), WORKDIR, ENV, ARG, COPY and ADD of local files into " \
           "the workdir, USER root"
_IGNORED = {"LABEL", "EXPOSE", "CMD", "ENTRYPOINT", "VOLUME", "HEALTHCHECK", "STOPSIGNAL", "SHELL", "MAINTAINER"}
_ARCHIVE = re.compile(r"\.(tar|tgz|tar\.gz|tar\.bz2|tbz2|tar\.xz|txz|zip)$")
_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
_LOG_TAIL = 2000


def is_task_dir(path: Path) -> bool:
    return (path / "instruction.md").is_file() or (path / "task.toml").is_file()


def is_task_set(path: Path) -> bool:
    """A directory whose subdirectories are Harbor tasks (one that is one is enough to say so)."""
    with contextlib.suppress(OSError):
        return any(c.is_dir() and is_task_dir(c) for c in path.iterdir())
    return False


def is_harbor(task: Task | dict) -> bool:
    return KEY in (task.data if isinstance(task, Task) else task)


def read_harbor(path: Path, split: str = "train") -> list[Task]:
    """The tasks of `split` (task.toml's `[metadata] split`, default "train") in a task dir or a directory of them.
    A task dir given alone that cannot be read is a TaskError; in a set, such a task is kept with the reason it
    cannot be prepared (`not_prepared`), so that a run reports it instead of skipping it."""
    path = path.resolve()
    if is_task_dir(path):
        task = _read_task(path)
        if task.data[KEY].get("not_prepared"):
            raise TaskError(task.data[KEY]["not_prepared"])
        return [task] if task.split == split else []
    tasks, ids = [], UniqueIds(str(path))
    for child in sorted(c for c in path.iterdir() if c.is_dir() and not c.name.startswith(".")):
        task = _read_task(child)
        ids.add(task.task_id, child.name)
        if task.split == split:
            tasks.append(task)
    return tasks


def agent_task(task: Task) -> dict:
    """What the agent is given: the instruction, nothing of where the task lives."""
    return {"task_id": task.task_id, "prompt": task.data["prompt"]}


def spec_of(task: Task, **more) -> SandboxSpec:
    h = task.data[KEY]
    return SandboxSpec(workdir=h["workdir"], env=h["env"], cpus=h["cpus"],
                       memory_mb=h["memory_mb"], **more)


# ------------------------------------------------------------------------------------------------------ reading


def _read_task(d: Path) -> Task:
    task_id = d.name
    base = {"path": str(d), "workdir": DEFAULT_WORKDIR, "env": {}, "copies": [], "cpus": None, "memory_mb": None,
            "agent_timeout_s": DEFAULT_AGENT_TIMEOUT_S, "verifier_timeout_s": DEFAULT_VERIFIER_TIMEOUT_S,
            "image": None, "ignored": [], "metadata": {}, "not_prepared": None}
    prompt, split = "", "train"
    try:
        instruction = d / "instruction.md"
        if not instruction.is_file():
            raise TaskError(f"task {task_id!r}: {instruction} is missing (the prompt the agent is given)")
        prompt = instruction.read_text(encoding="utf-8").strip()
        if not prompt:
            raise TaskError(f"task {task_id!r}: {instruction} is empty")
        if not (d / "tests" / "test.sh").is_file():
            raise TaskError(f"task {task_id!r}: {d / 'tests' / 'test.sh'} is missing (the verifier that writes "
                            "/logs/verifier/reward.txt)")
        toml = _read_toml(d / "task.toml", task_id)
        split = _settings(toml, base, task_id, d / "task.toml")
        dockerfile = d / "environment" / "Dockerfile"
        if dockerfile.is_file():
            _read_dockerfile(dockerfile, base, task_id)
    except TaskError as exc:
        base["not_prepared"] = str(exc)
    return Task(task_id=task_id, data={"prompt": prompt, KEY: base}, split=split)


def _read_toml(path: Path, task_id: str) -> dict:
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise TaskError(f"task {task_id!r}: {path} does not parse as TOML ({exc})") from None


def _settings(toml: dict, out: dict, task_id: str, where: Path) -> str:
    def number(section: str, key: str, target: str, kind=float):
        value = toml.get(section, {}).get(key)
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or not math.isfinite(value):
            raise TaskError(f"task {task_id!r}: {where} [{section}] {key} = {value!r}: expected a positive number")
        out[target] = kind(value)

    for section in ("agent", "verifier", "environment", "metadata"):
        if section in toml and not isinstance(toml[section], dict):
            raise TaskError(f"task {task_id!r}: {where}: [{section}] must be a table")
    number("agent", "timeout_sec", "agent_timeout_s")
    number("verifier", "timeout_sec", "verifier_timeout_s")
    number("environment", "cpus", "cpus")
    number("environment", "memory_mb", "memory_mb", int)
    out["metadata"] = toml.get("metadata", {})
    split = out["metadata"].get("split", "train")
    if not isinstance(split, str) or not split:
        raise TaskError(f"task {task_id!r}: {where} [metadata] split = {split!r}: expected a name")
    return split


def _read_dockerfile(path: Path, out: dict, task_id: str) -> None:
    from dockerfile_parse import DockerfileParser

    try:
        with open(path, "rb") as f:
            structure = DockerfileParser(fileobj=f).structure
    except Exception as exc:  # the parser's own errors have no common type
        raise TaskError(f"task {task_id!r}: {path} does not parse as a Dockerfile ({exc})") from None
    context = path.parent
    variables: dict[str, str] = {}
    workdir = DEFAULT_WORKDIR
    froms = 0

    def refuse(item: dict, why: str):
        raise TaskError(f"task {task_id!r}: {path}:{item['startline'] + 1}: `{item['content'].strip()}`: {why}; "
                        f"that needs a sandbox backend that builds images (docker, or Harbor's own environments). "
                        f"The bubblewrap sandbox honours {HONOURED}")

    for item in structure:
        instruction, value = item["instruction"].upper(), item["value"].strip()
        if instruction == "COMMENT":
            continue
        if instruction == "FROM":
            froms += 1
            if froms > 1:
                refuse(item, "a multi-stage build")
            out["image"] = value
        elif instruction == "ARG":
            name, _, default = value.partition("=")
            variables.setdefault(name.strip(), _unquote(default))
        elif instruction == "ENV":
            for name, val in _env_pairs(value, item, refuse):
                variables[name] = out["env"][name] = _substitute(val, variables)
        elif instruction == "WORKDIR":
            workdir = os.path.normpath(os.path.join(workdir, _substitute(value, variables)))
            if problem := workdir_problem(workdir):
                raise TaskError(f"task {task_id!r}: {path}:{item['startline'] + 1}: {problem}")
        elif instruction in ("COPY", "ADD"):
            _copy(item, instruction, _substitute(value, variables), context, workdir, out, refuse)
        elif instruction == "USER":
            if value.split(":")[0] not in ("root", "0"):
                refuse(item, "another user than root")
        elif instruction in _IGNORED:
            out["ignored"].append(instruction)
        else:
            refuse(item, f"{instruction} changes the image")
    for copy in out["copies"]:
        if not _under(copy["dest"], workdir):
            raise TaskError(f"task {task_id!r}: {path}: COPY to {copy['dest']} is outside the workdir {workdir}; "
                            f"the bubblewrap sandbox writes only the workspace. The bubblewrap sandbox honours "
                            f"{HONOURED}")
    out["workdir"] = workdir


def _env_pairs(value: str, item: dict, refuse) -> list[tuple[str, str]]:
    try:
        words = shlex.split(value)
    except ValueError:
        refuse(item, "an ENV that does not parse")
    if words and "=" not in words[0]:  # ENV NAME value (the old form)
        return [(words[0], value.split(None, 1)[1] if len(value.split(None, 1)) > 1 else "")]
    pairs = []
    for w in words:
        name, sep, val = w.partition("=")
        if not sep:
            refuse(item, f"{w!r} is not NAME=value")
        pairs.append((name, val))
    return pairs


def _copy(item: dict, instruction: str, value: str, context: Path, workdir: str, out: dict, refuse) -> None:
    try:
        words = shlex.split(value)
    except ValueError:
        refuse(item, "arguments that do not parse")
    if value.lstrip().startswith("["):
        try:
            words = json.loads(value)
        except ValueError:
            refuse(item, "a JSON form that does not parse")
    flags = [w for w in words if w.startswith("--")]
    words = [w for w in words if not w.startswith("--")]
    for f in flags:
        if f.startswith("--from"):
            refuse(item, "a copy from another stage or image")
        if not f.startswith(("--chown", "--chmod", "--link")):
            refuse(item, f"the flag {f}")
    if len(words) < 2:
        refuse(item, "no source or no destination")
    *sources, dest = words
    into_dir = dest.endswith("/") or len(sources) > 1
    dest = os.path.normpath(os.path.join(workdir, dest))
    for source in sources:
        if instruction == "ADD" and (re.match(r"^\w+://", source) or source.startswith("git@")):
            refuse(item, "ADD of a URL")
        if instruction == "ADD" and _ARCHIVE.search(source):
            refuse(item, "ADD of an archive (it is unpacked)")
        matches = sorted(glob.glob(str(context / source))) if glob.has_magic(source) else [str(context / source)]
        for match in matches:
            real = os.path.realpath(match)
            if not _under(real, str(context.resolve())):
                refuse(item, f"{source} is outside the build context {context}")
            if not os.path.exists(real):
                refuse(item, f"{source} is not in the build context {context}")
            is_dir = os.path.isdir(real)
            target = dest if is_dir or not (into_dir or len(matches) > 1) else os.path.join(dest, Path(real).name)
            out["copies"].append({"source": real, "dest": target, "dir": is_dir})


def _substitute(text: str, variables: dict[str, str]) -> str:
    return _VAR.sub(lambda m: variables.get(m[1] or m[2], ""), text)


def _unquote(text: str) -> str:
    text = text.strip()
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'" else text


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


# ------------------------------------------------------------------------------------------------------ episodes


def prepare(task: Task, workspace: Path) -> list[dict]:
    """Make the episode's workspace from the task's environment (its COPY lines); the flags it raised: a `.git`
    that came with the files is removed (its history may hold the answer)."""
    h = task.data[KEY]
    workspace.mkdir(parents=True, exist_ok=True)
    root = os.path.realpath(workspace)
    for copy in h["copies"]:
        target = workspace / os.path.relpath(copy["dest"], h["workdir"])
        if target.is_symlink() or not _under(os.path.realpath(target), root):
            raise TaskError(f"task {task.task_id!r}: COPY to {copy['dest']} goes through a link its earlier COPY "
                            "lines made: refused (it could write outside the workspace)")
        if copy["dir"]:
            shutil.copytree(copy["source"], target, symlinks=True, dirs_exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(copy["source"], target)
    flags = []
    for git in sorted(workspace.rglob(".git")):
        shutil.rmtree(git) if git.is_dir() and not git.is_symlink() else git.unlink()
        flags.append(flag("git_history_removed", path=str(Path(h["workdir"]) / git.relative_to(workspace))))
    return flags


def oracle_mounts(task: Task, scratch: Path) -> dict[str, tuple[Path, bool]]:
    """The oracle agent's solution/, copied, at /solution; a TaskError when the task has none."""
    solution = Path(task.data[KEY]["path"]) / "solution"
    if not (solution / "solve.sh").is_file():
        raise TaskError(f"task {task.task_id!r}: {solution / 'solve.sh'} is missing (the oracle's solution)")
    shutil.copytree(solution, scratch / "solution", symlinks=True)
    return {"/solution": (scratch / "solution", False)}


ORACLE_COMMAND = ["bash", "/solution/solve.sh"]


def tests_hash(task: Task) -> str:
    """The verifier's identity, as a judge's code hash: the bytes of tests/ (a changed test is a different judge)."""
    tests = Path(task.data[KEY]["path"]) / "tests"
    digest = hashlib.sha256()
    for f in sorted(p for p in tests.rglob("*") if p.is_file()):
        digest.update(str(f.relative_to(tests)).encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


async def verify(task: Task, episode_id: str, workspace: Path, backend, env: dict[str, str],
                 log_path: Path, *, memory_mb: int | None = None, max_procs: int | None = None) -> Judgement:
    """Run the task's tests/test.sh in a fresh sandbox over `workspace` (tests/ copied to /tests, the reward at
    /logs/verifier), under the verifier's timeout and the episode's limits, and read its reward. A verifier that
    cannot run is a judgement with its error, never a failed run."""
    try:
        return await _verify(task, episode_id, workspace, backend, env, log_path, memory_mb, max_procs)
    except (OSError, SandboxError, TaskError) as exc:
        return Judgement(episode_id, JUDGE, tests_hash(task), None, {}, f"task {task.task_id!r}: the verifier "
                         f"could not run: {exc}", time.time())


async def _verify(task: Task, episode_id: str, workspace: Path, backend, env: dict[str, str], log_path: Path,
                  memory_mb: int | None, max_procs: int | None) -> Judgement:
    h = task.data[KEY]
    started = time.time()
    details: dict = {}

    def judged(reward: float | None, error: str | None) -> Judgement:
        return Judgement(episode_id, JUDGE, tests_hash(task), reward, details, error, started)

    scratch = Path(tempfile.mkdtemp(prefix="hx-verify-"))
    try:
        shutil.copytree(Path(h["path"]) / "tests", scratch / "tests", symlinks=True)
        (scratch / "logs").mkdir()
        spec = spec_of(task, max_procs=max_procs)
        if spec.memory_mb is None:
            spec = dataclasses.replace(spec, memory_mb=memory_mb)
        box = await backend.open(spec, workspace, mounts={"/tests": (scratch / "tests", True),
                                                         "/logs/verifier": (scratch / "logs", True)})
        try:
            with open(log_path, "wb") as log:
                proc = await box.exec(["bash", "/tests/test.sh"], env=env, stdin=asyncio.subprocess.DEVNULL,
                                      stdout=log, stderr=log)
                try:
                    details["exit_code"] = await asyncio.wait_for(proc.wait(), h["verifier_timeout_s"])
                except TimeoutError:
                    return judged(None, f"task {task.task_id!r}: tests/test.sh ran past the verifier's "
                                        f"{h['verifier_timeout_s']:g} s timeout ([verifier] timeout_sec)")
        finally:
            await box.close()
        with open(log_path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - _LOG_TAIL))
            details["log_tail"] = log.read().decode("utf-8", "replace")
        try:
            reward, more = read_reward(scratch / "logs", task.task_id, details["exit_code"])
        except TaskError as exc:
            return judged(None, str(exc))
        details.update(more)
        return judged(reward, None)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def read_reward(logs: Path, task_id: str, exit_code: int | None) -> tuple[float, dict]:
    """The reward tests/test.sh wrote: reward.txt (one number) or reward.json ({"reward": x, other names: numbers,
    "role_rewards": {role: x}}; a single named number is the reward)."""
    text_file, json_file = logs / "reward.txt", logs / "reward.json"
    if text_file.is_file() or text_file.is_symlink():
        text = _read_written(text_file, task_id).strip()
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise TaskError(f"task {task_id!r}: tests/test.sh wrote {text[:80]!r} to /logs/verifier/reward.txt: "
                            "expected one number")
        return value, {}
    if json_file.is_file() or json_file.is_symlink():
        try:
            obj = json.loads(_read_written(json_file, task_id))
        except ValueError as exc:
            raise TaskError(f"task {task_id!r}: /logs/verifier/reward.json is not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise TaskError(f"task {task_id!r}: /logs/verifier/reward.json holds {type(obj).__name__}: expected "
                            "an object of named numbers")
        roles = obj.pop("role_rewards", None)
        numbers = {k: v for k, v in obj.items() if _number(v)}
        if bad := sorted(set(obj) - set(numbers)):
            raise TaskError(f"task {task_id!r}: /logs/verifier/reward.json: {', '.join(bad)} not a number")
        if roles is not None and not (isinstance(roles, dict) and all(_number(v) for v in roles.values())):
            raise TaskError(f"task {task_id!r}: /logs/verifier/reward.json: role_rewards must map role names to "
                            "numbers")
        if "reward" in numbers:
            reward = numbers.pop("reward")
        elif len(numbers) == 1:
            reward = numbers.popitem()[1]
        else:
            raise TaskError(f"task {task_id!r}: /logs/verifier/reward.json names {sorted(numbers) or 'no numbers'}: "
                            "say which is the reward with a \"reward\" entry")
        details = {"rewards": numbers} if numbers else {}
        if roles is not None:
            details["role_rewards"] = {k: float(v) for k, v in roles.items()}
        return float(reward), details
    raise TaskError(f"task {task_id!r}: tests/test.sh (exit {exit_code}) wrote no /logs/verifier/reward.txt or "
                    "reward.json")


def _read_written(path: Path, task_id: str, limit: int = 1 << 20) -> str:
    """A file the verifier wrote, as text: a plain file only (code the agent left ran there and may have made it a
    link to a host file), at most `limit` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        raise TaskError(f"task {task_id!r}: /logs/verifier/{path.name} is not a plain file") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise TaskError(f"task {task_id!r}: /logs/verifier/{path.name} is not a plain file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TaskError(f"task {task_id!r}: /logs/verifier/{path.name} is over {limit} bytes")
    return data.decode("utf-8", "replace")


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
