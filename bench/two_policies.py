"""One shared policy against one policy per role, on a two-role app whose roles need opposite habits.

    .venv/bin/python bench/two_policies.py [--steps 20] [--seed 0] [--no-docs]

examples/train/planner_executor.yaml on the real SmolLM2-135M-Instruct (built offline), LoRA rank 16: the app's
planner is paid for an equation that carries the problem's numbers, its executor for the number alone
(examples/planner_executor/judge.py, each role its own reward). Two runs, the same seed, data, judge and steps:
- shared: `roles.policies: {}`, both roles learn as one policy (one adapter);
- per role: `roles.policies: {planner: planner, executor: executor}`, an adapter each, served side by side.
Per run and step, each role's mean reward (the judge's role_rewards over the step's episodes) and the step's time,
read back from the run's DuckDB. The table gives each role's mean over the first and the last 3 steps and the
median step time. Writes its section of docs/BENCHMARKS.md unless --no-docs.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.docs_section import write_section  # noqa: E402

CONFIG = ROOT / "examples/train/planner_executor.yaml"
ARMS = {"shared": "roles.policies={}", "per role": "roles.policies={planner: planner, executor: executor}"}
ROLES = ("planner", "executor")


def train(folder: Path, model: Path, arm: str, steps: int, seed: int) -> tuple[Path, float]:
    name = arm.replace(" ", "_")
    command = [sys.executable, "-m", "harness.cli", "train", str(CONFIG), f"--set={ARMS[arm]}",
               f"--set=model.path={model}", f"--set=logging.run_dir={folder}", f"--set=experiment_name={name}",
               f"--set=trainer.total_steps={steps}", f"--set=trainer.seed={seed}", f"--set=data.seed={seed}",
               f"--set=rollout.seed={seed}",
               "--set=trainer.test_freq=0", "--set=trainer.val_before_train=false", "--set=logging.curve_png=false"]
    log = folder / f"{name}.log"
    started = time.perf_counter()
    with open(log, "wb") as sink:
        done = subprocess.run(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise SystemExit(f"{' '.join(command)} exited with {done.returncode}:\n{tail}")
    return folder / name / "harness.duckdb", time.perf_counter() - started


def per_step(db: Path) -> dict[int, dict[str, float]]:
    """step -> each role's mean reward and the step's seconds."""
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("""
            SELECT CAST(regexp_extract(o.run_id, '-train(\\d+)$', 1) AS INTEGER) AS step,
                   avg(CAST(j.details->'role_rewards'->>'planner' AS DOUBLE)),
                   avg(CAST(j.details->'role_rewards'->>'executor' AS DOUBLE))
            FROM episode_outcomes o JOIN judgements j USING (episode_id)
            WHERE regexp_matches(o.run_id, '-train\\d+$') GROUP BY 1 ORDER BY 1""").fetchall()
        times = dict(con.execute("SELECT step, value FROM metrics WHERE name = 'time/step_s'").fetchall())
    return {step: {"planner": p, "executor": e, "step_s": times.get(step)} for step, p, e in rows}


def table(results: dict[str, dict[int, dict]], walls: dict[str, float], steps: int, seed: int) -> str:
    def window(by_step: dict[int, dict], role: str, last: bool) -> float:
        chosen = sorted(by_step)[-3:] if last else sorted(by_step)[:3]
        return statistics.mean(by_step[s][role] for s in chosen)

    rows = []
    for arm, by_step in results.items():
        rows.append(f"| {arm} | " + " | ".join(f"{window(by_step, r, False):.3f} -> {window(by_step, r, True):.3f}"
                                               for r in ROLES)
                    + f" | {statistics.median(v['step_s'] for v in by_step.values()):.1f} | {walls[arm] / 60:.1f} |")
    curves = []
    for arm, by_step in results.items():
        for role in ROLES:
            curves.append(f"- {arm}, {role}: " + " ".join(f"{by_step[s][role]:.2f}" for s in sorted(by_step)))
    return "\n".join([
        "## One policy per role (bench/two_policies.py)",
        "",
        f"{date.today()}, {platform.machine()}: examples/train/planner_executor.yaml on the real "
        f"SmolLM2-135M-Instruct, LoRA rank 16, {steps} steps of 4 problems x 8 episodes, seed {seed}; the same run "
        "with both roles as one policy (shared) and with an adapter per role. Rewards: each role's mean over the "
        "first 3 steps -> the last 3 (the judge's role_rewards).",
        "",
        "| arm | planner reward | executor reward | median step s | run min |",
        "|---|---:|---:|---:|---:|",
        *rows,
        "",
        "Per step:",
        "",
        *curves,
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="training steps per run (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="trainer and data seed of both runs (default: %(default)s)")
    ap.add_argument("--no-docs", action="store_true", help="print only; do not rewrite docs/BENCHMARKS.md")
    args = ap.parse_args()
    from harness.running.smollm2 import build_smollm2

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = build_smollm2(folder / "smollm2")
        results, walls = {}, {}
        for arm in ARMS:
            db, walls[arm] = train(folder, model, arm, args.steps, args.seed)
            results[arm] = per_step(db)
            print(f"{arm}: {results[arm]}", flush=True)
    text = table(results, walls, args.steps, args.seed)
    print(text)
    if not args.no_docs:
        write_section("two_policies", text)


if __name__ == "__main__":
    main()
