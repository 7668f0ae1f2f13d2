"""Data-parallel training with PyTorch FSDP2 (`fully_shard`): NCCL on GPUs, gloo on CPU, the same code on both.

The trainer is written once, for N processes started by torchrun. One process is the case N = 1, not a
separate code path: `init_distributed` then makes a trivial process group of one rank (an in-memory store, no
network), so `fully_shard`, DTensor state dicts and `torch.distributed.checkpoint` behave exactly as they do
with many ranks. That is also what gives a single GPU bf16 mixed precision and CPU offload, which FSDP2 only
offers on sharded modules.

Options of `shard`, and what each one really covers:
- mixed_precision: bf16 parameters in forward/backward, gradients reduced in fp32, fp32 master weights and
  optimizer state. CUDA only; on CPU it is ignored (logged), as bf16 matmuls there are slow and lossy.
- param_offload: FSDP2's `CPUOffloadPolicy`. Sharded parameters, their gradients and hence the optimizer state
  (created next to the parameters) live in CPU memory, and `optimizer.step()` runs on the CPU. There is no
  separate optimizer-only offload: optimizer offload is this option. On a CPU-only machine it is a no-op.
- gradient_checkpointing: HF's `gradient_checkpointing_enable(use_reentrant=False)`: every decoder layer's
  activations are recomputed in backward. Non-reentrant checkpointing composes with FSDP2.

torch is imported inside the functions: `harness train` imports this module to launch itself, before anything
heavy is loaded.
"""

from __future__ import annotations

import logging
import os
import runpy
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "Dist",
    "init_distributed",
    "shutdown",
    "shard",
    "full_state_dict",
    "all_reduce_mean",
    "launch",
    "under_torchrun",
]

log = logging.getLogger(__name__)

# Set by torchrun in every worker it starts.
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Dist:
    """Where this process sits in the job."""

    rank: int  # global rank, 0..world-1
    world: int  # number of processes
    local_rank: int  # rank on this machine; picks the GPU
    device: torch.device  # cuda:<its GPU> (init_distributed's gpus[local_rank], else local_rank), cpu otherwise
    is_main: bool  # rank 0: the process that logs, writes the run directory and talks to the engine


def under_torchrun() -> bool:
    """True in a worker started by torchrun (or by `launch`): an entry point uses it not to launch again."""
    return all(key in os.environ for key in _TORCHRUN_ENV)


def init_distributed(device: str | None = None, gpus: Sequence[int] | None = None) -> Dist:
    """Join the process group that torchrun's environment describes, or make a one-rank group without it.

    `device` forces "cpu" (gloo) or "cuda"; by default a GPU is used when there is one. On GPUs, local rank r
    trains on cuda:gpus[r] (the memory plan's placement.trainer_gpus, harness/running/gpus.py), by default on
    cuda:r. Calling it again in the same process returns the group already there. Call `shutdown()` at the end.
    """
    import torch
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError(f"init_distributed(device={device!r}): torch sees no CUDA device")
    env = {key: os.environ.get(key) for key in _TORCHRUN_ENV}
    if under_torchrun():
        rank, world, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    elif any(env.values()):
        missing = [key for key, value in env.items() if value is None]
        raise RuntimeError(f"Partial torchrun environment: {missing} unset; start the job with torchrun or `launch`")
    else:
        rank, world, local_rank = 0, 1, 0
    if use_cuda and gpus and local_rank >= len(gpus):
        raise RuntimeError(f"local rank {local_rank} has no GPU in {list(gpus)}: give one GPU per rank "
                           "(placement.trainer_gpus)")
    target = torch.device("cuda", gpus[local_rank] if gpus else local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(target)
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if world == 1 and not under_torchrun():
            # A one-rank group on an in-memory store: nothing listens, nothing to clean up but the group.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            kwargs = {"device_id": target} if use_cuda else {}
            dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)
    return Dist(rank=rank, world=world, local_rank=local_rank, device=target, is_main=rank == 0)


