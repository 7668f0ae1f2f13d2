"""Judges: score one episode of an agent; the score is the reward RL trains on.

A judge is any callable

    judge(task: dict, answer: str | None, calls: list[dict]) -> float | bool | dict

or a class, instantiated once with no arguments, whose instances are such callables.

- task: the task object the agent was given (`Task.data`). The reference answer is by convention task["answer"],
  else task["expected"], task["reference"] or task["target"]; a list there means "any of these".
- answer: the agent's final answer (`EpisodeOutcome.answer`); None when it gave none.
- calls: the episode's recorded calls in order, one dict each (`Store.episode_calls` builds them):
    call_index         int, 0-based arrival order within the episode
    status             "ok", "error" or "cancelled"
    http_status        the HTTP status the agent got
    request            the request body the agent sent, parsed JSON (secrets removed)
    response           the answer it got, parsed JSON (a stream assembled into one completion); None if none
    prompt_tokens      int or None
    completion_tokens  int or None
    requested_model    the model name the agent asked for
    role               the call's role name when roles are named (`roles.match`, `--role`), else None
    engine_fault       "stream_broke_off" or "error_mid_stream" when the engine failed a stream the agent got a
                       200 for, else None
- the return value: a number (a bool counts as 1.0 / 0.0) or a dict with a numeric "reward"; the dict's other keys
  are kept as the judgement's details (stored as JSON). A "call_rewards" entry (a list by call_index, None for
  calls not scored, or {call_index: reward}) gives `harness train` per-call rewards on top of the outcome. A
  "role_rewards" entry ({role name: reward}) gives each named role its own reward (a role it leaves out gets
  "reward"); each role's samples are then compared only with that role's samples of the same task.

A judge is named by a spec (`load_judge`): a built-in short name (exact_match, math, substring, f1, rubric, env),
"module:function", "module:Class", "module->Class" (AgentJet's spelling) or "path/to/file.py:name".
`harness.running.judge_pool.JudgePool` runs a judge in worker processes, so that a judge that raises, hangs or crashes
becomes an error row instead of a dead run.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import math as pymath
import os
import re
import string
import sys
import types
import unicodedata
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson

__all__ = ["JudgeError", "LoadedJudge", "load_judge", "normalise_result", "reference_answers",
           "exact_match", "math", "substring", "f1", "RubricJudge", "parse_verdict", "BUILTIN_JUDGES"]

REFERENCE_KEYS = ("answer", "expected", "reference", "target")  # where a task keeps its reference answer
# The built-ins' names are stored with every judgement (`judgements.judge`) and written in users' configs, so they
# keep the module path they were first published under; this module answers to it.
PUBLISHED_AS = "harness.judges"
BUILTIN_JUDGES = {  # short name -> normalised spec
    "exact_match": "harness.judges:exact_match",
    "math": "harness.judges:math",
    "substring": "harness.judges:substring",
    "f1": "harness.judges:f1",
    "rubric": "harness.judges:RubricJudge",
    "env": "harness.judges:env",
}


class JudgeError(ValueError):
    """A judge spec that cannot be loaded, or a judge that returned something that is not a reward."""


# ---------------------------------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class LoadedJudge:
    """A judge ready to call: `judge(task, answer, calls) -> (reward, details)`."""

    name: str  # the normalised spec, e.g. "harness.judges:math" or "judges/qa.py:score"
    code_hash: str  # sha256 of the defining module's source (built-ins: of their own code), 16 hex chars
    fn: Callable = field(repr=False)  # the judge itself (a class is already instantiated)

    def __call__(self, task: dict, answer: str | None, calls: list[dict]) -> tuple[float, dict]:
        return normalise_result(self.name, self.fn(task, answer, calls))


def load_judge(spec: str) -> LoadedJudge:
    """Import the judge a spec names; raise JudgeError, naming the spec and what to do, if that is not possible.

    "module:name" imports with the current directory on sys.path (appended), so `harness run --judge
    myjudges:score` works from a project directory; "file.py:name" loads that file (relative to the current
    directory) with its own directory on sys.path, so it can import its neighbours.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise JudgeError(f"judge spec {spec!r} is empty; give a built-in judge ({', '.join(BUILTIN_JUDGES)}), "
                         "module:function, module:Class or path/to/file.py:function")
    given = spec.strip()
    normal = BUILTIN_JUDGES.get(given, given.replace("->", ":"))
    where, sep, attr = normal.rpartition(":")
    if not sep or not where or not attr:
        raise JudgeError(f"judge spec {given!r} is not a built-in judge ({', '.join(BUILTIN_JUDGES)}) and not of "
                         "the form module:function, module:Class, module->Class or path/to/file.py:function")
    if where.endswith(".py") or "/" in where or os.sep in where:
        module, shown = _load_file(where, given)
        normal = f"{shown}:{attr}"
    else:
        module, shown = _import_module(where, given), where
    target = _resolve(module, attr, shown, given)
    return LoadedJudge(name=normal, code_hash=_code_hash(target, module), fn=_instantiate(target, given))


def _load_file(where: str, spec: str) -> tuple[types.ModuleType, str]:
    path = Path(where).expanduser()
    if not path.is_file():
        raise JudgeError(f"judge file {where!r} does not exist (judge spec {spec!r}; a relative path starts at "
                         f"the current directory, {os.getcwd()})")
    path = path.resolve()
    try:
        shown = path.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        shown = path.as_posix()
    stem, digest = re.sub(r"\W", "_", path.stem), hashlib.sha1(str(path).encode()).hexdigest()[:8]
    name = f"_harness_judge_{stem}_{digest}"  # one module per file, whatever its name
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickle look their module up here
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        sys.modules.pop(name, None)
        raise JudgeError(f"loading judge file {where!r} failed: {type(e).__name__}: {e} (judge spec {spec!r})") from e
    return module, shown


def _import_module(name: str, spec: str) -> types.ModuleType:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        return sys.modules[__name__] if name == PUBLISHED_AS else importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise JudgeError(f"judge spec {spec!r}: no module named {e.name!r}; is it installed, or on PYTHONPATH, "
                             f"or in the current directory ({cwd})? A file is named as path/to/file.py:name") from e
        raise JudgeError(f"judge spec {spec!r}: importing {name!r} failed: {type(e).__name__}: {e}") from e
    except (Exception, SystemExit) as e:
        raise JudgeError(f"judge spec {spec!r}: importing {name!r} failed: {type(e).__name__}: {e}") from e


def _resolve(module: types.ModuleType, attr: str, shown: str, spec: str) -> object:
    target: object = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                             and getattr(v, "__module__", None) == module.__name__)
            hint = f"; it defines {', '.join(defined[:12])}" if defined else ""
            raise JudgeError(f"judge spec {spec!r}: {shown!r} has no attribute {attr!r}{hint}") from None
    return target


def _instantiate(target: object, spec: str) -> Callable:
    if inspect.isclass(target):
        try:
            judge = target()
        except JudgeError as e:
            raise JudgeError(f"judge spec {spec!r}: {e}") from e
        except Exception as e:
            raise JudgeError(f"judge spec {spec!r}: {target.__name__}() failed: {type(e).__name__}: {e} "
                             "(a judge class is instantiated with no arguments)") from e
        if not callable(judge):
            raise JudgeError(f"judge spec {spec!r}: instances of {target.__name__} are not callable; give it a "
                             "__call__(self, task, answer, calls) method")
        return judge
    if not callable(target):
        raise JudgeError(f"judge spec {spec!r} names a {type(target).__name__} ({target!r:.80}), not a function or "
                         "class; a judge is called as judge(task, answer, calls)")
    return target


