"""A trainer that runs out of memory says so in one line: what it asked for, what the device had, and the settings
that lower it, instead of torch's traceback. Both of torch's ways of saying it are read: CUDA's
`torch.OutOfMemoryError` ("Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.72 GiB of which 1.21
GiB is free...") and the CPU allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory: you tried to
allocate N bytes")."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch

from trainer.config.keys import TrainConfig

__all__ = ["TrainerOutOfMemory", "advice", "explain_oom"]

_ASKED = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)")
_CUDA_TOTAL = re.compile(r"total capacity of ([\d.]+ [KMGT]?i?B) of which ([\d.]+ [KMGT]?i?B) is free")
_CPU_ASKED = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")


class TrainerOutOfMemory(RuntimeError):
    """The trainer's device ran out of memory; the message names the numbers and what to turn down or on."""


def advice(cfg: TrainConfig) -> str:
    """The settings that lower the trainer's memory, from the cheapest to try, leaving out those already on."""
    t, m = cfg.trainer, cfg.model
    ways = [f"lower trainer.micro_batch_tokens (now {t.micro_batch_tokens}; half is "
            f"{max(1, t.micro_batch_tokens // 2)})"]
    if not m.gradient_checkpointing:
        ways.append("turn on model.gradient_checkpointing")
    if not m.activation_offload:
        ways.append("model.activation_offload")
    if not (t.fsdp.param_offload or t.fsdp.optimizer_offload):
        ways.append("trainer.fsdp.param_offload")
    if t.lora.rank == 0:
        ways.append("train with LoRA (trainer.lora.rank: 16)")
    if m.dtype in ("auto", "float32"):
        ways.append("train in model.dtype bfloat16")
    return ", ".join(ways[:-1]) + " or " + ways[-1] if len(ways) > 1 else ways[0]


def explain_oom(exc: BaseException, cfg: TrainConfig, device: torch.device | str) -> TrainerOutOfMemory | None:
    """The one-line error for `exc` when it is an out-of-memory error of torch (None otherwise)."""
    text = str(exc)
    if isinstance(exc, torch.OutOfMemoryError):
        asked, total = _ASKED.search(text), _CUDA_TOTAL.search(text)
        had = f" of a {total.group(1)} GPU with {total.group(2)} free" if total else ""
        what = f"asked for {asked.group(1)} more{had}" if asked else "ran out"
    elif isinstance(exc, RuntimeError) and (cpu := _CPU_ASKED.search(text)):
        what = f"asked for {int(cpu.group(1)) / 1024**3:.2f} GiB more of CPU memory"
    else:
        return None
    return TrainerOutOfMemory(f"the trainer ran out of memory on {device}: it {what} (trainer.micro_batch_tokens "
                              f"{cfg.trainer.micro_batch_tokens}, model.gradient_checkpointing "
                              f"{str(cfg.model.gradient_checkpointing).lower()}). To fit: {advice(cfg)}")


@contextlib.contextmanager
def oom_explained(cfg: TrainConfig, device: torch.device | str) -> Iterator[None]:
    """Around a run: an out-of-memory error leaves as TrainerOutOfMemory, torch's own error as its cause."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        explained = explain_oom(exc, cfg, device)
        if explained is None:
            raise
        raise explained from exc
