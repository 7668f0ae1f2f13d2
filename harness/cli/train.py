"""`harness train` and `harness sft`: the verbs that update the policy.

    harness train config.yaml                     the closed RL loop (trainer/loop.py), or with verl on Ray
    harness train config.yaml --from-run RUN      train on a recorded run, no rollouts (trainer/offline.py)
    harness sft config.yaml                       supervised fine-tuning on chat records (trainer/offline.py)

All three read one config file (docs/training.md); torch is imported only once a config checked out.
"""

from __future__ import annotations

import sys
from pathlib import Path


def add_train_parser(verbs) -> None:
    p = verbs.add_parser(
        "train", help="the closed RL loop: rollouts of the agent, judge, merge, GRPO, weights into the engine",
        description="Train the policy on the agent's episodes: each step runs a batch of tasks num_repeat times "
        "through the recording proxy, judges them, merges their calls into samples, makes a GRPO update and loads "
        "the new weights into the running engine. With --from-run, train on a recorded run's episodes instead, "
        "without running the agent (offline.loss sft: rejection-sampling fine-tuning on the episodes --where keeps; "
        "pg: policy gradient, importance-corrected against the stored sampling logprobs). Everything lands in "
        "runs/<experiment>/ (config, curve.png, checkpoints, harness.duckdb with a metrics table). "
        "docs/training.md describes every config key.",
    )
    _common(p)
    p.add_argument("--from-run", metavar="RUN", help="train on this recorded run (offline.run) instead of rollouts")
    p.add_argument("--db", type=Path, help="the DuckDB holding --from-run's run (offline.db; default: the "
                   "experiment's runs/<experiment>/harness.duckdb)")
    p.add_argument("--where", metavar="SQL", help="which of the run's episodes to train on (offline.where), e.g. "
                   "'reward >= 1'; columns: episode_id, task_id, repeat_index, status, reward, n_calls, n_errors")
    p.add_argument("--debug", action="store_true", help="the first debug.n_tasks tasks, one episode at a time, "
                   "fixed seeds, the agent on this terminal, the judge in this process, no timeouts: breakpoints in "
                   "agent or judge code work")
    p.set_defaults(func=_train)


def add_sft_parser(verbs) -> None:
    p = verbs.add_parser(
        "sft", help="supervised fine-tuning on chat records (harness export's, or any messages/tools data)",
        description="Fine-tune the policy on chat records: offline.data is a .jsonl, .json or .parquet file or a "
        "datasets dir of {messages, tools} records (assistant turns with weight 0 are context) or "
        "{prompt, completion} message lists, as `harness export --run RUN` writes them. Records are tokenised with "
        "the model's chat template; the loss is on the assistant turns. The same trainer, config file, checkpoints "
        "and metrics as harness train; with data.validation the agent validates the weights on the engine. The "
        "trained model is written to runs/<experiment>/hf (a warm start for harness train: model.path).",
    )
    _common(p)
    p.add_argument("--data", metavar="PATH", help="the chat records (offline.data)")
    p.set_defaults(func=_sft)


def _common(p) -> None:
    p.add_argument("config", nargs="?", type=Path, help="the YAML config (e.g. examples/train/terse.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set trainer.lr=1e-5 (repeatable)")
    p.add_argument("--show-config", action="store_true", help="print every config key with its default and help")


def _train(args) -> int:
    if (args.db or args.where) and not args.from_run:
        print("error: --db and --where choose what --from-run RUN trains on: give --from-run RUN too (without it, "
              "harness train runs the agent)", file=sys.stderr)
        return 2
    flags = {"offline.run": args.from_run, "offline.db": args.db, "offline.where": args.where}
    overrides = [*args.overrides, *(f"{k}={v}" for k, v in flags.items() if v is not None),
                 *(["debug.enabled=true"] if args.debug else [])]
    return _launch(args, overrides, "train")


def _sft(args) -> int:
    return _launch(args, [*args.overrides, *([f"offline.data={args.data}"] if args.data else [])], "sft")


def _launch(args, overrides: list[str], verb: str) -> int:
    from trainer.config import ConfigError, describe_config, load_config

    if args.show_config:
        print(describe_config())
        return 0
    if args.config is None:
        print(f"error: give a config file, e.g. harness {verb} examples/train/terse.yaml "
              f"(harness {verb} --show-config lists the keys)", file=sys.stderr)
        return 2
    try:
        # rl with offline.run: from_run; model.path a local directory (a Hub id: the cache, else downloaded) first
        cfg = load_config(args.config, overrides, "sft" if verb == "sft" else "rl", locate_model=True)
        mode = "sft" if verb == "sft" else "from_run" if cfg.offline.run else "rl"
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.backbone == "verl":  # verl's trainer on Ray, imported only when chosen
        from trainer.verl_backbone import main as verl_main

        return verl_main(cfg)
    from trainer.fsdp import launch, under_torchrun

    if cfg.trainer.fsdp.nprocs > 1 and not under_torchrun():
        if mode != "rl":  # bad data is said here, once, rather than by every rank under torchrun's report
            from trainer.offline import check_data

            if problem := check_data(cfg, mode):
                print(f"error: {problem}", file=sys.stderr)
                return 2
        argv = ["-m", "harness.cli", verb, str(args.config), *(f"--set={o}" for o in overrides)]
        return launch(cfg.trainer.fsdp.nprocs, argv)
    from harness.running.tasks import TaskError
    from trainer.chat_data import ChatDataError
    from trainer.checkpoint import ResumeError
    from trainer.offline_data import OfflineDataError
    from trainer.oom import TrainerOutOfMemory

    try:
        if mode == "rl":
            from trainer.loop import train

            train(cfg)
        else:
            from trainer.offline import train_offline

            train_offline(cfg, mode)
    except (TaskError, OfflineDataError, ChatDataError, ResumeError) as exc:  # bad data, found once the run reads it
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TrainerOutOfMemory as exc:  # settings too big for the device: what to lower, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
