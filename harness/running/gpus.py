"""Which GPUs the engines and the trainer ranks of `harness train` use, and whether they fit: the memory plan.

Two layouts (`placement.layout`):

    colocated   engines and trainer ranks on the same GPUs: each engine takes its share of a GPU's memory
                (`rollout.engine.gpu_memory_utilization`), the trainer the rest; with `rollout.engine.sleep` the
                engine gives its part back while the trainer updates
    split       engines on GPUs of their own, trainer ranks on the others: no sharing, no sleeping needed

GPU numbers in the config are indices into the GPUs this process sees, as torch numbers them (`cuda:i`): the
entries of CUDA_VISIBLE_DEVICES when the user set it, else every GPU nvidia-smi lists. An engine is started with
CUDA_VISIBLE_DEVICES set to the entry at its index, so `CUDA_VISIBLE_DEVICES=4,5` and `engine_gpus: [1]` puts the
engine on physical GPU 5. Everything here takes what it knows of the machine as an argument (`Gpus`), so the
plan can be checked for any machine; `this_machine()` asks nvidia-smi once.

The memory of a trainer GPU is estimated in the two phases of a step (`gpu_memory`): while the engines generate,
their share beside the trainer's weights and AdamW moments; while the trainer updates, what the engines keep
(all of it, or little asleep) beside the trainer's weights, moments and gradients (`trainer_memory`, from the
parameter count read from the safetensors headers, no weights loaded) and one micro-batch's activations
(`Shape.activation_bytes`, from the model's config.json). harness/running/gpu_sizing.py prints the same arithmetic
as docs/gpu.md's table. Pure stdlib: no torch, no vllm.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GpuMemory", "Gpus", "Placement", "PlacementError", "Shape", "TrainerMemory", "count_parameters",
           "gpu_memory", "lora_parameters", "memory_problem", "model_shape", "plan", "this_machine", "trainer_memory",
           "visible_gpus", "COLOCATED_SHARE", "ENGINE_ASLEEP", "LOGITS_CHUNK", "SPLIT_SHARE"]

COLOCATED_SHARE = 0.5  # an engine's default share of a GPU it shares with trainer ranks (verl's default too)
SPLIT_SHARE = 0.9  # an engine's default share of a GPU of its own (vLLM's default)
ENGINE_ASLEEP = 0.1  # what a sleeping engine keeps of its share: vLLM's sleep mode frees "up to 90%" of it
LOGITS_CHUNK = 1024  # positions the trainer runs the output layer on at a time (trainer/model/policy.py token_logprobs)
GIB = 1024**3


class PlacementError(ValueError):
    """GPU lists that can't be used on this machine; the message names the key, the numbers and what to do."""


@dataclass(frozen=True)
class Gpus:
    """The GPUs this process sees."""

    ids: tuple[str, ...]  # each visible GPU as CUDA_VISIBLE_DEVICES names it, by torch index; () on a CPU machine
    memory_bytes: int | None = None  # total memory of the smallest GPU (nvidia-smi); None when unknown
    from_env: bool = False  # the list is CUDA_VISIBLE_DEVICES's, not nvidia-smi's

    @property
    def count(self) -> int:
        return len(self.ids)


def visible_gpus(cuda_visible_devices: str | None, smi_memory_mib: Sequence[int]) -> Gpus:
    """The GPUs a process sees, from its CUDA_VISIBLE_DEVICES (None: unset) and the total memory (MiB) of each GPU
    nvidia-smi lists. A machine where nvidia-smi lists none has none, whatever the variable says; a set variable
    decides how many (and which) are seen, as CUDA does: entries up to the first invalid one ("-1", ""), at most
    as many as there are."""
    memory = min(smi_memory_mib) * 1024**2 if smi_memory_mib else None
    if not smi_memory_mib:
        return Gpus(())
    if cuda_visible_devices is None:
        return Gpus(tuple(str(i) for i in range(len(smi_memory_mib))), memory)
    ids: list[str] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if not entry or entry.startswith("-"):
            break
        ids.append(entry)
    return Gpus(tuple(ids[:len(smi_memory_mib)]), memory, from_env=True)


