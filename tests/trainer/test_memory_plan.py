"""The memory plan of `harness train`: settings that cannot fit are refused at config load with the numbers, and
with rollout.engine.sleep the loop puts the engine to sleep after each step's episodes and wakes it before the
push, read from the request log of the scripted engine (a real HTTP server answering like vLLM, its sleep routes
included). The machine's GPUs are an argument of load_config (`Gpus`), so no GPU is needed; a model of
Qwen2.5-1.5B's shape without weights (tests/shaped_model.py) stands for the real one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.running.gpus import GIB, Gpus
from tests.shaped_model import QWEN25_1_5B, shaped_model
from tests.support import ScriptedUpstream, db_rows
from trainer.config import ConfigError, load_config, read_config
from trainer.config.memory import memory_plan

TERSE_YAML = Path(__file__).resolve().parents[2] / "examples" / "train" / "terse.yaml"
MATH_YAML = TERSE_YAML.with_name("math.yaml")
ONE_GPU_80G = Gpus(("0",), 80 * GIB)


@pytest.fixture(scope="module")
def qwen25_1_5b(tmp_path_factory, tiny_model_dir):
    """A model directory of Qwen2.5-1.5B's shape and parameter count, without weights (tests/shaped_model.py)."""
    return shaped_model(tmp_path_factory.mktemp("models") / "qwen2.5-1.5b-shaped", QWEN25_1_5B, tiny_model_dir)


def _load(tiny_model_dir, *overrides: str, gpus: Gpus = ONE_GPU_80G):
    return load_config(TERSE_YAML, [f"model.path={tiny_model_dir}", *overrides], gpus=gpus)


def test_engine_share_trainer_and_activations_over_the_gpu_memory_are_refused_with_what_would_fit(tiny_model_dir):
    found = memory_plan(read_config(TERSE_YAML, [f"model.path={tiny_model_dir}"]), ONE_GPU_80G)
    gpu = Gpus(("0",), int(1.5 * (found.trainer.peak + found.activations)))  # over beside a 0.5 share; fits asleep
    with pytest.raises(ConfigError) as info:
        _load(tiny_model_dir, gpus=gpu)
    message = str(info.value)
    assert message.startswith("the memory plan does not fit (layout colocated: trainer ranks on GPUs [0]; engine 0 "
                              "on GPU 0 (CUDA id 0), each engine takes 50% of its GPU;")
    assert "1 engine(s) x 0.5 of" in message and "while it updates" in message and "over the GPU's" in message
    assert "+ its activations ~" in message and "trainer.micro_batch_tokens 4096" in message
    fitting = re.findall(r"([\w.]+): (\S+) \((?:saves ~[\d.]+ GiB, )?then it fits", message)
    assert ("rollout.engine.sleep", "1") in fitting
    for key, value in fitting:  # each setting the refusal says makes it fit does
        assert _load(tiny_model_dir, f"{key}={value}", gpus=gpu)
    assert _load(tiny_model_dir, "rollout.engine.gpu_memory_utilization=0.25", gpus=gpu)
    # the share as an older config gives it, in vLLM's own flag, counts the same
    assert _load(tiny_model_dir, "rollout.engine.extra_args=[--gpu-memory-utilization, '0.25']", gpus=gpu)
    with pytest.raises(ConfigError, match="1 engine\\(s\\) x 0.7 of"):
        _load(tiny_model_dir, "rollout.engine.extra_args=[--gpu-memory-utilization, '0.7']", gpus=gpu)


def test_a_1_5b_model_with_8k_micro_batches_beside_half_an_80_gib_gpu_is_refused_for_its_activations(qwen25_1_5b):
    """docs/gpu.md's own numbers: the engine's 40 GiB + the float32 trainer's 23.0 GiB + 21.8 GiB of activations."""
    given = [f"model.path={qwen25_1_5b}", "trainer.micro_batch_tokens=8192"]
    with pytest.raises(ConfigError) as info:
        load_config(MATH_YAML, given, gpus=ONE_GPU_80G)
    message = str(info.value)
    assert "1.54B parameters, model.dtype auto, trainer.micro_batch_tokens 8192" in message
    assert ("1 engine(s) x 0.5 of 80.0 GiB = 40.0 GiB + the trainer's ~23.0 GiB while it updates (weights and AdamW "
            "~17.3 GiB, gradients ~5.8 GiB) + its activations ~21.8 GiB = 84.8 GiB, over the GPU's 80.0 GiB") in message
    assert "model.gradient_checkpointing: true (saves ~18.1 GiB, then it fits)" in message
    assert load_config(MATH_YAML, [*given, "rollout.engine.sleep=1"], gpus=ONE_GPU_80G)
    assert load_config(MATH_YAML, [*given, "model.gradient_checkpointing=true"], gpus=ONE_GPU_80G)
    assert load_config(MATH_YAML, [f"model.path={qwen25_1_5b}"], gpus=ONE_GPU_80G)  # math.yaml's 4096 tokens fit


@pytest.mark.parametrize(("settings", "on_already"), [
    (["rollout.engine.sleep=1", "trainer.micro_batch_tokens=65536"], ["rollout.engine.sleep"]),
    (["rollout.engine.sleep=1", "model.dtype=bfloat16", "model.gradient_checkpointing=true",
      "trainer.micro_batch_tokens=600000"], ["rollout.engine.sleep", "model.dtype", "model.gradient_checkpointing"]),
    (["trainer.lora.rank=8", "model.activation_offload=true", "trainer.fsdp.param_offload=true",
      "trainer.micro_batch_tokens=524288"], ["trainer.lora.rank", "model.activation_offload",
                                                      "trainer.fsdp.param_offload"]),
])  # fmt: skip
def test_the_refusal_advises_only_settings_not_on_yet_each_with_what_it_saves(qwen25_1_5b, settings, on_already):
    with pytest.raises(ConfigError) as info:
        load_config(MATH_YAML, [f"model.path={qwen25_1_5b}", *settings], gpus=ONE_GPU_80G)
    advice = str(info.value).split("To fit, set one or more of: ")[1].split("; ")
    assert advice and all(re.search(r"\((saves ~[\d.]+ GiB|then it fits)", item) for item in advice)
    assert not [item for item in advice if item.startswith(tuple(on_already))]


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
    from trainer.rl.loop import train

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
    # attach's probe (a one-token call), the proxy asking the engine's context as it starts; then step 1's episodes
    assert events[:3] == ["models", "call", "models"]
    steps, rest = [], events[3:]
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
