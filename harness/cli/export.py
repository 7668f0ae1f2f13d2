"""`harness export`: what training produced or recorded, in the shapes other tools read.

    harness export --run RUN [--records chat|tokens] [--where SQL] --format jsonl|parquet|hf --out PATH
        recorded episodes as SFT chat records or RL token records (harness/store/export.py, docs/export.md)
    harness export --merge ADAPTER --out DIR
        a LoRA adapter merged into its base model: a plain model directory that transformers and vLLM load without
        peft (docs/training.md, LoRA); a run's <run>/adapter with several policies: DIR/<policy>, one model each
    harness retokenize --model DIR|HUB_ID [--run RUN]
        token ids for calls recorded as text only, marked as a tokenizer's (harness/store/retokenize.py)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness.cli import options
from harness.running.hub import local_model


def add_parser(verbs) -> None:
    from harness.store.export import EPISODE_COLUMNS, FORMATS, RECORDS

    p = verbs.add_parser(
        "export", help="recorded episodes as SFT or RL data; a LoRA adapter merged into its base model",
        description="With --run: a run's recorded episodes as training data, either chat records for supervised "
        "fine-tuning (messages and tools as TRL's SFT trainer reads them; each assistant message has weight 1 "
        "if the model gave it, 0 if the agent wrote it) or token records for RL (the engine's ids, loss mask, "
        "logprobs, reward and GRPO advantage); docs/export.md. With --merge: a LoRA adapter (e.g. "
        "<run>/adapters/v000012) merged into its base model, written as a plain model directory. With --checkpoint: a "
        "training checkpoint as a plain model directory.",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--run", metavar="RUN", help="the run whose episodes to export (harness sql \"SELECT DISTINCT "
                      "run_id FROM episode_summary\")")
    what.add_argument("--merge", type=Path, metavar="ADAPTER", help="the LoRA adapter directory to merge")
    what.add_argument("--checkpoint", type=Path, metavar="CKPT", help="a full-weight checkpoint of harness train "
                      "(<run>/checkpoints/step_<k>) to write as a plain model directory")
    p.add_argument("--out", type=Path, required=True, help="the file (or, for --format hf and --merge, the "
                   "directory) to write; must not exist")
    p.add_argument("--db", type=Path, default=options.DEFAULT_RUN_DIR / "harness.duckdb",
                   help="with --run: the DuckDB file, or a folder of them read as one (default: %(default)s)")
    p.add_argument("--records", choices=RECORDS, default="chat",
                   help="chat: one record per conversation (SFT); tokens: one per merged sample (RL)")
    p.add_argument("--format", choices=FORMATS, default="jsonl", dest="fmt",
                   help="jsonl (default), parquet, or hf (a datasets directory; needs the data extra)")
    p.add_argument("--where", metavar="SQL", help="keep the episodes this SQL predicate holds for, e.g. "
                   "'reward >= 1'; columns: " + ", ".join(EPISODE_COLUMNS))
    p.add_argument("--model", help="with --merge: the base model, a directory or a Hugging Face id (default: the "
                   "one the adapter names); with --checkpoint: the run's model.path (default: the one its "
                   "config.resolved.yaml names)")
    p.set_defaults(func=main)


def main(args) -> int:
    if args.out.exists():
        print(f"error: {str(args.out)!r} exists: give a new path with --out", file=sys.stderr)
        return 2
    if not args.out.parent.is_dir():
        print(f"error: --out {str(args.out)!r}: its folder does not exist; create it first", file=sys.stderr)
        return 2
    if args.merge is not None:
        return _merge_main(args)
    if args.checkpoint is not None:
        return _checkpoint_main(args)
    from harness.store.export import ExportError, records, write
    from harness.store.sql import Reader, SqlError

    try:
        with Reader(args.db) as reader:
            count = write(records(reader, args.run, args.records, args.where), args.out, args.fmt)
    except (ExportError, SqlError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{count} {args.records} records of run {args.run} -> {args.out}", file=sys.stderr)
    return 0


def _merge_main(args) -> int:
    adapter, out = args.merge, args.out
    config_path = adapter / "adapter_config.json"
    entries = sorted(adapter.iterdir()) if adapter.is_dir() and not config_path.is_file() else []
    policies = entries if entries and all((d / "adapter_config.json").is_file() for d in entries) else []
    if policies:  # a run of several policies (roles.policies): <run>/adapter/<policy>/ alone, one model each
        out.mkdir()
        for one in policies:
            code = _merge_main(argparse.Namespace(**{**vars(args), "merge": one, "out": out / one.name}))
            if code:
                return code
        return 0
    if not config_path.is_file():
        print(f"error: {str(adapter)!r} is not a LoRA adapter directory (no adapter_config.json): give one of "
              "<run>/adapters/v..., or a run's <run>/adapter (with several policies: one model each)",
              file=sys.stderr)
        return 2
    named = json.loads(config_path.read_text()).get("base_model_name_or_path")
    if args.model is None and not named:
        print(f"error: {str(config_path)!r} names no base model (base_model_name_or_path): give it with --model",
              file=sys.stderr)
        return 2
    try:  # the adapter's own reference was written by peft as given: a path (from its cwd) or a Hub id
        base = local_model(*(args.model, "--model") if args.model else (named, f"{config_path}'s base model"))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    merge(adapter, base, out)
    print(f"merged {adapter} into {base}: {out}", file=sys.stderr)
    return 0


def _checkpoint_main(args) -> int:
    import yaml

    from trainer.model.checkpoint import checkpoint_model

    if not args.checkpoint.is_dir():
        what = "is not a directory" if args.checkpoint.exists() else "does not exist"
        print(f"error: --checkpoint {str(args.checkpoint)!r} {what}: give a checkpoint directory of harness train, "
              "<run>/checkpoints/step_<k>", file=sys.stderr)
        return 2
    resolved = args.checkpoint.resolve().parent.parent / "config.resolved.yaml"
    named = None
    if args.model is None and resolved.is_file():
        named = ((yaml.safe_load(resolved.read_text()) or {}).get("harness") or {}).get("model", {}).get("path")
    if args.model is None and not named:
        print(f"error: no base model for {str(args.checkpoint)!r}: give the run's model.path with --model (looked "
              f"for {str(resolved)!r})", file=sys.stderr)
        return 2
    try:
        base = local_model(args.model, "--model") if args.model else local_model(named, f"{resolved}'s model.path")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        out = checkpoint_model(args.checkpoint, base, args.out)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"checkpoint {args.checkpoint} with {base}'s config: {out}", file=sys.stderr)
    return 0




def merge(adapter: Path, base: Path, out: Path) -> Path:
    """Write base + adapter as one model directory: the base's config and tokenizer files with the merged weights
    (trainer.model.checkpoint.save_hf: built beside `out`, renamed into place when complete)."""
    from peft import PeftModel

    from trainer.model.checkpoint import save_hf
    from trainer.model.policy import load_policy

    model = PeftModel.from_pretrained(load_policy(base), str(adapter)).merge_and_unload()
    return save_hf(model.state_dict(), base, out)


def add_retokenize_parser(verbs) -> None:
    p = verbs.add_parser(
        "retokenize", help="token ids for calls recorded as text only, marked as retokenized",
        description="Give the calls recorded as text only (token_source 'none': in front of a hosted API, or an "
        "engine that returned no ids) token ids from a model's tokenizer and chat template: prompt ids as the "
        "template renders the request, completion ids as it renders the answer. They are marked token_source "
        "'retokenized', never taken for the engine's own: they stay out of RL samples. Stop the proxy first. "
        "docs/export.md.",
    )
    p.add_argument("--model", required=True, help="the model whose tokenizer and chat template to use (the model "
                   "the calls are meant to train): a directory or a Hugging Face id")
    p.add_argument("--db", type=Path, default=options.DEFAULT_RUN_DIR / "harness.duckdb",
                   help="the DuckDB file (default: %(default)s)")
    p.add_argument("--run", help="only this run's calls (default: every text-only call in the file)")
    p.set_defaults(func=_retokenize_main)


def _retokenize_main(args) -> int:
    import duckdb

    from harness.store.database import SchemaVersionError
    from harness.store.retokenize import retokenize_database

    if not args.db.is_file():  # before the model, which may be a download
        print(f"error: no database at {str(args.db)!r}: give --db", file=sys.stderr)
        return 2
    try:
        model = local_model(args.model, "--model", files="tokenizer")  # retokenizing reads the tokenizer only
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not (model / "tokenizer_config.json").is_file():
        print(f"error: --model {args.model!r} has no tokenizer_config.json: give a model directory with its "
              "tokenizer", file=sys.stderr)
        return 2
    try:
        done = retokenize_database(args.db, model, args.run)
    except (ValueError, SchemaVersionError, duckdb.Error) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    skipped = ", ".join(f"{n} ({why})" for why, n in done.skipped.items()) or "none"
    print(f"retokenized {done.calls} calls ({done.choices} choices) with {model}; left as text: {skipped}",
          file=sys.stderr)
    return 0
