"""The files of a model directory, below both the checkpoints (trainer/checkpoint.py) and the untied engine view
(trainer/tied.py) that write one: what to copy besides the weights, and a state dict safetensors will take."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["copy_model_files", "unshared_contiguous"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".safetensors.index.json",
                    ".bin.index.json")


def copy_model_files(model_dir: Path, out: Path) -> None:
    """Every file of a model directory that is not weights (config, tokenizer, chat template) into `out`."""
    for item in sorted(model_dir.iterdir()):
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(item, out / item.name)


def unshared_contiguous(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings in a plain state dict): copy those."""
    seen: set[int] = set()
    result = {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu().contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        result[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    return result
