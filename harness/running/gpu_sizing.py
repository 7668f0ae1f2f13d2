"""What fits on a GPU: the sizing table of docs/gpu.md, computed from the published shapes of Qwen2.5's sizes with the
memory plan's own estimate (harness/running/gpus.py `trainer_memory`) plus estimates of activations and of the
engine's weights and KV cache. Estimates on paper, not measurements: `python -m harness.running.gpu_sizing` prints
the table (tests/running/test_gpus.py checks docs/gpu.md holds it as printed).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.running.gpus import GIB, trainer_memory

LORA_RANK = 16
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # every linear projection, as the config's default


@dataclass(frozen=True)
class Shape:
    """A decoder's published shape (config.json): what the memory depends on."""

    name: str
    parameters: int  # all of them, embeddings included
    hidden: int
    layers: int
    intermediate: int
    kv_dim: int  # key/value heads x head dim
    vocab: int

    def lora_parameters(self, rank: int = LORA_RANK) -> int:
        """Adapters of `rank` on every projection: rank x (in + out) each."""
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        per_layer = (h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h)
        return rank * per_layer * self.layers

    def activation_bytes(self, tokens: int, checkpointing: bool) -> int:
        """Activations kept for the backward pass over `tokens` (bf16 compute, SDPA attention, no padding): per
        layer the inputs of its norms and projections, q/k/v, and the MLP's four intermediate-wide tensors; with
        gradient checkpointing only each layer's input. Plus the float32 logits and their log-softmax, over the
        whole vocabulary, which checkpointing does not save."""
        per_layer = self.hidden if checkpointing else 6 * self.hidden + 2 * self.kv_dim + 4 * self.intermediate
        return tokens * (2 * per_layer * self.layers + 2 * 4 * self.vocab)

    def kv_bytes(self, tokens: int) -> int:
        """The engine's KV cache for `tokens` (bf16 keys and values in every layer)."""
        return tokens * 2 * self.layers * self.kv_dim * 2


QWEN25 = (  # Qwen2.5's configs: hidden_size, num_hidden_layers, intermediate_size, kv heads x 128, vocab_size
    Shape("0.5B", 494_032_768, 896, 24, 4864, 2 * 64, 151_936),
    Shape("1.5B", 1_543_714_304, 1536, 28, 8960, 2 * 128, 151_936),
    Shape("3B", 3_085_938_688, 2048, 36, 11008, 2 * 128, 151_936),
    Shape("7B", 7_615_616_512, 3584, 28, 18944, 4 * 128, 151_936),
)


def sizing_table(shapes: tuple[Shape, ...] = QWEN25) -> str:
    """The markdown table: per model size, the trainer's memory on one GPU (full training in float32 master
    weights or bf16, LoRA), activations per 1k tokens, and what the engine's bf16 weights and 8k tokens of KV cache
    take of its share."""
    rows = ["| model | full, float32 (`model.dtype: auto`) | full, bf16 | LoRA r16, bf16 base "
            "| activations / 1k tokens (checkpointing off / on) | engine: bf16 weights + KV cache / 8k tokens |",
            "|---|---:|---:|---:|---:|---:|"]
    for s in shapes:
        full32, full16 = trainer_memory(s.parameters, 4), trainer_memory(s.parameters, 2)
        lora = trainer_memory(s.parameters, 2, lora=True, trainable=s.lora_parameters())
        rows.append(f"| Qwen2.5-{s.name} | {_gib(full32.peak)} | {_gib(full16.peak)} | {_gib(lora.peak)} | "
                    f"{_gib(s.activation_bytes(1024, False))} / {_gib(s.activation_bytes(1024, True))} | "
                    f"{_gib(2 * s.parameters)} + {_gib(s.kv_bytes(8192))} |")
    return "\n".join(rows) + "\n"


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


if __name__ == "__main__":
    print(sizing_table(), end="")
