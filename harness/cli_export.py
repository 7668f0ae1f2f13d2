"""`harness export --merge ADAPTER --out DIR`: a LoRA adapter merged into its base model, as a plain model directory
that transformers and vLLM load without peft (docs/training.md, LoRA)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def add_parser(verbs) -> None:
    p = verbs.add_parser(
        "export", help="write a trained LoRA adapter merged into its base model",
        description="Merge a LoRA adapter (a directory with adapter_config.json, e.g. <run>/adapters/v000012) into "
        "its base model and write a plain model directory (weights, config and tokenizer files) to --out.",
    )
    p.add_argument("--merge", type=Path, required=True, metavar="ADAPTER", help="the adapter directory")
    p.add_argument("--model", type=Path, help="the base model directory (default: the one the adapter names)")
    p.add_argument("--out", type=Path, required=True, help="where the merged model goes (must not exist)")
    p.set_defaults(func=main)


def main(args) -> int:
    adapter, out = args.merge, args.out
    config_path = adapter / "adapter_config.json"
    if not config_path.is_file():
        print(f"error: {str(adapter)!r} is not a LoRA adapter directory (no adapter_config.json): give one of "
              "<run>/adapters/v...", file=sys.stderr)
        return 2
    base = args.model or Path(json.loads(config_path.read_text()).get("base_model_name_or_path") or "")
    if not (base / "config.json").is_file():
        print(f"error: base model {str(base)!r} has no config.json: give the base model directory with --model",
              file=sys.stderr)
        return 2
    if out.exists():
        print(f"error: {str(out)!r} exists: give a new directory for the merged model", file=sys.stderr)
        return 2
    merge(adapter, base, out)
    print(f"merged {adapter} into {base}: {out}", file=sys.stderr)
    return 0


def merge(adapter: Path, base: Path, out: Path) -> Path:
    """Write base + adapter as one model directory: the base's config and tokenizer files with the merged weights
    (trainer.checkpoint.save_hf: built beside `out`, renamed into place when complete)."""
    from peft import PeftModel

    from trainer.checkpoint import save_hf
    from trainer.policy import load_policy

    model = PeftModel.from_pretrained(load_policy(base), str(adapter)).merge_and_unload()
    return save_hf(model.state_dict(), base, out)