def this_machine() -> Gpus:
    """What this process sees: CUDA_VISIBLE_DEVICES over nvidia-smi's list (no GPU when there is no nvidia-smi)."""
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return Gpus(())
    memory = [int(float(line)) for line in result.stdout.split() if _number(line)] if result.returncode == 0 else []
    return visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), memory)


@dataclass(frozen=True)
class Placement:
    """Where each engine and each trainer rank runs."""

    layout: str  # "colocated" or "split"
    trainer_gpus: tuple[int, ...]  # rank r trains on cuda:trainer_gpus[r] (an index into the visible GPUs)
    engine_gpus: tuple[int, ...]  # engine k runs on visible GPU engine_gpus[k]; () for attached engines
    engine_ids: tuple[str, ...]  # engine k's CUDA_VISIBLE_DEVICES (the visible entry at its index)
    share: float | None  # each started engine's --gpu-memory-utilization; None for attached engines

    def describe(self) -> str:
        """One line for the run's log."""
        engines = (", ".join(f"engine {k} on GPU {i} (CUDA id {c})" for k, (i, c) in
                             enumerate(zip(self.engine_gpus, self.engine_ids, strict=True)))
                   or "engines attached (rollout.engine.url)")
        share = f", each engine takes {self.share:.0%} of its GPU" if self.share is not None else ""
        return f"layout {self.layout}: trainer ranks on GPUs {list(self.trainer_gpus)}; {engines}{share}"


def plan(gpus: Gpus, *, layout: str, engines: int, nprocs: int, engine_gpus: Sequence[int] = (),
         trainer_gpus: Sequence[int] = (), share: float | None = None, attached: bool = False) -> Placement | None:
    """Where `engines` started engines (none when `attached`) and `nprocs` trainer ranks run on `gpus`; None on a
    machine without GPUs. Raises PlacementError with the numbers for lists that can't be used.

    colocated: the trainer on `trainer_gpus` (default the first `nprocs`), engine k on the k-th of them (cycling).
    split: the trainer as above, the engines on `engine_gpus` (default the visible GPUs the trainer leaves, in
    order), disjoint from the trainer's. More engines than engine GPUs share them: only with `share` set."""
    if not gpus.count:
        if engine_gpus or trainer_gpus:
            raise PlacementError(f"placement.engine_gpus {list(engine_gpus)} / trainer_gpus {list(trainer_gpus)} "
                                 "name GPUs, but this machine has none visible (nvidia-smi lists none, or "
                                 "CUDA_VISIBLE_DEVICES hides them): leave the lists empty on a CPU machine")
        return None
    seen = (f"{gpus.count} GPUs visible" + (f" (CUDA_VISIBLE_DEVICES={','.join(gpus.ids)}: indices 0.."
                                            f"{gpus.count - 1} into that list)" if gpus.from_env else ""))
    for key, values in (("engine_gpus", engine_gpus), ("trainer_gpus", trainer_gpus)):
        bad = [i for i in values if not 0 <= i < gpus.count]
        if bad:
            raise PlacementError(f"placement.{key} {list(values)} names GPU {bad[0]}, but there are {seen}")
        if len(set(values)) != len(values):
            raise PlacementError(f"placement.{key} {list(values)} names a GPU twice")
    trainer = tuple(trainer_gpus) or tuple(range(nprocs))
    if len(trainer) != nprocs:
        raise PlacementError(f"placement.trainer_gpus {list(trainer_gpus)} lists {len(trainer)} GPUs for "
                             f"trainer.fsdp.nprocs {nprocs} ranks: give one GPU per rank")
    if max(trainer) >= gpus.count:
        raise PlacementError(f"trainer.fsdp.nprocs {nprocs} ranks need {nprocs} GPUs, but there are {seen}")
    if layout == "colocated":
        if engine_gpus:
            raise PlacementError(f"placement.engine_gpus {list(engine_gpus)} is for layout split: colocated engines "
                                 "run on the trainer's GPUs (placement.trainer_gpus)")
        on = () if attached else tuple(trainer[k % len(trainer)] for k in range(engines))
    elif layout == "split":
        on = _split_engines(gpus, trainer, engine_gpus, engines, attached, seen)
    else:
        raise PlacementError(f"placement.layout must be colocated or split, got {layout!r}")
    per_gpu = max((on.count(i) for i in set(on)), default=0)
    if per_gpu > 1 and share is None:
        raise PlacementError(f"rollout.engines {engines} on {len(set(on))} GPU(s) puts {per_gpu} engines on one "
                             "GPU: set rollout.engine.gpu_memory_utilization to each one's share (their shares "
                             "together below 1, the trainer's part included when colocated)")
    if share is None:
        share = COLOCATED_SHARE if layout == "colocated" else SPLIT_SHARE
    if per_gpu * share > 1:
        raise PlacementError(f"{per_gpu} engines on one GPU at rollout.engine.gpu_memory_utilization {share} take "
                             f"{per_gpu * share:.0%} of it: lower the share to at most {1 / per_gpu:.2f}")
    return Placement(layout, trainer, on, tuple(gpus.ids[i] for i in on), None if attached else share)


