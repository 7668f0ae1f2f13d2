"""`harness train FILE --check` and `--show-config FILE`: a config checked and shown without training. The check
reads the file and its --sets, locates the model without downloading, builds the reply parsers on its tokenizer
and prints the placement and memory plan; it starts no engine, agent or trainer (those are replaced by functions
that fail the test). The machine is an argument (`Gpus`), so an 80 GiB GPU's plan is checked on this CPU machine,
with a model of Qwen2.5-1.5B's shape and no weights (tests/shaped_model.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness.cli.main import main
from harness.cli.train import run_check
from harness.running.gpus import GIB, Gpus
from tests.shaped_model import QWEN25_1_5B, shaped_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "train"
MATH_YAML, TERSE_YAML = EXAMPLES / "math.yaml", EXAMPLES / "terse.yaml"
ONE_GPU_80G = Gpus(("0",), 80 * GIB)


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch):
    """No GPU on this machine, whatever it has, and no engine, torchrun launch or training: each fails the test."""
    import harness.running.gpus
    import harness.running.vllm_server
    import trainer.model.fsdp

    def started(*args, **kwargs):
        raise AssertionError("--check started something")

    monkeypatch.setattr(harness.running.gpus, "this_machine", lambda: Gpus(()))
    monkeypatch.setattr(harness.running.vllm_server, "start_vllm", started)
    monkeypatch.setattr(trainer.model.fsdp, "launch", started)


@pytest.fixture(scope="module")
def qwen25_1_5b(tmp_path_factory, tiny_model_dir):
    return shaped_model(tmp_path_factory.mktemp("models") / "qwen2.5-1.5b-shaped", QWEN25_1_5B, tiny_model_dir)


# ---------------------------------------------------------------------------------------------- --check


def test_check_prints_the_plan_and_exits_0_on_a_machine_without_a_gpu(tiny_model_dir, capsys):
    assert main(["train", str(MATH_YAML), "--check", "--set", f"model.path={tiny_model_dir}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"harness train {MATH_YAML} --check --set model.path={tiny_model_dir}\n  config       "
                          f"{MATH_YAML}: harness train, experiment math, backbone harness\n")
    assert "  tasks        data.train " in out and "math_agent/tasks.jsonl: 10 tasks in split 'train'" in out
    assert "  judge        task_judge.judge math: loaded (harness.judges:math)" in out
    assert f"  model        {tiny_model_dir}: 0.8M parameters, hidden 128, 2 layers" in out
    assert ("  parsers      rollout.tool_parser hermes, rollout.reasoning_parser null: built on the model's "
            "tokenizer") in out
    assert "  GPUs         none visible on this machine: no placement and no GPU memory to check" in out
    assert "  activations  ~" in out
    assert "for trainer.micro_batch_tokens 4096 with model.gradient_checkpointing false" in out
    assert out.endswith("\nok: nothing found that would stop it (nothing was started)\n")


def test_check_of_a_1_5b_model_on_an_80_gib_gpu_prints_both_phases_and_refuses_it(qwen25_1_5b, capsys):
    given = [f"model.path={qwen25_1_5b}", "trainer.micro_batch_tokens=8192"]
    assert run_check(MATH_YAML, given, gpus=ONE_GPU_80G) == 1
    out = capsys.readouterr().out
    assert "  model        " + f"{qwen25_1_5b}: 1.54B parameters, hidden 1536, 28 layers, MLP 8960, KV 256" in out
    assert "  placement    layout colocated: trainer ranks on GPUs [0]; engine 0 on GPU 0 (CUDA id 0)" in out
    assert "  trainer      ~23.0 GiB per GPU: weights and AdamW ~17.3 GiB, gradients ~5.8 GiB" in out
    assert ("  activations  ~21.8 GiB for trainer.micro_batch_tokens 8192 with model.gradient_checkpointing false "
            "(true: ~3.7 GiB)") in out
    assert "    while the engines generate  ~40.0 GiB engines + ~17.3 GiB trainer weights and AdamW = ~57.3 GiB" in out
    assert ("    while the trainer updates   ~40.0 GiB engines + ~23.0 GiB trainer + ~21.8 GiB activations = "
            "~84.8 GiB\n    does not fit: ~4.8 GiB over") in out
    assert "\n1 problem(s):\n  - the memory plan does not fit (" in out

    assert run_check(MATH_YAML, [*given, "rollout.engine.sleep=1"], gpus=ONE_GPU_80G) == 0
    out = capsys.readouterr().out
    assert "~40.0 GiB while generating (bf16 weights ~2.9 GiB, the rest KV cache); asleep (rollout.engine.sleep 1) " \
           "~4.0 GiB" in out
    assert ("    while the trainer updates   ~4.0 GiB engines + ~23.0 GiB trainer + ~21.8 GiB activations = "
            "~48.8 GiB") in out
    assert "    fits: ~22.7 GiB to spare" in out and out.endswith("ok: nothing found that would stop it (nothing was "
                                                                   "started)\n")


def test_check_lists_every_problem_it_finds(qwen25_1_5b, tiny_model_dir, capsys):
    given = [f"model.path={qwen25_1_5b}", "trainer.micro_batch_tokens=8192", "rollout.agent=nowhere.py"]
    assert run_check(MATH_YAML, given, gpus=ONE_GPU_80G) == 1
    problems = capsys.readouterr().out.split("\n2 problem(s):\n")[1]
    assert "  - rollout.agent " in problems and "nowhere.py' is not a file" in problems
    assert "  - the memory plan does not fit" in problems
    assert run_check(MATH_YAML, [f"model.path={tiny_model_dir}", "placement.layout=split"], gpus=ONE_GPU_80G) == 1
    assert "layout split needs a GPU for the engines besides the trainer's 1" in capsys.readouterr().out


def test_check_builds_the_reply_parsers_on_the_tokenizer(tiny_model_dir, capsys):
    """The tiny model's tokenizer has no [TOOL_CALLS] token: vLLM's mistral parser can't be built on it."""
    assert main(["train", str(MATH_YAML), "--check", "--set", f"model.path={tiny_model_dir}",
                 "--set", "rollout.tool_parser=mistral"]) == 1
    out = capsys.readouterr().out
    assert "  parsers      rollout.tool_parser mistral, rollout.reasoning_parser null: do not work" in out
    assert "  - the reply parsers (rollout.tool_parser mistral, rollout.reasoning_parser null) do not work with the " \
           "model's tokenizer: " in out


