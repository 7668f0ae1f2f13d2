"""Checkpoints that a killed run resumes from exactly, and HF-format weights for users and the engine.

A checkpoint is one directory, `<run_dir>/checkpoints/step_<k>/`:

    state/          model and optimizer, sharded (torch.distributed.checkpoint: one file per rank + .metadata)
    scheduler.pt    the LR scheduler's state_dict
    rng/rank_<r>.pt each rank's RNG states: python `random`, numpy (when installed), torch CPU, CUDA (on GPUs)
    meta.json       {"step": k, "world": N, "extra_state": {...}}, e.g. the data position; written last

It is written under `checkpoints/.tmp-step_<k>/` and renamed into place once every rank has written its part,
so a `step_<k>` directory is always complete; a kill leaves at most a `.tmp-*` directory, which resume ignores
and the next save of that step removes. `checkpoints/latest` (a text file naming the checkpoint last written) is
replaced after the rename; "auto" resumes from it.

The model and optimizer go through `torch.distributed.checkpoint` with sharded state dicts, so each rank writes
only its shards and a checkpoint can be loaded at another world size. RNG states are per rank: when the world
size changes they cannot all be restored (a warning says so), and the resumed run is no longer bitwise
identical. On several machines, `run_dir` must be on a filesystem they share.

The training loops record in extra_state what kind of run wrote a checkpoint ("mode"), over which data ("plan")
and for which model ("model": `model_fingerprint`); `check_resume` refuses to continue a checkpoint whose record
differs from the run's, before any weight is loaded (`saved_state` reads the record alone).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from trainer.config import TrainConfig
    from trainer.model.fsdp import Dist

__all__ = ["ResumeError", "check_resume", "checkpoint_model", "save", "find_resume", "load", "model_fingerprint",
           "save_hf", "saved_state"]

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"step_(\d+)")
_META = "meta.json"


# ---------------------------------------------------------------------------------------------------- save / load


def save(
    run_dir: str | Path,
    step: int,
    model,
    optimizer,
    scheduler,
    extra_state: dict[str, Any],
    dist: Dist,
    *,
    keep_last: int | None = None,
) -> Path:
    """Write `<run_dir>/checkpoints/step_<step>/` atomically and return its path. A collective: all ranks call it.

    `extra_state` is anything JSON can hold that the loop needs to continue (data position, counters); `load`
    gives it back with "step" added. `keep_last` then keeps the newest N checkpoints of this run (steps <= `step`).
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: keep at least the checkpoint just written (or None for all)")
    if "step" in extra_state:
        raise ValueError("extra_state may not use the key 'step': save records the step itself")
    meta = json.dumps({"step": step, "world": dist.world, "extra_state": extra_state}, indent=2)  # fail early
    root = Path(run_dir) / CHECKPOINTS
    final, tmp = root / f"step_{step}", root / f".tmp-step_{step}"
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving this step
        (tmp / "rng").mkdir(parents=True)
    _barrier()

    model_state, optim_state = get_state_dict(model, optimizer, options=_options(model))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp / "state")
    _write(tmp / "rng" / f"rank_{dist.rank}.pt", lambda f: torch.save(_rng_state(dist), f))
    if dist.is_main:
        if scheduler is not None:
            _write(tmp / "scheduler.pt", lambda f: torch.save(scheduler.state_dict(), f))
    _barrier()  # every rank's files are in tmp

    if dist.is_main:
        _write(tmp / _META, lambda f: f.write(meta.encode()))
        if final.exists():  # saving a step again, e.g. after resuming from an earlier one
            old = root / f".old-step_{step}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            shutil.rmtree(old)
        tmp.rename(final)
        _write(root / ".tmp-latest", lambda f: f.write(final.name.encode()))
        os.replace(root / ".tmp-latest", root / "latest")
        fsync_path(root)
        if keep_last is not None:  # older steps of this run; higher ones are another run's, left alone
            earlier = [k for k in _complete_steps(root) if k < step]
            for old_step in earlier[: max(0, len(earlier) - (keep_last - 1))]:
                shutil.rmtree(root / f"step_{old_step}")
    _barrier()
    return final


