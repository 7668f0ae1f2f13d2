"""Where a training step's time goes, and what the trainer costs over a bare forward + backward, side by side.

    .venv/bin/python bench/train_step.py [--steps 6] [--quick] [--repeat 7] [--threads 1] [--no-docs]

(1) Step time split of a real `harness train` run: examples/train/terse.yaml (the unmodified two-turn terse agent,
    16 episodes a step, through the recording proxy into a vLLM engine this run starts) on the tiny model
    (running/tiny_model.py, seed 0), `--steps` steps. Reads the per-step `time/*` metrics back from the run's DuckDB
    `metrics` table: medians per phase, their share of the median step, weight sync against its goal (<= 10%).
(2) Trainer throughput on the samples that run stored, cut exactly as trainer/rl/loop.py cuts them (per step: the
    trained episodes, `ppo_epochs` shuffled passes, mini-batches, micro-batches of `micro_batch_tokens`):
    (a) the trainer's path per micro-batch: collate + token_logprobs(loss_only, with_entropy) + policy_loss +
        entropy aggregate + backward + the loop's `.item()` metrics;
    (b) a bare `model(input_ids, attention_mask).logits` -> log_softmax -> gather -> mean over the trained tokens
        -> backward, on the same padded micro-batches (collated beforehand, untimed);
    (c) the same bare pass with the output layer run on the trained positions only (what loss_only saves),
    (d) the trainer's path on the model as the loop holds it (trainer.model.fsdp.shard over a one-rank group);
    (a)-(c) on one model (trainer.model.policy.load_policy), all at a fixed number of torch threads, gradients zeroed
    after each mini-batch and no optimizer step in any arm; arms interleaved, median of `--repeat`. Goal: (a) <=
    1.3x (b). Then (d) at torch's default thread count against (d) at the fixed one, on one step's mini-batches.
(3) Merged vs per-call training time on the 10-turn workload is bench/merge.py's (its section).

Writes its section of docs/BENCHMARKS.md (between the train_step markers) unless --no-docs.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.docs_section import DOCS, write_section  # noqa: E402

CONFIG = ROOT / "examples" / "train" / "terse.yaml"
PHASES = ("rollout_s", "judge_s", "merge_s", "logprobs_s", "train_s", "sync_s", "sync_reload_s", "checkpoint_s")
SLOW_PASSES = 7  # pairs of passes of arm (d) at the fixed and at torch's default thread count
IN_STEP = ("rollout_s", "merge_s", "logprobs_s", "train_s", "sync_s", "checkpoint_s")  # disjoint parts of step_s


# ---------------------------------------------------------------------------------------------- (1) the real run


def run_training(folder: Path, steps: int) -> tuple[Path, float]:
    """`harness train` on the terse demo and the tiny model in `folder`; returns its run directory and wall time."""
    from harness.running.tiny_model import build_tiny_model

    model = build_tiny_model(folder / "tiny", seed=0)
    command = [sys.executable, "-m", "harness.cli", "train", str(CONFIG), "--set", f"trainer.total_steps={steps}",
               "--set", f"logging.run_dir={folder / 'runs'}", "--set", f"model.path={model}"]
    log = folder / "train.log"
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise SystemExit(f"`{' '.join(command)}` exited with {done.returncode}; the end of its output:\n{tail}")
    return folder / "runs" / "terse", wall


def step_metrics(db: Path) -> dict[int, dict[str, float]]:
    """step -> {time metric without its `time/` prefix: seconds}, from the run's metrics table."""
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("SELECT step, name, value FROM metrics WHERE name LIKE 'time/%' AND value IS NOT NULL "
                           "ORDER BY step").fetchall()
    steps: dict[int, dict[str, float]] = {}
    for step, name, value in rows:
        steps.setdefault(step, {})[name.removeprefix("time/")] = value
    return steps


