"""Extra vLLM arguments for the engine harness starts: `--engine-args` on `harness serve` and `harness run`, as
`rollout.engine.extra_args` is for `harness train`. They reach the engine's command line as given; the flags harness
sets itself, a `--gpu-memory-utilization` that is not a share, and engine arguments for an engine already running
(--upstream, rollout.engine.url) are refused in one line, the same way for all three verbs. The engine is the edge
faked here: a process that exits at once stands in for vLLM, and the command line harness gave it is kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import options
from harness.cli.main import build_parser, main
from harness.running import vllm_server
from harness.running.engine_args import OWNED_FLAGS, check_engine_args
from harness.running.gpus import Gpus
from harness.running.vllm_server import engine_command
from trainer.config import ConfigError, load_config

TERSE_YAML = Path(__file__).resolve().parents[2] / "examples" / "train" / "terse.yaml"


@pytest.fixture
def model_dir(tmp_path):
    """A directory harness takes for a model (it has a config.json); the fake engine never reads it."""
    path = tmp_path / "models" / "m"
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture
def engine_starts(monkeypatch):
    """The command lines harness starts vLLM with; each engine is a process that exits at once, so the command
    fails with the engine's log, as it would if vLLM refused an argument."""
    started, real_popen = [], subprocess.Popen

    def popen(args, **kwargs):
        if "vllm.entrypoints.openai.api_server" not in args:
            return real_popen(args, **kwargs)  # nvidia-smi and the like
        started.append(list(args))
        return real_popen([sys.executable, "-c", "raise SystemExit(3)"], **kwargs)

    monkeypatch.setattr(vllm_server.subprocess, "Popen", popen)
    return started


def _run_args(tmp_path: Path) -> list[str]:
    agent, tasks = tmp_path / "agent.py", tmp_path / "tasks.jsonl"
    agent.write_text("print('4')\n")
    tasks.write_text('{"prompt": "2+2?", "answer": "4"}\n')
    return ["run", str(agent), "--data", str(tasks), "--run-dir", str(tmp_path / "run")]


def _serve_args(tmp_path: Path) -> list[str]:
    return ["serve", "--run-dir", str(tmp_path / "run"), "--port", "0"]


VERBS = {"serve": _serve_args, "run": _run_args}


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: "), err
    assert len([line for line in err if line.startswith("error: ")]) == 1 and "\n" not in err[-1]
    return err[-1].removeprefix("error: ")


# ---------------------------------------------------------------------------------------------- the option


def test_engine_args_are_split_like_a_shell_repeatable_and_in_order(model_dir):
    for verb, args in (("serve", []), ("run", ["agent.py", "--data", "t.jsonl"])):
        parsed = build_parser().parse_args([
            verb, *args, "--model", str(model_dir),
            "--engine-args", "--gpu-memory-utilization 0.8 --tensor-parallel-size 2",
            "--engine-args=--enforce-eager", "--engine-args", "--chat-template '/tmp/my template.jinja'"])
        assert options.engine_args(parsed) == ["--gpu-memory-utilization", "0.8", "--tensor-parallel-size", "2",
                                               "--enforce-eager", "--chat-template", "/tmp/my template.jinja"]
    assert options.engine_args(build_parser().parse_args(["serve", "--model", str(model_dir)])) == []


def test_the_engine_command_line_carries_the_engine_args_after_harness_s_own_flags():
    extra = ["--max-num-seqs", "4", "--chat-template", "t.jinja"]
    for gpus in (0, 1):
        args, _ = engine_command(Path("/models/m"), port=8000, served_model_name="m",
                                 max_model_len=4096, gpus=gpus, gpu_memory_utilization=0.5, extra_args=extra)
        assert args[-len(extra):] == extra and args.index("--model") < args.index("--max-num-seqs")


@pytest.mark.parametrize("verb", VERBS)
def test_serve_and_run_start_the_engine_with_the_engine_args(verb, tmp_path, model_dir, engine_starts, capsys):
    code = main([*VERBS[verb](tmp_path), "--model", str(model_dir), "--max-model-len", "512",
                 "--engine-args", "--max-num-seqs 4 --gpu-memory-utilization=0.8"])
    assert code == (1 if verb == "serve" else 2)  # the fake engine exited: its log is named
    assert "vLLM exited with code 3 before serving" in capsys.readouterr().err
    [started] = engine_starts
    assert started[started.index("--model") + 1] == str(model_dir)
    assert started[started.index("--max-model-len") + 1] == "512"
    assert started[-3:] == ["--max-num-seqs", "4", "--gpu-memory-utilization=0.8"]


def test_harness_sets_every_flag_of_its_command_line_but_the_recipe_s():
    """The flags engine_command sets are refused in engine arguments, except the CPU recipe and the memory plan,
    which a user may override."""
    overridable = {"--dtype", "--enforce-eager", "--distributed-executor-backend", "--gpu-memory-utilization",
                   "--enable-sleep-mode"}
    for gpus in (0, 1):
        args, _ = engine_command(Path("/m"), port=1, served_model_name="m", max_model_len=16, gpus=gpus,
                                 reasoning_parser="qwen3", gpu_memory_utilization=0.5, sleep_mode=bool(gpus))
        flags = {arg for arg in args if arg.startswith("--")}
        assert flags - overridable <= set(OWNED_FLAGS), flags - overridable - set(OWNED_FLAGS)


