"""A run's beginning and end, shared by the RL loop and offline training: seeding, the trained model written, and
winding down however the run ends."""

from __future__ import annotations

import logging
import random

import torch

from trainer.config import TrainConfig
from trainer.config.roles import adapters_of
from trainer.model.checkpoint import save_hf
from trainer.model.fsdp import Dist, full_state_dict, shutdown
from trainer.model.lora import save_adapter, spec_of
from trainer.rl.rollout import Rollouts
from trainer.rl.tracking import Tracker

log = logging.getLogger("harness.train")


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
