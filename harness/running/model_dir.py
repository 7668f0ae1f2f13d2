"""A model directory written whole: built in a temporary folder beside its place and renamed into it once
complete, so a reader (vLLM, transformers) finds the old directory or the new one, and a failed build leaves
nothing half-written behind."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_model_dir(out_dir: str | Path, write: Callable[[Path], None]) -> Path:
    """Call `write(folder)` on a fresh folder beside `out_dir`, then put it in `out_dir`'s place (an existing one is
    replaced only then); return `out_dir`."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        write(work)
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out
