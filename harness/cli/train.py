"""`harness train` and `harness sft`: the verbs that update the policy.

    harness train config.yaml                     the closed RL loop (trainer/rl/loop.py), or with verl on Ray
    harness train config.yaml --from-run RUN      train on a recorded run, no rollouts (trainer/offline/loop.py)
    harness sft config.yaml                       supervised fine-tuning on chat records (trainer/offline/loop.py)
    harness train config.yaml --check             what the config amounts to, and what would stop it: nothing starts
    harness train config.yaml --show-config       every key's value in the config, beside its default

All read one config file (docs/training.md); torch is imported only once a config checked out.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.running.gpus import Gpus
    from trainer.config import TrainConfig
    from trainer.config.memory import MemoryPlan


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
    p.add_argument("--show-config", action="store_true", help="print every config key with its default and help; "
                   "with a config file, each key's value in it (its --set values applied) beside its default")
    p.add_argument("--check", action="store_true", help="check the config without training and print its plan: "
                   "the model (a directory, or a Hub id in the local cache: nothing is downloaded), the reply parsers "
                   "on its tokenizer, the GPU placement and memory plan; exit 0 when nothing stops it, 1 with the "
                   "problems. Starts no engine, agent or trainer")


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
    from trainer.config import ConfigError, load_config

    if args.show_config:
        shown = _show_config(args.config, overrides, verb)
        if shown or not args.check:
            return shown
    if args.config is None:
        print(f"error: give a config file, e.g. harness {verb} examples/train/terse.yaml "
              f"(harness {verb} --show-config lists the keys)", file=sys.stderr)
        return 2
    if args.check:
        return run_check(args.config, overrides, verb)
    try:
        # rl with offline.run: from_run; model.path a local directory (a Hub id: the cache, else downloaded) first
        cfg = load_config(args.config, overrides, "sft" if verb == "sft" else "rl", locate_model=True)
        mode = "sft" if verb == "sft" else "from_run" if cfg.offline.run else "rl"
    except ConfigError as exc:
        return _refused(exc.problems)
    if cfg.backbone == "verl":  # verl's trainer on Ray, imported only when chosen
        if problems := _bad_inputs(cfg, mode):
            return _refused(problems)
        from trainer.rl.verl_backbone import main as verl_main

        return verl_main(cfg)
    from trainer.model.fsdp import launch, under_torchrun

    if not under_torchrun() and (problems := _bad_inputs(cfg, mode)):  # once, not on every rank
        return _refused(problems)
    if cfg.trainer.fsdp.nprocs > 1 and not under_torchrun():
        if mode != "rl":  # bad data is said here, once, rather than by every rank under torchrun's report
            from trainer.offline.loop import check_data

            if problem := check_data(cfg, mode):
                print(f"error: {problem}", file=sys.stderr)
                return 2
        argv = ["-m", "harness.cli", verb, str(args.config), *(f"--set={o}" for o in overrides)]
        return launch(cfg.trainer.fsdp.nprocs, argv)
    from harness.running.judges import JudgeError
    from harness.running.tasks import TaskError
    from trainer.model.checkpoint import ResumeError
    from trainer.offline.chat_data import ChatDataError
    from trainer.offline.data import OfflineDataError
    from trainer.rl.oom import TrainerOutOfMemory

    try:
        if mode == "rl":
            from trainer.rl.loop import train

            train(cfg)
        else:
            from trainer.offline.loop import train_offline

            train_offline(cfg, mode)
    except (TaskError, JudgeError, OfflineDataError, ChatDataError, ResumeError) as exc:  # bad data or judge, found
        # once the run reads it (what _bad_inputs can't read up front: a service's tasks, a judge that fails later)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TrainerOutOfMemory as exc:  # settings too big for the device: what to lower, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _bad_inputs(cfg: TrainConfig, mode: str) -> list[str]:
    """The problems of the tasks and the judge, found before the policy is built or an engine starts (rather than
    minutes in, when step 1's rollouts would load the judge): what --check reads (harness/cli/inputs.py).
    Offline data is read by the offline loop itself before its model is built (and by the launcher of ranks)."""
    from harness.cli.inputs import check_inputs

    return check_inputs(cfg, mode, offline=False).problems


def _refused(problems: Sequence[str]) -> int:
    """Exit code 2, each problem one `error:` line on stderr."""
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------------------------------------------
# --show-config and --check


def _show_config(config: Path | None, overrides: Sequence[str], verb: str) -> int:
    from trainer.config import ConfigError, describe_config, read_config

    if config is None:
        if overrides:
            print(f"error: --set (and --from-run, --data) change a config file's values: give the file, e.g. "
                  f"harness {verb} examples/train/math.yaml --show-config --set ...", file=sys.stderr)
            return 2
        print(describe_config())
        return 0
    try:
        cfg = read_config(config, overrides)
    except ConfigError as exc:
        return _refused(exc.problems)
    print(f"# {config}{' with ' + ' '.join(overrides) if overrides else ''}: every key's value (paths resolved), "
          f"its type and default\n")
    print(describe_config(cfg=cfg))
    return 0


def run_check(config: Path, overrides: Sequence[str], verb: str = "train", gpus: Gpus | None = None) -> int:
    """`harness VERB CONFIG --check`: print what the config amounts to and its problems; 0 when there are none.
    The plan goes to stdout; a line on stderr says each phase before it starts (finding the model, building the
    reply parsers, reading the tasks...: together some seconds), so that the wait says what it waits for."""
    lines, problems = check_config(config, overrides, verb, gpus)
    print(f"harness {verb} {config} --check{''.join(f' --set {shlex.quote(o)}' for o in overrides)}")
    for line in lines:
        print(f"  {line}")
    if problems:
        print(f"\n{len(problems)} problem(s):")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print("\nok: nothing found that would stop it (nothing was started)")
    return 0


def check_config(config: Path, overrides: Sequence[str], verb: str = "train",
                 gpus: Gpus | None = None) -> tuple[list[str], list[str]]:
    """What `--check` finds: (the plan, as lines; the problems). The config is read with its overrides and checked
    as `harness VERB` would; the model located without downloading anything (a directory, or a Hub id's snapshot in
    the local cache); the reply parsers built on its tokenizer as the proxy builds them; the tasks, the judge and
    the offline data read as the run reads them first (harness/cli/inputs.py says which sources); the placement
    and memory plan computed on `gpus` (None: this machine's). Every problem found is listed, not just the first.
    Nothing is started and nothing is written."""
    from harness.cli.inputs import check_inputs, progress
    from harness.running.gpus import this_machine
    from trainer.config import ConfigError, read_config
    from trainer.config.checks import problems_of
    from trainer.config.memory import memory_plan

    progress(f"reading the config {config}")
    try:
        cfg = read_config(config, overrides)
    except ConfigError as exc:
        return [], exc.problems
    mode = "sft" if verb == "sft" else "from_run" if cfg.offline.run else "rl"
    serves = mode == "rl" or cfg.data.validation is not None
    lines = [f"config       {config}: harness {verb}{' --from-run' if mode == 'from_run' else ''}, experiment "
             f"{cfg.experiment_name}, backbone {cfg.backbone}"]
    problems: list[str] = []
    located = None
    if cfg.model.path:
        progress(f"locating the model {cfg.model.path}")
        try:
            located = _located(cfg.model.path, verb)
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=located))
        except ConfigError as exc:
            problems += exc.problems
    machine = this_machine() if gpus is None else gpus
    progress("the config's values, the GPUs and the memory plan")
    problems += [p for p in problems_of(cfg, config.name, mode, machine) if p not in problems]
    try:
        found = memory_plan(cfg, machine, serves)
    except ConfigError as exc:
        found = None
        problems += [p for p in exc.problems if p not in problems]
    if found is not None and found.shape is not None:
        s = found.shape
        lines.append(f"model        {cfg.model.path}: {_count(s.parameters)} parameters, hidden {s.hidden}, {s.layers} "
                     f"layers, MLP {s.intermediate}, KV {s.kv_dim}, vocabulary {s.vocab}")
    if located is not None and serves:
        progress("building the reply parsers on the model's tokenizer")
        lines.append(_parsers(cfg, located, problems))
    inputs = check_inputs(cfg, mode, model_here=located is not None, say=progress)
    lines += inputs.lines
    problems += [p for p in inputs.problems if p not in problems]
    if found is not None:
        lines += _plan_lines(cfg, found)
        if found.problem is not None and found.problem not in problems:
            problems.append(found.problem)
    return lines, problems


def _located(reference: str, verb: str) -> str:
    """model.path's directory, nothing downloaded: a model directory, or a Hub id's snapshot in the local cache."""
    from harness.running.hub import ModelNotFoundError, resolve_model
    from trainer.config import ConfigError

    try:
        return str(resolve_model(reference, "model.path", download=False))
    except ModelNotFoundError as exc:
        raise ConfigError(f"{exc} (harness {verb} downloads it when it starts; --check downloads nothing)") from None


def _parsers(cfg: TrainConfig, model_dir: str, problems: list[str]) -> str:
    """The reply parsers built as the proxy builds them, on the model's tokenizer: their line, or a problem."""
    from proxy.parsing import reply_parsing

    r = cfg.rollout
    names = f"rollout.tool_parser {r.tool_parser}, rollout.reasoning_parser {r.reasoning_parser or 'null'}"
    try:
        reply_parsing(r.tool_parser, r.reasoning_parser, model_dir)
    except (ValueError, TypeError, OSError) as exc:
        problems.append(f"the reply parsers ({names}) do not work with the model's tokenizer: {exc}")
        return f"parsers      {names}: do not work with the model's tokenizer"
    return f"parsers      {names}: built on the model's tokenizer"


def _plan_lines(cfg: TrainConfig, plan: MemoryPlan) -> list[str]:
    """The memory plan as --check prints it."""
    m, t, e = cfg.model, cfg.trainer, cfg.rollout.engine
    lines = []
    lora = f"LoRA rank {t.lora.rank} on {', '.join(t.lora.target_modules)}" if t.lora.rank else "LoRA off"
    weights = "bf16" if m.dtype in ("bfloat16", "float16") else "float32"
    lines.append(f"training     model.dtype {m.dtype} ({weights} weights, gradients and AdamW), {lora}, "
                 f"{t.fsdp.nprocs} rank(s)" + (", offloaded to CPU memory" if t.fsdp.param_offload
                                               or t.fsdp.optimizer_offload else ""))
    if cfg.backbone != "harness":
        return [*lines, "GPUs         backbone verl places its own workers (verl.*): no memory plan here"]
    if plan.placement is None:
        lines.append("GPUs         none visible on this machine: no placement and no GPU memory to check (run --check "
                     "where it will train)")
    else:
        lines.append(f"placement    {plan.placement.describe()}")
    if plan.trainer is None:
        return [*lines, f"memory       model.path {m.path!r} has no safetensors weights here to count: the memory "
                        "plan is not estimated"]
    tm, ckpt = plan.trainer, m.gradient_checkpointing
    lines.append(f"trainer      ~{_size(tm.peak)} per GPU: weights and AdamW ~{_size(tm.resident)}, gradients "
                 f"~{_size(tm.update)}")
    if plan.shape is not None:
        lines.append(f"activations  ~{_size(plan.activations)} for trainer.micro_batch_tokens {t.micro_batch_tokens} "
                     f"with model.gradient_checkpointing {str(ckpt).lower()} ({str(not ckpt).lower()}: "
                     f"~{_size(plan.activations_flipped)})")
    g = plan.gpu
    if g is None:
        if plan.placement is not None:
            lines.append("GPU memory   unknown (nvidia-smi did not say): not checked")
        return lines
    if g.engines:
        asleep = (f"asleep (rollout.engine.sleep {e.sleep}) ~{_size(g.engine_asleep)}" if e.sleep else
                  "all of it while the trainer updates too (rollout.engine.sleep 0)")
        kv = f" (bf16 weights ~{_size(2 * plan.shape.parameters)}, the rest KV cache)" if plan.shape else ""
        lines.append(f"engines      {g.engines} on the busiest trainer GPU, {g.share} of it each: "
                     f"~{_size(g.engine_awake)} while generating{kv}; {asleep}")
    lines += [f"GPU memory   {_size(g.total)} per GPU; the busiest trainer GPU holds",
              f"  while the engines generate  ~{_size(g.engine_awake)} engines + ~{_size(g.trainer.resident)} "
              f"trainer weights and AdamW = ~{_size(g.generating)}",
              f"  while the trainer updates   ~{_size(g.engine_asleep)} engines + ~{_size(g.trainer.peak)} trainer + "
              f"~{_size(g.activations)} activations = ~{_size(g.updating)}",
              f"  {'fits' if g.fits else 'does not fit'}: ~{_size(abs(g.total - g.worst))} "
              f"{'to spare (CUDA contexts, ~0.5-1 GiB a process, come out of it)' if g.fits else 'over'}"]
    return lines


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 10**9 else f"{n / 1e6:.1f}M"


def _size(n: int | float) -> str:
    return f"{n / 1024**3:.1f} GiB" if n >= 1024**3 else f"{n / 1024**2:.1f} MiB"
