"""The memory plan on paper: which GPUs engines and trainer ranks get on machines of 1, 2, 4 and 8 GPUs (with and
without CUDA_VISIBLE_DEVICES), the trainer's memory estimate and one GPU's in both phases of a step, the model's
shape and activations read from config.json, `python -m harness.running.gpu_sizing`, the engine's command line on a
GPU machine, and vLLM's sleep routes against the scripted engine. No GPU needed: the machine is an argument
(`Gpus`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.running.gpu_sizing import QWEN25, main, sizing_table
from harness.running.gpus import (
    ENGINE_ASLEEP,
    GIB,
    LOGITS_CHUNK,
    Gpus,
    PlacementError,
    Shape,
    count_parameters,
    gpu_memory,
    lora_parameters,
    memory_problem,
    model_shape,
    plan,
    trainer_memory,
    visible_gpus,
)
from harness.running.vllm_server import EngineError, engine_command, is_sleeping, sleep, wake_up
from proxy.scripted_engine import Script
from tests.shaped_model import QWEN25_1_5B
from tests.support import ScriptedUpstream

H100 = 80 * 1024  # MiB, as nvidia-smi reports memory.total
LLAMA32_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
              "tie_word_embeddings": True}  # meta-llama/Llama-3.2-1B's config.json, the keys of the shape


def machine(n: int, cuda_visible_devices: str | None = None) -> Gpus:
    return visible_gpus(cuda_visible_devices, [H100] * n)


# ---------------------------------------------------------------------------------------------- what is visible


def test_the_visible_gpus_come_from_cuda_visible_devices_when_it_is_set():
    assert machine(8).ids == tuple("01234567") and machine(8).memory_bytes == 80 * GIB
    assert machine(8, "4,5").ids == ("4", "5") and machine(8, "4,5").from_env
    assert machine(8, "GPU-1a2b,GPU-3c4d").count == 2  # UUIDs are passed through as they are
    assert machine(8, "").count == 0 and machine(8, "-1").count == 0  # CUDA's "none"
    assert machine(8, "2,-1,3").ids == ("2",)  # CUDA stops at the first invalid entry
    assert machine(2, "0,1,2,3").count == 2  # never more than there are
    assert machine(0, "0,1").count == 0 and machine(0).memory_bytes is None  # no nvidia-smi: no GPU


# ---------------------------------------------------------------------------------------------- placement


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_colocated_engines_share_the_trainer_gpus_and_never_land_elsewhere(n):
    p = plan(machine(n), layout="colocated", engines=n, nprocs=n, share=0.4 if n == 1 else None)
    assert p.trainer_gpus == tuple(range(n)) and p.engine_gpus == tuple(range(n))
    assert p.engine_ids == tuple(str(i) for i in range(n)) and p.share == (0.4 if n == 1 else 0.5)
    one = plan(machine(n), layout="colocated", engines=1, nprocs=n)
    assert one.engine_gpus == (0,) and one.share == 0.5  # the default leaves half of GPU 0 to rank 0


@pytest.mark.parametrize("n", [2, 4, 8])
def test_split_puts_engines_on_the_gpus_the_trainer_leaves(n):
    half = n // 2
    p = plan(machine(n), layout="split", engines=half, nprocs=half)
    assert p.trainer_gpus == tuple(range(half)) and p.engine_gpus == tuple(range(half, n))
    assert not set(p.trainer_gpus) & set(p.engine_gpus) and p.share == 0.9
    chosen = plan(machine(n), layout="split", engines=1, nprocs=n - 1, trainer_gpus=list(range(1, n)),
                  engine_gpus=[0])
    assert chosen.engine_gpus == (0,) and chosen.trainer_gpus == tuple(range(1, n))


def test_split_on_one_gpu_is_refused_with_the_count():
    with pytest.raises(PlacementError, match=r"needs a GPU for the engines besides the trainer's 1, but there are "
                                             r"1 GPUs visible"):
        plan(machine(1), layout="split", engines=1, nprocs=1)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_cuda_visible_devices_maps_config_indices_to_its_entries(n):
    visible = ",".join(str(8 + 2 * i) for i in range(n))  # e.g. 8,10,12: what the user left visible
    gpus = visible_gpus(visible, [H100] * 16)
    colocated = plan(gpus, layout="colocated", engines=1, nprocs=n)
    assert colocated.engine_ids == ("8",) and colocated.trainer_gpus == tuple(range(n))  # cuda:i is the i-th
    if n > 1:
        split = plan(gpus, layout="split", engines=1, nprocs=n - 1)
        assert split.engine_gpus == (n - 1,) and split.engine_ids == (str(8 + 2 * (n - 1)),)
    with pytest.raises(PlacementError, match=rf"names GPU {n}, but there are {n} GPUs visible "
                                             rf"\(CUDA_VISIBLE_DEVICES={visible}: indices 0..{n - 1}"):
        plan(gpus, layout="colocated", engines=1, nprocs=1, trainer_gpus=[n])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"layout": "split", "engines": 1, "nprocs": 2, "engine_gpus": [1]},
     "engine_gpus [1] and trainer_gpus [0, 1] share GPU 1; use layout colocated"),
    ({"layout": "colocated", "engines": 1, "nprocs": 1, "engine_gpus": [2]}, "placement.engine_gpus [2] is for "
                                                                             "layout split"),
    ({"layout": "colocated", "engines": 1, "nprocs": 2, "trainer_gpus": [1]}, "lists 1 GPUs for "
                                                                              "trainer.fsdp.nprocs 2 ranks"),
    ({"layout": "colocated", "engines": 1, "nprocs": 8}, "trainer.fsdp.nprocs 8 ranks need 8 GPUs, but there are 4"),
    ({"layout": "colocated", "engines": 3, "nprocs": 2}, "rollout.engines 3 on 2 GPU(s) puts 2 engines on one GPU: "
                                                         "set rollout.engine.gpu_memory_utilization"),
    ({"layout": "split", "engines": 4, "nprocs": 2, "share": 0.6}, "2 engines on one GPU at rollout.engine."
                                                                   "gpu_memory_utilization 0.6 take 120% of it"),
    ({"layout": "split", "engines": 1, "nprocs": 1, "trainer_gpus": [0], "engine_gpus": [1, 1]}, "names a GPU twice"),
])  # fmt: skip
def test_gpu_lists_that_cannot_work_are_refused_with_the_numbers(kwargs, message):
    with pytest.raises(PlacementError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        plan(machine(4), **kwargs)


def test_more_engines_than_gpus_run_with_a_share_and_no_gpu_means_no_plan():
    p = plan(machine(2), layout="colocated", engines=4, nprocs=2, share=0.2)
    assert p.engine_gpus == (0, 1, 0, 1) and p.share == 0.2
    assert plan(machine(0), layout="colocated", engines=2, nprocs=1) is None
    with pytest.raises(PlacementError, match="this machine has none visible"):
        plan(machine(0), layout="split", engines=1, nprocs=1, trainer_gpus=[0])
    attached = plan(machine(2), layout="colocated", engines=1, nprocs=2, attached=True)
    assert attached.engine_gpus == () and attached.share is None and "attached" in attached.describe()


# ---------------------------------------------------------------------------------------------- memory


def test_the_trainer_estimate_counts_weights_gradients_and_adam_by_dtype():
    billion = 10**9
    full = trainer_memory(4 * billion, 4)  # a 4B model in float32: 16 GB each of weights and grads, 32 of Adam
    assert (full.resident, full.update, full.peak) == (48 * billion, 16 * billion, 64 * billion)
    assert trainer_memory(4 * billion, 2, world=4).peak == 8 * billion  # bf16, sharded over 4 ranks
    lora = trainer_memory(4 * billion, 4, lora=True, trainable=10**7)
    assert lora.resident == 4 * (4 * billion + 3 * 10**7) and lora.update == 4 * 10**7
    assert trainer_memory(billion, 4, reference=True).resident == 16 * billion  # + the frozen reference
    assert trainer_memory(billion, 4, critic=True).peak == 32 * billion  # a second trained model
    assert trainer_memory(4 * billion, 4, offload=True).peak == 0


def test_one_gpu_must_hold_the_engine_share_the_trainer_and_its_activations_and_sleep_frees_most_of_the_share():
    gpu = 80 * GIB
    colocated = plan(machine(1), layout="colocated", engines=1, nprocs=1)
    fits = trainer_memory(1_500_000_000, 4)  # 1.5B float32: ~22 GiB
    assert memory_problem(fits, gpu, colocated, sleep=False) is None
    assert memory_problem(fits, gpu, colocated, sleep=False, activations=20 * GIB) is not None  # activations count
    big = trainer_memory(4 * 10**9, 4)  # 4B float32: ~60 GiB
    problem = memory_problem(big, gpu, colocated, sleep=False, activations=2 * GIB)
    assert problem == ("1 engine(s) x 0.5 of 80.0 GiB = 40.0 GiB + the trainer's ~59.6 GiB while it updates "
                       "(weights and AdamW ~44.7 GiB, gradients ~14.9 GiB) + its activations ~2.0 GiB = 101.6 GiB, "
                       "over the GPU's 80.0 GiB")
    tight = trainer_memory(3 * 10**9, 4)  # ~44.7 GiB: fits only while the engine sleeps
    assert memory_problem(tight, gpu, colocated, sleep=False) is not None
    assert memory_problem(tight, gpu, colocated, sleep=True) is None
    asleep = gpu_memory(tight, gpu, colocated, sleep=True, activations=GIB)
    assert asleep.engine_awake == 40 * GIB and asleep.engine_asleep == int(40 * GIB * ENGINE_ASLEEP)  # what stays
    assert asleep.generating == 40 * GIB + tight.resident
    assert asleep.updating == asleep.engine_asleep + tight.peak + GIB
    assert "1 engine(s) asleep ~4.0 GiB (of their 40.0 GiB) + the trainer's" in memory_problem(
        tight, gpu, colocated, sleep=True, activations=35 * GIB)
    assert "while the engines generate" in memory_problem(big, gpu, colocated, sleep=True)
    split = plan(machine(2), layout="split", engines=1, nprocs=1)
    assert memory_problem(big, gpu, split, sleep=False) is None  # the trainer has its GPU alone
    assert gpu_memory(big, gpu, split, sleep=False).engines == 0
    assert "= 104.3 GiB per GPU, over the GPU's 80.0 GiB" in memory_problem(trainer_memory(7 * 10**9, 4), gpu, split,
                                                                            sleep=False)
    assert memory_problem(big, None, colocated, sleep=False) is None  # memory unknown: nothing to check


# ---------------------------------------------------------------------------------------------- the model's shape


def test_the_shape_and_parameters_come_from_config_json_as_published():
    one_five = Shape.from_config("Qwen2.5-1.5B", QWEN25_1_5B)  # no weights: the parameters estimated from the shape
    assert one_five == next(s for s in QWEN25 if s.name == "Qwen2.5-1.5B")
    llama = Shape.from_config("Llama-3.2-1B", LLAMA32_1B)
    assert (llama.parameters, llama.kv_dim) == (1_235_814_400, 512)  # its published count: tied, no biases
    gemma_like = Shape.from_config("m", {"text_config": LLAMA32_1B})  # a multimodal config's text part
    assert gemma_like.hidden == 2048 and Shape.from_config("m", QWEN25_1_5B, parameters=7).parameters == 7
    with pytest.raises(ValueError, match="config.json has no hidden_size"):
        Shape.from_config("bert", {"model_type": "bert"})


def test_the_shape_of_a_model_directory_counts_its_weights(tiny_model_dir):
    shape = model_shape(tiny_model_dir)
    assert shape.parameters == count_parameters(tiny_model_dir)
    assert shape.parameters == Shape.from_config("tiny", json.loads((Path(tiny_model_dir) / "config.json")
                                                                    .read_text())).parameters  # the estimate agrees
    assert model_shape(Path(tiny_model_dir) / "nowhere") is None


def test_activations_grow_with_the_micro_batch_and_checkpointing_keeps_one_input_per_layer():
    s = next(s for s in QWEN25 if s.name == "Qwen2.5-1.5B")
    layer = 6 * s.hidden + 2 * s.kv_dim + 4 * s.intermediate  # values per token one layer keeps for the backward
    logits = LOGITS_CHUNK * s.vocab * 16  # one chunk of float32 logits, log-softmax and both gradients
    assert s.activation_bytes(8192, False) == 8192 * layer * s.layers * 2 + logits
    assert s.activation_bytes(8192, True) == 8192 * (s.hidden * s.layers + layer) * 2 + logits
    assert s.activation_bytes(8192, False, bytes_per_value=4) - logits == 2 * (s.activation_bytes(8192, False) - logits)
    assert s.activation_bytes(8192, True, offload=True) == 8192 * layer * 2 + logits  # the rest waits in CPU memory
    assert s.activation_bytes(100, False) == 100 * layer * s.layers * 2 + 100 * s.vocab * 16  # shorter than a chunk
    assert round(s.activation_bytes(8192, False) / GIB, 1) == 21.8  # docs/gpu.md's table


def test_parameters_are_counted_from_the_safetensors_headers(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert count_parameters(tiny_model_dir) == sum(p.numel() for p in model.state_dict().values())
    q = model.model.layers[0].self_attn.q_proj.weight
    layers = len(model.model.layers)
    assert lora_parameters(tiny_model_dir, 8, ["q_proj"]) == layers * 8 * (q.shape[0] + q.shape[1])
    assert count_parameters(Path(tiny_model_dir) / "nowhere") is None


# ---------------------------------------------------------------------------------------------- the command line


def _command(**kwargs):
    return engine_command(Path("/models/m"), port=8000, served_model_name="m", max_model_len=4096,
                          **kwargs)


def test_the_engine_command_on_a_gpu_machine_carries_the_memory_plan():
    args, env = _command(gpus=8, gpu="5", gpu_memory_utilization=0.5, sleep_mode=True,
                         base_env={"CUDA_VISIBLE_DEVICES": "4,5", "PATH": "/bin"})
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.5"
    assert "--enable-sleep-mode" in args and "--dtype" not in args and "--enforce-eager" not in args
    assert env["CUDA_VISIBLE_DEVICES"] == "5" and env["VLLM_SERVER_DEV_MODE"] == "1" and env["PATH"] == "/bin"
    plain, env = _command(gpus=1, base_env={})
    assert "--gpu-memory-utilization" not in plain and "--enable-sleep-mode" not in plain  # vLLM's defaults
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_the_engine_command_on_cpu_has_no_gpu_flags_and_refuses_sleep_mode():
    args, env = _command(gpus=0, gpu_memory_utilization=0.5, share=(1, 2), cores=[0, 1, 2], base_env={})
    assert args[args.index("--dtype") + 1] == "float32" and "--gpu-memory-utilization" not in args
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and "CUDA_VISIBLE_DEVICES" not in env
    assert "VLLM_CACHE_ROOT" not in env  # vLLM's own, shared by every start (tests/running/test_vllm_server_engine.py)
    assert _command(gpus=0, base_env={"VLLM_CACHE_ROOT": "/c"})[1]["VLLM_CACHE_ROOT"] == "/c"  # the user's
    with pytest.raises(EngineError, match="sleep mode needs a CUDA GPU"):
        _command(gpus=0, sleep_mode=True, base_env={})


# ---------------------------------------------------------------------------------------------- sleep routes


def test_sleep_and_wake_against_the_scripted_engine():
    up = ScriptedUpstream()
    try:
        assert is_sleeping(up.url) is False
        sleep(up.url, 2)
        assert is_sleeping(up.url) is True and up.engine.sleep_level == 2
        wake_up(up.url)
        assert is_sleeping(up.url) is False
        assert up.engine.targets == ["GET /is_sleeping", "POST /sleep?level=2", "GET /is_sleeping", "POST /wake_up",
                                     "GET /is_sleeping", "GET /is_sleeping"]
    finally:
        up.close()


def test_a_failed_wake_names_the_engine_url_and_its_status():
    up = ScriptedUpstream(Script(wake_status=500))
    try:
        sleep(up.url, 1)
        with pytest.raises(EngineError, match=rf"POST {up.url}/wake_up answered HTTP 500 trying to wake it up"):
            wake_up(up.url)
        assert is_sleeping(up.url) is True
    finally:
        up.close()
    with pytest.raises(EngineError, match=r"POST http://127.0.0.1:9/sleep\?level=1 failed trying to put it to sleep"):
        sleep("http://127.0.0.1:9", 1)


def test_docs_gpu_md_holds_the_sizing_table_as_computed():
    """docs/gpu.md's table is `python -m harness.running.gpu_sizing`'s output, and its numbers are the memory plan's
    own estimate (a full bf16 1.5B: 8 bytes a parameter)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "gpu.md").read_text(encoding="utf-8")
    assert f"<!-- sizing:start -->\n{sizing_table()}<!-- sizing:end -->" in doc
    one_five = next(s for s in QWEN25 if s.name == "Qwen2.5-1.5B")
    assert trainer_memory(one_five.parameters, 2).peak == 8 * one_five.parameters