def split(steps: dict[int, dict[str, float]]) -> dict[str, dict]:
    """Per phase: median over the steps that logged it, and on how many; `other` is what the step spends outside
    the timed phases (advantages, metrics, logging), per step."""
    out = {}
    for phase in (*PHASES, "step_s"):
        values = [m[phase] for m in steps.values() if phase in m]
        if values:
            out[phase] = {"median": statistics.median(values), "n": len(values), "values": values}
    other = [m["step_s"] - sum(m.get(p, 0.0) for p in IN_STEP) for m in steps.values()]
    out["other"] = {"median": statistics.median(other), "n": len(other), "values": other}
    return out


# ---------------------------------------------------------------------------------------------- (2) the work


@dataclass
class MiniBatch:
    """One mini-batch of one PPO epoch, as trainer/rl/update.py's `update` builds it."""

    rows: list  # Samples
    advantages: list[float]  # one per row: its episode's advantage
    old: list  # per row, the trainer's logprobs at the rollout weights ([len(token_ids)] tensors)
    micro: list[list[int]]  # micro-batches: indices into rows
    weights: list  # per row, each token's weight in the mini-batch's loss (trainer.maths.algorithms.token_weights)


def step_rows(run: Path, cfg) -> list[tuple[list, list[float]]]:
    """Per training step, the samples the loop trained on (groups without contrast dropped, as the loop does when
    no KL or entropy term keeps them) and their episodes' advantages."""
    import torch

    from harness.store.database import Store
    from trainer.maths import algorithms as algo

    with Store.open(run / "harness.duckdb", read_only=True) as store:
        samples = store.load_samples()
        with store.cursor() as cur:
            outcomes = cur.execute("SELECT episode_id, run_id, task_id FROM episode_outcomes").fetchall()
    where = {eid: (int(run_id.rsplit("-train", 1)[1]), task) for eid, run_id, task in outcomes if "-train" in run_id}
    by_step: dict[int, dict[str, list]] = {}
    for s in samples:
        if s.episode_id in where and s.reward is not None:
            by_step.setdefault(where[s.episode_id][0], {}).setdefault(s.episode_id, []).append(s)
    keep_flat = cfg.trainer.kl_coef > 0 or cfg.trainer.entropy_coef > 0
    out = []
    for step in sorted(by_step):
        episodes = list(by_step[step].items())
        rewards = torch.tensor([rows[0].reward for _, rows in episodes], dtype=torch.float64)
        groups = [where[eid][1] for eid, _ in episodes]
        advantages = algo.outcome_advantages(rewards, groups, cfg.trainer.adv_estimator).tolist()
        spread: dict[str, list[float]] = {}
        for g, r in zip(groups, rewards.tolist(), strict=True):
            spread.setdefault(g, []).append(r)
        rows, adv = [], []
        for (_, samples_of), a, g in zip(episodes, advantages, groups, strict=True):
            if keep_flat or (len(spread[g]) > 1 and max(spread[g]) - min(spread[g]) >= 1e-12):
                rows += samples_of
                adv += [a] * len(samples_of)
        out.append((rows, adv))
    return out


