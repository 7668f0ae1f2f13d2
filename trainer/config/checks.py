"""The checks of a loaded TrainConfig: every value in its range, required keys set, and keys that must agree with
each other (trainer/config/load.py loads the YAML and calls `check`). Each ConfigError names the key, the value and what
to write instead.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from harness.running.engine_args import check_engine_args, gpu_memory_share
from harness.running.gpus import Gpus
from trainer.config.errors import ConfigError, raise_all
from trainer.config.keys import GROUP_ESTIMATORS, TrainConfig
from trainer.config.memory import memory_plan
from trainer.config.reference import in_range, key_name, range_text
from trainer.config.roles import check_roles

__all__ = ["ConfigError", "Mode", "check", "correction_of", "problems_of"]

Mode = Literal["rl", "from_run", "sft"]



def check(cfg: TrainConfig, where: str, mode: Mode = "rl", gpus: Gpus | None = None) -> None:
    """Values in range, required keys set, keys that must agree with each other, for `mode`, and the memory plan
    on `gpus` (None: this machine's); ConfigError names the key, the value and what to do, with every problem
    found in its `problems`."""
    raise_all(problems_of(cfg, where, mode, gpus))


def problems_of(cfg: TrainConfig, where: str, mode: Mode = "rl", gpus: Gpus | None = None) -> list[str]:
    """Every problem `check` finds. Values out of range or missing stop the checks there (those below take them as
    valid); past that, each group of checks is run and its problem kept, so that one --check lists them all."""
    found = _leaf_problems(cfg, where, mode)
    if found:
        return found
    serves = mode == "rl" or cfg.data.validation is not None
    groups = [
        *([lambda: _check_offline(cfg, where, mode)] if mode != "rl" else []),
        lambda: _check_agreement(cfg, where, mode),
        lambda: _check_lora(cfg),
        lambda: _check_engine_args(cfg),
        lambda: _check_tied(cfg, serves=serves),
        lambda: _check_memory_plan(cfg, gpus, serves=serves),
        lambda: _check_parsers(cfg),
        lambda: _check_verl_batch(cfg, mode),
        lambda: check_roles(cfg, mode),
    ]
    for group in groups:
        try:
            group()
        except ConfigError as exc:
            found += [p for p in exc.problems if p not in found]
    return found


def harbor_data(cfg: TrainConfig) -> bool:
    """Whether the tasks are Harbor task directories (harness/running/harbor.py)."""
    from harness.running import harbor

    paths = [Path(p) for p in (cfg.data.train, cfg.data.validation) if isinstance(p, str) and p]
    return bool(paths) and all(p.is_dir() and (harbor.is_task_dir(p) or harbor.is_task_set(p)) for p in paths)


def _leaf_problems(cfg: TrainConfig, where: str, mode: Mode) -> list[str]:
    """Required keys left null and numbers out of their range."""
    online = mode == "rl"
    # offline modes train on stored data: tasks and a judge only for validating with the agent
    offline_optional = {"data.train"} | (set() if cfg.data.validation else {"task_judge.judge"})
    judged_by_tests = harbor_data(cfg)  # Harbor tasks: their own tests/test.sh is the judge
    found = []
    for key, f, _, value in _leaves(cfg):
        meta = f.metadata
        if judged_by_tests and key == "task_judge.judge":
            continue
        if meta["required"] and value is None and (online or key not in offline_optional):
            found.append(f"{key} is required ({meta['help']}): set it in {where} or with --set {key}=...")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not in_range(value, meta):
            found.append(f"{key} must be {range_text(meta)}, got {value!r}")
    return found


def _check_agreement(cfg: TrainConfig, where: str, mode: Mode) -> None:
    """Keys that must agree with each other; every one that does not, in one ConfigError."""
    online = mode == "rl"
    r, t = cfg.rollout, cfg.trainer
    problems = [
        (harbor_data(cfg) and cfg.task_judge.judge is not None,
         f"task_judge.judge {cfg.task_judge.judge!r}: Harbor tasks (data.train {cfg.data.train}) are judged by their "
         f"own tests/test.sh: leave task_judge.judge out of {where}"),
        (r.agent is None and r.command is None and (online or cfg.data.validation is not None),
         f"rollout.agent (a Python file) or rollout.command (any command) is required"
         f"{'' if online else ' to validate on data.validation'}: set one in {where}"),
        (r.agent is not None and r.command is not None, "give rollout.agent or rollout.command, not both"),
        (r.agent is not None and not Path(r.agent).is_file(),
         f"rollout.agent {r.agent!r} is not a file: fix the path (relative to the config file's directory)"),
        (r.command is not None and not _split_ok(r.command),
         f"rollout.command {r.command!r} is not a command a shell could split: check its quotes"),
        (online and t.adv_estimator in GROUP_ESTIMATORS and r.num_repeat < 2,
         f"rollout.num_repeat must be >= 2 for trainer.adv_estimator {t.adv_estimator!r} (it compares the episodes "
         f"of a group), got {r.num_repeat}; or use adv_estimator 'reinforce_pp'"),
        (online and t.mini_batch_size is not None and r.batch_size % t.mini_batch_size != 0,
         f"trainer.mini_batch_size {t.mini_batch_size} must divide rollout.batch_size {r.batch_size}"),
        (len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas),
         f"trainer.betas must be two numbers in [0, 1), got {t.betas!r}"),
        (t.use_kl_in_reward and t.kl_coef == 0, "trainer.use_kl_in_reward needs trainer.kl_coef > 0"),
        (t.val_before_train and cfg.data.validation is None,
         "trainer.val_before_train needs validation tasks: set data.validation"),
        (r.validation.n > 1 and r.validation.temperature == 0,
         f"rollout.validation.n {r.validation.n} with temperature 0 repeats one greedy episode: set "
         "rollout.validation.temperature > 0, or n: 1"),
        (t.resume not in ("auto", "disable") and not Path(t.resume).exists(),
         f"trainer.resume {t.resume!r} does not exist: use auto, disable, or a checkpoint directory"),
        (not re.fullmatch(r"[\w.-]+", cfg.experiment_name) or cfg.experiment_name in (".", ".."),
         f"experiment_name {cfg.experiment_name!r} must be a directory name: letters, digits, '.', '-', '_'"),
        (r.engine.url is not None and not r.engine.url.startswith(("http://", "https://")),
         f"rollout.engine.url {r.engine.url!r} must start with http:// or https://"),
        (r.engine.more_urls and r.engine.url is None,
         "rollout.engine.more_urls needs rollout.engine.url (the first engine to attach to)"),
        (r.engine.url is not None and r.engines > 1,
         "rollout.engines starts engines; with rollout.engine.url, list the other running ones in "
         "rollout.engine.more_urls instead"),
        (online and t.adv_estimator == "remax" and r.async_.max_staleness > 0,
         "trainer.adv_estimator remax takes each task's greedy episode at the weights being trained as the "
         "baseline: it runs with rollout.async.max_staleness 0"),
        (not r.guard.enabled and (r.guard.end_episode or r.guard.penalty is not None or r.guard.length_cap
                                  or r.guard.min_surprisal is not None),
         "rollout.guard.end_episode, penalty, length_cap and min_surprisal act on what the guard finds: set "
         "rollout.guard.enabled: true (or leave them out)"),
        (t.kl_ctrl == "adaptive" and not t.use_kl_in_reward,
         "trainer.kl_ctrl adaptive steers the KL penalty in the reward: set trainer.use_kl_in_reward: true (and "
         "trainer.kl_coef > 0, its starting value)"),
        ((r.llm_hosts or r.refuse_other_hosts) and not r.transparent,
         "rollout.llm_hosts and rollout.refuse_other_hosts need rollout.transparent: true"),
    ]
    found = [message for failed, message in problems if failed]
    try:
        correction = correction_of(cfg)
    except ConfigError as exc:
        found += exc.problems
    else:
        if online and r.async_.max_staleness > 0 and not correction.corrects:
            found.append(f"rollout.async.max_staleness {r.async_.max_staleness} trains on episodes sampled with "
                         "older weights: choose an off-policy correction (docs/training.md: Off-policy correction), "
                         "e.g. trainer.tis_cap: 2.0 (token TIS), trainer.correction.level: token with threshold "
                         "0.5_5.0 (IcePop), trainer.correction.reject: seq_mean_k3 with reject_threshold 0.01, or "
                         "trainer.correction.mode: bypass")
    raise_all(found)


def _check_lora(cfg: TrainConfig) -> None:
    t = cfg.trainer
    if t.lora.rank > 0:
        from trainer.model.lora import LoraSpec

        try:
            LoraSpec(t.lora.rank, t.lora.alpha, tuple(t.lora.target_modules), t.lora.dropout)
        except ValueError as exc:
            raise ConfigError(f"trainer.lora: {exc}") from None


def _check_parsers(cfg: TrainConfig) -> None:
    """The parser names vLLM knows (building them on the model's tokenizer is --check's: harness/cli/train.py)."""
    from proxy.parsing.native import check_reasoning_parser, check_tool_parser

    r = cfg.rollout
    try:
        check_tool_parser(r.tool_parser)
        check_reasoning_parser(r.reasoning_parser)
    except ValueError as exc:
        raise ConfigError(f"rollout: {exc}") from None


def _check_verl_batch(cfg: TrainConfig, mode: Mode) -> None:
    """With backbone verl, each optimizer step's samples must split evenly into verl's micro-batches, or verl stops
    after the first rollout ("data size must be divisible by force_group_size * micro_batch_size_per_gpu").

    verl 0.9's v1 trainer (the one trainer/rl/verl_backbone.py runs) takes a mini-batch of trainer.mini_batch_size
    (else rollout.batch_size) tasks x rollout.num_repeat samples per optimizer step, splits it over its
    data-parallel ranks (verl.nnodes x verl.n_gpus_per_node / verl.ulysses_sequence_parallel_size) and cuts each
    rank's share into micro-batches of exactly verl.micro_batch_size_per_gpu sequences (actor, reference,
    logprob passes and critic alike: verl_config gives them all that one value). So mini-batch / ranks must be a
    whole number, and a multiple of the micro-batch size.

    Episodes whose calls do not extend each other give several samples, so a step's sample count varies; verl pads
    every step with no-op samples up to a whole number of mini-batches (trainer_base.py _balance_batch,
    _get_required_batch_multiple), so the rule above holds for any count and is checked exactly. With verl's
    token-based micro-batches (verl.overrides actor_rollout_ref.actor.use_dynamic_bsz=true) there is no fixed
    micro-batch size, and nothing to check."""
    if cfg.backbone != "verl" or mode != "rl" or _verl_dynamic_batches(cfg):
        return
    r, t, v = cfg.rollout, cfg.trainer, cfg.verl
    dp = max(1, v.nnodes * v.n_gpus_per_node // v.ulysses_sequence_parallel_size)
    tasks = t.mini_batch_size or r.batch_size
    samples = tasks * r.num_repeat
    counted = (f"trainer.mini_batch_size {tasks}" if t.mini_batch_size else f"rollout.batch_size {tasks}") + \
        f" tasks x rollout.num_repeat {r.num_repeat} = {samples} samples per optimizer step"
    ranks = (f"{dp} data-parallel rank(s) (verl.nnodes {v.nnodes} x verl.n_gpus_per_node {v.n_gpus_per_node}"
             + (f" / verl.ulysses_sequence_parallel_size {v.ulysses_sequence_parallel_size}"
                if v.ulysses_sequence_parallel_size > 1 else "") + ")")
    anyway = " (or verl.overrides actor_rollout_ref.actor.use_dynamic_bsz=true: micro-batches by tokens)"
    if samples % dp:
        raise ConfigError(f"backbone verl splits {counted} over {ranks}, and {samples} is not a multiple of {dp}: "
                          f"make the tasks x num_repeat a multiple of {dp}, or use fewer GPUs")
    per_rank, micro = samples // dp, v.micro_batch_size_per_gpu
    if per_rank % micro:
        fits = max(d for d in range(1, micro + 1) if per_rank % d == 0)
        instead = f"verl.micro_batch_size_per_gpu: {fits}"
        if not t.mini_batch_size:  # the next batch size whose samples split evenly
            more = next(n for n in range(tasks + 1, tasks + micro * dp + 1) if n * r.num_repeat % (micro * dp) == 0)
            instead += f", or rollout.batch_size: {more} ({more * r.num_repeat} samples)"
        raise ConfigError(f"backbone verl splits {counted} over {ranks}, {per_rank} on each, into micro-batches of "
                          f"verl.micro_batch_size_per_gpu {micro}, which does not divide {per_rank}: verl would stop "
                          f"after the first rollout (\"data size must be divisible by ... micro_batch_size_per_gpu\"). "
                          f"Set {instead}{anyway}")


def _verl_dynamic_batches(cfg: TrainConfig) -> bool:
    """Whether verl.overrides turn on verl's token-based micro-batches for the actor (no fixed count to divide)."""
    for item in cfg.verl.overrides:
        key, _, raw = item.partition("=")
        if key.strip() == "actor_rollout_ref.actor.use_dynamic_bsz" and raw.strip().lower() in ("true", "1", "yes"):
            return True
    return False


