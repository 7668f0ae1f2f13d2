"""The trainer's tests' fixtures: the tiny model with tied embeddings."""

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