def mini_batches(model, steps: list[tuple[list, list[float]]], cfg, pad_id: int) -> list[MiniBatch]:
    """Every mini-batch of every step and epoch, in the loop's order and shapes, with the old logprobs."""
    import torch

    from trainer.maths.algorithms import token_weights
    from trainer.model.policy import collate, micro_batches, token_logprobs

    t = cfg.trainer
    n_mini = max(1, cfg.rollout.batch_size // (t.mini_batch_size or cfg.rollout.batch_size))
    work = []
    for rows, adv in steps:
        old: list = [None] * len(rows)
        with torch.no_grad():
            for idx in micro_batches(rows, t.micro_batch_tokens) if rows else []:
                batch = collate([rows[i] for i in idx], pad_id, indices=idx)
                logprobs, _ = token_logprobs(model, batch, cfg.rollout.temperature, loss_only=True)
                for r, i in enumerate(idx):
                    old[i] = logprobs[r, :len(rows[i].token_ids)]
        rng = random.Random(t.seed)
        for _ in range(t.ppo_epochs):
            order = list(range(len(rows)))
            rng.shuffle(order)
            for k in range(n_mini):
                mine = order[k::n_mini]
                if not mine:
                    continue
                part = [rows[i] for i in mine]
                work.append(MiniBatch(part, [adv[i] for i in mine], [old[i] for i in mine],
                                      micro_batches(part, t.micro_batch_tokens), token_weights(part, t.loss_agg_mode)))
    if not work:
        raise SystemExit("the run stored no trained samples: nothing to time")
    return work


# ---------------------------------------------------------------------------------------------- (2) the arms


def trainer_arm(model, mb: MiniBatch, cfg, pad_id: int) -> None:
    """trainer/rl/update.py's own mini_batch on one mini-batch (no KL term: the terse config has none)."""
    from trainer.model.fsdp import init_distributed
    from trainer.rl.update import mini_batch

    dist = init_distributed(device="cpu")  # one rank: the group is made once and reused
    mini_batch(model, mb.rows, mb.advantages, mb.old, [None] * len(mb.rows), mb.weights, mb.rows[0], pad_id, cfg,
                dist)
    model.zero_grad(set_to_none=True)


def bare_arm(model, batches: list, trained_only: bool) -> None:
    """Forward + backward of one mini-batch's pre-collated micro-batches: mean logprob of the trained tokens.
    `trained_only`: run the output layer on the trained positions alone, as token_logprobs(loss_only) does."""
    import torch

    for b in batches:
        keep = b.loss_mask[:, 1:] > 0
        targets = b.token_ids[:, 1:][keep]
        if trained_only:
            hidden = model.get_decoder()(input_ids=b.token_ids, attention_mask=b.attention_mask).last_hidden_state
            logits = model.get_output_embeddings()(hidden[:, :-1][keep])
        else:
            logits = model(input_ids=b.token_ids, attention_mask=b.attention_mask).logits[:, :-1][keep]
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1))
        logprobs.mean().backward()
    model.zero_grad(set_to_none=True)


def collate_arm(mb: MiniBatch, pad_id: int) -> None:
    from trainer.model.policy import collate

    for idx in mb.micro:
        collate([mb.rows[i] for i in idx], pad_id, indices=idx)


def thread_pairs(run_arm, work: list[MiniBatch], threads: int, default_threads: int) -> list[tuple[float, float]]:
    """(seconds at `threads`, seconds at `default_threads`) of passes of `run_arm` over `work`, alternated
    SLOW_PASSES times.

    Apart from the interleaved arms: an OpenMP pool switched between thread counts mini-batch by mini-batch
    keeps a spare thread spinning, and that would slow the other arms too."""
    import torch

    pairs = []
    for _ in range(SLOW_PASSES):
        pair = []
        for n in (threads, default_threads):
            torch.set_num_threads(n)
            run_arm(work[:1])  # the first mini-batch after a switch pays for it: not timed
            t0 = time.perf_counter()
            run_arm(work)
            pair.append(time.perf_counter() - t0)
        pairs.append(tuple(pair))
    torch.set_num_threads(threads)
    return pairs