def _split_engines(gpus: Gpus, trainer: tuple[int, ...], engine_gpus: Sequence[int], engines: int, attached: bool,
                   seen: str) -> tuple[int, ...]:
    """The GPU of each engine in layout split: `engine_gpus`, or the GPUs the trainer leaves; none attached."""
    if attached:
        if engine_gpus:
            raise PlacementError("placement.engine_gpus places engines harness starts; with rollout.engine.url the "
                                 "engines run where they were started: leave it empty")
        return ()
    on_gpus = tuple(engine_gpus) or tuple(i for i in range(gpus.count) if i not in trainer)[:engines]
    overlap = sorted(set(on_gpus) & set(trainer))
    if overlap:
        raise PlacementError(f"placement: layout split puts engines and trainer ranks on disjoint GPUs, but "
                             f"engine_gpus {list(on_gpus)} and trainer_gpus {list(trainer)} share GPU {overlap[0]}; "
                             "use layout colocated to share GPUs on purpose")
    if not on_gpus:
        raise PlacementError(f"placement: layout split needs a GPU for the engines besides the trainer's "
                             f"{len(trainer)}, but there are {seen}: lower trainer.fsdp.nprocs or use layout "
                             "colocated")
    return tuple(on_gpus[k % len(on_gpus)] for k in range(engines))


# ---------------------------------------------------------------------------------------------- the model's shape


@dataclass(frozen=True)
class Shape:
    """A decoder's shape, as its config.json gives it: what activations, adapters and the KV cache depend on."""

    name: str
    parameters: int  # all of them, embeddings included
    hidden: int  # hidden_size
    layers: int  # num_hidden_layers
    intermediate: int  # intermediate_size: the MLP's width
    kv_dim: int  # num_key_value_heads x head_dim
    vocab: int  # vocab_size

    @classmethod
    def from_config(cls, name: str, config: Mapping, parameters: int | None = None) -> Shape:
        """The shape a config.json describes (its text_config, for a multimodal model that has one). `parameters`
        None: estimated from the shape (projections, q/k/v biases where the model has them, norms, embeddings, an
        untied output layer). A ValueError names the key a decoder's config.json should have had."""
        c = config.get("text_config") or config
        for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"):
            if not isinstance(c.get(key), int):
                raise ValueError(f"{name}: its config.json has no {key}, so it is not a decoder this estimate reads")
        h, layers, i, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
        heads = c.get("num_attention_heads") or 1
        head_dim = c.get("head_dim") or h // heads
        kv = (c.get("num_key_value_heads") or heads) * head_dim
        if parameters is None:
            q = heads * head_dim
            bias = q + 2 * kv if c.get("attention_bias", c.get("model_type") == "qwen2") else 0
            per_layer = 2 * h * q + 2 * h * kv + bias + 3 * h * i + 2 * h
            tied = config.get("tie_word_embeddings", c.get("tie_word_embeddings", False))
            parameters = layers * per_layer + vocab * h * (1 if tied else 2) + h
        return cls(name, parameters, h, layers, i, kv, vocab)

    def lora_parameters(self, rank: int) -> int:
        """Adapters of `rank` on every projection: rank x (in + out) each."""
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        per_layer = (h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h)
        return rank * per_layer * self.layers

    def activation_bytes(self, tokens: int, checkpointing: bool, bytes_per_value: int = 2,
                         offload: bool = False) -> int:
        """The trainer's activations for one micro-batch of `tokens` (SDPA attention, no padding), in the compute
        dtype (`bytes_per_value` 2: bf16, trainer.fsdp.mixed_precision). Each layer keeps the inputs of its norms
        and projections, q/k/v and the MLP's four intermediate-wide tensors for the backward; with gradient
        checkpointing only each layer's input, and one layer's worth while the backward recomputes it; with
        `offload` (model.activation_offload) they wait in CPU memory and only the layer at work is on the GPU. The
        output layer comes on top for at most LOGITS_CHUNK positions: trainer/model/policy.py runs it a chunk at a time,
        checkpointed, so the float32 logits, their log-softmax and both gradients exist for one chunk only."""
        layer = 6 * self.hidden + 2 * self.kv_dim + 4 * self.intermediate
        if offload:
            kept = layer
        elif checkpointing:
            kept = self.hidden * self.layers + layer
        else:
            kept = layer * self.layers
        return tokens * kept * bytes_per_value + min(tokens, LOGITS_CHUNK) * self.vocab * 4 * 4

    def kv_bytes(self, tokens: int) -> int:
        """The engine's KV cache for `tokens` (bf16 keys and values in every layer)."""
        return tokens * 2 * self.layers * self.kv_dim * 2


