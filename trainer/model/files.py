"""The files of a model directory, below both the checkpoints (trainer/model/checkpoint.py) and the untied engine view
(trainer/model/tied.py) that write one: what to copy besides the weights, and the weights themselves, written as
transformers writes them (one `model.safetensors`, or shards and their index) one shard at a time."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["INDEX", "SINGLE", "copy_model_files", "gathered", "unshared_contiguous", "write_weights"]

SINGLE = "model.safetensors"  # the weights of a model written in one file
INDEX = "model.safetensors.index.json"  # which shard holds each tensor, when written in several
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".safetensors.index.json",
                    ".bin.index.json")


def copy_model_files(model_dir: Path, out: Path) -> None:
    """Every file of a model directory that is not weights (config, tokenizer, chat template) into `out`."""
    for item in sorted(model_dir.iterdir()):
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(item, out / item.name)


def write_weights(out: Path, tensors: Mapping[str, torch.Tensor], *, max_shard_bytes: int,
                  dtype: torch.dtype | None = None) -> list[Path]:
    """Write `tensors` into the directory `out` as safetensors in `dtype` (None: each in its own); return the files.

    Shards hold up to `max_shard_bytes` (a tensor larger than that gets a shard of its own): one shard is written
    as `model.safetensors`, several as `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`, as
    transformers' save_pretrained writes them. Each shard's tensors are brought to the CPU and cast only while that
    shard is written, so besides `tensors` themselves this needs one shard in `dtype` of host memory (none for
    tensors already on the CPU in `dtype`). Tensors sharded by FSDP (DTensors) are gathered one at a time: a
    collective in which every other rank runs `gathered` over the same tensors in the same order.
    """
    from safetensors.torch import save_file

    shards = _plan_shards(tensors, max_shard_bytes, dtype)
    names = [SINGLE] if len(shards) == 1 else [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                                for i in range(1, len(shards) + 1)]
    for name, shard in zip(names, shards, strict=True):
        on_host = {key: _on_host(tensors[key], dtype) for key in shard}
        save_file(unshared_contiguous(on_host), out / name, metadata={"format": "pt"})
        del on_host  # the next shard is cast only once this one is on disk
    if len(shards) == 1:
        return [out / SINGLE]
    index = {"metadata": {"total_parameters": sum(t.numel() for t in tensors.values()),
                          "total_size": sum(_nbytes(t, dtype) for t in tensors.values())},
             "weight_map": {key: name for name, shard in zip(names, shards, strict=True) for key in shard}}
    (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return [out / name for name in names] + [out / INDEX]


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` whole, on its device: an FSDP-sharded one (a DTensor) all-gathered from every rank (a collective,
    as torch.distributed.checkpoint gathers a full state dict, parameters offloaded to the CPU included)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    if tensor.device.type != tensor.device_mesh.device_type:  # parameters offloaded to the CPU
        tensor = tensor.to(tensor.device_mesh.device_type)
    return tensor.full_tensor()


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


def _on_host(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Whole, in `dtype`, on the CPU: cast where it lives (on a GPU, only the cast copy crosses to the host)."""
    whole = gathered(tensor.detach())
    return whole.to(dtype=dtype or whole.dtype).cpu()


def _nbytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    return tensor.numel() * (dtype or tensor.dtype).itemsize


def _plan_shards(tensors: Mapping[str, torch.Tensor], max_bytes: int, dtype: torch.dtype | None) -> list[list[str]]:
    """The names in each shard, in the order of `tensors`: a new shard where the next tensor would overflow one."""
    if max_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_bytes!r}")
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = _nbytes(tensor, dtype)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards
