"""Checkpoints: a run killed after step k's checkpoint resumes at step k+1 with the loss it would have had.

The kill test drives a real training loop in a subprocess (the tiny model, AdamW with a warmup schedule, dropout
and random token masks so that every RNG state matters, data read in order from a fixed pool) and stops it with
SIGKILL once it reports that step k's checkpoint is written. It runs on 1 process and on 2 FSDP processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import long_run
from trainer.model.checkpoint import find_resume, load, save, save_hf

ROOT = Path(__file__).resolve().parents[2]
STEPS, KILL_AFTER = 4, 2

LOOP = textwrap.dedent(
    """
    import argparse, json, os, random, sys, time

    import torch
    from transformers import AutoModelForCausalLM

    from trainer.model.checkpoint import find_resume, load, save
    from trainer.model.fsdp import all_reduce_mean, init_distributed, shard, shutdown

    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--resume", default="auto")
    parser.add_argument("--pause-after", type=int, default=None)
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters over the frozen base")
    args = parser.parse_args()

    def emit(event):  # one write per line: the ranks share stdout, and print() may split a line in two writes
        sys.stdout.write(json.dumps(event) + "\\n")
        sys.stdout.flush()

    dist = init_distributed(device="cpu")
    random.seed(100 + dist.rank)
    torch.manual_seed(200 + dist.rank)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attention_dropout=0.2)
    if args.lora:
        from trainer.model.lora import LoraSpec, with_adapter

        model = with_adapter(model, LoraSpec(rank=4, dropout=0.1))
    model = shard(model, dist)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    POOL = torch.randint(0, 2000, (16, 20), generator=torch.Generator().manual_seed(0))
    ROWS = 2  # per rank and step

    step, position = 0, 0
    path = find_resume(args.run_dir, args.resume)
    if path is not None:
        state = load(path, model, optimizer, scheduler, dist)
        step, position = state["step"], state["data_position"]
    if dist.is_main:
        emit({"event": "start", "step": step, "data_position": position})
    while step < args.steps:
        step += 1
        first = position + dist.rank * ROWS
        ids = POOL[[(first + i) % len(POOL) for i in range(ROWS)]]
        position += ROWS * dist.world
        start = random.randrange(4)  # python RNG: a random crop
        ids = ids[:, start : start + 16]
        mask = (torch.rand(ids.shape[0], ids.shape[1] - 1) < 0.8).float()  # torch RNG (and dropout)
        logits = model(input_ids=ids).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        loss = all_reduce_mean(loss.item(), dist)
        save(args.run_dir, step, model, optimizer, scheduler, {"data_position": position}, dist)
        if dist.is_main:
            emit({"event": "step", "step": step, "loss": loss, "data_position": position})
        if step == args.pause_after:  # wait to be killed, right after this step's checkpoint
            emit({"event": "checkpointed", "step": step, "pid": os.getpid()})
            time.sleep(300)
    shutdown()
    """
)


def _command(script: Path, world: int, *args: str) -> list[str]:
    if world == 1:
        return [sys.executable, str(script), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(script),
            *args]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith('{"event"')]


def _start(script: Path, world: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen(_command(script, world, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env())  # fmt: skip


def _finish(proc: subprocess.Popen) -> list[dict]:
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr[-3000:]
    return _events(stdout)


def _run_until_killed(script: Path, world: int, log: Path, *args: str) -> list[dict]:
    """Run until every rank reports step KILL_AFTER's checkpoint, then SIGKILL the training processes."""
    with open(log, "w") as stderr:
        proc = subprocess.Popen(_command(script, world, *args), stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env=_env())  # fmt: skip
    events, pids = [], []
    try:
        for line in proc.stdout:
            if line.startswith('{"event"'):
                events.append(json.loads(line))
                if events[-1]["event"] == "checkpointed":
                    pids.append(events[-1]["pid"])
            if len(pids) == world:
                break
        assert len(pids) == world, f"no checkpoint at step {KILL_AFTER}: {events}\n{log.read_text()[-3000:]}"
        for pid in pids:  # the training processes themselves (under torchrun, its workers)
            os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=60) != 0  # torchrun sees its workers die and fails
    finally:
        if proc.poll() is None:
            proc.terminate()  # torchrun passes it on to its workers
            proc.wait(timeout=60)
    return events


