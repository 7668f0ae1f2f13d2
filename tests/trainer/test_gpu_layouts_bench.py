"""bench/gpu_layouts.py, the GPU measurement of the trainer's layouts, runs end to end on this CPU on the tiny model
(`--shape tiny`), so the one command a GPU machine runs (bench/gpu_layouts.sh) is known to work before a GPU's time
is spent on it. Its numbers are not checked here (no timed tests); its counts are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_bench_runs_every_arm_on_the_tiny_model(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu_layouts.py"), "--shape", "tiny", "--words", "0.05",
                           "--steps", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    table = (tmp_path / "gpu_layouts.md").read_text()
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 10 and cells[0].startswith("("):
            rows[(cells[0][:3], cells[1])] = (int(cells[2].replace(",", "")), int(cells[3].replace(",", "")))
    assert set(rows) == {("(a)", "bare loop"), *((b, arm) for b in ("(a)", "(b)")
                                                 for arm in ("padded", "packed", "tree"))}, table
    for batch in ("(a)", "(b)"):
        tokens = {rows[(batch, arm)][0] for arm in ("padded", "packed", "tree")}
        assert len(tokens) == 1, (batch, rows)  # the same samples in every layout
        assert rows[(batch, "padded")][1] >= tokens.pop()
    # the GRPO-shaped batch shares its system prompt and task: the tree computes far fewer positions
    assert rows[("(b)", "tree")][1] * 2 < rows[("(b)", "padded")][1], rows
    assert "Goals: packed >= 0.9x the bare loop" in table
