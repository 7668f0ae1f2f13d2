"""What the RL loop (trainer/rl/loop.py) and offline training (trainer/offline/loop.py) share besides the model
(trainer/model/build.py): pushing weights, putting the engines to sleep and waking them, validation, tracking,
winding a run down, and small distributed helpers."""

from __future__ import annotations

import logging
import random
import time

import torch

from harness.running.report import pass_at_k
from harness.running.vllm_server import cuda_gpus, sleep, wake_up
from proxy.config import SamplingOverrides
from trainer.config import TrainConfig, config_to_dict, run_dir
from trainer.config.roles import adapters_of
from trainer.model.checkpoint import save_hf
from trainer.model.fsdp import Dist, full_state_dict, shutdown
from trainer.model.lora import ADAPTER_NAME, adapters_in_use, save_adapter, spec_of
from trainer.model.weight_sync import WeightSync, engine_dtype, follow_push
from trainer.rl.experience import Experience, mean
from trainer.rl.rollout import Rollouts, engine_model_dir, sampling_seed
from trainer.rl.tracking import Tracker

log = logging.getLogger("harness.train")


def weight_sync(rollouts: Rollouts, cfg: TrainConfig, out) -> WeightSync | dict[str, WeightSync]:
    """How new weights reach the rollouts' engines: a full checkpoint per push, or with LoRA the adapter; with
    several policies (roles.policies) one sync per policy, each pushing its adapter under names of its own
    (`<policy>-lora-v000042`) that the proxy sends the policy's calls to."""
    lora, model_dir = spec_of(cfg.trainer.lora) is not None, engine_model_dir(cfg, out)
    # pushes are written in the dtype of the engines we start; an engine the user runs gets the trainer's
    dtype = None if cfg.rollout.engine.url else engine_dtype(model_dir, cfg.rollout.engine.extra_args,
                                                             gpu=cuda_gpus() > 0)

    def sync(folder, adapter: str | None, policy: str | None = None) -> WeightSync:
        return WeightSync(rollouts.engine.base_url, folder, proxy_url=rollouts.url,
                          proxy_admin_token=rollouts.admin_token, model_dir=model_dir,
                          keep=adapters_in_use(cfg.rollout.async_.max_staleness) if lora else 2,
                          more_engine_urls=tuple(e.base_url for e in rollouts.more_engines), adapter=adapter,
                          dtype=dtype, peft_adapter=policy, policy=policy)

    if adapters := adapters_of(cfg):
        return {name: sync(out / "adapters" / name, f"{name}-lora", name) for name in adapters}
    return sync(out / ("adapters" if lora else "weights"), ADAPTER_NAME if lora else None)


def tracker_for(store, run_id: str, cfg: TrainConfig) -> Tracker:
    """The run's metrics, into `store` under `run_id` and the logging section's backends."""
    lg = cfg.logging
    return Tracker(store, run_id, run_dir(cfg), project=cfg.project_name, experiment=cfg.experiment_name,
                   config=config_to_dict(cfg), console=lg.console, curve_png=lg.curve_png, swanlab=lg.swanlab,
                   wandb=lg.wandb)


def wind_down(tracker: Tracker | None, rollouts: Rollouts | None) -> None:
    """The end of a run, however it ends: metrics flushed, the proxy and the engines it started stopped, the
    process group left."""
    if tracker is not None:
        tracker.close()
    if rollouts is not None:
        rollouts.close()
        for engine in (rollouts.engine, *rollouts.more_engines):
            engine.stop()
    shutdown()


def by_policy(adapters: tuple[str, ...], policies: list[str]) -> list[tuple[str, list[int]]]:
    """Each policy (adapter) that has samples, with the positions of its samples in `policies` (each sample's)."""
    out = [(name, [i for i, p in enumerate(policies) if p == name]) for name in adapters]
    return [(name, idx) for name, idx in out if idx]