def shutdown() -> None:
    """Leave the process group, if any: torchrun workers should not exit with one open.

    On a clean exit every rank first waits for the others: a rank that tore its group down while another was still
    working (rank 0 writing the trained model) died of SIGABRT in gloo about one run in twelve on two CPU ranks.
    While an exception is on its way out there is no wait: the other ranks may be inside a collective that will
    never complete, and torchrun stops them when this one exits.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() > 1 and sys.exc_info()[1] is None:
            dist.barrier()
        dist.destroy_process_group()


def _units(model) -> list:
    """The modules to shard, innermost first: each decoder layer, the decoder, the output layer (with tied
    embeddings, the input and output embeddings together as one unit, before the decoder).

    The decoder and the output layer are units of their own, not left to the root, because the trainer calls
    them separately (trainer/model/policy.py runs the decoder once, then the output layer on chunks of positions): a
    sharded module gathers its parameters only when its own forward runs. HF marks decoder layers as
    `_no_split_modules` (e.g. Qwen2DecoderLayer).
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    units: list = [module for module in model.modules() if type(module).__name__ in names and module is not model]
    tied = _tied_embeddings(model)
    if tied is not None:  # one unit for both: a parameter in two units would become two parameters, untied
        units.append(list(tied))
    for getter in ("get_decoder", "get_output_embeddings"):
        module = getattr(model, getter)() if hasattr(model, getter) else None
        if module is not None and module is not model and all(module is not unit for unit in units) and not (
                tied is not None and module is tied[1]):
            units.append(module)
    return units


def _tied_embeddings(model) -> tuple | None:
    """(input, output) embedding modules when they share their weight (tie_word_embeddings), else None."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    inputs, outputs = (get_in() if get_in else None), (get_out() if get_out else None)
    if inputs is None or outputs is None or inputs is outputs:
        return None
    return (inputs, outputs) if getattr(inputs, "weight", None) is getattr(outputs, "weight", False) else None


def _unit_tensors(unit) -> list:
    modules = unit if isinstance(unit, list) else [unit]
    return [t for m in modules for t in (*m.parameters(), *m.buffers())]


def shard(
    model,
    dist: Dist,
    *,
    mixed_precision: bool = False,
    param_offload: bool = False,
    gradient_checkpointing: bool = False,
):
    """Shard `model` in place and return it: each decoder layer, the decoder, the output layer, then the root if
    parameters are left there (then call the model itself, not its parts: FSDP2 wants its root run first).

    Build the optimizer after this call, from the returned model's parameters (now DTensors). The model may be
    on the CPU: FSDP2 moves each shard to `dist.device`, or leaves it on the CPU with `param_offload`.
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    on_cuda = dist.device.type == "cuda"
    if mixed_precision and not on_cuda:
        log.info("shard(mixed_precision=True) ignored on %s: bf16 mixed precision is for CUDA", dist.device)
    if param_offload and not on_cuda:
        log.info("shard(param_offload=True) is a no-op on %s: parameters are in CPU memory already", dist.device)
    if getattr(model, "config", None) is not None and hasattr(model.config, "use_cache"):
        model.config.use_cache = False  # a KV cache in training only costs memory
    if gradient_checkpointing:
        if not hasattr(model, "gradient_checkpointing_enable"):
            raise TypeError(f"gradient_checkpointing needs a transformers model, got {type(model).__name__}")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    kwargs = {
        "mesh": init_device_mesh(dist.device.type, (dist.world,)),
        "mp_policy": mp if on_cuda and mp is not None else MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy() if on_cuda and param_offload else OffloadPolicy(),
    }
    units = _units(model)
    for unit in units:
        fully_shard(unit, **kwargs)
    covered = {id(t) for unit in units for t in _unit_tensors(unit)}
    if not units or any(id(p) not in covered for p in model.parameters()):
        fully_shard(model, **kwargs)
    else:  # the root stays a plain module: bring its own buffers (if any) where fully_shard put the rest
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                if id(buffer) not in covered:
                    setattr(module, name, buffer.to(dist.device))
    return model


