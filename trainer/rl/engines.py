"""The run's engines, from the trainer's side: how the new weights reach them (a checkpoint per push, or with LoRA
the adapter; one per policy with several), and putting them to sleep around the update and waking them after."""

from __future__ import annotations

import time

from harness.running.vllm_server import cuda_gpus, sleep, wake_up
from trainer.config import TrainConfig
from trainer.config.roles import adapters_of
from trainer.model.fsdp import Dist, full_state_dict
from trainer.model.lora import ADAPTER_NAME, adapters_in_use, spec_of
from trainer.model.weight_sync import WeightSync, engine_dtype, follow_push
from trainer.rl.rollout import Rollouts, engine_model_dir


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
