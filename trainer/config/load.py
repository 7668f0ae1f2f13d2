"""`harness train config.yaml`: one YAML file with the root `harness:`, read into a typed TrainConfig.

The keys, their defaults and help are declared in trainer/config/keys.py; this module reads the YAML into them,
applies `--set section.key=value` overrides and resolves paths; trainer/config/checks.py checks the values. Errors
name the key, the value and what to write instead (an AgentJet key name is pointed at its harness name,
`_AGENTJET_NAMES`).

Paths resolve relative to where they were written: the config file's directory for values in the file, the current
directory for `--set` overrides and for defaults. The resolved config holds absolute paths and loads back equal.
model.path may also be a Hugging Face id (`Qwen/Qwen2.5-1.5B-Instruct`): a value that is not there and is shaped
like one is kept as the id (harness/running/hub.py says the rule), and `harness train` loads the config with
`locate_model=True`, which makes it the snapshot directory in the local cache, downloading it if need be.

    runs/<experiment_name>/        run_dir(cfg)
        config.resolved.yaml       save_resolved(cfg)
        logs/  checkpoints/  ...
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from harness.running.gpus import Gpus
from harness.running.hub import ModelNotFoundError, hub_id_of, model_reference, resolve_model
from trainer.config.checks import ConfigError, Mode, check
from trainer.config.errors import raise_all
from trainer.config.keys import (
    ADV_ESTIMATORS,
    GROUP_ESTIMATORS,
    KL_TYPES,
    LOSS_AGG_MODES,
    ROOT,
    DataConfig,
    DebugConfig,
    EngineConfig,
    FsdpConfig,
    LoggingConfig,
    ModelConfig,
    RolloutConfig,
    TaskJudgeConfig,
    TrainConfig,
    TrainerConfig,
    ValidationSampling,
)
from trainer.config.reference import describe_config, iter_keys, key_name, optional_inner, type_text
from trainer.config.roles import role_rules, trains

__all__ = ["ConfigError", "role_rules", "trains", "load_config", "read_config", "config_to_dict", "save_resolved",
           "describe_config", "run_dir", "iter_keys", "Mode", "TrainConfig", "ModelConfig", "DataConfig",
           "TaskJudgeConfig", "RolloutConfig", "ValidationSampling", "EngineConfig", "TrainerConfig", "FsdpConfig",
           "LoggingConfig", "DebugConfig", "ADV_ESTIMATORS", "LOSS_AGG_MODES", "KL_TYPES", "GROUP_ESTIMATORS"]

RESOLVED_NAME = "config.resolved.yaml"

# AgentJet names a user may bring along, and where the same setting lives here (used only in error messages).
_AGENTJET_NAMES = {
    "ajet": "harness", "trainer_common": "trainer", "task_reader": "data.train / data.validation",
    "user_workflow": "rollout.agent", "max_env_worker": "rollout.concurrency", "train_batch_size": "rollout.batch_size",
    "val_kwargs": "rollout.validation", "val_pass_n": "rollout.validation.n", "judge_protocol": "task_judge.judge",
    "kl_loss_coef": "trainer.kl_coef", "kl_loss_type": "trainer.kl_type", "lr_warmup_steps": "trainer.warmup_steps",
    "lr_scheduler_type": "trainer.lr_schedule", "total_training_steps": "trainer.total_steps",
    "fsdp_config": "trainer.fsdp", "optim": "trainer (lr, betas, ... sit in trainer itself)",
    "algorithm": "trainer (adv_estimator, ... sit in trainer itself)", "debug_first_n_tasks": "debug.n_tasks",
    "experiment_dir": "logging.run_dir",
}


# ---------------------------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path, overrides: Sequence[str] = (), mode: Mode = "rl", *,
                locate_model: bool = False, gpus: Gpus | None = None) -> TrainConfig:
    """The config in the YAML file at `path`, with `overrides` ("trainer.lr=1e-5") applied, checked for `mode`:
    rl (`harness train`: rollouts need data.train and an agent), from_run (`harness train --from-run`: needs
    offline.run) or sft (`harness sft`: needs offline.data); offline modes need an agent only to validate. A config
    that names offline.run is checked as from_run whatever `mode` says: `harness train` then trains on that run.

    With `locate_model`, model.path becomes the model directory it names (a Hub id: its snapshot in the local cache,
    downloaded when missing and online) or a ConfigError says why it can't: what a command that uses the model does
    first. Without it the model need not exist yet, so a config can be read, shown and checked on any machine.
    The memory plan is checked against `gpus`, by default the GPUs this process sees (harness/running/gpus.py)."""
    cfg = read_config(path, overrides, locate_model=locate_model)
    check(cfg, Path(path).name, "from_run" if mode == "rl" and cfg.offline.run else mode, gpus)
    return cfg


def read_config(path: str | Path, overrides: Sequence[str] = (), *, locate_model: bool = False) -> TrainConfig:
    """The config in the YAML file at `path` with `overrides` applied, typed and its paths resolved, but not
    checked (load_config checks it): what `harness train FILE --show-config` shows and `--check` checks. A
    ConfigError names what can't be read: the file, or every unknown key and value of the wrong type (its
    `problems`, one each: the reading goes on past the first, so that a user fixes them in one go)."""
    path = Path(path)
    problems: list[str] = []  # every unknown key and unreadable value, of the file and of the overrides
    values = _walk(TrainConfig, _root(_read_yaml(path), path.name), "", path.resolve().parent, path.name, problems)
    for item in overrides:
        try:
            _override(values, item)
        except ConfigError as exc:
            problems += exc.problems
    raise_all(problems)
    if values.get("experiment_name") is None:
        values["experiment_name"] = path.stem
    rollout = values.setdefault("rollout", {})
    if rollout.get("cwd") is None:
        rollout["cwd"] = str(path.resolve().parent)
    cfg = _build(TrainConfig, values)
    if locate_model and cfg.model.path is not None:
        given_at = Path.cwd() if any(_sets_model_path(o) for o in overrides) else path.resolve().parent
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=_model_dir(cfg.model.path, given_at)))
    return cfg


def _model_dir(reference: str, given_at: Path) -> str:
    """model.path's directory; `given_at` is the folder a relative value was read against (for the error)."""
    try:
        return str(resolve_model(reference, "model.path", given_at))
    except ModelNotFoundError as exc:
        raise ConfigError(str(exc)) from None


