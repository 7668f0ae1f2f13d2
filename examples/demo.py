"""`make demo`: build the tiny model, start vLLM and the recording proxy, run an unmodified OpenAI-SDK agent over a
handful of tasks (one episode each) and show what was recorded with `harness sql`, and the episodes merged into
training sequences with `harness merge`; then run a tool-using math agent over a dataset with `harness run`, judged,
with its report and its merged samples; then train the tiny model with GRPO on a two-turn agent until its
reward visibly rises (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from harness.running.tiny_model import build_tiny_model
from harness.running.vllm_server import start_vllm
from proxy import ProxyConfig, ProxyServer

HERE = Path(__file__).resolve().parent
LORA_OUTPUT_SCALE = 8.0  # --lora: the tiny model's output layer x8 (harness tiny-model --output-scale)
LORA_LR = 5e-2  # --lora: adapters (scale alpha / rank = 4) take larger steps than the whole model's 1e-2
SUMMARY = """
SELECT e.episode_id, count(*) AS calls, sum(c.prompt_tokens)::BIGINT AS prompt_tokens,
       sum(c.completion_tokens)::BIGINT AS completion_tokens, list(c.status ORDER BY c.call_index) AS statuses,
       round(avg(c.latency_ms), 1) AS avg_latency_ms
FROM episodes e JOIN calls c USING (episode_id)
GROUP BY e.episode_id ORDER BY e.episode_id
"""
FIDELITY = """
SELECT count(*) AS choices,
       count(*) FILTER (WHERE len(ch.completion_ids) = len(ch.logprobs)) AS ids_match_logprobs,
       count(*) FILTER (WHERE c.token_source = 'engine') AS engine_token_ids
FROM calls c JOIN choices ch USING (call_id)
"""
CURVE = """
SELECT step, round(reward_mean, 3) AS reward_mean, round(entropy, 2) AS entropy, round(response_length, 1) AS
       sampled_tokens, round(step_s, 1) AS step_s
FROM training_curve WHERE run_id = (SELECT run_id FROM runs ORDER BY started_at DESC LIMIT 1) ORDER BY step
"""
MERGE = """
SELECT episodes, calls, samples, per_call_tokens, merged_tokens, round(merge_ratio, 2) AS merge_ratio, drift_rate
FROM merge_metrics
"""


def harness_sql(db: Path, query: str) -> None:
    subprocess.run([sys.executable, "-m", "harness.cli", "sql", "--db", str(db), query], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/demo"))
    parser.add_argument("--tasks", type=Path, default=HERE / "tasks.jsonl")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="train LoRA adapters of this rank instead of the whole model (the engine serves them)")
    parser.add_argument("--max-staleness", type=int, default=0, metavar="K",
                        help="asynchronous rollouts: the next K steps' episodes run while a step trains")
    args = parser.parse_args()
    run_dir = args.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    db = run_dir / "harness.duckdb"

    # LoRA leaves the output layer frozen, and a random one barely separates tokens: its model gets one that does
    model_dir = run_dir / ("tiny-model-lora" if args.lora else "tiny-model")
    if not (model_dir / "config.json").exists():
        print(f"[1/6] building the tiny model into {model_dir}")
        build_tiny_model(model_dir, seed=0, output_scale=LORA_OUTPUT_SCALE if args.lora else 1.0)
    else:
        print(f"[1/6] tiny model already at {model_dir}")

    print(f"[2/6] starting vLLM (log: {run_dir / 'engine.log'}); about a minute on CPU")
    t0 = time.time()
    lora = {}
    if args.lora:
        from trainer.model.lora import ENGINE_ENV, LoraSpec, engine_args

        lora = {"extra_args": engine_args(LoraSpec(rank=args.lora)), "env": ENGINE_ENV}
    with start_vllm(model_dir, run_dir, **lora) as engine:
        print(f"      engine ready in {time.time() - t0:.0f} s at {engine.base_url}")
        proxy = ProxyServer(ProxyConfig(upstream_url=engine.base_url, served_model=engine.served_model,
                                        db_path=db, port=0))
        url = proxy.start_in_thread()
        print(f"      proxy recording at {url}/v1 into {db}")
        try:
            tasks = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
            print(f"[3/6] running examples/simple_agent.py (OpenAI SDK, no harness imports) on {len(tasks)} tasks")
            for task in tasks:
                episode_url = f"{url}/e/demo-{task['id']}/v1"
                env = dict(os.environ, OPENAI_BASE_URL=episode_url, OPENAI_API_KEY="sk-demo-not-stored")
                out = subprocess.run([sys.executable, str(HERE / "simple_agent.py"), task["prompt"]], env=env,
                                     capture_output=True, text=True, timeout=300)
                if out.returncode != 0:
                    print(out.stderr[-2000:], file=sys.stderr)
                    raise SystemExit(f"the agent failed on task {task['id']!r}")
                answer = json.loads(out.stdout.strip().splitlines()[-1])["answer"]
                print(f"      {task['id']:>8}: {str(answer)[:60]!r}")
            print("[4/6] what was recorded (harness sql, through the live proxy):")
            harness_sql(db, SUMMARY)
            harness_sql(db, FIDELITY)
        finally:
            proxy.stop_thread()
        print("      harness merge: each episode's calls as training sequences (token-exact: one per episode)")
        subprocess.run([sys.executable, "-m", "harness.cli", "merge", "--db", str(db)], check=True)
        print("[5/6] harness run: examples/math_agent over 4 tasks x 2, judged by the math judge")
        math = HERE / "math_agent"
        subprocess.run([sys.executable, "-m", "harness.cli", "run", str(math / "agent.py"), "--data",
                        str(math / "tasks.jsonl"), "--limit", "4", "--repeat", "2", "--judge", "math",
                        "--upstream", engine.base_url, "--run-dir", str(run_dir / "math")], check=True)
        print("      its episodes merged into training samples (tool calls and results in one sequence each):")
        harness_sql(run_dir / "math" / "harness.duckdb", MERGE)
        print("[6/6] harness train: the tiny model learns, by RL alone, to answer examples/terse_agent tersely")
        train_db = run_dir / "terse" / "harness.duckdb"
        subprocess.run([sys.executable, "-m", "harness.cli", "train", str(HERE / "train" / "terse.yaml"),
                        f"--set=model.path={model_dir}", f"--set=rollout.engine.url={engine.base_url}",
                        f"--set=logging.run_dir={run_dir}", "--set=trainer.resume=disable",
                        f"--set=trainer.lora.rank={args.lora}",
                        *([f"--set=trainer.lora.alpha={4 * args.lora}", f"--set=trainer.lr={LORA_LR}"] if args.lora
                          else []),
                        f"--set=rollout.async.max_staleness={args.max_staleness}",
                        *(["--set=trainer.tis_cap=2.0"] if args.max_staleness else [])], check=True)
        print("      the reward per step (judge: examples/terse_agent/judge.py):")
        harness_sql(train_db, CURVE)
    print(f"done. Query it yourself: .venv/bin/harness sql --db {db} \"SELECT * FROM completions LIMIT 5\"")
    print(f"  and the dataset run: .venv/bin/harness sql --db {run_dir / 'math' / 'harness.duckdb'} "
          "\"SELECT * FROM rewards\"")
    print(f"  and the training: the curve is {run_dir / 'terse' / 'curve.png'}, checkpoints in "
          f"{run_dir / 'terse' / 'checkpoints'}, metrics in .venv/bin/harness sql --db {train_db} "
          "\"SELECT * FROM training_curve ORDER BY step\"")
    return 0


if __name__ == "__main__":
    sys.exit(main())
