"""Which proxy holds a database open: DuckDB lets one process hold a file, so a running proxy announces itself.

The run-info file `<db>.proxy.json` (mode 0600: it holds the admin token) says where the proxy that records into
`<db>` listens; `harness sql` and the viewer then read through its read-only SQL route, and `harness merge` refuses
to write under it. The proxy writes and removes the file (proxy/server.py); everyone else reads it here.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path


def info_path(db_path: str | Path) -> Path:
    db_path = Path(db_path)
    return db_path.with_name(db_path.name + ".proxy.json")


def write_info(db_path: str | Path, info: dict) -> None:
    """Announce a proxy that records into `db_path` (readable by this user only)."""
    fd = os.open(info_path(db_path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)


def discover(db_path: str | Path, timeout_s: float = 2.0) -> dict | None:
    """The live proxy that owns `db_path`, or None if none answers."""
    path = info_path(db_path)
    try:
        info = json.loads(path.read_text())
        with urllib.request.urlopen(info["url"] + "/health", timeout=timeout_s) as resp:
            health = json.loads(resp.read())
    except (OSError, ValueError, KeyError):
        return None
    return info if health.get("run_id") == info.get("run_id") else None
