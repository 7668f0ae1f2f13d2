"""`harness run --trained RUN_DIR` / `harness serve --trained RUN_DIR`: what a finished training run trained, read
back from its directory (config.resolved.yaml, hf/ or adapter/ or adapter/<policy>/) into the engine's flags and
the proxy's role rules and policy models; what an unfinished or foreign directory lacks is named. The engine tier
serves a trained two-policy run for real (tests/trainer/test_policies_engine.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli.main import main
from harness.cli.trained import read_trained
from trainer.config import load_config, save_resolved

ROOT = Path(__file__).resolve().parents[2]
TWO = ["roles.train=[planner, executor]", "roles.policies={planner: plans, executor: acts}"]


def _run(tmp_path: Path, *overrides: str, lora: int = 16) -> Path:
    cfg = load_config(ROOT / "examples/train/planner_executor.yaml",
                      ["model.path=/models/base", f"logging.run_dir={tmp_path}", "experiment_name=pe",
                       f"trainer.lora.rank={lora}", *overrides])
    return save_resolved(cfg).parent


def _adapter(folder: Path, rank: object) -> None:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 32, "peft_type": "LORA"}))


def test_a_run_of_two_policies_serves_an_adapter_each_under_its_roles(tmp_path):
    run = _run(tmp_path, *TWO)
    _adapter(run / "adapter" / "plans", 16)
    _adapter(run / "adapter" / "acts", 8)
    trained = read_trained(run)
    assert trained.model == "/models/base" and trained.rank == 16
    assert trained.adapters == {"plans": run / "adapter" / "plans", "acts": run / "adapter" / "acts"}
    assert trained.policy_models == {"plans": "plans-lora-pe", "acts": "acts-lora-pe"}
    assert {r.name: r.policy for r in trained.roles} == {"planner": "plans", "executor": "acts"}
    modules = [json.dumps({"name": f"{p}-lora-pe", "path": str(run / "adapter" / p)}) for p in ("plans", "acts")]
    assert trained.engine_args() == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "2",
                                     "--max-cpu-loras", "2", "--lora-modules", *modules]


def test_a_run_of_one_policy_serves_its_adapter_or_its_model(tmp_path):
    run = _run(tmp_path, "roles.policies={}")
    _adapter(run / "adapter", 12)
    one = read_trained(run)
    assert one.adapters == {"policy": run / "adapter"} and one.policy_models == {"policy": "policy-lora-pe"}
    assert one.engine_args()[:3] == ["--enable-lora", "--max-lora-rank", "16"]  # vLLM's next rank up from 12

    shared = _run(tmp_path / "shared", "roles.policies={planner: both, executor: both}")
    _adapter(shared / "adapter", 8)
    both = read_trained(shared)  # one policy, whatever its name: its adapter serves every call, as in training
    assert both.adapters == {"policy": shared / "adapter"} and {r.policy for r in both.roles} == {"both"}

    full = _run(tmp_path / "full", "roles.policies={}", lora=0)
    (full / "hf").mkdir()
    (full / "hf" / "config.json").write_text("{}")
    whole = read_trained(full)
    assert whole.model == str(full / "hf") and whole.adapters == {} and whole.engine_args() == []


def test_what_a_run_directory_lacks_is_named(tmp_path):
    with pytest.raises(ValueError, match="has no config.resolved.yaml: give the directory harness train wrote"):
        read_trained(tmp_path)
    run = _run(tmp_path, *TWO)
    _adapter(run / "adapter" / "plans", 16)
    with pytest.raises(ValueError, match=r"the trained adapter .*adapter/acts is written when the run finishes"):
        read_trained(run)
    _adapter(run / "adapter" / "acts", "16")
    with pytest.raises(ValueError, match=r"give ranks \[16, '16'\]: each must have a positive integer \"r\""):
        read_trained(run)
    shared = _run(tmp_path / "shared", "roles.policies={planner: both, executor: both}")
    _adapter(shared / "adapter", 8)
    both = read_trained(shared)  # one policy, whatever its name: its adapter serves every call, as in training
    assert both.adapters == {"policy": shared / "adapter"} and {r.policy for r in both.roles} == {"both"}

    full = _run(tmp_path / "full", "roles.policies={}", lora=0)
    with pytest.raises(ValueError, match=r"the trained model .*/hf is written when the run finishes"):
        read_trained(full)


def test_harness_run_trained_refuses_roles_of_its_own_and_names_a_bad_directory(tmp_path, capsys):
    run = _run(tmp_path, *TWO)
    _adapter(run / "adapter" / "plans", 16)
    _adapter(run / "adapter" / "acts", 16)
    agent, data = ROOT / "examples/planner_executor/agent.py", ROOT / "examples/planner_executor/train.jsonl"
    base = ["run", str(agent), "--data", str(data), "--run-dir", str(tmp_path / "eval")]
    assert main([*base, "--trained", str(run), "--role", "planner=model:x"]) == 2
    assert "--role with --trained: the run's roles are served as it trained them" in capsys.readouterr().err
    assert main([*base, "--trained", str(tmp_path / "nowhere")]) == 2
    assert "nowhere' has no config.resolved.yaml" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main([*base, "--trained", str(run), "--model", "/models/base"])
    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
