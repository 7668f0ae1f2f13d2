"""A config's memory plan: where its engines and trainer ranks go on the machine's GPUs (`placement_of`), and what
the busiest trainer GPU holds while the engines generate and while the trainer updates (`memory_plan`), with the
settings that would make a plan that does not fit fit. trainer/config/checks.py refuses a plan with a problem;
`harness train --check` prints it."""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.running.engine_args import gpu_memory_share
from harness.running.gpus import (
    ENGINE_ASLEEP,
    GIB,
    GpuMemory,
    Gpus,
    Placement,
    PlacementError,
    Shape,
    TrainerMemory,
    count_parameters,
    gpu_memory,
    lora_parameters,
    memory_problem,
    model_shape,
    plan,
    this_machine,
    trainer_memory,
)
from trainer.config.errors import ConfigError
from trainer.config.keys import TrainConfig

__all__ = ["MemoryPlan", "memory_plan", "placement_of"]


def placement_of(cfg: TrainConfig, gpus: Gpus | None = None, serves: bool = True) -> Placement | None:
    """Where the run's engines and trainer ranks go on `gpus` (None: this machine's); None without GPUs or with
    backbone verl (its own placement). PlacementError (a ValueError) names what does not fit."""
    if cfg.backbone != "harness":
        return None
    e, p = cfg.rollout.engine, cfg.placement
    share = e.gpu_memory_utilization
    if share is None:  # an older config's way to say it: vLLM's own flag
        try:
            share = gpu_memory_share(e.extra_args, "rollout.engine.extra_args")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return plan(this_machine() if gpus is None else gpus, layout=p.layout, engines=cfg.rollout.engines,
                nprocs=cfg.trainer.fsdp.nprocs, engine_gpus=p.engine_gpus, trainer_gpus=p.trainer_gpus,
                share=share, attached=e.url is not None or not serves)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """A config's memory plan on a machine: where engines and trainer ranks go, and what the busiest trainer GPU
    holds while the engines generate and while the trainer updates. `harness train --check` prints it; `check`
    refuses a plan with a problem."""

    placement: Placement | None  # None: no GPU visible, or backbone verl (its own placement)
    gpu_bytes: int | None  # each GPU's memory (the smallest's); None: unknown
    shape: Shape | None  # the model's, from its config.json; None: model.path is not a local model directory
    trainer: TrainerMemory | None  # per trainer GPU; None: no safetensors weights to count the parameters of
    activations: int  # one micro-batch's, model.gradient_checkpointing as configured (0 without a shape)
    activations_flipped: int  # the same with model.gradient_checkpointing the other way
    gpu: GpuMemory | None  # the busiest trainer GPU; None without a placement, the GPU's memory or the trainer's
    problem: str | None  # why it does not fit, with what would make it fit; None when it fits or can't be told


def memory_plan(cfg: TrainConfig, gpus: Gpus | None = None, serves: bool = True) -> MemoryPlan:
    """The memory plan of `cfg` on `gpus` (None: this machine's), for a run whose engines serve (`serves`: rl, or
    validation with the agent). ConfigError for GPU lists that can't be used."""
    machine = this_machine() if gpus is None else gpus
    try:
        placement = placement_of(cfg, machine, serves)
    except PlacementError as exc:
        raise ConfigError(str(exc)) from None
    path, m = cfg.model.path, cfg.model
    shape = model_shape(path) if path else None
    parameters = count_parameters(path) if path and cfg.backbone == "harness" else None
    trainer = _trainer_memory(cfg, parameters) if parameters else None
    gpu = _gpu_memory(cfg, machine, parameters, shape, serves) if trainer else None
    problem = None
    if gpu is not None and placement is not None and not gpu.fits:
        what = memory_problem(gpu.trainer, gpu.total, placement, sleep=bool(cfg.rollout.engine.sleep),
                              activations=gpu.activations)
        problem = (f"the memory plan does not fit ({placement.describe()}; {parameters / 1e9:.2f}B parameters, "
                   f"model.dtype {m.dtype}, trainer.micro_batch_tokens {cfg.trainer.micro_batch_tokens}, "
                   f"model.gradient_checkpointing {str(m.gradient_checkpointing).lower()}): {what}. "
                   f"{_fits_with(cfg, machine, parameters, shape, serves, gpu)}")
    return MemoryPlan(placement, machine.memory_bytes, shape, trainer,
                      _activations(cfg, shape, m.gradient_checkpointing),
                      _activations(cfg, shape, not m.gradient_checkpointing), gpu, problem)


_HALF = ("bfloat16", "float16")


def _trainer_memory(cfg: TrainConfig, parameters: int) -> TrainerMemory:
    t, lora = cfg.trainer, cfg.trainer.lora.rank > 0
    return trainer_memory(parameters, 2 if cfg.model.dtype in _HALF else 4, world=t.fsdp.nprocs, lora=lora,
                          trainable=lora_parameters(cfg.model.path, t.lora.rank, t.lora.target_modules)
                          if lora else None, reference=t.kl_coef > 0, critic=t.adv_estimator == "gae",
                          offload=t.fsdp.param_offload or t.fsdp.optimizer_offload)