def throughput(run: Path, repeat: int, threads: int) -> dict:
    """Times the arms over the run's work; returns per-pass times (s) and token counts. The arms take turns on
    each mini-batch (in rotating order), so a burst of other work on the machine falls on all of them alike."""
    import torch

    from trainer.config import load_config
    from trainer.model.build import pad_id_of
    from trainer.model.fsdp import init_distributed, shard, shutdown
    from trainer.model.policy import collate, load_policy

    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = load_config(run / "config.resolved.yaml")
    pad_id = pad_id_of(cfg.model.path, cfg.model.trust_remote_code)
    model = load_policy(cfg.model.path, torch.float32)
    sharded = shard(load_policy(cfg.model.path, torch.float32), init_distributed("cpu"))  # as the RL loop holds it
    steps = step_rows(run, cfg)
    work = mini_batches(model, steps, cfg, pad_id)
    batches = [[collate([mb.rows[i] for i in idx], pad_id, indices=idx) for idx in mb.micro] for mb in work]
    arms = {"trainer": lambda j: trainer_arm(model, work[j], cfg, pad_id),
            "bare": lambda j: bare_arm(model, batches[j], trained_only=False),
            "bare_trained": lambda j: bare_arm(model, batches[j], trained_only=True),
            "trainer_fsdp": lambda j: trainer_arm(sharded, work[j], cfg, pad_id),
            "collate": lambda j: collate_arm(work[j], pad_id)}
    for j in range(len(work)):  # warm-up: first-call allocations
        for arm in arms.values():
            arm(j)
    times: dict[str, list] = {name: [] for name in arms}
    names = list(arms)
    for rep in range(repeat):
        total = dict.fromkeys(arms, 0.0)
        for j in range(len(work)):
            for k in range(len(names)):
                name = names[(j + rep + k) % len(names)]
                t0 = time.perf_counter()
                arms[name](j)
                total[name] += time.perf_counter() - t0
        for name, value in total.items():
            times[name].append(value)
    if default_threads != threads:
        first = work[:max(1, len(work) // len(steps))]  # one step's mini-batches: slow passes, kept short
        times["thread_pairs"] = thread_pairs(lambda mbs: [trainer_arm(sharded, mb, cfg, pad_id) for mb in mbs],
                                             first, threads, default_threads)
    shutdown()
    flat = [b for mini in batches for b in mini]
    return {"s": {name: statistics.median(times[name]) for name in arms}, "times": times,
            "tokens": sum(b.n_tokens for b in flat), "padded": sum(b.token_ids.numel() for b in flat),
            "trained": int(sum(b.loss_mask.sum() for b in flat)), "micro": len(flat), "mini": len(work),
            "steps": len(steps), "rows": sum(len(rows) for rows, _ in steps),
            "cfg": cfg, "params": sum(p.numel() for p in model.parameters()), "threads": threads,
            "default_threads": default_threads}


# ---------------------------------------------------------------------------------------------- the report

PHASE_NOTES = {
    "rollout_s": "16 episodes of the agent through the proxy into vLLM, judges included",
    "judge_s": "judge waits summed over episodes; inside rollout, overlapping the agents",
    "merge_s": "flush the recorder, read the calls back, merge into samples",
    "logprobs_s": "old logprobs: one no-grad pass at the rollout weights",
    "train_s": "ppo_epochs x mini-batches: forward, backward, clip, AdamW",
    "sync_s": "gather, write safetensors, pause, reload, reset cache, notify proxy, resume",
    "sync_reload_s": "of which the engine's reload_weights call",
    "checkpoint_s": "model, optimizer, scheduler to disk (save_freq and the last step)",
    "other": "the rest of the step: advantages, metrics, logging",
}


def phase_table(phases: dict[str, dict], n_steps: int) -> list[str]:
    step = phases["step_s"]["median"]
    lines = ["| phase | median s | share of the median step | steps logged | what it is |",
             "| --- | ---: | ---: | ---: | --- |"]
    for name in (*PHASES, "other"):
        if name not in phases:
            continue
        p = phases[name]
        label = name.removesuffix("_s").replace("_", " ")
        lines.append(f"| {label} | {p['median']:.3f} | {p['median'] / step:.1%} | {p['n']} of {n_steps} "
                     f"| {PHASE_NOTES[name]} |")
    lines.append(f"| **step** | **{step:.2f}** | 100% | {phases['step_s']['n']} | |")
    return lines


def report(command: str, phases: dict, n_steps: int, train_wall: float, tp: dict, load: tuple[float, float]) -> str:
    import torch
    import vllm

    machine = (f"{os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}, "
               f"vLLM {vllm.__version__}")
    lines = [
        "## train_step",
        "",
        f"`.venv/bin/python bench/train_step.py {command}` on {date.today()}: {machine}; 1-minute load average "
        f"{load[0]:.1f} at the start, {load[1]:.1f} at the end (other work shares this machine).",
        "",
        *step_section(phases, n_steps, train_wall, tp),
        "",
        *throughput_section(tp, phases),
        "",
        "**(3) Merged vs per-call samples** on the 10-turn workload (the tokens the trainer is spared before any of "
        "this): the `merge` section above, its trainer-step proxy row.",
    ]
    return "\n".join(lines)


def step_section(phases: dict, n_steps: int, train_wall: float, tp: dict) -> list[str]:
    cfg = tp["cfg"]
    t = cfg.trainer
    step = phases["step_s"]["median"]
    sync_share = phases["sync_s"]["median"] / step
    worst = max(v / m for v, m in zip(phases["sync_s"]["values"], phases["step_s"]["values"], strict=True))
    return [
        f"**(1) Step time split** of `harness train examples/train/terse.yaml` for {n_steps} steps on the tiny model "
        f"({tp['params'] / 1e6:.2f}M parameters, float32; {cfg.rollout.batch_size} tasks x {cfg.rollout.num_repeat} "
        f"two-turn episodes a step, {t.ppo_epochs} epochs x {cfg.rollout.batch_size // (t.mini_batch_size or 1)} "
        "mini-batches), from the run's own `time/*` metrics (its `metrics` table); the whole command took "
        f"{train_wall:.0f} s, vLLM's start included.",
        "",
        *phase_table(phases, n_steps),
        "",
        f"Weight sync: **{sync_share:.1%}** of the median step (worst step {worst:.1%}); goal <= 10%: "
        f"{YES[sync_share <= 0.10]}. The step is the agents' rollout; on this model the update and the sync are "
        "small beside it.",
    ]


ARMS = {
    "trainer": "(a) trainer: collate + token_logprobs(loss_only, with_entropy) + policy_loss + backward",
    "bare": "(b) bare: `model(...).logits` -> log_softmax -> gather -> mean -> backward",
    "bare_trained": "(c) bare, output layer on the trained positions only",
    "trainer_fsdp": "(d) = (a) on the model as trainer/rl/loop.py holds it: `shard()` (FSDP2) over a one-rank group",
}


def throughput_section(tp: dict, phases: dict) -> list[str]:
    t, s, times = tp["cfg"].trainer, tp["s"], tp["times"]
    present = list(ARMS)
    ratio = {name: ratios(times, name, "bare") for name in present}
    goal, _ = ratio["trainer"]
    loop, _ = ratio["trainer_fsdp"]
    extras, _ = ratios(times, "trainer", "bare_trained")
    wrapper, _ = ratios(times, "trainer_fsdp", "trainer")
    bold = {"trainer": "**"}
    rows = [f"| {ARMS[name]} | {s[name]:.3f} | {tp['tokens'] / s[name]:,.0f} "
            f"| {bold.get(name, '')}{ratio[name][0]:.2f}x{bold.get(name, '')} ({ratio[name][1]}) |" for name in present]
    in_run = (f"- In the run the update took {phases['train_s']['median']:.2f} s a step (median `time/train_s`, "
              "AdamW and gradient clipping included), against "
              f"{s['trainer_fsdp'] / tp['steps']:.2f} s for a step's forward and backward in arm (d).")
    if "thread_pairs" in times:
        each = sorted(b / a for a, b in times["thread_pairs"])
        in_run += (f" Arm (d) at torch's default of {tp['default_threads']} threads, as `harness train` runs it, "
                   f"took {statistics.median(each):.1f}x as long as at {tp['threads']} ({each[0]:.1f}-"
                   f"{each[-1]:.1f}x; {len(each)} alternated pairs of passes over one step's mini-batches). The "
                   f"likely cause: on {os.cpu_count()} cores shared with other processes, each of the many small "
                   "operators waits at an OpenMP barrier for a thread the scheduler has given to another process.")
    return [
        f"**(2) Trainer throughput** on the {tp['rows']} samples that run trained ({tp['steps']} steps), cut as "
        f"trainer/rl/loop.py cuts them: {tp['mini']} mini-batches ({t.ppo_epochs} epochs), {tp['micro']} micro-batches "
        f"of at most {t.micro_batch_tokens} padded tokens; {tp['tokens']:,} tokens ({tp['padded']:,} padded, "
        f"{tp['trained']:,} trained) per pass. {tp['threads']} torch thread(s), no optimizer step in any arm, "
        "gradients zeroed after each mini-batch. The arms take turns on each mini-batch, in rotating order; times "
        f"are medians of {len(times['bare'])} passes, ratios the median of each pass's ratio (range in brackets).",
        "",
        "| arm | s per pass | tokens/s | time over (b) |",
        "| --- | ---: | ---: | ---: |",
        *rows,
        "",
        f"Trainer overhead over a bare forward + backward: **{goal:.2f}x** (goal <= 1.3x: {YES[goal <= 1.3]}); "
        f"as the loop runs it, FSDP2 wrapper included: {loop:.2f}x ({YES[loop <= 1.3]}).",
        "",
        "- Every arm runs the same micro-batches: the same rows, padding and trained tokens. What (a) does beyond "
        f"(b): it builds the padded tensors from the samples' lists (`collate`, {s['collate'] * 1000:.1f} ms a pass, "
        f"{s['collate'] / s['trainer']:.0%} of (a)) and pads old logprobs and advantages; runs the output layer in "
        "checkpointed chunks, so it runs twice; computes the entropy of every trained position over the whole "
        "vocabulary; the clipped policy loss, its per-episode aggregation and seven clip/ratio metrics, read back "
        "with `.item()`. What it does less: with `loss_only` the output layer and log_softmax run on the trained "
        f"positions alone ({tp['trained']:,} of {tp['tokens']:,} tokens; agent prompts are mostly context), where "
        f"(b) runs them on every position. (c) does only that saving: (a) over (c), {extras:.2f}x, is the price of "
        f"the extras. (d) over (a), {wrapper:.2f}x, is FSDP2's per-unit hooks and DTensor parameters, paid even on "
        "one rank.",
        in_run,
    ]


YES = {True: "yes", False: "**no**"}


def ratios(times: dict[str, list[float]], arm: str, baseline: str) -> tuple[float, str]:
    """Median over passes of arm / baseline (the arms of one pass saw the same machine), and its range."""
    each = sorted(a / b for a, b in zip(times[arm], times[baseline], strict=True))
    return statistics.median(each), f"{each[0]:.2f}-{each[-1]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps of the real run")
    parser.add_argument("--repeat", type=int, default=7, help="passes of each throughput arm; the median is reported")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the throughput arms")
    parser.add_argument("--quick", action="store_true", help="3 steps and 3 passes: a smoke run (~2.5 minutes)")
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeat = min(args.steps, 3), min(args.repeat, 3)
    command = f"--steps {args.steps} --repeat {args.repeat} --threads {args.threads}"

    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-train-step-") as tmp:
        print(f"harness train, {args.steps} steps (vLLM starts first, ~40 s) ...", flush=True)
        run, wall = run_training(Path(tmp), args.steps)
        steps = step_metrics(run / "harness.duckdb")
        phases = split(steps)
        print(f"done in {wall:.0f} s; median step {phases['step_s']['median']:.2f} s. Throughput arms ...", flush=True)
        tp = throughput(run, args.repeat, args.threads)
    text = report(command, phases, len(steps), wall, tp, (load0, os.getloadavg()[0]))
    print(text)
    if not args.no_docs:
        write_section("train_step", text)
        print(f"updated {DOCS}")


if __name__ == "__main__":
    main()