def push_weights(model, sync: WeightSync | dict[str, WeightSync] | None, dist: Dist,
                 version: int) -> dict[str, float]:
    """Write the weights and load them into the engine (rank 0); every rank takes part in the gathers (collectives).
    Full weights are gathered tensor by tensor as the push writes them (at most one shard in host memory); with
    LoRA the whole state is gathered and peft writes the adapter from it."""
    t0 = time.perf_counter()
    if hasattr(model, "peft_config"):
        state = full_state_dict(model, dist)
        if not dist.is_main:
            return {}
        timings = {}
        for one in sync.values() if isinstance(sync, dict) else (sync,):  # each policy's adapter
            for phase, seconds in one.push(model, version, state=state).items():
                timings[phase] = timings.get(phase, 0.0) + seconds
    elif dist.is_main:
        timings = sync.push(model, version)
    else:
        follow_push(model)
        return {}
    return {"time/sync_s": time.perf_counter() - t0, "time/sync_reload_s": timings.get("reload_s", 0.0)}


def sleep_engines(rollouts: Rollouts, level: int) -> float:
    """Put every engine of the run to sleep at `level` (rollout.engine.sleep: their GPU memory goes to the
    trainer's update); the seconds it took. Only once no episode runs: nothing may reach a sleeping engine."""
    started = time.perf_counter()
    for engine in (rollouts.engine, *rollouts.more_engines):
        sleep(engine.base_url, level)
    return time.perf_counter() - started


def wake_engines(rollouts: Rollouts) -> float:
    """Wake every engine of the run, before the new weights are pushed (after level 2 the push is what loads
    them again); the seconds it took. An EngineError names the engine and what it answered."""
    started = time.perf_counter()
    for engine in (rollouts.engine, *rollouts.more_engines):
        wake_up(engine.base_url)
    return time.perf_counter() - started


def validate(rollouts: Rollouts, step: int, tasks, cfg: TrainConfig) -> dict[str, float]:
    """pass@n and mean reward of the validation tasks at validation sampling."""
    v = cfg.rollout.validation
    rollout = rollouts.collect(step, tasks, tag="val", repeat=v.n,
                               sampling=SamplingOverrides(temperature=v.temperature, top_p=v.top_p,
                                                          max_tokens_cap=cfg.rollout.max_tokens,
                                                          seed=sampling_seed(cfg)))
    threshold = cfg.task_judge.success_threshold
    by_task: dict[str, list[bool]] = {}
    for e in rollout.episodes:
        by_task.setdefault(e.task_id, []).append(e.reward is not None and e.reward >= threshold)
    rewards = [e.reward for e in rollout.episodes if e.reward is not None]
    passes = [pass_at_k(len(hits), sum(hits), v.n) for hits in by_task.values()]
    return {"val/pass@n": mean(passes), "val/reward_mean": mean(rewards), "time/validation_s":
            rollout.timings["rollout_s"]}


def broadcast(experience: Experience | None, dist: Dist) -> Experience:
    if dist.world == 1:
        return experience
    box = [experience]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def log_metrics(tracker: Tracker | None, step: int, metrics: dict) -> None:
    if tracker is not None:
        tracker.log(step, metrics)


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def write_trained(model, cfg: TrainConfig, out, dist: Dist) -> None:
    """The end of a run: the trained model as a plain model directory that transformers and vLLM load
    (`<run>/hf`: weights in the trained dtype, the base's config, tokenizer and template, its embeddings tied as
    the base had them), or with LoRA the adapter alone (`<run>/adapter`; harness export --merge makes a whole
    model of it); with several policies each one's adapter (`<run>/adapter/<policy>`). A collective: every rank
    calls it."""
    state = full_state_dict(model, dist)
    if not dist.is_main:
        return
    if spec_of(cfg.trainer.lora) is None:
        log.info("the trained model: %s", save_hf(state, cfg.model.path, out / "hf"))
    elif adapters := adapters_of(cfg):
        for name in adapters:
            (out / "adapter" / name).mkdir(parents=True, exist_ok=True)
            save_adapter(model, out / "adapter" / name, state, name)
        log.info("the trained adapters: %s", ", ".join(str(out / "adapter" / name) for name in adapters))
    else:
        save_adapter(model, out / "adapter", state)
        log.info("the trained adapter: %s", out / "adapter")