def _code_hash(target: object, module: types.ModuleType) -> str:
    """A changed judge is a different judge: hash the source of the module that defines it."""
    try:
        defining = inspect.getmodule(target) or module
    except TypeError:
        defining = module
    if defining is sys.modules[__name__]:
        source = _builtin_source(target, set())
    else:
        file = getattr(defining, "__file__", None)
        if file and file.endswith(".py") and os.path.isfile(file):
            source = Path(file).read_text(errors="replace")
        else:
            try:
                source = inspect.getsource(defining)
            except (OSError, TypeError):
                source = f"{defining.__name__}:{getattr(target, '__qualname__', type(target).__qualname__)}"
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _builtin_source(obj: object, seen: set[str]) -> str:
    """A built-in's own source plus the helpers and constants of this module it uses, so that editing an
    unrelated judge in this file does not change its hash, but editing its number regex does."""
    seen.add(obj.__name__)
    codes = [obj.__code__] if inspect.isfunction(obj) else [v.__code__ for v in vars(obj).values()
                                                            if inspect.isfunction(v)]
    names: set[str] = set()
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    parts = [inspect.getsource(obj)]
    for name in sorted(names - seen):
        value = globals().get(name)
        if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == __name__:
            parts.append(_builtin_source(value, seen))
        elif isinstance(value, re.Pattern):
            parts.append(value.pattern)
        elif isinstance(value, (str, int, float, tuple, frozenset)):
            parts.append(repr(value))
    return "\n".join(parts)


def normalise_result(name: str, value: object) -> tuple[float, dict]:
    """(reward, details) from what a judge returned; JudgeError, naming the judge and the value, if it is no reward."""
    reward, details = value, {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise JudgeError(f"judge {name} returned a dict without a 'reward' key (keys: {sorted(map(str, value))}); "
                             "return a number or {'reward': <number>, ...}")
        reward, details = value["reward"], {k: v for k, v in value.items() if k != "reward"}
    if isinstance(reward, (str, bytes)) or not hasattr(type(reward), "__float__"):
        raise JudgeError(f"judge {name} returned {_show(value)}; expected a number, a bool or a dict with a numeric "
                         "'reward'")
    try:
        reward = float(reward)
    except (TypeError, ValueError, OverflowError) as e:
        raise JudgeError(f"judge {name} returned {_show(value)}, which is not a number: {e}") from e
    if not pymath.isfinite(reward):
        raise JudgeError(f"judge {name} returned a reward of {reward}; a reward must be a finite number")
    try:  # details are stored as JSON: make them so now, not when the store chokes on them
        details = orjson.loads(orjson.dumps(details, default=str,
                                            option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY))
    except orjson.JSONEncodeError as e:
        raise JudgeError(f"judge {name} returned details that cannot be stored as JSON: {e}") from e
    return reward, details


def _show(value: object) -> str:
    return f"{value!r:.200} ({type(value).__name__})"


# ---------------------------------------------------------------------------------------------------- built-ins


def reference_answers(task: dict) -> list[str]:
    """The task's reference answer(s): the first of REFERENCE_KEYS that is set; a list gives several."""
    for key in REFERENCE_KEYS:
        value = task.get(key)
        if value is not None:
            return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    raise ValueError(f"the task has no reference answer: none of {', '.join(REFERENCE_KEYS)} is set "
                     f"(task keys: {', '.join(map(str, task)) or 'none'})")


def _plain(text: str) -> str:
    """Unicode-width-, case- and whitespace-insensitive text."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def _clip(text: str | None, limit: int = 500) -> str | None:
    return text if text is None or len(text) <= limit else text[:limit] + "..."


def exact_match(task: dict, answer: str | None, calls: list[dict]) -> dict:
    """1.0 if the answer equals a reference, ignoring case, runs of whitespace, Unicode width and a final period."""
    refs = reference_answers(task)
    got = None if answer is None else _plain(answer).rstrip(".").rstrip()
    hit = got is not None and any(_plain(r).rstrip(".").rstrip() == got for r in refs)
    return {"reward": float(hit), "expected": refs[0] if len(refs) == 1 else refs, "got": _clip(answer)}


def substring(task: dict, answer: str | None, calls: list[dict]) -> dict:
    """1.0 if a reference appears in the answer, ignoring case and runs of whitespace."""
    refs = reference_answers(task)
    if not all(_plain(r) for r in refs):
        raise ValueError(f"the task's reference answer {refs!r} is empty; every answer would contain it")
    got = _plain(answer or "")
    hit = answer is not None and any(_plain(r) in got for r in refs)
    return {"reward": float(hit), "expected": refs[0] if len(refs) == 1 else refs, "got": _clip(answer)}


_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def _squad_tokens(text: str) -> list[str]:
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return _ARTICLES.sub(" ", text).split()


def _token_f1(pred: list[str], gold: list[str]) -> float:
    if not pred or not gold:
        return float(pred == gold)
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def f1(task: dict, answer: str | None, calls: list[dict]) -> dict:
    """Token F1 as in SQuAD (lowercase, no punctuation, no articles), best over the references."""
    refs = reference_answers(task)
    pred = _squad_tokens(answer or "")
    return {"reward": max(_token_f1(pred, _squad_tokens(r)) for r in refs), "got": _clip(answer)}


_NUM = r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+"
_NUMBER = re.compile(rf"(?<![\w.])(?P<num>{_NUM})(?:\s*/\s*(?P<den>{_NUM}))?")
_LATEX_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")


def _last_number(text: str) -> float | None:
    """The last number in a text: "1,234", "$5.00", "-3", "3/4", "\\frac{3}{4}", "1e-6"; None if there is none."""
    text = _LATEX_FRAC.sub(r"\1/\2", text).replace("\\$", "").replace("$", "").replace("\\,", "").replace("\\!", "")
    value = None
    for m in _NUMBER.finditer(text):
        num = float(m["num"].replace(",", ""))
        den = float(m["den"].replace(",", "")) if m["den"] else 1.0
        if den != 0:
            value = num / den
    return value


def math(task: dict, answer: str | None, calls: list[dict]) -> dict:
    """Numeric equality within 1e-6 relative. The reference's number follows GSM8K's "####" when there is one;
    the answer's is the last number in its last \\boxed{...}, else after its last "####", else anywhere."""
    refs = reference_answers(task)
    expected = [n for n in (_last_number(r.rpartition("####")[2]) for r in refs) if n is not None]
    if not expected:
        raise ValueError(f"the task's reference answer {refs[0] if len(refs) == 1 else refs!r:.200} contains no number")
    got = None
    if answer is not None:
        boxed = _BOXED.findall(answer)
        got = _last_number(boxed[-1] if boxed else answer.rpartition("####")[2])
    hit = got is not None and any(pymath.isclose(got, e, rel_tol=1e-6) for e in expected)
    return {"reward": float(hit), "expected": expected[0] if len(expected) == 1 else expected, "got": got}


# ---------------------------------------------------------------------------------------------------- rubric

DEFAULT_RUBRIC = ("Judge how well the answer accomplishes the task. Correctness matters most (agreement with the "
                  "reference answer, when one is given), then completeness, then clarity. The lowest score means "
                  "wrong, missing or off-topic; the highest means fully correct and complete.")
_SYSTEM = "You grade answers to tasks against a rubric. You are strict, fair and brief."
_TASK_KEYS = ("prompt", "question", "problem", "input", "instruction", "query", "messages")
_JSON_OBJECT = re.compile(r"\{.*\}", re.S)
_SCORE_LINE = re.compile(r"score\W{0,4}(-?\d+(?:\.\d+)?)", re.I)
_REASON_LINE = re.compile(r"reason\W{0,4}(.+)", re.I | re.S)


class RubricJudge:
    """LLM-as-judge, pointwise: a separately configured judge model grades the answer against a rubric.

    The judge model is never the policy and never trained: configure it with HARNESS_JUDGE_BASE_URL (an
    OpenAI-compatible /v1 endpoint that is not the harness proxy), HARNESS_JUDGE_MODEL and, if the server needs
    one, HARNESS_JUDGE_API_KEY, or with the constructor's arguments. The rubric is task["rubric"] or DEFAULT_RUBRIC.
    reward = (score - min_score) / (max_score - min_score), clipped to [0, 1]; passed = reward >= success_threshold.
    """

    def __init__(self, *, base_url: str | None = None, model: str | None = None, api_key: str | None = None,
                 min_score: float = 0.0, max_score: float = 10.0, success_threshold: float = 0.7,
                 timeout_s: float = 60.0, max_tokens: int = 512, temperature: float = 0.0):
        base_url = base_url or os.environ.get("HARNESS_JUDGE_BASE_URL")
        model = model or os.environ.get("HARNESS_JUDGE_MODEL")
        if not base_url:
            raise JudgeError("the rubric judge needs its own judge model: set HARNESS_JUDGE_BASE_URL to an "
                             "OpenAI-compatible endpoint (e.g. http://judge-host:8000/v1; not the policy's proxy) "
                             "and HARNESS_JUDGE_MODEL to the model it serves")
        if not model:
            raise JudgeError(f"the rubric judge needs a model name: set HARNESS_JUDGE_MODEL to a model that "
                             f"{base_url} serves")
        if not max_score > min_score:
            raise JudgeError(f"rubric judge: max_score ({max_score}) must be above min_score ({min_score})")
        if not 0.0 <= success_threshold <= 1.0:
            raise JudgeError(f"rubric judge: success_threshold ({success_threshold}) is a fraction of the score range, "
                             "between 0 and 1")
        import openai  # here, not at the top: the other judges and the judge workers start faster without it

        self.model, self.base_url = model, base_url
        self.min_score, self.max_score, self.success_threshold = float(min_score), float(max_score), success_threshold
        self.max_tokens, self.temperature = max_tokens, temperature
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or os.environ.get("HARNESS_JUDGE_API_KEY")
                                    or "none", timeout=timeout_s, max_retries=1)

    def __call__(self, task: dict, answer: str | None, calls: list[dict]) -> dict:
        if answer is None or not answer.strip():
            return {"reward": 0.0, "score": None, "reason": "no answer", "passed": False}
        reply = self.client.chat.completions.create(model=self.model, messages=self.messages(task, answer),
                                                    temperature=self.temperature, max_tokens=self.max_tokens)
        score, reason = parse_verdict(reply.choices[0].message.content or "")
        reward = min(1.0, max(0.0, (score - self.min_score) / (self.max_score - self.min_score)))
        return {"reward": reward, "score": score, "reason": reason, "passed": reward >= self.success_threshold,
                "judge_model": self.model}

    def messages(self, task: dict, answer: str) -> list[dict]:
        """The grading conversation sent to the judge model."""
        try:
            refs = reference_answers(task)
            reference = refs[0] if len(refs) == 1 else "any of: " + "; ".join(refs)
        except ValueError:
            reference = "(none given)"
        lo, hi = f"{self.min_score:g}", f"{self.max_score:g}"
        user = (f"## Task\n{_task_text(task)}\n\n## Reference answer\n{reference}\n\n## Answer to grade\n{answer}\n\n"
                f"## Rubric\n{task.get('rubric') or DEFAULT_RUBRIC}\n\n"
                f"Grade the answer from {lo} (worst) to {hi} (best). Reply with only a JSON object: "
                f'{{"score": <number from {lo} to {hi}>, "reason": "<one sentence>"}}')
        return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}]


