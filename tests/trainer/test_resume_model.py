"""Resume knows its model: a checkpoint records the model it trains (trainer/model/checkpoint.py
`model_fingerprint`), and `check_resume` refuses to continue it as a run of another model, naming what differs and
what to do.

Two runs that share an experiment name share runs/<experiment>/checkpoints: the tiny model first and a real one
later, or a full-weight run and a LoRA run of the same model. Each checkpoint here is written by the real `save`,
with the extra state the RL loop writes (trainer/rl/loop.py), and read back as the loop reads it before resuming.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest

from tests.trainer.test_offline import CHAT, TERSE_YAML, _cli, _refused
from trainer.config import load_config
from trainer.model.checkpoint import ResumeError, check_resume, find_resume, model_fingerprint, save, saved_state


def _config(model: Path, *overrides: str):
    """examples/train/terse.yaml on `model`, loaded as `harness train` loads it."""
    return load_config(TERSE_YAML, [f"model.path={model}", "experiment_name=math", *overrides], locate_model=True)


def _checkpoint(dist, run_dir: Path, extra_state: dict) -> Path:
    """A real checkpoint of a small sharded model, with `extra_state` as the loop saves it."""
    import torch

    from trainer.model.fsdp import shard

    model = shard(torch.nn.Linear(4, 2), dist)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    save(run_dir, 3, model, optimizer, None, extra_state, dist)
    return find_resume(run_dir, "auto")


def _rl_state(cfg) -> dict:
    return {"mode": "rl", "model": model_fingerprint(cfg), "data_pos": 12, "kl_coef": 0.0}


def _refusal(path: Path, cfg) -> str:
    with pytest.raises(ResumeError) as refused:
        check_resume(saved_state(path), path, "rl", model=model_fingerprint(cfg), experiment=cfg.experiment_name)
    return str(refused.value)


def test_a_checkpoint_continues_only_as_a_run_of_its_model(one_rank, tmp_path, tiny_model_dir):
    full = _config(tiny_model_dir)
    path = _checkpoint(one_rank, tmp_path / "runs" / "math", _rl_state(full))
    check_resume(saved_state(path), path, "rl", model=model_fingerprint(full), experiment="math")  # the same model

    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    message = _refusal(path, _config(other))
    was, now = str(tiny_model_dir.resolve()), str(other.resolve())
    assert f"model.path {was!r} in the checkpoint, {now!r} in this run" in message
    assert "--set experiment_name=math-other-model" in message and str(path.parent) in message

    message = _refusal(path, _config(tiny_model_dir, "trainer.lora.rank=8"))
    assert "(trainer.lora.rank 0 in the checkpoint, 8 in this run), so" in message
    assert "--set experiment_name=math-lora8" in message

    message = _refusal(path, _config(tiny_model_dir, "model.dtype=bfloat16"))
    assert "model.dtype 'float32' in the checkpoint, 'bfloat16' in this run" in message
    check_resume(saved_state(path), path, "rl", model=model_fingerprint(_config(tiny_model_dir, "model.dtype=float32")))


def test_a_lora_checkpoint_is_refused_by_a_run_with_other_adapters(one_rank, tmp_path, tiny_model_dir):
    lora = _config(tiny_model_dir, "trainer.lora.rank=8")
    path = _checkpoint(one_rank, tmp_path / "runs" / "math", _rl_state(lora))
    message = _refusal(path, _config(tiny_model_dir, "trainer.lora.rank=8", "trainer.lora.alpha=32"))
    assert "trainer.lora.alpha 16.0 in the checkpoint, 32.0 in this run" in message
    assert "trainer.lora.rank 8 in the checkpoint, 0 in this run" in _refusal(path, _config(tiny_model_dir))


def test_a_checkpoint_from_before_models_were_recorded_still_resumes(one_rank, tmp_path, tiny_model_dir, caplog):
    path = _checkpoint(one_rank, tmp_path / "runs" / "math", {"mode": "rl", "data_pos": 12, "kl_coef": 0.0})
    with caplog.at_level(logging.WARNING, logger="trainer.model.checkpoint"):
        check_resume(saved_state(path), path, "rl", model=model_fingerprint(_config(tiny_model_dir)))
    assert "does not record its model" in caplog.text
    assert saved_state(path) == {"mode": "rl", "data_pos": 12, "kl_coef": 0.0, "step": 3}


def test_a_hub_model_is_recorded_by_id_and_commit_wherever_the_cache_is(tmp_path, tiny_model_dir):
    """model.path of a Hub id is its snapshot in the local cache: two caches hold the same model."""
    prints = []
    for cache in ("one", "two"):
        snapshot = tmp_path / cache / "models--org--tiny" / "snapshots" / "0123abcd"
        shutil.copytree(tiny_model_dir, snapshot)
        cfg = _config(tiny_model_dir)
        prints.append(model_fingerprint(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                                           path=str(snapshot)))))
    assert prints[0] == prints[1]
    assert (prints[0]["model.path"], prints[0]["model.revision"]) == ("org/tiny", "0123abcd")


def test_harness_sft_of_another_model_under_the_same_experiment_is_refused(tmp_path, tiny_model_dir, capsys):
    """The real loop's checkpoint (harness sft, 3 steps), then the same command on a copy of the model elsewhere:
    refused before any training, with both paths and a name for a fresh experiment."""
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHAT * 4))
    first = _cli("sft", tiny_model_dir, tmp_path, f"--data={data}", "--set=offline.batch_size=4")
    assert first.returncode == 0, first.stderr[-3000:]
    another = shutil.copytree(tiny_model_dir, tmp_path / "another-model")
    refused = _refused(capsys, "sft", another, tmp_path, f"--data={data}", "--set=offline.batch_size=4")
    assert f"{str(tiny_model_dir.resolve())!r} in the checkpoint, {str(another.resolve())!r} in this run" in refused
    assert "--set experiment_name=offline-another-model" in refused
