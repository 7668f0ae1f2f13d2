"""The trainer's tests' fixtures: the tiny model with tied embeddings, a one-rank process group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM


@pytest.fixture
def tied_model(tiny_model_dir, tmp_path) -> Path:
    """The tiny model with its output layer tied to its embeddings, saved as transformers saves a tied model."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    out = tmp_path / "tied"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((tiny_model_dir / name).read_bytes())
    return out


@pytest.fixture
def one_rank(monkeypatch):
    """The one-rank process group a process without torchrun trains in (trainer/model/fsdp.py init_distributed)."""
    from trainer.model.fsdp import init_distributed, shutdown

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    dist = init_distributed(device="cpu")
    yield dist
    shutdown()