def _check_engine_args(cfg: TrainConfig) -> None:
    """rollout.engine.extra_args as harness serve and run check --engine-args (harness/running/engine_args.py), for
    an engine harness starts, and not said twice."""
    e = cfg.rollout.engine
    try:
        check_engine_args(e.extra_args, "rollout.engine.extra_args")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if e.extra_args and e.url is not None:
        raise ConfigError(f"rollout.engine.extra_args {e.extra_args!r} go to the engines harness starts; with "
                          f"rollout.engine.url {e.url} the engine is already running: start it with them yourself, "
                          "or leave rollout.engine.url out")
    said = gpu_memory_share(e.extra_args, "rollout.engine.extra_args")
    if said is not None and e.gpu_memory_utilization is not None:
        raise ConfigError(f"rollout.engine.gpu_memory_utilization {e.gpu_memory_utilization:g} and "
                          f"--gpu-memory-utilization {said:g} in rollout.engine.extra_args both give the engine's "
                          "share of its GPU: keep rollout.engine.gpu_memory_utilization alone")


def _check_tied(cfg: TrainConfig, serves: bool) -> None:
    """A model that ties its embeddings, trained with full weights, is served from its untied view
    (trainer/model/tied.py): an engine the user started can't be given it, and some models can't be written as one. Any
    model whose config.json and weights disagree about the tie is refused whatever trains it (tie_disagreement).
    With LoRA the engine serves the model as shipped; verl syncs weights its own way."""
    from trainer.model.tied import tie_disagreement, ties_embeddings, unservable

    r, t = cfg.rollout, cfg.trainer
    if cfg.model.path and (disagreement := tie_disagreement(cfg.model.path)) is not None:
        raise ConfigError(f"model.path {cfg.model.path!r}: {disagreement}")
    if t.lora.rank > 0 or cfg.backbone != "harness" or not ties_embeddings(cfg.model.path):
        return
    if r.engine.url:
        raise ConfigError(f"model.path {cfg.model.path!r} ties its input and output embeddings, and the engine at "
                          f"rollout.engine.url {r.engine.url} serves it as it is: vLLM's weight reload would keep its "
                          "old output layer. Leave rollout.engine.url out (harness then starts the engine from an "
                          "untied view of the model), or train with LoRA (trainer.lora.rank)")
    why = unservable(cfg.model.path) if serves else None
    if why is not None:
        raise ConfigError(f"model.path {cfg.model.path!r} ties its input and output embeddings, and {why}")


