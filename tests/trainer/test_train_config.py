"""`harness train config.yaml`: the typed config, its overrides, paths, error messages and key reference.

Real YAML files in tmp_path; nothing is faked and no engine is started.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest
import yaml

from trainer.config import (
    ConfigError,
    TrainConfig,
    config_to_dict,
    describe_config,
    iter_keys,
    load_config,
    run_dir,
    save_resolved,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train" / "math.yaml"
TRAINING_DOC = REPO / "docs" / "training.md"
BASE = {"harness": {
    "model": {"path": "model"},
    "data": {"train": "tasks.jsonl"},
    "task_judge": {"judge": "math"},
    "rollout": {"agent": "agent.py"},
}}  # fmt: skip


def write_config(tmp_path: Path, sections: dict | None = None, *, drop: tuple[str, ...] = (),
                 name: str = "config.yaml") -> Path:
    """A config next to a real agent file: BASE with `sections` merged in and the dotted keys in `drop` removed."""
    (tmp_path / "agent.py").write_text("print('{\"answer\": \"1\"}')\n")
    tree = copy.deepcopy(BASE)
    for section, keys in (sections or {}).items():
        if isinstance(keys, dict) and isinstance(tree["harness"].get(section), dict):
            tree["harness"][section].update(keys)
        else:
            tree["harness"][section] = keys
    for dotted in drop:
        section, key = dotted.split(".")
        del tree["harness"][section][key]
    path = tmp_path / name
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


# ---------------------------------------------------------------------------------------------------------------
# Loading


def test_example_config_loads_with_paths_relative_to_its_directory():
    cfg = load_config(EXAMPLE)
    assert cfg.experiment_name == "math"
    assert cfg.rollout.agent == str(REPO / "examples" / "math_agent" / "agent.py")
    assert cfg.data.train == str(REPO / "examples" / "math_agent" / "tasks.jsonl")
    assert cfg.model.path == str(REPO / "runs" / "tiny")
    assert cfg.task_judge.judge == "math"  # a built-in judge name is not a path
    assert cfg.rollout.cwd == str(EXAMPLE.parent)
    assert run_dir(cfg) == REPO / "runs" / "math"
    assert cfg.trainer.lr == pytest.approx(1e-5)


@pytest.mark.parametrize("example", sorted(EXAMPLE.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_load_with_readable_tasks_and_judge(example):
    from harness.running.judges import load_judge
    from harness.running.tasks import read_tasks

    cfg = load_config(example)
    assert len(read_tasks(cfg.data.train, split=cfg.data.split)) >= cfg.rollout.batch_size
    if cfg.data.validation:
        assert read_tasks(cfg.data.validation, split=cfg.data.validation_split)
    load_judge(cfg.task_judge.judge)


def test_defaults_fill_every_key_left_out(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(write_config(tmp_path, name="my-run.yaml"))
    assert cfg.experiment_name == "my-run"  # the file's name
    assert cfg.logging.run_dir == str(tmp_path / "runs")  # a default path: relative to the current directory
    assert cfg.rollout.cwd == str(tmp_path)
    assert cfg.trainer == type(cfg.trainer)(resume="auto")
    assert cfg.rollout.num_repeat == 4 and cfg.trainer.adv_estimator == "grpo"


def test_exponent_without_a_dot_is_a_number(tmp_path):
    path = tmp_path / "c.yaml"
    write_config(tmp_path, name="c.yaml")
    path.write_text(path.read_text() + "  trainer:\n    lr: 1e-5\n    weight_decay: 0\n")
    cfg = load_config(path)
    assert cfg.trainer.lr == pytest.approx(1e-5) and isinstance(cfg.trainer.lr, float)
    assert cfg.trainer.weight_decay == 0.0 and isinstance(cfg.trainer.weight_decay, float)


def test_overrides_are_parsed_by_the_key_type(tmp_path):
    cfg = load_config(write_config(tmp_path), [
        "trainer.lr=1e-5", "rollout.num_repeat=8", "trainer.resume=disable", "trainer.val_before_train=false",
        "rollout.max_tokens=128", "rollout.max_tokens=null", "trainer.adv_estimator=rloo", "trainer.betas=[0.9, 0.95]",
        "rollout.engine.extra_args=--enforce-eager", "harness.debug.enabled=yes", "rollout.env={HF_HOME: /tmp/hf}",
        "trainer.fsdp.nprocs=2", "experiment_name=2024",
    ])  # fmt: skip
    assert cfg.trainer.lr == pytest.approx(1e-5)
    assert cfg.rollout.num_repeat == 8
    assert cfg.trainer.resume == "disable"
    assert cfg.trainer.val_before_train is False
    assert cfg.rollout.max_tokens is None  # the later override wins
    assert cfg.trainer.adv_estimator == "rloo"
    assert cfg.trainer.betas == [0.9, 0.95]
    assert cfg.rollout.engine.extra_args == ["--enforce-eager"]
    assert cfg.debug.enabled is True
    assert cfg.rollout.env == {"HF_HOME": "/tmp/hf"}
    assert cfg.trainer.fsdp.nprocs == 2
    assert cfg.experiment_name == "2024"


def test_override_paths_are_relative_to_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    config = write_config(tmp_path / "conf")
    (tmp_path / "other.py").write_text("print(1)\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(config, ["rollout.agent=other.py", "logging.run_dir=out"])
    assert cfg.rollout.agent == str(tmp_path / "other.py")
    assert cfg.logging.run_dir == str(tmp_path / "out")
    assert cfg.model.path == str(tmp_path / "conf" / "model")  # written in the file: relative to the file


@pytest.mark.parametrize(("given", "resolved"), [
    ("math", "math"),  # a built-in judge
    ("myjudges:score", "myjudges:score"),  # module:function
    ("judges.py:score", "{dir}/judges.py:score"),  # path.py:name, the file part resolved
    ("judges.py->Scorer", "{dir}/judges.py->Scorer"),
    ("../shared/judge.py:score", "{parent}/shared/judge.py:score"),
])  # fmt: skip
def test_judge_specs_resolve_only_their_file_part(tmp_path, given, resolved):
    cfg = load_config(write_config(tmp_path, {"task_judge": {"judge": given}}))
    assert cfg.task_judge.judge == resolved.format(dir=tmp_path, parent=tmp_path.parent)


@pytest.mark.parametrize(("given", "resolved"), [
    ("tasks.jsonl", "{dir}/tasks.jsonl"),
    ("./data", "{dir}/data"),
    ("openai/gsm8k", "openai/gsm8k"),  # a Hub name, not a local directory
    ("openai/gsm8k:main", "openai/gsm8k:main"),
    ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),  # an environment service
    ("mytasks:make", "mytasks:make"),
])  # fmt: skip
def test_data_sources_resolve_only_when_they_are_paths(tmp_path, given, resolved):
    cfg = load_config(write_config(tmp_path, {"data": {"train": given}}))
    assert cfg.data.train == resolved.format(dir=tmp_path)


def test_a_local_directory_shadows_a_hub_name(tmp_path):
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert load_config(write_config(tmp_path, {"data": {"train": "org/name"}})).data.train == str(tmp_path / "org/name")


def test_command_agent_runs_in_cwd(tmp_path):
    cfg = load_config(write_config(tmp_path, {"rollout": {"command": "node agent.js", "cwd": "agents"}},
                                   drop=("rollout.agent",)))
    assert cfg.rollout.command == "node agent.js"
    assert cfg.rollout.cwd == str(tmp_path / "agents")


def test_yaml_merge_keys_may_be_overridden(tmp_path):
    path = write_config(tmp_path)
    path.write_text(path.read_text() + "  debug:\n    <<: {n_tasks: 3, seed: 1}\n    seed: 5\n")
    cfg = load_config(path)
    assert (cfg.debug.n_tasks, cfg.debug.seed) == (3, 5)


# ---------------------------------------------------------------------------------------------------------------
# Round trip


def test_resolved_config_loads_back_equal(tmp_path, monkeypatch):
    cfg = load_config(EXAMPLE, ["trainer.lr=3e-6", "rollout.env={A: b}", "trainer.tis_cap=2"])
    target = save_resolved(cfg, tmp_path / "math")
    assert target == tmp_path / "math" / "config.resolved.yaml"
    monkeypatch.chdir(tmp_path)  # absolute paths: loading from elsewhere changes nothing
    assert load_config(target) == cfg


def test_save_resolved_defaults_to_the_run_dir(tmp_path):
    cfg = load_config(write_config(tmp_path), [f"logging.run_dir={tmp_path / 'runs'}"])
    target = save_resolved(cfg)
    assert target == tmp_path / "runs" / "config" / "config.resolved.yaml"
    assert yaml.safe_load(target.read_text())["harness"]["experiment_name"] == "config"


def test_config_to_dict_is_plain_json(tmp_path):
    data = config_to_dict(load_config(EXAMPLE))
    assert json.loads(json.dumps(data)) == data
    assert data["trainer"]["fsdp"]["nprocs"] == 1 and "harness" not in data


# ---------------------------------------------------------------------------------------------------------------
# Errors: each names the key, the value and what to do


@pytest.mark.parametrize(("sections", "message"), [
    ({"trainer": {"lrr": 1e-5}}, "unknown key 'trainer.lrr' in config.yaml: did you mean 'trainer.lr'?"),
    ({"trainer": {"num_repeat": 8}}, "unknown key 'trainer.num_repeat' in config.yaml: did you mean "
                                     "'rollout.num_repeat'?"),
    ({"trainer_common": {"lr": 1}}, "unknown key 'trainer_common' in config.yaml: harness calls it 'trainer'"),
    ({"rollout": {"user_workflow": "x->Y"}}, "harness calls it 'rollout.agent'"),
    ({"trainer": {"zzz": 1}}, "the keys of trainer are adv_estimator, loss_agg_mode"),
    ({"trainer": {"lr": "fast"}}, "trainer.lr must be a number, got 'fast'"),
    ({"rollout": {"batch_size": 2.5}}, "rollout.batch_size must be an integer, got 2.5"),
    ({"rollout": {"batch_size": True}}, "rollout.batch_size must be an integer, got True"),
    ({"rollout": {"batch_size": None}}, "rollout.batch_size can't be null: give integer"),
    ({"logging": {"wandb": "maybe"}}, "logging.wandb must be true or false, got 'maybe'"),
    ({"trainer": {"adv_estimator": "gpro"}}, "trainer.adv_estimator must be one of 'grpo', 'grpo_no_std', 'drgrpo', "
                                             "'rloo', 'reinforce_pp', 'reinforce_pp_baseline', 'gae', 'remax', got "
                                             "'gpro': did you mean 'grpo'?"),
    ({"trainer": {"loss_agg_mode": "mean"}}, "trainer.loss_agg_mode must be one of 'token-mean'"),
    ({"trainer": {"kl_type": "low_var_kl"}}, "trainer.kl_type must be one of 'k1', 'k2', 'k3', 'abs'"),
    ({"trainer": {"betas": 0.9}}, "trainer.betas must be a list, e.g. [a, b], got 0.9"),
    ({"trainer": {"betas": [0.9, "x"]}}, "trainer.betas[1] must be a number, got 'x'"),
    ({"trainer": {"betas": [0.9, 0.99, 0.5]}}, "trainer.betas must be two numbers in [0, 1), got [0.9, 0.99, 0.5]"),
    ({"rollout": {"env": ["A=b"]}}, "rollout.env must be a mapping of names to values"),
    ({"trainer": 5}, "trainer in config.yaml must be a section of keys, got 5"),
    ({"trainer": {"clip_low": 1.5}}, "trainer.clip_low must be in (0, 1), got 1.5"),
    ({"trainer": {"lr": 0}}, "trainer.lr must be > 0, got 0.0"),
    ({"trainer": {"dual_clip": 0.5}}, "trainer.dual_clip must be > 1, got 0.5"),
    ({"rollout": {"top_p": 1.5}}, "rollout.top_p must be in (0, 1], got 1.5"),
    ({"rollout": {"temperature": 0}}, "rollout.temperature must be in (0, 10], got 0.0"),
    ({"rollout": {"concurrency": 0}}, "rollout.concurrency must be >= 1, got 0"),
    ({"rollout": {"num_repeat": 1}}, "rollout.num_repeat must be >= 2 for trainer.adv_estimator 'grpo'"),
    ({"trainer": {"mini_batch_size": 3}}, "trainer.mini_batch_size 3 must divide rollout.batch_size 8"),
    ({"trainer": {"use_kl_in_reward": True}}, "trainer.use_kl_in_reward needs trainer.kl_coef > 0"),
    ({"trainer": {"val_before_train": True}}, "trainer.val_before_train needs validation tasks: set data.validation"),
    ({"rollout": {"validation": {"n": 4}}}, "rollout.validation.n 4 with temperature 0 repeats one greedy episode"),
    ({"trainer": {"resume": "ckpt/step-3"}}, "trainer.resume '{dir}/ckpt/step-3' does not exist: use auto, disable, "
                                             "or a checkpoint directory"),
    ({"experiment_name": "a/b"}, "experiment_name 'a/b' must be a directory name"),
    ({"rollout": {"tool_parser": "nope"}}, "unknown tool parser 'nope': use one of vLLM's --tool-call-parser names"),
    ({"rollout": {"reasoning_parser": "qwen"}}, "unknown reasoning parser 'qwen': use one of"),
    ({"rollout": {"reasoning_history": "drop"}}, "reasoning_history"),
    ({"rollout": {"engine": {"url": "localhost:8000"}}}, "rollout.engine.url 'localhost:8000' must start with http://"),
    ({"rollout": {"agent": "missing.py"}}, "rollout.agent '{dir}/missing.py' is not a file"),
    ({"rollout": {"command": "python agent.py"}}, "give rollout.agent or rollout.command, not both"),
    ({"rollout": {"agent": None}}, "rollout.agent (a Python file) or rollout.command (any command) is required"),
    ({"rollout": {"agent": None, "command": "python 'agent.py"}}, "is not a command a shell could split"),
    ({"data": {"train": None}}, "data.train is required (training tasks: "),
    ({"model": {"path": None}}, "model.path is required"),
    ({"task_judge": {"judge": None}}, "task_judge.judge is required"),
])  # fmt: skip
def test_bad_values_are_named_with_what_to_do(tmp_path, sections, message):
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, sections))
    assert message.format(dir=tmp_path) in str(info.value)


def test_harbor_tasks_need_no_judge_and_refuse_one(tmp_path):
    """Harbor tasks are judged by their own tests/test.sh: task_judge.judge is not required, and one given is
    refused with what to do."""
    harbor = str(REPO / "examples" / "harbor_tasks")
    cfg = load_config(write_config(tmp_path, {"data": {"train": harbor}, "task_judge": {"judge": None},
                                              "rollout": {"sandbox": "bwrap", "blocked_commands": ["git"],
                                                          "sandbox_binds": ["node_modules"]}}))
    assert cfg.task_judge.judge is None and cfg.rollout.sandbox == "bwrap"
    assert cfg.rollout.sandbox_binds == [str(tmp_path / "node_modules")]  # relative to the config file
    with pytest.raises(ConfigError, match="are judged by their own tests/test.sh: leave task_judge.judge out"):
        load_config(write_config(tmp_path, {"data": {"train": harbor}}))


def test_group_size_one_is_fine_without_a_group_estimator(tmp_path):
    sections = {"rollout": {"num_repeat": 1}, "trainer": {"adv_estimator": "reinforce_pp"}}
    cfg = load_config(write_config(tmp_path, sections))
    assert cfg.rollout.num_repeat == 1


@pytest.mark.parametrize(("text", "message"), [
    ("", "config.yaml is empty: it needs a root 'harness:'"),
    ("- a\n- b\n", "config.yaml must be a mapping with one root 'harness:', got list"),
    ("ajet:\n  model: {path: x}\n", "config.yaml has the AgentJet root 'ajet:'"),
    ("model: {path: x}\ntrainer: {lr: 1}\n", "has sections at the top level (model, trainer): put them under the "
                                             "single root 'harness:'"),
    ("harness: {}\nextra: 1\n", "unknown top-level key 'extra' in config.yaml"),
    ("harness:\n  trainer:\n    lr: 1\n    lr: 2\n", "config.yaml: key 'lr' appears twice in one section (line 4)"),
    ("harness:\n  trainer: [\n", "config.yaml is not valid YAML"),
])  # fmt: skip
def test_bad_files_are_named_with_what_to_do(tmp_path, text, message):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(f"config file '{tmp_path / 'nope.yaml'}' not found")):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize(("override", "message"), [
    ("trainer.lrr=1", "unknown key 'trainer.lrr' in --set trainer.lrr=1: did you mean 'trainer.lr'?"),
    ("trainer.lr=fast", "trainer.lr must be a number, got 'fast'"),
    ("rollout.num_repeat=four", "rollout.num_repeat must be an integer, got 'four'"),
    ("trainer.lr", "override 'trainer.lr' must look like section.key=value, e.g. trainer.lr=1e-5"),
    ("trainer=1", "--set trainer=1: 'trainer' is a section; set one of its keys, e.g. trainer.adv_estimator=..."),
    ("trainer.lr.x=1", "--set trainer.lr.x=1: 'trainer.lr' is a key, not a section"),
    ("trainer.betas=[0.9", "trainer.betas: can't read '[0.9' as YAML"),
    ("rollout.batch_size=null", "rollout.batch_size can't be null"),
    ("trainer.resume=elsewhere", "trainer.resume '{cwd}/elsewhere' does not exist"),
])  # fmt: skip
def test_bad_overrides_are_named_with_what_to_do(tmp_path, monkeypatch, override, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path), [override])
    assert message.format(cwd=tmp_path) in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# The key reference


def _fields(cls: type, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f.name.removesuffix("_") if f.name == "async_" else f.name  # a keyword as a key
        yield prefix + name, f
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _fields(hints[f.name], f"{prefix}{name}.")


def test_every_key_has_help_and_a_default():
    keys = list(_fields(TrainConfig))
    assert len(keys) > 60
    for key, f in keys:
        assert f.metadata.get("help", "").strip(), f"{key} has no help string"
        assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, key
    TrainConfig()  # every section builds from its defaults alone


def test_describe_config_lists_every_key_with_its_help():
    text = describe_config()
    for key, section, f in ((k, s, f) for k, f, _, s in iter_keys()):
        shown = rf"^\[{re.escape(key)}\]  " if section else rf"^{re.escape(key)}  \("
        assert re.search(shown, text, re.M), f"{key} missing from describe_config()"
        assert f.metadata["help"] in text
    assert "trainer.clip_low  (number, in (0, 1); default 0.2)" in text
    assert "model.path  (string; default required)" in text


def test_iter_keys_matches_the_dataclass_tree():
    assert [k for k, *_ in iter_keys()] == [k for k, _ in _fields(TrainConfig)]


def test_docs_hold_the_generated_key_reference():
    doc = TRAINING_DOC.read_text()
    match = re.search(r"<!-- config-reference:start -->\n(.*?)<!-- config-reference:end -->", doc, re.S)
    assert match, "docs/training.md has no config reference block"
    assert match.group(1).strip() == describe_config(markdown=True).strip(), (
        "docs/training.md's key reference is stale: regenerate it with `python -m trainer.config --markdown`")
    for key, _ in _fields(TrainConfig):
        assert f"`{key}`" in doc, f"docs/training.md does not list {key}"


@pytest.mark.parametrize("tie", [True, None, False])
def test_a_tied_model_on_an_engine_the_user_started_is_refused_when_the_config_loads(tmp_path, tie):
    """vLLM's reload would keep such an engine's output layer; harness's own engines serve an untied view
    (trainer/model/tied.py), and LoRA leaves the embeddings frozen, so only this pair is refused (a config that does not
    say: its architecture's default, as transformers reads it; Gemma's ties)."""
    config = {"model_type": "gemma"} if tie is None else {"model_type": "llama", "tie_word_embeddings": tie}
    untied = {"lm_head.weight"} if tie is False else set()  # an untied model has an output layer of its own
    _model_dir(tmp_path / "model", config, {"model.embed_tokens.weight", *untied})
    attached = {"rollout": {"engine": {"url": "http://127.0.0.1:8000"}}}
    if tie is False:
        load_config(write_config(tmp_path, attached))
        return
    with pytest.raises(ConfigError, match=r"ties its input and output embeddings.*Leave rollout.engine.url out"):
        load_config(write_config(tmp_path, attached))
    load_config(write_config(tmp_path))  # harness starts the engine
    load_config(write_config(tmp_path, {**attached, "trainer": {"lora": {"rank": 8}}}))


def _model_dir(path: Path, config: dict, tensors: set[str], weights: str = "model.safetensors") -> Path:
    """A model directory as far as a config check reads it: its config and the tensor names of its weights."""
    import numpy as np
    from safetensors.numpy import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({name: np.zeros((2, 2), np.float32) for name in tensors}, str(path / weights))
    return path


@pytest.mark.parametrize("weights, tensors, message", [
    ("pytorch_model.bin", {"model.embed_tokens.weight"}, r"has no \.safetensors weights.*convert them"),
    ("model.safetensors", {"transformer.wte.weight"}, r"no 'model\.embed_tokens\.weight' to write out.*LoRA"),
])  # fmt: skip
def test_a_tied_model_harness_cannot_serve_untied_is_refused_when_the_config_loads(tmp_path, weights, tensors,
                                                                                   message):
    """Its engine serves the untied view (trainer/model/tied.py engine_view), written from safetensors that name the
    embeddings: a model that has neither is refused in one line before anything starts; with LoRA the engine serves
    it as shipped, and without an engine (harness sft) nothing is served."""
    model = _model_dir(tmp_path / "model", {"model_type": "llama", "tie_word_embeddings": True}, tensors, weights)
    with pytest.raises(ConfigError, match=message) as refused:
        load_config(write_config(tmp_path))
    assert str(refused.value).startswith(f"model.path {str(model)!r} ties its input and output embeddings")
    assert "\n" not in str(refused.value)
    load_config(write_config(tmp_path, {"trainer": {"lora": {"rank": 8}}}))
    load_config(write_config(tmp_path, {"offline": {"data": "chat.jsonl"}}, drop=("data.train",)), mode="sft")


# ---------------------------------------------------------------------------------------------------------------
# model.path: a directory or a Hugging Face id (harness/running/hub.py; the cache written as huggingface_hub does)

QWEN = "Qwen/Qwen2.5-1.5B-Instruct"


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache (HF_HUB_CACHE), offline: nothing here may reach the network."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf-cache"


def test_a_hub_id_in_model_path_is_kept_as_written_not_joined_to_the_config_folder(tmp_path, monkeypatch):
    assert load_config(write_config(tmp_path, {"model": {"path": QWEN}})).model.path == QWEN
    assert load_config(write_config(tmp_path, {"model": {"path": f"./{QWEN}"}})).model.path == str(tmp_path / QWEN)
    monkeypatch.chdir(tmp_path)
    assert load_config(write_config(tmp_path), [f"model.path={QWEN}"]).model.path == QWEN
    (tmp_path / "Qwen" / "Qwen2.5-1.5B-Instruct").mkdir(parents=True)  # a folder of that name wins, as in transformers
    assert load_config(write_config(tmp_path, {"model": {"path": QWEN}})).model.path == str(tmp_path / QWEN)


def test_locate_model_makes_a_cached_hub_id_its_snapshot_and_the_resolved_config_names_both(tmp_path, hf_cache,
                                                                                              monkeypatch):
    from tests.running.hub_cache import COMMIT, NO_TENSORS, cache_model

    snapshot = cache_model(hf_cache, QWEN, {"config.json": b'{"model_type": "qwen2"}', "model.safetensors": NO_TENSORS})
    config = write_config(tmp_path, {"model": {"path": QWEN}})
    assert load_config(config).model.path == QWEN  # only reading the config: the model is not looked for
    cfg = load_config(config, locate_model=True)
    assert cfg.model.path == str(snapshot)
    target = save_resolved(cfg, tmp_path / "run")
    assert f"# model.path is the Hugging Face model {QWEN} at commit {COMMIT}\n" in target.read_text()
    monkeypatch.delenv("HF_HUB_CACHE")  # the resolved config names the directory: no cache lookup to load it back
    assert load_config(target, locate_model=True) == cfg


def test_locate_model_refuses_what_names_no_model_in_one_line(tmp_path, hf_cache, monkeypatch):
    for written in ("./models/tiny", "models/tiny/hf"):  # paths: they start with . or have two slashes
        with pytest.raises(ConfigError) as exc:
            load_config(write_config(tmp_path, {"model": {"path": written}}), locate_model=True)
        assert str(exc.value).startswith(f"model.path {str(tmp_path / written)!r} is not a directory: give a model "
                                         "directory")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"model.path '.*/empty' has no config.json"):
        load_config(write_config(tmp_path, {"model": {"path": "empty"}}), locate_model=True)
    for written in (QWEN, "models/tiny"):  # shaped like ids: the folder they were looked for in is named too
        with pytest.raises(ConfigError) as exc:
            load_config(write_config(tmp_path, {"model": {"path": written}}), locate_model=True)
        text = str(exc.value)
        assert "\n" not in text and text.startswith(f"model.path {written!r} is no folder in {str(tmp_path)!r}, nor "
                                                    f"in the Hugging Face cache {str(hf_cache)!r}")
        assert f"`hf download {written}`" in text
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # --set: relative to the current directory, and said so
    with pytest.raises(ConfigError, match=f"is no folder in {re.escape(repr(str(tmp_path / 'elsewhere')))}"):
        load_config(write_config(tmp_path), [f"model.path={QWEN}"], locate_model=True)


def test_a_tied_hub_model_on_an_engine_the_user_started_is_refused_once_located(tmp_path, hf_cache):
    """The checks see the model's own config.json once the id is located: the tie check of the test above holds
    for a model given by id."""
    from tests.running.hub_cache import NO_TENSORS, cache_model

    cache_model(hf_cache, "org/tied", {"config.json": b'{"model_type": "llama", "tie_word_embeddings": true}',
                                       "model.safetensors": NO_TENSORS})
    config = write_config(tmp_path, {"model": {"path": "org/tied"}, "rollout": {"engine": {"url": "http://x:1"}}})
    load_config(config)  # not located: nothing to check against yet
    with pytest.raises(ConfigError, match="ties its input and output embeddings"):
        load_config(config, locate_model=True)


def test_harness_train_with_an_uncached_hub_id_offline_exits_2_naming_the_fetch_command(tmp_path, hf_cache,
                                                                                       capsys):
    from harness.cli.main import main

    rc = main(["train", str(EXAMPLE), f"--set=model.path={QWEN}", f"--set=logging.run_dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: model.path {QWEN!r} is no folder in ") and f"hf download {QWEN}" in err[0]
    assert not (tmp_path / "math").exists()  # refused before the run began


def test_sft_needs_no_judge_unless_it_validates_with_the_agent(tmp_path):
    """Fine-tuning on chat records judges nothing: task_judge.judge is required for RL and for validation only."""
    sft = {"offline": {"data": "chat.jsonl"}}
    cfg = load_config(write_config(tmp_path, sft, drop=("data.train", "task_judge.judge")), mode="sft")
    assert cfg.task_judge.judge is None
    with pytest.raises(ConfigError, match="task_judge.judge is required"):
        load_config(write_config(tmp_path, {**sft, "data": {"validation": "tasks.jsonl"}},
                                 drop=("data.train", "task_judge.judge")), mode="sft")
    with pytest.raises(ConfigError, match="task_judge.judge is required"):
        load_config(write_config(tmp_path, drop=("task_judge.judge",)))


@pytest.mark.parametrize("overrides,message", [
    (["trainer.correction.level=tokens"], "trainer.correction.level must be one of 'off', 'token', 'sequence', got "
                                          "'tokens': did you mean 'token'?"),
    (["trainer.correction.level=token", "trainer.correction.threshold=5_0.5"],
     "trainer.correction.threshold '5_0.5': the lower bound 5 is above the upper 0.5"),
    (["trainer.correction.level=sequence", "trainer.correction.threshold=big"],
     "trainer.correction.threshold must be a number, got 'big'"),
    (["trainer.correction.threshold=0.5_5.0"], "trainer.correction.threshold '0.5_5.0' bounds importance weights: "
                                               "set trainer.correction.level"),
    (["trainer.correction.reject=seq_mean_k4", "trainer.correction.reject_threshold=0.1"],
     "trainer.correction.reject: unknown rejection option(s) ['seq_mean_k4']: choose from token_k1"),
    (["trainer.correction.reject=seq_mean_k3"], "trainer.correction.reject 'seq_mean_k3' needs "
                                                "trainer.correction.reject_threshold"),
    (["trainer.correction.reject=seq_mean_k3", "trainer.correction.reject_threshold=0.5_2"],
     "the seq_mean_k3 threshold '0.5_2': k2 and k3 take an upper bound only"),
    (["trainer.correction.reject=token_k1,seq_max_k2", "trainer.correction.reject_threshold=0.5_2,0.1,3"],
     "3 rejection thresholds for 2 options"),
    (["trainer.correction.reject_threshold=0.1"], "reject_threshold '0.1' bounds rejection options: set "
                                                  "trainer.correction.reject too"),
    (["trainer.correction.batch_normalize=true"], "batch_normalize normalises importance weights: set "
                                                  "trainer.correction.level"),
    (["trainer.correction.loss=reinforce"], "trainer.correction.loss 'reinforce' is the loss of mode bypass"),
    (["trainer.correction.mode=bypassed"], "did you mean 'bypass'?"),
    (["trainer.tis_cap=2", "trainer.correction.level=token"], "trainer.tis_cap 2 is the short form of "
                                                              "trainer.correction.level: token"),
    (["rollout.async.max_staleness=1"], "rollout.async.max_staleness 1 trains on episodes sampled with older "
                                        "weights: choose an off-policy correction"),
    (["trainer.correction.reject=token_k1", "trainer.correction.reject_threshold=abc"],
     "trainer.correction.reject_threshold: the token_k1 threshold must be a number, got 'abc'"),
    (["trainer.tis_cap=2", "trainer.correction.threshold=3"], "trainer.tis_cap 2 is the weights' bound already: "
                                                              "drop trainer.correction.threshold '3'"),
])
def test_a_bad_correction_is_refused_at_load_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(EXAMPLE, overrides)


@pytest.mark.parametrize("overrides,level,bounds,options,bypass", [
    (["trainer.tis_cap=2"], "token", (2.0, None), (), False),
    (["trainer.correction.level=token", "trainer.correction.threshold=0.5_5.0",
      "trainer.correction.reject=seq_mean_k3", "trainer.correction.reject_threshold=0.01"],
     "token", (5.0, 0.5), (("seq_mean_k3", 0.01, None),), False),
    (["trainer.correction.reject=token_k1,seq_max_k2", "trainer.correction.reject_threshold=2,0.2"],
     None, (2.0, None), (("token_k1", 2.0, 0.5), ("seq_max_k2", 0.2, None)), False),
    (["trainer.correction.mode=bypass", "trainer.correction.loss=reinforce", "trainer.correction.level=sequence"],
     "sequence", (2.0, None), (), True),
])
def test_every_correction_satisfies_the_asynchronous_rule_and_parses(overrides, level, bounds, options, bypass):
    from trainer.config.checks import correction_of

    cfg = load_config(EXAMPLE, ["rollout.async.max_staleness=1", *overrides])
    c = correction_of(cfg)
    assert (c.level, (c.upper, c.lower), tuple((o.option, o.upper, o.lower) for o in c.reject), c.bypass) == \
        (level, bounds, options, bypass)
    assert c.reinforce == ("trainer.correction.loss=reinforce" in overrides)


def test_bounds_written_bare_in_yaml_stay_bounds(tmp_path):
    """YAML 1.1 reads 0.5_5.0 as the number 0.55; the config keeps it as the pair it is (and numbers with digit
    separators still load as numbers)."""
    from trainer.config.checks import correction_of

    text = EXAMPLE.read_text().replace("trainer:", "trainer:\n    correction: {level: token, threshold: 0.5_5.0, "
                                       "reject: 'seq_mean_k1,token_k3', reject_threshold: '0.9_1.1,0.02,'}\n"
                                       "    kl_horizon: 10_000", 1)
    path = tmp_path / "train" / "bare.yaml"  # the example's relative paths, from a copy at its depth
    path.parent.mkdir()
    path.write_text(text.replace("../math_agent/", f"{REPO}/examples/math_agent/"))
    cfg = load_config(path)
    c = correction_of(cfg)
    assert (c.upper, c.lower) == (5.0, 0.5) and cfg.trainer.kl_horizon == 10000
    assert [(o.option, o.upper, o.lower) for o in c.reject] == [("seq_mean_k1", 1.1, 0.9), ("token_k3", 0.02, None)]
