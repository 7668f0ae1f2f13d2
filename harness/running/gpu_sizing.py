"""What fits on a GPU: the sizing table of docs/gpu.md, with the memory plan's own arithmetic (harness/running/gpus.py:
`trainer_memory`, `Shape.activation_bytes`) plus the engine's bf16 weights and KV cache. Estimates on paper, not
measurements.

    python -m harness.running.gpu_sizing                     Qwen2.5's published sizes: docs/gpu.md's table
    python -m harness.running.gpu_sizing MODEL [MODEL ...]   those models, each a model directory or a Hugging Face
                                                             id whose config.json is in the local cache

tests/running/test_gpus.py checks that docs/gpu.md holds the table as printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.running.gpus import GIB, Shape, count_parameters, trainer_memory
from harness.running.hub import is_hub_id

__all__ = ["QWEN25", "SizingError", "main", "shape_of", "sizing_table"]

LORA_RANK = 16
MICRO_BATCH_TOKENS = 8192  # trainer.micro_batch_tokens's default
KV_TOKENS = 8192

QWEN25 = (  # Qwen2.5's configs: hidden_size, num_hidden_layers, intermediate_size, kv heads x 128, vocab_size
    Shape("Qwen2.5-0.5B", 494_032_768, 896, 24, 4864, 2 * 64, 151_936),
    Shape("Qwen2.5-1.5B", 1_543_714_304, 1536, 28, 8960, 2 * 128, 151_936),
    Shape("Qwen2.5-3B", 3_085_938_688, 2048, 36, 11008, 2 * 128, 151_936),
    Shape("Qwen2.5-7B", 7_615_616_512, 3584, 28, 18944, 4 * 128, 151_936),
)


class SizingError(ValueError):
    """A model argument that names no model whose config.json can be read here; the message is one line."""


def sizing_table(shapes: Sequence[Shape] = QWEN25) -> str:
    """The markdown table: per model, the trainer's memory on one GPU (full training in float32 master weights or
    bf16, LoRA), the activations of a default micro-batch, and what the engine's bf16 weights and 8k tokens of KV
    cache take of its share."""
    rows = ["| model | full, float32 (`model.dtype: auto`) | full, bf16 | LoRA r16, bf16 base "
            "| activations / 8k-token micro-batch (checkpointing off / on) "
            "| engine: bf16 weights + KV cache / 8k tokens |",
            "|---|---:|---:|---:|---:|---:|"]
    for s in shapes:
        full32, full16 = trainer_memory(s.parameters, 4), trainer_memory(s.parameters, 2)
        lora = trainer_memory(s.parameters, 2, lora=True, trainable=s.lora_parameters(LORA_RANK))
        rows.append(f"| {s.name} | {_gib(full32.peak)} | {_gib(full16.peak)} | {_gib(lora.peak)} | "
                    f"{_gib(s.activation_bytes(MICRO_BATCH_TOKENS, False))} / "
                    f"{_gib(s.activation_bytes(MICRO_BATCH_TOKENS, True))} | "
                    f"{_gib(2 * s.parameters)} + {_gib(s.kv_bytes(KV_TOKENS))} |")
    return "\n".join(rows) + "\n"


def shape_of(model: str) -> tuple[Shape, bool]:
    """The shape of `model` (a model directory, or a Hub id whose config.json is in the local Hugging Face cache:
    nothing is downloaded) and whether its parameters were counted from safetensors headers (else estimated from
    config.json). SizingError says why it can't be read."""
    path = Path(model).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise SizingError(f"{model!r} is a directory without a config.json: give a Hugging Face model directory")
    elif is_hub_id(model):
        config = _cached_config(model)
    else:
        raise SizingError(f"{model!r} is neither a model directory nor a Hugging Face id (org/name)")
    try:
        parameters = count_parameters(config.parent)
        return Shape.from_config(model, json.loads(config.read_text(encoding="utf-8")), parameters), bool(parameters)
    except (ValueError, AttributeError, OSError) as exc:
        raise SizingError(f"{model!r}: can't read {str(config)!r}: {exc}") from None


def _cached_config(repo_id: str) -> Path:
    """The config.json of `repo_id` in the local Hugging Face cache (nothing downloaded)."""
    from harness.running.hub import ModelNotFoundError, resolve_model

    try:
        return resolve_model(repo_id, "MODEL", files="config", download=False) / "config.json"
    except ModelNotFoundError as exc:
        raise SizingError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.running.gpu_sizing",
        description="Print the GPU memory table of docs/gpu.md: per model, the trainer's memory on one GPU (full "
        "training in float32 or bf16, LoRA r16), the activations of an 8192-token micro-batch (gradient "
        "checkpointing off / on) and the engine's bf16 weights + KV cache. Estimates on paper, as the memory plan "
        "of `harness train --check` computes them.")
    parser.add_argument("models", nargs="*", metavar="MODEL", help="a model directory or a Hugging Face id whose "
                        "config.json is in the local cache (nothing is downloaded); none: Qwen2.5's sizes")
    args = parser.parse_args(argv)
    if not args.models:
        print(sizing_table(), end="")
        return 0
    shapes, estimated = [], []
    for model in args.models:
        try:
            shape, counted = shape_of(model)
        except SizingError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        shapes.append(shape)
        if not counted:
            estimated.append(model)
    print(sizing_table(shapes), end="")
    if estimated:
        print(f"\nparameters estimated from config.json (no safetensors weights here): {', '.join(estimated)}")
    return 0


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


if __name__ == "__main__":
    sys.exit(main())