def _sets_model_path(override: str) -> bool:
    return override.partition("=")[0].strip().removeprefix(ROOT + ".") == "model.path"


def run_dir(cfg: TrainConfig) -> Path:
    """The experiment's directory: <logging.run_dir>/<experiment_name> (logs/, checkpoints/, config.resolved.yaml)."""
    return Path(cfg.logging.run_dir) / cfg.experiment_name


def config_to_dict(cfg: TrainConfig) -> dict:
    """Every key of `cfg` as plain YAML/JSON values, sections nested, without the root."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        out[key_name(f)] = config_to_dict(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
    return out


def save_resolved(cfg: TrainConfig, directory: str | Path | None = None) -> Path:
    """Write the config, every key filled in and paths absolute, to <run dir>/config.resolved.yaml."""
    target = Path(directory if directory is not None else run_dir(cfg)) / RESOLVED_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump({ROOT: config_to_dict(cfg)}, sort_keys=False, allow_unicode=True)
    header = "# resolved by harness train: every key, paths absolute; docs/training.md\n"
    if cfg.model.path and (repo_id := hub_id_of(cfg.model.path)):
        header += f"# model.path is the Hugging Face model {repo_id} at commit {Path(cfg.model.path).name}\n"
    target.write_text(header + text)
    return target


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error rather than last-wins, and
    that a plain scalar with an underscore stays text: YAML 1.1 reads 0.5_5.0 as the number 0.55, where a bound
    pair "L_U" was meant (numbers with digit separators still load: the keys' coercion drops the underscores)."""

    def resolve(self, kind, value, implicit):
        tag = super().resolve(kind, value, implicit)
        if kind is yaml.ScalarNode and implicit[0] and "_" in value and tag in (_INT, _FLOAT):
            return "tag:yaml.org,2002:str"
        return tag

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` may be overridden key by key
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise ConfigError(f"key {key!r} appears twice in one section (line {key_node.start_mark.line + 1}): "
                                  "keep one")
            if isinstance(key, typing.Hashable):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found: give the path of a YAML file such as "
                          "examples/train/math.yaml") from None
    except OSError as exc:
        raise ConfigError(f"can't read config file {str(path)!r}: {exc}") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader that rejects repeated keys
    except ConfigError as exc:
        raise ConfigError(f"{path.name}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path.name} is not valid YAML: {exc}") from None


def _root(raw: Any, where: str) -> Any:
    sections = set(_fields(TrainConfig))
    if raw is None:
        raise ConfigError(f"{where} is empty: it needs a root 'harness:' holding the sections (see "
                          "examples/train/math.yaml)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping with one root 'harness:', got {type(raw).__name__}")
    if ROOT in raw and len(raw) == 1:
        return raw[ROOT]
    if "ajet" in raw:
        raise ConfigError(f"{where} has the AgentJet root 'ajet:'; harness reads the root 'harness:', whose keys "
                          "are listed by `harness train --show-config` and in docs/training.md")
    misplaced = sorted(str(k) for k in raw if k in sections)
    if misplaced:
        raise ConfigError(f"{where} has sections at the top level ({', '.join(misplaced)}): put them under the "
                          "single root 'harness:'")
    extra = sorted(str(k) for k in raw if k != ROOT)
    raise ConfigError(f"unknown top-level key {extra[0]!r} in {where}: the file holds one root, 'harness:'")


def _walk(cls: type, mapping: Any, prefix: str, base: Path, where: str, problems: list[str]) -> dict:
    """The values of one section as given in the file: types coerced, paths resolved against `base`. An unknown
    key or a value that can't be read is added to `problems` and left out, and the walk goes on."""
    if mapping is None:
        return {}
    if not isinstance(mapping, dict):
        problems.append(f"{prefix.rstrip('.') or ROOT} in {where} must be a section of keys, got {mapping!r}")
        return {}
    fields, hints, out = _fields(cls), typing.get_type_hints(cls), {}
    for name, value in mapping.items():
        if name not in fields:
            problems.append(f"unknown key {prefix + str(name)!r} in {where}: {_suggest(str(name), prefix, fields)}")
            continue
        f = fields[name]
        if dataclasses.is_dataclass(hints[f.name]):
            out[name] = _walk(hints[f.name], value, f"{prefix}{name}.", base, where, problems)
            continue
        try:
            out[name] = _value(f, hints[f.name], value, prefix + name, base)
        except ConfigError as exc:
            problems += exc.problems
    return out


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    """A section's fields by their keys in the YAML (reference.key_name)."""
    return {key_name(f): f for f in dataclasses.fields(cls)}


def _override(values: dict, item: str) -> None:
    """Apply one `section.key=value` to `values`, the value parsed by the key's type, paths against the cwd."""
    dotted, sep, raw = item.partition("=")
    dotted = dotted.strip().removeprefix(ROOT + ".")
    if not sep or not dotted:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. trainer.lr=1e-5")
    cls, node, prefix, parts = TrainConfig, values, "", dotted.split(".")
    for i, part in enumerate(parts):
        fields, hints = _fields(cls), typing.get_type_hints(cls)
        if part not in fields:
            raise ConfigError(f"unknown key {prefix + part!r} in --set {item}: {_suggest(part, prefix, fields)}")
        last, tp = i == len(parts) - 1, hints[fields[part].name]
        if dataclasses.is_dataclass(tp):
            if last:
                first = key_name(dataclasses.fields(tp)[0])
                raise ConfigError(f"--set {item}: {dotted!r} is a section; set one of its keys, e.g. "
                                  f"{dotted}.{first}=...")
            cls, node, prefix = tp, node.setdefault(part, {}), f"{prefix}{part}."
        elif not last:
            raise ConfigError(f"--set {item}: {prefix + part!r} is a key, not a section")
        else:
            node[part] = _value(fields[part], tp, _parse_raw(raw.strip(), tp, dotted), dotted, Path.cwd())


def _parse_raw(raw: str, tp: Any, key: str) -> Any:
    """A command-line string as the value a YAML file would have given for a key of type `tp`."""
    inner = optional_inner(tp)
    if raw.lower() in ("null", "none", "~", "") and (inner is not tp or inner is not str):
        return None  # _coerce says so if the key can't be null
    origin = typing.get_origin(inner)
    if origin not in (list, dict):
        return raw  # _coerce reads numbers and booleans from text
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: can't read {raw!r} as YAML: {exc}") from None
    if origin is list and not isinstance(value, list):
        value = [v.strip() for v in raw.split(",")] if "," in raw else [value]
    return value


def _value(f: dataclasses.Field, tp: Any, value: Any, key: str, base: Path) -> Any:
    value = _coerce(value, tp, key)
    kind = f.metadata.get("path")
    if kind and isinstance(value, list):  # a list of paths (rollout.sandbox_binds)
        return [_resolve(kind, v, base) if isinstance(v, str) else v for v in value]
    return _resolve(kind, value, base) if kind and value is not None else value


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """`value` as type `tp`, or a ConfigError naming the key, the value and what is expected."""
    inner = optional_inner(tp)
    if value is None:
        if inner is not tp:
            return None
        raise ConfigError(f"{key} can't be null: give {type_text(tp)}")
    tp, origin = inner, typing.get_origin(inner)
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, str) and all(isinstance(c, int) for c in choices):  # from --set: "1", "off"
            text = value.strip().lower()
            value = 0 if text in _FALSE else int(text) if text.isdigit() else value
        if value in choices:
            return choices[choices.index(value)]  # the choice itself: `sleep: off` (YAML's false) is 0
        by_lower = {str(c).lower(): c for c in choices}
        close = difflib.get_close_matches(str(value).lower(), list(by_lower), n=1)
        hint = f": did you mean {by_lower[close[0]]!r}?" if close else ""
        raise ConfigError(f"{key} must be one of {', '.join(map(repr, choices))}, got {value!r}{hint}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp in (int, float):
        number = _number(value, tp)
        if number is None:
            raise ConfigError(f"{key} must be {'an integer' if tp is int else 'a number'}, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key} must be a string, got {value!r}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, e.g. [a, b], got {value!r}")
        return [_coerce(v, typing.get_args(tp)[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping of names to values, got {value!r}")
        return {str(k): _coerce(v, typing.get_args(tp)[1], f"{key}.{k}") for k, v in value.items()}
    raise TypeError(f"config key {key}: type {tp!r} has no coercion")  # a bug in this module, not in a config


def _number(value: Any, tp: type) -> int | float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str):  # "1e-5": PyYAML reads exponents without a dot as text
        try:
            value = float(value.replace("_", "")) if tp is float else int(value.replace("_", ""))
        except ValueError:
            return None
    if isinstance(value, float) and tp is int:
        return int(value) if value.is_integer() else None
    return tp(value) if isinstance(value, (int, float)) else None


_PY_SPEC = re.compile(r"^(?P<file>.+\.py)(?P<sep>:|->)(?P<name>[A-Za-z_]\w*)$")
_FILE_SUFFIXES = {".jsonl", ".json", ".parquet", ".arrow", ".csv", ".py", ".yaml", ".yml"}


def _resolve(kind: str, value: str, base: Path) -> str:
    """A path written relative to `base` made absolute; a source, judge or model that is not a path is left alone."""
    if kind == "resume" and value in ("auto", "disable"):
        return value
    if kind == "model":  # a path, or a Hugging Face id kept as it is (never joined to `base`)
        return model_reference(value, base)
    if kind == "source":
        if "://" in value:
            return value
        if match := _PY_SPEC.match(value):
            return f"{_absolute(match['file'], base)}{match['sep']}{match['name']}"
        path = Path(value).expanduser()
        if not (path.is_absolute() or value.startswith((".", "~")) or path.suffix in _FILE_SUFFIXES
                or (base / path).exists()):
            return value  # a built-in judge, module:function, or a Hub dataset name
    return _absolute(value, base)


def _absolute(value: str, base: Path) -> str:
    return os.path.normpath(base / Path(value).expanduser())


def _build(cls: type, values: dict) -> Any:
    kwargs, hints = {}, typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], values.get(key_name(f), {}))
        elif key_name(f) in values:
            kwargs[f.name] = values[key_name(f)]
        elif f.metadata.get("path") and isinstance(f.default, str):  # a default path: relative to the cwd
            kwargs[f.name] = _resolve(f.metadata["path"], f.default, Path.cwd())
    return cls(**kwargs)


def _suggest(name: str, prefix: str, fields: dict) -> str:
    """What to write instead of the unknown key `name` in section `prefix`."""
    if name in _AGENTJET_NAMES:
        return f"harness calls it {_AGENTJET_NAMES[name]!r}"
    elsewhere = [k for k, *_ in iter_keys() if k.rsplit(".", 1)[-1] == name]
    if elsewhere:
        return f"did you mean {elsewhere[0]!r}?"
    close = difflib.get_close_matches(name, list(fields), n=1)
    if close:
        return f"did you mean {prefix + close[0]!r}?"
    return f"the keys of {prefix.rstrip('.') or ROOT} are {', '.join(fields)}"