def _losses(events: list[dict]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


# CI runs two ranks with LoRA (the adapters' own state); full weights resume on one rank in the engine tier
# (test_train_engine.py, a SIGKILLed `harness train`); make test-long runs all three here.
@pytest.mark.parametrize("world, lora", [pytest.param(1, False, marks=long_run), pytest.param(2, False, marks=long_run),
                                         (2, True)])
def test_killed_run_resumes_with_the_loss_of_an_uninterrupted_run(world, lora, tmp_path, tiny_model_dir):
    """With LoRA the checkpoint holds the adapters and their optimizer state only (frozen weights come from the
    model directory again), and the resumed run is still exactly the uninterrupted one."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    run = tmp_path / "run"
    common = [str(tiny_model_dir), str(run), f"--steps={STEPS}", *(["--lora"] if lora else [])]
    # The uninterrupted run, in a run directory of its own, alongside the others (their startup dominates).
    uninterrupted = _start(script, world, str(tiny_model_dir), str(tmp_path / "reference"), f"--steps={STEPS}",
                           *(["--lora"] if lora else []))

    killed = _run_until_killed(script, world, tmp_path / "killed.log", *common, f"--pause-after={KILL_AFTER}")
    assert sorted(_losses(killed)) == list(range(1, KILL_AFTER + 1))
    # As if the next save had been killed halfway: a temp directory with some of the files.
    shutil.copytree(run / "checkpoints" / f"step_{KILL_AFTER}", run / "checkpoints" / f".tmp-step_{KILL_AFTER + 1}")
    (run / "checkpoints" / f".tmp-step_{KILL_AFTER + 1}" / "meta.json").unlink()

    resuming = _start(script, world, *common, "--resume=auto")
    reference = _losses(_finish(uninterrupted))
    # "disable" in a run directory full of checkpoints starts again from step 0.
    restarted = _finish(_start(script, world, str(tiny_model_dir), str(tmp_path / "reference"), "--steps=1",
                               "--resume=disable", *(["--lora"] if lora else [])))  # fmt: skip
    resumed = _finish(resuming)
    start = [e for e in resumed if e["event"] == "start"][0]
    assert (start["step"], start["data_position"]) == (KILL_AFTER, KILL_AFTER * 2 * world)
    assert sorted(_losses(resumed)) == list(range(KILL_AFTER + 1, STEPS + 1))
    positions = [e["data_position"] for e in resumed if e["event"] == "step"]
    assert positions == [step * 2 * world for step in range(KILL_AFTER + 1, STEPS + 1)]

    assert [e["step"] for e in restarted if e["event"] == "start"] == [0]
    assert _losses(restarted) == {1: reference[1]}
    assert find_resume(tmp_path / "reference", "auto") == tmp_path / "reference" / "checkpoints" / "step_1"
    assert sorted(reference) == list(range(1, STEPS + 1))
    # Exactly equal (CPU, same process layout): weights, optimizer, schedule, data position and RNG all restored.
    assert _losses(killed) == {k: reference[k] for k in range(1, KILL_AFTER + 1)}
    assert _losses(resumed) == {k: reference[k] for k in range(KILL_AFTER + 1, STEPS + 1)}
    assert len(set(reference.values())) == STEPS  # the losses do move: the comparison means something
    assert (run / "checkpoints" / "latest").read_text() == f"step_{STEPS}"
    assert not (run / "checkpoints" / f".tmp-step_{KILL_AFTER + 1}").exists()  # the next save cleared it
    if lora:  # the frozen base is not in the checkpoint: it is a fraction of the model's size
        saved = sum(f.stat().st_size for f in (run / "checkpoints" / f"step_{STEPS}").rglob("*") if f.is_file())
        model = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
        assert saved < model / 2, (saved, model)


# ---------------------------------------------------------------------------------------------------- in process


def _tiny_trainer(dist):
    import torch

    from trainer.model.fsdp import shard

    torch.manual_seed(0)
    model = shard(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)), dist)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=5)
    return model, optimizer, scheduler


def _train_step(model, optimizer, scheduler) -> float:
    import random

    import torch

    x = torch.randn(16, 4) * random.random()
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return loss.item()


def test_save_load_round_trip_in_one_process(one_rank, tmp_path):
    model, optimizer, scheduler = _tiny_trainer(one_rank)
    for step in (1, 2):
        _train_step(model, optimizer, scheduler)
        path = save(tmp_path, step, model, optimizer, scheduler, {"data_position": 10 * step}, one_rank)
    assert path == tmp_path / "checkpoints" / "step_2"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_2"
    assert {p.name for p in path.iterdir()} == {"state", "scheduler.pt", "rng", "meta.json"}
    expected = [_train_step(model, optimizer, scheduler) for _ in range(2)]

    model, optimizer, scheduler = _tiny_trainer(one_rank)
    _train_step(model, optimizer, scheduler)  # move weights, optimizer, schedule and RNG away from the checkpoint
    state = load(find_resume(tmp_path, "auto"), model, optimizer, scheduler, one_rank)
    assert state == {"data_position": 20, "step": 2}
    assert [_train_step(model, optimizer, scheduler) for _ in range(2)] == expected


def test_keep_last_deletes_older_checkpoints(one_rank, tmp_path):
    model, optimizer, scheduler = _tiny_trainer(one_rank)
    for step in range(1, 5):
        save(tmp_path, step, model, optimizer, scheduler, {}, one_rank, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_3", "step_4"]
    save(tmp_path, 1, model, optimizer, scheduler, {}, one_rank, keep_last=1)  # restarted: 3 and 4 are not its own
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_1", "step_3", "step_4"]
    assert find_resume(tmp_path, "auto") == tmp_path / "checkpoints" / "step_1"
    with pytest.raises(ValueError, match="keep_last=0"):
        save(tmp_path, 5, model, optimizer, scheduler, {}, one_rank, keep_last=0)
    with pytest.raises(ValueError, match="'step'"):
        save(tmp_path, 5, model, optimizer, scheduler, {"step": 5}, one_rank)


def test_saving_a_step_again_replaces_it(one_rank, tmp_path):
    model, optimizer, scheduler = _tiny_trainer(one_rank)
    save(tmp_path, 1, model, optimizer, scheduler, {"run": "first"}, one_rank)
    path = save(tmp_path, 1, model, optimizer, scheduler, {"run": "second"}, one_rank)
    assert json.loads((path / "meta.json").read_text())["extra_state"] == {"run": "second"}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_1"]


def _fake_checkpoint(path: Path, complete: bool = True) -> Path:
    path.mkdir(parents=True)
    if complete:
        (path / "meta.json").write_text('{"step": 0, "world": 1, "extra_state": {}}')
    return path


def test_auto_resume_follows_latest_else_the_newest_complete_checkpoint(tmp_path):
    assert find_resume(tmp_path, "auto") is None  # no checkpoints directory yet
    root = tmp_path / "checkpoints"
    _fake_checkpoint(root / "step_2")
    _fake_checkpoint(root / "step_10")
    _fake_checkpoint(root / ".tmp-step_11", complete=False)  # killed while saving
    _fake_checkpoint(root / ".tmp-step_12")  # killed after meta.json, before the rename
    _fake_checkpoint(root / "step_13", complete=False)  # not written by save (copied by hand, half)
    _fake_checkpoint(root / "step_14_backup")
    assert find_resume(tmp_path, "auto") == root / "step_10"  # no `latest` (killed between rename and pointer)
    (root / "latest").write_text("step_2")  # a run restarted with "disable" saved step 2 after an older step 10
    assert find_resume(tmp_path, "auto") == root / "step_2"
    (root / "latest").write_text("step_13")  # names an incomplete one: fall back
    assert find_resume(tmp_path, "auto") == root / "step_10"


def test_disable_never_resumes(tmp_path):
    _fake_checkpoint(tmp_path / "checkpoints" / "step_3")
    assert find_resume(tmp_path, "disable") is None


def test_explicit_resume_path_must_be_a_complete_checkpoint(tmp_path):
    done = _fake_checkpoint(tmp_path / "elsewhere" / "step_7")
    assert find_resume(tmp_path, str(done)) == done
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*step_8.*'auto', 'disable' or a path"):
        find_resume(tmp_path, str(tmp_path / "elsewhere" / "step_8"))
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        find_resume(tmp_path, str(_fake_checkpoint(tmp_path / "half", complete=False)))
    with pytest.raises(FileNotFoundError, match="'atuo'"):  # a misspelt mode reads as a missing path
        find_resume(tmp_path, "atuo")


# ---------------------------------------------------------------------------------------------------- HF format


@pytest.mark.parametrize("max_shard_bytes", [5 * 2**30, 600_000])
def test_save_hf_round_trips_through_transformers(tiny_model_dir, tmp_path, max_shard_bytes):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    state = {k: v + 1.0 for k, v in model.state_dict().items()}  # new weights, as after training
    out = tmp_path / "hf"
    (out / "stale").parent.mkdir()
    (out / "stale").write_text("from an older save")
    assert save_hf(state, tiny_model_dir, out, max_shard_bytes=max_shard_bytes) == out
    assert not (out / "stale").exists()
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert (len(shards) > 1) == (max_shard_bytes < 2**20)
    assert (out / "model.safetensors.index.json").exists() == (len(shards) > 1)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert all(torch.equal(reloaded[k], state[k]) for k in state)
    assert AutoTokenizer.from_pretrained(out).encode("hello world") == AutoTokenizer.from_pretrained(
        tiny_model_dir
    ).encode("hello world")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp directories left


def test_save_hf_copies_tied_weights(tmp_path, tiny_model_dir):
    import torch
    from safetensors.torch import load_file

    shared = torch.ones(3, 2)
    save_hf({"a.weight": shared, "b.weight": shared}, tiny_model_dir, tmp_path / "hf")
    loaded = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(loaded["a.weight"], shared) and torch.equal(loaded["b.weight"], shared)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        save_hf({"a": shared}, tmp_path, tmp_path / "other")


def test_a_checkpoint_becomes_a_plain_model_directory_tied_as_its_base(one_rank, tmp_path, tied_model):
    """`harness export --checkpoint`: a training checkpoint of a tied model (sharded as the trainer shards it) as a
    model directory transformers loads tied, with the trained weights; a wrong base or a non-checkpoint is named."""
    import subprocess
    import sys

    import torch
    import yaml
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trainer.model.fsdp import full_state_dict, shard
    from trainer.model.policy import load_policy

    model = shard(load_policy(tied_model), one_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor([[1, 2, 3, 4, 5]])).logits.square().mean().backward()
    optimizer.step()
    trained = full_state_dict(model, one_rank)
    run = tmp_path / "run"
    path = save(run, 1, model, optimizer, None, {}, one_rank)
    (run / "config.resolved.yaml").write_text(yaml.safe_dump({"harness": {"model": {"path": str(tied_model)}}}))
    harness = [sys.executable, "-m", "harness.cli", "export", "--checkpoint"]
    done = subprocess.run([*harness, str(path), "--out", str(tmp_path / "model")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    assert out.config.tie_word_embeddings and out.lm_head.weight.data_ptr() == out.model.embed_tokens.weight.data_ptr()
    written, shipped = (load_file(d / "model.safetensors") for d in (tmp_path / "model", tied_model))
    assert written.keys() == shipped.keys() and "lm_head.weight" not in written  # as shipped: no output layer
    assert all(torch.equal(out.state_dict()[k], v) for k, v in trained.items())
    assert not torch.equal(trained["model.embed_tokens.weight"],
                           load_policy(tied_model).state_dict()["model.embed_tokens.weight"])  # it did train
    bad = subprocess.run([*harness, str(tmp_path), "--out", str(tmp_path / "x"), "--model", str(tied_model)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "is not a complete checkpoint" in bad.stderr and not (tmp_path / "x").exists()


def test_a_tied_model_resumes_with_its_embeddings_one_parameter_holding_the_saved_weights(one_rank, tmp_path,
                                                                                          tied_model):
    """Resume loads the checkpoint's embeddings into the one tied parameter (not into two, or into one of the two),
    and the resumed model then trains exactly as the model that wrote the checkpoint goes on training."""
    import torch

    from trainer.model.fsdp import full_state_dict, shard
    from trainer.model.policy import load_policy

    def trainer():
        model = shard(load_policy(tied_model), one_rank)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, optimizer) -> None:
        model(input_ids=torch.tensor([[1, 2, 3, 4, 5]])).logits.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    model, optimizer = trainer()
    step(model, optimizer)
    saved = full_state_dict(model, one_rank)
    path = save(tmp_path, 1, model, optimizer, None, {}, one_rank)
    resumed, resumed_optimizer = trainer()
    load(path, resumed, resumed_optimizer, None, one_rank)
    assert resumed.lm_head.weight is resumed.model.embed_tokens.weight
    state = full_state_dict(resumed, one_rank)
    assert torch.equal(state["model.embed_tokens.weight"], saved["model.embed_tokens.weight"])
    assert torch.equal(state["lm_head.weight"], saved["model.embed_tokens.weight"])
    assert not torch.equal(saved["model.embed_tokens.weight"],
                           load_policy(tied_model).state_dict()["model.embed_tokens.weight"])  # it did train
    step(model, optimizer)
    step(resumed, resumed_optimizer)  # the optimizer state of the tied weight came back with it
    assert resumed.lm_head.weight is resumed.model.embed_tokens.weight
    after, resumed_after = full_state_dict(model, one_rank), full_state_dict(resumed, one_rank)
    assert all(torch.equal(resumed_after[k], v) for k, v in after.items())