def model_shape(model_dir: str | Path) -> Shape | None:
    """The shape of the model at `model_dir` (its config.json; parameters counted from its safetensors headers,
    else estimated); None when it has no config.json a decoder would have."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        return Shape.from_config(Path(model_dir).name, json.loads(path.read_text(encoding="utf-8")),
                                 count_parameters(model_dir))
    except (ValueError, AttributeError):
        return None


# ---------------------------------------------------------------------------------------------- one GPU's memory


@dataclass(frozen=True)
class TrainerMemory:
    """The trainer's estimated memory on each of its GPUs, in bytes, before activations."""

    resident: int  # kept between updates, also while the engine generates: weights and AdamW's two moments
    update: int  # added while it updates: the gradients

    @property
    def peak(self) -> int:
        return self.resident + self.update


def trainer_memory(parameters: int, bytes_per_value: int, *, world: int = 1, lora: bool = False,
                   trainable: int | None = None, reference: bool = False, critic: bool = False,
                   offload: bool = False) -> TrainerMemory:
    """The trainer's memory per GPU: `parameters` x `bytes_per_value` (the trainer's dtype: 4 for float32, 2 for
    bf16) for the weights, the same again for the gradients and twice for AdamW's moments, of what trains (all of
    it, or with `lora` the adapters' `trainable` parameters, ~0 when unknown); a frozen reference model (kl_coef >
    0) adds its weights, a critic (gae) a whole second trained model. FSDP shards all of it over `world` ranks;
    with `offload` (FSDP's CPUOffloadPolicy) it all lives in CPU memory. Activations (`Shape.activation_bytes`)
    come on top; the gathered layer being computed and CUDA's own context too: leave a margin."""
    if offload:
        return TrainerMemory(0, 0)
    trained = (trainable or 0) if lora else parameters
    weights = parameters + (trained if lora else 0) + (parameters if reference else 0)
    moments, grads = 2 * trained, trained
    if critic:
        weights, moments, grads = weights + parameters, moments + 2 * parameters, grads + parameters
    shard = bytes_per_value / world
    return TrainerMemory(int((weights + moments) * shard), int(grads * shard))