# ---------------------------------------------------------------------------------------------- refused, serve and run


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize(("given", "message"), [
    ("--port 8000", "--engine-args: harness sets --port itself (a free port, behind the proxy): to run the engine "
                    "your way, start it yourself and give --upstream URL instead"),
    ("--max_model_len=8192", "--engine-args: harness sets --max-model-len itself: use the --max-model-len option "
                             "instead"),
    ("--tool-call-parser hermes", "--engine-args: harness sets --tool-call-parser itself: use the --tool-parser "
                                  "option instead"),
    ("--served-model-name policy", "--engine-args: harness sets --served-model-name itself (the model's directory "
                                   "name or Hub id; the proxy sends every call to it, whatever model the agent "
                                   "names)"),
    ("--gpu-memory-utilization 1.5", "--engine-args: --gpu-memory-utilization '1.5' must be a number in (0, 1], the "
                                     "engine's share of its GPU's memory, e.g. 0.8"),
    ("--gpu-memory-utilization=most", "--engine-args: --gpu-memory-utilization 'most' must be a number in (0, 1]"),
    ("--enforce-eager --gpu-memory-utilization", "--engine-args: --gpu-memory-utilization needs a value, the "
                                                 "engine's share of its GPU's memory in (0, 1], e.g. 0.8"),
    ("--chat-template 'a b", "--engine-args \"--chat-template 'a b\": No closing quotation: check its quotes"),
])  # fmt: skip
def test_engine_args_harness_cannot_pass_are_refused_before_anything_starts(verb, given, message, tmp_path, model_dir,
                                                                            engine_starts, capsys):
    assert main([*VERBS[verb](tmp_path), "--model", str(model_dir), f"--engine-args={given}"]) == 2
    assert _error(capsys).startswith(message)
    assert engine_starts == []


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("more", [[], ["--record-only"]])
def test_engine_args_for_an_engine_already_running_are_refused_naming_both_options(verb, more, tmp_path,
                                                                                   engine_starts, capsys):
    assert main([*VERBS[verb](tmp_path), "--upstream", "http://127.0.0.1:9/v1", *more,
                 "--engine-args", "--max-num-seqs 4"]) == 2
    assert _error(capsys) == ("--engine-args go to the engine harness starts with --model; with --upstream the engine "
                              "is already running: start it with them yourself, or drop --engine-args")
    assert engine_starts == []


# ---------------------------------------------------------------------------------------------- train's config


def _load(model, *overrides: str):
    return load_config(TERSE_YAML, [f"model.path={model}", *overrides], gpus=Gpus(()))


@pytest.mark.parametrize(("extra_args", "message"), [
    ("[--port, '8000']", "rollout.engine.extra_args: harness sets --port itself (a free port, behind the proxy): to "
                         "run the engine your way, start it yourself and set rollout.engine.url instead"),
    ("[--model=/elsewhere]", "rollout.engine.extra_args: harness sets --model itself: set model.path instead"),
    ("[--reasoning-parser, qwen3]", "rollout.engine.extra_args: harness sets --reasoning-parser itself: set "
                                    "rollout.reasoning_parser instead"),
    ("[--logprobs-mode, raw_logprobs]", "rollout.engine.extra_args: harness sets --logprobs-mode itself "
                                        "(processed_logprobs: the logprobs after temperature, which the trainer "
                                        "recomputes)"),
    ("[--gpu-memory-utilization, '0']", "rollout.engine.extra_args: --gpu-memory-utilization '0' must be a number in "
                                        "(0, 1], the engine's share of its GPU's memory, e.g. 0.8; better, set "
                                        "rollout.engine.gpu_memory_utilization"),
])  # fmt: skip
def test_train_refuses_the_same_extra_args_with_its_own_keys(tiny_model_dir, extra_args, message):
    with pytest.raises(ConfigError) as info:
        _load(tiny_model_dir, f"rollout.engine.extra_args={extra_args}")
    assert str(info.value) == message


def test_train_refuses_extra_args_for_an_engine_already_running_or_a_share_said_twice(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"rollout.engine.extra_args \['--max-num-seqs', '4'\] go to the engines "
                                          "harness starts; with rollout.engine.url http://127.0.0.1:9 the engine is "
                                          "already running"):
        _load(tiny_model_dir, "rollout.engine.extra_args=[--max-num-seqs, '4']", "rollout.engine.url=http://127.0.0.1:9")
    with pytest.raises(ConfigError, match=r"rollout.engine.gpu_memory_utilization 0.5 and --gpu-memory-utilization "
                                          r"0.7 in rollout.engine.extra_args both give the engine's share"):
        _load(tiny_model_dir, "rollout.engine.gpu_memory_utilization=0.5",
              "rollout.engine.extra_args=[--gpu-memory-utilization, '0.7']")
    cfg = _load(tiny_model_dir, "rollout.engine.extra_args=[--max-num-seqs, 64, --chat-template=t.jinja]")
    assert cfg.rollout.engine.extra_args == ["--max-num-seqs", "64", "--chat-template=t.jinja"]


def test_harness_train_says_it_in_one_line_with_exit_code_2(tiny_model_dir, capsys):
    assert main(["train", str(TERSE_YAML), "--set", f"model.path={tiny_model_dir}",
                 "--set", "rollout.engine.extra_args=[--served-model-name, policy]"]) == 2
    assert _error(capsys).startswith("rollout.engine.extra_args: harness sets --served-model-name itself")


def test_engine_args_must_be_a_list_of_strings():
    with pytest.raises(ValueError, match=r"rollout.engine.extra_args must be a list of vLLM's command-line "
                                         r"arguments, one string each, e.g. \['--max-num-seqs', '64'\], got "
                                         r"'--max-num-seqs 64'"):
        check_engine_args("--max-num-seqs 64", "rollout.engine.extra_args")
    with pytest.raises(ValueError, match="rollout.engine.extra_args: 64 is not a string: give each of vLLM's "
                                         "arguments as text, e.g. '64'"):
        check_engine_args(["--max-num-seqs", 64], "rollout.engine.extra_args")