def _task_text(task: dict) -> str:
    for key in _TASK_KEYS:
        value = task.get(key)
        if isinstance(value, str):
            return value
        if isinstance(value, list):  # chat messages
            return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, dict) else str(m)
                             for m in value)
    rest = {k: v for k, v in task.items() if k not in REFERENCE_KEYS and k != "rubric"}
    return json.dumps(rest, ensure_ascii=False, default=str)


def env(task: dict, answer: str | None, calls: list[dict]) -> dict:
    """The environment service scores its own instance of the task (docs/environments.md)."""
    from harness.running.tasks import evaluate_instance

    if not task.get("env_url") or not task.get("instance_id"):
        raise ValueError("the env judge scores tasks read from an environment service (--data http://...): "
                         "this task has no env_url / instance_id")
    result = evaluate_instance(task["env_url"], task["instance_id"], answer)
    return {"reward": result["reward"], **(result.get("details") or {})}


def parse_verdict(text: str) -> tuple[float, str]:
    """(score, reason) from a judge model's reply: a JSON {"score", "reason"} object (fenced or not), else a
    "Score: N" line. ValueError if the reply holds no score."""
    for candidate in (text, *_JSON_OBJECT.findall(text)):
        try:
            verdict = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(verdict, dict) and "score" in verdict:
            try:
                return float(verdict["score"]), str(verdict.get("reason", ""))
            except (TypeError, ValueError):
                break
    m = _SCORE_LINE.search(text)
    if m is None:
        raise ValueError(f"the judge model's reply holds no score: {text!r:.300}")
    reason = _REASON_LINE.search(text)
    return float(m[1]), (reason[1].strip() if reason else text.strip())[:500]