# ---------------------------------------------------------------------------------------------- python -m gpu_sizing


def test_gpu_sizing_prints_the_qwen_table_without_arguments_and_a_row_per_model_given(tmp_path, tiny_model_dir,
                                                                                       capsys):
    assert main([]) == 0
    assert capsys.readouterr().out == sizing_table()
    llama = tmp_path / "llama-3.2-1b"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps(LLAMA32_1B))  # a config.json, no weights
    assert main([str(llama), str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(f"| {tmp_path}") or line.startswith("| /")]
    assert [row.split(" | ")[0] for row in rows] == [f"| {llama}", f"| {tiny_model_dir}"]
    assert rows[0] == sizing_table([Shape.from_config(str(llama), LLAMA32_1B)]).splitlines()[2]
    assert "Qwen2.5" not in out
    assert f"parameters estimated from config.json (no safetensors weights here): {llama}" in out


def test_gpu_sizing_reads_a_hub_id_from_the_local_cache_only(tmp_path, monkeypatch, capsys):
    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.2-1B" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(LLAMA32_1B))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert main(["meta-llama/Llama-3.2-1B"]) == 0
    assert "| meta-llama/Llama-3.2-1B | 18.4 GiB | 9.2 GiB |" in capsys.readouterr().out
    assert main(["meta-llama/Llama-3.2-3B"]) == 2  # not cached: nothing is downloaded
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "nor in the Hugging Face cache" in err and "hf download" in err


@pytest.mark.parametrize("argument", ["no such dir", "/nowhere/at/all", "a/b/c"])
def test_gpu_sizing_says_in_one_line_what_is_wrong_with_an_argument(argument, capsys):
    assert main([argument]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert captured.err.startswith(f"error: {argument!r} is neither a model directory nor a Hugging Face id")


def test_gpu_sizing_answers_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0 and "MODEL" in capsys.readouterr().out