@dataclass(frozen=True)
class GpuMemory:
    """The estimated memory of the busiest GPU a trainer rank uses, in bytes, in the two phases of a step: the
    engines generate (the trainer's weights and moments wait beside them), then the trainer updates."""

    total: int  # the GPU's memory
    engines: int  # engines started on this GPU (colocated); 0 when the trainer has it alone
    share: float  # each engine's share of it (rollout.engine.gpu_memory_utilization)
    engine_awake: int  # what the engines take while they generate: their share (weights, KV cache, CUDA graphs)
    engine_asleep: int  # what they keep while the trainer updates: all of it, or with sleep mode what it leaves
    trainer: TrainerMemory
    activations: int  # one micro-batch's, during the update

    @property
    def generating(self) -> int:
        return self.engine_awake + self.trainer.resident

    @property
    def updating(self) -> int:
        return self.engine_asleep + self.trainer.peak + self.activations

    @property
    def worst(self) -> int:
        return max(self.generating, self.updating)

    @property
    def fits(self) -> bool:
        return self.worst <= self.total


def gpu_memory(memory: TrainerMemory, gpu_bytes: int, placement: Placement, *, sleep: bool,
               activations: int = 0) -> GpuMemory:
    """The trainer's GPU with the most engines beside it: colocated engines hold their share while they generate,
    and with `sleep` only ENGINE_ASLEEP of it while the trainer updates (vLLM's sleep mode moves the weights to CPU
    memory or drops them, and drops the KV cache; the CUDA context and graphs stay). A split trainer has its GPUs
    to itself."""
    share = placement.share or 0.0
    engines = max((placement.engine_gpus.count(i) for i in placement.trainer_gpus), default=0) if share else 0
    awake = int(engines * share * gpu_bytes)
    asleep = int(awake * ENGINE_ASLEEP) if sleep else awake
    return GpuMemory(gpu_bytes, engines, share, awake, asleep, memory, activations)


def memory_problem(memory: TrainerMemory, gpu_bytes: int | None, placement: Placement, *, sleep: bool,
                   activations: int = 0) -> str | None:
    """Why the plan does not fit one GPU's memory (`gpu_memory`), with the numbers, or None (also when the GPU's
    memory is unknown)."""
    if gpu_bytes is None:
        return None
    m = gpu_memory(memory, gpu_bytes, placement, sleep=sleep, activations=activations)
    if m.fits:
        return None
    total, t = _gib(m.total), m.trainer
    trainer = (f"the trainer's ~{_gib(t.peak)} GiB while it updates (weights and AdamW ~{_gib(t.resident)} GiB, "
               f"gradients ~{_gib(t.update)} GiB) + its activations ~{_gib(m.activations)} GiB")
    if not m.engines:
        return f"{trainer} = {_gib(m.updating)} GiB per GPU, over the GPU's {total} GiB"
    engines = f"{m.engines} engine(s) x {m.share} of {total} GiB = {_gib(m.engine_awake)} GiB"
    if m.updating < m.generating:
        return (f"{engines} + the trainer's weights and AdamW ~{_gib(t.resident)} GiB while the engines generate = "
                f"{_gib(m.generating)} GiB, over the GPU's {total} GiB")
    if sleep:
        engines = f"{m.engines} engine(s) asleep ~{_gib(m.engine_asleep)} GiB (of their {_gib(m.engine_awake)} GiB)"
    return f"{engines} + {trainer} = {_gib(m.updating)} GiB, over the GPU's {total} GiB"


def count_parameters(model_dir: str | Path) -> int | None:
    """The parameters in a model directory's *.safetensors files, read from their headers (no weights loaded);
    None when it has none."""
    shapes = _shapes(model_dir)
    return sum(_numel(shape) for shape in shapes.values()) if shapes else None


def lora_parameters(model_dir: str | Path, rank: int, target_modules: Sequence[str]) -> int:
    """The parameters of rank-`rank` adapters on the 2-d weights named `<...>.<target>.weight`: rank x (in + out)
    each."""
    targets = set(target_modules)
    return sum(rank * (shape[0] + shape[1]) for name, shape in _shapes(model_dir).items()
               if len(shape) == 2 and name.endswith(".weight") and name.rsplit(".", 2)[-2] in targets)


def _shapes(model_dir: str | Path) -> dict[str, list[int]]:
    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    shapes: dict[str, list[int]] = {}
    for path in files:
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header: Mapping = json.loads(f.read(size))
        shapes.update({name: entry["shape"] for name, entry in header.items() if name != "__metadata__"})
    return shapes


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _gib(n: int | float) -> str:
    return f"{n / GIB:.1f}"


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