def _activations(cfg: TrainConfig, shape: Shape | None, checkpointing: bool) -> int:
    """One micro-batch's activations, computed in bf16 with trainer.fsdp.mixed_precision or a bf16 model."""
    if shape is None:
        return 0
    half = cfg.trainer.fsdp.mixed_precision or cfg.model.dtype in _HALF
    return shape.activation_bytes(cfg.trainer.micro_batch_tokens, checkpointing, 2 if half else 4,
                                  offload=cfg.model.activation_offload)


def _gpu_memory(cfg: TrainConfig, machine: Gpus, parameters: int, shape: Shape | None,
                serves: bool) -> GpuMemory | None:
    placement = placement_of(cfg, machine, serves)
    if placement is None or machine.memory_bytes is None:
        return None
    return gpu_memory(_trainer_memory(cfg, parameters), machine.memory_bytes, placement,
                      sleep=bool(cfg.rollout.engine.sleep),
                      activations=_activations(cfg, shape, cfg.model.gradient_checkpointing))


def _fits_with(cfg: TrainConfig, machine: Gpus, parameters: int, shape: Shape | None, serves: bool,
               now: GpuMemory) -> str:
    """What would make a plan that does not fit fit, leaving out what is on already: each setting with what it
    saves on the busiest GPU (the same plan recomputed with it), from the cheapest to try."""
    t, m, e = cfg.trainer, cfg.model, cfg.rollout.engine
    n = t.fsdp.nprocs
    tries: list[dict[str, Any]] = []
    if not m.gradient_checkpointing:
        tries.append({"model.gradient_checkpointing": True})
    if now.engines and not e.sleep and cfg.rollout.async_.max_staleness == 0:
        tries.append({"rollout.engine.sleep": 1})
    if t.micro_batch_tokens > 1:
        tries.append({"trainer.micro_batch_tokens": t.micro_batch_tokens // 2})
    if not m.activation_offload:
        tries.append({"model.activation_offload": True})
    if m.dtype not in _HALF:
        tries.append({"model.dtype": "bfloat16"})
    if t.lora.rank == 0:
        tries.append({"trainer.lora.rank": 16} | ({"rollout.engine.sleep": 1} if e.sleep == 2 else {}))
    if not (t.fsdp.param_offload or t.fsdp.optimizer_offload):
        tries.append({"trainer.fsdp.param_offload": True})
    if machine.count >= 2 * n and not cfg.placement.trainer_gpus:
        tries.append({"trainer.fsdp.nprocs": 2 * n})
    if now.engines and machine.count > n:
        tries.append({"placement.layout": "split"})
    ways = []
    if (share := _fitting_share(now, bool(e.sleep), 2 * parameters)) is not None:
        ways.append(f"rollout.engine.gpu_memory_utilization: {share:.2f} (then it fits, each engine keeping "
                    f"~{share * now.total / GIB:.1f} GiB for its bf16 weights, ~{2 * parameters / GIB:.1f} GiB, and "
                    "its KV cache)")
    for changes in tries:
        try:
            after = _gpu_memory(_with(cfg, changes), machine, parameters, shape, serves)
        except (ConfigError, PlacementError):
            continue
        if after is not None and after.worst < now.worst:
            setting = " and ".join(f"{key}: {str(value).lower()}" for key, value in changes.items())
            ways.append(f"{setting} (saves ~{(now.worst - after.worst) / GIB:.1f} GiB"
                        f"{', then it fits' if after.fits else ''})")
    if not ways:
        return "No setting of this config makes it fit: a GPU with more memory, or a smaller model"
    return "To fit, set one or more of: " + "; ".join(ways)


def _fitting_share(now: GpuMemory, sleep: bool, engine_weights: int) -> float | None:
    """The largest rollout.engine.gpu_memory_utilization below the present one with which the plan fits and each
    engine still holds its weights and a GiB of KV cache; None when there is none."""
    if not now.engines:
        return None
    total, per = now.total, now.engines * now.total
    share = min((total - now.trainer.resident) / per,
                (total - now.trainer.peak - now.activations) / (per * (ENGINE_ASLEEP if sleep else 1)))
    share = int(share * 100) / 100
    if share >= now.share or share * total < engine_weights + GIB:
        return None
    return share


def _with(cfg: Any, changes: dict[str, Any]) -> Any:
    """`cfg` with the dotted keys of `changes` (their field names) set."""
    for dotted, value in changes.items():
        head, _, rest = dotted.partition(".")
        inner = _with(getattr(cfg, head), {rest: value}) if rest else value
        cfg = dataclasses.replace(cfg, **{head: inner})
    return cfg
