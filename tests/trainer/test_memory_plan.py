"""The memory plan of `harness train`: settings that cannot fit are refused at config load with the numbers, and
with rollout.engine.sleep the loop puts the engine to sleep after each step's episodes and wakes it before the
push, read from the request log of the scripted engine (a real HTTP server answering like vLLM, its sleep routes
included). The machine's GPUs are an argument of load_config (`Gpus`), so no GPU is needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.running.gpus import GIB, Gpus, count_parameters
from tests.support import ScriptedUpstream, db_rows
from trainer.config import ConfigError, load_config

TERSE_YAML = Path(__file__).resolve().parents[2] / "examples" / "train" / "terse.yaml"
ONE_GPU_80G = Gpus(("0",), 80 * GIB)


def _load(tiny_model_dir, *overrides: str, gpus: Gpus = ONE_GPU_80G):
    return load_config(TERSE_YAML, [f"model.path={tiny_model_dir}", *overrides], gpus=gpus)


def test_engine_share_and_trainer_over_the_gpu_memory_are_refused_with_the_numbers(tiny_model_dir):
    parameters = count_parameters(tiny_model_dir)
    gpu = Gpus(("0",), 24 * parameters)  # float32 AdamW: 12 bytes a parameter kept, 4 more while updating
    with pytest.raises(ConfigError) as info:
        _load(tiny_model_dir, gpus=gpu)
    message = str(info.value)
    assert message.startswith("the memory plan does not fit (layout colocated: trainer ranks on GPUs [0]; engine 0 "
                              "on GPU 0 (CUDA id 0), each engine takes 50% of its GPU;")
    assert "1 engine(s) x 0.5 of" in message and "while it updates" in message and "over the GPU's" in message
    assert "set rollout.engine.sleep" in message
    assert _load(tiny_model_dir, "rollout.engine.sleep=1", gpus=gpu).rollout.engine.sleep == 1  # freed to update
    assert _load(tiny_model_dir, "rollout.engine.gpu_memory_utilization=0.25", gpus=gpu)
    assert _load(tiny_model_dir, "model.dtype=bfloat16", gpus=gpu)
    assert _load(tiny_model_dir, "trainer.lora.rank=8", gpus=gpu)  # only the adapter trains
    # the share as an older config gives it, in vLLM's own flag, counts the same
    assert _load(tiny_model_dir, "rollout.engine.extra_args=[--gpu-memory-utilization, '0.25']", gpus=gpu)
    with pytest.raises(ConfigError, match="1 engine\\(s\\) x 0.7 of"):
        _load(tiny_model_dir, "rollout.engine.extra_args=[--gpu-memory-utilization, '0.7']", gpus=gpu)


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.engine.sleep=1", "rollout.async.max_staleness=1", "trainer.tis_cap=2"],
     "rollout.engine.sleep 1 puts the engine to sleep while a step trains, but with rollout.async.max_staleness 1 "
     "the next steps' episodes run on it meanwhile"),
    (["rollout.engine.sleep=2", "trainer.lora.rank=8"], "rollout.engine.sleep 2 drops the engine's weights, and with "
                                                        "LoRA (trainer.lora.rank 8) each push loads only the adapter"),
    (["placement.layout=split", "placement.engine_gpus=[0]"], "engine_gpus [0] and trainer_gpus [0] share GPU 0"),
    (["placement.layout=split"], "layout split needs a GPU for the engines besides the trainer's 1, but there are 1 "
                                 "GPUs visible"),
    (["rollout.engines=2"], "rollout.engines 2 on 1 GPU(s) puts 2 engines on one GPU: set "
                            "rollout.engine.gpu_memory_utilization"),
    (["rollout.engines=2", "rollout.engine.gpu_memory_utilization=0.6"], "2 engines on one GPU at "
                                                                         "rollout.engine.gpu_memory_utilization 0.6 "
                                                                         "take 120% of it"),
    (["trainer.fsdp.nprocs=2"], "trainer.fsdp.nprocs 2 ranks need 2 GPUs, but there are 1 GPUs visible"),
    (["rollout.engine.gpu_memory_utilization=1.5"], "rollout.engine.gpu_memory_utilization must be in (0, 1], got "
                                                    "1.5"),
    (["rollout.engine.sleep=3"], "rollout.engine.sleep must be one of 0, 1, 2, got 3"),
])  # fmt: skip
def test_plans_that_cannot_work_are_refused_at_load(tiny_model_dir, overrides, message):
    with pytest.raises(ConfigError) as info:
        _load(tiny_model_dir, *overrides)
    assert message in str(info.value)


def test_sleep_needs_a_gpu_for_an_engine_harness_starts_but_not_for_one_it_attaches_to(tiny_model_dir):
    with pytest.raises(ConfigError, match="rollout.engine.sleep 1 needs the engine on a CUDA GPU"):
        _load(tiny_model_dir, "rollout.engine.sleep=1", gpus=Gpus(()))
    cfg = _load(tiny_model_dir, "rollout.engine.sleep=2", "rollout.engine.url=http://127.0.0.1:1", gpus=Gpus(()))
    assert cfg.rollout.engine.sleep == 2


def test_sleep_reads_off_and_levels_from_yaml_and_overrides(tiny_model_dir, tmp_path):
    assert _load(tiny_model_dir).rollout.engine.sleep == 0
    assert _load(tiny_model_dir, "rollout.engine.sleep=off").rollout.engine.sleep == 0
    config = tmp_path / "c.yaml"
    config.write_text(TERSE_YAML.read_text().replace("    engine:\n", "    engine:\n      sleep: off\n"))
    cfg = load_config(config, [f"model.path={tiny_model_dir}", f"rollout.agent={TERSE_YAML.parents[1]}/terse_agent/"
                               "agent.py", f"data.train={TERSE_YAML.parents[1]}/terse_agent/tasks.jsonl",
                               f"task_judge.judge={TERSE_YAML.parents[1]}/terse_agent/judge.py:terse"],
                      gpus=ONE_GPU_80G)
    assert cfg.rollout.engine.sleep == 0 and type(cfg.rollout.engine.sleep) is int


# ---------------------------------------------------------------------------------------------- the loop


def test_every_step_sleeps_after_its_episodes_and_wakes_before_the_push(tiny_model_dir, tmp_path):
    """Two steps of the real loop (proxy, agents, judge, trainer, weight push) against the scripted engine with
    sleep level 2: in its request log each step's calls come first, then the sleep, then the wake, then the push
    (pause, reload, cache reset, resume), and the next step's calls only after that; nothing reached it asleep."""
    from trainer.loop import train

    up = ScriptedUpstream()
    try:
        cfg = load_config(TERSE_YAML, [f"model.path={tiny_model_dir}", f"rollout.engine.url={up.url}",
                                       f"logging.run_dir={tmp_path}", "rollout.engine.sleep=2", "trainer.total_steps=2",
                                       "rollout.batch_size=2", "rollout.num_repeat=2", "rollout.concurrency=4",
                                       "trainer.save_freq=0", "logging.curve_png=false", "logging.console=false"],
                          gpus=Gpus(()))
        metrics = train(cfg)
        log = list(up.engine.targets)
        refused = list(up.engine.refused_asleep)
    finally:
        up.close()
    assert refused == []
    events = [_event(target) for target in log]
    assert events[:2] == ["models", "call"]  # attach's probe (a one-token call); then step 1's episodes
    steps, rest = [], events[2:]
    for _ in range(2):
        calls = rest[:rest.index("sleep")]
        assert set(calls) == {"call"} and len(calls) == 2 * 2 * 2  # tasks x repeats x turns, all before the sleep
        cut = rest.index("resume") + 1
        steps.append(rest[len(calls):cut])
        rest = rest[cut:]
    push = ["pause", "reload", "reset", "resume"]
    assert steps == [["sleep", "wake", "is_sleeping", *push]] * 2 and rest == []  # the end: the trained model only
    assert [t for t in log if "sleep?" in t] == ["POST /sleep?level=2"] * 2
    assert metrics["time/sleep_s"] >= 0 and metrics["time/wake_s"] >= 0
    recorded = db_rows(tmp_path / "terse" / "harness.duckdb", "SELECT step, name FROM metrics WHERE name IN "
                       "('time/sleep_s', 'time/wake_s') ORDER BY step, name")
    assert recorded == [(1, "time/sleep_s"), (1, "time/wake_s"), (2, "time/sleep_s"), (2, "time/wake_s")]


def _event(target: str) -> str:
    """A request of the scripted engine's log as what it is in the loop."""
    names = {"/v1/chat/completions": "call", "/v1/models": "models", "POST /sleep": "sleep", "POST /wake_up": "wake",
             "GET /is_sleeping": "is_sleeping", "POST /pause": "pause", "POST /collective_rpc": "reload",
             "POST /reset_prefix_cache": "reset", "POST /resume": "resume"}
    return next(name for prefix, name in names.items() if target.startswith(prefix))
