"""Several policies in one run (roles.policies): one LoRA adapter per policy over one frozen base, each trained only
on its own roles' samples. The config's refusals, and the update's bookkeeping on the tiny model: a policy's step
moves its adapter alone, a policy without samples keeps its adapter and its optimizer state bit for bit, the base
never moves, and the adapter a push writes is the one the trainer computes with."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from tests.trainer.test_layouts import ADVANTAGES, STEP, TASKS, two_ranks_and_one
from trainer.config import ConfigError, load_config
from trainer.config.roles import adapters_of, policies_of, policy_of
from trainer.model.build import build_policy
from trainer.model.fsdp import full_state_dict, init_distributed
from trainer.model.lora import activate, save_adapter
from trainer.model.policy import collate, token_logprobs
from trainer.rl import update as rl_update
from trainer.rl.experience import Experience

ROOT = Path(__file__).resolve().parents[2]
TWO = ["roles.match={planner: 'model:gpt-4o-mini', executor: 'system:^You carry out'}",
       "roles.train=[planner, executor]", "roles.policies={planner: plans, executor: acts}"]


def _cfg(*overrides: str, model: str = "/nowhere"):
    return load_config(ROOT / "examples/train/terse.yaml",
                       [f"model.path={model}", "rollout.batch_size=3", "trainer.mini_batch_size=null",
                        "trainer.ppo_epochs=1", "rollout.temperature=0.7", *overrides])


# ---------------------------------------------------------------------------------------------- the config


def test_which_policy_each_role_learns_as():
    cfg = _cfg(*TWO, "trainer.lora.rank=8")
    assert policies_of(cfg) == adapters_of(cfg) == ("plans", "acts")
    assert policy_of(cfg, "planner") == "plans" and policy_of(cfg, "executor") == "acts"
    # roles.train empty: every role learns, and calls no rule matches learn as the default policy
    cfg = _cfg(TWO[0], "roles.policies={planner: plans}", "trainer.lora.rank=8")
    assert policies_of(cfg) == ("policy", "plans")
    assert policy_of(cfg, None) == policy_of(cfg, "executor") == "policy"
    # roles naming one policy share it: one policy, trained as trainer.lora says
    cfg = _cfg(TWO[0], TWO[1], "roles.policies={planner: both, executor: both}")
    assert policies_of(cfg) == ("both",) and adapters_of(cfg) == ()
    assert policies_of(_cfg()) == ("policy",)  # no roles at all: today's single policy


@pytest.mark.parametrize("overrides, words", [
    ((*TWO,), ["2 policies (plans, acts)", "trainer.lora.rank 0", "set trainer.lora.rank"]),
    ((TWO[0], "roles.train=[planner]", "roles.policies={planner: plans, executor: acts}", "trainer.lora.rank=8"),
     ["roles.policies.executor", "'acts' is a policy no role learns as", "roles.train"]),
    ((TWO[0], "roles.policies={critic: judges}", "trainer.lora.rank=8"), ["'critic'", "no match"]),
    ((*TWO, "roles.policies={planner: 'no/slash', executor: acts}", "trainer.lora.rank=8"), ["'no/slash'"]),
    ((*TWO, "trainer.lora.rank=8", "rollout.engine.extra_args=[--max-loras, '3']"),
     ["--max-loras 3", "2 policies (plans, acts) x 2 versions", "at least 4"]),
    ((*TWO, "trainer.lora.rank=8", "trainer.adv_estimator=gae"), ["critic per policy", "trainer.adv_estimator"]),
])
def test_a_config_several_policies_cannot_run_is_refused_naming_the_key(overrides, words):
    with pytest.raises(ConfigError) as caught:
        _cfg(*overrides)
    for word in words:
        assert word in str(caught.value), str(caught.value)


def test_full_weight_policies_are_refused_with_the_memory_they_would_take(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"2 copies of 0\.00B parameters .* GiB") as caught:
        _cfg(*TWO, model=str(tiny_model_dir))
    assert "one LoRA adapter per policy" in str(caught.value)


# ---------------------------------------------------------------------------------------------- the update


@pytest.fixture(scope="module")
def dist():
    return init_distributed(device="cpu")


def _built(model_dir, dist, *more: str):
    cfg = _cfg(*TWO, "trainer.lora.rank=8", "trainer.lr=1e-2", "trainer.weight_decay=0.1", *more,
               model=str(model_dir))
    return cfg, build_policy(cfg, dist, total_steps=4, mode="rl", adapters=adapters_of(cfg))


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _old(model, name: str) -> list[torch.Tensor]:
    activate(model, name)
    with torch.no_grad():
        lp, _ = token_logprobs(model, collate(STEP, 0), 0.7, loss_only=True)
    return [lp[i, :len(s.token_ids)] - 0.05 for i, s in enumerate(STEP)]


def _apart(model) -> None:
    """Adapters that compute differently, as trained ones would: their B matrices no longer zero."""
    torch.manual_seed(0)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if ".lora_B." in key:
                p.add_(0.05 * torch.randn_like(p))


def _write_adapters(built, dist, folder: Path) -> None:
    """Each adapter into folder/<name>, from the state a push gathers."""
    state = full_state_dict(built.model, dist)
    for name in built.adapters:
        (folder / name).mkdir(parents=True)
        save_adapter(built.model, folder / name, state, name)


def _kind(key: str) -> str:
    return "plans" if ".plans." in key else "acts" if ".acts." in key else "base"


def test_a_policys_step_moves_its_adapter_alone(tiny_model_dir, dist):
    cfg, built = _built(tiny_model_dir, dist)
    model, optimizer = built.model, built.optimizer
    assert built.adapters == ("plans", "acts") and len(optimizer.param_groups) == 2
    before = _state(model)
    idle = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in optimizer.param_groups[1]["params"]]
    policies = ["plans"] * len(STEP)  # a step where only the planner has samples
    old = _old(model, "plans")
    metrics = rl_update.update_policies(model, optimizer, built.adapters, policies, STEP, TASKS, ADVANTAGES, old, old,
                                       0, cfg, dist)
    assert "policy/plans/actor/grad_norm" in metrics and not any(k.startswith("policy/acts/") for k in metrics)
    after = _state(model)
    moved = {_kind(k) for k in before if not torch.equal(before[k], after[k])}
    assert moved == {"plans"}, moved  # the base and the executor's adapter: bit for bit as they were
    for p, was in zip(optimizer.param_groups[1]["params"], idle, strict=True):  # the idle one's moments and steps
        assert all(torch.equal(optimizer.state[p][k], v) for k, v in was.items())
    assert all(int(optimizer.state[p]["step"]) == 0 for p in optimizer.param_groups[1]["params"])

    # both have samples: both move, the base still not; the planner's moments carry on from its first step
    steps_before = {id(p): int(optimizer.state[p]["step"]) for p in optimizer.param_groups[0]["params"]}
    policies = ["plans" if i % 2 else "acts" for i in range(len(STEP))]
    old = [a if p == "plans" else b for a, b, p in zip(_old(model, "plans"), _old(model, "acts"), policies,
                                                         strict=True)]
    metrics = rl_update.update_policies(model, optimizer, built.adapters, policies, STEP, TASKS, ADVANTAGES, old, old,
                                       0, cfg, dist)
    assert {"policy/plans/actor/grad_norm", "policy/acts/actor/grad_norm", "update/tokens"} <= set(metrics)
    final = _state(model)
    assert {_kind(k) for k in after if not torch.equal(after[k], final[k])} == {"plans", "acts"}
    assert all(torch.equal(before[k], final[k]) for k in before if _kind(k) == "base")
    assert all(int(optimizer.state[p]["step"]) == steps_before[id(p)] + 1 for p in optimizer.param_groups[0]["params"])


def test_bypass_mode_measures_each_policy_and_their_token_mean(tiny_model_dir, dist):
    """trainer.correction.mode bypass with two policies: each policy's update measures its mismatch to the engine
    (policy/<name>/rollout_corr/...), and the step's rollout_corr/ values are their token-weighted mean, as the
    console and the dashboard read them."""
    cfg, built = _built(tiny_model_dir, dist, "trainer.correction.mode=bypass", "trainer.correction.level=token")
    policies = ["plans" if i % 2 else "acts" for i in range(len(STEP))]
    engine = [torch.tensor(s.logprobs) for s in STEP]  # bypass: old is the engine's
    metrics = rl_update.update_policies(built.model, built.optimizer, built.adapters, policies, STEP, TASKS,
                                       ADVANTAGES, engine, [None] * len(STEP), 0, cfg, dist)
    for key in ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/rollout_is_mean"):
        mine = {name: (metrics[f"policy/{name}/{key}"], metrics[f"policy/{name}/update/tokens"])
                for name in ("plans", "acts")}
        assert mine["plans"][0] != mine["acts"][0]
        want = sum(v * n for v, n in mine.values()) / sum(n for _, n in mine.values())
        assert metrics[key] == pytest.approx(want)


def test_each_policy_scores_its_own_samples_through_its_adapter(tiny_model_dir, dist):
    cfg, built = _built(tiny_model_dir, dist)
    model = built.model
    _apart(model)
    policies = ["plans" if i % 3 else "acts" for i in range(len(STEP))]
    experience = Experience(STEP, {}, {}, {}, policies=policies)
    old, _, metrics = rl_update.score(model, None, experience, built.adapters, 0, cfg)
    want = {name: _old(model, name) for name in built.adapters}
    assert not torch.allclose(want["plans"][0], want["acts"][0])
    for i, name in enumerate(policies):
        assert torch.allclose(old[i], want[name][i] + 0.05, atol=1e-6), (name, i)
    assert {"policy/plans/logprob/engine_max_abs_diff", "policy/acts/logprob/engine_max_abs_diff",
            "logprob/engine_max_abs_diff"} <= set(metrics)


def test_the_adapter_a_push_writes_computes_what_the_trainer_does(tiny_model_dir, dist, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, built = _built(tiny_model_dir, dist)
    model = built.model
    _apart(model)
    _write_adapters(built, dist, tmp_path)
    for name in built.adapters:
        folder = tmp_path / name
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {f.name for f in folder.iterdir()}
        fresh = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                          folder).eval()
        with torch.no_grad():
            want, _ = token_logprobs(fresh, collate(STEP, 0), 1.0)
            activate(model, name)
            got, _ = token_logprobs(model, collate(STEP, 0), 1.0)
        assert torch.allclose(got, want, atol=1e-5), name


def test_a_checkpoint_holds_every_adapter_and_its_moments_and_resumes_exactly(tiny_model_dir, dist, tmp_path):
    from trainer.model.checkpoint import load, save

    alone = ["plans"] * len(STEP)  # step 1: the executor has no samples yet
    both = ["plans" if i % 2 else "acts" for i in range(len(STEP))]

    def step(cfg, built, policies) -> None:
        old = [a if p == "plans" else b for a, b, p in zip(_old(built.model, "plans"), _old(built.model, "acts"),
                                                             policies, strict=True)]
        rl_update.update_policies(built.model, built.optimizer, built.adapters, policies, STEP, TASKS, ADVANTAGES, old,
                                 old, 0, cfg, dist)
        built.scheduler.step()

    cfg, built = _built(tiny_model_dir, dist)
    step(cfg, built, alone)
    save(tmp_path, 1, built.model, built.optimizer, built.scheduler, {}, dist)
    step(cfg, built, both)
    want = _state(built.model)

    cfg, resumed = _built(tiny_model_dir, dist)  # a fresh process's model: new adapters, no moments
    load(tmp_path / "checkpoints" / "step_1", resumed.model, resumed.optimizer, resumed.scheduler, dist)
    step(cfg, resumed, both)
    got = _state(resumed.model)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])]


def test_export_merge_writes_one_model_per_policy(tiny_model_dir, dist, tmp_path):
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    _, built = _built(tiny_model_dir, dist)
    model = built.model
    _apart(model)
    _write_adapters(built, dist, tmp_path / "adapter")  # as the run writes them: <run>/adapter/<policy>
    done = subprocess.run([sys.executable, "-m", "harness.cli", "export", "--merge", str(tmp_path / "adapter"),
                           "--out", str(tmp_path / "merged")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "merged").iterdir()) == ["acts", "plans"]
    for name in built.adapters:
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged" / name, dtype=torch.float32).eval()
        with torch.no_grad():
            want, _ = token_logprobs(merged, collate(STEP, 0), 1.0)
            activate(model, name)
            got, _ = token_logprobs(model, collate(STEP, 0), 1.0)
        assert torch.allclose(got, want, atol=1e-5), name


WORKER = textwrap.dedent(
    '''
    import sys

    import torch

    from tests.trainer.test_layouts import ADVANTAGES, STEP, TASKS
    from tests.trainer.test_policies import _built, _old
    from trainer.model.fsdp import full_state_dict, init_distributed, launch, shutdown
    from trainer.rl import update as rl_update

    model_dir, out = sys.argv[1], sys.argv[2]
    dist = init_distributed(device="cpu")
    torch.manual_seed(0)  # the same fresh adapters on every rank and in both runs
    cfg, built = _built(model_dir, dist, "trainer.lr=1e-4")
    for policies in (["plans"] * len(STEP), ["plans" if i % 2 else "acts" for i in range(len(STEP))]):
        old = [a if p == "plans" else b for a, b, p in zip(_old(built.model, "plans"), _old(built.model, "acts"),
                                                             policies, strict=True)]
        stats = rl_update.update_policies(built.model, built.optimizer, built.adapters, policies, STEP, TASKS,
                                         ADVANTAGES, old, old, 0, cfg, dist)
    state = full_state_dict(built.model, dist)
    if dist.is_main:
        torch.save({"stats": stats, "state": state}, out)
    shutdown()
    '''
)


def test_two_fsdp_ranks_train_the_policies_as_one_process_does(tmp_path, tiny_model_dir, monkeypatch):
    two, one = two_ranks_and_one(WORKER, tmp_path, monkeypatch, [str(tiny_model_dir)])
    for key in ("policy/plans/actor/pg_loss", "policy/acts/actor/pg_loss", "policy/plans/actor/grad_norm"):
        assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-4, abs=1e-6), key
    for name, value in one["state"].items():  # two AdamW steps at 1e-4 (each ~lr x sign(grad)): within them
        assert float((two["state"][name] - value).abs().max()) <= 2.5e-4 * max(float(value.abs().max()), 1.0), name

