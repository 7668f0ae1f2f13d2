"""`harness train CONFIG --check` and `harness sft CONFIG --check --data X` refuse every input `harness run` refuses
(tasks that are missing or not JSONL, a judge that is not built-in, chat records that can't be read, a recorded
run that is not there), list every problem found, and write nothing; `harness train` itself refuses a bad judge
or bad tasks in one line before anything slow. Each test runs the CLI as a subprocess, as a user types it, on
configs written into tmp_path whose run directory is tmp_path/runs: that nothing was started is that nothing was
written there (a run writes runs/<experiment>/config.resolved.yaml before it builds the policy or starts an
engine, and the engine's log beside it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TERSE = ROOT / "examples" / "terse_agent"


def write_config(tmp_path: Path, model: Path, name: str = "inputs", **sections) -> Path:
    """A config of the terse example's shape in tmp_path, its run directory tmp_path/runs; `sections` replace
    keys section by section (e.g. data={"train": ...})."""
    config = {"experiment_name": name, "model": {"path": str(model)},
              "data": {"train": str(TERSE / "tasks.jsonl")},
              "task_judge": {"judge": f"{TERSE / 'judge.py'}:terse"},
              "rollout": {"agent": str(TERSE / "agent.py"), "num_repeat": 2, "batch_size": 2},
              "logging": {"run_dir": str(tmp_path / "runs"), "console": False, "curve_png": False}}
    for section, keys in sections.items():
        config[section] = {**config.get(section, {}), **keys} if isinstance(keys, dict) else keys
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"harness": config}, sort_keys=False))
    return path


def harness(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


def problems_of(out: str) -> list[str]:
    """The problems `--check` lists after its "N problem(s):" line, one each; asserts N is their number."""
    head, _, listed = out.partition(" problem(s):\n")
    found = [line.removeprefix("  - ") for line in listed.splitlines() if line.startswith("  - ")]
    assert int(head.rsplit("\n", 1)[-1]) == len(found), out
    return found


def nothing_written(tmp_path: Path) -> None:
    assert not (tmp_path / "runs").exists(), sorted(p.name for p in (tmp_path / "runs").rglob("*"))


@pytest.fixture
def bad_jsonl(tmp_path) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text("this is not json\n")
    return path


def test_check_lists_missing_tasks_bad_validation_tasks_and_an_unknown_judge_together(tiny_model_dir, tmp_path,
                                                                                   bad_jsonl):
    missing = tmp_path / "nowhere.jsonl"
    config = write_config(tmp_path, tiny_model_dir, data={"train": str(missing), "validation": str(bad_jsonl)},
                          task_judge={"judge": "exactmatch"})
    done = harness("train", config, "--check")
    assert done.returncode == 1, done.stdout + done.stderr
    assert problems_of(done.stdout) == [
        f"data.train: no such file or directory: {missing}",
        f"data.validation: {bad_jsonl} line 1: not valid JSON (Expecting value: column 1)",
        "task_judge.judge: judge spec 'exactmatch' is not a built-in judge (exact_match, math, substring, f1, "
        "rubric, env) and not of the form module:function, module:Class, module->Class or path/to/file.py:function",
    ]
    assert f"  tasks        data.train {missing}: can't be read" in done.stdout
    assert "Traceback" not in done.stderr
    nothing_written(tmp_path)


def test_check_refuses_a_task_file_without_tasks_as_harness_run_does(tiny_model_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    done = harness("train", write_config(tmp_path, tiny_model_dir, data={"train": str(empty)}), "--check")
    assert done.returncode == 1
    assert problems_of(done.stdout) == [f"data.train {str(empty)!r} has no tasks in split 'train': give a source "
                                        "with tasks, or the split they are in"]
    nothing_written(tmp_path)


def test_check_lists_every_unknown_key_with_what_was_meant_and_its_header_shows_the_sets(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, trainer={"lrr": 1e-5, "micro_batch_tokenz": 1024})
    done = harness("train", config, "--check", "--set", "rollout.num_repeats=4", "--set", "trainer.lr=1e-5")
    assert done.returncode == 1
    assert done.stdout.startswith(f"harness train {config} --check --set rollout.num_repeats=4 --set trainer.lr=1e-5\n")
    assert problems_of(done.stdout) == [
        f"unknown key 'trainer.lrr' in {config.name}: did you mean 'trainer.lr'?",
        f"unknown key 'trainer.micro_batch_tokenz' in {config.name}: did you mean 'trainer.micro_batch_tokens'?",
        "unknown key 'rollout.num_repeats' in --set rollout.num_repeats=4: did you mean 'rollout.num_repeat'?",
    ]
    nothing_written(tmp_path)


def test_check_says_each_phase_on_stderr_before_it_starts(tiny_model_dir, tmp_path):
    done = harness("train", write_config(tmp_path, tiny_model_dir), "--check")
    assert done.returncode == 0, done.stdout + done.stderr
    phases = [line for line in done.stderr.splitlines() if line.startswith("checking: ")]
    assert phases[:4] == [f"checking: reading the config {tmp_path / 'inputs.yaml'}",
                          f"checking: locating the model {tiny_model_dir}",
                          "checking: the config's values, the GPUs and the memory plan",
                          "checking: building the reply parsers on the model's tokenizer"]
    assert f"checking: reading data.train {TERSE / 'tasks.jsonl'}" in phases
    assert f"checking: loading the judge {TERSE / 'judge.py'}:terse" in phases
    assert f"  tasks        data.train {TERSE / 'tasks.jsonl'}: 16 tasks in split 'train'" in done.stdout
    nothing_written(tmp_path)


@pytest.mark.parametrize("data", ["missing", "bad"])
def test_sft_check_refuses_chat_records_that_are_missing_or_not_jsonl(tiny_model_dir, tmp_path, bad_jsonl, data):
    records = tmp_path / "nowhere.jsonl" if data == "missing" else bad_jsonl
    done = harness("sft", write_config(tmp_path, tiny_model_dir), "--check", "--data", records)
    assert done.returncode == 1, done.stdout + done.stderr
    [problem] = problems_of(done.stdout)
    assert problem == (f"offline.data: {str(records)!r} does not exist: give a .jsonl, .json or .parquet file, or a "
                       "directory saved with datasets' save_to_disk" if data == "missing" else
                       f"offline.data: {records} line 1 is not JSON (Expecting value: line 1 column 1 (char 0)); fix "
                       "or remove that line")
    nothing_written(tmp_path)


def test_from_run_check_refuses_a_missing_database_and_creates_none(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir)
    done = harness("train", config, "--check", "--from-run", "nope")
    assert done.returncode == 1
    db = tmp_path / "runs" / "inputs" / "harness.duckdb"  # the experiment's own, by default
    assert problems_of(done.stdout) == [f"offline.run 'nope' in {str(db)!r}: no database at {str(db)!r}: record "
                                        "something first, or pass --db PATH"]
    nothing_written(tmp_path)


def test_from_run_check_refuses_a_run_the_database_does_not_hold(tiny_model_dir, tmp_path):
    from harness.store.database import Store

    db = tmp_path / "other.duckdb"
    Store.open(db).close()  # a real database with the harness schema and no runs
    done = harness("train", write_config(tmp_path, tiny_model_dir), "--check", "--from-run", "nope", "--db", db)
    assert done.returncode == 1
    assert problems_of(done.stdout) == [f"offline.run 'nope' in {str(db)!r}: run 'nope' has no episodes in "
                                        f"{str(db)!r}; runs there: none"]
    nothing_written(tmp_path)


def test_a_verl_batch_that_does_not_split_into_micro_batches_is_refused_at_load(tiny_model_dir, tmp_path):
    """3 tasks x 2 repeats on one GPU in micro-batches of 4: verl would stop after the first rollout."""
    config = write_config(tmp_path, tiny_model_dir, backbone="verl", rollout={"batch_size": 3},
                          verl={"nnodes": 1, "n_gpus_per_node": 1, "micro_batch_size_per_gpu": 4})
    said = ("backbone verl splits rollout.batch_size 3 tasks x rollout.num_repeat 2 = 6 samples per optimizer step "
            "over 1 data-parallel rank(s) (verl.nnodes 1 x verl.n_gpus_per_node 1), 6 on each, into micro-batches of "
            "verl.micro_batch_size_per_gpu 4, which does not divide 6")
    done = harness("train", config, "--check")
    assert done.returncode == 1
    [problem] = problems_of(done.stdout)
    assert problem.startswith(said) and "Set verl.micro_batch_size_per_gpu: 3, or rollout.batch_size: 4" in problem
    done = harness("train", config)
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: {said}") and len(done.stderr.splitlines()) == 1, done.stderr
    nothing_written(tmp_path)
    assert harness("train", config, "--check", "--set", "verl.micro_batch_size_per_gpu=3").returncode == 0


def test_train_refuses_an_unknown_judge_in_one_line_before_anything_starts(tiny_model_dir, tmp_path):
    """Without the up-front check the judge was loaded only when step 1's rollouts started: after the run
    directory, the policy and the engine (runs/<experiment>/config.resolved.yaml, then its engine log)."""
    done = harness("train", write_config(tmp_path, tiny_model_dir, task_judge={"judge": "exactmatch"}))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: task_judge.judge: judge spec 'exactmatch' is not a built-in judge (exact_match, math, substring, f1, "
        "rubric, env) and not of the form module:function, module:Class, module->Class or path/to/file.py:function"]
    nothing_written(tmp_path)


def test_train_refuses_tasks_that_are_not_jsonl_in_one_line_before_anything_starts(tiny_model_dir, tmp_path,
                                                                                    bad_jsonl):
    done = harness("train", write_config(tmp_path, tiny_model_dir, data={"train": str(bad_jsonl)}))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"error: data.train: {bad_jsonl} line 1: not valid JSON (Expecting value: column 1)"]
    nothing_written(tmp_path)