class ResumeError(ValueError):
    """A checkpoint of another kind of run, of other data or of another model; the message says what to do."""


def check_resume(state: dict[str, Any], path: str | Path, mode: str, plan: str | None = None, *,
                 model: dict[str, Any] | None = None, experiment: str | None = None) -> None:
    """Refuse to continue, as a `mode` run of `model` (`model_fingerprint`) over `plan` (a fingerprint of its data),
    a checkpoint that another kind of run (`harness train`, `--from-run`, `harness sft` share
    runs/<experiment>/checkpoints), another model or other data wrote. `state` is the checkpoint's `saved_state`;
    `experiment` (this run's experiment_name) is named in the way out. A checkpoint written before models were
    recorded is continued, with a warning."""
    found = state.get("mode", "rl")  # checkpoints from before modes were recorded are the RL loop's
    if found != mode:
        raise _refusal(path, f"a {found} run", mode)
    _check_model(state.get("model"), model, Path(path), experiment)
    if state.get("plan") != plan:  # after the model: another tokenizer makes other samples of the same data
        raise _refusal(path, "a run over other data (or offline.epochs, batch_size, seed)", mode)


def _refusal(path: str | Path, what: str, mode: str) -> ResumeError:
    return ResumeError(f"the checkpoint {str(path)!r} was written by {what}; a {mode} run cannot continue it: "
                       "start fresh with --set trainer.resume=disable, or give this run its own experiment_name")


def model_fingerprint(cfg: TrainConfig, adapters: Sequence[str] = ()) -> dict[str, Any]:
    """The model a run trains, as its checkpoints record it: model.path (a Hub id and the snapshot's commit for a
    model in the Hugging Face cache, else the absolute directory), the trainer's dtype, the LoRA settings (rank 0:
    the whole model trains), the tie of the embeddings (trainer/model/tied.py) and, with several policies, their
    adapters' names (trainer.config.checks adapters_of). JSON, keyed by the config keys."""
    from trainer.model.tied import ties_embeddings

    lora, full = cfg.trainer.lora, cfg.trainer.lora.rank == 0
    path, revision = _model_of(cfg.model.path)
    tied = ties_embeddings(cfg.model.path)
    return {
        "model.path": path,
        "model.revision": revision,
        "model.dtype": "float32" if cfg.model.dtype == "auto" else cfg.model.dtype,  # auto: float32 master weights
        "trainer.lora.rank": lora.rank,
        "trainer.lora.alpha": None if full else lora.alpha,
        "trainer.lora.target_modules": None if full else sorted(lora.target_modules),
        "tied_embeddings": tied,
        "untied_engine_view": tied and full,  # the engines serve the untied view (rollout.py engine_model_dir)
        "roles.policies": list(adapters) or None,  # an adapter each
    }


def _model_of(path: str) -> tuple[str, str | None]:
    """model.path as a checkpoint records it, and its revision: the same model wherever the Hub cache lives."""
    from harness.running.hub import hub_id_of

    if hub := hub_id_of(path):
        return hub, Path(path).name  # .../models--org--name/snapshots/<commit>
    return (str(Path(path).resolve()) if Path(path).exists() else path), None


# Settings of the model fingerprint that differ whenever those named here do: left out of the message then.
_FOLLOWS = {"trainer.lora.alpha": ("trainer.lora.rank",), "trainer.lora.target_modules": ("trainer.lora.rank",),
            "untied_engine_view": ("trainer.lora.rank", "tied_embeddings")}