def full_state_dict(model, dist: Dist) -> dict[str, torch.Tensor] | None:
    """The full (unsharded) state dict in CPU memory on rank 0, None on the other ranks.

    A collective: every rank must call it. Used for the weight sync to the engine and for HF-format saves.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return state if dist.is_main else None


def all_reduce_mean(value: float, dist: Dist) -> float:
    """The mean of `value` over ranks (for metrics); every rank gets it. A collective when world > 1."""
    if dist.world == 1:
        return float(value)
    import torch
    import torch.distributed

    tensor = torch.tensor([float(value)], dtype=torch.float64, device=dist.device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor.item() / dist.world


def most_over_ranks(count: int, dist: Dist) -> int:
    """The largest `count` over ranks (e.g. forward/backward passes: FSDP's collectives pair up only if every rank
    runs as many). A collective when world > 1."""
    if dist.world == 1:
        return count
    import torch
    import torch.distributed

    most = torch.tensor([count], device=dist.device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    return int(most.item())


def metrics_over_ranks(stats: dict[str, float], weight: float, dist: Dist, summed=(), maxed=()) -> dict[str, float]:
    """Each rank's metrics of its share of a batch, combined (every rank gets them): those named in `maxed` are
    maxima and the largest wins; those in `summed` are parts of a whole (weighted sums) and add up; the others are
    this rank's means, averaged weighted by `weight` (its tokens). A collective when world > 1: every rank passes
    the same keys."""
    if dist.world == 1:
        return dict(stats)
    import torch
    import torch.distributed

    keys = sorted(k for k in stats if k not in maxed)
    parts = [stats[k] if k in summed else stats[k] * weight for k in keys]
    tensor = torch.tensor([*parts, float(weight)], dtype=torch.float64, device=dist.device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    values, total = tensor[:-1].tolist(), max(tensor[-1].item(), 1e-12)
    out = {k: v if k in summed else v / total for k, v in zip(keys, values, strict=True)}
    highest = sorted(k for k in stats if k in maxed)
    if highest:
        tensor = torch.tensor([stats[k] for k in highest], dtype=torch.float64, device=dist.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        out.update(zip(highest, tensor.tolist(), strict=True))
    return {k: out[k] for k in stats}


def launch(nprocs: int, argv: list[str]) -> int:
    """Run `argv` (as torchrun takes it: `["-m", "module", *args]` or `["script.py", *args]`) on `nprocs` ranks.

    nprocs > 1: a torchrun subprocess (`python -m torch.distributed.run --standalone --nproc-per-node N ...`)
    on this machine; returns its exit code. nprocs == 1: `argv` runs in this process (so breakpoints work), with
    `sys.argv` set as Python would set it; returns its exit code. An entry point that launches itself checks
    `under_torchrun()` first, so that its workers train instead of launching again:

        if nprocs > 1 and not under_torchrun():
            return launch(nprocs, ["-m", "harness.cli", *sys.argv[1:]])
        return train(config)  # one process, or one torchrun worker
    """
    if nprocs < 1:
        raise ValueError(f"launch(nprocs={nprocs}): need at least one process")
    if not argv:
        raise ValueError("launch(argv=[]): name a script or `-m module` to run")
    if under_torchrun():
        raise RuntimeError(f"launch({nprocs}, {argv!r}) inside a torchrun worker: check under_torchrun() first")
    if nprocs == 1:
        return _run_in_process(argv)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}", *argv]
    return subprocess.run(command, check=False).returncode


def _run_in_process(argv: list[str]) -> int:
    module = argv[1] if argv[0] == "-m" and len(argv) > 1 else None
    saved = sys.argv[:]
    sys.argv = [module or argv[0], *(argv[2:] if module else argv[1:])]
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)  # what Python itself does with `sys.exit("message")`
        return 1
    finally:
        sys.argv = saved
    return 0
