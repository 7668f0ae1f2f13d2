"""`harness export --merge ADAPTER --out DIR`: a LoRA adapter merged into its base model, as a plain model directory
that transformers and vLLM load without peft (docs/training.md, LoRA)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


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
    """Write base + adapter as one model directory (built beside `out`, renamed into place when complete)."""
    from peft import PeftModel

    from trainer.policy import load_policy

    model = PeftModel.from_pretrained(load_policy(base), str(adapter)).merge_and_unload()
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in base.iterdir():  # tokenizer, chat template, generation config: as the base has them
        if f.is_file() and not f.name.endswith(_WEIGHTS) and not (tmp / f.name).exists():
            shutil.copy2(f, tmp / f.name)
    tmp.rename(out)
    return out