def correction_of(cfg: TrainConfig):
    """The run's off-policy correction (trainer.correction, or trainer.tis_cap's token TIS), parsed: a
    trainer.maths.rollout_correction.Correction. ConfigError names the key and the values allowed."""
    from trainer.maths.rollout_correction import Correction, parse_bounds, parse_rejection

    t, c = cfg.trainer, cfg.trainer.correction
    key = "trainer.correction"
    if t.tis_cap is not None and c.level != "off":
        raise ConfigError(f"trainer.tis_cap {t.tis_cap:g} is the short form of {key}.level: token with threshold "
                          f"{t.tis_cap:g}, and {key}.level is {c.level!r} too: give one of them")
    if t.tis_cap is not None and c.threshold != "2.0":
        raise ConfigError(f"trainer.tis_cap {t.tis_cap:g} is the weights' bound already: drop {key}.threshold "
                          f"{c.threshold!r}, or replace tis_cap by {key}.level: token with that threshold")
    problems = [
        (c.batch_normalize and c.level == "off" and t.tis_cap is None,
         f"{key}.batch_normalize normalises importance weights: set {key}.level (token or sequence)"),
        (c.reject is not None and c.reject_threshold is None,
         f"{key}.reject {c.reject!r} needs {key}.reject_threshold: one bound for all options or one per option, "
         "e.g. 0.5_2.0 for a k1 option (on engine / pi_old), 0.01 for k2 or k3"),
        (c.threshold != "2.0" and c.level == "off",
         f"{key}.threshold {c.threshold!r} bounds importance weights: set {key}.level (token or sequence)"),
        (c.reject_threshold is not None and c.reject is None,
         f"{key}.reject_threshold {c.reject_threshold!r} bounds rejection options: set {key}.reject too"),
        (c.loss != "ppo_clip" and c.mode != "bypass",
         f"{key}.loss {c.loss!r} is the loss of mode bypass (decoupled mode keeps the PPO clip): set {key}.mode: "
         "bypass, or leave loss out"),
    ]
    for failed, message in problems:
        if failed:
            raise ConfigError(message)
    try:
        upper, lower = (t.tis_cap, None) if t.tis_cap is not None else parse_bounds(c.threshold, f"{key}.threshold")
        reject = tuple(parse_rejection(c.reject, c.reject_threshold)) if c.reject is not None else ()
    except ValueError as exc:
        message = str(exc)
        where = "" if message.startswith(key) else f"{key}.reject_threshold: " if "threshold" in message else \
            f"{key}.reject: "
        raise ConfigError(where + message) from None
    level = "token" if t.tis_cap is not None else None if c.level == "off" else c.level
    return Correction(level, upper, lower, c.batch_normalize, reject, c.mode == "bypass", c.loss == "reinforce")