def _check_model(saved: dict[str, Any] | None, this: dict[str, Any] | None, path: Path,
                 experiment: str | None) -> None:
    """Refuse a checkpoint of another model, naming each setting that differs and what to do."""
    if this is None:
        return
    if saved is None:
        log.warning("checkpoint %s does not record its model (written before checkpoints did): continuing it as a "
                    "checkpoint of %s", path, this["model.path"])
        return
    differs = [key for key in this if key in saved and saved[key] != this[key]]  # a key added later: unknown
    if not differs:
        return
    differs = [key for key in differs if not set(_FOLLOWS.get(key, ())) & set(differs)]
    experiment = experiment or path.parent.parent.name  # <run_dir>/<experiment>/checkpoints/step_<k>
    what = "; ".join(f"{key} {saved[key]!r} in the checkpoint, {this[key]!r} in this run" for key in differs)
    raise ResumeError(f"the checkpoint {str(path)!r} was written for another model ({what}), so this run cannot "
                      f"continue it: give this run its own experiment with --set experiment_name="
                      f"{_fresh_name(experiment, differs[0], this)}, or delete {str(path.parent)!r} to start "
                      f"experiment {experiment!r} afresh")


def _fresh_name(experiment: str, differs: str, this: dict[str, Any]) -> str:
    """An experiment name for this run, from the first setting that differs (math-lora8, math-Qwen2.5-1.5B)."""
    rank = this["trainer.lora.rank"]
    tags = {"model.path": Path(this["model.path"]).name, "model.revision": (this["model.revision"] or "local")[:8],
            "model.dtype": this["model.dtype"], "trainer.lora.rank": f"lora{rank}" if rank else "full"}
    return f"{experiment}-{tags.get(differs, 'new')}"


