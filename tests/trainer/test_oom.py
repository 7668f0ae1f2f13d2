"""Out of memory in the trainer is one line with the numbers and what to lower, for torch's CUDA error (its message
as torch 2.x writes it) and for the CPU allocator's (raised here for real, by asking for 10 TB)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.config import load_config
from trainer.rl.oom import TrainerOutOfMemory, oom_explained

TERSE_YAML = Path(__file__).resolve().parents[2] / "examples" / "train" / "terse.yaml"
CUDA = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.72 GiB of which 1.21 GiB "
        "is free. Including non-PyTorch memory, this process has 138.49 GiB memory in use. Of the allocated memory "
        "130.10 GiB is allocated by PyTorch, and 6.87 GiB is reserved by PyTorch but unallocated.")


def _cfg(tiny_model_dir, *overrides):
    return load_config(TERSE_YAML, [f"model.path={tiny_model_dir}", "trainer.micro_batch_tokens=50000", *overrides])


def test_a_cuda_out_of_memory_error_names_what_it_asked_for_what_there_was_and_what_to_lower(tiny_model_dir):
    with pytest.raises(TrainerOutOfMemory) as raised, oom_explained(_cfg(tiny_model_dir), "cuda:0"):
        raise torch.OutOfMemoryError(CUDA)
    message = str(raised.value)
    assert message.startswith("the trainer ran out of memory on cuda:0: it asked for 2.00 GiB more of a 139.72 GiB "
                              "GPU with 1.21 GiB free (trainer.micro_batch_tokens 50000")
    for way in ("lower trainer.micro_batch_tokens (now 50000; half is 25000)", "model.gradient_checkpointing",
                "model.activation_offload", "trainer.lora.rank"):
        assert way in message
    assert "\n" not in message and isinstance(raised.value.__cause__, torch.OutOfMemoryError)


def test_the_advice_leaves_out_what_is_on_already(tiny_model_dir):
    cfg = _cfg(tiny_model_dir, "model.gradient_checkpointing=true", "trainer.lora.rank=8")
    with pytest.raises(TrainerOutOfMemory) as raised, oom_explained(cfg, "cuda:0"):
        raise torch.OutOfMemoryError(CUDA)
    assert "gradient_checkpointing true" in str(raised.value)
    assert "turn on model.gradient_checkpointing" not in str(raised.value) and "lora" not in str(raised.value)


def test_the_cpu_allocator_s_error_and_other_errors(tiny_model_dir):
    cfg = _cfg(tiny_model_dir)
    with pytest.raises(TrainerOutOfMemory, match=r"asked for 9313.23 GiB more of CPU memory"), \
            oom_explained(cfg, "cpu"):
        torch.empty(10**13, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="not memory") as other, oom_explained(cfg, "cpu"):
        raise RuntimeError("not memory")
    assert not isinstance(other.value, TrainerOutOfMemory)