def _check_memory_plan(cfg: TrainConfig, gpus: Gpus | None, serves: bool) -> None:
    """Sleep mode where it can work, the GPU lists against the machine, and the memory plan (`memory_plan`: the
    engines' share, the trainer's weights, gradients and AdamW moments, and a micro-batch's activations) within a
    GPU's memory: refused here, with the numbers and what would fit, rather than as an out-of-memory error at the
    first update."""
    r, t, e = cfg.rollout, cfg.trainer, cfg.rollout.engine
    if e.sleep and r.async_.max_staleness > 0:
        raise ConfigError(f"rollout.engine.sleep {e.sleep} puts the engine to sleep while a step trains, but with "
                          f"rollout.async.max_staleness {r.async_.max_staleness} the next steps' episodes run on it "
                          "meanwhile: set one of them to 0")
    if e.sleep == 2 and t.lora.rank > 0:
        raise ConfigError("rollout.engine.sleep 2 drops the engine's weights, and with LoRA (trainer.lora.rank "
                          f"{t.lora.rank}) each push loads only the adapter, so the base weights would never come "
                          "back: use rollout.engine.sleep 1")
    if cfg.backbone != "harness":
        return
    found = memory_plan(cfg, gpus, serves)
    if e.sleep and serves and e.url is None and found.placement is None:
        raise ConfigError(f"rollout.engine.sleep {e.sleep} needs the engine on a CUDA GPU (vLLM's sleep mode), and "
                          "this machine has none visible: leave it 0 on CPU")
    if found.problem is not None:
        raise ConfigError(found.problem)


def _check_offline(cfg: TrainConfig, where: str, mode: Mode) -> None:
    o, t = cfg.offline, cfg.trainer
    command = "harness train --from-run" if mode == "from_run" else "harness sft"
    problems = [
        (mode == "from_run" and not o.run, f"harness train --from-run needs a run id: give --from-run RUN (or set "
         f"offline.run in {where}); `harness sql \"SELECT DISTINCT run_id FROM episode_summary\"` lists them"),
        (mode == "sft" and not o.data, f"harness sft needs chat records: set offline.data in {where} (e.g. a file "
         "`harness export --run RUN --out chat.jsonl` wrote)"),
        (mode == "sft" and o.loss != "sft", f"harness sft trains on chat data, which has no rewards or sampling "
         f"logprobs: offline.loss {o.loss!r} needs a recorded run (harness train --from-run RUN)"),
        (o.loss == "pg" and t.adv_estimator in ("gae", "remax"), f"offline.loss pg compares each episode with its "
         f"recorded group; trainer.adv_estimator {t.adv_estimator!r} needs a critic or greedy episodes at the "
         "trained weights: choose grpo, grpo_no_std, drgrpo, rloo, reinforce_pp or reinforce_pp_baseline"),
        (o.loss == "pg" and o.allow_retokenized, "offline.allow_retokenized needs offline.loss sft: retokenized "
         "calls have no sampling logprobs for pg's importance ratio"),
        (t.kl_coef > 0 or t.entropy_coef > 0, f"{command} has no reference model or entropy term: set "
         "trainer.kl_coef=0 and trainer.entropy_coef=0 (e.g. --set trainer.kl_coef=0)"),
        (cfg.backbone != "harness", f"{command} runs on backbone harness; got backbone {cfg.backbone!r}"),
    ]
    raise_all([message for failed, message in problems if failed])


def _split_ok(command: str) -> bool:
    try:
        return bool(shlex.split(command))
    except ValueError:
        return False


def _leaves(cfg: Any, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any, Any]]:
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{key_name(f)}.")
        else:
            yield prefix + key_name(f), f, hints[f.name], value