@pytest.mark.parametrize(("overrides", "problem"), [
    (["trainer.nope=1"], "unknown key 'trainer.nope' in --set trainer.nope=1"),
    (["model.path=/nowhere/model"], "model.path '/nowhere/model' is not a directory"),
    (["rollout.engine.sleep=1"], "rollout.engine.sleep 1 needs the engine on a CUDA GPU"),
])  # fmt: skip
def test_check_exits_1_with_the_problem_of_a_config_that_cannot_run(tiny_model_dir, capsys, overrides, problem):
    args = ["train", str(MATH_YAML), "--check", "--set", f"model.path={tiny_model_dir}"]
    assert main([*args, *(a for o in overrides for a in ("--set", o))]) == 1
    assert f"problem(s):\n  - {problem}" in capsys.readouterr().out


def test_check_finds_a_hub_id_in_the_local_cache_and_downloads_nothing(tiny_model_dir, tmp_path, monkeypatch,
                                                                      capsys):
    repo = tmp_path / "hub" / "models--someone--tiny-chat"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / "c0ffee")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert main(["train", str(MATH_YAML), "--check", "--set", "model.path=someone/tiny-chat"]) == 0
    assert f"  model        {repo / 'snapshots' / 'c0ffee'}: 0.8M parameters" in capsys.readouterr().out
    assert main(["train", str(MATH_YAML), "--check", "--set", "model.path=someone/not-here"]) == 1
    out = capsys.readouterr().out
    assert "  - model.path 'someone/not-here' is not a local directory" in out
    assert "nor in the Hugging Face cache" in out
    assert "nothing is downloaded here: fetch it with `hf download someone/not-here`" in out
    assert "--check downloads nothing" in out
    assert not (tmp_path / "hub" / "models--someone--not-here").exists()


def test_sft_and_from_run_check_as_they_would_train(tiny_model_dir, tmp_path, capsys):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"},
                                             {"role": "assistant", "content": "4"}]}) + "\n")
    assert main(["sft", str(TERSE_YAML), "--check", "--data", str(chat), "--set", f"model.path={tiny_model_dir}"]) == 0
    assert f"config       {TERSE_YAML}: harness sft, experiment terse" in capsys.readouterr().out
    db = tmp_path / "runs.duckdb"
    assert main(["train", str(TERSE_YAML), "--check", "--from-run", "run-1", "--db", str(db), "--set",
                 f"model.path={tiny_model_dir}"]) == 1  # no database there: said, and none created
    out = capsys.readouterr().out
    assert "harness train --from-run, experiment terse" in out
    assert f"  - offline.run 'run-1' in {str(db)!r}: no database at {str(db)!r}" in out
    assert not db.exists()
    assert main(["sft", str(TERSE_YAML), "--check", "--set", f"model.path={tiny_model_dir}"]) == 1
    assert "harness sft needs chat records: set offline.data" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- --show-config


def test_show_config_of_a_file_shows_its_values_with_the_sets_beside_the_defaults(capsys):
    assert main(["train", str(MATH_YAML), "--show-config", "--set", "trainer.lr=3e-5"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"# {MATH_YAML} with trainer.lr=3e-5: every key's value")
    assert "\ntrainer.lr = 3e-05  (number, > 0; default 1e-06)\n    peak learning rate (AdamW)\n" in shown
    assert "\ntrainer.micro_batch_tokens = 4096  (integer, >= 1; default 8192)\n" in shown  # the file's value
    assert "\ntrainer.clip_low = 0.2  (number, in (0, 1); the default)\n" in shown
    assert "\nexperiment_name = \"math\"  (string or null; default null)\n" in shown
    assert main(["train", "--show-config"]) == 0
    listing = capsys.readouterr().out
    assert "\ntrainer.lr  (number, > 0; default 1e-06)\n" in listing and "3e-05" not in listing


@pytest.mark.parametrize("argv", [
    ["train", str(MATH_YAML), "--show-config", "--set", "trainer.nope=1"],
    ["train", "--show-config", "--set", "trainer.lr=1"],
    ["sft", str(MATH_YAML), "--show-config", "--set", "trainer.lr=fast"],
])  # fmt: skip
def test_show_config_refuses_what_it_cannot_apply(argv, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ")