def find_resume(run_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint to resume from: `resume` is "auto", "disable" or a checkpoint directory.

    "auto": the checkpoint `<run_dir>/checkpoints/latest` names, or without a usable one the newest complete
    `step_<k>`; None when there is none. "disable": None. A path: that checkpoint, which must be complete.
    `latest` comes first because a run restarted with "disable" saves low steps next to an older run's higher ones.
    """
    if resume == "disable":
        return None
    if resume == "auto":
        root = Path(run_dir) / CHECKPOINTS
        pointer = root / "latest"
        if pointer.is_file():
            named = root / pointer.read_text().strip()
            if _STEP_DIR.fullmatch(named.name) and (named / _META).is_file():
                return named
            log.warning("%s names %r, not a complete checkpoint: taking the newest one", pointer, named.name)
        steps = _complete_steps(root) if root.is_dir() else []
        return root / f"step_{steps[-1]}" if steps else None
    path = Path(resume)
    if not path.exists():
        raise FileNotFoundError(f"resume: no checkpoint at {str(path)!r} (resume is 'auto', 'disable' or a path)")
    if not (path / _META).is_file():
        raise FileNotFoundError(
            f"resume: {str(path)!r} is not a complete checkpoint (no {_META}); expected a "
            f"directory like {Path(run_dir) / CHECKPOINTS / 'step_10'}"
        )
    return path


def load(path: str | Path, model, optimizer, scheduler, dist: Dist) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and this rank's RNG states from `path`; return the extra_state.

    The returned dict is the `extra_state` given to `save`, with "step" added. A collective: all ranks call it,
    after `shard` and after building the optimizer and scheduler.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    meta = _meta(path, "load")
    options = _options(model)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path / "state")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    if scheduler is not None:
        if not (path / "scheduler.pt").is_file():
            raise FileNotFoundError(f"load: {str(path)!r} was saved without a scheduler; pass scheduler=None")
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))

    rng_path = path / "rng" / f"rank_{dist.rank}.pt"
    if meta["world"] != dist.world or not rng_path.is_file():
        log.warning(
            "checkpoint %s was written by %d ranks, this job has %d: RNG states not restored",
            path,
            meta["world"],
            dist.world,
        )
    else:
        _set_rng_state(torch.load(rng_path, weights_only=True), dist)
    return {**meta["extra_state"], "step": meta["step"]}


def saved_state(path: str | Path) -> dict[str, Any]:
    """What `load` returns of the checkpoint at `path` (its extra_state, with "step"), read without loading any
    weight: what `check_resume` looks at before the model is built."""
    meta = _meta(Path(path), "resume")
    return {**meta["extra_state"], "step": meta["step"]}


def _meta(path: Path, verb: str) -> dict[str, Any]:
    if not (path / _META).is_file():
        raise FileNotFoundError(f"{verb}: {str(path)!r} is not a complete checkpoint (no {_META})")
    return json.loads((path / _META).read_text())


def _options(model):
    """A checkpoint holds what trains: with frozen parameters (LoRA's base weights, which come from model.path
    again on resume) only the trainable ones are written and read."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


# ---------------------------------------------------------------------------------------------------- HF format


def checkpoint_model(path: str | Path, base: str | Path, out: str | Path) -> Path:
    """A full-weight checkpoint (`<run>/checkpoints/step_<k>`) as a plain model directory `out` that transformers
    and vLLM load: its model weights in the base's dtype, with the base's config, tokenizer and template (tied
    embeddings tied as the base has them). One process, no process group; the optimizer state is not read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from trainer.model.policy import load_policy

    path = Path(path)
    if not (path / _META).is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a complete checkpoint (no {_META}): give one of "
                                "<run>/checkpoints/step_<k>")
    model = load_policy(base)
    state = {"model": get_model_state_dict(model)}
    try:
        dcp.load(state, checkpoint_id=path / "state")
    except Exception as exc:  # another model's checkpoint: missing or mismatched tensors
        raise ValueError(f"checkpoint {str(path)!r} does not hold the weights of {str(base)!r} ({type(exc).__name__}: "
                         f"{str(exc)[:300]}); give the run's model.path as the base (a LoRA checkpoint holds only "
                         "the adapter: use <run>/adapters/v... with harness export --merge)") from None
    model.load_state_dict(state["model"])
    return save_hf(model.state_dict(), base, out)


def save_hf(
    model_state_dict: dict[str, torch.Tensor],
    config_dir: str | Path,
    out_dir: str | Path,
    *,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write a HF model directory: safetensors weights plus every config and tokenizer file of `config_dir`.

    `model_state_dict` is a full state dict (`fsdp.full_state_dict` on rank 0). When `config_dir`'s config ties
    the output layer to the embeddings, the output layer is left out, as the model ships (trainer/model/tied.py
    `as_shipped`). Weights over `max_shard_bytes` are split into `model-0000i-of-0000n.safetensors` with an index,
    as transformers and vLLM expect (trainer/model/files.py `write_weights`). The directory is built next to
    `out_dir` and renamed into place: a reader sees the old files or the new ones.
    """
    from trainer.model.files import copy_model_files, write_weights
    from trainer.model.tied import as_shipped

    config_dir, out = Path(config_dir), Path(out_dir)
    if not (config_dir / "config.json").is_file():
        raise FileNotFoundError(f"save_hf: {str(config_dir)!r} has no config.json to copy")
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    copy_model_files(config_dir, tmp)
    write_weights(tmp, as_shipped(dict(model_state_dict), config_dir), max_shard_bytes=max_shard_bytes)

    if out.exists():
        old = out.with_name(f".old-{out.name}")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)
    return out


# ---------------------------------------------------------------------------------------------------- helpers


def _complete_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under `root`, oldest first (temp and foreign directories ignored)."""
    steps = []
    for item in root.iterdir():
        match = _STEP_DIR.fullmatch(item.name)
        if match and (item / _META).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def _rng_state(dist: Dist) -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)
    if dist.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(dist.device)
    return state


def _set_rng_state(state: dict[str, Any], dist: Dist) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    np = _numpy()
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if dist.device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], dist.device)


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _write(path: Path, write) -> None:
    """Write a file and flush it to disk: the rename that publishes a checkpoint must not outrun its bytes."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (after a rename into it) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
